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
    """The update with top_entropy_quantile 0.3: the tokens it trains are those whose entropy
    under the policy taking the optimizer step (transformers' logits) is at least the 0.7
    quantile of the step's written tokens'; the forking_frac metric says 0.3 of them. On-policy
    (one step: every token) that rides on one pass before the update. Off-policy (2
    mini-batches) each step chooses over its own tokens: the first from that pass's entropies,
    the second from one more pass (the policy has moved; here lr 0, so the same entropies)."""
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
    lengths = [len(s.response_ids) for s in samples]
    written = [torch.tensor(s.mask or [1] * n, dtype=torch.bool) for s, n in zip(samples, lengths)]
    for minis in (1, 2):
        torch.manual_seed(0)  # model_for perturbs the norms with the global generator
        model = model_for("qwen2").double()
        h = naive(model, samples, torch.zeros(sum(lengths), dtype=torch.float64), 0.7, 1.0)[1]
        h = h.split(lengths)
        want = [None] * len(samples)
        for part in trainer.split_mini_batches(len(samples), minis,
                                               torch.Generator().manual_seed(0)):
            bar = torch.quantile(torch.cat([h[i][written[i]] for i in part]), 0.7)
            for i in part:
                want[i] = (h[i] >= bar) & written[i]
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        cfg = grpo.GRPOConfig(top_entropy_quantile=0.3, mini_batches=minis, logprob_chunk=5)
        seen.clear()
        passes[:] = []
        m = reference.update(model, None, opt, reference.batch_of(samples, adv),
                             reference.settings(cfg, 0.7))
        assert len(passes) == minis and all(k["entropy"] for k in passes)
        assert all(seen[id(s)].bool().equal(w) for s, w in zip(samples, want)), minis
        frac, kept = m["forking_frac"], sum(int(w.sum()) for w in want)
        assert abs(frac.total / frac.count - kept / sum(int(w.sum()) for w in written)) < 1e-12


def test_off_policy_each_step_chooses_under_the_policy_that_takes_it(world_of_one, monkeypatch):
    """Two epochs over one mini-batch with a learning rate that moves the policy: the second
    optimizer step's forking tokens are those of the entropies the model has then (transformers'
    logits at that moment, the 0.7 quantile of the written tokens'), not the first step's."""
    samples = varied_samples(4)
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5, 0.3, 0.8])
    lengths = [len(s.response_ids) for s in samples]
    chosen, real_acc = [], trainer.accumulate_gradients

    def spy(actor, batch, *a, **k):  # the step's choice, and the choice of the model now
        h = []
        with torch.no_grad():  # each response token's entropy at temperature 0.7, one by one
            for s in batch.samples:  # (in the step's order: shuffled)
                n = len(s.prompt_ids)
                z = actor(input_ids=torch.tensor([s.prompt_ids + s.response_ids])).logits[0]
                logq = (z[n - 1:n - 1 + len(s.response_ids)].double() / 0.7).log_softmax(-1)
                h.append(-(logq.exp() * logq).sum(-1))
        h = torch.cat(h)
        now = h >= torch.quantile(h, 0.7)
        chosen.append((torch.cat(batch.forking).bool(), now, [id(s) for s in batch.samples]))
        return real_acc(actor, batch, *a, **k)

    monkeypatch.setattr(trainer, "accumulate_gradients", spy)
    torch.manual_seed(0)
    model = model_for("qwen2").double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    cfg = grpo.GRPOConfig(top_entropy_quantile=0.3, ppo_epochs=2, logprob_chunk=5)
    batch = reference.batch_of(samples, adv)
    reference.update(model, None, opt, batch, reference.settings(cfg, 0.7))
    (first, first_now, order1), (second, second_now, order2) = chosen
    assert first.equal(first_now) and second.equal(second_now)
    by_sample = [dict(zip(order, mask.split([lengths[ids.index(i)] for i in order])))
                 for mask, order in ((first, order1), (second, order2))
                 for ids in [[id(s) for s in samples]]]
    assert any(not by_sample[0][i].equal(by_sample[1][i]) for i in order1)  # the policy moved
