"""offload.py on one process: the host arena's exact size, a round trip to host memory across
chunk boundaries, the engine's turn (weight_sync.EngineTurn) that restores everything whatever
raised, the host memory check. (2 ranks with FSDP2, a reference and ZeRO-2:
tests/workers/offload_parity.py, via test_fsdp.)"""

import pytest
import torch

import offload
import weight_sync
from rollout import RolloutConfig


def test_power_of_two_parts_add_up_exactly():
    for n in (1, 2, 3, 13, 4096, 4097, 2**31 + 12345):
        parts = offload.power_of_two_parts(n)
        assert sum(parts) == n and len(set(parts)) == len(parts)
        assert all(p & (p - 1) == 0 for p in parts) and parts == sorted(parts, reverse=True)
    assert offload.power_of_two_parts(13) == [8, 4, 1]


class Odd(torch.nn.Module):
    """Parameters and a buffer of odd byte sizes, so that tensors straddle the arena's chunks."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.a = torch.nn.Parameter(torch.randn(7, 3, generator=gen, dtype=torch.float16))
        self.b = torch.nn.Parameter(torch.randn(1001, generator=gen))
        self.register_buffer("c", torch.randint(0, 100, (13,), generator=gen, dtype=torch.int8))

    def forward(self, x):
        return x * self.b.sum()


class FakeEngine:
    """What the engine's turn asks of an engine, raising Ctrl-C where `fail` says."""

    def __init__(self, fail: str):
        self.cfg, self.lora, self.fail = RolloutConfig(), None, fail
        self.awake, self.sleeps = False, 0

    def wake(self, tags):
        if self.fail == f"wake {tags[0]}":
            raise KeyboardInterrupt
        self.awake = True

    def load_weights(self, pairs):
        pass

    def sleep(self):
        self.awake, self.sleeps = False, self.sleeps + 1


def storages(model):
    return [t.untyped_storage() for t in [*model.parameters(), *model.buffers()]]


def test_a_round_trip_is_exact_in_host_memory_of_exactly_its_size():
    model, copy = Odd(), offload.HostCopy()
    want = [t.detach().clone() for t in [*model.parameters(), *model.buffers()]]
    total = sum(s.nbytes() for s in storages(model))  # 42 + 4004 + 13 bytes
    assert total == 4059
    for _ in range(3):
        copy.to_host(model)
        assert all(s.nbytes() == 0 for s in storages(model))
        assert sum(copy.layout) == copy.host_bytes == total
        assert len(copy.arena.chunks) == bin(total).count("1")  # tensors straddle chunks
        with pytest.raises(RuntimeError, match="host memory"):
            model(torch.ones(1))  # a model whose weights are on the host refuses to run
        copy.to_device()
        got = [*model.parameters(), *model.buffers()]
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert model(torch.ones(1)).shape == (1,)
    assert copy.allocations == 1


@pytest.mark.parametrize("where", ["wake weights", "wake kv_cache", "in the turn"])
def test_leaving_the_engine_turn_restores_everything_whatever_raised(where):
    """Ctrl-C when the engine's weights wake (the optimizer state already on the host), when its
    KV cache wakes (the actor too), or inside the turn: the engine asleep, and the actor and its
    optimizer state back on the device, bit for bit, the model runnable again."""
    model = Odd()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(1)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    tensors = lambda: [*model.parameters(), *model.buffers(),  # noqa: E731
                       *(v for s in opt.state.values() for v in s.values())]
    want = [t.detach().clone() for t in tensors()]
    engine = FakeEngine(where)
    turn = weight_sync.EngineTurn(model, opt, engine, offload_on=True)
    with pytest.raises(KeyboardInterrupt):
        with turn:
            assert all(t.untyped_storage().nbytes() == 0 for t in tensors())
            raise KeyboardInterrupt
    assert engine.sleeps == 1 and not engine.awake
    assert all(torch.equal(t, w) for t, w in zip(tensors(), want))
    assert model(torch.ones(1)).shape == (1,)  # the guard is gone
    assert not turn.params.away and not turn.state.away
    metrics = turn.metrics()
    assert {"offload_out_time_s", "offload_in_time_s", "offload_host_gb"} <= set(metrics)
    held = turn.params.host_bytes + turn.state.host_bytes
    assert metrics["offload_host_gb"] * 2**30 == held
    if where != "wake weights":  # both moves out happened: every storage has its host copy
        assert held == sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                            for t in tensors()}.values())


def test_a_tensor_in_an_internal_npu_format_is_refused_before_anything_moves(monkeypatch):
    """vLLM-Ascend turns internal tensor formats on for the whole process, the trainer's too
    (0.23 worker/model_runner_v1.py:201). A storage in FRACTAL_NZ (29) does not hold the
    tensor's elements in order: the offload, which copies and frees storages byte for byte,
    refuses it with one line before it copies or frees anything. A stand-in torch_npu answers
    get_npu_format as torch_npu does: an int, 2 for ND."""
    import types

    import npu_ops

    model = Odd()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    nz = model.b.untyped_storage().data_ptr()
    monkeypatch.setattr(npu_ops, "STAND_IN", types.SimpleNamespace(
        get_npu_format=lambda t: 29 if t.untyped_storage().data_ptr() == nz else 2))
    copy = offload.HostCopy()
    with pytest.raises(ValueError, match=r"shape \(1001,\) is stored in the device's internal "
                                         r"format 29, not ND"):
        copy.to_host(model)
    assert copy.arena is None and copy.away == [] and copy.guard is None
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())
    monkeypatch.setattr(npu_ops, "STAND_IN", types.SimpleNamespace(get_npu_format=lambda t: 2))
    copy.to_host(model)  # ND everywhere: moves
    assert model.b.untyped_storage().nbytes() == 0
    copy.to_device()
    assert all(torch.equal(t, before[n]) for n, t in model.state_dict().items())


def test_host_memory_check(tiny_models):
    from transformers import AutoModelForCausalLM

    n = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(
        tiny_models["qwen2"]).parameters())
    need = offload.host_bytes_per_rank(tiny_models["qwen2"], 2, True, torch.bfloat16)
    assert need == -(-n // 2) * (12 + 2)
    assert offload.host_bytes_per_rank(tiny_models["qwen2"], 1, False, None) == 0
    offload.check_host_memory(need, 8, 8 * need)  # fits exactly
    offload.check_host_memory(need, 8, None)  # nothing known: no check
    with pytest.raises(ValueError, match=r"model.offload: 8 rank\(s\)") as e:
        offload.check_host_memory(need, 8, 8 * need - 1)
    assert len(str(e.value).splitlines()) == 1 and "Fix:" in str(e.value)
