"""Packed micro-batches and chunked logprobs compute what padded, unchunked ones do.

Samples of very different lengths (2 to 60 tokens) on tiny Qwen2 and Qwen3 models in fp32:
- the update's loss and every gradient, packed (one row, position ids restarting, attention kept
  within each sample by fsdp_utils.packed_sdpa) against padded batches: 1e-5 relative;
- logprobs, entropy and their gradients computed 5 rows of the output layer at a time against
  all rows at once, and against transformers' own logits (an independent path); each chunk's
  logits computed once, in the forward;
- the packed planner respects the token budget.
"""

import copy
import sys

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import fsdp_utils
import grpo
import logprobs
import reference
from tasks import tiny_task
import trainer
from records import Sample


@pytest.fixture(scope="module")
def world_of_one(tmp_path_factory):
    path = tmp_path_factory.mktemp("pg") / "store"
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def model_for(arch, **kwargs):
    base = tiny_task.build_tiny_model(15, 1, 0, seed=3, arch=arch)
    attn = fsdp_utils.register_attention("sdpa")
    model = AutoModelForCausalLM.from_config(base.config, attn_implementation=attn, **kwargs)
    model.load_state_dict(base.state_dict())
    with torch.no_grad():  # non-trivial norms, so that a wrong position or mask would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def varied_samples(seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for prompt_len, response_len in ((1, 1), (3, 57), (20, 2), (5, 30), (40, 20), (2, 9)):
        p = torch.randint(2, 15, (prompt_len,), generator=g).tolist()
        r = torch.randint(2, 15, (response_len,), generator=g).tolist()
        out.append(Sample(p, r, (-torch.rand(response_len, generator=g)).tolist(), False))
    return out


def update(model, samples, adv, **cfg):
    """One accumulate_gradients pass; returns the per-sample logps and the gradients."""
    model.zero_grad()
    g = grpo.GRPOConfig(is_correction="tis", **cfg)
    logps, stats = trainer.accumulate_gradients(model, reference.batch_of(samples, adv),
                                                reference.settings(g, 0.7))
    return logps, stats, {n: p.grad.clone() for n, p in model.named_parameters()
                          if p.grad is not None}


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_packed_equals_padded(arch, world_of_one):
    model, samples = model_for(arch), varied_samples()
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5, 0.3, 0.8])
    budget = 4096  # all in one micro-batch either way: a packed row of 189 tokens
    lp_pad, st_pad, g_pad = update(model, samples, adv, pack=False, micro_batch_tokens=budget)
    lp_pack, st_pack, g_pack = update(model, samples, adv, pack=True, micro_batch_tokens=budget)
    for a, b in zip(lp_pack, lp_pad):
        assert a.shape == b.shape and rel(a, b) < 1e-5
    assert abs(st_pack["entropy"] - st_pad["entropy"]) < 1e-5 * st_pad["entropy"]
    for name, grad in g_pad.items():
        assert grad.abs().max() > 0, name  # every weight takes part
        assert rel(g_pack[name], grad) < 1e-5, (name, rel(g_pack[name], grad))
    # several packed micro-batches (a budget of 64 tokens) accumulate to the same gradient
    _, _, g_small = update(model, samples, adv, pack=True, micro_batch_tokens=64)
    for name, grad in g_pad.items():
        assert rel(g_small[name], grad) < 1e-5, name


def hf_twin(model):
    """The same weights under transformers' own sdpa attention (an independent path)."""
    twin = AutoModelForCausalLM.from_config(copy.deepcopy(model.config),
                                            attn_implementation="sdpa")
    twin.load_state_dict(model.state_dict())
    return twin


@pytest.mark.parametrize("packed", [True, False])
def test_chunked_logprobs_equal_unchunked_and_transformers(packed, monkeypatch):
    model, samples = model_for("qwen3"), varied_samples(1)
    weights = torch.randn(len(samples), 60)  # an arbitrary loss, to compare gradients
    passes = []  # chunks whose logits were computed, and in which phase
    real_logits = logprobs._logits
    monkeypatch.setattr(logprobs, "_logits",
                        lambda *a: passes.append(phase[0]) or real_logits(*a))
    mb = logprobs.micro_batch(samples, 0, packed, model.config)
    ids, attn, targets, mask, _ = reference.pad_batch(samples, 0)
    w = weights[:, :mask.shape[1]][mask.bool()]  # (K,) the response tokens, sample after sample
    K = sum(len(s.response_ids) for s in samples)  # rows through the output layer

    def run(chunk):
        model.zero_grad()
        passes.clear()
        phase[0] = "forward"
        out = logprobs.run(model, mb, logprobs.Passes(0.7, chunk=chunk), reference.weighted(w))
        phase[0] = "backward"
        out["loss"].backward()
        # the logits: once per chunk of the forward, never again in backward
        assert passes == ["forward"] * -(-K // chunk), (passes, K, chunk)
        return (mb.padded(out["logp"]), out["entropy"].item(),
                {n: p.grad.clone() for n, p in model.named_parameters()})

    phase = [""]
    chunked, ent_chunked, g_chunked = run(5)
    whole, ent_whole, g_whole = run(10**9)
    with torch.no_grad():  # the old and reference passes: logprobs only
        assert rel(logprobs.run(model, mb, logprobs.Passes(0.7, chunk=5))["logp"], mb.flat(chunked)) == 0
    # transformers' logits (padded batch, sdpa), then the logprob of each target
    twin = hf_twin(model)
    logits = twin(input_ids=ids, attention_mask=attn).logits[:, :-1]
    ref = reference.token_logprobs(logits, targets, 0.7)
    (ref * mask * weights[:, :ref.shape[1]]).sum().backward()
    ent_ref = reference.masked_entropy_sum(logits.detach() / 0.7, mask)  # the sampling distribution
    m = mask.bool()
    for got in (chunked, whole):
        assert rel(got[mb.mask.bool()], ref[m].detach()) < 1e-5
    assert abs(ent_chunked - ent_ref) < 1e-5 * ent_ref and abs(ent_whole - ent_ref) < 1e-5 * ent_ref
    for name, p in twin.named_parameters():
        assert rel(g_chunked[name], p.grad) < 1e-5 and rel(g_whole[name], p.grad) < 1e-5, name


def test_packed_plan_respects_the_budget():
    lengths = [60, 3, 17, 17, 40, 1, 22, 9, 70]
    plan = logprobs.plan_micro_batches(lengths, 64, packed=True)
    assert sorted(i for b in plan for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 64 or len(b) == 1 for b in plan)  # 70 alone
    padded = logprobs.plan_micro_batches(lengths, 64, packed=False)
    assert len(plan) < len(padded)  # packing needs fewer forwards for the same budget


def test_a_packed_row_holds_no_more_samples_than_the_fused_attention_takes():
    """npu_fusion_attention's actual_seq_qlen holds at most 1K entries in the varlen (TND)
    layout (op-plugin's doc of it): under that attention a packed row holds at most
    npu_ops.FUSION_MAX_SAMPLES samples, each sample in exactly one row; under sdpa, which has
    no such limit, the rows are what the token budget alone gives."""
    import types

    import npu_ops

    lengths = [3 + i % 5 for i in range(2500)]  # short samples: the budget alone fits 2000+
    fused = types.SimpleNamespace(
        _attn_implementation=fsdp_utils.register_attention(npu_ops.FUSION_ATTENTION))
    cap = logprobs.packed_sample_cap(fused)
    assert cap == npu_ops.FUSION_MAX_SAMPLES == 1024
    plan = logprobs.plan_micro_batches(lengths, 16384, packed=True, max_samples=cap)
    assert sorted(i for b in plan for i in b) == list(range(len(lengths)))
    assert [len(b) for b in plan] == [1024, 1024, 452]
    assert all(sum(lengths[i] for i in b) <= 16384 for b in plan)
    plain = types.SimpleNamespace(_attn_implementation=fsdp_utils.register_attention("sdpa"))
    assert logprobs.packed_sample_cap(plain) == 0
    assert len(logprobs.plan_micro_batches(lengths, 16384, packed=True)) == 1


@pytest.mark.usefixtures("world_of_one")
def test_a_hybrid_s_rows_bound_the_padding_its_linear_layers_pay():
    """A skewed mix (one 2,200-token sample, twenty of 100 and 150): first fit fills the long
    sample's row with short ones, and a hybrid's Gated DeltaNet layers, which pad each sample to
    its row's longest, would run 14 x 2,200 positions for a 4,096-token row. For a model with
    such layers (config.layer_types) micro_batch_plan keeps every row's samples x longest within
    LINEAR_PADDING x the budget; every sample is planned once, in as few rows as that allows
    (the short ones fill one more row); a dense model's plan is first fit's alone."""
    import types

    from records import Sample

    lengths = [2200] + [100, 150] * 10
    samples = [Sample([1] * (n - 1), [2], [0.0], False) for n in lengths]
    budget = 4096
    dense = types.SimpleNamespace(layer_types=["full_attention"] * 2)
    hybrid = types.SimpleNamespace(layer_types=["linear_attention", "full_attention"])
    plain = logprobs.micro_batch_plan(samples, budget, True, dense)
    # first fit: the long sample's row takes all ten of 150 and three of 100: 14 x 2,200 padded
    assert max(len(b) * max(lengths[i] for i in b) for b in plain) == 14 * 2200
    plan = logprobs.micro_batch_plan(samples, budget, True, hybrid)
    assert sorted(i for b in plan for i in b) == list(range(len(lengths)))
    bound = logprobs.LINEAR_PADDING * budget
    assert all(len(b) * max(lengths[i] for i in b) <= bound for b in plan), plan
    assert all(sum(lengths[i] for i in b) <= budget for b in plan)
    assert [len(b) for b in plan] == [3, 18]  # long + two 150s; the rest: 18 x 150 <= 8192


def test_ulysses_rows_respect_the_fused_kernels_cap_padding_included():
    """Under sequence parallelism the attention is seq_parallel.attention around the fused one:
    its rows reach the same kernel (op-plugin's TND limit, npu_ops.FUSION_MAX_SAMPLES), and
    split_row may add a padding sample to a row whose length is not a multiple of sp. The plan
    leaves room for it: 1023 samples a row, 1024 with the padding, never more; around packed
    sdpa there is no limit."""
    import types

    from modeling import seq_parallel
    import npu_ops

    split = seq_parallel.Split(group=None, rank=0, size=2)
    fused = types.SimpleNamespace(
        _attn_implementation=fsdp_utils.register_attention(npu_ops.FUSION_ATTENTION, split))
    assert fused._attn_implementation == f"ulysses_{npu_ops.FUSION_ATTENTION}"
    assert logprobs.packed_sample_cap(fused, split) == npu_ops.FUSION_MAX_SAMPLES - 1 == 1023
    plain = types.SimpleNamespace(_attn_implementation=fsdp_utils.register_attention("sdpa",
                                                                                      split))
    assert logprobs.packed_sample_cap(plain, split) == 0
    # 2100 samples of 3 tokens: a row of 1023 is 3069 tokens, odd, and gets a padding sample
    samples = [Sample([3], [4, 5], [-1.0, -1.0], False) for _ in range(2100)]
    plan = logprobs.plan_micro_batches([3] * len(samples), 10**6, packed=True,
                                       max_samples=logprobs.packed_sample_cap(fused, split))
    assert [len(b) for b in plan] == [1023, 1023, 54]
    mb = logprobs.micro_batch([samples[i] for i in plan[0]], 0, True, None, split)
    assert len(mb.inputs["row"]["packed_ends"]) == npu_ops.FUSION_MAX_SAMPLES  # + the padding


def counted_flops(model, samples, adv) -> int:
    """The matrix FLOPs of one accumulate_gradients pass, as torch's FLOP counter sees the ops
    run (it has no rule for the in-place addmm_ of the output layer's weight gradient: 2mnk)."""
    from torch.utils.flop_counter import FlopCounterMode

    inplace = {torch.ops.aten.addmm_: lambda s, a, b, out_shape=None, **kw: 2 * a[0] * a[1] * b[1]}
    with FlopCounterMode(display=False, custom_mapping=inplace) as counter:
        update(model, samples, adv)
    # the linear layers' products; attention's (bmm where sdpa takes its math path: torch 2.10
    # on CPU) are left out of flops_per_token by design
    return sum(n for op, n in counter.get_flop_counts()["Global"].items()
               if str(op) in ("aten.mm", "aten.addmm", "aten.addmm_"))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_flops_per_token_counts_the_updates_matrix_products(arch, world_of_one):
    """`mfu` rests on fsdp_utils.flops_per_token: it must equal the FLOPs that torch's counter
    sees the trainer's own update run, prompts through the body and only response rows through
    the output layer; with the output layer frozen (tied to the embedding here), its weight
    gradient is skipped and it costs 4 FLOPs per element and row, not 6."""
    model, samples = model_for(arch), varied_samples()
    adv = torch.randn(len(samples), generator=torch.Generator().manual_seed(0))
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    rows = sum(len(s.response_ids) for s in samples)
    body, head = fsdp_utils.flops_per_token(model)
    H, V = model.config.hidden_size, model.config.vocab_size
    assert head == 6 * H * V and body > 0
    assert counted_flops(model, samples, adv) == body * tokens + head * rows
    model.get_output_embeddings().weight.requires_grad_(False)
    assert fsdp_utils.flops_per_token(model) == (body, 4 * H * V)
    assert counted_flops(model, samples, adv) == body * tokens + 4 * H * V * rows


@pytest.mark.parametrize("arch,graphs", [("qwen2", 3), ("qwen3", 4)])
def test_compiled_kernels_match_transformers_and_compile_once(arch, graphs, world_of_one):
    """model.fused_kernels=compiled: the trainer's update through the compiled RMSNorm, SwiGLU
    and rotary functions gives transformers' gradients (fp32; inductor may reorder a norm's
    sum of squares: a few ulps a layer), and micro-batches of different token counts reuse one
    graph per function and input rank (qwen3's per-head norms take 4-d input: 4 graphs, not 3).
    Compiled for fixed shapes, each new row length would compile again, on a GPU at every
    micro-batch of a run's first steps."""
    from modeling import kernels
    from torch._dynamo.utils import counters

    model, samples = model_for(arch), varied_samples()
    adv = torch.randn(len(samples), generator=torch.Generator().manual_seed(0))
    compiled = copy.deepcopy(model)
    _, _, want = update(model, samples, adv, micro_batch_tokens=64)
    kernels.COMPILED.clear()
    torch._dynamo.reset()
    counters.clear()
    saved = {m: m.apply_rotary_pos_emb for m in map(sys.modules.get, (
        "transformers.models.qwen2.modeling_qwen2", "transformers.models.qwen3.modeling_qwen3"))
        if m is not None}
    try:
        kernels.patch_qwen(compiled, "compiled")
        plan = logprobs.plan_micro_batches([len(s.prompt_ids) + len(s.response_ids)
                                            for s in samples], 64, packed=True)
        assert len({sum(len(samples[i].prompt_ids) + len(samples[i].response_ids) for i in b)
                    for b in plan}) >= 3  # rows of at least three lengths
        _, _, got = update(compiled, samples, adv, micro_batch_tokens=64)
    finally:
        for module, fn in saved.items():
            module.apply_rotary_pos_emb = fn
    assert counters["stats"]["unique_graphs"] == graphs
    for name, g in want.items():
        assert rel(got[name], g) < 1e-5, name
