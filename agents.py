"""Agents written against the OpenAI API, trained on the tokens the engine wrote for them.

With `env.kind: agent`, `env.name` names an `async def agent(base_url, example)` that returns
its episode's reward (or (reward, info)) and talks to the model through any OpenAI-compatible
client pointed at `base_url`. During the rollout each engine group's first rank serves
`POST {base_url}/chat/completions` and `GET {base_url}/models` on 127.0.0.1 (`Endpoint`, a
server per rollout, on a free port, gone when the rollout ends), each episode under a base URL
of its own (a random key in the path) so that every call is its episode's. The agents run in the
environment's worker (plugins.Worker: an event loop with env.concurrency agents at once, each
cut at env.timeout_s) while this process's main thread steps the engine (`Serving`): each
engine step takes every call that came in since the last, and the calls' requests are batched
into the engine's own step loop (continuous batching: a call that arrives while others decode
joins them at the next step). With rollout.tp_size > 1 the first rank of the engine group
serves and hands each step's new requests to the group's other ranks, which add them and step
with it (`AgentRunner._drive`).

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
a longer max_tokens): the response's `overridden` says which it used.
"""

import json
import logging
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import envs
import episodes
import plugins
import records
import rollout

log = logging.getLogger("grpo")


class BadCall(Exception):
    """A call the endpoint refuses: its HTTP status and a one-line message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def error_body(message: str, status: int) -> dict:
    kind = {404: "not_found_error", 503: "service_unavailable"}.get(status,
                                                                     "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


class Call:
    """One chat-completions request, from the server's thread that holds its connection to the
    main thread that serves it; `answer` hands the response back."""

    def __init__(self, key: str, body: dict):
        self.key, self.body = key, body
        self.status, self.response, self.done = 503, None, threading.Event()

    def answer(self, status: int, response: dict) -> None:
        if not self.done.is_set():
            self.status, self.response = status, response
            self.done.set()


class _Handler(BaseHTTPRequestHandler):
    """Routes /e/<episode key>/v1/{chat/completions, models}; a chat call waits for its answer."""
    protocol_version = "HTTP/1.1"  # keep-alive, as OpenAI clients expect
    calls: queue.Queue = None
    model: str = ""

    def log_message(self, *args) -> None:  # no line per request on stderr
        pass

    def _route(self) -> tuple[str | None, str]:
        parts = self.path.split("?")[0].split("/")
        if len(parts) >= 5 and parts[1] == "e" and parts[3] == "v1":
            return parts[2], "/".join(parts[4:])
        return None, ""

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:  # the agent went (cut at its limit): nobody reads the answer
            pass

    def do_GET(self) -> None:
        key, route = self._route()
        if key is None or route != "models":
            return self._reply(404, error_body(f"GET {self.path}: the endpoint serves "
                                               "{base_url}/models and /chat/completions", 404))
        self._reply(200, {"object": "list", "data": [
            {"id": self.model, "object": "model", "created": 0, "owned_by": "grpo"}]})

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        key, route = self._route()
        if key is None or route != "chat/completions":
            return self._reply(404, error_body(f"POST {self.path}: the endpoint serves "
                                               "{base_url}/chat/completions", 404))
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return self._reply(400, error_body("the request body is not a JSON object", 400))
        call = Call(key, body)
        self.calls.put(call)
        call.done.wait()
        self._reply(call.status, call.response)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # every agent of a rollout may connect at once (env.concurrency): a backlog of socketserver's
    #   default 5 overflowed at 64 and reset connections mid-request (ReadError in the client)
    request_queue_size = 4096


class Endpoint:
    """The HTTP server of one rollout, on 127.0.0.1 and a free port, a thread per connection;
    the calls it receives go to `calls`. close() stops it."""

    def __init__(self, calls: queue.Queue, model: str):
        handler = type("Handler", (_Handler,), {"calls": calls, "model": model})
        self.server = _Server(("127.0.0.1", 0), handler)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,),
                                       daemon=True)  # (close() waits up to that poll interval)
        self.thread.start()

    def url(self, key: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/e/{key}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


# ----------------------------------------------------------------------------------------------
# a call's request, checked


@dataclass
class Request:
    messages: list[dict]  # as the chat template takes them (for_template)
    history: list  # each message as compared between calls (norm)
    tools: list[dict]
    n: int = 1
    max_tokens: int | None = None
    stop: list[str] | None = None
    logprobs: bool = False
    token_ids: bool = False  # return_token_ids: the prompt's and each completion's ids
    parse_tools: bool = True
    asked: dict = field(default_factory=dict)  # sampling settings the call asked for


def text_of(content) -> str:
    """A message's content as text: a string, None, or a list of text parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise BadCall(400, "messages: a content that is not text (only text and text parts are "
                       "served)")


def _arguments(arguments):
    """A tool call's arguments as the chat templates take them (a dict), where they parse."""
    try:
        return json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        return arguments


def _tool_calls(m: dict) -> list[dict]:
    calls = m.get("tool_calls") or []
    if not (isinstance(calls, list) and all(isinstance(c, dict) and isinstance(
            c.get("function"), dict) and isinstance(c["function"].get("name"), str)
            for c in calls)):
        raise BadCall(400, "messages: a tool_calls that is not a list of "
                           "{'function': {'name', 'arguments'}}")
    return calls


def norm(m: dict) -> tuple:
    """What two calls must share of a message for the later to extend the earlier: its role,
    its text, its tool calls (name, arguments as parsed JSON)."""
    calls = tuple((c["function"]["name"], json.dumps(_arguments(c["function"].get("arguments")),
                                                     sort_keys=True)) for c in _tool_calls(m))
    return m["role"], text_of(m.get("content")), calls


def for_template(m: dict) -> dict:
    out = {k: v for k, v in m.items() if k in ("role", "name", "tool_call_id")}
    out["content"] = text_of(m.get("content"))
    if calls := _tool_calls(m):
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _arguments(
            c["function"].get("arguments"))}} for c in calls]
    return out


def parse_request(body: dict) -> Request:
    """A chat-completions body as a Request, or BadCall naming what it refuses."""
    messages = body.get("messages")
    if not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
        raise BadCall(400, "messages: a non-empty list of {'role', 'content'} is required")
    if body.get("stream"):
        raise BadCall(400, "stream: true is not served; the response comes whole")
    n = 1 if body.get("n") is None else body["n"]
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if not (isinstance(n, int) and 1 <= n <= 64):
        raise BadCall(400, f"n={n!r}: an integer from 1 to 64")
    if max_tokens is not None and not (isinstance(max_tokens, int) and max_tokens >= 1):
        raise BadCall(400, f"max_tokens={max_tokens!r}: a positive integer")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s
                                                               for s in stop)):
        raise BadCall(400, "stop: a string or a list of non-empty strings")
    tools, choice = body.get("tools") or [], body.get("tool_choice", "auto")
    if not isinstance(tools, list) or choice not in ("auto", "none"):
        raise BadCall(400, f"tools must be a list, and tool_choice 'auto' or 'none' (not "
                           f"{choice!r}): the model's own choice is what is trained")
    if body.get("top_logprobs"):
        raise BadCall(400, "top_logprobs: only the sampled token's logprob is served")
    return Request([for_template(m) for m in messages], [norm(m) for m in messages], tools, n,
                   max_tokens, stop or None, bool(body.get("logprobs")),
                   bool(body.get("return_token_ids")), choice != "none",
                   {k: body[k] for k in ("temperature", "top_p") if body.get(k) is not None})


# ----------------------------------------------------------------------------------------------
# an episode's samples


@dataclass
class Segment:
    """One sample of an agent's episode as it grows: its prompt, and after it the completions
    (mask 1, the engine's logprobs) and the messages between them (mask 0); `history`: the
    messages (norm) that a call must start with to extend it, `tools` the tools it was
    rendered with."""
    prompt_ids: list[int]
    ids: list[int]
    mask: list[int]
    logp: list[float]
    history: list = field(default_factory=list)
    tools: str = "[]"
    truncated: bool = False
    text: str = ""  # the last completion's content

    def extended(self, between: list[int], ids: list[int], logp: list[float]) -> "Segment":
        return Segment(self.prompt_ids, self.ids + between + ids,
                       self.mask + [0] * len(between) + [1] * len(ids),
                       self.logp + [0.0] * len(between) + logp)


class Episode:
    """An agent's episode: its example, the key of its base URL, its samples that a call may
    still extend (`open`), its calls, and whether a limit refused one."""

    def __init__(self, example: dict, index: int):
        self.example, self.index, self.key = example, index, secrets.token_hex(8)
        self.open: list[Segment] = []
        self.calls = self.rewrites = 0
        self.limited, self.conversation = False, None

    def prompt(self, req: Request, runner: "AgentRunner") -> tuple:
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
            raise BadCall(400, f"the chat template refused the messages: "
                               f"{plugins.one_line(e)}") from None
        return None, [], runner.tokenizer(text, add_special_tokens=False)["input_ids"]

    def record(self, base, between: list, prompt: list, req: Request, outs: list,
               runner: "AgentRunner") -> list[dict]:
        """The call's completions into its samples; returns each as a response message."""
        messages, made = [], []
        for ids, logp, how in outs:
            text = runner.tokenizer.decode(ids, skip_special_tokens=True)
            cut = [text.find(x) for x in req.stop or () if x in text] if how == "stop" else []
            text = text[:min(cut)] if cut else text  # the response leaves out a stop string,
            #   as OpenAI's does (the sample keeps its tokens: the model wrote them)
            content, calls = runner.tool_calls(text, req) if req.parse_tools else (text, [])
            message = {"role": "assistant", "content": content or (None if calls else ""),
                       **({"tool_calls": calls} if calls else {})}
            seg = (base.extended(between, ids, logp) if base is not None
                   else Segment(list(prompt), list(ids), [1] * len(ids), list(logp)))
            seg.history, seg.tools = req.history + [norm(message)], json.dumps(req.tools,
                                                                               sort_keys=True)
            seg.truncated, seg.text = how == "length", content
            messages.append(message)
            made.append(seg)
        self.open = [s for s in self.open if s is not base] + made
        self.conversation = req.messages + messages[:1]
        return messages

    def sample(self) -> records.Sample:
        last, *_ = self.open[-1:]
        return records.Sample(last.prompt_ids, last.ids, last.logp, last.truncated, last.mask,
                              earlier=[records.Sample(s.prompt_ids, s.ids, s.logp, s.truncated,
                                                      s.mask) for s in self.open[:-1]] or None)


# ----------------------------------------------------------------------------------------------
# serving a rollout


class AgentRunner:
    """Runs a rollout's samples as agents' episodes (the module's docstring says how), with the
    interface episodes.EpisodeRunner has for the sampler and eval: run() and close(). cfg: the
    `env:` section; group: the rollout.EngineGroup, whose first rank alone serves."""

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
        self.worker = None
        if group is None or group.first:  # the agents run where the endpoint does
            self.worker = plugins.Worker([cfg.name], envs.resolve_agent, envs.as_outcome,
                                         cfg.timeout_s, "agent", cfg.workers, cfg.concurrency)

    def run(self, engine, batch: list[dict], n: int, greedy: bool = False,
            seed: int | None = None) -> records.Generated:
        """`n` episodes per example of `batch`, prompt-major, each an agent's run to its end."""
        if self.worker is None:  # a later rank of the engine group: step as the first one says
            self._drive(engine, None, greedy)
            return self.group.one_answer(None)
        sampling = {"temperature": 0.0 if greedy else engine.cfg.temperature,
                    "top_p": 1.0 if greedy else engine.cfg.top_p}
        serving = Serving(self, [Episode(ex, i * n + j) for i, ex in enumerate(batch)
                                 for j in range(n)], seed, sampling)
        try:
            self._drive(engine, serving, greedy)
        finally:
            serving.close()
        generated = serving.generated()
        return self.group.one_answer(lambda: generated) if self.group is not None else generated

    def _drive(self, engine, serving, greedy: bool) -> None:
        """Step the engine until the agents are done: each step, the new requests (the first
        rank's Serving.next_requests, handed to the group's other ranks) added, then one
        engine step, whose ended requests answer their calls."""
        def share(fn):
            return self.group.one_answer(fn) if self.group is not None else fn()

        try:
            while (adds := share(serving and serving.next_requests)) is not None:
                ended = rollout.step_requests(engine, adds, greedy)
                if serving is not None:
                    serving.ended(ended)
        finally:
            rollout.abort_requests(engine)

    def tool_calls(self, text: str, req: Request) -> tuple[str, list[dict]]:
        """The model's text as (content, tool_calls in the OpenAI form), by env.tool_parser."""
        if not req.tools:
            return text, []
        try:
            content, calls = self.parser(text, req.tools)
            calls = [{"id": f"call_{secrets.token_hex(6)}", "type": "function",
                      "function": {"name": str(c["name"]), "arguments": str(c["arguments"])}}
                     for c in calls]
        except Exception as e:  # noqa: BLE001
            raise BadCall(500, f"env.tool_parser {self.cfg.tool_parser!r} failed: "
                               f"{plugins.one_line(e)}") from None
        return content, calls

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


class Serving:
    """The first rank's side of one rollout: the endpoint, the agents (in a thread that waits
    for the worker), the calls in the engine (`pending`: request id -> (call, choice))."""

    def __init__(self, runner: AgentRunner, eps: list[Episode], seed: int | None,
                 sampling: dict):
        self.runner, self.episodes, self.seed, self.sampling = runner, eps, seed, sampling
        self.by_key = {e.key: e for e in eps}
        self.calls, self.pending, self.made = queue.Queue(), {}, 0
        self.endpoint = Endpoint(self.calls, runner.model)
        self.outcomes, self.error, self.t = None, None, time.perf_counter()
        jobs = [(0, (self.endpoint.url(e.key), e.example)) for e in eps]
        self.thread = threading.Thread(target=self._agents, args=(jobs,), daemon=True)
        self.thread.start()

    def _agents(self, jobs: list) -> None:
        try:
            self.outcomes = self.runner.worker.run(jobs)
        except BaseException as e:  # noqa: BLE001  (raised in the main thread, at close)
            self.error = e

    def next_requests(self) -> list | None:
        """The requests of the calls that came in (waiting for one while the engine is idle), or
        None once every agent has returned."""
        while True:
            alive = self.thread.is_alive()
            got = []
            try:
                if alive and not self.pending:
                    got.append(self.calls.get(timeout=0.05))
                while True:
                    got.append(self.calls.get_nowait())
            except queue.Empty:
                pass
            if not alive:  # every agent returned: what still calls is an agent cut at its limit
                for call in got:
                    call.answer(503, error_body("the rollout is over", 503))
                return None
            adds = [a for call in got for a in self.accept(call)]
            if adds or self.pending:
                return adds

    def accept(self, call: Call) -> list:
        """A call's engine requests; a call refused is answered here."""
        r = self.runner
        try:
            e = self.by_key.get(call.key)
            if e is None:
                raise BadCall(404, f"no episode {call.key!r} in this rollout: use the base_url "
                                   "the agent was given")
            req = parse_request(call.body)
            if e.calls >= r.cfg.max_turns:
                e.limited = True
                raise BadCall(400, f"the episode made its env.max_turns={r.cfg.max_turns} calls")
            base, between, prompt = e.prompt(req, r)
            used = 0 if base is None else len(base.ids) + len(between)
            room = min(r.max_new_tokens, r.cfg.max_tokens - used, r.max_model_len - len(prompt))
            if room < 1:
                e.limited = True
                raise BadCall(400, f"the episode's sample is at its env.max_tokens="
                                   f"{r.cfg.max_tokens} (or rollout.max_model_len) limit")
        except BadCall as b:
            call.answer(b.status, error_body(str(b), b.status))
            return []
        e.calls += 1
        limit = min(room, req.max_tokens or room)
        call.work = (e, base, between, prompt, req, [None] * req.n, self.overridden(req, limit))
        adds = []
        for j in range(req.n):
            rid, self.made = f"agent-{self.made}", self.made + 1
            seed = (None if self.seed is None
                    else rollout.seed_from(self.seed, e.index, e.calls, j))
            adds.append((rid, prompt, limit, seed, req.stop))
            self.pending[rid] = (call, j)
        return adds

    def overridden(self, req: Request, limit: int) -> dict:
        """The settings the run used where the call asked for others."""
        out = {k: self.sampling[k] for k, v in req.asked.items() if v != self.sampling[k]}
        if req.max_tokens is not None and req.max_tokens > limit:
            out["max_tokens"] = limit
        return out

    def ended(self, ended: list) -> None:
        """Requests that ended in an engine step: a call whose choices are all done is
        answered."""
        for rid, ids, logp, how in ended:
            call, j = self.pending.pop(rid)
            e, base, between, prompt, req, outs, overridden = call.work
            outs[j] = (ids, logp, how)
            if any(o is None for o in outs):
                continue
            try:
                messages = e.record(base, between, prompt, req, outs, self.runner)
            except BadCall as b:
                call.answer(b.status, error_body(str(b), b.status))
                continue
            call.answer(200, self.response(rid, prompt, req, outs, messages, overridden))

    def response(self, rid: str, prompt: list, req: Request, outs: list, messages: list,
                 overridden: dict) -> dict:
        choices = []
        for j, ((ids, logp, how), message) in enumerate(zip(outs, messages)):
            c = {"index": j, "message": message, "logprobs": None, "finish_reason":
                 "tool_calls" if message.get("tool_calls") else how}
            if req.logprobs:
                tokens = self.runner.tokenizer.convert_ids_to_tokens(ids)
                c["logprobs"] = {"content": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                    for t, lp in zip(tokens, logp)]}
            if req.token_ids:
                c["token_ids"] = list(ids)
            choices.append(c)
        done = sum(len(ids) for ids, _, _ in outs)
        out = {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()),
               "model": self.runner.model, "choices": choices,
               "usage": {"prompt_tokens": len(prompt), "completion_tokens": done,
                         "total_tokens": len(prompt) + done}}
        if req.token_ids:
            out["prompt_token_ids"] = list(prompt)
        if overridden:
            out["overridden"] = overridden
        return out

    def close(self) -> None:
        """Answer what still waits, stop the server, wait for the agents."""
        for call, _ in list(self.pending.values()):
            call.answer(503, error_body("the rollout is over", 503))
        self.pending.clear()
        self.endpoint.close()
        while not self.calls.empty():
            self.calls.get_nowait().answer(503, error_body("the rollout is over", 503))
        self.thread.join()
        self.seconds = time.perf_counter() - self.t
        if self.error is not None:
            raise self.error

    def generated(self) -> records.Generated:
        """The episodes as records.Generated: each one's last sample (its earlier ones with
        it), its example with the agent's reward, info and last conversation."""
        samples, examples, texts, failed = [], [], [], []
        env = records.EnvCalls(seconds=self.seconds)
        for e, out in zip(self.episodes, self.outcomes):
            cut, no_call = out is TimeoutError, not e.open
            bad = out is plugins.Failed or cut or no_call
            env.errors += out is plugins.Failed or (no_call and not cut)
            env.timeouts += cut
            env.calls, env.rewrites = env.calls + e.calls, env.rewrites + e.rewrites
            reward, info = (0.0, None) if bad else out
            if e.open:
                samples.append(e.sample())
            else:  # no call: one token that trains nothing (the episode has failed)
                eos = self.runner.tokenizer.eos_token_id or 0
                samples.append(records.Sample(e.example["prompt_ids"], [eos], [0.0], False, [0]))
            examples.append({**e.example, "agent_reward": reward, "agent_info": info,
                             "conversation": e.conversation or []})
            texts.append(e.open[-1].text if e.open else "")
            failed.append(bad)
        return records.Generated(samples, examples, texts, [e.calls for e in self.episodes],
                                 failed, [e.limited for e in self.episodes], env)
