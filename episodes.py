"""Multi-turn rollouts: the model acts, an environment answers, the loss sees only the model's
tokens.

With an environment named in `env.name` (envs.py says what one is), each sample of a rollout is
an episode. Turn 1 samples `group_size` responses per prompt, as a single-turn rollout does.
Then, turn after turn, the environment answers every unfinished episode at once (in worker
processes, each call with a time limit: plugins.Worker; on the first rank of each engine group
only, which hands the replies to the group's other ranks: rollout.EngineGroup), each reply is
appended as tokens (through the tokenizer's chat template with data.chat_template, in the role
the template gives it, its content as text; else as plain text), and the engine generates the
next turn of every unfinished episode in one call, each with its whole token history as the
prompt (its prefix cache keeps their KV). An episode
ends when the environment says so, or at a limit: env.max_turns model turns, or a reply and a
next turn that would take its tokens after the prompt past env.max_tokens (it then ends after
its last whole turn). Each turn stops at rollout.max_new_tokens or at the episode's room.

The sample of an episode is its prompt and all that follows it, the model's turns and the
replies in order, with `mask` 1 on the model's tokens (records.Sample): the loss, the importance
weights, the KL term, every token mean and the mismatch metric see those only. The rewards score
the last model turn, and see the whole conversation as example["conversation"] (from the
system prompt and the prompt with its suffix, as the model saw them). An environment call that
fails or is cut ends its episode, which is counted and, with env.on_failure "drop", left out of
the loss. The first episode of a run with a reply is checked against the chat template's
rendering of its whole conversation (Replies.check), and a difference is logged once.
"""

import logging
import time
from dataclasses import dataclass
from typing import Annotated

from collect import envs, sandbox
from modeling import vision
import plugins
import records
import rollout
from config import FLAG, Anything, OneOf, Range, need

log = logging.getLogger("grpo")


@dataclass
class EnvConfig:
    LIVE = ()  # between steps (train_grpo.configure): none, its runner is built of them
    # "" = one turn per sample; else a built-in (envs.ENVS), mod:fn or file.py:fn; with kind
    #   agent, the agent: an `async def` mod:fn or file.py:fn (envs.AGENT_SIGNATURE)
    name: Annotated[str, Anything("validate resolves it", refused=("nope",))] = ""
    # "function": the trainer calls `name` after each model turn (envs.py); "agent": `name` is
    #   an agent that calls an OpenAI-compatible endpoint over the engine (agents.py)
    kind: Annotated[str, OneOf("function", "agent")] = "function"
    # kind agent: how the model's text becomes tool_calls: a built-in (envs.TOOL_PARSERS: hermes,
    #   Qwen's <tool_call>{json}</tool_call>), mod:fn or file.py:fn
    tool_parser: Annotated[str, Anything("validate resolves it", refused=("nope",))] = "hermes"
    max_turns: Annotated[int, Range(1)] = 2  # model turns per episode
    # tokens after the prompt (model and environment); each turn also stops at
    #   rollout.max_new_tokens
    max_tokens: Annotated[int, Range(1)] = 256
    timeout_s: Annotated[float, Range(0)] = 10.0  # one environment call's limit; 0: in-process
    # worker processes that call a plain function at once (a call each); ignored with timeout_s 0.
    #   0: 16 per CPU of this rank, 2 to 32 (plugins.default_workers; the start-up log says how
    #   many); 1: one call at a time, in order (to debug)
    workers: Annotated[int, Range(0)] = 0
    # calls of an `async def` environment in flight at once, in one worker's event loop
    concurrency: Annotated[int, Range(1)] = 64
    # a sample whose environment failed or was cut, or one of whose reward calls raised or timed
    #   out: "drop" = out of the loss (its group's advantages computed without it, counted in
    #   samples_dropped); "zero" = trained with reward 0, as any other sample
    on_failure: Annotated[str, OneOf("drop", "zero")] = "drop"
    # the chat role of a reply given as text ("tool" for a tool's)
    reply_role: Annotated[str, Anything("any role the tokenizer's chat template renders")] = "user"
    # name "python": run it although the host lacks file or network isolation for the model's
    #   code (sandbox.missing() names what is missing; the run says it at start-up)
    unsafe_ok: Annotated[bool, FLAG] = False

    def check(self, cfg, world_size: int) -> None:
        """The section against the run (config.validate calls it): an agent's reward and the
        rounds its step takes, then the section itself (`validate`)."""
        if self.kind == "agent":
            need("agent" in cfg.reward.funcs, f"env.kind=agent with reward.funcs="
                 f"{cfg.reward.funcs}: the agent's returned reward is the reward named `agent`. "
                 "Fix: add agent to reward.funcs, e.g. reward.funcs=[agent]")
            p = cfg.rollout.partial
            need(not p.enabled or p.round_tokens == 0, "env.kind=agent with rollout.partial."
                 f"round_tokens={p.round_tokens}: an agent's step ends when enough of its groups "
                 "have returned, not at a token budget. Fix: rollout.partial.round_tokens=0 and "
                 "rollout.partial.oversample > 1")
        validate(self, cfg.data.max_prompt_len, cfg.rollout.max_model_len)


def validate(cfg: EnvConfig, max_prompt_len: int, max_model_len: int) -> None:
    """Check the `env:` section before any model loads (the environment resolves here). Raises
    a one-line ValueError naming the field."""
    envs.resolve_tool_parser(cfg.tool_parser)  # (a typo fails whatever the kind)
    if not cfg.name:
        if cfg.kind == "agent":
            raise ValueError("env.kind=agent with no env.name: name the agent. Fix: "
                             "env.name=path/to/file.py:agent")
        return
    if cfg.kind == "agent":  # an async def
        envs.resolve_agent(cfg.name)
    elif envs.resolve(cfg.name) is envs.python_tool:  # (each field's range: its domain, checked
        #   by config.validate) the model's code: no run without file and network isolation
        for gone in sandbox.check(cfg.unsafe_ok):  # (unless env.unsafe_ok), the rest said here
            log.warning("env python: the sandbox of the model's code lacks %s", gone)
    if max_prompt_len + cfg.max_tokens > max_model_len:
        raise ValueError(f"data.max_prompt_len + env.max_tokens must be <= rollout.max_model_len "
                         f"({max_prompt_len} + {cfg.max_tokens} > {max_model_len})")


class Replies:
    """How a reply becomes tokens after a model turn. With a chat template: what the template puts
    after an assistant turn (less what the model's own stop token wrote of it), the reply as the
    template renders a message of its role, and the template's opening of the next assistant
    turn. Plain text otherwise: the reply's tokens, as they are. The reply's content is always
    tokenized as text: a special token's spelling in it (a tool that prints `<|im_end|>`) stays
    text and forges no turn boundary."""

    MARK, TURN = "\x1e", "\x1d"  # stand for a reply's content and a model turn's

    def __init__(self, tokenizer, chat_template: bool, role: str):
        self.tokenizer, self.chat, self.role = tokenizer, chat_template, role
        # what comes before the reply: a system turn (without one, some templates add a default
        # system prompt), a user turn (some refuse a conversation without one: Qwen3's) and the
        # model's turn, whose end marks where the reply's tokens start
        self.prefix = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"},
                       {"role": "assistant", "content": self.TURN}]

    def render(self, messages: list[dict], generation_prompt: bool = False,
               tools: list | None = None) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, tools=tools,
                                                  add_generation_prompt=generation_prompt)

    def message(self, reply: dict) -> dict:
        """An environment's reply (envs.as_reply) as a chat message: role None -> env.reply_role."""
        return {"role": reply["role"] or self.role, "content": reply["content"]}

    def encode(self, text: str, as_text: bool = False) -> list[int]:
        """as_text: a special token's spelling in `text` stays text; else the template's own
        special tokens count."""
        return self.tokenizer(text, add_special_tokens=False,
                              split_special_tokens=as_text)["input_ids"]

    def tokens(self, messages: list[dict], last_token: int | None) -> list[int]:
        """The tokens that follow a model turn which ended with `last_token` (its stop token;
        None for a turn cut at its length limit): the chat `messages` (self.message), each one's
        content as text, and with a template the turn boundaries around them, with their special
        tokens, up to the opening of the next assistant turn (consecutive messages rendered
        together: a template may join them, as Qwen's joins tool outputs into one turn)."""
        if not self.chat:
            return [t for m in messages for t in self.encode(m["content"], as_text=True)]
        full = self.render(self.prefix + [{**m, "content": self.MARK} for m in messages],
                           generation_prompt=True)
        if full.count(self.MARK) != len(messages) or full.count(self.TURN) != 1:
            raise ValueError("the chat template renders a message's content other than once, "
                             f"as is (roles {[m['role'] for m in messages]}): env.reply_role or "
                             "the template")
        pieces = full[full.index(self.TURN) + 1:].split(self.MARK)
        stop = "" if last_token is None else self.tokenizer.decode([last_token])
        if stop and pieces[0].startswith(stop):  # the model wrote the end of its turn itself
            pieces[0] = pieces[0][len(stop):]
        ids = self.encode(pieces[0])
        for m, after in zip(messages, pieces[1:]):
            ids += self.encode(m["content"], as_text=True) + self.encode(after)
        return ids

    def check(self, ids: list[int], messages: list[dict], tools: list | None = None) -> str | None:
        """None if `ids` (an episode's prompt and all after it) spell what the chat template
        renders for its whole conversation `messages`, else where they first differ. Templates
        may render a conversation otherwise than turn by turn (Qwen3's drops the `<think>` part
        of model turns before the last user turn): then the model is trained on a context that
        differs from the one the template would give it. Compared as text, decoded with the
        special tokens: a model turn's own tokens need not be the ones its text encodes to."""
        ours = self.tokenizer.decode(ids, skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)
        want = self.render(messages, tools=tools)  # after a last model turn that stopped: the
        #   template's end
        n = min(len(ours), len(want))
        i = next((i for i in range(n) if ours[i] != want[i]), n)
        if i == len(ours):  # the episode is what the template renders, up to its end
            return None
        lo, hi = 0, len(ids)  # the first token whose text reaches position i
        while lo < hi:
            mid = (lo + hi) // 2
            text = self.tokenizer.decode(ids[:mid + 1], skip_special_tokens=False,
                                         clean_up_tokenization_spaces=False)
            lo, hi = (mid + 1, hi) if len(text) <= i else (lo, mid)
        return (f"token {lo} (character {i}): the episode has {ours[i:i + 40]!r}, the template "
                f"renders {want[i:i + 40]!r}")


class Episode:
    """One episode as it grows: its tokens after the prompt, which of them the model wrote, the
    engine's logprobs of those and the weights version that wrote each, and the conversation
    (chat messages) for the environment and the rewards. With partial rollout (partial.py) a
    turn can stop at a round's end and go on in a later step: `pending` holds what it wrote so
    far (ids, logp, versions), `limit` its room in tokens."""

    def __init__(self, example: dict, prompt_key: str, tokenizer, limit: int):
        # the conversation the model saw (data.load_examples: system prompt, suffix), else the
        # row's own prompt
        prompt = example.get("prompt_messages", example[prompt_key])
        self.example, self.prompt_ids, self.tokenizer = example, example["prompt_ids"], tokenizer
        self.messages = ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
                         else [dict(m) for m in prompt])
        self.ids, self.mask, self.logp, self.versions = [], [], [], []
        self.turns, self.over, self.limited, self.failed = 0, False, False, False
        self.pending, self.limit, self.last = ([], [], []), limit, None

    def add_turn(self, s: records.Sample, versions: list[int] | None = None) -> None:
        self.ids += s.response_ids
        self.mask += [1] * len(s.response_ids)
        self.logp += list(s.logp)
        self.versions += versions or [0] * len(s.response_ids)
        self.turns += 1
        self.last, self.pending = s, None  # its stop token, and whether it was cut
        self.messages.append({"role": "assistant", "content": self.tokenizer.decode(
            s.response_ids, skip_special_tokens=True)})

    def add_reply(self, message: dict, ids: list[int]) -> None:
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logp += [0.0] * len(ids)
        self.versions += self.versions[-1:] * len(ids)  # the turn's before it (mask 0)
        self.messages.append(message)

    def sample(self, versions: bool = False) -> records.Sample:
        """Truncated: its last turn was cut at a length limit (overlong handling sees that)."""
        return records.Sample(self.prompt_ids, self.ids, self.logp, self.last.truncated,
                              self.mask, self.versions if versions else None)

    def state(self) -> dict:
        """What a checkpoint keeps of it (partial rollout's carried episodes)."""
        return {k: v for k, v in vars(self).items() if k != "tokenizer"}


class EpisodeRunner:
    """Runs the samples of a rollout as episodes: one turn each without an environment (env.name
    ""), else until the environment or a limit ends them (the module's docstring says how).
    close() stops the environment's worker. The steps of an episode (start, add a turn's tokens,
    respond, finish) are methods here, which `run` and partial rollout's rounds (partial.py)
    both take. group: the rollout.EngineGroup, whose first rank alone calls the environment."""

    def __init__(self, cfg: EnvConfig, tokenizer, chat_template: bool, prompt_key: str,
                 max_new_tokens: int, group=None, processor=None, image_key: str = ""):
        self.cfg, self.tokenizer, self.prompt_key = cfg, tokenizer, prompt_key
        self.processor, self.image_key = processor, image_key  # prompts with images
        self.max_new_tokens, self.group = max_new_tokens, group
        self.checked = not chat_template  # the episodes against the template, once a run
        self.worker = self.replies = None
        if cfg.name:
            self.replies = Replies(tokenizer, chat_template, cfg.reply_role)
            self.worker = plugins.Worker([cfg.name], envs.resolve, envs.as_reply,
                                         cfg.timeout_s, "environment", cfg.workers,
                                         cfg.concurrency)

    def run(self, engine, batch: list[dict], n: int, greedy: bool = False,
            seed: int | None = None) -> records.Generated:
        """`n` episodes per example of `batch`, prompt-major, played to their end."""
        media = ([vision.media(self.processor, ex, self.image_key) for ex in batch]
                 if self.image_key else None)
        first = engine.generate([ex["prompt_ids"] for ex in batch], n=n, greedy=greedy, seed=seed,
                                **({"media": media} if media else {}))
        examples = [ex for ex in batch for _ in range(n)]
        if self.worker is None:  # one turn: the samples as the engine made them
            texts = self.tokenizer.batch_decode([s.response_ids for s in first],
                                                skip_special_tokens=True)
            return records.Generated(first, examples, texts, turns=[1] * len(first),
                                     failed=[False] * len(first),
                                     limited=[s.truncated for s in first])
        episodes = [self.start(ex) for ex in examples]
        for e, s in zip(episodes, first):
            e.add_turn(s)
        going, calls = self.respond(episodes)
        turn = 1
        while going:
            turn += 1
            turn_seed = None if seed is None else rollout.seed_from(seed, turn)
            outs = engine.generate([e.prompt_ids + e.ids for e in going], n=1, greedy=greedy,
                                   seed=turn_seed, max_tokens=[e.limit for e in going])
            for e, s in zip(going, outs):
                e.add_turn(s)
            going, more = self.respond(going)
            calls += more
        return self.finish(episodes, calls)

    def start(self, example: dict) -> Episode:
        """A new episode of `example`, its first turn still to be written."""
        return Episode(example, self.prompt_key, self.tokenizer, self.max_new_tokens)

    def restore(self, state: dict) -> Episode:
        """An episode from its state() (a checkpoint's carried episodes)."""
        e = Episode.__new__(Episode)
        vars(e).update(state, tokenizer=self.tokenizer)
        return e

    def advance(self, e: Episode, ids: list[int], logp: list[float], ended: str | None,
                version: int) -> bool:
        """Add what the engine wrote of e's turn (its limit e.limit) under weights `version`;
        `ended`: how its request ended ("stop", "length", None: cut before either). Returns
        whether the turn is over: its stop token, or its limit reached. A turn over ends the
        episode without an environment; with one, respond() decides."""
        done_ids, done_logp, done_versions = e.pending
        done_ids, done_logp = done_ids + ids, done_logp + logp
        e.pending = (done_ids, done_logp, done_versions + [version] * len(ids))
        if ended != "stop" and len(done_ids) < e.limit:
            return False  # it goes on in a later round
        versions = e.pending[2]
        e.add_turn(records.Sample(e.prompt_ids + e.ids, done_ids, done_logp,
                                  ended != "stop"), versions)
        e.over = self.worker is None
        return True

    def respond(self, episodes: list[Episode]) -> tuple[list[Episode], records.EnvCalls]:
        """The environment answers the last turn of every episode of `episodes` that is not
        over (one job for its worker, on the first rank of the engine group); an episode it
        answers with a reply that fits gets the reply's tokens and room for its next turn
        (e.limit, e.pending emptied). Returns those that go on, and the calls' counts."""
        live = [e for e in episodes if not e.over]
        if not live:
            return [], records.EnvCalls()
        t = time.perf_counter()
        calls = [(0, (e.messages, e.example)) for e in live]
        run = lambda: self.worker.run(calls)  # noqa: E731
        replies = self.group.one_answer(run) if self.group is not None else run()
        counts, going = records.EnvCalls(seconds=time.perf_counter() - t), []
        for e, reply in zip(live, replies):
            e.over = True
            if reply is plugins.Failed or reply is TimeoutError:  # its episode scores 0
                e.failed = True
                counts.errors += reply is plugins.Failed
                counts.timeouts += reply is TimeoutError
            elif reply is not None and e.turns == self.cfg.max_turns:
                e.limited = True  # the environment would go on: the turn limit ended it
            elif reply is not None:
                reply = self.replies.message(reply)
                ids = self.replies.tokens([reply], None if e.last.truncated
                                          else e.last.response_ids[-1])
                room = self.cfg.max_tokens - len(e.ids) - len(ids)
                e.limited = room < 1  # no room for the reply and a turn: ends here
                if not e.limited:
                    e.add_reply(reply, ids)
                    e.over, e.limit, e.pending = False, min(self.max_new_tokens, room), ([], [], [])
                    going.append(e)
        return going, counts

    def finish(self, episodes: list[Episode], env: records.EnvCalls,
               versions: bool = False) -> records.Generated:
        """The episodes, all over, as samples: their examples (each with its "conversation" when
        an environment ran), texts (the last model turn), turns, failures and limits; `env`: the
        environment calls that made them; with `versions`, each sample's token versions
        (partial rollout)."""
        if self.worker is None:  # one turn, as run() gives it: the row as it is
            examples = [e.example for e in episodes]
        else:
            examples = [{**e.example, "conversation": e.messages} for e in episodes]
            if not self.checked and (e := next((e for e in episodes if 0 in e.mask), None)):
                self.checked = True  # one episode with a reply, at the first turn that has one
                if (where := self.replies.check(e.prompt_ids + e.ids, e.messages)) is not None:
                    log.warning("an episode's tokens differ from what the chat template renders "
                                "for its whole conversation, at %s. The model is trained on the "
                                "episode's tokens (each turn rendered after the last); shown "
                                "once", where)
        return records.Generated(
            [e.sample(versions) for e in episodes], examples,
            texts=[e.messages[-1]["content"] for e in episodes],  # always a model turn
            turns=[e.turns for e in episodes], failed=[e.failed for e in episodes],
            limited=[e.limited or (self.worker is None and e.last.truncated) for e in episodes],
            env=env)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
