"""Plugins for the notebook tests: a reward and an environment that raise KeyboardInterrupt once,
as Ctrl-C in a notebook would, when `ARMED` is set (tests/workers/caught_error.py sets it),
otherwise the built-in task's; and a reward that gives every sample 0."""

from collect import envs
import rewards

ARMED = False


def _fire() -> None:
    global ARMED
    if ARMED:
        ARMED = False
        raise KeyboardInterrupt


def reward(completion: str, example: dict) -> float:
    _fire()
    return rewards.tiny_sum(completion, example)


def env(messages: list, example: dict):
    _fire()
    return envs.retry(messages, example)


def nothing(completion: str, example: dict) -> float:
    """Every sample scores 0: every group constant, so dynamic sampling drops them all."""
    return 0.0
