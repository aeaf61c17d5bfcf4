"""The platform layer: the only file that names npu, cuda or torch_npu.

Everything device-specific is decided here once, logged, and exposed as plain functions:
1. platform: device type (npu > cuda > cpu), process-group backend, local device, memory, sync;
2. environment: Ascend defaults set before torch_npu and the engine initialise (user values win);
3. checks: Ascend misconfigurations that would otherwise fail minutes into start-up;
4. fused kernels for Qwen2/Qwen3 (dense): RMSNorm, rotary embedding, SwiGLU MLP, each next to its
   reference implementation, plus the choice of attention implementation.

What was verified where: the CPU paths and the wiring of every NPU branch run in CI (the kernel
patches against a stand-in namespace that implements torch_npu's documented signatures in plain
torch). Nothing here has been run on an Ascend NPU by this project: the NPU facts come from the
documentation and code of torch_npu, vLLM-Ascend and transformers, and say so where they are used.
"""

import functools
import importlib.metadata
import importlib.util
import logging
import os
import sys
import types

import torch

log = logging.getLogger("grpo")


# ----------------------------------------------------------------------------------------------
# 1) platform


def npu_installed() -> bool:
    """torch_npu is installed. Does not import it: importing starts the Ascend runtime (CANN),
    which must only happen after `setup_env`."""
    return importlib.util.find_spec("torch_npu") is not None


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


def _accel(name: str):
    """torch.accelerator's function `name` where this torch has it, else torch.<device>'s."""
    return getattr(torch.accelerator, name, None) or getattr(getattr(torch, device_type()), name)


def local_device() -> torch.device:
    """The device of this rank (LOCAL_RANK under torchrun, 0 otherwise); sets it current."""
    kind = device_type()
    if kind == "cpu":
        return torch.device("cpu")
    idx = int(os.environ.get("LOCAL_RANK", "0"))
    _accel("set_device_index")(idx)
    return torch.device(kind, idx)


def engine_supports_sleep() -> bool:
    """vLLM's sleep mode frees weights and KV cache on CUDA and NPU; the CPU backend lacks it."""
    return device_type() in ("cuda", "npu")


def synchronize() -> None:
    if device_type() != "cpu":
        _accel("synchronize")()


def empty_cache() -> None:
    if device_type() != "cpu":
        _accel("empty_cache")()


def memory_gb() -> dict:
    """Allocated, reserved and peak accelerator memory in GiB; on CPU, this process's RSS."""
    if device_type() == "cpu":
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB on Linux
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
        return {"allocated": rss, "reserved": rss, "peak": peak}
    return {"allocated": _accel("memory_allocated")() / 2**30,
            "reserved": _accel("memory_reserved")() / 2**30,
            "peak": _accel("max_memory_allocated")() / 2**30}


# ----------------------------------------------------------------------------------------------
# 2) environment


def ascend_env_defaults(graph_mode: bool, sleep_mode: bool) -> dict:
    """The environment an RL run on Ascend wants, from torch_npu's and vLLM-Ascend's docs and
    verl's Ascend tuning guide (not run here):
    - TASK_QUEUE_ENABLE: 2 moves more operator dispatch to a second thread (faster in eager
      mode), but torch_npu refuses graph capture with it, so graph mode needs 1;
    - HCCL_OP_EXPANSION_MODE=AIV: collectives scheduled by the AI vector cores, not the AI CPU;
    - VLLM_ASCEND_ENABLE_NZ=0: the NZ weight layout makes derived copies of weights that an
      in-place weight sync does not update (garbled generations after the first sync);
    - PYTORCH_NPU_ALLOC_CONF: sleep mode's memory pool is incompatible with expandable segments;
    - CPU_AFFINITY_CONF=1: bind each rank's threads to its card's share of CPU cores (2 binds
      finer; vLLM-Ascend also binds its own threads).
    """
    env = {"TASK_QUEUE_ENABLE": "1" if graph_mode else "2", "HCCL_OP_EXPANSION_MODE": "AIV",
           "VLLM_ASCEND_ENABLE_NZ": "0", "CPU_AFFINITY_CONF": "1"}
    if sleep_mode:
        env["PYTORCH_NPU_ALLOC_CONF"] = "expandable_segments:False"
    return env


def setup_env(graph_mode: bool = False, sleep_mode: bool = True) -> dict:
    """Set environment defaults before the engine or the accelerator runtime initialise.

    A value already in the user's environment is kept. Returns {name: (value, "default"|"user")}
    for every variable this platform cares about, for the start-up log.
    Call it before `device_type()`, the process group and the engine. Recent torch may import
    torch_npu together with torch (device-backend autoload); these variables are read when the
    device, the allocator and HCCL initialise, which happens later (from torch_npu's docs, not
    checked on an NPU). Exporting them in the shell is always safe.
    """
    if npu_installed():
        wanted = ascend_env_defaults(graph_mode, sleep_mode)
    elif torch.cuda.is_available():
        wanted = {}
    else:  # CPU: one OpenMP thread per rank, ~10x faster generation than oversubscribed cores
        wanted = {"OMP_NUM_THREADS": "1"}
    report = {}
    for name, value in wanted.items():
        report[name] = (os.environ.get(name, value), "user" if name in os.environ else "default")
        os.environ.setdefault(name, value)
    if "OMP_NUM_THREADS" in wanted:
        # vLLM's CPU worker later turns torch.set_num_threads into a no-op: set it now.
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    return report


# ----------------------------------------------------------------------------------------------
# 3) checks (before any model loads)

# Combinations vLLM-Ascend documents together (its versioning policy); the README repeats them.
# None was run by this project: no NPU is reachable from its machines.
TESTED_NPU_STACKS = [
    {"vllm": "0.23.0", "vllm-ascend": "0.23.0", "torch-npu": "2.10.0.post4"},
]


def installed_versions() -> dict:
    """Versions of the engine stack, read from package metadata without importing anything."""
    out = {}
    for name in ("vllm", "vllm-ascend", "torch-npu"):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _release(version: str) -> str:
    """'0.23.0.post1' -> '0.23.0'; '2.10.0.post4' stays (torch-npu's post releases differ)."""
    return version.split(".post")[0] if version else version


def check_ascend(graph_mode: bool, sleep_level: int, env: dict, versions: dict) -> list:
    """Ascend misconfigurations, each as one line naming the setting and the fix.

    Raises ValueError for what would fail or silently train on garbage; returns warnings.
    """
    errors, warnings = [], []
    if graph_mode and env.get("TASK_QUEUE_ENABLE") == "2":
        errors.append("TASK_QUEUE_ENABLE=2 with rollout.enforce_eager=false (graph mode): torch_npu "
                      "refuses graph capture at level 2. Fix: export TASK_QUEUE_ENABLE=1, or set "
                      "rollout.enforce_eager=true")
    if sleep_level == 2:
        errors.append("rollout.sleep_level=2 on vLLM-Ascend: level 2 has produced constant wrong "
                      "rewards there. Fix: rollout.sleep_level=1")
    if "expandable_segments:true" in env.get("PYTORCH_NPU_ALLOC_CONF", "").replace(" ", "").lower():
        errors.append("PYTORCH_NPU_ALLOC_CONF has expandable_segments:True, which vLLM-Ascend's "
                      "sleep-mode memory pool rejects. Fix: unset it or use "
                      "expandable_segments:False")
    vllm, ascend, npu = versions.get("vllm"), versions.get("vllm-ascend"), versions.get("torch-npu")
    if ascend and ascend != "0.0.0" and vllm and _release(ascend) != _release(vllm):
        errors.append(f"vllm {vllm} with vllm-ascend {ascend}: vLLM-Ascend X.Y.Z runs on vLLM X.Y.Z "
                      f"only. Fix: pip install vllm=={_release(ascend)} (see requirements-npu.txt)")
    stack = {"vllm": _release(vllm), "vllm-ascend": _release(ascend), "torch-npu": npu}
    if not errors and stack not in TESTED_NPU_STACKS:
        tested = "; ".join(", ".join(f"{k} {v}" for k, v in s.items()) for s in TESTED_NPU_STACKS)
        warnings.append(f"engine stack {stack} is outside the documented matrix ({tested}); "
                        "install requirements-npu.txt if anything misbehaves")
    if errors:
        raise ValueError("Ascend configuration:\n  " + "\n  ".join(errors))
    return warnings


def check_platform(graph_mode: bool, sleep_level: int) -> None:
    """Run the checks of the platform this process is on; warnings go to the log."""
    if npu_installed():
        for line in check_ascend(graph_mode, sleep_level, dict(os.environ), installed_versions()):
            log.warning(line)


# ----------------------------------------------------------------------------------------------
# 4) fused kernels for Qwen2 / Qwen3 (dense): reference implementations next to the patches

KERNELS = None  # a torch_npu-like namespace; tests set a stand-in to exercise the fused path


def kernels():
    if KERNELS is not None:
        return KERNELS
    import torch_npu

    return torch_npu


def rms_norm_reference(module, hidden_states):
    """Qwen2/Qwen3 RMSNorm as transformers computes it: normalise in fp32, scale in input dtype."""
    dtype = hidden_states.dtype
    x = hidden_states.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
    return module.weight * x.to(dtype)


def rms_norm_fused(module, hidden_states):
    # torch_npu.npu_rms_norm(x, gamma, epsilon) -> (y, rstd); gamma must match x's dtype
    x = hidden_states.to(module.weight.dtype)
    return kernels().npu_rms_norm(x, module.weight, epsilon=module.variance_epsilon)[0]


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_reference(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb: q, k (B, N, S, D); cos, sin (B, S, D)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotary_fused(q, k, cos, sin, unsqueeze_dim=1):
    # torch_npu.npu_rotary_mul(x, r1, r2) = x * r1 + rotate_half(x) * r2 ("half" mode); with x in
    # BNSD layout it takes r1/r2 of shape (1|B, 1, S, D): cos.unsqueeze(1) is (B, 1, S, D)
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    mul = kernels().npu_rotary_mul
    return mul(q, cos, sin).to(q.dtype), mul(k, cos, sin).to(k.dtype)


def swiglu_mlp_reference(module, x):
    return module.down_proj(module.act_fn(module.gate_proj(x)) * module.up_proj(x))


def swiglu_mlp_fused(module, x):
    # torch_npu.npu_swiglu(t, dim=-1) = silu(first half of t) * second half: cat([gate, up])
    gate_up = torch.cat((module.gate_proj(x), module.up_proj(x)), dim=-1)
    return module.down_proj(kernels().npu_swiglu(gate_up, dim=-1))


def attention_implementation(requested: str) -> str:
    """'auto' -> 'flash_attention_2' on NPU (transformers routes it to its wrappers around
    torch_npu.npu_fusion_attention; not run here), 'sdpa' elsewhere."""
    if requested != "auto":
        return requested
    return "flash_attention_2" if device_type() == "npu" else "sdpa"


PATHS = {"fused": (rms_norm_fused, swiglu_mlp_fused, rotary_fused),
         "reference": (rms_norm_reference, swiglu_mlp_reference, rotary_reference)}


def kernel_path(mode: str):
    """model.fused_kernels -> which path to patch in: 'fused', 'reference' or None (leave the
    model as transformers builds it). 'auto' is fused on NPU and None elsewhere; 'reference'
    routes through the same patch points with the plain-torch functions (to bisect numerics)."""
    if mode not in ("auto", "fused", "reference", "off"):
        raise ValueError(f"model.fused_kernels='{mode}': use auto, fused, reference or off")
    if mode == "fused" and KERNELS is None and not npu_installed():
        raise ValueError("model.fused_kernels=fused needs torch_npu. Fix: install "
                         "requirements-npu.txt on an Ascend machine, or use auto/reference/off")
    if mode == "auto":
        return "fused" if device_type() == "npu" else None
    return None if mode == "off" else mode


def patch_qwen(model, path: str = "fused") -> list:
    """Route a Qwen2/Qwen3 model's RMSNorm, MLP and rotary embedding through `path`.

    RMSNorm and MLP are patched on this model's module instances; the rotary function is a
    module-level function of transformers' modeling file, so that patch holds for every model of
    that architecture in the process. Returns what was patched, for the log.
    """
    rms_norm, mlp, rotary = PATHS[path]
    modeling = sys.modules[type(model).__module__]
    arch = type(model).__name__
    if not hasattr(modeling, "apply_rotary_pos_emb") or "Qwen" not in arch or "Moe" in arch:
        raise ValueError(f"fused kernels are written for dense Qwen2/Qwen3, not {arch}")
    counts = {"RMSNorm": 0, "MLP": 0}
    for module in model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm"):
            module.forward = types.MethodType(rms_norm, module)
            counts["RMSNorm"] += 1
        elif name.endswith("MLP"):
            module.forward = types.MethodType(mlp, module)
            counts["MLP"] += 1
    modeling.apply_rotary_pos_emb = rotary
    return [f"{counts['RMSNorm']} RMSNorm -> {rms_norm.__name__}",
            f"{counts['MLP']} MLP -> {mlp.__name__}",
            f"{modeling.__name__}.apply_rotary_pos_emb -> {rotary.__name__}"]
