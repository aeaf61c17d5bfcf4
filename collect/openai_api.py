"""The OpenAI chat-completions wire format, and the HTTP endpoint that serves it.

`Endpoint` is one rollout's HTTP server on 127.0.0.1: `POST {base_url}/chat/completions` and
`GET {base_url}/models`, each base URL `/e/<key>/v1` (agents.py gives each episode a key). A
chat call becomes a `Call` on a queue and waits there, its connection held open, until the
trainer's main thread answers it (agents.Serving). `parse_request` checks a call's body into a
`Request` as the chat template takes it, or refuses it (`BadCall`: an HTTP status and a one-line
message); `response` writes the answer, with vLLM's token-id fields. Nothing here knows of
engines or samples: what a call means for training is agents.py's.
"""

import json
import queue
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


# ----------------------------------------------------------------------------------------------
# a call's request, checked, and its answer


class BadCall(Exception):
    """A call the endpoint refuses: its HTTP status, a one-line message, and the kind of
    refusal it counts as (records.REFUSALS)."""

    def __init__(self, status: int, message: str, kind: str = "bad_request"):
        super().__init__(message)
        self.status, self.kind = status, kind


def error_body(message: str, status: int) -> dict:
    kind = {404: "not_found_error", 503: "service_unavailable"}.get(status,
                                                                     "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}


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


def response(rid: str, w, messages: list, tokenizer, model: str) -> dict:
    """A call's answer in OpenAI's chat.completion form, with vLLM's token-id fields and ours
    (`overridden`) where they apply. w: the call as the engine served it (agents.Work: its
    Request, prompt ids, what each choice wrote and how it ended, `overridden`); messages:
    each choice as a response message."""
    choices, req = [], w.req
    for j, ((ids, logp, _), how, message) in enumerate(zip(w.written, w.how, messages)):
        c = {"index": j, "message": message, "logprobs": None, "finish_reason":
             "tool_calls" if message.get("tool_calls") else how}
        if req.logprobs:
            tokens = tokenizer.convert_ids_to_tokens(ids)
            c["logprobs"] = {"content": [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(tokens, logp)]}
        if req.token_ids:
            c["token_ids"] = list(ids)
        choices.append(c)
    done = sum(len(ids) for ids, _, _ in w.written)
    out = {"id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()),
           "model": model, "choices": choices,
           "usage": {"prompt_tokens": len(w.prompt), "completion_tokens": done,
                     "total_tokens": len(w.prompt) + done}}
    if req.token_ids:
        out["prompt_token_ids"] = list(w.prompt)
    if w.overridden:
        out["overridden"] = w.overridden
    return out


# ----------------------------------------------------------------------------------------------
# the endpoint


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
    closed = False  # set by Endpoint.close: a kept-alive connection outlives the listener

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
        while not call.done.wait(0.2):  # nobody drains the queue once the endpoint is closed
            if self.closed:
                call.answer(503, error_body("the rollout is over", 503))
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
        self.handler = type("Handler", (_Handler,), {"calls": calls, "model": model})
        self.server = _Server(("127.0.0.1", 0), self.handler)
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.02,),
                                       daemon=True)  # (close() waits up to that poll interval)
        self.thread.start()

    def url(self, key: str) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/e/{key}/v1"

    def close(self) -> None:
        self.handler.closed = True  # (a call on a connection kept alive is refused, not lost)
        self.server.shutdown()
        self.server.server_close()
