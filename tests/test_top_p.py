"""At rollout.top_p < 1 the trainer's logprob of a token is over the nucleus the engine sampled
from, renormalised (logprobs._outside_nucleus): the set vLLM 0.32's sampler keeps, exactly, and
the fused pass's logprobs, entropy and gradients those of the plain statement (full logits ->
that set -> log softmax over it, differentiated by autograd), chunked and unchunked, in fp64.
A target outside the trainer's set (its logits a rounding away from the engine's) joins it.
"""

import pytest
import torch

import logprobs
import reference
from test_packing import hf_twin, model_for, varied_samples


def nucleus_kept(z, top_p):
    """(c, V) logits / T -> (c, V) bool, the tokens vLLM keeps: the plain statement of
    apply_top_k_top_p_pytorch's top-p branch (vLLM 0.32 v1/sample/ops/topk_topp_sampler.py),
    in z's dtype, p an fp32 tensor as vLLM's sampling metadata holds it."""
    zs, idx = z.sort(dim=-1, descending=False)
    probs_sum = zs.softmax(dim=-1).cumsum(dim=-1)
    drop = probs_sum <= 1 - torch.full((z.shape[0], 1), top_p, dtype=torch.float32)
    drop[:, -1] = False
    return ~torch.zeros_like(drop).scatter(1, idx, drop)


@pytest.mark.engine  # vLLM's own function: the lanes that have vLLM (0.32, and 0.23's)
def test_the_kept_set_is_vllms():
    """On fp32 rows with ties (bf16-rounded logits, as a bf16 output layer gives them) and
    without, peaked and flat, at several top_p: the tokens vLLM's own function keeps are the
    ones _outside_nucleus keeps, exactly, and our plain statement agrees."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    g = torch.Generator().manual_seed(0)
    for scale, bf16 in ((1.0, False), (4.0, False), (4.0, True), (0.1, True)):
        z = torch.randn(64, 1000, generator=g) * scale
        if bf16:
            z = z.bfloat16().float()
        for top_p in (0.1, 0.5, 0.9, 0.99):
            theirs = apply_top_k_top_p_pytorch(z.clone(), None, torch.full((64,), top_p))
            kept = theirs > -float("inf")
            target = theirs.argmax(1)  # one they kept (of tied maxima, not always the first)
            assert (~logprobs._outside_nucleus(z, top_p, target) == kept).all()
            assert (nucleus_kept(z, top_p) == kept).all()
            assert kept.sum() < kept.numel()  # something was dropped


def naive(model, samples, w, temperature, top_p, bonus=None):
    """The plain statement on transformers' own logits (padded batch, sdpa): each target's
    log softmax over vLLM's kept set and itself, the sum of w x logp (minus the sum of bonus x
    each row's entropy, where given) differentiated by autograd; the entropy of that
    distribution per row; and which targets were outside the set."""
    twin = hf_twin(model.float()).double()
    twin.load_state_dict(model.double().state_dict())  # fp64 all along
    ids, attn, targets, mask, _ = reference.pad_batch(samples, 0)
    z = twin(input_ids=ids, attention_mask=attn).logits[:, :-1] / temperature  # (n, T-1, V)
    m = mask.bool()
    rows, t = z[m], targets[m]  # (K, V), (K,)
    kept = nucleus_kept(rows.detach(), top_p)
    outside = ~kept.gather(1, t[:, None])[:, 0]
    kept = kept.scatter(1, t[:, None], True)
    logp_all = rows.masked_fill(~kept, -float("inf")).log_softmax(-1)
    logp = logp_all.gather(1, t[:, None])[:, 0]
    rows_h = -(logp_all.exp() * logp_all.masked_fill(~kept, 0)).sum(1)  # (K,)
    ((logp * w).sum() - (0 if bonus is None else (rows_h * bonus).sum())).backward()
    return logp.detach(), rows_h.detach(), {n: p.grad for n, p in twin.named_parameters()}, \
        outside


@pytest.mark.parametrize("top_p", [0.9, 0.6])
def test_fused_pass_is_the_nucleus_statement(top_p):
    """fp64: the same arithmetic up to the order of sums, 1e-10 relative."""
    torch.manual_seed(0)
    model = model_for("qwen2").double()
    with torch.no_grad():  # sharper than a random init: a nucleus of a few tokens
        model.model.norm.weight.mul_(6.0)
    samples = varied_samples(1)
    K = sum(len(s.response_ids) for s in samples)
    w = torch.randn(K, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    lp_ref, ent_ref, g_ref, outside = naive(model, samples, w, 0.7, top_p)
    assert outside.any() and not outside.all()  # the guard takes part
    mb = logprobs.micro_batch(samples, 0, True, model.config)
    for chunk in (5, 10**9):
        model.zero_grad()
        out = logprobs.run(model, mb, logprobs.Passes(0.7, top_p, chunk), reference.weighted(w))
        out["loss"].backward()
        assert (out["logp"] - lp_ref).abs().max() < 1e-10 * lp_ref.abs().max()
        assert abs(out["entropy"] - ent_ref.sum()) < 1e-10 * ent_ref.sum()
        for name, p in model.named_parameters():
            top = g_ref[name].abs().max()
            assert top > 0 and (p.grad - g_ref[name]).abs().max() < 1e-10 * top, name
        with torch.no_grad():  # the old-policy and reference passes: the same logprobs
            assert torch.equal(logprobs.run(model, mb, logprobs.Passes(0.7, top_p, chunk))["logp"],
                               out["logp"])
    # and it is not the full softmax's: what the nucleus changes is far above the tolerance
    full = logprobs.run(model, mb, logprobs.Passes(0.7, chunk=5))["logp"]
    assert (full - lp_ref).abs().max() > 1e-2


def test_top_p_one_is_the_full_softmax_unchanged():
    """top_p = 1 takes no selection at all: the result is bit for bit the full softmax's
    (the path without top_p), and no sort runs."""
    torch.manual_seed(0)
    model, samples = model_for("qwen3"), varied_samples(2)
    mb = logprobs.micro_batch(samples, 0, True, model.config)
    w = torch.randn(mb.targets.shape[0])
    sorts = []
    real = logprobs._outside_nucleus
    try:
        logprobs._outside_nucleus = lambda *a: sorts.append(1) or real(*a)
        found = []
        for kwargs in ({}, {"top_p": 1.0}):
            model.zero_grad()
            out = logprobs.run(model, mb, logprobs.Passes(0.7, chunk=5, **kwargs), reference.weighted(w))
            out["loss"].backward()
            found.append((out["logp"], out["entropy"],
                          [p.grad.clone() for p in model.parameters()]))
    finally:
        logprobs._outside_nucleus = real
    assert not sorts
    (a, ea, ga), (b, eb, gb) = found
    assert torch.equal(a, b) and torch.equal(ea, eb)
    assert all(torch.equal(x, y) for x, y in zip(ga, gb))


def test_top_k_of_the_nucleus_is_inside_it():
    """The no-grad pass's top k at top_p < 1 (a distribution's, as a teacher's would be) lists
    only kept tokens, with their renormalised logprobs; past the nucleus's size, -inf."""
    torch.manual_seed(0)
    model = model_for("qwen2").double()
    with torch.no_grad():
        model.model.norm.weight.mul_(6.0)
    samples = varied_samples(1)
    mb = logprobs.micro_batch(samples, 0, True, model.config)
    with torch.no_grad():
        out = logprobs.run(model, mb, logprobs.Passes(0.7, 0.6, 5), top_k=15)
    probs = out["top_logp"].exp()
    assert torch.allclose(probs.sum(1), torch.ones_like(probs[:, 0]), atol=1e-12)
    assert (out["top_logp"][:, -1] == -float("inf")).any()
