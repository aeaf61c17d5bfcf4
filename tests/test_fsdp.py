"""FSDP2 sharded training on 2 gloo ranks equals unsharded training."""

import pytest
import torch

import fsdp_utils
from conftest import launch


@pytest.mark.parametrize("arch, reshard, ckpt", [("qwen2", "1", "0"), ("qwen3", "0", "1")],
                         ids=["qwen2-zero3", "qwen3-zero2-gradckpt"])
def test_sharded_equals_unsharded(tiny_models, arch, reshard, ckpt):
    out = launch(["tests/workers/fsdp_parity.py", tiny_models[arch], reshard, ckpt])
    assert out.count("FSDP_PARITY_OK") == 2


def test_shard_adamw_and_clip_equal_torch_s_on_dtensors_and_leave_nothing_growing():
    """tests/workers/shard_adamw.py: fsdp_utils.ShardAdamW and clip_grad_norm, on each rank's
    shards, against torch's AdamW and clip_grad_norm_ on the DTensors, bitwise, then no kind of
    object growing step by step (torch 2.10's and 2.11's DTensor ops leak; this lane's torch
    version decides whether the reference's own steps would fail that check)."""
    out = launch(["tests/workers/shard_adamw.py"])
    assert out.count("SHARD_ADAMW_OK") == 2, out[-3000:]


def test_shard_adamw_refuses_the_options_its_step_does_not_run():
    params = torch.nn.Linear(2, 2).parameters()
    with pytest.raises(ValueError, match=r"^ShardAdamW runs plain AdamW; amsgrad, fused is not "):
        fsdp_utils.ShardAdamW(params, lr=1e-3, amsgrad=True, fused=True, foreach=None)


@pytest.mark.parametrize("reshard", ["1", "0"], ids=["zero3", "zero2"])
def test_offload_round_trip_is_exact(tiny_models, reshard):
    out = launch(["tests/workers/offload_parity.py", tiny_models["qwen2"], reshard])
    assert out.count("OFFLOAD_PARITY_OK") == 2, out[-3000:]


def test_an_update_with_no_gradient_keeps_its_norm_on_the_parameters_device():
    """No rank had a token to learn from: no parameter has a gradient, and torch's
    clip_grad_norm_ returns a CPU zero, which the update then stacks with its device tensors (a
    raise on GPU and NPU). The meta device stands in for an accelerator here."""
    with torch.device("meta"):
        model = torch.nn.Linear(4, 4)
    norm = fsdp_utils.clip_grad_norm(model, 1.0)
    assert norm.device.type == "meta" and norm.shape == ()
