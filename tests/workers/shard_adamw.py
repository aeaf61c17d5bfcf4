"""2 ranks: fsdp_utils.ShardAdamW and fsdp_utils.clip_grad_norm, which run on each rank's shards,
against torch's own AdamW and clip_grad_norm_ run on the DTensors (the independent reference):
the same norms, parameters and optimizer state, bitwise, over 6 steps of a warm-up schedule with
weight decay and clipping that bites. Then what a step leaves behind: no count of gc-tracked
objects may grow over 6 more steps (torch 2.10 and 2.11 leak a tuple per DTensor op given a list,
the foreach path torch's AdamW takes on accelerators, and its one-tensor path keeps a cache
entry per parameter and step: the reference's own steps, run the same way, are counted and
printed beside ours, to show what this check catches on those versions).
Prints SHARD_ADAMW_OK on each rank when every check passed.
Usage: torchrun --nproc_per_node 2 tests/workers/shard_adamw.py
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fsdp_utils
from train_grpo import init_distributed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/workers
from growth import grown  # noqa: E402

rank, world = init_distributed()
mesh = init_device_mesh("cpu", (world,))
cfg = fsdp_utils.OptimConfig(lr=1e-2, weight_decay=0.1, warmup_steps=4, grad_clip=0.05)


def model() -> torch.nn.Module:
    torch.manual_seed(0)  # rows 5 and 3 do not split evenly over 2 ranks: one shard is padded
    m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    fully_shard(m[0], mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


ours, ref = model(), model()
opt, sched = fsdp_utils.build_optimizer(cfg, ours, total_steps=20)
ref_opt = torch.optim.AdamW(ref.parameters(), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                            weight_decay=cfg.weight_decay, foreach=True)  # accelerators' path
ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, sched.lr_lambdas[0])
data = torch.Generator().manual_seed(1 + rank)


def step(m, o, s, clip, x) -> torch.Tensor:
    m(x).pow(2).sum().backward()
    norm = clip(m)
    o.step()
    s.step()
    o.zero_grad()
    return norm


def batch() -> torch.Tensor:
    return torch.randn(4, 6, generator=data)


def theirs(m):
    return torch.nn.utils.clip_grad_norm_(list(m.parameters()), cfg.grad_clip).full_tensor()


def ours_clip(m):
    return fsdp_utils.clip_grad_norm(m, cfg.grad_clip)


for i in range(6):
    x = batch()
    a, b = step(ours, opt, sched, ours_clip, x), step(ref, ref_opt, ref_sched, theirs, x)
    assert torch.equal(a, b), (i, a, b)
    assert a > 3 * cfg.grad_clip, f"step {i}: the clip must bite (norm {a.item()})"
for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
    assert torch.equal(p.to_local(), q.to_local()), name
    for key in ("step", "exp_avg", "exp_avg_sq"):
        mine, want = opt.state[p][key], ref_opt.state[q][key]
        assert type(mine) is type(want) and mine.dtype == want.dtype, (name, key)
        want, mine = (t.to_local() if hasattr(t, "to_local") else t for t in (want, mine))
        assert torch.equal(mine, want), (name, key)


print(f"rank {rank}: torch {torch.__version__}: torch's AdamW and clip on DTensors left growing: "
      f"{grown(lambda: step(ref, ref_opt, ref_sched, theirs, batch()))[0]}", flush=True)
left, _ = grown(lambda: step(ours, opt, sched, ours_clip, batch()))
assert not left, f"ShardAdamW's steps left growing: {left}"
dist.barrier()
print(f"rank {rank}: SHARD_ADAMW_OK")
