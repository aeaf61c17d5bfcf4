"""The platform layer: the only file that names npu, cuda or torch_npu.

Everything device-specific is decided here once and exposed as plain functions:
device type (npu > cuda > cpu), the process-group backend, local device selection, memory stats,
empty_cache, synchronize, environment tuning, and whether the engine supports sleep mode.

Ascend notes: the NPU branches follow torch_npu's and vLLM-Ascend's documentation; they have not
been run on an NPU by this project's tests (no NPU is reachable from CI). CPU and CUDA paths are the
ones exercised.
"""

import functools
import logging
import os

import torch

log = logging.getLogger("grpo")


@functools.cache
def device_type() -> str:
    """'npu' if torch_npu imports and sees a device, else 'cuda' if available, else 'cpu'."""
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)

        if torch.npu.is_available():
            return "npu"
    except ImportError:
        pass
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def dist_backend() -> str:
    # NPU: gloo for CPU tensors (object collectives), hccl for device tensors.
    return {"npu": "cpu:gloo,npu:hccl", "cuda": "nccl", "cpu": "gloo"}[device_type()]


def local_device() -> torch.device:
    """The device of this rank (LOCAL_RANK under torchrun, 0 otherwise); sets it current."""
    kind = device_type()
    if kind == "cpu":
        return torch.device("cpu")
    idx = int(os.environ.get("LOCAL_RANK", "0"))
    getattr(torch, kind).set_device(idx)
    return torch.device(kind, idx)


def setup_env() -> dict:
    """Set environment defaults before the engine or the accelerator runtime initialise.

    A value already in the user's environment is kept. Returns what was set, for the log.
    """
    kind = device_type()
    wanted = {}
    if kind == "cpu":
        # One OpenMP thread per rank: ~10x faster generation than oversubscribed cores.
        wanted["OMP_NUM_THREADS"] = "1"
    elif kind == "npu":
        # From vLLM-Ascend / torch_npu guides (not run here): NZ weight layout off for RL weight
        # updates, AIV expansion for HCCL.
        wanted.update(VLLM_ASCEND_ENABLE_NZ="0", HCCL_OP_EXPANSION_MODE="AIV")
    applied = {k: v for k, v in wanted.items() if k not in os.environ}
    os.environ.update(applied)
    if kind == "cpu":
        # vLLM's CPU worker later turns torch.set_num_threads into a no-op: set it now.
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    return applied


def engine_supports_sleep() -> bool:
    """vLLM's sleep mode frees weights and KV cache on CUDA and NPU; the CPU backend lacks it."""
    return device_type() in ("cuda", "npu")


def synchronize() -> None:
    if device_type() != "cpu":
        getattr(torch, device_type()).synchronize()


def empty_cache() -> None:
    if device_type() != "cpu":
        getattr(torch, device_type()).empty_cache()


def memory_gb() -> dict:
    """Allocated, reserved and peak accelerator memory in GiB; on CPU, this process's RSS."""
    kind = device_type()
    if kind == "cpu":
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB on Linux
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
        return {"allocated": rss, "reserved": rss, "peak": peak}
    mod = getattr(torch, kind)
    return {"allocated": mod.memory_allocated() / 2**30, "reserved": mod.memory_reserved() / 2**30,
            "peak": mod.max_memory_allocated() / 2**30}
