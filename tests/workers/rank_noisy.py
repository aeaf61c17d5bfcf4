"""An environment and a reward whose answers depend on the rank that calls them, each call
written down with that rank (tests/test_e2e.py: tensor-parallel episodes). Worker processes
inherit the rank's environment: RANK is the calling rank's."""

import os

from collect import envs
import rewards


def _note(kind: str) -> str:
    rank = os.environ.get("RANK", "0")
    with open(os.environ["CALLS_LOG"], "a") as f:
        f.write(f"{kind} {rank}\n")
    return rank


def env(messages, example):
    rank = _note("env")
    reply = envs.retry(messages, example)
    return None if reply is None else reply + rank  # another prompt on each rank


def reward(completion, example):
    return rewards.tiny_sum(completion, example) + 0.5 * int(_note("reward"))
