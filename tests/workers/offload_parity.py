"""2 ranks: moving the FSDP2 actor and its optimizer state to host memory and back (ActorSwap)
restores both bit for bit, and training goes on exactly as without it.

On CPU host and device memory are one, so the test makes sure a move is real: after `out` every
shard and state tensor is a different tensor with the same bits; a change made to the host copy
comes back with `back` (what returns is that copy); the actor trained with a swap around every
step ends bit-equal to one trained without.
Usage: torchrun --nproc_per_node 2 tests/workers/offload_parity.py MODEL_DIR
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

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


def tensors(actor, opt):
    """Every shard (local part) and optimizer state tensor, in a fixed order."""
    out = [p.to_local() for p in actor.parameters()]
    for state in opt.state.values():
        out += [v.to_local() if hasattr(v, "to_local") else v for v in state.values()
                if torch.is_tensor(v)]
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


for step in range(4):
    if step > 0:  # the optimizer has state from the first step on
        before = [t.clone() for t in tensors(actors[0], opts[0])]
        ptrs = [t.data_ptr() for t in tensors(actors[0], opts[0])]
        swap.out()
        away = tensors(actors[0], opts[0])
        assert len(away) == len(before) > 0
        assert all(torch.equal(a, b) for a, b in zip(away, before)), "out changed a value"
        assert all(t.numel() == 0 or t.data_ptr() != p for t, p in zip(away, ptrs)), "not a copy"
        if step == 2:  # what comes back is the host copy: a change to it must come back
            with torch.no_grad():
                next(actors[0].parameters()).to_local().fill_(7.0)
        host_ptrs = [t.data_ptr() for t in tensors(actors[0], opts[0])]
        swap.back()
        back = tensors(actors[0], opts[0])
        assert all(t.numel() == 0 or t.data_ptr() != p for t, p in zip(back, host_ptrs))
        if step == 2:
            assert bool((back[0] == 7.0).all()), "back did not return the host copy"
            with torch.no_grad():  # the saved bits again, exactly
                next(actors[0].parameters()).to_local().copy_(before[0])
            back = tensors(actors[0], opts[0])
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
