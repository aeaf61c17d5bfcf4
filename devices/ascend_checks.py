"""Ascend start-up checks: misconfigurations that would fail minutes into start-up or train on
wrong numbers, found from the environment variables and the installed packages' versions before
any model loads. Nothing here imports torch, the torch-npu package or the engine, or calls the
device; npu_ops runs these checks where torch-npu is installed (check_platform) and reads the
engine's applied settings back itself."""

import importlib.metadata
import os

# vLLM-Ascend reads the weight NZ mode from additional_config's weight_nz_mode from 0.20.2rc1 on
# (ascend_config.py; VLLM_ASCEND_ENABLE_NZ is its deprecated fallback there), before from the
# variable only (envs.py). NPUWorker.wake_up raises unless the mode is 0 (0.23 worker/worker.py).
NZ_CONFIG_SINCE = (0, 20, 2)
# LoRA came to vLLM-Ascend in 0.8.4rc1 (PR #521, vllm_ascend/lora/punica_npu.py); its support
# matrix marks it experimental from 0.15.0rc1 on (PR #6759; still so in 0.23.0). Read from the
# repository's history, not run: no NPU is reachable from this project's machines.
LORA_SINCE = (0, 8, 4)


# Combinations vLLM-Ascend documents together (its versioning policy); docs/platforms.md repeats them.
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


def release(version: str | None) -> tuple | None:
    """The release numbers of a PEP 440 version: '0.23.0+empty' (vLLM built for vLLM-Ascend's
    image), '0.23.0.post1' and '0.23.0rc1' all give (0, 23, 0)."""
    from packaging.version import Version

    return Version(version).release if version else None


def chip_type(soc_version: int) -> str:
    """The device type of a chip from the soc_version torch-npu reports (npu_ops.check_device
    reads it), as vLLM-Ascend 0.23 names it (utils.py check_ascend_device_type: 220-225 A2,
    250-255 A3, 200-205 310P, 260 A5)."""
    for low, high, name in ((220, 225, "A2"), (250, 255, "A3"), (200, 205, "_310P"),
                            (260, 260, "A5")):
        if low <= soc_version <= high:
            return name
    return f"unknown (soc_version {soc_version})"


A3_FIX = ("vLLM-Ascend's A3 image (quay.io/ascend/vllm-ascend:v0.23.0-a3), or vllm-ascend built "
          "from source with SOC_VERSION=ascend910_9391 (its installation guide)")


def check_device_type(build: str | None, soc_version: int) -> None:
    """vLLM-Ascend's wheel is built for one device type (its _build_info.__device_type__; both
    PyPI wheels of 0.23.0 say 'A2'), and NPUWorker.__init__ stops the engine when the chip is
    another (0.23 worker/worker.py:124 -> utils.py:845-866). Raises ValueError with the fix
    before anything loads; `build` None: no vLLM-Ascend, nothing to compare."""
    chip = chip_type(soc_version)
    if build is not None and chip != build:
        fix = A3_FIX if chip == "A3" else f"a vllm-ascend built for {chip}"
        raise ValueError(f"this node's chip is {chip} (soc_version {soc_version}) but the "
                         f"installed vllm-ascend was built for {build}: its NPUWorker would stop "
                         f"the engine at start. Fix: {fix}")


def _has_nnal(env: dict) -> bool:
    """NNAL's ATB is set up (its set_env.sh exports ATB_HOME_PATH and puts libatb.so on
    LD_LIBRARY_PATH), or libatb.so is on LD_LIBRARY_PATH some other way."""
    return bool(env.get("ATB_HOME_PATH")) or any(
        os.path.exists(os.path.join(d, "libatb.so"))
        for d in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if d)


def _engine_start(errors: list, warnings: list, env: dict, versions: dict,
                  matmul_allreduce: bool, tp_size: int, soc: str | None) -> None:
    """check_ascend's checks of what the engine loads at start: NNAL, the fused matmul +
    all-reduce (MC2)."""
    if versions.get("vllm-ascend") and not _has_nnal(env):
        # NPUWorker.__init__ calls torch-npu's _register_atb_extensions (0.23 worker/worker.py),
        # which raises OSError "Please run 'source set_env.sh' in the NNAL installation path"
        # when libop_plugin_atb.so cannot load libatb.so (torch-npu's op_plugin/atb/_atb_ops.py)
        errors.append("NNAL (libatb.so) is not set up in this shell: ATB_HOME_PATH is unset and "
                      "no LD_LIBRARY_PATH directory has libatb.so, so vLLM-Ascend's NPUWorker "
                      "would fail loading torch-npu's ATB operators at engine start. Fix: "
                      "source /usr/local/Ascend/nnal/atb/set_env.sh (NNAL 9.1.0)")
    if matmul_allreduce and env.get("HCCL_OP_EXPANSION_MODE") == "AIV":
        errors.append("rollout.matmul_allreduce=true with HCCL_OP_EXPANSION_MODE=AIV: the fused "
                      "matmul + all-reduce (MC2) kernels have hung under AIV expansion "
                      "(vllm-ascend issues #14928, #3881). Fix: unset HCCL_OP_EXPANSION_MODE "
                      "(the trainer then leaves it to HCCL), or rollout.matmul_allreduce=false")
    if matmul_allreduce and soc not in ("A2", None):
        errors.append(f"rollout.matmul_allreduce=true on {soc}: vLLM-Ascend documents its fused "
                      "matmul + all-reduce (npu_mm_all_reduce_base) for A2 only. Fix: "
                      "rollout.matmul_allreduce=false")
    if matmul_allreduce:
        warnings.append("rollout.matmul_allreduce=true: the fused matmul + all-reduce (MC2) has "
                        "not been measured with sleep mode and weight reload; "
                        + ("it does nothing at rollout.tp_size=1" if tp_size == 1 else
                           "watch logp_gap and the first steps' times"))
    if env.get("VLLM_ASCEND_ENABLE_MATMUL_ALLREDUCE") is not None:
        warnings.append("VLLM_ASCEND_ENABLE_MATMUL_ALLREDUCE is ignored: the engine gets "
                        "additional_config.enable_matmul_allreduce from rollout.matmul_allreduce "
                        f"({str(matmul_allreduce).lower()})")


def _integer(value: str | None, lo: int, hi: int | None = None) -> bool:
    return value is not None and value.strip().isdigit() and lo <= int(value) <= (hi or int(value))


def _hccl(errors: list, warnings: list, env: dict) -> None:
    """HCCL's variables against the ranges of CANN 9.1.0's environment variable reference
    (HCCL_CONNECT_TIMEOUT, HCCL_EXEC_TIMEOUT, HCCL_BUFFSIZE, HCCL_IF_BASE_PORT) and the way
    torch-npu reads them: a value out of range is an error before any process group forms, not a
    hang or a failed link later."""
    bad = []
    for name, lo, hi, what in (("HCCL_CONNECT_TIMEOUT", 120, 7200, "whole seconds, 120-7200"),
                               ("HCCL_BUFFSIZE", 1, None, "whole MB, at least 1"),
                               ("HCCL_IF_BASE_PORT", 1024, 65520, "a port, 1024-65520")):
        if env.get(name) is not None and not _integer(env[name], lo, hi):
            bad.append(f"{name}={env[name]!r} ({what})")
    # torch-npu reads HCCL_EXEC_TIMEOUT with strtol (v26.1.0-pytorch2.10.0
    # OptionsManager.cpp:182-193): "0.5" would be 0, which its watchdog takes for "never"
    exec_s = env.get("HCCL_EXEC_TIMEOUT")
    if exec_s is not None and not _integer(exec_s, 0):
        bad.append(f"HCCL_EXEC_TIMEOUT={exec_s!r} (whole seconds, 0 or more: torch-npu 2.10 "
                   "reads the leading integer only)")
    if bad:
        errors.append("HCCL settings out of CANN's documented ranges: " + "; ".join(bad)
                      + ". Fix: correct or unset them")
    elif exec_s is not None and env.get("HCCL_OP_EXPANSION_MODE") == "AIV" and (
            float(exec_s) == 0 or float(exec_s) > 1091):
        warnings.append(f"HCCL_EXEC_TIMEOUT={exec_s} with HCCL_OP_EXPANSION_MODE=AIV: HCCL takes "
                        "1091 s (AIV's limit; 0 does not mean never there)")


def hccl_summary(env: dict) -> str:
    """One line for the log: what HCCL will use, with CANN 9.1.0's documented defaults where a
    variable is unset (a collective under AIV expansion waits at most 1091 s on the device,
    whatever train.dist_timeout_s allows on the host)."""
    aiv = env.get("HCCL_OP_EXPANSION_MODE") == "AIV"
    exec_s = env.get("HCCL_EXEC_TIMEOUT", "1091" if aiv else "1836")
    return (f"HCCL: connect timeout {env.get('HCCL_CONNECT_TIMEOUT', '120')} s, exec timeout "
            f"{exec_s} s{' (AIV: at most 1091)' if aiv else ''}, buffer "
            f"{env.get('HCCL_BUFFSIZE', '200')} MB x2 per communicator, host ports from "
            f"{env.get('HCCL_IF_BASE_PORT', '60000')}, expansion "
            f"{env.get('HCCL_OP_EXPANSION_MODE', 'HCCL decides')}")


def stack_versions(env: dict) -> dict:
    """CANN's and the driver's versions as their installers record them (the first version= line
    of the toolkit's <arch>-linux/ascend_toolkit_install.info under ASCEND_TOOLKIT_HOME or
    ASCEND_HOME_PATH, and of /usr/local/Ascend/driver/version.info; CANN's installation guide
    names the first; not read on a node by this project: None where absent), and the Python
    packages' (installed_versions)."""
    import glob

    home = env.get("ASCEND_TOOLKIT_HOME") or env.get("ASCEND_HOME_PATH") or ""
    found = {"cann": glob.glob(os.path.join(home, "*-linux", "ascend_toolkit_install.info"))
             if home else [], "driver": ["/usr/local/Ascend/driver/version.info"]}
    out = {}
    for name, paths in found.items():
        out[name] = None
        for path in paths:
            try:
                with open(path) as f:
                    out[name] = next((line.split("=", 1)[1].strip() for line in f
                                      if line.lower().startswith("version=")), None)
            except OSError:
                continue
            break
    return {**out, **installed_versions()}


def check_ascend(env: dict, versions: dict, graph_mode: bool = False, temperature: float = 1.0,
                 top_p: float = 1.0, lora: bool = False, matmul_allreduce: bool = False,
                 tp_size: int = 1, soc: str | None = None) -> list:
    """Ascend misconfigurations, each as one line naming the setting and the fix. `env` is the
    environment the run will have (npu_ops.check_platform: without the defaults setup_env takes
    back), `soc` the device type vLLM-Ascend was built for (npu_ops.ascend_soc).

    Raises ValueError for what would fail or silently train on wrong numbers; returns warnings.
    """
    from packaging.version import Version

    errors, warnings = [], []
    _engine_start(errors, warnings, env, versions, matmul_allreduce, tp_size, soc)
    _hccl(errors, warnings, env)
    if graph_mode and env.get("TASK_QUEUE_ENABLE") == "2":
        errors.append("TASK_QUEUE_ENABLE=2 with rollout.enforce_eager=false (graph mode): "
                      "torch-npu refuses graph capture at level 2. Fix: export "
                      "TASK_QUEUE_ENABLE=1, or set rollout.enforce_eager=true")
    vllm, ascend, npu = versions.get("vllm"), versions.get("vllm-ascend"), versions.get("torch-npu")
    if env.get("VLLM_ASCEND_ENABLE_NZ", "1") != "0" and (release(ascend) or ()) < NZ_CONFIG_SINCE:
        errors.append(f"VLLM_ASCEND_ENABLE_NZ={env.get('VLLM_ASCEND_ENABLE_NZ', '1 (unset)')}: "
                      "vLLM-Ascend's NPUWorker.wake_up raises whenever the weight NZ mode is not 0, "
                      f"so the first weight sync would fail (vllm-ascend {ascend} reads no "
                      "weight_nz_mode). Fix: export VLLM_ASCEND_ENABLE_NZ=0")
    if temperature != 1.0 or top_p != 1.0:
        errors.append(f"rollout.temperature={temperature}, rollout.top_p={top_p}: vLLM-Ascend's "
                      "sampler returns the logprobs of the raw logits whatever logprobs_mode says, "
                      "so the mismatch correction (grpo.is_correction) and logp_gap would compare "
                      "the wrong distributions. Fix: rollout.temperature=1.0 and rollout.top_p=1.0")
    if "expandable_segments:true" in env.get("PYTORCH_NPU_ALLOC_CONF", "").replace(" ", "").lower():
        errors.append("PYTORCH_NPU_ALLOC_CONF has expandable_segments:True, which vLLM-Ascend's "
                      "sleep-mode memory pool rejects. Fix: unset it or use "
                      "expandable_segments:False")
    if lora and ascend and (0, 0, 0) < release(ascend) < LORA_SINCE:
        errors.append(f"model.lora.rank > 0 with vllm-ascend {ascend}, which has no LoRA (from "
                      "0.8.4rc1 on). Fix: install a newer vllm-ascend (scripts/setup_npu.sh), or "
                      "model.lora.rank=0 to train every weight")
    elif lora:
        warnings.append(f"model.lora: vLLM-Ascend marks LoRA experimental (vllm-ascend {ascend}); "
                        "the engine's logprobs are checked against the trainer's every step "
                        "(logp_gap): watch it")
    if ascend and release(ascend) != (0, 0, 0) and vllm and release(ascend) != release(vllm):
        want = ".".join(map(str, release(ascend)))
        errors.append(f"vllm {vllm} with vllm-ascend {ascend}: vLLM-Ascend X.Y.Z runs on vLLM X.Y.Z "
                      f"only. Fix: install vllm {want} (scripts/setup_npu.sh)")
    documented = any(release(vllm) == release(s["vllm"]) and release(ascend) == release(
        s["vllm-ascend"]) and npu and Version(npu).public == s["torch-npu"] for s in TESTED_NPU_STACKS)
    if not errors and not documented:
        tested = "; ".join(", ".join(f"{k} {v}" for k, v in s.items()) for s in TESTED_NPU_STACKS)
        warnings.append(f"engine stack vllm {vllm}, vllm-ascend {ascend}, torch-npu {npu} is "
                        f"outside the documented matrix ({tested}); run scripts/setup_npu.sh if "
                        "anything misbehaves")
    if graph_mode:  # vLLM-Ascend RFC #16322 (open): captured graphs can keep stale weight pointers
        warnings.append("!" * 12 + " rollout.enforce_eager=false: graph mode with live weight sync "
                        "is not yet safe on vLLM-Ascend (graph replays have failed after weight "
                        "updates; generations may use stale weights). Fix: rollout.enforce_eager="
                        "true " + "!" * 12)
    if errors:
        raise ValueError("Ascend configuration:\n  " + "\n  ".join(errors))
    return warnings
