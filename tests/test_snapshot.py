"""snapshot.py without an engine: an FSDP2 actor, AdamW and its schedule, taken aside and put
back, against the same steps taken once (bit for bit); a snapshot from before the optimizer had
state, restored into one that has it and back; on disk as in memory; the refusal when the
host has no room. The steps draw their inputs from torch's generator, so a restore that left
the generators where they were would give other steps. The trainer's own loop, with the engine,
is tests/test_rewind.py."""

import types

import pytest
import torch

import offload
from workflows import snapshot


class Positions:
    """A sampler stand-in: snapshot() and rewind() of a data position."""

    def __init__(self):
        self.drawn = 0

    def snapshot(self):
        return {"drawn": self.drawn}

    def rewind(self, state):
        self.drawn = state["drawn"]


def step(run) -> None:
    """A training step whose input is drawn from torch's default generator."""
    ids = torch.randint(0, run.actor.config.vocab_size, (2, 8))
    run.actor(input_ids=ids).logits.float().pow(2).mean().backward()
    run.opt.step()
    run.opt.zero_grad(set_to_none=True)
    run.sched.step()
    run.step += 1
    run.sampler.drawn += 2


def local(t):
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def state(run) -> dict:
    out = {f"p {n}": local(p) for n, p in run.actor.named_parameters()}
    for i, p in enumerate(q for g in run.opt.param_groups for q in g["params"]):
        out.update({f"o {i} {k}": local(v) for k, v in run.opt.state.get(p, {}).items()})
    out["lr"] = torch.tensor(run.sched.get_last_lr())
    out["drawn"] = torch.tensor(run.sampler.drawn)
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def run(tiny_models, tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp_utils

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        actor = fsdp_utils.build_actor(fsdp_utils.ModelConfig(path=tiny_models["qwen2"],
                                                              param_dtype="float32"),
                                       init_device_mesh("cpu", (1,)))
        cfg = fsdp_utils.OptimConfig(lr=1e-2, warmup_steps=3, schedule="cosine")
        opt, sched = fsdp_utils.build_optimizer(cfg, actor, total_steps=10)
        yield types.SimpleNamespace(actor=actor, opt=opt, sched=sched, sampler=Positions(),
                                    step=0, applied={"a": 1}, last=None, turn=None)
    finally:
        dist.destroy_process_group()


def test_restored_runs_take_the_same_steps_bit_for_bit(run, tmp_path):
    s0 = snapshot.take(run)  # Adam has no state yet
    assert s0.bytes == sum(p.numel() * 4 for p in run.actor.parameters())
    step(run), step(run)
    after2 = state(run)
    s2, s2_disk = snapshot.take(run), snapshot.take(run, str(tmp_path / "snap"))
    assert s2.bytes == s2_disk.bytes == 3 * s0.bytes + 4 * len(list(run.actor.parameters()))
    step(run)
    after3 = state(run)
    assert not same(after2, after3)

    snapshot.restore(run, s0)
    assert not run.opt.state and run.step == 0  # the state it had then: none
    step(run), step(run)
    assert same(state(run), after2), "the steps after a restore are not the first run's"

    snapshot.restore(run, s0)
    snapshot.restore(run, s2)  # into an optimizer without state: its tensors made again
    assert same(state(run), after2) and run.step == 2
    step(run)
    assert same(state(run), after3)

    snapshot.restore(run, s2_disk)
    assert same(state(run), after2)
    step(run)
    assert same(state(run), after3)


def test_no_room_refuses_in_one_line_before_any_copy(run, monkeypatch):
    monkeypatch.setattr(offload, "host_memory_available", lambda: 1000)
    with pytest.raises(MemoryError) as e:
        snapshot.take(run)
    message = str(e.value)
    assert len(message.splitlines()) == 1 and "host memory" in message
    assert "run.snapshot(path=DIR)" in message and "1 rank(s)" in message
