"""What only an accelerator shows, on whichever one is present (an NVIDIA GPU or an Ascend NPU):
memory given back, bf16 numerics, the device's kernels against their plain-torch references,
device placement after an empty update or a caught error (marker `device`).

Skipped on CPU, so CI collects them and skips them with the reason; `scripts/gpu_check.sh` and
`scripts/npu_check.sh` run them on a machine with the accelerator and vLLM.
"""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from modeling import kernels
import npu_ops
from tasks import tiny_task
from conftest import ROOT, launch, python_path

DEVICE = npu_ops.device_type()
pytestmark = [pytest.mark.device, pytest.mark.skipif(
    DEVICE == "cpu", reason="needs a GPU or an NPU, and vLLM (scripts/gpu_check.sh, "
                            "scripts/npu_check.sh)")]
# the tiny task's model and engine dtype here: configs/tiny_cpu.yaml's float32 where the
# platform's attention takes it, else the first its kernels take (bf16 on an NPU:
# npu_ops.engine_dtypes); the engine/trainer logprob gap allowed after three steps in it (bf16:
# device_checks.py's bound for the tiny model's 2 layers)
ENGINE_DTYPE = (npu_ops.engine_dtypes() or ("float32",))[0]
DTYPE_ARGS = [f"--model.param_dtype={ENGINE_DTYPE}", f"--rollout.dtype={ENGINE_DTYPE}"]
GAP_BOUND = 1e-3 if ENGINE_DTYPE == "float32" else 2 * (2 * 2 + 2) * 2.0**-8
# lines that say the device's runtime failed: CUDA's, or CANN's error codes (EZ9999, ...) and
# torch_npu's (ERR00100, ...)
RUNTIME_ERROR = r"CUDA [Ee]rror|\bE[A-Z][0-9]{4}\b|\bERR[0-9]{5}\b"


def runtime_errors(text: str) -> list:
    import re

    return re.findall(RUNTIME_ERROR, text)


@pytest.fixture(scope="module")
def model_dir():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from common import random_qwen2

    # ~100M parameters (head_dim 128): 1.1 GB of fp32 shards and Adam state to move out
    return random_qwen2(hidden=1024, layers=8, rank=0)


def test_offload_frees_the_actor_sleep_frees_the_kv_cache_bf16_sync_matches(model_dir):
    out = launch(["tests/workers/device_checks.py", model_dir], nproc=1)
    assert "DEVICE_CHECKS_OK" in out, out[-4000:]
    print(next(line for line in out.splitlines() if line.startswith("{")))


@pytest.fixture
def restore_rotary():
    from transformers.models.qwen3 import modeling_qwen3

    saved = modeling_qwen3.apply_rotary_pos_emb
    yield
    modeling_qwen3.apply_rotary_pos_emb = saved


def test_the_device_kernels_match_their_plain_torch_references(restore_rotary):
    """The kernel path `model.fused_kernels` takes on this device (the NPU's fused kernels;
    on a GPU the compiled one) against the plain-torch path, on the device in bf16: logits and
    gradients within bf16 rounding of a small Qwen3 (a few units of 2^-8, relative)."""
    path = "fused" if DEVICE == "npu" else "compiled"
    device = npu_ops.local_device()
    model = tiny_task.build_tiny_model(15, 1, 0, seed=3, arch="qwen3").to(device, torch.bfloat16)
    patched = copy.deepcopy(model)
    ids = torch.randint(0, 15, (3, 33), generator=torch.Generator().manual_seed(0)).to(device)
    results = []
    for m, kind in ((model, "reference"), (patched, path)):  # in turn: the rotary patch is the
        kernels.patch_qwen(m, kind)  # modeling module's, shared by both models
        logits = m(input_ids=ids).logits.float()
        logits.square().mean().backward()
        results.append((logits.detach(), {n: p.grad.float() for n, p in m.named_parameters()}))
    (want, want_grads), (got, got_grads) = results
    scale = want.abs().max()
    assert (got - want).abs().max() <= 8 * 2.0**-8 * scale, path
    for name, grad in want_grads.items():
        assert (got_grads[name] - grad).abs().max() <= 16 * 2.0**-8 * grad.abs().max(), name


@pytest.mark.skipif(DEVICE != "npu", reason="the NPU's fused attention only")
def test_fusion_attention_matches_sdpa_on_the_npu():
    """npu_ops.fusion_attention on the NPU: the model's packed forward (one row of five samples,
    TND, the samples' ends as host integers) against transformers' SDPA on each sample alone, in
    bf16 (the CPU test of the same, against a stand-in of the kernel: test_npu_attention.py)."""
    import logprobs
    from test_npu_attention import models, varied_samples

    device = npu_ops.local_device()
    fused, twin = (m.to(device, torch.bfloat16) for m in models())
    samples = varied_samples()
    mb = logprobs.micro_batch(samples, 0, True, fused.config)
    inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in mb.inputs.items()}
    with torch.no_grad():
        logits = fused(**inputs).logits[0].float()
        start = 0
        for sample in samples:
            ids = torch.tensor([sample.prompt_ids + sample.response_ids], device=device)
            want = twin(input_ids=ids).logits[0].float()
            got = logits[start:start + ids.shape[1]]
            assert (got - want).abs().max() <= 8 * 2.0**-8 * want.abs().max(), start
            start += ids.shape[1]


def test_twenty_steps_exit_cleanly(tmp_path):
    """The tiny task for 20 steps on one device, in ENGINE_DTYPE: exit code 0, the reward
    rising, and no runtime error line at the engine's shutdown (vLLM's sleeping memory pool
    used to fail there on CUDA)."""
    cmd = [sys.executable, "train_grpo.py", "--config", "configs/tiny_cpu.yaml",
           "--train.steps=20", "--log.eval_every=20", f"--log.out_dir={tmp_path}",
           f"--data.tiny_task_dir={tmp_path / 'task'}", *DTYPE_ARGS]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(cmd, cwd=ROOT, env={**env, "PYTHONPATH": python_path()},
                          capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert not runtime_errors(out), out[-4000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(1, 21))
    # model.offload auto: on with sleep. The pinned host memory is the copied bytes exactly (no
    # power-of-two rounding by the pinned allocator: offload.HostArena), the same every step
    copied = rows[-1]["offload_host_gb"]
    assert copied > 0 and all(r["offload_host_gb"] == copied for r in rows[1:])
    freed = rows[-1]["mem_actor_out_before_gb"] - rows[-1]["mem_actor_out_after_gb"]
    assert freed > 0, rows[-1]
    first, last = (sum(r["reward_mean"] for r in part) / 5 for part in (rows[:5], rows[-5:]))
    assert last > first, (first, last)


def test_a_step_after_a_caught_ctrl_c(tmp_path):
    """Ctrl-C in a reward, caught, with the offload on and a reference, on one device: the next
    steps run (before the engine's turn was guarded, the actor stayed in host memory and the
    next step read freed memory), and the engine still agrees with the trainer after the next
    syncs (in ENGINE_DTYPE)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "tests/workers/caught_error.py", "tiny", "reward",
                           str(tmp_path / "task"), str(tmp_path / "run"), str(tmp_path / "last"),
                           *DTYPE_ARGS],
                          cwd=ROOT, env={**env, "PYTHONPATH": python_path()}, capture_output=True,
                          text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "CAUGHT" in proc.stdout, out[-4000:]
    assert not runtime_errors(out), out[-4000:]
    last = json.load(open(tmp_path / "last.json"))
    assert last["step"] == 3 and last["logp_gap"] < GAP_BOUND and last["offload_host_gb"] > 0, last
