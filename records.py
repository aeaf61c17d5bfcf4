"""What a rollout produced, as typed records: each sample (`Sample`: its prompt, its response
tokens and the engine's logprob of each), what the episodes made of a batch of prompts
(`Generated`), what the reward functions made of it (`Rewards`), and a step's rollout (`Rollout`:
all of it, with the rollout's part of the step's metrics). The engine (rollout.py) and the
episodes (episodes.py) make samples; the sampler (sampler.py) puts a step's rollout together,
once, in `Rollout.join`; grpo.py scores it and trains on it.

A leaf module, near enough: it imports only tracking's metric types.
"""

from dataclasses import dataclass, field

from tracking import Mean, Sum


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]  # all that follows the prompt (in an episode: every turn and reply)
    logp: list[float]  # the engine's logprob of each response token (post-temperature; 0 where
    #   the environment wrote it)
    truncated: bool  # stopped at max_new_tokens, not at EOS (an episode: stopped at a limit)
    mask: list[int] | None = None  # 1 where the model wrote the token, 0 where the environment
    #   did (episodes.py); None: every response token is the model's
    versions: list[int] | None = None  # partial rollout (partial.py): the weights version (steps
    #   trained) that wrote each response token; None: all this step's
    routing: object = None  # model.routing_replay: the engine's experts at each position but the
    #   last, an array (prompt + response - 1, layers, k) (moe.given_routing); None: none
    earlier: list | None = None  # an agent's episode (agents.py): its other samples (calls
    #   that did not extend this one's tokens), trained with this one's advantage (with_earlier)
    vision: object = None  # images in the prompt: a vision.Vision (their patches, grids and the
    #   prompt's multimodal positions); None: a text prompt

    @property
    def model_tokens(self) -> int:
        return len(self.response_ids) if self.mask is None else sum(self.mask)


def with_earlier(samples: list, adv):
    """`samples` with each one's earlier samples (Sample.earlier) before it, and `adv` (a (n,)
    tensor) repeated to match: every sample of an agent's episode trains with its advantage."""
    if not any(s.earlier for s in samples):
        return samples, adv
    idx = [i for i, s in enumerate(samples) for _ in range(1 + len(s.earlier or ()))]
    return [x for s in samples for x in (*(s.earlier or ()), s)], adv[idx]


def shown(examples: list[dict], texts: list[str]) -> list:
    """What samples.jsonl shows of each sample: its text, or an episode's conversation."""
    return [ex.get("conversation", text) for ex, text in zip(examples, texts)]


# why the agents' endpoint refused a call (agents.Serving): a call for no episode of the rollout
#   (a made-up or stale base URL), one after its agent returned, one the endpoint cannot serve
#   (its fields, or messages the chat template refuses), one past env.max_turns or
#   env.max_tokens, one whose completion env.tool_parser failed on
REFUSALS = ("no_episode", "after_return", "bad_request", "limit", "tool_parser")


@dataclass
class EnvCalls:
    """An environment's calls, counted: those that raised, those cut at env.timeout_s, and the
    seconds this rank waited for them."""
    errors: int = 0
    timeouts: int = 0
    seconds: float = 0.0
    calls: int = 0  # an agent's calls of the endpoint (agents.py)
    rewrites: int = 0  # of those, the ones that started a new sample of their episode
    refused: dict = field(default_factory=dict)  # an agent's calls refused, by REFUSALS kind
    episodes: int = 0  # agents' episodes that returned
    tool_calls: int = 0  # the tool calls the model wrote in them (env.tool_parser's)
    tool_episodes: int = 0  # those episodes with at least one

    def __add__(self, other: "EnvCalls") -> "EnvCalls":
        refused = {k: self.refused.get(k, 0) + other.refused.get(k, 0)
                   for k in {**self.refused, **other.refused}}
        return EnvCalls(self.errors + other.errors, self.timeouts + other.timeouts,
                        self.seconds + other.seconds, self.calls + other.calls,
                        self.rewrites + other.rewrites, refused, self.episodes + other.episodes,
                        self.tool_calls + other.tool_calls,
                        self.tool_episodes + other.tool_episodes)


@dataclass
class Generated:
    """Finished episodes of a batch of prompts, prompt-major (the G of a prompt consecutive)."""
    samples: list[Sample]
    examples: list[dict]  # each sample's dataset row (with "conversation" when an env ran)
    texts: list[str]  # each sample's last model turn, decoded
    turns: list[int]  # model turns
    failed: list[bool]  # its environment failed or was cut (scored 0)
    limited: list[bool]  # a limit (turns, tokens) ended it
    env: EnvCalls = field(default_factory=EnvCalls)  # the environment calls that made them


@dataclass
class Rewards:
    """The reward functions' answer for each sample of a Generated (rewards.Scorer.score)."""
    total: list[float]  # the functions' weighted sum (0 for a sample whose episode failed)
    by_name: dict[str, list[float]]  # each function's own value
    failed: list[bool]  # one of its calls raised or was cut (that call scores 0)
    errors: int = 0  # calls that raised
    timeouts: int = 0  # calls cut at reward.timeout_s


@dataclass
class Rollout:
    """One step's samples and their rewards, each list prompt-major over samples, or one entry
    per group (prompt) or per engine group where it says so. Every rank of an engine group holds
    the same rollout. Made by `join`, read by everything after."""

    samples: list[Sample]
    examples: list[dict]
    texts: list[str]
    turns: list[int]
    env_failed: list[bool]
    limited: list[bool]
    rewards: list[float]
    by_name: dict[str, list[float]]
    reward_failed: list[bool]
    dropped: list[bool]  # out of the loss: a failed environment or reward call (grpo.judge)
    keep: list[bool]  # per group: may go into the update (dynamic sampling drops the constant)
    kept: list[int]  # per engine group: its groups kept
    env: EnvCalls  # the environment calls of the step
    reward_errors: int
    reward_timeouts: int
    rounds: int  # generation rounds
    seconds: dict  # {"gen": generating, "reward": scoring}

    @classmethod
    def join(cls, pieces: list, kept: list[int], env: EnvCalls, rounds: int,
             seconds: dict) -> "Rollout":
        """The rollout of `pieces`, [(Generated, Rewards, dropped per sample, keep per group)]
        in order (grpo.judge's)."""
        gen = [g for g, *_ in pieces]
        rew = [r for _, r, *_ in pieces]
        names = rew[0].by_name if rew else {}
        return cls(samples=[s for g in gen for s in g.samples],
                   examples=[x for g in gen for x in g.examples],
                   texts=[t for g in gen for t in g.texts], turns=[t for g in gen for t in g.turns],
                   env_failed=[f for g in gen for f in g.failed],
                   limited=[x for g in gen for x in g.limited],
                   rewards=[x for r in rew for x in r.total],
                   by_name={n: [x for r in rew for x in r.by_name[n]] for n in names},
                   reward_failed=[f for r in rew for f in r.failed],
                   dropped=[d for *_, dropped, _ in pieces for d in dropped],
                   keep=[k for *_, keep in pieces for k in keep], kept=list(kept), env=env,
                   reward_errors=sum(r.errors for r in rew),
                   reward_timeouts=sum(r.timeouts for r in rew), rounds=rounds,
                   seconds=dict(seconds))

    def completions(self) -> list:
        return shown(self.examples, self.texts)

    def metrics(self, group, env: bool, agent: bool = False) -> dict:
        """The rollout's part of the step's metrics (tracking.reduce): each generated sample
        counted once over its engine group's ranks (rank tp_rank takes every size-th), and each
        count of the engine group once (its first rank). group: rollout.EngineGroup."""
        tp_rank, tp, first = group.tp_rank, group.size, int(group.first)
        share = [self.samples[i] for i in range(tp_rank, len(self.samples), tp)]
        n = len(share)
        response = sum(s.model_tokens for s in share)  # an episode's: the model's turns
        m = {"reward_mean": Mean(sum(self.rewards[tp_rank::tp]), n),
             "response_len_mean": Mean(response, n),
             "truncated_frac": Mean(sum(s.truncated for s in share), n),
             "reward_errors": Sum(first * self.reward_errors),
             "reward_timeouts": Sum(first * self.reward_timeouts),
             "tokens": Sum(sum(len(s.prompt_ids) + len(s.response_ids) for s in share))}
        if len(self.by_name) > 1:  # each reward function's mean, beside their weighted sum
            m.update({f"reward/{name}": Mean(sum(v[tp_rank::tp]), n)
                      for name, v in self.by_name.items()})
        if env:  # episodes: model turns, the environment's time (this rank's), failures, limits
            m.update(turns_mean=Mean(sum(self.turns[tp_rank::tp]), n),
                     env_time_s=self.env.seconds, env_errors=Sum(first * self.env.errors),
                     env_timeouts=Sum(first * self.env.timeouts),
                     limited_frac=Mean(sum(self.limited[tp_rank::tp]), n))
        if agent:  # the agents' calls, the share that started a new sample of an episode, and
            #   the tool calls the model wrote: per episode, and the share of episodes with one
            env, eps = self.env, first * self.env.episodes
            m.update(agent_calls=Sum(first * env.calls),
                     agent_rewrite_frac=Mean(first * env.rewrites, first * env.calls),
                     agent_tool_calls=Mean(first * env.tool_calls, eps),
                     agent_tool_frac=Mean(first * env.tool_episodes, eps))
            m.update({f"agent_refused/{kind}": Sum(first * self.env.refused.get(kind, 0))
                      for kind in REFUSALS})  # (every kind, every step: reduce's names agree)
        return m
