"""A rank's training state, copied and compared bit for bit (tests/workers/rewind.py,
tests/workers/nonfinite.py)."""

import torch


def state(run) -> dict:
    """This rank's shards of every parameter and of every optimizer state tensor, copied."""
    local = lambda t: (t.to_local() if hasattr(t, "to_local") else t).detach().clone()  # noqa
    out = {f"param {n}": local(p) for n, p in run.actor.named_parameters()}
    for i, p in enumerate(q for g in run.opt.param_groups for q in g["params"]):
        for k, v in run.opt.state.get(p, {}).items():
            out[f"optim {i} {k}"] = local(v) if torch.is_tensor(v) else v
    return out


def same_state(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: {set(a) ^ set(b)}"
    for k in a:
        equal = torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k]
        assert equal, f"{what}: {k} differs"
