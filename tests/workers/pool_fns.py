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
    return f"{x}@{os.getpid()}"
