"""What only an accelerator shows: memory given back and bf16 numerics (marker `gpu`).

Skipped without a CUDA GPU, so CI (CPU) collects them and skips them with the reason;
`scripts/gpu_check.sh` runs them on a machine with a GPU and vLLM.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, launch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU and vLLM (scripts/gpu_check.sh)")]


@pytest.fixture(scope="module")
def model_dir():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from common import random_qwen2

    # ~100M parameters (head_dim 128): 1.1 GB of fp32 shards and Adam state to move out
    return random_qwen2(hidden=1024, layers=8, rank=0)


def test_switch_frees_the_actor_sleep_frees_the_kv_cache_bf16_sync_matches(model_dir):
    out = launch(["tests/workers/gpu_checks.py", model_dir], nproc=1)
    assert "GPU_CHECKS_OK" in out, out[-4000:]
    print(next(line for line in out.splitlines() if line.startswith("{")))


def test_few_steps_exit_cleanly(tmp_path):
    """The tiny task for a few steps on one GPU: exit code 0, and no CUDA error at the engine's
    shutdown (vLLM's sleeping memory pool used to fail there)."""
    cmd = [sys.executable, "train_grpo.py", "--config", "configs/tiny_cpu.yaml",
           "--train.steps=4", "--log.eval_every=2", f"--log.out_dir={tmp_path}",
           f"--data.tiny_task_dir={tmp_path / 'task'}"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(cmd, cwd=ROOT, env={**env, "PYTHONPATH": ROOT}, capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "CUDA Error" not in out and "CUDA error" not in out, out[-4000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["switch_out_time_s"] > 0 for r in rows)  # model.offload auto: on with sleep
