"""2 ranks: moving the FSDP2 actor and its optimizer state to host memory (the engine's turn,
weight_sync.EngineTurn, with offload.HostCopy) frees their storage, and bringing them back
restores both bit for bit; training, with a KL term to a frozen reference that is in host memory
between its passes (offload.to_host), goes on exactly as without the moves.

On CPU host and device memory are one, so `.device` cannot tell where a tensor's bytes are. What
the test checks instead holds on every platform: while in host memory (and after a garbage
collection), every tensor the actor, its optimizer and the reference hold (FSDP2's padded shard
storage included) is the same object as before and owns 0 bytes, no other live tensor keeps one
of the storages from before the move alive with bytes in it, nothing was rebuilt (a DTensor
rebuilt from a host copy lands on its mesh's device: that defect freed nothing on a GPU), the
host arenas hold exactly the copied bytes and are allocated once, and a change made to a host
buffer comes back with the move to the device. With reshard_after_forward=false (argv[2] = 0) the
reference's no-grad forward leaves its units gathered: the move to host memory must still leave
its shards with 0 bytes.
Usage: torchrun --nproc_per_node 2 tests/workers/offload_parity.py MODEL_DIR RESHARD(1|0)
"""

import gc
import sys
import types
import weakref

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import fsdp_utils
import grpo
import offload
import rollout
import weight_sync
from records import Sample
from tests.reference import batch_of, settings, update
from train_grpo import init_distributed

model_dir, reshard = sys.argv[1], sys.argv[2] == "1"
rank, world = init_distributed()
mesh = init_device_mesh("cpu", (world,))
mc = fsdp_utils.ModelConfig(path=model_dir, param_dtype="float32", reshard_after_forward=reshard)
oc = fsdp_utils.OptimConfig(lr=1e-2, weight_decay=0.01)
actors = [fsdp_utils.build_actor(mc, mesh) for _ in range(2)]  # [moved, plain], same weights
refs = [fsdp_utils.build_actor(mc, mesh, reference=True) for _ in range(2)]
opts = [fsdp_utils.build_optimizer(oc, a, 10)[0] for a in actors]
# the turn's engine, idle: its wakes and sleep do nothing, and it takes the pushed weights unread
# (the push's generator never runs, so nothing is gathered): only the moves are under test
engine = types.SimpleNamespace(cfg=rollout.RolloutConfig(), lora=None, wake=lambda tags: None,
                               load_weights=lambda pairs: None, sleep=lambda: None)
turn = weight_sync.EngineTurn(actors[0], opts[0], engine, offload_on=True)
g = grpo.GRPOConfig(is_correction="none", micro_batch_tokens=32, kl_coef=0.1)


def local(t):
    """The tensor object a DTensor holds (to_local() of a parameter returns a fresh view)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def tensors(actor, opt=None):
    """Every shard (local part), buffer and optimizer state tensor, in a fixed order."""
    out = [local(p) for p in actor.parameters()] + list(actor.buffers())
    for state in opt.state.values() if opt is not None else ():
        out += [local(v) for v in state.values() if torch.is_tensor(v)]
    return out


def fsdp_internal(model):
    """FSDP2's own references to each shard: the padded flat storage and the registered one."""
    out = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            for fp in group.fsdp_params if group else ():
                out += [fp._sharded_param_data, fp.sharded_param._local_tensor]
    return out


def train_step(actor, ref, opt, step):
    gen = torch.Generator().manual_seed(100 + step)
    samples = [Sample(torch.randint(3, 15, (4,), generator=gen).tolist(),
                      torch.randint(3, 15, (3 + i,), generator=gen).tolist(), [0.0] * (3 + i),
                      False) for i in range(4)]
    mine = list(range(rank, 4, world))
    adv = torch.randn(4, generator=gen)
    update(actor, ref, opt, batch_of([samples[i] for i in mine], adv[mine], step),
           settings(g, max_len=8, grad_clip=1.0))


def owns_nothing(held) -> bool:
    return all(t.untyped_storage().nbytes() == 0 for t in held)


rebuilt = []  # a spy: any DTensor rebuilt from a local tensor during a move
from_local = DTensor.from_local
DTensor.from_local = staticmethod(lambda *a, **k: rebuilt.append(a) or from_local(*a, **k))
host_ptrs = None
for step in range(4):
    # the reference is in host memory between its passes, whatever its units' state after them
    assert owns_nothing(tensors(refs[0]) + fsdp_internal(refs[0])), "the reference holds bytes"
    if step > 0:  # the optimizer has state from the first step on
        held = tensors(actors[0], opts[0]) + fsdp_internal(actors[0])
        before = [t.clone() for t in held]
        storages = [weakref.ref(t.untyped_storage()) for t in held if t.numel()]
        pre_bytes = sum({id(s()): s().nbytes() for s in storages}.values())
        assert len(held) > 0 and pre_bytes > 0
        with turn:  # in: the optimizer state, then the actor, to host memory; out: both back
            gc.collect()
            assert not rebuilt, "to_host rebuilt a tensor"
            after = tensors(actors[0], opts[0]) + fsdp_internal(actors[0])
            assert all(a is b for a, b in zip(after, held)), "to_host replaced a tensor"
            assert owns_nothing(after), "to_host left bytes behind"
            alive = {id(s()): s() for s in storages if s() is not None}
            leaks = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)
                     and not isinstance(o, DTensor) and not o.is_meta
                     and id(o.untyped_storage()) in alive and o.untyped_storage().nbytes() > 0]
            assert not leaks, f"{len(leaks)} live tensors still hold storage from before the move"
            copies = (turn.params, turn.state)
            chunks = [c for p in copies for c in p.arena.chunks]
            assert all(c.device.type == "cpu" for c in chunks)
            ptrs = [c.data_ptr() for c in chunks]
            assert host_ptrs in (None, ptrs), "host memory allocated again"
            assert [p.allocations for p in copies] == [1, 1]
            host_ptrs = ptrs
            # every byte, once, in host memory of exactly that size
            assert sum(sum(p.layout) if p.away else 0 for p in copies) == pre_bytes
            assert sum(c.numel() for c in chunks) == pre_bytes, (sum(map(len, chunks)), pre_bytes)
            if step == 2:  # what comes back is the host memory: a change to it must come back
                storage, offset = turn.params.away[0]
                assert storage is held[0].untyped_storage() and offset == 0
                n = held[0].numel() * held[0].element_size()
                turn.params.arena.chunks[0][:n].view(torch.float32).fill_(7.0)
        assert not rebuilt, "to_device rebuilt a tensor"
        back = tensors(actors[0], opts[0]) + fsdp_internal(actors[0])
        assert all(a is b for a, b in zip(back, held)), "to_device replaced a tensor"
        if step == 2:
            assert bool((back[0] == 7.0).all()), "to_device did not return the host memory"
            with torch.no_grad():  # the saved bits again, exactly
                back[0].copy_(before[0])
        assert all(torch.equal(a, b) for a, b in zip(back, before)), "to_device changed a value"
    for actor, ref, opt in zip(actors, refs, opts):
        train_step(actor, ref, opt, step)
    same = all(torch.equal(a, b) for a, b in zip(tensors(actors[0], opts[0]),
                                                 tensors(actors[1], opts[1])))
    print(f"rank {rank} step {step}: moved == plain bit for bit: {same}", flush=True)
    assert same
# the reference's host memory too: allocated at its first move there, reused over every step since
ref_copy = offload._COPIES[refs[0]]
assert ref_copy.allocations == 1, ref_copy.allocations
assert ref_copy.host_bytes == (sum(ref_copy.layout) if ref_copy.away else 0) > 0
dist.destroy_process_group()
print("OFFLOAD_PARITY_OK")
