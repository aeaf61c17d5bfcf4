"""GRPO math against hand-computed numbers and plain Python loops. The loss is grpo.grpo_loss,
the function training calls, on padded (N, T) cases flattened to its per-token inputs."""

import math
import statistics

import pytest
import torch

import grpo
import tracking
from grpo import (LOSS_AGGS, GRPOConfig, constant_groups, group_advantages, kl_penalty,
                  mismatch_weights, overlong_penalty, take_groups)
from logprobs import plan_micro_batches
from records import Sample
from reference import masked_entropy_sum, pad_batch, token_logprobs
from trainer import mismatch_stats, split_mini_batches


def tokens_of(old, adv, mask, g, n_tokens, n_seqs, max_len, is_weight=None, ref_logp=None):
    """grpo.Tokens of a padded (N, T) case, flattened: every position a token, the padding's
    weight (grpo.loss_weights) 0; no mismatch weight is weight 1."""
    N, T = mask.shape
    return grpo.Tokens(
        adv=adv[:, None].expand(N, T).reshape(-1),
        coef=grpo.loss_weights(mask, g, n_tokens, n_seqs, max_len).reshape(-1),
        written=mask.reshape(-1), engine=torch.zeros(N * T, dtype=mask.dtype),
        old=old.reshape(-1), is_weight=(torch.ones_like(mask) if is_weight is None
                                        else is_weight).reshape(-1),
        ref=None if ref_logp is None else ref_logp.reshape(-1))


def grpo_loss(logp, old, adv, mask, g, n_tokens, n_seqs, max_len, is_weight=None,
              ref_logp=None):
    """grpo.grpo_loss on the flattened case: the loss, and per position (N, T) whether the clip
    was active there (its count, one token at a time)."""
    t = tokens_of(old, adv, mask, g, n_tokens, n_seqs, max_len, is_weight, ref_logp)
    flat = logp.reshape(-1)
    loss, count = grpo.grpo_loss(flat, t, g)
    each = torch.stack([grpo.grpo_loss(flat[k:k + 1].detach(), t[k:k + 1], g)[1]
                        for k in range(flat.numel())])
    assert each.sum() == count
    return loss, each.view(mask.shape).bool()


def test_advantages_hand_computed():
    # group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3) -> +-0.8660
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 4, eps=0.0)
    s = 0.5 / math.sqrt(1 / 3)
    assert torch.allclose(adv, torch.tensor([s, -s, -s, s]), atol=1e-6)


def test_advantages_naive_loop():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(6 * 5, generator=g)
    adv = group_advantages(rewards, 5, eps=1e-6)
    r = rewards.tolist()
    for b in range(6):
        grp = r[b * 5:(b + 1) * 5]
        mean, std = statistics.mean(grp), statistics.stdev(grp)
        for j in range(5):
            assert abs(adv[b * 5 + j].item() - (grp[j] - mean) / (std + 1e-6)) < 1e-5


def test_constant_groups_get_exactly_zero():
    # 0.1 + 0.2 style float rewards: a "constant" group must not produce 1e8-scale advantages
    r = torch.tensor([0.1 + 0.2, 0.3, 0.1 + 0.2, 0.1 + 0.2, 1.0, 1.0, 1.0, 1.0,
                      0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    adv = group_advantages(r, 4)
    assert adv[4:8].eq(0).all()
    assert adv[8:].abs().sum() > 0
    # a group equal only up to float noise is not "constant"; its advantage stays bounded by
    # the normalisation, |adv| <= (G-1)/sqrt(G) for unbiased std
    assert adv[:4].abs().max() <= 3 / 2 + 1e-6


def test_token_logprobs_against_log_softmax_loop():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 7, generator=g)
    targets = torch.randint(0, 7, (2, 3), generator=g)
    got = token_logprobs(logits, targets, temperature=0.7)
    for n in range(2):
        for t in range(3):
            row = (logits[n, t] / 0.7).tolist()
            norm = math.log(sum(math.exp(x) for x in row))
            assert abs(got[n, t].item() - (row[targets[n, t]] - norm)) < 1e-5


def central_differences(fn, logp, h=1e-6):
    """d fn / d logp[i, t] by central differences, fn a function of nested lists like logp."""
    grad = torch.zeros_like(logp)
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            up, down = logp.tolist(), logp.tolist()
            up[i][t] += h
            down[i][t] -= h
            grad[i, t] = (fn(up) - fn(down)) / (2 * h)
    return grad


def naive_kl(lp, ref, estimator):
    """Schulman's estimators written out: x = log(q/p) for a token sampled from p."""
    x = ref - lp
    return {"k1": -x, "k2": x * x / 2, "k3": math.exp(x) - 1 - x}[estimator]


def naive_loss(logp, old, adv, mask, g, n_tokens, n_seqs, max_len, weight=None, ref=None):
    """Loops over samples and tokens; logp etc. are nested Python lists."""
    total = 0.0
    for i in range(len(logp)):
        seq, count = 0.0, 0
        for t in range(len(logp[i])):
            if not mask[i][t]:
                continue
            r = math.exp(logp[i][t] - old[i][t])
            clipped_r = min(max(r, 1 - g.clip_low), 1 + g.clip_high)
            term = -min(r * adv[i], clipped_r * adv[i]) * (weight[i][t] if weight else 1.0)
            if ref is not None:
                term += g.kl_coef * naive_kl(logp[i][t], ref[i][t], g.kl_estimator)
            seq, count = seq + term, count + 1
        if g.loss_agg == "token_mean":
            total += seq / n_tokens
        elif g.loss_agg == "seq_mean":
            total += (seq / count if count else 0.0) / n_seqs
        else:
            total += seq / (n_seqs * max_len)
    return total


def loss_case(seed=2):
    g = torch.Generator().manual_seed(seed)
    logp = (torch.randn(3, 5, generator=g, dtype=torch.float64) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(3, 5, generator=g, dtype=torch.float64) * 0.3  # in/out clip
    ref = logp.detach() + torch.randn(3, 5, generator=g, dtype=torch.float64) * 0.5
    weight = torch.rand(3, 5, generator=g, dtype=torch.float64) * 2
    adv = torch.tensor([1.5, -0.7, 0.4], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.float64)
    return logp, old, ref, weight, adv, mask


VARIANTS = [  # (loss_agg, clip_low, clip_high, kl_coef, kl_estimator, with importance weights)
    ("token_mean", 0.2, 0.2, 0.0, "k3", False), ("token_mean", 0.2, 0.28, 0.1, "k3", True),
    ("seq_mean", 0.2, 0.2, 0.0, "k3", False), ("seq_mean", 0.1, 0.3, 0.05, "k1", True),
    ("constant", 0.2, 0.2, 0.0, "k3", False), ("constant", 0.2, 0.28, 0.2, "k2", True),
]


@pytest.mark.parametrize("agg, low, high, kl, est, weighted", VARIANTS)
def test_loss_value_and_gradient_against_loop(agg, low, high, kl, est, weighted):
    logp, old, ref, weight, adv, mask = loss_case()
    g = GRPOConfig(loss_agg=agg, clip_low=low, clip_high=high, kl_coef=kl, kl_estimator=est)
    w = weight if weighted else None
    r = ref if kl else None
    args = (g, 10.0, 3.0, 6)  # n_tokens, n_seqs, max_len of the "global batch"
    loss, clipped = grpo_loss(logp, old, adv, mask, *args, is_weight=w, ref_logp=r)
    lists = [x.tolist() if x is not None else None for x in (old, adv, mask, w, r)]

    def naive(lp):
        return naive_loss(lp, lists[0], lists[1], lists[2], *args, lists[3], lists[4])

    assert abs(loss.item() - naive(logp.tolist())) < 1e-12
    # gradient against central finite differences of the loop
    loss.backward()
    assert (logp.grad - central_differences(naive, logp.detach())).abs().max() < 1e-7
    # the clip is active where the clipped product is the smaller one: its gradient is 0
    ratio = (logp - old).exp().detach()
    for i in range(3):
        for t in range(5):
            c = min(max(ratio[i, t].item(), 1 - low), 1 + high)
            assert clipped[i, t].item() == bool(mask[i, t] and c * adv[i] < ratio[i, t] * adv[i])
    assert clipped.any() and not clipped.all()


@pytest.mark.parametrize("agg, low, high, kl, est, weighted", VARIANTS)
def test_masked_tokens_get_exactly_zero_gradient(agg, low, high, kl, est, weighted):
    logp, old, ref, weight, adv, mask = loss_case(seed=3)
    g = GRPOConfig(loss_agg=agg, clip_low=low, clip_high=high, kl_coef=kl, kl_estimator=est)
    loss, _ = grpo_loss(logp, logp.detach(), adv, mask, g, 10.0, 3.0, 6,
                        is_weight=weight if weighted else None, ref_logp=ref if kl else None)
    loss.backward()
    assert logp.grad[mask == 0].eq(0).all()
    assert logp.grad[mask == 1].ne(0).all()


@pytest.mark.parametrize("agg", LOSS_AGGS)
def test_on_policy_gradient_is_reinforce(agg):
    """old_logp = logp.detach(): ratio 1, so grad = -A * (the aggregation's weight of the token)."""
    logp = torch.randn(2, 4, dtype=torch.float64).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.float64)
    adv = [2.0, -1.0]
    g = GRPOConfig(loss_agg=agg)
    loss, _ = grpo_loss(logp, logp.detach(), torch.tensor(adv, dtype=torch.float64), mask, g,
                        n_tokens=8.0, n_seqs=4.0, max_len=5)
    loss.backward()
    for i, length in enumerate([3, 1]):
        w = {"token_mean": 1 / 8, "seq_mean": 1 / (4 * length), "constant": 1 / (4 * 5),
             "seq_sum": 1 / 4}[agg]
        expect = [-adv[i] * w] * length + [0.0] * (4 - length)
        assert torch.allclose(logp.grad[i], torch.tensor(expect, dtype=torch.float64))


def test_kl_estimators_expectations_exact():
    """Under p, E[k1] = E[k3] = KL(p || q) exactly; k2 is >= 0 and close for nearby p, q."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    q = torch.tensor([0.4, 0.35, 0.2, 0.05], dtype=torch.float64)
    kl = sum(pi * math.log(pi / qi) for pi, qi in zip(p.tolist(), q.tolist()))
    lp, lq = p.log(), q.log()
    for est in ("k1", "k2", "k3"):
        vals = kl_penalty(lp, lq, est)
        for v, a, b in zip(vals.tolist(), lp.tolist(), lq.tolist()):
            assert abs(v - naive_kl(a, b, est)) < 1e-12
    assert abs((p * kl_penalty(lp, lq, "k1")).sum().item() - kl) < 1e-12
    assert abs((p * kl_penalty(lp, lq, "k3")).sum().item() - kl) < 1e-12
    assert (kl_penalty(lp, lq, "k3") >= 0).all() and (kl_penalty(lp, lq, "k1") < 0).any()
    assert abs((p * kl_penalty(lp, lq, "k2")).sum().item() - kl) < 0.1 * kl


def test_mismatch_weights_against_loop():
    g = torch.Generator().manual_seed(4)
    engine = torch.randn(4, 6, generator=g, dtype=torch.float64) - 1
    old = engine + torch.randn(4, 6, generator=g, dtype=torch.float64) * 0.6
    mask = torch.tensor([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [0, 1, 0, 0, 0, 0],
                         [0, 1, 1, 1, 1, 1]], dtype=torch.float64)
    cap = 2.0
    assert mismatch_weights(old, engine, mask, "none", cap).eq(1).all()
    tis = mismatch_weights(old, engine, mask, "tis", cap)
    seq = mismatch_weights(old, engine, mask, "seq_mask", cap)
    n_kept = 0
    for i in range(4):
        prod = 1.0
        for t in range(6):
            r = math.exp(old[i, t] - engine[i, t]) if mask[i, t] else 1.0
            prod *= r
            if mask[i, t]:
                assert abs(tis[i, t].item() - min(r, cap)) < 1e-12
        inside = 1 / cap <= prod <= cap
        n_kept += inside
        want = prod if inside else 0.0  # masked IS: the sequence's ratio inside the band
        assert (seq[i] - want).abs().max() <= 1e-12 * max(1.0, want), i
    assert 0 < n_kept < 4  # the case has sequences on both sides
    assert (tis[mask.bool()] == cap).any() and (tis[mask.bool()] < 1).any()


def test_mismatch_stats_against_loop():
    old = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5]), torch.tensor([-3.0, -0.1, -0.2])]
    engine = [[-1.1, -1.0], [-0.5], [-3.0, -0.1, -1.2]]
    m = mismatch_stats(old, engine, cap=2.0)
    flat = [(o, e) for os_, es in zip(old, engine) for o, e in zip(os_.tolist(), es)]
    ratios = [math.exp(o - e) for o, e in flat]
    assert m["logp_gap"].count == m["is_ratio_mean"].count == m["is_above_cap_frac"].count == 6
    assert m["seq_outside_cap_frac"].count == 3
    assert abs(m["logp_gap"].total - sum(abs(o - e) for o, e in flat)) < 1e-6
    assert abs(m["is_ratio_mean"].total - sum(ratios)) < 1e-6
    assert m["is_above_cap_frac"].total == sum(r > 2 for r in ratios) == 1  # exp(1.0)
    # sequence ratios: exp(0.1 - 1.0) = 0.41, exp(0) = 1, exp(1.0) = 2.72: two leave [1/2, 2]
    assert m["seq_outside_cap_frac"].total == 2
    assert isinstance(m["is_ratio_max"], tracking.Max) and isinstance(m["is_ratio_min"],
                                                                      tracking.Min)
    assert abs(m["is_ratio_max"].value - max(ratios)) < 1e-6
    assert abs(m["is_ratio_min"].value - min(ratios)) < 1e-6


def test_advantages_without_std_scaling_and_constant_groups():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    adv = group_advantages(r, 4, scale_by_std=False)  # Dr. GRPO: r - mean
    assert adv.tolist() == [0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0]
    assert constant_groups(r, 4).tolist() == [False, True]


def test_overlong_penalty_hand_computed():
    # max_len 10, buffer 4: free up to 6 tokens, then -1/4 per token down to -factor at 10
    lengths = torch.tensor([3.0, 6.0, 7.0, 8.0, 10.0])
    got = overlong_penalty(lengths, max_len=10, buffer=4, factor=0.5)
    assert got.tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]


def test_entropy_in_chunks_against_loop():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 3, 7, generator=g)
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]], dtype=torch.float)
    expect = 0.0
    for n in range(2):
        for t in range(3):
            if mask[n, t]:
                z = sum(math.exp(x) for x in logits[n, t].tolist())
                expect -= sum(math.exp(x) / z * (x - math.log(z)) for x in logits[n, t].tolist())
    assert abs(masked_entropy_sum(logits, mask, chunk=2) - expect) < 1e-4


def test_take_groups_first_come_over_engine_groups():
    # 3 engine groups kept 2, 3, 1 groups; a batch of 4: engine 0 takes its 2, engine 1 its
    # first 2, engine 2 none
    keeps = [[True, False, True], [True, True, False, True], [False, True]]
    kept = [sum(k) for k in keeps]
    got = [take_groups(keeps[e], kept, e, target=4) for e in range(3)]
    assert got == [[0, 2], [0, 1], []]
    assert [take_groups(keeps[e], kept, e, target=10) for e in range(3)] == [[0, 2], [0, 1, 3], [1]]


def test_mini_batches_partition_each_epoch():
    gen = torch.Generator().manual_seed(0)
    a, b = split_mini_batches(10, 3, gen), split_mini_batches(10, 3, gen)
    for parts in (a, b):
        assert sorted(i for p in parts for i in p) == list(range(10))
        assert sorted(len(p) for p in parts) == [3, 3, 4]
    assert a != b  # reshuffled every epoch


def test_pad_batch_masks_response_positions():
    s1 = Sample([5, 6], [7, 8, 9], [-0.1, -0.2, -0.3], False)
    s2 = Sample([5, 6, 7], [8], [-0.4], True)
    ids, attn, targets, mask, pt = pad_batch([s1, s2], 0, per_token={"old": [[1, 2, 3], [4]]})
    assert ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 8, 0]]
    assert attn.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # targets[t] = ids[t+1]; response tokens 7,8,9 of s1 are targets at t = 1, 2, 3
    assert mask.tolist() == [[0, 1, 1, 1], [0, 0, 1, 0]]
    assert targets[0, 1:4].tolist() == [7, 8, 9] and targets[1, 2].item() == 8
    assert torch.allclose(pt["engine"], torch.tensor([[0, -0.1, -0.2, -0.3], [0, 0, -0.4, 0]]))
    assert pt["old"].tolist() == [[0, 1, 2, 3], [0, 0, 4, 0]]


def test_micro_batches_respect_budget_and_cover_all():
    lengths = [10, 3, 7, 7, 2, 9, 1]
    plan = plan_micro_batches(lengths, budget=16)
    assert sorted(i for mb in plan for i in mb) == list(range(7))
    for mb in plan:
        assert len(mb) == 1 or len(mb) * max(lengths[i] for i in mb) <= 16


def test_lr_schedule_warmup_then_cosine():
    from fsdp_utils import OptimConfig, build_optimizer

    cfg = OptimConfig(lr=1.0, warmup_steps=4, schedule="cosine", min_lr_ratio=0.1)
    opt, sched = build_optimizer(cfg, torch.nn.Linear(2, 2), total_steps=14)
    lrs = []
    for _ in range(14):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]  # linear warmup
    # cosine from 1.0 (step 4) down to 0.1 at the last step: 0.1 + 0.9 * (1 + cos(pi p)) / 2
    for step in range(4, 14):
        p = (step - 4) / 10
        assert abs(lrs[step] - (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))) < 1e-9
