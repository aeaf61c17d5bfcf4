"""Functions for the worker pool's tests (tests/test_plugins.py): each returns which process ran
it, or does what example["mode"] says: sleep example["s"] seconds, hang, raise, exit, block."""

import asyncio
import os
import time

import plugins


def resolve(spec: str):
    return plugins.resolve(spec, "test", {}, "fn(x, example)")


def nap(x, example):
    mode = example.get("mode")
    if mode == "hang":
        time.sleep(3600)
    if mode == "boom":
        raise RuntimeError("boom")
    if mode == "bad":
        raise ValueError("bad")
    if mode == "die":
        os._exit(3)
    time.sleep(example.get("s", 0.0))
    return f"{x}@{os.getpid()}"


async def anap(x, example):
    mode = example.get("mode")
    if mode == "hang":
        await asyncio.sleep(3600)
    if mode == "block":  # synchronous code in a coroutine: the event loop stops with it
        time.sleep(3600)
    if mode == "boom":
        raise RuntimeError("boom")
    await asyncio.sleep(example.get("s", 0.0))
    if mode == "late":  # fails once its nap is over
        raise RuntimeError("late")
    return f"{x}@{os.getpid()}"


async def leaky(x, example):
    """An OpenAI client made per call and dropped unclosed, as agents written after the `openai`
    package's examples leave theirs; first the ones earlier calls dropped are collected, so that
    their cleanup (openai's AsyncHttpxClientWrapper.__del__: aclose() on the running loop) runs
    on this call's loop."""
    import gc

    from openai import AsyncOpenAI

    gc.collect()
    client = AsyncOpenAI(base_url=example["url"], api_key="unused", max_retries=0)
    await client.models.list()
    return f"{x}@{os.getpid()}"
