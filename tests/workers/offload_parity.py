"""2 ranks: parking the FSDP2 actor and its optimizer state in host memory (ActorSwap) frees
their storage, and bringing them back restores both bit for bit; training goes on exactly as
without it.

On CPU host and device memory are one, so `.device` cannot tell where a tensor's bytes are. What
the test checks instead holds on every platform: after `out` (and a garbage collection), every
tensor the actor and its optimizer hold (FSDP2's padded shard storage included) is the same
object as before and owns 0 bytes, no other live tensor keeps one of the pre-switch storages
alive with bytes in it, nothing was rebuilt (a DTensor rebuilt from a host copy lands on its
mesh's device: that defect freed nothing on a GPU), and the bytes sit in host buffers that are
reused from one switch to the next; a change made to a host buffer comes back with `back`.
Usage: torchrun --nproc_per_node 2 tests/workers/offload_parity.py MODEL_DIR
"""

import gc
import sys
import weakref

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import fsdp_utils
import grpo
from rollout import Sample
from train_grpo import init_distributed

model_dir = sys.argv[1]
rank, world = init_distributed()
mesh = init_device_mesh("cpu", (world,))
mc = fsdp_utils.ModelConfig(path=model_dir, param_dtype="float32")
oc = fsdp_utils.OptimConfig(lr=1e-2, weight_decay=0.01)
actors = [fsdp_utils.build_actor(mc, mesh) for _ in range(2)]  # [swapped, plain], same weights
opts = [fsdp_utils.build_optimizer(oc, a, 10)[0] for a in actors]
swap = fsdp_utils.ActorSwap(actors[0], opts[0], enabled=True)
g = grpo.GRPOConfig(is_correction="none", micro_batch_tokens=32)


def local(t):
    """The tensor object a DTensor holds (to_local() of a parameter returns a fresh view)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def tensors(actor, opt):
    """Every shard (local part), buffer and optimizer state tensor, in a fixed order."""
    out = [local(p) for p in actor.parameters()] + list(actor.buffers())
    for state in opt.state.values():
        out += [local(v) for v in state.values() if torch.is_tensor(v)]
    return out


def fsdp_internal(actor):
    """FSDP2's own references to each shard: the padded flat storage and the registered one."""
    out = []
    for m in actor.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            for fp in group.fsdp_params if group else ():
                out += [fp._sharded_param_data, fp.sharded_param._local_tensor]
    return out


def train_step(actor, opt, step):
    gen = torch.Generator().manual_seed(100 + step)
    samples = [Sample(torch.randint(3, 15, (4,), generator=gen).tolist(),
                      torch.randint(3, 15, (3 + i,), generator=gen).tolist(), [0.0] * (3 + i),
                      False) for i in range(4)]
    mine = list(range(rank, 4, world))
    adv = torch.randn(4, generator=gen)
    grpo.accumulate_gradients(actor, [samples[i] for i in mine], adv[mine], None, None, g, 0,
                              "cpu", 1.0, 8)
    fsdp_utils.clip_grad_norm(actor, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


rebuilt = []  # a spy: any DTensor rebuilt from a local tensor during a switch
from_local = DTensor.from_local
DTensor.from_local = staticmethod(lambda *a, **k: rebuilt.append(a) or from_local(*a, **k))
host_ptrs = {}
for step in range(4):
    if step > 0:  # the optimizer has state from the first step on
        held = tensors(actors[0], opts[0]) + fsdp_internal(actors[0])
        before = [t.clone() for t in held]
        storages = [weakref.ref(t.untyped_storage()) for t in held if t.numel()]
        pre_bytes = sum({id(s()): s().nbytes() for s in storages}.values())
        assert len(held) > 0 and pre_bytes > 0
        swap.out()
        gc.collect()
        assert not rebuilt, "out rebuilt a tensor"
        after = tensors(actors[0], opts[0]) + fsdp_internal(actors[0])
        assert all(a is b for a, b in zip(after, held)), "out replaced a tensor"
        assert all(t.untyped_storage().nbytes() == 0 for t in after), "out left bytes behind"
        alive = {id(s()): s() for s in storages if s() is not None}
        leaks = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)
                 and not isinstance(o, DTensor) and not o.is_meta
                 and id(o.untyped_storage()) in alive and o.untyped_storage().nbytes() > 0]
        assert not leaks, f"{len(leaks)} live tensors still hold pre-switch storage"
        park = fsdp_utils._PARKS[actors[0]]
        ptrs = {k: b.data_ptr() for k, b in park.host.items()}
        assert all(b.device.type == "cpu" for b in park.host.values())
        assert all(ptrs[k] == p for k, p in host_ptrs.items()), "host buffers reallocated"
        host_ptrs = ptrs
        assert sum(b.numel() for _, b in park.away) == pre_bytes  # every byte, once
        if step == 2:  # what comes back is the host buffer: a change to it must come back
            storage, buf = park.away[0]
            assert storage is held[0].untyped_storage()  # the first shard views it from byte 0
            buf[:held[0].numel() * held[0].element_size()].view(torch.float32).fill_(7.0)
        swap.back()
        assert not rebuilt, "back rebuilt a tensor"
        back = tensors(actors[0], opts[0]) + fsdp_internal(actors[0])
        assert all(a is b for a, b in zip(back, held)), "back replaced a tensor"
        if step == 2:
            assert bool((back[0] == 7.0).all()), "back did not return the host buffer"
            with torch.no_grad():  # the saved bits again, exactly
                back[0].copy_(before[0])
        assert all(torch.equal(a, b) for a, b in zip(back, before)), "back changed a value"
        assert {"switch_out_time_s", "switch_in_time_s"} <= set(swap.metrics())
    for actor, opt in zip(actors, opts):
        train_step(actor, opt, step)
    same = all(torch.equal(a, b) for a, b in zip(tensors(actors[0], opts[0]),
                                                 tensors(actors[1], opts[1])))
    print(f"rank {rank} step {step}: swapped == plain bit for bit: {same}", flush=True)
    assert same
dist.destroy_process_group()
print("OFFLOAD_PARITY_OK")
