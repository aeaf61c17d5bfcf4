"""Push the FSDP2 actor's weights into the engine, in place.

Contract (what `push` sends): one (name, tensor) pair per weight of the Hugging Face checkpoint,
named as in `model.safetensors` (`model.layers.0.self_attn.q_proj.weight`, ...), each a full
(unsharded) tensor in the engine's dtype. The engine shards it for its own tensor parallelism.
- FSDP2 keeps the original module names, so the only renaming is stripping wrapper prefixes that
  `torch.compile` or activation checkpointing may add.
- Tied embeddings: `named_parameters()` lists the shared tensor once, as the embedding; vLLM then
  keeps its old `lm_head.weight`, so the pair is sent a second time as `lm_head.weight`.
- Memory: pairs are produced lazily, one parameter at a time (all-gather, cast, hand over, drop),
  so at most one full parameter beyond the shards is alive: never a second copy of the model.
  Every rank must call `push` (the all-gathers are collectives).
"""

import time

import torch

import npu_ops

WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def hf_name(name: str) -> str:
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def iter_full_params(model: torch.nn.Module, dtype: torch.dtype, stats: dict):
    """Yield (HF name, full tensor in `dtype`) for every parameter, gathering FSDP2 shards."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    for name, param in model.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param  # DTensor -> Tensor
        full = full.detach().to(dtype)
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
    engine.load_weights(iter_full_params(model, dtype, stats))
    if before_kv_cache is not None:
        t = time.perf_counter()
        before_kv_cache()
        t0 += time.perf_counter() - t
    engine.wake(["kv_cache"])
    npu_ops.synchronize()
    return {"bytes": stats["bytes"], "seconds": time.perf_counter() - t0}
