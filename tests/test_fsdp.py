"""FSDP2 sharded training on 2 gloo ranks equals unsharded training."""

import pytest

from conftest import launch


@pytest.mark.parametrize("reshard", ["1", "0"], ids=["zero3", "zero2"])
def test_sharded_equals_unsharded(tiny_task_dir, reshard):
    out = launch(["tests/workers/fsdp_parity.py", f"{tiny_task_dir}/model", reshard])
    assert out.count("FSDP_PARITY_OK") == 2
