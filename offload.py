"""Device memory handed between the actor and the engine: a sharded model (and its optimizer
state) copied to host memory and back, in place.

The tensors stay the same objects: only the device storage behind them moves. `HostCopy.to_host`
copies each storage into host memory and resizes the storage to 0 bytes, which frees its device
memory (FSDP2 frees its gathered parameters the same way); `to_device` resizes it again and
copies the bytes in. Nothing is rebuilt: a DTensor rebuilt around a host copy lands on its mesh's
device again (DTensor.from_local moves the local tensor there), and the device would keep every
byte. One storage holds a parameter's padded FSDP2 shard (`_sharded_param_data`) and the local
tensor that views it, so both go at once. Every FSDP2 unit is resharded first: a unit left
gathered (a no-grad forward under reshard_after_forward=False, a push cut in the middle) would
otherwise copy its gathered parameters and leave the shard on the device.

Host memory. A copy's bytes go into one arena, allocated at the first copy and reused after:
pinned chunks (on accelerators) whose sizes are the powers of two of the total's binary
expansion, so that they add up to exactly the copied bytes. The accelerators' pinned host
allocators round each block up to a power of two (torch 2.10.0 and 2.13.0,
ATen/core/CachingHostAllocator.h, allocate: PowerOf2Ceil; by its source, the Ascend backend's
too), so a buffer per tensor, or one buffer for all, can take up to twice the memory; a power of
two is not rounded. Tensors are laid end to end and may straddle two chunks.

Who moves what when: weight_sync.EngineTurn (the actor and its optimizer state, around the
engine's turn), and `on_device` (the frozen reference, around its forward passes).

Run on an H100 by tests/test_device.py (scripts/gpu_check.sh; docs/benchmarks.md); not on an
Ascend device (scripts/npu_check.sh would).
"""

import contextlib
import itertools
import logging
import weakref

import torch
from torch.distributed.fsdp import FSDPModule

import checkpoint
import npu_ops

log = logging.getLogger("grpo")


def device_tensors(model: torch.nn.Module | None, optimizer=None) -> list:
    """What a HostCopy moves, in a fixed order: each parameter's local shard and each buffer (of
    `model`), each optimizer state tensor (Adam's moments), where it lives on the compute
    device."""
    found = []
    if model is not None:
        found += itertools.chain(model.parameters(), model.buffers())
    for state in optimizer.state.values() if optimizer is not None else ():
        found += [v for v in state.values() if torch.is_tensor(v)]
    with torch.no_grad():
        local = [t.to_local() if hasattr(t, "to_local") else t for t in found]
    return [t for t in local if t.device.type == npu_ops.device_type()]


def reshard(model: torch.nn.Module) -> None:
    """Every FSDP2 unit of `model` back to its shards (a no-op for one that is sharded)."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A (nbytes,) uint8 tensor over the whole of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def power_of_two_parts(n: int) -> list[int]:
    """The powers of two that add up to n, largest first: 13 -> [8, 4, 1]."""
    return [1 << b for b in range(n.bit_length() - 1, -1, -1) if n >> b & 1]


class HostArena:
    """`nbytes` of host memory as chunks of power-of-two sizes that add up to exactly nbytes,
    pinned on accelerators. `pieces(offset, n)` maps a byte range onto them."""

    def __init__(self, nbytes: int, pin: bool):
        self.chunks = [torch.empty(size, dtype=torch.uint8, pin_memory=pin)
                       for size in power_of_two_parts(nbytes)]
        self.starts = list(itertools.accumulate([0] + [c.numel() for c in self.chunks]))

    def pieces(self, offset: int, n: int):
        """(chunk slice, start within the range) for the bytes [offset, offset + n)."""
        end = offset + n
        for chunk, start in zip(self.chunks, self.starts):
            lo, hi = max(offset, start), min(end, start + chunk.numel())
            if lo < hi:
                yield chunk[lo - start:hi - start], lo - offset


class HostCopy:
    """A model's device storage (and its optimizer's state) copied into a host arena and freed on
    the device, then back; see the module's docstring. `to_host` then releases the device's
    cached blocks."""

    def __init__(self):
        self.arena = None  # allocated at the first copy, reused while the layout is the same
        self.layout = None  # (storage bytes, ...) of the copy the arena was made for
        self.allocations = 0  # arenas made (1 in a healthy run)
        self.away = []  # [(storage, offset)] while on the host
        self.guard = None  # while on the host: a forward pre-hook that refuses to run the model

    def to_host(self, model: torch.nn.Module | None, optimizer=None) -> None:
        if self.away:
            return
        if model is not None:
            reshard(model)
        storages, seen = [], set()
        for t in device_tensors(model, optimizer):
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:  # empty, or shared (tied)
                continue
            if (fmt := npu_ops.internal_format(t)) is not None:  # before anything moves
                raise ValueError(
                    f"offload: a tensor of shape {tuple(t.shape)} is stored in the device's "
                    f"internal format {fmt}, not ND: its storage is not its elements in order, "
                    "and the move to host memory copies and frees storages byte for byte. Fix: "
                    "model.offload=off (docs/platforms.md, \"Ascend NPUs\")")
            seen.add(storage.data_ptr())
            storages.append(storage)
        layout = tuple(s.nbytes() for s in storages)
        if not layout:  # nothing there yet (Adam's state before the first step)
            return
        pin = npu_ops.device_type() != "cpu"  # faster copies both ways (no pinning on CPU)
        if layout != self.layout:
            if self.layout is not None:
                log.warning("offload: the tensors moved to host memory changed size (%d -> %d "
                            "bytes): host memory allocated again", sum(self.layout), sum(layout))
            self.arena, self.layout = None, None  # the old arena goes before the new one comes
            self.arena, self.layout = HostArena(sum(layout), pin), layout
            self.allocations += 1
        offsets = itertools.accumulate((0,) + layout)
        away = list(zip(storages, offsets))
        for storage, offset in away:
            src = _as_bytes(storage)
            for piece, at in self.arena.pieces(offset, storage.nbytes()):
                piece.copy_(src[at:at + piece.numel()], non_blocking=pin)
        npu_ops.synchronize()  # the copies are done before the memory is given back
        self.away = away  # from here `to_device` restores whatever the loop below got to
        for storage, _ in away:
            storage.resize_(0)
        npu_ops.empty_cache()
        if model is not None:
            self.guard = model.register_forward_pre_hook(_refuse_on_host, prepend=True)

    def to_device(self) -> None:
        pin = npu_ops.device_type() != "cpu"
        for (storage, offset), n in zip(self.away, self.layout or ()):  # a storage not yet
            #   resized (an interrupted `out`) is written with the bytes it still holds
            if storage.nbytes() != n:
                storage.resize_(n)
            dst = _as_bytes(storage)
            for piece, at in self.arena.pieces(offset, n):
                dst[at:at + piece.numel()].copy_(piece, non_blocking=pin)
        if self.away:
            npu_ops.synchronize()  # the host bytes may be overwritten by the next copy
        self.away = []
        if self.guard is not None:
            self.guard.remove()
            self.guard = None

    @property
    def host_bytes(self) -> int:
        return sum(c.numel() for c in self.arena.chunks) if self.arena is not None else 0


def _refuse_on_host(module, args):
    # the model's tensors own no device bytes: running it would read freed memory
    raise RuntimeError("this model's weights are in host memory (offload.to_host): call "
                       "offload.to_device(model) before running it")


_COPIES = weakref.WeakKeyDictionary()  # model -> its HostCopy (host memory kept between moves)


def to_host(model: torch.nn.Module) -> None:
    """The model's device storage into host memory (the frozen reference between its passes)."""
    _COPIES.setdefault(model, HostCopy()).to_host(model)


def to_device(model: torch.nn.Module) -> None:
    """Bring back what `to_host` moved, bit for bit, into the same tensors."""
    if model in _COPIES:
        _COPIES[model].to_device()


@contextlib.contextmanager
def on_device(model: torch.nn.Module):
    """The model on the device inside the block, back in host memory on leaving it, whatever
    raised."""
    to_device(model)
    try:
        yield
    finally:
        to_host(model)


def enabled(mode: str) -> bool:
    """model.offload: on, off, or auto (on wherever the engine sleeps beside the actor on an
    accelerator: then there is memory to give it)."""
    return {"on": True, "off": False}.get(mode, npu_ops.engine_supports_sleep())


def host_bytes_per_rank(model_path: str, world: int, offload: bool, reference_dtype=None,
                        frozen_dtype=None, tower: str = "") -> int:
    """The host memory one rank's copies take: with the offload, the actor's fp32 shards and
    Adam's two fp32 moments (12 bytes per parameter over the ranks), or with adapters on a base
    frozen in `frozen_dtype`, that base's shards (the adapters and their moments, a few percent
    at most, not counted); with a reference, its shards in `reference_dtype`. tower: "" (a
    vision-language checkpoint's language model alone), "frozen" (the whole model, its tower's
    fp32 shards without moments: 4 bytes a parameter) or "trained" (the whole model). Counted on
    a model built on the meta device from config.json (no weights read)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    hf_cfg = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = (AutoModelForImageTextToText.from_config(hf_cfg) if tower else
                 AutoModelForCausalLM.from_config(checkpoint.language_config(hf_cfg)))
    params = sum(p.numel() for p in model.parameters())  # a tied embedding once
    still = (sum(p.numel() for p in model.get_submodule("model.visual").parameters())
             if tower == "frozen" else 0)
    actor = frozen_dtype.itemsize if frozen_dtype is not None else 12
    per_param = (actor if offload else 0) + (reference_dtype.itemsize if reference_dtype else 0)
    return (-(-(params - still) // world) * per_param
            + -(-still // world) * ((4 if offload else 0) + (reference_dtype.itemsize
                                                              if reference_dtype else 0)))


def host_memory_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (the host's, every process's share); None where
    there is none (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            kib = dict(line.split(":", 1) for line in f)
        return int(kib["MemAvailable"].split()[0]) << 10
    except (OSError, KeyError, ValueError):
        return None


def check_host_memory(needed_per_rank: int, local_ranks: int, available: int | None) -> None:
    """Raise a one-line ValueError when the ranks of this node cannot hold their host copies."""
    if available is None or needed_per_rank * local_ranks <= available:
        return
    gib = needed_per_rank / 2**30
    raise ValueError(
        f"model.offload: {local_ranks} rank(s) on this node would move {gib * local_ranks:.1f} "
        f"GiB to host memory ({gib:.1f} GiB each: the actor's fp32 shards and Adam's state, "
        "and a reference's shards), but "
        f"{available / 2**30:.1f} GiB is available. Fix: model.offload=off, more ranks, or a "
        "host with more memory")
