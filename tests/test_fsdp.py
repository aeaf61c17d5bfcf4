"""FSDP2 sharded training on 2 gloo ranks equals unsharded training."""

import pytest

from conftest import launch


@pytest.mark.parametrize("arch, reshard, ckpt", [("qwen2", "1", "0"), ("qwen3", "0", "1")],
                         ids=["qwen2-zero3", "qwen3-zero2-gradckpt"])
def test_sharded_equals_unsharded(tiny_models, arch, reshard, ckpt):
    out = launch(["tests/workers/fsdp_parity.py", tiny_models[arch], reshard, ckpt])
    assert out.count("FSDP_PARITY_OK") == 2


@pytest.mark.parametrize("reshard", ["1", "0"], ids=["zero3", "zero2"])
def test_offload_round_trip_is_exact(tiny_models, reshard):
    out = launch(["tests/workers/offload_parity.py", tiny_models["qwen2"], reshard])
    assert out.count("OFFLOAD_PARITY_OK") == 2, out[-3000:]
