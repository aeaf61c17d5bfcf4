"""Push the FSDP2 actor's weights into the engine, in place.

Contract (what `push` sends): one (name, tensor) pair per weight of the Hugging Face checkpoint,
named as in `model.safetensors` (`model.layers.0.self_attn.q_proj.weight`, ...), each a full
(unsharded) tensor in the engine's dtype. The engine shards it for its own tensor parallelism.
A vision-language checkpoint's language model goes under the checkpoint's own names
(`model.language_model.layers.0...`: checkpoint.stored_name), after its vision tower, which the
actor does not hold, read from the checkpoint's files (`iter_full_params` says why).
- FSDP2 keeps the original module names, so the only renaming is stripping wrapper prefixes that
  `torch.compile` or activation checkpointing may add.
- Tied embeddings: `named_parameters()` lists the shared tensor once, as the input embedding; it
  is sent a second time under the output layer's name (fsdp_utils.Family), right after.
- Order: the decoder layers first, the embedding last (`units` says why).
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
  bench/weight_sync.py times both (docs/benchmarks.md has what it printed).
With adapters (model.lora) only they are sent: each adapted layer's lora_A and lora_B, gathered
whole (all of them in one all-gather: `gather_rows`) into `rollout.Engine.load_adapter`, which
writes them into the engine's adapter slot in place; the engine's base never changes (but a
final norm that trains beside the adapters, below). Where
there is no slot to write (the first push, or vLLM let it go), the adapter is written in peft's
format (`checkpoint.save_adapter`, as the export writes it) into the engine's directory for it,
which `rollout.Engine.add_adapter` registers. What trains whole beside the adapters (the final
norm, model.lora.train_final_norm) goes into the engine's base in place, whole
(`rollout.Engine.load_adapter`, `rollout.load_in_full`): vLLM's LoRA takes no norm.

`EngineTurn` is the engine's turn around the push: the memory moves, the wakes, and the sleep.
"""

import math
import time

import torch
from torch.distributed.fsdp import FSDPModule

import checkpoint
import fsdp_utils
from modeling import vision
import npu_ops
import offload

# a checkpoint's tensors the engine never loads, left out of the push: Qwen3.5's multi-token
# prediction head (~0.4B parameters at 27B; vLLM 0.23 and 0.32 models/qwen3_5.py skip "mtp.")
ENGINE_SKIPS = ("mtp.",)


def units(model: torch.nn.Module) -> list[tuple[torch.nn.Module | None, list[str]]]:
    """[(FSDP unit, names of the parameters it owns)] in the order the engine takes them best:
    the decoder layers' units first, then the unit holding the input embedding, that embedding
    last within it; one (None, all names) for a model that is not sharded. A parameter belongs to
    the innermost unit above it.

    Why this order (vLLM's layerwise reload, model_loader/reload/layerwise.py in 0.26 and 0.32):
    a module counts as loading until every element of its tensors has arrived, and each load
    into another module while one is loading makes vLLM hold the loaded tensors in extra buffers
    and warn. The engine pads the vocabulary to a multiple of 64 rows per rank and never receives
    the padding, so an embedding (or output layer) with a vocabulary off that multiple loads
    until the end of the reload: it goes last. Every other module's tensors come together."""
    modules = {name: m for name, m in model.named_modules() if isinstance(m, FSDPModule)}
    owned = {}
    for pname, _ in model.named_parameters():
        path = pname.split(".")
        owner = next((".".join(path[:i]) for i in range(len(path) - 1, -1, -1)
                      if ".".join(path[:i]) in modules), None)
        owned.setdefault(owner, []).append(pname)
    embedding = fsdp_utils.family(model.config.model_type).embedding
    last = lambda name: fsdp_utils.hf_name(name) == embedding  # noqa: E731
    groups = [(modules.get(owner), sorted(names, key=last))
              for owner, names in owned.items()]  # sorts are stable: the rest keep their order
    return sorted(groups, key=lambda group: last(group[1][-1]))


def full_params(model: torch.nn.Module, dtype: torch.dtype, by_unit: bool, skip=()):
    """(parameter name, whole tensor in `dtype`), one at a time, in `units` order, gathered as the
    docstring says; the names in `skip` left out (a unit of them alone not gathered)."""
    for unit, names in units(model):
        names = [n for n in names if n not in skip]
        if not names:
            continue
        if by_unit and unit is not None:
            unit.unshard()  # one all-gather: the unit's parameters are whole tensors now
        for name in names:
            param = model.get_parameter(name).detach()
            if by_unit:
                yield name, param.to(dtype, copy=True)
            else:
                param = param.to(dtype)  # the shard, cast before the gather
                yield name, param.full_tensor() if hasattr(param, "full_tensor") else param
        if by_unit and unit is not None:
            unit.reshard()


def iter_full_params(model: torch.nn.Module, dtype: torch.dtype, stats: dict,
                     by_unit: bool = False, frozen_tower: bool = True):
    """Yield (HF name, full tensor in `dtype`) for every parameter, gathering FSDP2 shards; for a
    vision-language checkpoint, first the tensors the actor does not hold (its vision tower),
    from the checkpoint's files, but for those the engine does not load (ENGINE_SKIPS): the
    engine's reload wants every tensor of its model (vLLM 0.23 refuses a push without them;
    0.32 warns), and a level-2 sleep dropped them. A whole
    vision-language actor's frozen tower (vision.frozen_tower) is left out unless frozen_tower:
    where the engine keeps what a push leaves out (rollout.Engine.keeps_unsent)."""
    skip = () if frozen_tower else vision.frozen_tower(model)
    tied = getattr(model.config, "tie_word_embeddings", False)
    names = fsdp_utils.family(model.config.model_type)  # a tied model's two names
    if (path := getattr(model, "checkpoint_path", None)) is not None:
        held = {checkpoint.stored_name(model, fsdp_utils.hf_name(n))
                for n, _ in model.named_parameters()}
        held.add(checkpoint.stored_name(model, names.output))
        for name, tensor in checkpoint.tensors_beyond(path, held, dtype, skip=ENGINE_SKIPS):
            stats["bytes"] += tensor.numel() * tensor.element_size()
            yield name, tensor
    for name, full in full_params(model, dtype, by_unit, skip):
        name = fsdp_utils.hf_name(name)
        stats["bytes"] += full.numel() * full.element_size()
        yield checkpoint.stored_name(model, name), full
        if tied and name == names.embedding:
            stats["bytes"] += full.numel() * full.element_size()
            yield checkpoint.stored_name(model, names.output), full
        del full


def full_adapters(model: torch.nn.Module, dtype: torch.dtype, stats: dict) -> dict:
    """{HF name of an adapted layer, as the model's checkpoint stores it (checkpoint.stored_name:
    a vision-language checkpoint's language model under its prefix): (lora_A, lora_B)}, whole
    tensors in `dtype`, gathered from their FSDP2 shards in one all-gather (every rank must
    call)."""
    layers = fsdp_utils.adapters(model)
    weights = [part[layer.active_adapters[0]].weight.detach()
               for _, layer in layers for part in (layer.lora_A, layer.lora_B)]
    whole = gather_rows(weights, dtype)
    stats["bytes"] += sum(t.numel() * t.element_size() for t in whole)
    return {checkpoint.stored_name(model, name): (whole[2 * i], whole[2 * i + 1])
            for i, (name, _) in enumerate(layers)}


def full_beside_adapters(model: torch.nn.Module, dtype: torch.dtype, stats: dict) -> dict:
    """{checkpoint name: whole tensor in `dtype`} of what trains whole beside the adapters (the
    final norm, model.lora.train_final_norm; checkpoint.trained_in_full), in one all-gather
    (every rank must call); {} where nothing does."""
    whole = checkpoint.trained_in_full(model)
    tensors = gather_rows([p.detach() for _, p in whole], dtype)
    stats["bytes"] += sum(t.numel() * t.element_size() for t in tensors)
    return {checkpoint.stored_name(model, fsdp_utils.hf_name(name)): t
            for (name, _), t in zip(whole, tensors)}


@torch.no_grad()
def gather_rows(tensors: list, dtype: torch.dtype) -> list:
    """Whole copies in `dtype` of `tensors`, FSDP2 parameters sharded by rows over one mesh
    dimension, in a single all-gather (the adapters of a 0.5B model are 336 small tensors: one
    collective each cost 0.39 s a push on 2 CPU ranks). FSDP2 cuts each tensor as torch.chunk
    does: ceil(rows / world) rows a rank, the last non-empty rank short, any after it empty; each
    rank lays its shards end to end, each padded to that many rows, so that every rank's block
    has the same size, and the whole tensor is the ranks' pieces one after another, trimmed."""
    from torch.distributed.tensor import DTensor, Shard

    if not tensors or not isinstance(tensors[0], DTensor):
        return [t.to(dtype) for t in tensors]
    mesh = tensors[0].device_mesh
    if mesh.ndim != 1 or any(t.placements != (Shard(0),) or t.device_mesh != mesh
                             for t in tensors):
        return [t.to(dtype).full_tensor() for t in tensors]  # another layout: one at a time
    world = mesh.size()
    # each tensor's elements a rank, padded
    chunk = [-(-t.shape[0] // world) * math.prod(t.shape[1:]) for t in tensors]
    block = torch.zeros(sum(chunk), dtype=dtype, device=tensors[0].to_local().device)
    offset = 0
    for t, n in zip(tensors, chunk):
        local = t.to_local()
        block[offset:offset + local.numel()].copy_(local.reshape(-1))
        offset += n
    gathered = torch.empty(world * block.numel(), dtype=dtype, device=block.device)
    torch.distributed.all_gather_into_tensor(gathered, block, group=mesh.get_group())
    gathered, out, offset = gathered.view(world, -1), [], 0
    for t, n in zip(tensors, chunk):
        rows = gathered[:, offset:offset + n].reshape(-1, *t.shape[1:])  # ranks' pieces in order
        out.append(rows[:t.shape[0]].clone())
        offset += n
    return out


@torch.no_grad()
def load(model: torch.nn.Module, engine) -> int:
    """Stream the actor into the engine's awake weights (the adapters alone, with LoRA): every
    rank must call. Returns the bytes sent."""
    stats, dtype = {"bytes": 0}, getattr(torch, engine.cfg.dtype)
    if engine.lora is not None:
        layers = full_adapters(model, dtype, stats)
        if not engine.load_adapter(layers, full_beside_adapters(model, dtype, stats)):
            # no slot to write in place: register the files
            checkpoint.save_adapter(engine.adapter_dir, layers, engine.lora)
            engine.add_adapter()
    else:
        leave = bool(vision.frozen_tower(model)) and engine.keeps_unsent()
        engine.load_weights(iter_full_params(model, dtype, stats, engine.cfg.sync_by == "unit",
                                             frozen_tower=not leave),
                            **({"leaving_out": True} if leave else {}))
    return stats["bytes"]


class EngineTurn:
    """The engine's turn on the device, as one guarded block (`with turn:`), the one owner of
    wake, push, sleep and the memory moves around them, for a rollout and for eval alike.
    Entering it: the optimizer state to host memory (offload.HostCopy), the engine's weights
    awake, the actor pushed into them (`load`), the actor's shards to host memory, the KV cache
    awake, each wake finding the memory the moves freed. Inside, the engine generates. Leaving
    it, whatever raised (an error in a reward, Ctrl-C during generation): every unit of the
    actor resharded (a push cut between a unit's gather and its reshard), the engine asleep, and
    the actor and its optimizer state back. `offload_on` False (model.offload, off on CPU): no
    move, the rest as said. `metrics()`: the newest turn's seconds, bytes and memory."""

    def __init__(self, actor, optimizer, engine, offload_on: bool):
        self.actor, self.optimizer, self.engine = actor, optimizer, engine
        self.offload_on = offload_on
        self.params, self.state = offload.HostCopy(), offload.HostCopy()  # the actor's; its Adam's
        self.stats = {}

    def __enter__(self):
        self.stats = {"sync_time_s": 0.0}
        try:
            with torch.profiler.record_function("step:sync"):
                self._enter()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _enter(self) -> None:
        """Memory moves out, the push, the wakes (timed into self.stats)."""
        self._move("optimizer_out", lambda: self.state.to_host(None, self.optimizer))
        t = time.perf_counter()
        self.engine.wake(["weights"])
        self.stats["sync_gb"] = load(self.actor, self.engine) / 2**30
        self.stats["sync_time_s"] += time.perf_counter() - t
        self._move("actor_out", lambda: self.params.to_host(self.actor))
        t = time.perf_counter()
        self.engine.wake(["kv_cache"])
        npu_ops.synchronize()
        self.stats["sync_time_s"] += time.perf_counter() - t

    def __exit__(self, *exc) -> None:
        try:
            offload.reshard(self.actor)
            t = time.perf_counter()
            self.engine.sleep()  # frees weights + KV cache where the platform can
            self.stats["sleep_time_s"] = time.perf_counter() - t
        finally:
            if self.params.away or self.state.away:
                self._move("actor_in", self._back)

    def _back(self) -> None:
        self.params.to_device()
        self.state.to_device()

    def _move(self, name: str, fn) -> None:
        """fn, a move between device and host, timed (offload_{out,in}_time_s) and, on
        accelerators, the device memory in use before and after it (mem_{name}_*_gb)."""
        if not self.offload_on:
            return
        t, before = time.perf_counter(), npu_ops.device_memory_used_gb()
        fn()
        key = "offload_in_time_s" if name == "actor_in" else "offload_out_time_s"
        self.stats[key] = self.stats.get(key, 0.0) + time.perf_counter() - t
        if before is not None:
            self.stats.update({f"mem_{name}_before_gb": before,
                               f"mem_{name}_after_gb": npu_ops.device_memory_used_gb()})

    def metrics(self) -> dict:
        """The newest turn's seconds (sync_time_s: wakes and push; sleep_time_s; with the
        offload, offload_out_time_s for both moves out, offload_in_time_s), bytes pushed
        (sync_gb), device memory around each move on accelerators, and the host memory the
        copies hold (offload_host_gb)."""
        host = (self.params.host_bytes + self.state.host_bytes) / 2**30
        return {**self.stats, **({"offload_host_gb": host} if self.offload_on else {})}
