"""Push the FSDP2 actor's weights into the engine, in place.

Contract (what `push` sends): one (name, tensor) pair per weight of the Hugging Face checkpoint,
named as in `model.safetensors` (`model.layers.0.self_attn.q_proj.weight`, ...), each a full
(unsharded) tensor in the engine's dtype. The engine shards it for its own tensor parallelism.
- FSDP2 keeps the original module names, so the only renaming is stripping wrapper prefixes that
  `torch.compile` or activation checkpointing may add.
- Tied embeddings: `named_parameters()` lists the shared tensor once, as the embedding; vLLM then
  keeps its old `lm_head.weight`, so the pair is sent a second time as `lm_head.weight`.
- Gathering: one FSDP unit at a time (a decoder layer, then the root's embedding, norm and output
  layer): `unshard()` all-gathers the unit's parameters in one collective, in the compute dtype
  (FSDP2's mixed precision casts before the gather), each tensor goes to the engine as one copy
  in the engine's dtype (the cast and the copy in one pass), and `reshard()` frees the unit. At
  most one unit (and the engine's pending layer) is whole beyond the shards: never a second copy
  of the model.
  Every rank must call `push` (the all-gathers are collectives).
"""

import time

import torch
from torch.distributed.fsdp import FSDPModule

import npu_ops

WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def hf_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def units(model: torch.nn.Module) -> list[tuple[torch.nn.Module | None, list[str]]]:
    """[(FSDP unit, names of the parameters it owns)], in named_parameters order; one (None,
    all names) for a model that is not sharded. A parameter belongs to the innermost unit whose
    module holds it."""
    modules = {name: m for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    owned = {}
    for pname, _ in model.named_parameters():
        path = pname.split(".")
        owner = next((".".join(path[:i]) for i in range(len(path) - 1, -1, -1)
                      if ".".join(path[:i]) in modules), None)
        owned.setdefault(owner, []).append(pname)
    return [(modules.get(owner), names) for owner, names in owned.items()]


def iter_full_params(model: torch.nn.Module, dtype: torch.dtype, stats: dict):
    """Yield (HF name, full tensor in `dtype`) for every parameter, gathering unit by unit."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    for unit, names in units(model):
        if unit is not None:
            unit.unshard()  # one all-gather for the unit; its parameters are now whole tensors
        for pname in names:
            # a copy, cast on the way: reshard() frees the gathered storage in place, and the
            # engine may hold a tensor until its whole layer has arrived
            full = model.get_parameter(pname).detach().to(dtype, copy=True)
            name = hf_name(pname)
            stats["bytes"] += full.numel() * full.element_size()
            yield name, full
            if tied and name.endswith("embed_tokens.weight"):
                stats["bytes"] += full.numel() * full.element_size()
                yield "lm_head.weight", full
            del full
        if unit is not None:
            unit.reshard()


@torch.no_grad()
def push(model: torch.nn.Module, engine, before_kv_cache=None) -> dict:
    """Wake the engine's weights, stream the actor into them, then wake its KV cache.

    Order: weights -> load -> KV cache (see rollout.py). `before_kv_cache` runs between the load
    and the KV cache's wake: the loop moves the actor out of device memory there, so that the KV
    cache can take it. Returns {"bytes": sent, "seconds": s}, the seconds without that call.
    """
    t0 = time.perf_counter()
    stats = {"bytes": 0}
    dtype = getattr(torch, engine.cfg.dtype)
    engine.wake(["weights"])
    engine.load_weights(iter_full_params(model, dtype, stats))
    if before_kv_cache is not None:
        t = time.perf_counter()
        before_kv_cache()
        t0 += time.perf_counter() - t
    engine.wake(["kv_cache"])
    npu_ops.synchronize()
    return {"bytes": stats["bytes"], "seconds": time.perf_counter() - t0}
