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

import re

import plugins
import sandbox


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
