"""Agents written against the OpenAI API, trained on the tokens the engine wrote for them.

With `env.kind: agent`, `env.name` names an `async def agent(client, example)` that returns its
episode's reward (or (reward, info)) and talks to the model through `client`, an
openai.AsyncOpenAI at its episode's base URL (envs.with_client), or an `async def
agent(base_url, example)` that points any OpenAI-compatible client at `base_url`. During the
rollout each engine group's first rank serves `POST {base_url}/chat/completions` and `GET
{base_url}/models` on 127.0.0.1 (`openai_api.Endpoint`, a server per rollout, on a free port,
gone when the rollout ends), each episode under a base URL of its own (a random key in the path)
so that every call is its episode's. The agents run in the environment's worker (plugins.Worker:
an event loop with env.concurrency agents at once, each cut at env.timeout_s) while this
process's main thread steps the engine (`Serving`): each engine step takes every call that came
in since the last, and the calls' requests are batched into the engine's own step loop
(continuous batching: a call that arrives while others decode joins them at the next step). With
rollout.tp_size > 1 the first rank of the engine group serves and hands each step's new requests
to the group's other ranks, which add them and step with it (`AgentRunner.drive`).

Token-exact trajectories: the endpoint renders a call's messages to token ids once, with the
tokenizer's chat template, and keeps them with the completion's ids and the engine's logprobs.
A call whose messages are an earlier call's messages and the reply it got, plus more (tool
results, a user turn), extends that call's sample: its prompt is that call's prompt and
completion, token for token as the engine wrote them, and the new messages' tokens after it
(episodes.Replies.tokens, mask 0). A call that does not (the agent rewrote its history, or
dropped part of it) starts a new sample of the same episode; the episode's reward goes to each,
and `agent_rewrite_frac` says how often that happened. An episode's samples are the last sample
(records.Sample, which the group's advantages see) and its `earlier` ones, which the update
trains with the same advantage (records.with_earlier).

Limits, as for environments: env.max_turns calls per episode, env.max_tokens tokens after a
sample's prompt (a call gets at most the room left, and rollout.max_new_tokens), env.timeout_s
per episode; a call past a limit is refused (HTTP 400) and its episode counted in limited_frac.
An agent that raises, returns no number, is cut at its limit or never calls the endpoint fails
its episode (env.on_failure). The run's sampling settings win over a call's (temperature, top_p,
a longer max_tokens): the response's `overridden` says which it used. With partial rollout
(PartialAgents) a call still in the engine at a step's end goes on in the next step.
"""

import json
import logging
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field

from collect import envs, openai_api
import episodes
import plugins
import records
import rollout

log = logging.getLogger("grpo")


# ----------------------------------------------------------------------------------------------
# an episode's samples


@dataclass
class Segment:
    """One sample of an agent's episode as it grows: its prompt, and after it the completions
    (mask 1, the engine's logprobs, the weights version that wrote each token) and the messages
    between them (mask 0); `history`: the messages (openai_api.norm) that a call must start
    with to extend it, `tools` the tools it was rendered with."""
    prompt_ids: list[int]
    ids: list[int]
    mask: list[int]
    logp: list[float]
    versions: list[int]
    history: list = field(default_factory=list)
    tools: str = "[]"
    truncated: bool = False
    text: str = ""  # the last completion's content

    def extended(self, between: list[int], ids: list, logp: list, versions: list) -> "Segment":
        return Segment(self.prompt_ids, self.ids + between + ids,
                       self.mask + [0] * len(between) + [1] * len(ids),
                       self.logp + [0.0] * len(between) + logp,
                       self.versions + self.versions[-1:] * len(between) + versions)

    def sample(self, versions: bool) -> records.Sample:
        return records.Sample(self.prompt_ids, self.ids, self.logp, self.truncated, self.mask,
                              self.versions if versions else None)


class Episode:
    """An agent's episode: its example, the key of its base URL, its samples that a call may
    still extend (`open`), its calls, whether a limit refused one, and once its agent returned,
    the outcome (plugins.Worker's: (reward, info), Failed or TimeoutError)."""

    def __init__(self, example: dict, index: int):
        self.example, self.index, self.key = example, index, secrets.token_hex(8)
        self.open: list[Segment] = []
        self.calls = self.rewrites = self.tool_calls = 0  # tool_calls: the model's, parsed
        self.limited, self.conversation, self.tools, self.outcome = False, None, None, None
        self.done = self.dropped = False

    def prompt(self, req: openai_api.Request, runner: "AgentRunner") -> tuple:
        """(the sample it extends or None, the tokens between, the call's prompt ids)."""
        tools = json.dumps(req.tools, sort_keys=True)
        bases = [s for s in self.open if s.tools == tools and len(s.history) < len(req.history)
                 and req.history[:len(s.history)] == s.history]
        if bases:
            base = max(bases, key=lambda s: len(s.history))
            between = runner.replies.tokens(req.messages[len(base.history):],
                                            None if base.truncated else base.ids[-1])
            return base, between, base.prompt_ids + base.ids + between
        self.rewrites += bool(self.open)
        try:
            text = runner.tokenizer.apply_chat_template(
                req.messages, tools=req.tools or None, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # noqa: BLE001  (the template's own refusal, e.g. no user turn)
            raise openai_api.BadCall(400, f"the chat template refused the messages: "
                                          f"{plugins.one_line(e)}") from None
        return None, [], runner.tokenizer(text, add_special_tokens=False)["input_ids"]

    def record(self, w: "Work", runner: "AgentRunner") -> list[dict]:
        """A call's completions (w.written: ids, logprobs, versions; w.how: how each ended) into
        its samples; returns each as a response message."""
        messages, made, req = [], [], w.req
        for (ids, logp, versions), how in zip(w.written, w.how):
            text = runner.tokenizer.decode(ids, skip_special_tokens=True)
            cut = [text.find(x) for x in req.stop or () if x in text] if how == "stop" else []
            text = text[:min(cut)] if cut else text  # the response leaves out a stop string,
            #   as OpenAI's does (the sample keeps its tokens: the model wrote them)
            content, calls = runner.tool_calls(text, req) if req.parse_tools else (text, [])
            message = {"role": "assistant", "content": content or (None if calls else ""),
                       **({"tool_calls": calls} if calls else {})}
            seg = (w.base.extended(w.between, ids, logp, versions) if w.base is not None
                   else Segment(list(w.prompt), list(ids), [1] * len(ids), list(logp),
                                list(versions)))
            seg.history = req.history + [openai_api.norm(message)]
            seg.tools = json.dumps(req.tools, sort_keys=True)
            seg.truncated, seg.text = how == "length", content
            messages.append(message)
            made.append(seg)
            self.tool_calls += len(calls)
        self.open = [s for s in self.open if s is not w.base] + made
        self.conversation = req.messages + [openai_api.for_template(messages[-1])]
        self.tools = req.tools
        return messages

    def sample(self, versions: bool = False) -> records.Sample:
        """Its newest sample, the others as its `earlier` ones."""
        last = self.open[-1].sample(versions)
        last.earlier = [s.sample(versions) for s in self.open[:-1]] or None
        return last


@dataclass
class Work:
    """A call in the engine: its episode, the sample it extends (or None) and the tokens between,
    its prompt, request, room and `overridden`; per choice what the engine wrote so far (ids,
    logprobs, versions: a choice cut at a step's end goes on in the next) and how it ended."""
    episode: Episode
    base: Segment | None
    between: list
    prompt: list
    req: openai_api.Request
    limit: int
    overridden: dict
    written: list = field(default_factory=list)
    how: list = field(default_factory=list)
    call: openai_api.Call | None = None  # the HTTP request that waits for the answer


# ----------------------------------------------------------------------------------------------
# serving a rollout


class AgentRunner:
    """Runs a rollout's samples as agents' episodes (the module's docstring says how), with the
    interface episodes.EpisodeRunner has for the sampler and eval: run() and close(); partial
    rollout's source is PartialAgents. cfg: the `env:` section; group: the
    rollout.EngineGroup, whose first rank alone serves and runs the agents."""

    def __init__(self, cfg, tokenizer, max_new_tokens: int, max_model_len: int, model: str,
                 group=None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("env.kind=agent: the tokenizer has no chat template, and the "
                             "endpoint renders each call's messages with it. Fix: a chat model's "
                             "tokenizer, or give it a chat_template")
        self.cfg, self.tokenizer, self.group, self.model = cfg, tokenizer, group, model
        self.max_new_tokens, self.max_model_len = max_new_tokens, max_model_len
        self.replies = episodes.Replies(tokenizer, True, "user")
        self.parser = envs.resolve_tool_parser(cfg.tool_parser)
        self.worker = self.new_worker() if group is None or group.first else None
        self.idle = [self.worker] if self.worker is not None else []  # workers with no job
        self.checked = False  # a sample against the template's rendering, once a run (check)
        self.shown = set()  # the kinds of refused calls logged so far (Serving.refuse)

    def new_worker(self) -> plugins.Worker:
        """A worker for one job of agents (plugins.Worker: an event loop in a process of its own,
        env.concurrency agents at once, each cut at env.timeout_s)."""
        c = self.cfg
        return plugins.Worker([c.name], envs.resolve_agent, envs.as_outcome, c.timeout_s,
                              "agent", c.workers, c.concurrency)

    def run(self, engine, batch: list[dict], n: int, greedy: bool = False,
            seed: int | None = None) -> records.Generated:
        """`n` episodes per example of `batch`, prompt-major, each an agent's run to its end."""
        if self.worker is None:  # a later rank of the engine group: step as the first one says
            self.drive(engine, None, greedy)
            return self.group.one_answer(None)
        eps = [Episode(ex, i * n + j) for i, ex in enumerate(batch) for j in range(n)]
        serving = Serving(self, seed, sampling(engine, greedy))
        try:
            serving.start(eps)
            self.drive(engine, serving, greedy, lambda: all(e.done for e in eps))
        finally:
            serving.close()
        self.check(eps)
        generated = serving.generated(eps)
        return self.share(lambda: generated)

    def drive(self, engine, serving, greedy: bool, stop=None) -> None:
        """Step the engine until stop() (on the first rank: Serving.next_requests): each step,
        the new requests (handed to the group's other ranks) added, then one engine step, whose
        ended requests answer their calls. The requests still in the engine then are cut and
        kept (Serving.cut)."""
        ask = serving and (lambda: serving.next_requests(stop))  # (None on the other ranks)
        try:
            while (adds := self.share(ask)) is not None:
                ended = rollout.step_requests(engine, adds, greedy)
                if serving is not None:
                    serving.ended(ended)
        finally:
            cut = rollout.cut_requests(engine)
            if serving is not None:
                serving.cut(cut)

    def check(self, eps: list[Episode]) -> None:
        """Once a run, the first sample with messages between its calls against what the chat
        template renders for its episode's whole conversation (episodes.Replies.check: Qwen3's
        drops the reasoning of earlier turns, so its episodes differ); a difference is logged.
        The sample keeps the tokens the engine saw."""
        e = next((e for e in eps if e.open and 0 in e.open[-1].mask), None)
        if self.checked or e is None:
            return
        self.checked, s = True, e.open[-1]
        if (where := self.replies.check(s.prompt_ids + s.ids, e.conversation, e.tools)):
            log.warning("an agent's sample differs from what the chat template renders for its "
                        "whole conversation, at %s. The model is trained on the tokens the "
                        "engine saw, call by call; shown once", where)

    def share(self, fn):
        """fn() on the engine group's first rank, its value handed to the group's other ranks
        (rollout.EngineGroup.one_answer; they pass None); fn() alone without a group."""
        return self.group.one_answer(fn) if self.group is not None else fn()

    def tool_calls(self, text: str, req: openai_api.Request) -> tuple[str, list[dict]]:
        """The model's text as (content, tool_calls in the OpenAI form), by env.tool_parser."""
        if not req.tools:
            return text, []
        try:
            content, calls = self.parser(text, req.tools)
            calls = [{"id": f"call_{secrets.token_hex(6)}", "type": "function",
                      "function": {"name": str(c["name"]), "arguments": str(c["arguments"])}}
                     for c in calls]
        except Exception as e:  # noqa: BLE001
            raise openai_api.BadCall(500, f"env.tool_parser {self.cfg.tool_parser!r} failed: "
                                          f"{plugins.one_line(e)}", "tool_parser") from None
        return content, calls

    def close(self) -> None:
        for w in self.idle:
            w.close()


def overridden(sampling: dict, req: openai_api.Request, limit: int) -> dict:
    """The settings the run used (`sampling`, and the call's room) where the call asked for
    others."""
    out = {k: sampling[k] for k, v in req.asked.items() if v != sampling[k]}
    if req.max_tokens is not None and req.max_tokens > limit:
        out["max_tokens"] = limit
    return out


def sampling(engine, greedy: bool) -> dict:
    """The sampling settings the engine's requests use (Engine.sampling's; a call asking for
    others is told: `overridden`)."""
    params = engine.sampling(1, 1, greedy)
    return {"temperature": params.temperature, "top_p": params.top_p}


class Serving:
    """The first rank's side: the endpoint, the agents' jobs (each in a thread that waits for
    its worker; `outcomes` as each agent returns), the calls in the engine (`pending`: request
    id -> (Work, choice)) and those cut at a drive's end (`carried`), which the next drive
    adds first. `version`: the weights version the engine holds (partial rollout)."""

    def __init__(self, runner: AgentRunner, seed: int | None, settings: dict):
        self.runner, self.seed, self.sampling, self.version = runner, seed, settings, 0
        self.by_key, self.calls, self.outcomes = {}, queue.Queue(), queue.Queue()
        self.pending, self.carried, self.made, self.made_tokens = {}, [], 0, 0
        self.jobs, self.errors, self.t, self.seconds = [], [], time.perf_counter(), 0.0
        self.refused = {}  # calls refused since `generated` last took them, by kind
        self.endpoint = openai_api.Endpoint(self.calls, runner.model)

    def start(self, eps: list[Episode]) -> None:
        """The agents of `eps`, one job of an idle worker (a new one if none is idle)."""
        self.by_key.update((e.key, e) for e in eps)
        worker = self.runner.idle.pop() if self.runner.idle else self.runner.new_worker()
        jobs = [(0, (self.endpoint.url(e.key), e.example)) for e in eps]
        self.jobs.append((threading.Thread(target=self._job, args=(worker, eps, jobs),
                                           daemon=True), worker))
        self.jobs[-1][0].start()

    def _job(self, worker: plugins.Worker, eps: list[Episode], jobs: list) -> None:
        try:
            worker.run(jobs, ended=lambda k, v: self.outcomes.put((eps[k], v)))
            self.runner.idle.append(worker)
        except BaseException as e:  # noqa: BLE001  (raised in the main thread)
            self.errors.append(e)

    def next_requests(self, stop) -> list | None:
        """The requests to add before the next engine step: the carried ones, then those of the
        calls that came in (waiting for one while the engine is idle); None once stop() says
        so, checked after the agents that returned are counted."""
        while True:
            while not self.outcomes.empty():  # the agents that returned
                e, outcome = self.outcomes.get_nowait()
                e.outcome, e.done = outcome, True
            if self.errors:
                raise self.errors[0]
            if stop():
                return None
            adds = [self.add(w, j) for w, j in self.carried]
            self.carried, got = [], []
            try:
                if not (self.pending or adds):
                    got.append(self.calls.get(timeout=0.05))
                while True:
                    got.append(self.calls.get_nowait())
            except queue.Empty:
                pass
            adds += [a for call in got for a in self.accept(call)]
            if adds or self.pending:
                return adds

    def accept(self, call: openai_api.Call) -> list:
        """A call's engine requests; a call refused is answered here."""
        r = self.runner
        try:
            e = self.by_key.get(call.key)
            if e is None or e.dropped:
                raise openai_api.BadCall(404, f"no episode {call.key!r} in this rollout (or it "
                                              "was dropped as too stale): use the base_url the "
                                              "agent was given", "no_episode")
            if e.done:
                raise openai_api.BadCall(410, "the episode's agent already returned: a call "
                                              "after that is no part of its sample",
                                         "after_return")
            req = openai_api.parse_request(call.body)
            if e.calls >= r.cfg.max_turns:
                e.limited = True
                raise openai_api.BadCall(400, f"the episode made its env.max_turns="
                                              f"{r.cfg.max_turns} calls", "limit")
            base, between, prompt = e.prompt(req, r)
            used = 0 if base is None else len(base.ids) + len(between)
            room = min(r.max_new_tokens, r.cfg.max_tokens - used, r.max_model_len - len(prompt))
            if room < 1:
                e.limited = True
                raise openai_api.BadCall(400, f"the episode's sample is at its env.max_tokens="
                                              f"{r.cfg.max_tokens} (or rollout.max_model_len) "
                                              "limit", "limit")
        except openai_api.BadCall as b:
            self.refuse(call, b)
            return []
        e.calls += 1
        limit = min(room, req.max_tokens or room)
        w = Work(e, base, between, prompt, req, limit, overridden(self.sampling, req, limit),
                 [([], [], []) for _ in range(req.n)], [None] * req.n, call)
        return [self.add(w, j) for j in range(req.n)]

    def refuse(self, call: openai_api.Call, b: openai_api.BadCall) -> None:
        """Answer a refused call with its error, counted by kind (records.REFUSALS); the first
        of each kind in a run is logged, with its message."""
        self.refused[b.kind] = self.refused.get(b.kind, 0) + 1
        if b.kind not in self.runner.shown:
            self.runner.shown.add(b.kind)
            log.warning("an agent's call was refused (%s, HTTP %d): %s. Counted in "
                        "agent_refused/%s; each kind shown once", b.kind, b.status, b, b.kind)
        call.answer(b.status, openai_api.error_body(str(b), b.status))

    def add(self, w: Work, j: int) -> tuple:
        """Choice j of a call as an engine request: after what it wrote so far, for the room
        left."""
        rid, self.made = f"agent-{self.made}", self.made + 1
        done = w.written[j][0]
        seed = (None if self.seed is None
                else rollout.seed_from(self.seed, w.episode.index, w.episode.calls, j, len(done)))
        self.pending[rid] = (w, j)
        return rid, w.prompt + done, w.limit - len(done), seed, w.req.stop

    def wrote(self, rid: str, ids: list, logp: list) -> tuple:
        self.made_tokens += len(ids)
        w, j = self.pending.pop(rid)
        done_ids, done_logp, versions = w.written[j]
        w.written[j] = (done_ids + ids, done_logp + logp, versions + [self.version] * len(ids))
        return w, j

    def ended(self, ended: list) -> None:
        """Requests that ended in an engine step: a call whose choices are all done is
        answered."""
        for rid, ids, logp, how in ended:
            w, j = self.wrote(rid, ids, logp)
            w.how[j] = how
            if any(h is None for h in w.how):
                continue
            try:
                messages = w.episode.record(w, self.runner)
            except openai_api.BadCall as b:
                self.refuse(w.call, b)
                continue
            w.call.answer(200, openai_api.response(rid, w, messages, self.runner.tokenizer,
                                        self.runner.model))

    def cut(self, cut: list) -> None:
        """Requests cut where they were (rollout.cut_requests): carried, with what they wrote."""
        for rid, ids, logp in cut:
            if rid in self.pending:
                self.carried.append(self.wrote(rid, ids, logp))

    def drop(self, eps: list[Episode]) -> None:
        """Episodes out of the rollout (too stale): their calls refused, their agents' returns
        ignored."""
        for e in eps:
            e.dropped = True
        gone = [(w, j) for w, j in self.carried if w.episode.dropped]
        self.carried = [c for c in self.carried if not c[0].episode.dropped]
        for w, _ in gone:
            w.call.answer(404, openai_api.error_body("the episode was dropped as too stale", 404))

    def close(self) -> None:
        """Answer what still waits, stop the server, wait for the agents. The agents still in
        flight (partial rollout's at the run's end, or any after an error) fail on the answer
        "the rollout is over": by design, so their workers print nothing of it."""
        over = openai_api.error_body("the rollout is over", 503)
        for _, worker in self.jobs:
            worker.quiet()
        for w, _ in list(self.pending.values()) + self.carried:
            w.call.answer(503, over)
        self.pending, self.carried = {}, []
        self.endpoint.close()
        while not self.calls.empty():
            self.calls.get_nowait().answer(503, over)
        for job, _ in self.jobs:
            job.join()
        for _, worker in self.jobs:  # after all: a worker may hold several jobs, one by one
            worker.quiet(False)
        self.seconds = time.perf_counter() - self.t
        if self.errors:
            raise self.errors[0]

    def generated(self, eps: list[Episode], versions: bool = False) -> records.Generated:
        """The episodes, their agents returned, as records.Generated: each one's last sample
        (its earlier ones with it), its example with the agent's reward, info and last
        conversation; with `versions`, each token's weights version (partial rollout)."""
        samples, examples, texts, failed = [], [], [], []
        env = records.EnvCalls(seconds=self.seconds, refused=self.refused)  # (close() sets it)
        self.refused = {}  # (each counted once: partial rollout takes a step's in pieces)
        for e in eps:
            out = e.outcome
            cut, no_call = out is TimeoutError, not e.open
            bad = out is plugins.Failed or cut or no_call
            env.errors += out is plugins.Failed or (no_call and not cut)
            env.timeouts += cut
            env.calls, env.rewrites = env.calls + e.calls, env.rewrites + e.rewrites
            env.episodes, env.tool_calls = env.episodes + 1, env.tool_calls + e.tool_calls
            env.tool_episodes += e.tool_calls > 0
            reward, info = (0.0, None) if bad else out
            if e.open:
                samples.append(e.sample(versions))
            else:  # no call: one token that trains nothing (the episode has failed)
                eos = self.runner.tokenizer.eos_token_id or 0
                samples.append(records.Sample(e.example["prompt_ids"], [eos], [0.0], False, [0],
                                              [self.version] if versions else None))
            examples.append({**e.example, "agent_reward": reward, "agent_info": info,
                             "conversation": e.conversation or []})
            texts.append(e.open[-1].text if e.open else "")
            failed.append(bad)
        return records.Generated(samples, examples, texts, [e.calls for e in eps], failed,
                                 [e.limited for e in eps], env)


class PartialAgents:
    """partial.PartialRollout's source for agents: groups of Episode whose agents run on from
    step to step, their calls served by the engine group's first rank, which decides (`leads`;
    the others step the engine as it says and get what it took). A step's generation ends once
    the groups it still needs have all returned; the calls still in the engine are cut where
    they are, their HTTP requests held open through the update, and go on first next step under
    the new weights. A group dropped as too stale has its calls refused. A checkpoint keeps no
    agent in flight (its state lives in its worker process: `keeps`)."""

    keeps = False

    def __init__(self, cfg, group, engine, runner: AgentRunner):
        self.group_size, self.engine, self.runner = cfg.grpo.group_size, engine, runner
        self.leads, self.serving = group.first, None

    def configure(self, cfg) -> None:
        """The engine's sampling, changed between steps (train_grpo.configure), for the calls
        to come (the engine is configured first)."""
        if self.serving is not None:
            self.serving.sampling = sampling(self.engine, False)

    def begin(self, step: int) -> None:
        """The first rank's endpoint (one for the run) at the weights version step - 1."""
        if self.leads:
            self.serving = self.serving or Serving(self.runner, None, sampling(self.engine, False))
            self.serving.version, self.serving.made_tokens = step - 1, 0

    def start(self, examples: list[dict], first: int) -> list:
        """A group per example (drawn `first`, first + 1, ...), their agents one job."""
        g = self.group_size
        groups = [[Episode(example, (first + k) * g + j) for j in range(g)]
                  for k, example in enumerate(examples)]
        self.serving.start([e for group in groups for e in group])
        return groups

    def done(self, group: list) -> bool:
        return all(e.done for e in group)

    def oldest(self, group: list, version: int) -> int:
        """The oldest weights version among the model tokens of `group`'s samples and of its
        calls cut at the last step's end; `version` when it holds none."""
        found = [v for e in group for s in e.open for v, m in zip(s.versions, s.mask) if m]
        found += [v for w, j in self.serving.carried if w.episode in group
                  for v in w.written[j][2]]
        return min(found, default=version)

    def drop(self, groups: list) -> None:
        if self.leads:
            self.serving.drop([e for g in groups for e in g])

    def generate(self, groups: list, need: int, round_index: int) -> records.EnvCalls:
        """Engine steps until `ready`; the agents' calls are counted as they are taken."""
        self.runner.drive(self.engine, self.serving, False, lambda: ready(groups, need))
        return records.EnvCalls()

    def generated(self, groups: list) -> records.Generated:
        eps = [e for g in groups for e in g]
        self.runner.check(eps)
        return self.serving.generated(eps, versions=True)

    def exhausted(self, groups: list) -> bool:
        """With the step's draws spent, whether `groups` end it: no agent is left in flight."""
        return not groups

    def agree(self, answer):
        """The first rank's `answer` on every rank of the engine group."""
        return self.runner.share(lambda: answer)

    @property
    def made(self) -> int:
        """The tokens the engine wrote for the agents this step."""
        return self.serving.made_tokens if self.leads else 0

    def held(self, groups: list) -> int:
        """The model tokens of `groups`' samples and of the calls cut at the step's end."""
        held = sum(sum(s.mask) for g in groups for e in g for s in e.open)
        return held + (sum(len(w.written[j][0]) for w, j in self.serving.carried)
                       if self.serving else 0)

    def state(self, groups: list) -> list:
        return []  # (their agents' state lives in their worker process)

    def restore(self, states: list) -> list:
        return []

    def resumed(self, carried: int | None) -> None:
        log.warning("partial rollout with agents: a checkpoint keeps no agent in flight; the run "
                    "goes on with none")

    def close(self) -> None:
        if self.serving is not None:
            self.serving.close()


def ready(groups: list, need: int) -> bool:
    """Whether `need` of `groups` have all returned, or no agent in flight is left to wait for."""
    complete = sum(all(e.done for e in g) for g in groups)
    return complete >= need or all(e.done for g in groups for e in g)
