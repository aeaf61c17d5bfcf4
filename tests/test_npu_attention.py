"""Attention for packed rows on the Ascend fused kernel, on CPU: the plain-torch reference of the
kernel's contract against torch's SDPA, the model's packed forward through npu_ops'
fusion_attention (with a stand-in kernel that checks the documented arguments) against
transformers' own sdpa on each sample alone, and a count of host reads during that forward.

Tolerances: fp32 throughout. The paths differ only in the order of their sums (a softmax over at
most 60 keys, dot products over a head dim of 32, then the model's layers), each sum of n terms
off by at most about n * 2^-24 relative: 1e-5 relative bounds it for these sizes."""

import copy

import pytest
import torch
from torch.overrides import TorchFunctionMode
from transformers import AutoModelForCausalLM

import fsdp_utils
import logprobs
import npu_ops
import reference
from tasks import tiny_task
from records import Sample


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


class StandInFusionAttention:
    """npu_fusion_attention's documented arguments (op-plugin docs), checked on every call, the
    numbers from reference.fusion_attention_reference."""

    def __init__(self):
        self.masks, self.layouts = [], []

    def npu_fusion_attention(self, query, key, value, head_num, input_layout, *, atten_mask=None,
                             scale=1.0, keep_prob=1.0, sparse_mode=0, actual_seq_qlen=None,
                             actual_seq_kvlen=None):
        assert head_num == query.shape[-2 if input_layout == "TND" else 1]
        if input_layout == "TND":  # varlen: cumulative host ints, at most 1024 samples
            ends = actual_seq_qlen
            assert all(type(e) is int for e in ends) and list(ends) == list(actual_seq_kvlen)
            assert list(ends) == sorted(ends) and ends[-1] == query.shape[0] and len(ends) <= 1024
        if sparse_mode in (2, 3):  # the compressed causal mask, whatever the lengths
            assert atten_mask.dtype == torch.bool and atten_mask.shape == (2048, 2048)
            assert torch.equal(atten_mask, torch.ones(2048, 2048, dtype=torch.bool).triu(1))
        self.masks.append(atten_mask)
        self.layouts.append(input_layout)
        return reference.fusion_attention_reference(
            query, key, value, head_num, input_layout, atten_mask=atten_mask, scale=scale,
            keep_prob=keep_prob, sparse_mode=sparse_mode, actual_seq_qlen=actual_seq_qlen,
            actual_seq_kvlen=actual_seq_kvlen)


@pytest.fixture
def standin():
    npu_ops.STAND_IN = StandInFusionAttention()
    yield npu_ops.STAND_IN
    npu_ops.STAND_IN = None


def test_reference_equals_sdpa_on_a_packed_row():
    """reference.fusion_attention_reference in TND (samples end to end, grouped-query heads) equals
    torch's SDPA run causally on each sample alone."""
    g = torch.Generator().manual_seed(0)
    lengths, heads, kv_heads, dim = [1, 7, 33, 4, 60], 4, 2, 32
    T = sum(lengths)
    q, k, v = (torch.randn(T, n, dim, generator=g) for n in (heads, kv_heads, kv_heads))
    ends = torch.tensor(lengths).cumsum(0).tolist()
    mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    got = reference.fusion_attention_reference(q, k, v, heads, "TND", atten_mask=mask, scale=0.2,
                                             sparse_mode=3, actual_seq_qlen=ends,
                                             actual_seq_kvlen=ends)[0]
    start = 0
    for end in ends:
        qs, ks, vs = (x[start:end].transpose(0, 1)[None] for x in (q, k, v))
        want = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=0.2, enable_gqa=True)[0].transpose(0, 1)
        assert rel(got[start:end], want) < 1e-5, (start, end)
        start = end


def varied_samples():
    g = torch.Generator().manual_seed(1)
    out = []
    for prompt_len, response_len in ((1, 1), (3, 57), (20, 2), (5, 30), (2, 9)):
        p = torch.randint(2, 15, (prompt_len,), generator=g).tolist()
        r = torch.randint(2, 15, (response_len,), generator=g).tolist()
        out.append(Sample(p, r, [0.0] * response_len, False))
    return out


def models():
    """The same random qwen3 weights (norms made non-trivial) under npu_ops' fused attention and
    under transformers' own sdpa."""
    base = tiny_task.build_tiny_model(15, 1, 0, seed=3, arch="qwen3")
    with torch.no_grad():
        for name, p in base.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    attn = fsdp_utils.register_attention(npu_ops.attention_implementation("npu_fusion"))
    fused = AutoModelForCausalLM.from_config(copy.deepcopy(base.config), attn_implementation=attn)
    twin = AutoModelForCausalLM.from_config(copy.deepcopy(base.config), attn_implementation="sdpa")
    for m in (fused, twin):
        m.load_state_dict(base.state_dict())
    return fused, twin


def test_packed_forward_on_the_fused_attention_equals_transformers_sdpa(standin):
    fused, twin = models()
    samples = varied_samples()
    mb = logprobs.micro_batch(samples, 0, True, fused.config)
    logits = fused(**mb.inputs).logits[0]  # (R, V), one packed row
    (logits.square().mean()).backward()
    start = 0
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        want = twin(input_ids=ids).logits[0]
        n = ids.shape[1]
        assert rel(logits[start:start + n], want) < 1e-5
        start += n
    assert standin.layouts == ["TND"] * fused.config.num_hidden_layers
    assert all(m is standin.masks[0] for m in standin.masks)  # the causal mask built once
    # a padded batch (no packing) runs in BNSD, causally, and equals transformers too
    ids = torch.randint(2, 15, (3, 11))
    assert rel(fused(input_ids=ids).logits, twin(input_ids=ids).logits) < 1e-5
    assert standin.layouts[-1] == "BNSD"


class HostReads(TorchFunctionMode):
    """Counts the tensor functions that hand a tensor's values to the host: `.cpu()`, `.numpy()`,
    `.tolist()`, `.item()`, `int(t)` and the like, and the operators that size their output from
    the data. On an accelerator each one is a sync that stalls the launch queue; on CPU they cost
    nothing, so they are counted where Python calls them."""

    READS = {"cpu", "numpy", "tolist", "item", "__int__", "__float__", "__bool__", "__index__",
             "nonzero", "masked_select", "unique"}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in self.READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_a_packed_forward_reads_nothing_back_from_the_device(standin):
    """The whole packed forward through fusion_attention (prepared masks, host boundaries)
    reads no value back; the packed_sdpa path without host boundaries does (two reads a layer),
    which shows that the count sees them."""
    fused, _ = models()
    mb = logprobs.micro_batch(varied_samples(), 0, True, fused.config)
    with torch.no_grad(), HostReads() as mode:
        fused(**mb.inputs)
    assert mode.reads == []
    attn = fsdp_utils.register_attention("sdpa")
    sdpa = AutoModelForCausalLM.from_config(copy.deepcopy(fused.config), attn_implementation=attn)
    inputs = {k: v for k, v in mb.inputs.items() if not k.startswith(("cu_", "max_"))}
    with torch.no_grad(), HostReads() as mode:
        sdpa(**inputs)
    assert mode.reads == ["__int__", "__int__"] * fused.config.num_hidden_layers


def test_fused_attention_needs_the_kernels():
    with pytest.raises(ValueError, match="model.attn_implementation=npu_fusion needs torch_npu"):
        npu_ops.attention_implementation("npu_fusion")
