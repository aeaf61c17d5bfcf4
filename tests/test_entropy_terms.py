"""The entropy's two uses in the loss: grpo.entropy_coef's bonus (its gradient computed with the
logprobs' in the fused pass, dense over the vocabulary) against autograd on transformers' own
logits, at top_p 1 and under a nucleus; and grpo.top_entropy_quantile's forking tokens
(Wang et al. 2025, arXiv 2506.01939): each token's entropy from the pass without gradient, the
threshold as torch.quantile and the mask as TRL 1.16's get_high_entropy_mask make them, and the
update selecting them under the policy before its first step.

Tolerances: fp64 throughout, the same arithmetic in other orders (sums over a vocabulary of
15 and a few hundred tokens): 1e-10 relative leaves orders of magnitude."""

import pytest
import torch

import batcher
import grpo
import logprobs
import reference
import trainer
from test_packing import model_for, varied_samples, world_of_one  # noqa: F401
from test_top_p import naive


def sharp_model():
    torch.manual_seed(0)
    model = model_for("qwen2").double()
    with torch.no_grad():  # sharper than a random init: a nucleus of a few tokens
        model.model.norm.weight.mul_(6.0)
    return model


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_entropy_bonus_is_autograd_of_the_entropy(top_p):
    """loss = sum w logp - sum b H: the fused pass's value and every gradient against autograd
    through the plain statement, chunked and not; without the bonus the gradients differ."""
    model, samples = sharp_model(), varied_samples(1)
    K = sum(len(s.response_ids) for s in samples)
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(K, generator=gen, dtype=torch.float64)
    b = torch.rand(K, generator=gen, dtype=torch.float64)
    lp_ref, h_ref, g_ref, _ = naive(model, samples, w, 0.7, top_p, bonus=b)
    want = (lp_ref * w).sum() - (h_ref * b).sum()
    mb = logprobs.micro_batch(samples, 0, True, model.config)
    for chunk in (5, 10**9):
        model.zero_grad()
        out = logprobs.run(model, mb, logprobs.Passes(0.7, top_p, chunk), reference.weighted(w, b))
        out["loss"].backward()
        assert abs(out["loss"] - want) < 1e-10 * (lp_ref * w).abs().sum()
        assert abs(out["entropy"] - h_ref.sum()) < 1e-10 * h_ref.sum()
        for name, p in model.named_parameters():
            top = g_ref[name].abs().max()
            assert top > 0 and (p.grad - g_ref[name]).abs().max() < 1e-10 * top, name
    without = naive(model, samples, w, 0.7, top_p)[2]
    assert max((without[n] - g_ref[n]).abs().max() / g_ref[n].abs().max()
               for n in g_ref) > 1e-3  # the bonus moved the gradient


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_the_pass_without_gradient_gives_each_tokens_entropy(top_p):
    model, samples = sharp_model(), varied_samples(1)
    K = sum(len(s.response_ids) for s in samples)
    _, h_ref, _, _ = naive(model, samples, torch.zeros(K, dtype=torch.float64), 0.7, top_p)
    mb = logprobs.micro_batch(samples, 0, True, model.config)
    with torch.no_grad():
        got = logprobs.run(model, mb, logprobs.Passes(0.7, top_p, 5), entropy=True)["entropy"]
    assert (got - h_ref).abs().max() < 1e-10 * h_ref.abs().max()
    assert h_ref.std() > 0.5 * h_ref.mean()  # tokens of different entropies


@pytest.mark.parametrize("n", [1, 2, 7, 1000])
def test_quantile_is_torch_quantile(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
    for q in (0.0, 0.2, 0.5, 0.8, 0.999, 1.0):
        assert abs(batcher.quantile(x, q) - torch.quantile(x, q).item()) < 1e-12


def trl_high_entropy_mask(entropies, mask, threshold):
    """TRL 1.16's get_high_entropy_mask (trl/trainer/grpo_trainer.py) at one process, on
    padded (B, T) entropies and mask: its quantile, then entropy >= it, on the mask."""
    local = entropies[mask.bool()].float()
    if local.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    entropy_threshold = torch.quantile(local, threshold)
    return (entropies * mask.float() >= entropy_threshold) & mask.bool()


@pytest.mark.parametrize("rho", [0.0, 0.2, 0.5, 1.0])
def test_forking_tokens_are_trls_high_entropy_mask(rho, world_of_one):
    """Each sample's response tokens, an environment's among them (mask 0: never kept), the
    entropies fp32 as the pass returns them: the mask TRL computes with 1 - rho."""
    samples = varied_samples(3)
    samples[3].mask = [1] * 10 + [0] * 5 + [1] * 15
    gen = torch.Generator().manual_seed(1)
    ent = [torch.rand(len(s.response_ids), generator=gen) * 3 for s in samples]
    keep, threshold = batcher.forking_tokens(samples, ent, rho, None)
    T = max(len(s.response_ids) for s in samples)
    pad = torch.zeros(len(samples), T)
    mask = torch.zeros(len(samples), T)
    for i, (s, e) in enumerate(zip(samples, ent)):
        pad[i, :len(e)] = e
        mask[i, :len(e)] = torch.tensor(s.mask or [1] * len(e), dtype=torch.float32)
    theirs = trl_high_entropy_mask(pad, mask, 1 - rho)
    ours = torch.zeros(len(samples), T)
    for i, k in enumerate(keep):
        ours[i, :len(k)] = k
    assert ours.bool().equal(theirs)
    n = int(mask.sum())
    assert int(ours.sum()) == {0.0: 1, 1.0: n}.get(rho, int(ours.sum()))
    if 0 < rho < 1:  # about rho of the model's tokens
        assert abs(ours.sum() / n - rho) <= 1 / n + 1e-9


def test_the_update_keeps_the_gradient_of_the_forking_tokens_only(world_of_one, monkeypatch):
    """The update with top_entropy_quantile 0.3, on-policy: the tokens it trains are those
    whose entropy under the policy before the step (transformers' logits) is at least the 0.7
    quantile of every written token's; the forking_frac metric says 0.3 of them. Off-policy (2
    mini-batches) the same selection rides on the old policy's pass: one pass, not two."""
    samples = varied_samples(4)
    samples[1].mask = [1] * 20 + [0] * 7 + [1] * 30
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5, 0.3, 0.8])
    seen, passes = {}, []
    real_acc, real_pass = trainer.accumulate_gradients, logprobs.sample_pass
    monkeypatch.setattr(trainer, "accumulate_gradients", lambda actor, batch, *a, **k: seen.update(
        {id(s): f for s, f in zip(batch.samples, batch.forking)}) or real_acc(actor, batch, *a,
                                                                                **k))
    monkeypatch.setattr(logprobs, "sample_pass",
                        lambda *a, **k: passes.append(k) or real_pass(*a, **k))
    for minis in (1, 2):
        torch.manual_seed(0)  # model_for perturbs the norms with the global generator
        model = model_for("qwen2").double()
        K = sum(len(s.response_ids) for s in samples)
        h = naive(model, samples, torch.zeros(K, dtype=torch.float64), 0.7, 1.0)[1]
        written = torch.cat([torch.tensor(s.mask or [1] * len(s.response_ids), dtype=torch.bool)
                             for s in samples])
        want = (h >= torch.quantile(h[written], 0.7)) & written
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        cfg = grpo.GRPOConfig(top_entropy_quantile=0.3, mini_batches=minis, logprob_chunk=5)
        seen.clear()
        passes[:] = []
        m = reference.update(model, None, opt, reference.batch_of(samples, adv),
                             reference.settings(cfg, 0.7))
        assert len(passes) == 1 and passes[0]["entropy"]  # the old policy's, if any, with it
        assert torch.cat([seen[id(s)] for s in samples]).bool().equal(want)
        frac = m["forking_frac"]
        assert abs(frac.total / frac.count - want.sum().item() / written.sum().item()) < 1e-12
