"""The Ascend layer on CPU: kernel patches (reference path and a stand-in torch_npu), the
environment, and the start-up checks. No NPU is used: the stand-in implements torch_npu's
documented signatures and layout rules in plain torch, written independently of npu_ops."""

import copy
import sys

import pytest
import torch

import npu_ops
import tiny_task


class StandInTorchNpu:
    """torch_npu's documented contracts, checked on every call, computed in plain torch."""

    def __init__(self):
        self.calls = {"npu_rms_norm": 0, "npu_rotary_mul": 0, "npu_swiglu": 0}

    def npu_rms_norm(self, x, gamma, epsilon=1e-6):
        # returns (y, rstd); gamma has x's dtype and matches x's trailing dim
        assert gamma.dtype == x.dtype and gamma.shape == x.shape[-1:], (gamma.shape, x.shape)
        self.calls["npu_rms_norm"] += 1
        rstd = (x.float().square().mean(-1, keepdim=True) + epsilon).rsqrt()
        return gamma * (x.float() * rstd).to(x.dtype), rstd

    def npu_rotary_mul(self, x, r1, r2):
        # "half" mode, 4-D; for x in BNSD, r1/r2 are 11SD, B1SD or BNSD; even head dim
        assert x.dim() == 4 and r1.shape == r2.shape and x.shape[-1] % 2 == 0
        B, N, S, D = x.shape
        assert r1.shape in ((1, 1, S, D), (B, 1, S, D), (B, N, S, D)), (x.shape, r1.shape)
        self.calls["npu_rotary_mul"] += 1
        x1, x2 = x.chunk(2, dim=-1)
        return r1 * x + r2 * torch.cat((-x2, x1), dim=-1)

    def npu_swiglu(self, x, dim=-1):
        # swish of the first half times the second half along `dim`
        assert x.shape[dim] % 2 == 0 and x.is_contiguous()
        self.calls["npu_swiglu"] += 1
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
    npu_ops.KERNELS = None


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
    npu_ops.KERNELS = standin
    report = npu_ops.patch_qwen(patched, path)
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
    npu_ops.KERNELS = StandInTorchNpu()
    npu_ops.patch_qwen(model, "fused")
    assert torch.allclose(model(input_ids=ids).logits, want, atol=3e-2)


def test_kernel_choice(monkeypatch):
    assert npu_ops.kernel_path("auto") is None  # CPU: leave the model as transformers builds it
    assert npu_ops.kernel_path("off") is None
    assert npu_ops.kernel_path("reference") == "reference"
    with pytest.raises(ValueError, match="model.fused_kernels=fused needs torch_npu"):
        npu_ops.kernel_path("fused")
    with pytest.raises(ValueError, match="model.fused_kernels='fast'"):
        npu_ops.kernel_path("fast")
    assert npu_ops.attention_implementation("auto") == "sdpa"
    monkeypatch.setattr(npu_ops, "device_type", lambda: "npu")
    assert npu_ops.kernel_path("auto") == "fused"
    assert npu_ops.attention_implementation("auto") == "flash_attention_2"
    assert npu_ops.attention_implementation("eager") == "eager"
    assert npu_ops.dist_backend() == "cpu:gloo,npu:hccl"


def test_patch_refuses_other_architectures():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match="dense Qwen2/Qwen3, not LlamaForCausalLM"):
        npu_ops.patch_qwen(model, "reference")


def test_ascend_env_defaults_and_user_override(monkeypatch):
    eager = npu_ops.ascend_env_defaults(graph_mode=False, sleep_mode=True)
    assert eager == {"TASK_QUEUE_ENABLE": "2", "HCCL_OP_EXPANSION_MODE": "AIV",
                     "VLLM_ASCEND_ENABLE_NZ": "0", "CPU_AFFINITY_CONF": "1",
                     "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:False"}
    graph = npu_ops.ascend_env_defaults(graph_mode=True, sleep_mode=False)
    assert graph["TASK_QUEUE_ENABLE"] == "1" and "PYTORCH_NPU_ALLOC_CONF" not in graph

    monkeypatch.setattr(npu_ops, "npu_installed", lambda: True)
    for name in eager:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HCCL_OP_EXPANSION_MODE", "AI_CPU")  # the user's value wins
    report = npu_ops.setup_env(graph_mode=False, sleep_mode=True)
    import os

    assert os.environ["HCCL_OP_EXPANSION_MODE"] == "AI_CPU"
    assert report["HCCL_OP_EXPANSION_MODE"] == ("AI_CPU", "user")
    assert os.environ["TASK_QUEUE_ENABLE"] == "2" and report["TASK_QUEUE_ENABLE"] == ("2", "default")
    assert set(report) == set(eager)


DOCUMENTED = {"vllm": "0.23.0", "vllm-ascend": "0.23.0.post1", "torch-npu": "2.10.0.post4"}


@pytest.mark.parametrize("kwargs, message", [
    (dict(graph_mode=True, env={"TASK_QUEUE_ENABLE": "2"}), "TASK_QUEUE_ENABLE=2 with rollout"),
    (dict(sleep_level=2), "rollout.sleep_level=2 on vLLM-Ascend"),
    (dict(env={"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"}), "expandable_segments:True"),
    (dict(versions={**DOCUMENTED, "vllm": "0.24.0"}), "vllm 0.24.0 with vllm-ascend 0.23.0.post1"),
])
def test_ascend_checks_fail_fast(kwargs, message):
    args = {"graph_mode": False, "sleep_level": 1, "env": {}, "versions": DOCUMENTED, **kwargs}
    with pytest.raises(ValueError, match=message):
        npu_ops.check_ascend(**args)


def test_ascend_checks_pass_and_warn():
    assert npu_ops.check_ascend(True, 1, {"TASK_QUEUE_ENABLE": "1"}, DOCUMENTED) == []
    warnings = npu_ops.check_ascend(False, 1, {}, {**DOCUMENTED, "torch-npu": "2.9.0"})
    assert len(warnings) == 1 and "outside the documented matrix" in warnings[0]


def test_setup_env_cpu_sets_one_thread(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    report = npu_ops.setup_env()
    assert report == {"OMP_NUM_THREADS": ("1", "default")} and torch.get_num_threads() == 1
    assert "torch_npu" not in sys.modules  # nothing imported the NPU runtime on the way
