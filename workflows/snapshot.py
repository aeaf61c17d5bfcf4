"""A run's state held aside and put back: `take(run)` and `restore(run, snap)`, which
train_grpo.Run.snapshot and Run.restore call (a notebook's fork and rewind: variants.py).

What a snapshot holds, per rank, copied:
- the actor's parameters that train (this rank's shards; with adapters, the adapters alone and
  a final norm trained beside them: the rest of the base never changes) and the optimizer's
  state of each (Adam's moments and step), its param groups' settings (the learning rate the
  schedule set) and the schedule's state;
- the step, the config tree, the sampler's data positions and partial rollout's carried groups
  (sampler.Sampler.snapshot), every random generator of the process (checkpoint.rng_state);
- run.last (a reference: it is not changed by later steps, only replaced).
A reference model and a teacher are frozen: nothing of theirs is copied. The engine's weights
are not copied either: every step pushes the actor into the engine before it generates
(weight_sync.EngineTurn), so after a restore the next step's rollout comes from the restored
weights. What the run's reward functions, environments or agents keep in their own processes
is theirs, and not copied.

Where: host memory (not pinned: a copy is taken between steps, and pinned allocators round each
block up to a power of two, offload.py), or with `path` one file per rank in that directory
(torch.save), which a shared filesystem lets every node write. Before copying, every rank
learns what each rank would hold and where it runs, and all refuse together, with one line,
when the ranks of a host would not fit in its memory (MemAvailable) or its disk (`bytes`, per
rank, says what a snapshot costs).
"""

import copy
import dataclasses
import os
import shutil
import socket

import torch
import torch.distributed as dist

import checkpoint
import npu_ops
import offload


@dataclasses.dataclass
class Snapshot:
    """A run's state at `step` (module docstring): `state` in host memory, or None when it is
    in `path` (rank{r}.pt per rank); `bytes`, this rank's tensors' bytes; `cfg`, the run's
    config tree then; `last`, its run.last then."""
    step: int
    cfg: object
    last: object
    bytes: int
    state: dict | None = None
    path: str | None = None


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A host copy of this rank's part of `t` (a clone where it already is on the host)."""
    return _local(t).detach().to("cpu", copy=True)


def trained(actor: torch.nn.Module) -> dict:
    """{name: parameter} of the actor's parameters that train."""
    return {n: p for n, p in actor.named_parameters() if p.requires_grad}


def _indexed(opt) -> list:
    """The optimizer's parameters in its param groups' order (its state dict's numbering)."""
    return [p for group in opt.param_groups for p in group["params"]]


def state_bytes(run) -> int:
    """This rank's bytes of a snapshot of `run`'s tensors now: its shards of the parameters that
    train and the optimizer's state tensors."""
    tensors = list(trained(run.actor).values())
    tensors += [v for state in run.opt.state.values() for v in state.values()
                if torch.is_tensor(v)]
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def check_room(nbytes: int, path: str | None) -> None:
    """Every rank: a one-line MemoryError on all of them when the ranks of some host would hold
    more than that host has free (memory, or with `path` the disk under it)."""
    where = os.path.abspath(path) if path else None
    if where:
        os.makedirs(where, exist_ok=True)
    free = (shutil.disk_usage(where).free if where else offload.host_memory_available())
    mine = (socket.gethostname(), nbytes, free)
    ranks = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    for host in sorted({h for h, _, _ in ranks}):
        on_host = [(b, f) for h, b, f in ranks if h == host]
        need, have = sum(b for b, _ in on_host), min((f for _, f in on_host if f is not None),
                                                     default=None)
        if have is not None and need > have:
            raise MemoryError(
                f"snapshot: the {len(on_host)} rank(s) on {host} would write {need / 2**30:.2f} "
                f"GiB ({max(b for b, _ in on_host) / 2**30:.2f} GiB at most a rank: the actor's "
                f"trained shards and the optimizer's state) to "
                f"{'the disk under ' + where if where else 'host memory'}, but "
                f"{have / 2**30:.2f} GiB is free. Fix: "
                + ("run.snapshot(path=DIR) on a disk with room" if not where else
                   "a path on a disk with room") + ", or free some")


def take(run, path: str | None = None) -> Snapshot:
    """Every rank: `run`'s state now (module docstring), in host memory or under `path`."""
    state_bytes_now = state_bytes(run)
    check_room(state_bytes_now, path)
    sampler = run.sampler.snapshot()  # (its refusal comes before any copy)
    offload.reshard(run.actor)  # a unit left gathered holds no trained state of its own
    params = {n: host_copy(p) for n, p in trained(run.actor).items()}
    optim = {i: {k: host_copy(v) if torch.is_tensor(v) else copy.deepcopy(v)
                 for k, v in run.opt.state[p].items()}
             for i, p in enumerate(_indexed(run.opt)) if p in run.opt.state}
    groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
              for g in run.opt.param_groups]
    state = {"params": params, "optim": optim, "groups": groups,
             "sched": copy.deepcopy(run.sched.state_dict()), "rng": checkpoint.rng_state(),
             "sampler": sampler, "step": run.step}
    snap = Snapshot(run.step, copy.deepcopy(run.applied), run.last, state_bytes_now)
    if path is None:
        snap.state = state
    else:
        torch.save(state, os.path.join(path, f"rank{dist.get_rank()}.pt"))
        snap.path = path
    return snap


def _like(param: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
    """A new optimizer state tensor from its host copy: sharded as `param` where it has the
    shape of this rank's shard of it (Adam's moments), else a plain copy (Adam's step)."""
    from torch.distributed.tensor import DTensor

    local = _local(param)
    if host.shape != local.shape:
        return host.clone()
    if isinstance(param, DTensor):
        return DTensor.from_local(host.to(local.device), param.device_mesh, param.placements,
                                  shape=param.shape, stride=param.stride(), run_check=False)
    return host.to(local.device)


@torch.no_grad()
def restore(run, snap: Snapshot) -> None:
    """Every rank: `run`'s state back to `snap`, bit for bit, in place (the tensors stay the
    same objects where they exist: an offload's host copies and FSDP2's shards keep pointing at
    them). The caller rebuilds what derives from the config (train_grpo.Run.restore)."""
    turn = run.turn
    if turn is not None and (turn.params.away or turn.state.away):
        raise RuntimeError("restore: the actor is in host memory (inside the engine's turn); "
                           "restore between steps")
    state = snap.state if snap.state is not None else torch.load(
        os.path.join(snap.path, f"rank{dist.get_rank()}.pt"), weights_only=False)
    live = trained(run.actor)
    if live.keys() != state["params"].keys():
        raise ValueError("restore: the snapshot is of another model (its trained parameters "
                         "differ from this run's actor's)")
    offload.reshard(run.actor)  # a unit left gathered would keep the weights of later steps
    for name, p in live.items():
        _local(p).copy_(state["params"][name])
    for i, p in enumerate(_indexed(run.opt)):
        saved = state["optim"].get(i)
        if saved is None:  # no state yet then (before the first step)
            run.opt.state.pop(p, None)
            continue
        now, out = run.opt.state.get(p, {}), {}
        for k, v in saved.items():
            cur = now.get(k)
            if not torch.is_tensor(v):
                out[k] = copy.deepcopy(v)
            elif (torch.is_tensor(cur) and _local(cur).shape == v.shape
                  and _local(cur).dtype == v.dtype):
                _local(cur).copy_(v)
                out[k] = cur
            else:
                out[k] = _like(p, v)
        run.opt.state[p] = out
    for group, saved in zip(run.opt.param_groups, state["groups"]):
        group.update(copy.deepcopy(saved))
    run.sched.load_state_dict(copy.deepcopy(state["sched"]))
    npu_ops.synchronize()  # the host copies are read before anything overwrites them
    run.sampler.rewind(state["sampler"])
    checkpoint.set_rng_state(state["rng"])
    run.step, run.last = snap.step, snap.last
