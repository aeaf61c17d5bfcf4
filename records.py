"""What a rollout produced, as typed records: each sample (`Sample`: its prompt, its response
tokens and the engine's logprob of each) and a step's rollout (`Rollout`: the samples and what
the reward phase made of them, with the rollout's part of the step's metrics). The engine
(rollout.py) and the episodes (episodes.py) make them; grpo.py trains on them.

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

    @property
    def model_tokens(self) -> int:
        return len(self.response_ids) if self.mask is None else sum(self.mask)


@dataclass
class Rollout:
    """One step's samples and what the reward phase made of them. Lists over samples are
    prompt-major (the G samples of a prompt are consecutive), lists over groups have one entry
    per prompt. Every rank of an engine group holds the same rollout."""

    samples: list[Sample] = field(default_factory=list)
    examples: list[dict] = field(default_factory=list)  # each sample's dataset row
    texts: list[str] = field(default_factory=list)  # each sample's decoded response
    scores: list[float] = field(default_factory=list)  # the reward functions' weighted sum
    adv: list[float] = field(default_factory=list)  # advantage within its group (after shaping)
    by_name: dict[str, list[float]] = field(default_factory=dict)  # each function, per sample
    constant: list[bool] = field(default_factory=list)  # per group: all rewards equal, no signal
    keep: list[bool] = field(default_factory=list)  # per group: may go into the update
    # per sample: out of the loss, its environment or a reward call having failed (env.on_failure)
    dropped: list[bool] = field(default_factory=list)
    errors: int = 0  # reward calls that failed (scored 0)
    timeouts: int = 0  # reward calls cut at reward.timeout_s (scored 0)
    rounds: int = 0  # generation rounds (dynamic sampling draws fresh prompts)
    trained: list[int] = field(default_factory=list)  # the samples the update takes
    # episodes (episodes.py), per sample: model turns, whether the environment failed or was
    # cut (scored 0), whether a limit (turns, tokens) ended it; and the environment's counts
    turns: list[int] = field(default_factory=list)
    failed: list[bool] = field(default_factory=list)
    limited: list[bool] = field(default_factory=list)
    env_errors: int = 0
    env_timeouts: int = 0
    env_seconds: float = 0.0

    def extend(self, other: "Rollout") -> None:
        """Append another round's samples and counts."""
        for name in ("samples", "examples", "texts", "scores", "adv", "constant", "keep", "turns",
                     "failed", "limited", "dropped"):
            getattr(self, name).extend(getattr(other, name))
        for name, values in other.by_name.items():
            self.by_name.setdefault(name, []).extend(values)
        for name in ("errors", "timeouts", "rounds", "env_errors", "env_timeouts", "env_seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def completions(self) -> list:
        """What samples.jsonl shows of each sample: its text, or an episode's conversation."""
        return [ex.get("conversation", text) for ex, text in zip(self.examples, self.texts)]

    def metrics(self, groups_trained: int, tp_rank: int, tp: int, env: bool) -> dict:
        """The rollout's part of the step's metrics (tracking.reduce): each generated sample
        counted once over its engine group's ranks (rank tp_rank takes every tp-th), and each
        count of the engine group once."""
        share = [self.samples[i] for i in range(tp_rank, len(self.samples), tp)]
        n, first = len(share), int(tp_rank == 0)
        response = sum(s.model_tokens for s in share)  # an episode's: the model's turns
        m = {"reward_mean": Mean(sum(self.scores[tp_rank::tp]), n),
             "response_len_mean": Mean(response, n),
             "truncated_frac": Mean(sum(s.truncated for s in share), n),
             "reward_errors": Sum(first * self.errors),
             "reward_timeouts": Sum(first * self.timeouts),
             "groups_constant": Sum(first * sum(self.constant)),
             "groups_trained": Sum(first * groups_trained),
             "samples_trained": Sum(first * len(self.trained)),
             "samples_dropped": Sum(first * sum(self.dropped)),
             "tokens": Sum(sum(len(s.prompt_ids) + len(s.response_ids) for s in share))}
        if len(self.by_name) > 1:  # each reward function's mean, beside their weighted sum
            m.update({f"reward/{name}": Mean(sum(v[tp_rank::tp]), n)
                      for name, v in self.by_name.items()})
        if env:  # episodes: model turns, the environment's time (this rank's), failures, limits
            m.update(turns_mean=Mean(sum(self.turns[tp_rank::tp]), n),
                     env_time_s=self.env_seconds, env_errors=Sum(first * self.env_errors),
                     env_timeouts=Sum(first * self.env_timeouts),
                     limited_frac=Mean(sum(self.limited[tp_rank::tp]), n))
        return m
