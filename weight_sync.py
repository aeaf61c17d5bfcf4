"""Push the FSDP2 actor's weights into the engine, in place.

Contract (what `push` sends): one (name, tensor) pair per weight of the Hugging Face checkpoint,
named as in `model.safetensors` (`model.layers.0.self_attn.q_proj.weight`, ...), each a full
(unsharded) tensor in the engine's dtype. The engine shards it for its own tensor parallelism.
- FSDP2 keeps the original module names, so the only renaming is stripping wrapper prefixes that
  `torch.compile` or activation checkpointing may add.
- Tied embeddings: `named_parameters()` lists the shared tensor once, as the embedding; vLLM then
  keeps its old `lm_head.weight`, so the pair is sent a second time as `lm_head.weight`.
- Gathering (`rollout.sync_by`), lazily, so at most one unit (or one parameter) is whole beyond
  the shards: never a second copy of the model, never a host round trip. Every rank must call
  `push` (the all-gathers are collectives).
  - "unit" (default): one all-gather per FSDP unit (a decoder layer, then the root's embedding,
    norm and output layer) through `unshard()`, in the compute dtype (FSDP2's mixed precision
    casts before the gather), each tensor handed over as a copy in the engine's dtype
    (`reshard()` frees the gathered storage in place, and vLLM's layerwise loader may hold a
    tensor until its whole layer has arrived: without the copy the engine read freed storage).
  - "tensor": one all-gather per parameter, of its shard cast to the engine's dtype first (a
    bf16 engine: half the bytes of the fp32 shards on the wire), handed over, dropped.
  Measured on the 2-core CPU machine, 2 ranks: "unit" took the tiny model's sync from 35 to 17
  ms (fewer collectives), and a 108.6M model's bf16 push from 0.40 to 0.37 s; with that model in
  fp32 it was slower (0.71 against 0.51 s: FSDP2 copies in and out around its collective, and
  there memory bandwidth decides). bench/weight_sync.py times both; on NCCL/HCCL, unmeasured.
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
    """[(FSDP unit, names of the parameters it owns)], in named_parameters order; one (None, all
    names) for a model that is not sharded. A parameter belongs to the innermost unit above it."""
    modules = {name: m for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    owned = {}
    for pname, _ in model.named_parameters():
        path = pname.split(".")
        owner = next((".".join(path[:i]) for i in range(len(path) - 1, -1, -1)
                      if ".".join(path[:i]) in modules), None)
        owned.setdefault(owner, []).append(pname)
    return [(modules.get(owner), names) for owner, names in owned.items()]


def full_params(model: torch.nn.Module, dtype: torch.dtype, by_unit: bool):
    """(parameter name, whole tensor in `dtype`), one at a time, gathered as the docstring says."""
    if not by_unit:
        for name, param in model.named_parameters():
            param = param.detach().to(dtype)  # the shard, cast before the gather
            yield name, param.full_tensor() if hasattr(param, "full_tensor") else param
        return
    for unit, names in units(model):
        if unit is not None:
            unit.unshard()  # one all-gather: the unit's parameters are whole tensors now
        for name in names:
            yield name, model.get_parameter(name).detach().to(dtype, copy=True)
        if unit is not None:
            unit.reshard()


def iter_full_params(model: torch.nn.Module, dtype: torch.dtype, stats: dict,
                     by_unit: bool = False):
    """Yield (HF name, full tensor in `dtype`) for every parameter, gathering FSDP2 shards."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name, full in full_params(model, dtype, by_unit):
        name = hf_name(name)
        stats["bytes"] += full.numel() * full.element_size()
        yield name, full
        if tied and name.endswith("embed_tokens.weight"):
            stats["bytes"] += full.numel() * full.element_size()
            yield "lm_head.weight", full
        del full


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
    engine.load_weights(iter_full_params(model, dtype, stats, engine.cfg.sync_by == "unit"))
    if before_kv_cache is not None:
        t = time.perf_counter()
        before_kv_cache()
        t0 += time.perf_counter() - t
    engine.wake(["kv_cache"])
    npu_ops.synchronize()
    return {"bytes": stats["bytes"], "seconds": time.perf_counter() - t0}
