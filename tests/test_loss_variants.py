"""The update's first step under every loss aggregation equals the REINFORCE gradient (2 ranks)."""

from conftest import launch


def test_first_update_is_reinforce(tiny_models):
    out = launch(["tests/workers/reinforce_grad.py", tiny_models["qwen2"]])
    assert out.count("REINFORCE_OK") == 2, out[-3000:]
