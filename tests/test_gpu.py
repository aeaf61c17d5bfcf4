"""What only an accelerator shows: memory given back, bf16 numerics, device placement after an
empty update or a caught error (marker `gpu`).

Skipped without a CUDA GPU, so CI (CPU) collects them and skips them with the reason;
`scripts/gpu_check.sh` runs them on a machine with a GPU and vLLM.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, launch, python_path

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU and vLLM (scripts/gpu_check.sh)")]


@pytest.fixture(scope="module")
def model_dir():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from common import random_qwen2

    # ~100M parameters (head_dim 128): 1.1 GB of fp32 shards and Adam state to move out
    return random_qwen2(hidden=1024, layers=8, rank=0)


def test_offload_frees_the_actor_sleep_frees_the_kv_cache_bf16_sync_matches(model_dir):
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
    proc = subprocess.run(cmd, cwd=ROOT, env={**env, "PYTHONPATH": python_path()},
                          capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "CUDA Error" not in out and "CUDA error" not in out, out[-4000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # model.offload auto: on with sleep. The pinned host memory is the copied bytes exactly (no
    # power-of-two rounding by the pinned allocator: offload.HostArena), the same every step
    copied = rows[-1]["offload_host_gb"]
    assert copied > 0 and all(r["offload_host_gb"] == copied for r in rows[1:])
    freed = rows[-1]["mem_actor_out_before_gb"] - rows[-1]["mem_actor_out_after_gb"]
    assert freed > 0, rows[-1]


def test_a_step_after_a_caught_ctrl_c(tmp_path):
    """Ctrl-C in a reward, caught, with the offload on and a reference, on one GPU: the next
    steps run (before the engine's turn was guarded, the actor stayed in host memory and the
    next step read freed memory), and the engine still agrees with the trainer after the next
    syncs."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "tests/workers/caught_error.py", "tiny", "reward",
                           str(tmp_path / "task"), str(tmp_path / "run"), str(tmp_path / "last")],
                          cwd=ROOT, env={**env, "PYTHONPATH": python_path()}, capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "CAUGHT" in proc.stdout, out[-4000:]
    assert "CUDA Error" not in out and "CUDA error" not in out, out[-4000:]
    last = json.load(open(tmp_path / "last.json"))
    assert last["step"] == 3 and last["logp_gap"] < 1e-3 and last["offload_host_gb"] > 0, last
