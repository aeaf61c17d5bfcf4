"""The model's hot functions in plain torch, and the patching of a Qwen model.

Each is the reference for a fused kernel of npu_ops (same signature, same numbers up to rounding):
RMSNorm, rotary embedding and SwiGLU MLP as transformers computes them. `patch_qwen` routes a
dense Qwen2/Qwen3 model through one path (model.fused_kernels): the fused one on an Ascend
device; the compiled one, the same plain-torch arithmetic under torch.compile, which fuses each
function's elementwise work into a few kernels (a GPU, or CPU); the reference one to bisect
numerics anywhere. (The Ascend fused attention kernel's contract in plain torch, which only tests
run, is in tests/reference.py.)
"""

import sys
import types

import torch

import npu_ops


def rms_norm(x, weight, eps: float):
    """Qwen2/Qwen3 RMSNorm as transformers computes it: normalise in fp32, scale in input dtype."""
    dtype = x.dtype
    x = x.float()
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def rms_norm_reference(module, hidden_states):
    return rms_norm(hidden_states, module.weight, module.variance_epsilon)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rotary_reference(q, k, cos, sin, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb: q, k (B, N, S, D); cos, sin (B, S, D)."""
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def swiglu_mlp_reference(module, x):
    return module.down_proj(module.act_fn(module.gate_proj(x)) * module.up_proj(x))


def _silu_mul(gate, up):
    return torch.nn.functional.silu(gate) * up


COMPILED = {}  # name -> the compiled function, made at the first patch (torch.compile is lazy)


def compiled(name: str):
    """One compiled function per process, shared by every module: a compiled function that took
    the module would be guarded on (and recompiled for) each module. dynamic=True: a packed row's
    token count changes from micro-batch to micro-batch and must not recompile it."""
    if name not in COMPILED:
        fn = {"rms_norm": rms_norm, "silu_mul": _silu_mul, "rotary": rotary_reference}[name]
        COMPILED[name] = torch.compile(fn, dynamic=True)
    return COMPILED[name]


def rms_norm_compiled(module, hidden_states):
    return compiled("rms_norm")(hidden_states, module.weight, module.variance_epsilon)


def rotary_compiled(q, k, cos, sin, unsqueeze_dim=1):
    return compiled("rotary")(q, k, cos, sin, unsqueeze_dim)


def swiglu_mlp_compiled(module, x):  # silu: patch_qwen checks the model's hidden_act
    return module.down_proj(compiled("silu_mul")(module.gate_proj(x), module.up_proj(x)))


def kernel_path(mode: str):
    """model.fused_kernels -> which path to patch in: 'fused', 'compiled', 'reference' or None
    (leave the model as transformers builds it). 'auto' is fused where npu_ops says so (an
    Ascend device) and None elsewhere; 'compiled' runs the plain-torch functions under
    torch.compile (inductor: a GPU or CPU); 'reference' routes through the same patch points
    with the plain-torch functions (to bisect numerics)."""
    if mode not in ("auto", "fused", "compiled", "reference", "off"):
        raise ValueError(f"model.fused_kernels='{mode}': use auto, fused, compiled, reference or "
                         "off")
    if mode == "fused" and not npu_ops.has_kernels():
        raise ValueError("model.fused_kernels=fused needs Ascend's kernel library. Fix: run "
                         "scripts/setup_npu.sh on an Ascend machine, or use auto/reference/off")
    if mode == "compiled" and not npu_ops.inductor_runs():
        raise ValueError("model.fused_kernels=compiled is not run on this device (inductor "
                         "here is untried). Fix: use auto (the fused kernels here)")
    if mode == "auto":
        return "fused" if npu_ops.fused_by_default() else None
    return None if mode == "off" else mode


PATHS = {"fused": (npu_ops.rms_norm_fused, npu_ops.swiglu_mlp_fused, npu_ops.rotary_fused),
         "compiled": (rms_norm_compiled, swiglu_mlp_compiled, rotary_compiled),
         "reference": (rms_norm_reference, swiglu_mlp_reference, rotary_reference)}


def rotary_scale(model) -> float:
    """The factor the model's rotary embedding multiplies cos and sin by (transformers'
    attention_scaling: 1 but for rope_scaling such as YaRN's attention factor)."""
    return max((abs(float(m.attention_scaling)) for m in model.modules()
                if hasattr(m, "attention_scaling")), default=1.0)


def patch_qwen(model, path: str = "fused") -> list:
    """Route a Qwen2/Qwen3 model's RMSNorm, MLP and rotary embedding through `path`; on the
    fused path, a kernel that cannot take this chip or this model (npu_ops.kernel_fallbacks)
    goes through its plain-torch reference instead, and the report says why.

    RMSNorm and MLP are patched on this model's module instances; the rotary function is a
    module-level function of transformers' modeling file, so that patch holds for every model of
    that architecture in the process. Returns what was patched, for the log.
    """
    slots = ("rms_norm", "mlp", "rotary")
    chosen, why = dict(zip(slots, PATHS[path])), {}
    if path == "fused":
        why = npu_ops.kernel_fallbacks(rotary_scale(model))
        chosen.update({slot: dict(zip(slots, PATHS["reference"]))[slot] for slot in why})
    rms_norm, mlp, rotary = (chosen[slot] for slot in slots)
    modeling = sys.modules[type(model).__module__]
    arch = type(model).__name__
    if not hasattr(modeling, "apply_rotary_pos_emb") or "Qwen" not in arch or "Moe" in arch:
        raise ValueError(f"fused kernels are written for dense Qwen2/Qwen3, not {arch}")
    if getattr(model.config, "hidden_act", "silu") != "silu":
        raise ValueError(f"fused kernels are written for SwiGLU (hidden_act silu), not "
                         f"{model.config.hidden_act}")
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
    lines = [f"{counts['RMSNorm']} RMSNorm -> {rms_norm.__name__}",
             f"{counts['MLP']} MLP -> {mlp.__name__}",
             f"{modeling.__name__}.apply_rotary_pos_emb -> {rotary.__name__}"]
    return [line + (f" ({why[slot]})" if slot in why else "") for slot, line in zip(slots, lines)]
