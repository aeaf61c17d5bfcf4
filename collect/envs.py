"""Built-in environments for multi-turn rollouts (episodes.py runs them).

An environment is a function `fn(messages: list[dict], example: dict)` (or an `async def` one),
named in the `env:` config section like a reward: a built-in from ENVS, `package.module:function`
or `path/to/file.py:function`. After each model turn it gets the episode so far as chat messages
(the prompt's, each model turn as {"role": "assistant", ...}, each earlier reply) and the dataset
row, and returns its reply: text (a turn in the role of `env.reply_role`), a {"role", "content"}
message (e.g. role "tool" for a tool's output), or None when the episode is over. It runs in
worker processes (env.workers of them, or for an `async def` one an event loop with
env.concurrency calls at once) with a time limit per call, like the rewards; it keeps no state
between calls (derive it from the messages), so a cut call loses nothing but its own episode.

This module is what the environment worker imports (with the plugins named in the config): it
keeps to the standard library.
"""

import asyncio
import functools
import importlib.util
import inspect
import json
import math
import re
import weakref

from collect import sandbox
import plugins


def retry(messages: list[dict], example: dict):
    """The built-in task with a second chance: an answer that is not the right number alone gets
    the question again, and the model answers once more; the right one ends the episode. (Its
    reward, rewards.tiny_sum, scores the last answer.)"""
    if messages[-1]["content"].strip() == str(example["answer"]).strip():
        return None
    return example["prompt"]


_CODE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


def python_tool(messages: list[dict], example: dict):
    """Math with a Python tool: a model turn that holds a ```python block gets the output of its
    last block back as a tool message (sandbox.run_python: a confined child process); a turn
    without one is the final answer."""
    blocks = _CODE.findall(messages[-1]["content"])
    if not blocks:
        return None
    return {"role": "tool", "content": sandbox.run_python(blocks[-1])}


ENVS = {"retry": retry, "python": python_tool}
SIGNATURE = "def fn(messages: list[dict], example: dict) -> str | dict | None"


def resolve(spec: str):
    """The environment `spec` names (an ENVS key, module:function or file.py:function); raises a
    one-line ValueError naming env.name."""
    return plugins.resolve(spec, "env.name", ENVS, SIGNATURE)


def as_reply(value) -> dict | None:
    """An environment's answer as a message ({"role": None for the configured role, "content"}),
    or None when the episode is over; anything else is the environment's failure."""
    if value is None:
        return None
    if isinstance(value, str):
        return {"role": None, "content": value}
    if (isinstance(value, dict) and isinstance(value.get("role"), str)
            and isinstance(value.get("content"), str)):
        return {"role": value["role"], "content": value["content"]}
    raise TypeError(f"returned {value!r}: not text, a {{'role', 'content'}} message or None")


# ----------------------------------------------------------------------------------------------
# agents (env.kind "agent", agents.py): an async function that talks to the rollout's
# OpenAI-compatible endpoint, and the tool-call formats the endpoint parses

AGENT_SIGNATURE = ("async def agent(client, example: dict) -> float | tuple[float, dict]"
                   " (client: an openai.AsyncOpenAI; or base_url: str, the episode's URL)")


def resolve_agent(spec: str):
    """The agent `spec` names (module:function or file.py:function), an `async def` one, as an
    agent(base_url, example): one whose first parameter is `client` gets a ready client
    (`with_client`). Raises a one-line ValueError naming env.name."""
    fn = plugins.resolve(spec, "env.name", {}, AGENT_SIGNATURE)
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"env.name: {spec!r} is not an `async def` function; env.kind agent "
                         f"runs `{AGENT_SIGNATURE}`. Fix: make it async (an OpenAI client's "
                         "AsyncOpenAI calls), or use env.kind function")
    if next(iter(inspect.signature(fn).parameters), None) != "client":
        return fn
    if importlib.util.find_spec("openai") is None:
        raise ValueError(f"env.name: {spec!r} takes `client`, an openai.AsyncOpenAI, and the "
                         "openai package is not installed. Fix: pip install openai, or take "
                         "`base_url` and make your own client")
    return with_client(fn)


_CLIENTS = weakref.WeakKeyDictionary()  # an event loop -> the AsyncOpenAI its agents share


def with_client(fn):
    """`fn(client, example)` as an agent(base_url, example): `client` an openai.AsyncOpenAI at
    the episode's base URL, made from one client per event loop by with_options, which shares
    its HTTP connections (a fresh AsyncOpenAI builds an SSL context from the CA bundle first: 34
    ms on this project's CPU machine with openai 3.57 and httpx 0.28, against 0.07 ms for
    with_options; the endpoint speaks plain HTTP)."""

    @functools.wraps(fn)
    async def agent(base_url: str, example: dict):
        loop = asyncio.get_running_loop()
        if (shared := _CLIENTS.get(loop)) is None:
            from openai import AsyncOpenAI

            shared = _CLIENTS[loop] = AsyncOpenAI(base_url=base_url, api_key="unused")
        return await fn(shared.with_options(base_url=base_url), example)

    return agent


def as_outcome(value) -> tuple[float, dict | None]:
    """An agent's return as (reward, info): a finite number, or (number, dict); anything else
    is the agent's failure."""
    reward, info = value if isinstance(value, tuple) and len(value) == 2 else (value, None)
    if (isinstance(reward, bool) or not isinstance(reward, (int, float))
            or not math.isfinite(reward) or not (info is None or isinstance(info, dict))):
        raise TypeError(f"returned {value!r}: not a finite reward, nor (reward, dict)")
    return float(reward), info


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def hermes(text: str, tools: list[dict]) -> tuple[str, list[dict]]:
    """Tool calls written as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the
    Hermes format: Qwen2.5's and Qwen3's chat templates). Returns the text without them and
    each call as {"name", "arguments": a JSON string}. A block that is not such JSON stays in
    the text: the agent sees what the model wrote."""
    calls, kept = [], text
    for block in _TOOL_CALL.finditer(text):
        try:
            call = json.loads(block.group(1))
            name, arguments = call["name"], call.get("arguments", {})
        except (ValueError, TypeError, KeyError):
            continue
        if not isinstance(name, str):
            continue
        calls.append({"name": name, "arguments": arguments if isinstance(arguments, str)
                      else json.dumps(arguments, ensure_ascii=False)})
        kept = kept.replace(block.group(0), "", 1)
    return (kept.strip() if calls else text), calls


TOOL_PARSERS = {"hermes": hermes}
TOOL_PARSER_SIGNATURE = "def parse(text: str, tools: list[dict]) -> tuple[str, list[dict]]"


def resolve_tool_parser(spec: str):
    """The tool-call parser `spec` names (a TOOL_PARSERS key, module:function or
    file.py:function); raises a one-line ValueError naming env.tool_parser."""
    return plugins.resolve(spec, "env.tool_parser", TOOL_PARSERS, TOOL_PARSER_SIGNATURE)
