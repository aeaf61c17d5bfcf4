"""The surrogates of grpo.policy_loss (GSPO, CISPO, SAPO) against their papers' formulas written
as plain fp64 loops over sequences and tokens, with the gradient each paper's objective has
(derived by hand, below each formula), against hand-computed numbers, and the combinations
grpo.validate refuses. PPO's surrogate has the same tests in test_grpo_math.py; the fused pass
against the unfused statement, for each surrogate, is in test_fused_logprobs.py.

Tolerance: the loop and grpo.grpo_loss compute the same fp64 expressions in another order
(sums of at most 15 terms of size < 10): their difference is a few units of 2^-52 of that,
far under 1e-12."""

import dataclasses
import math

import pytest
import torch

import grpo
import trainer
from grpo import GRPOConfig
from test_grpo_math import central_differences, grpo_loss, loss_case, naive_kl, tokens_of


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def naive(policy, logp, old, adv, mask, g, n_tokens, n_seqs, max_len, weight):
    """The loss and its gradient (nested lists like logp), and where the surrogate cut the
    gradient, one sequence at a time.

    GSPO (arXiv 2507.18071, eq. 5-7): s_i = (pi(y_i) / pi_old(y_i))^(1 / |y_i|), the sequence's
    term min(s_i A_i, clip(s_i, 1 - eps_l, 1 + eps_h) A_i), averaged over sequences. d s_i /
    d logp_t = s_i / |y_i| for each of its tokens; the min's clipped branch has no gradient.
    CISPO (arXiv 2506.13585, eq. 4): each token's sg(r_hat) A log pi, r_hat = min(r, 1 + eps_h),
    summed over tokens (here: under loss_agg's weights); gradient r_hat A, never cut.
    SAPO (arXiv 2511.20347): each token's f(r) A, f(r) = 4 / tau sigmoid(tau (r - 1)), tau the
    positive or negative advantage's; gradient 4 sigmoid (1 - sigmoid) r A.
    LUSPO (arXiv 2602.05261, as TRL 1.16's luspo: GSPO's per-token loss summed over each
    sequence, then averaged over sequences): GSPO's term times the sequence's length |y_i|.
    VESPO (arXiv 2602.10693, as TRL 1.16's get_gamma_weights): w_i = prod over its tokens of
    p / p_old and of the mismatch weight (each log clamped: ratios to [-20, 20], weights and the
    sum to [log 1e-8, 20]), phi_i = e^lam w^k e^(-lam w) (k, lam those of the sign of A_i), each
    token's sg(phi_i) A_i log pi, under loss_agg's weights, the mismatch weight not applied
    again; gradient phi_i A_i (times the weight), cut where phi_i < 0.5.
    DPPO (arXiv 2602.04879, as verl's dppo_tv / dppo_kl compute it): each token's
    sg(min(r, cap)) A log pi times 1 inside the trust region, 0 outside: with p, q the current
    and old probabilities, inside for A > 0 when p - q <= eps_h (TV) or KL(Bern(q) || Bern(p))
    <= eps_h or p <= q (KL); for A <= 0 when q - p <= eps_l, or KL <= eps_l or p >= q.
    Gradient min(r, cap) A inside, cut outside.
    All terms are negated (a loss) and times the token's mismatch weight."""
    loss, grad, cut = 0.0, [], []
    for i in range(len(logp)):
        toks = [t for t in range(len(logp[i])) if mask[i][t]]
        n = len(toks)
        row_grad, row_cut = [0.0] * len(logp[i]), [False] * len(logp[i])
        if policy in ("gspo", "luspo"):  # luspo: the sequence's term times its length n
            s = math.exp(sum(logp[i][t] - old[i][t] for t in toks) / n)
            bounded = min(max(s, 1 - g.clip_low), 1 + g.clip_high)
            w = weight[i][toks[0]]  # a sequence's weight (gspo takes seq_mask or none)
            length = n if policy == "luspo" else 1
            loss += -min(s * adv[i], bounded * adv[i]) * w * length / n_seqs
            for t in toks:
                row_cut[t] = s * adv[i] > bounded * adv[i]
                row_grad[t] = 0.0 if row_cut[t] else -adv[i] * s / n * w * length / n_seqs
        if policy == "vespo":  # w: the product of the ratios to old and of the mismatch weights
            floor = math.log(1e-8)
            log_w = sum(min(max(logp[i][t] - old[i][t], -20), 20) for t in toks) \
                + sum(min(max(math.log(weight[i][t]) if weight[i][t] > 0 else -math.inf, floor),
                          20) for t in toks)
            w_seq = math.exp(min(max(log_w, floor), 20))
            k, lam = ((g.vespo_k_pos, g.vespo_lambda_pos) if adv[i] >= 0
                      else (g.vespo_k_neg, g.vespo_lambda_neg))
            phi = math.exp(lam) * w_seq ** k * math.exp(-lam * w_seq)
        for t in toks:
            if policy in ("gspo", "luspo"):
                continue
            if policy == "vespo":
                coef = {"token_mean": 1 / n_tokens, "seq_mean": 1 / (n * n_seqs)}[g.loss_agg]
                loss += -phi * adv[i] * logp[i][t] * coef
                row_grad[t], row_cut[t] = -phi * adv[i] * coef, phi < 0.5
                continue
            coef = {"token_mean": 1 / n_tokens, "seq_mean": 1 / (n * n_seqs),
                    "constant": 1 / (n_seqs * max_len)}[g.loss_agg]
            r = math.exp(logp[i][t] - old[i][t])
            if policy.startswith("dppo"):
                p, q = math.exp(logp[i][t]), math.exp(old[i][t])
                if policy == "dppo_tv":
                    up, down = p - q <= g.clip_high, q - p <= g.clip_low
                else:
                    kl = q * math.log(q / p) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
                    up, down = kl <= g.clip_high or p <= q, kl <= g.clip_low or p >= q
                inside = up if adv[i] > 0 else down
                r_hat = min(r, g.dppo_ratio_cap)
                loss += -r_hat * adv[i] * logp[i][t] * inside * weight[i][t] * coef
                row_grad[t] = -r_hat * adv[i] * inside * weight[i][t] * coef
                row_cut[t] = not inside
            elif policy == "cispo":
                r_hat = min(r, 1 + g.clip_high)
                loss += -r_hat * adv[i] * logp[i][t] * weight[i][t] * coef
                row_grad[t], row_cut[t] = -r_hat * adv[i] * weight[i][t] * coef, r > r_hat
            else:  # sapo
                tau = g.sapo_tau_pos if adv[i] > 0 else g.sapo_tau_neg
                gate = sigmoid(tau * (r - 1))
                loss += -4 / tau * gate * adv[i] * weight[i][t] * coef
                row_grad[t] = -4 * gate * (1 - gate) * r * adv[i] * weight[i][t] * coef
                row_cut[t] = 4 * gate * (1 - gate) < 0.5
        grad.append(row_grad)
        cut.append(row_cut)
    return loss, grad, cut


def ours(policy, logp, old, adv, mask, g, n_tokens, n_seqs, max_len, weight):
    """grpo.grpo_loss on the flattened case, gspo's and luspo's sequence ratios from
    grpo.sequence_ratio and vespo's from grpo.vespo_log_w, as the first pass makes them: the
    loss, the gradient, the cut tokens."""
    t = tokens_of(old, adv, mask, g, n_tokens, n_seqs, max_len, is_weight=weight)
    if policy in ("gspo", "luspo"):
        t = dataclasses.replace(t, seq_ratio=grpo.sequence_ratio(logp, old, mask)
                                .expand_as(mask).reshape(-1))
    if policy == "vespo":
        t = dataclasses.replace(t, seq_log_w=grpo.vespo_log_w(logp, old, weight, mask)
                                .expand_as(mask).reshape(-1))
    loss, _ = grpo.grpo_loss(logp.reshape(-1), t, g)
    loss.backward()
    cut = torch.stack([grpo.grpo_loss(logp.reshape(-1)[k:k + 1].detach(), t[k:k + 1], g)[1]
                       for k in range(mask.numel())]).view(mask.shape)
    return loss.item(), logp.grad, cut.bool()


CASES = [("gspo", "seq_mean", 3e-4, 4e-4), ("gspo", "seq_mean", 0.2, 0.2),
         ("cispo", "token_mean", 0.2, 0.5), ("cispo", "seq_mean", 0.2, 0.2),
         ("cispo", "constant", 0.2, 4.0), ("sapo", "token_mean", 0.2, 0.2),
         ("sapo", "seq_mean", 0.2, 0.2),
         ("dppo_tv", "token_mean", 0.03, 0.05), ("dppo_tv", "seq_mean", 0.05, 0.03),
         ("dppo_kl", "token_mean", 0.005, 0.01), ("dppo_kl", "constant", 0.01, 0.005),
         ("luspo", "seq_sum", 3e-4, 4e-4), ("luspo", "seq_sum", 0.2, 0.2),
         ("vespo", "token_mean", 0.2, 0.2), ("vespo", "seq_mean", 0.2, 0.2)]


@pytest.mark.parametrize("policy, agg, low, high", CASES)
def test_each_surrogate_against_its_paper_loop_in_fp64(policy, agg, low, high):
    logp, old, _, weight, adv, mask = loss_case()
    if policy in ("gspo", "luspo"):  # one weight per sequence (seq_mask's kind)
        weight = weight[:, :1].expand_as(weight).clone()
    if policy == "vespo":  # token_mask's kind: a token outside the band weighs 0, its w 1e-8
        weight[1, 2] = 0.0
        old = old * 0.5 - 0.5  # sequences' w on both sides of phi's peak
    g = GRPOConfig(policy_loss=policy, loss_agg=agg, clip_low=low, clip_high=high,
                   is_correction="seq_mask" if policy in ("gspo", "luspo") else "tis",
                   dppo_anchor="old")  # DPPO's recomputed anchor here: the loop's own ratio
    grpo.validate(g)
    args = (g, 10.0, 3.0, 6)  # n_tokens, n_seqs, max_len of the "global batch"
    lists = [x.tolist() for x in (logp, old, adv, mask, weight)]
    want, want_grad, want_cut = naive(policy, *lists[:4], *args, lists[4])
    got, got_grad, got_cut = ours(policy, logp, old, adv, mask, *args, weight)
    assert abs(got - want) < 1e-12
    assert (got_grad - torch.tensor(want_grad, dtype=torch.float64)).abs().max() < 1e-12
    assert got_cut.tolist() == [[c and bool(m) for c, m in zip(cr, mr)]
                                for cr, mr in zip(want_cut, mask.tolist())]
    if policy.startswith("dppo"):  # the case has tokens in and out of the trust region
        assert got_cut[mask.bool()].any() and not got_cut[mask.bool()].all()
    if policy == "vespo":  # phi took values far from 1 both ways, and the masked token's 0
        phi = grpo.vespo_phi(grpo.vespo_log_w(logp, old, weight, mask), adv[:, None], g)[:, 0]
        assert phi.max() > 1.05 and 0 < phi.min() < 0.5 and phi[1] < 1e-20, phi


@pytest.mark.parametrize("c", [1.5, 3.0])
def test_dual_clip_against_its_paper_loop_in_fp64(c):
    """Dual-clip PPO (Ye et al. 2020, arXiv 1912.09729, eq. 4): a token's term is PPO's
    min(r A, clip(r, 1 - eps, 1 + eps) A), and for A < 0 at least c A: max(that, c A). Its
    gradient is r A where the unclipped branch is the one taken, else 0 (the clip's and c A's
    branches are constants in logp). Token mean, times the mismatch weight, negated."""
    logp, old, _, weight, adv, mask = loss_case()
    old = old - torch.tensor([0.0, 1.2, 0.0], dtype=torch.float64)[:, None]  # A < 0: r ~ 3.3
    g = GRPOConfig(dual_clip=c, clip_low=0.2, clip_high=0.28, is_correction="tis")
    grpo.validate(g)
    n_tokens = 10.0
    want, want_grad, lower = 0.0, torch.zeros_like(logp), 0
    for i in range(3):
        for t in range(5):
            if not mask[i, t]:
                continue
            r, a, w = math.exp((logp[i, t] - old[i, t]).item()), adv[i].item(), weight[i, t].item()
            unclipped, clipped = r * a, min(max(r, 0.8), 1.28) * a
            term = min(unclipped, clipped)
            if a < 0 and c * a > term:
                term, lower = c * a, lower + 1
            want += -term * w / n_tokens
            if term == unclipped:
                want_grad[i, t] = -r * a * w / n_tokens
    got, got_grad, got_cut = ours("ppo", logp, old, adv, mask, g, n_tokens, 3.0, 6, weight)
    assert abs(got - want) < 1e-12
    assert (got_grad - want_grad).abs().max() < 1e-12
    assert lower > 0  # the case reaches the lower bound
    assert got_cut[mask.bool()].tolist() == (want_grad[mask.bool()] == 0).tolist()


def test_dual_clip_refusals():
    """Below or at 1 + clip_high the floor c A would bind inside PPO's clip range: for A < 0
    and a ratio r in (c, 1 + clip_high], r A < c A, so a token PPO keeps would lose its
    gradient (shown on one such token); refused, naming both fields and the fix."""
    a, high = torch.tensor(-1.0), 0.2
    grads = []
    for c in (0.0, 1.1):  # PPO alone, then with a floor below 1 + clip_high
        r = torch.tensor(1.15, requires_grad=True)  # inside PPO's range [0.8, 1.2]
        surrogate, _ = grpo.ppo_clip(r, a, 0.2, high, c)
        grads.append(float(torch.autograd.grad(surrogate, r, allow_unused=True)[0] or 0.0))
    assert grads == [-1.0, 0.0]  # the floor took a gradient PPO keeps
    for bad, match in (({"dual_clip": 1.0}, "c > 1 \\+ clip_high"),
                       ({"dual_clip": 1.1, "clip_high": 0.2}, "grpo.dual_clip=1.1 with grpo.clip_high=0.2"),
                       ({"dual_clip": 1.28, "clip_high": 0.28}, "within it, it cuts"),
                       ({"dual_clip": 3.0, "policy_loss": "cispo"}, "grpo.dual_clip=0"),
                       ({"dual_clip": 3.0, "policy_loss": "sapo"}, "grpo.dual_clip=0")):
        with pytest.raises(ValueError, match=match):
            grpo.validate(GRPOConfig(**bad))
    grpo.validate(GRPOConfig(dual_clip=3.0))


@pytest.mark.parametrize("policy", ["gspo", "luspo", "cispo", "sapo", "dppo_tv", "dppo_kl",
                                    "vespo"])
def test_on_policy_every_surrogate_is_reinforce(policy):
    """Ratio 1 (old = logp): GSPO's and LUSPO's s = 1, CISPO's weight 1, SAPO's gate slope 1,
    VESPO's phi(1) = 1: the gradient is -A times the aggregation's weight of the token, as for
    PPO (LUSPO's aggregation: each sequence's sum)."""
    logp = torch.randn(2, 4, dtype=torch.float64).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.float64)
    adv = torch.tensor([2.0, -1.0], dtype=torch.float64)
    agg = "seq_sum" if policy == "luspo" else "seq_mean"
    g = GRPOConfig(policy_loss=policy, loss_agg=agg, is_correction="none",
                   dppo_anchor="old")  # (anchored to the rollout: test_dppo_...)
    ours(policy, logp, logp.detach(), adv, mask, g, 8.0, 4.0, 5, torch.ones_like(mask))
    for i, length in enumerate([3, 1]):
        per = 4 if policy == "luspo" else 4 * length
        expect = [-adv[i].item() / per] * length + [0.0] * (4 - length)
        assert torch.allclose(logp.grad[i], torch.tensor(expect, dtype=torch.float64))


def test_hand_computed_values():
    """One sequence of two tokens, A = 2, token mean over 2 tokens (seq mean for GSPO)."""
    logp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    old = torch.tensor([[-1.5, -2.0]], dtype=torch.float64)  # ratios e^0.5 = 1.6487, 1
    adv, mask, one = torch.tensor([2.0], dtype=torch.float64), torch.ones(1, 2), torch.ones(1, 2)
    mask = mask.double()

    def value(policy, **kw):
        g = GRPOConfig(policy_loss=policy, is_correction="none", **kw)
        return ours(policy, logp.clone().requires_grad_(), old, adv, mask, g, 2.0, 1.0, 2,
                    one.double())[0]

    # CISPO, cap 1.2: -(1.2 * 2 * -1 + 1 * 2 * -2) / 2 = 3.2
    assert abs(value("cispo") - 3.2) < 1e-12
    # GSPO: s = e^0.25 = 1.2840 > 1.2 with A > 0: the clipped 1.2 * 2, negated: -2.4
    assert abs(value("gspo", loss_agg="seq_mean") - -2.4) < 1e-12
    # SAPO, tau 1 (A > 0): -(4 sigmoid(0.6487) * 2 + 4 sigmoid(0) * 2) / 2
    want = -(4 * sigmoid(math.exp(0.5) - 1) + 4 * 0.5)
    assert abs(value("sapo") - want) < 1e-12
    # LUSPO: GSPO's clipped -2.4 times the sequence's 2 tokens
    assert abs(value("luspo", loss_agg="seq_sum") - -4.8) < 1e-12
    # VESPO: w = e^0.5 (a product, not GSPO's mean), phi = e^(3 + 2 x 0.5 - 3 w) = 0.388;
    # -(phi 2 (-1) + phi 2 (-2)) / 2 = 3 phi
    assert abs(value("vespo") - 3 * math.exp(4 - 3 * math.exp(0.5))) < 1e-12


@pytest.mark.parametrize("overrides, says", [
    ({"policy_loss": "gspo"}, "grpo.loss_agg=seq_mean"),
    ({"policy_loss": "gspo", "loss_agg": "seq_mean"}, "grpo.is_correction=seq_mask"),
    ({"policy_loss": "gspo", "loss_agg": "seq_mean", "is_correction": "token_mask"},
     "with grpo.is_correction=token_mask"),
    ({"policy_loss": "sapo", "clip_high": 0.28}, "ignores grpo.clip_high=0.28"),
    ({"policy_loss": "sapo", "clip_low": 0.1, "clip_high": 0.3},
     "ignores grpo.clip_low=0.1 and grpo.clip_high=0.3"),
    ({"policy_loss": "cispo", "clip_low": 0.1}, "ignores grpo.clip_low=0.1"),
    ({"policy_loss": "luspo"}, "grpo.loss_agg=seq_sum"),
    ({"policy_loss": "luspo", "loss_agg": "seq_sum"}, "grpo.is_correction=seq_mask"),
    ({"policy_loss": "vespo", "is_correction": "seq_mask"}, "grpo.is_correction=tis or token_"),
    ({"policy_loss": "vespo", "clip_high": 0.28}, "ignores grpo.clip_high=0.28"),
    ({"policy_loss": "vespo", "dual_clip": 3.0}, "grpo.dual_clip=0")])
def test_combinations_the_papers_rule_out_are_refused(overrides, says):
    with pytest.raises(ValueError, match=says.replace(".", r"\.")):
        grpo.validate(GRPOConfig(**overrides))
    for fine in ({"policy_loss": "gspo", "loss_agg": "seq_mean", "is_correction": "seq_mask",
                  "clip_low": 3e-4, "clip_high": 4e-4}, {"policy_loss": "cispo", "clip_high": 4.0},
                 {"policy_loss": "sapo", "sapo_tau_neg": 2.0},
                 {"policy_loss": "luspo", "loss_agg": "seq_sum", "is_correction": "seq_mask",
                  "dual_clip": 3.0},
                 {"policy_loss": "vespo", "is_correction": "token_mask", "vespo_k_neg": 2.0}):
        grpo.validate(GRPOConfig(**fine))


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_unbiased_kl_against_its_loop(estimator):
    """grpo.kl_unbiased (DeepSeek-V3.2, arXiv 2512.02556, its KL estimate): each token's KL
    estimate times pi / pi_old = exp(logp - old), differentiated through both factors; checked
    with the clipped surrogate beside it, the loss to 1e-12 and the gradient against central
    differences of the loop (step 1e-6: truncation ~1e-12, rounding ~1e-10 for a loss of size
    ~1, so 1e-8)."""
    logp, old, ref, _, adv, mask = loss_case()
    g = GRPOConfig(kl_coef=0.1, kl_estimator=estimator, kl_unbiased=True)
    args = (g, 10.0, 3.0, 6)
    loss, _ = grpo_loss(logp, old, adv, mask, *args, ref_logp=ref)
    o, a, m, r = (x.tolist() for x in (old, adv, mask, ref))

    def loop(lp):
        total = 0.0
        for i in range(3):
            for t in range(5):
                if m[i][t]:
                    ratio = math.exp(lp[i][t] - o[i][t])
                    bounded = min(max(ratio, 1 - g.clip_low), 1 + g.clip_high)
                    term = -min(ratio * a[i], bounded * a[i])
                    term += g.kl_coef * naive_kl(lp[i][t], r[i][t], estimator) * ratio
                    total += term / 10.0
        return total

    assert abs(loss.item() - loop(logp.tolist())) < 1e-12
    loss.backward()
    assert (logp.grad - central_differences(loop, logp.detach())).abs().max() < 1e-8


@pytest.mark.parametrize("cap_low", [0.0, 0.8])
def test_every_importance_sampling_mode_against_its_loop(cap_low):
    """grpo.mismatch_weights for each grpo.is_correction mode, against a loop over sequences and
    tokens: ratio = exp(old - engine) per token, a sequence's the product (seq_geo_mask: the
    geometric mean); truncate clamps to [lo, C], masks keep the ratio inside [lo, C] and give 0
    outside; lo = cap_low, or where it is 0: nothing for the token modes and seq_truncate, 1/C
    for seq_mask and seq_geo_mask."""
    g = torch.Generator().manual_seed(4)
    engine = torch.randn(6, 6, generator=g, dtype=torch.float64) - 1
    old = engine + torch.randn(6, 6, generator=g, dtype=torch.float64) * 0.4
    mask = (torch.rand(6, 6, generator=g) < 0.7).double()
    mask[:, 0] = 1  # every sequence has a token
    old[4] -= 0.6  # two sequences drift as a whole: their geometric means leave the band too
    old[5] += 0.6
    cap = 1.5
    for mode in grpo.IS_MODES[1:]:
        got = grpo.mismatch_weights(old, engine, mask, mode, cap, cap_low)
        lo = cap_low or (1 / cap if mode in ("seq_mask", "seq_geo_mask") else 0.0)
        kinds = set()
        for i in range(6):
            toks = [t for t in range(6) if mask[i, t]]
            ratios = [math.exp(old[i, t] - engine[i, t]) for t in toks]
            seq = math.prod(ratios)
            if mode == "seq_geo_mask":
                seq = seq ** (1 / len(toks))
            for t, r in zip(toks, ratios):
                # the masks keep the ratio inside the band (IcePop's M(k) = k on [alpha, beta];
                # TRL 1.16: ratio.masked_fill(ratio > cap, 0)), 0 outside
                want = {"tis": min(max(r, lo), cap), "token_mask": r * (lo <= r <= cap),
                        "seq_truncate": min(max(seq, lo), cap),
                        "seq_mask": seq * (lo <= seq <= cap),
                        "seq_geo_mask": seq * (lo <= seq <= cap)}[mode]
                assert abs(got[i, t].item() - want) <= 1e-12 * max(1.0, want), (mode, i, t)
                kinds.add(want == 0 if mode.endswith("mask")
                          else (want == cap, want == lo, lo < want < cap))
        assert len(kinds) > 1, (mode, kinds)  # the case reaches both sides of the band


def test_off_policy_mask_against_its_loop():
    """grpo.off_policy_keep and off_policy_stats (DeepSeek-V3.2, eq. 9): a response is dropped
    exactly when its advantage is negative and the mean over its tokens of log p_engine -
    log p_trainer exceeds delta; the metric counts those responses among all."""
    g = torch.Generator().manual_seed(5)
    logp = torch.randn(8, 5, generator=g, dtype=torch.float64) - 1
    engine = logp + torch.randn(8, 5, generator=g, dtype=torch.float64) * 0.3 + 0.05
    mask = (torch.rand(8, 5, generator=g) < 0.8).double()
    mask[:, 0] = 1
    adv = torch.tensor([1.0, -1.0, -0.5, 2.0, -2.0, -0.1, 0.0, -3.0], dtype=torch.float64)
    delta = 0.05
    keep = grpo.off_policy_keep(logp, engine, mask, adv[:, None], delta)[:, 0].tolist()
    want = []
    for i in range(8):
        toks = [t for t in range(5) if mask[i, t]]
        kl = sum(engine[i, t].item() - logp[i, t].item() for t in toks) / len(toks)
        want.append(0.0 if adv[i] < 0 and kl > delta else 1.0)
    assert keep == want and 0 < sum(want) < 8
    per_sample = [(logp[i][mask[i].bool()], engine[i][mask[i].bool()]) for i in range(8)]
    stats = trainer.off_policy_stats([o for o, _ in per_sample], [e for _, e in per_sample], adv,
                                  delta)
    assert stats["off_policy_masked_frac"].total == 8 - sum(want)
    assert stats["off_policy_masked_frac"].count == 8
    assert trainer.off_policy_stats([], [], adv, 0.0) == {}  # off: no metric


@pytest.mark.parametrize("cap_low", [0.0, 0.8])
def test_the_modes_are_trls_formula(cap_low):
    """TRL 1.16's vllm_importance_sampling_mode as _generate_and_score_completions writes it
    (trl/trainer/grpo_trainer.py): the masked log difference old - sampling, summed over the
    sequence for sequence_*, exp; *_truncate clamps to [clip_min, clip_max], *_mask fills 0
    outside it. Ours with is_cap = clip_max and is_cap_low = clip_min (for seq_mask only where
    given: ours defaults to 1/C where TRL has none) on the mask's tokens."""
    g = torch.Generator().manual_seed(6)
    engine = torch.randn(5, 7, generator=g, dtype=torch.float64) - 1
    old = engine + torch.randn(5, 7, generator=g, dtype=torch.float64) * 0.4
    mask = (torch.rand(5, 7, generator=g) < 0.7).double()
    mask[:, 0] = 1
    cap = 1.5
    pairs = [("tis", "token_truncate"), ("token_mask", "token_mask"),
             ("seq_truncate", "sequence_truncate")]
    if cap_low:
        pairs.append(("seq_mask", "sequence_mask"))
    for ours, theirs in pairs:
        diff = (old - engine) * mask
        if theirs.startswith("sequence"):
            diff = diff.sum(dim=-1, keepdim=True)
        ratio = torch.exp(diff)
        if theirs.endswith("truncate"):
            ratio = torch.clamp(ratio, min=cap_low, max=cap)
        else:
            ratio = ratio.masked_fill((ratio < cap_low) | (ratio > cap), value=0.0)
        want = ratio.expand_as(mask) * mask
        got = grpo.mismatch_weights(old, engine, mask, ours, cap, cap_low) * mask
        assert (got - want).abs().max() <= 1e-12 * want.abs().max(), ours
        assert (want == 0).sum() > (mask == 0).sum() or theirs.endswith("truncate"), ours


def test_the_worked_example_of_a_new_loss_trains_as_the_docs_say(monkeypatch):
    """docs/algorithm.md's worked example, applied as a reader would: its function, named in
    grpo.policy_surrogate, becomes each token's surrogate in grpo.grpo_loss, ratio and weight
    as before. The loss and its gradient against the formula by hand (fp64): the ratio capped
    at 1 + clip_high where A > 0, free elsewhere; and they differ from ppo's."""
    import os
    import re

    with open(os.path.join(os.path.dirname(__file__), "..", "docs", "algorithm.md")) as f:
        page = f.read()
    code = re.search(r"A worked example.*?```python\n(.*?)```", page, re.DOTALL).group(1)
    found = {"torch": torch}
    exec(code, found)  # noqa: S102  (the page's own code)
    real = grpo.policy_surrogate
    monkeypatch.setattr(grpo, "policy_surrogate", lambda logp, old, ratio, t, cfg: (
        found["upper_clip"](ratio, t.adv, cfg.clip_high) if cfg.policy_loss == "upper_clip"
        else real(logp, old, ratio, t, cfg)))
    gen = torch.Generator().manual_seed(4)
    old = -torch.rand(12, generator=gen, dtype=torch.float64)
    log_ratio = torch.tensor([0.3, 0.3, -0.3, -0.3, 0.05, -0.05] * 2, dtype=torch.float64)
    logp = (old + log_ratio).requires_grad_()  # ratios past the cap, below it, near 1
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5] * 3, dtype=torch.float64)
    coef = torch.full((12,), 1 / 12, dtype=torch.float64)
    t = grpo.Tokens(adv=adv, coef=coef, written=torch.ones_like(adv), engine=old, old=old)
    g = GRPOConfig(is_correction="none", clip_high=0.1)
    g.policy_loss = "upper_clip"  # (as if POLICY_LOSSES named it)
    loss, cut = grpo.grpo_loss(logp, t, g)
    (grad,) = torch.autograd.grad(loss, logp)
    ratio = (logp - old).exp()
    by_hand = -(torch.where(adv > 0, ratio.clamp(max=1.1), ratio) * adv * coef).sum()
    (want,) = torch.autograd.grad(by_hand, logp)
    assert abs(loss - by_hand) < 1e-14 and (grad - want).abs().max() < 1e-14
    assert int(cut) == int(((adv > 0) & (ratio > 1.1)).sum()) > 0
    g.policy_loss = "ppo"
    assert abs(grpo.grpo_loss(logp, t, g)[0] - loss) > 1e-6


@pytest.mark.parametrize("policy, low, high", [("dppo_tv", 0.2, 0.2), ("dppo_kl", 0.05, 0.05)])
def test_dppo_anchored_to_the_rollout_masks_what_the_paper_masks_on_policy(policy, low, high):
    """DPPO as its paper writes it (arXiv 2602.04879, section 4 and Takeaway 2; its authors'
    sail-sg/Stable-RL compute_policy_loss_with_mask), in plain torch, fp64: the trust region and
    the ratio against the rollout (behaviour) policy, the engine's logprobs, with no other
    importance weight. On-policy (the old logprob is this forward's own) with a 0.7-nat
    engine/trainer gap: grpo.grpo_loss masks exactly the tokens that form masks (many of them),
    its loss and gradient within 1e-12, and grpo.is_correction adds nothing on top. The old
    anchor (grpo.dppo_anchor=old, the paper's recomputed ablation) masks none on-policy: its
    divergence is 0 there, and it is REINFORCE times the mismatch weight."""
    gen = torch.Generator().manual_seed(7)
    n = 300
    logp = -3 * torch.rand(n, generator=gen, dtype=torch.float64)  # p in (0.05, 1]
    engine = (logp + 0.7 * torch.randn(n, generator=gen, dtype=torch.float64)).clamp(max=0)
    adv = torch.randn(n, generator=gen, dtype=torch.float64)
    coef = torch.full((n,), 1 / n, dtype=torch.float64)
    p, q = logp.exp(), engine.exp()
    if policy == "dppo_tv":
        out_up, out_down = p - q > high, p - q < -low
    else:
        kl = q * (engine - logp) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
        out_up, out_down = (kl > high) & (p > q), (kl > low) & (p < q)
    valid = ~torch.where(adv > 0, out_up, out_down)
    lp = logp.clone().requires_grad_()
    want = -(adv * (lp - engine).exp().clamp(max=3.0).detach() * valid * lp * coef).sum()
    (want_grad,) = torch.autograd.grad(want, lp)
    t = grpo.Tokens(adv=adv, coef=coef, written=torch.ones_like(adv), engine=engine)
    for mode in ("none", "tis"):
        g = GRPOConfig(policy_loss=policy, clip_low=low, clip_high=high, is_correction=mode)
        lp = logp.clone().requires_grad_()
        loss, cut = grpo.grpo_loss(lp, t, g)
        (grad,) = torch.autograd.grad(loss, lp)
        assert abs(loss - want) < 1e-12 and (grad - want_grad).abs().max() < 1e-12, mode
        assert int(cut) == int((~valid).sum()) and 0.05 * n < int(cut) < 0.9 * n, int(cut)
        _, each = grpo.dppo(logp, engine, adv, g)
        assert torch.equal(each, ~valid)
    old = GRPOConfig(policy_loss=policy, clip_low=low, clip_high=high, dppo_anchor="old",
                     is_correction="tis")
    lp = logp.clone().requires_grad_()
    loss, cut = grpo.grpo_loss(lp, t, old)
    (grad,) = torch.autograd.grad(loss, lp)
    w = grpo.mismatch_weights(logp[None], engine[None], torch.ones(1, n, dtype=torch.float64),
                              "tis", old.is_cap)[0]
    assert int(cut) == 0 and (grad - (-adv * w * coef)).abs().max() < 1e-12
