"""GRPO math against hand-computed numbers and plain Python loops."""

import math
import statistics

import torch

from rollout import Sample
from train_grpo import (group_advantages, grpo_loss, pad_batch, plan_micro_batches,
                        token_logprobs)


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


def naive_loss(logp, old_logp, adv, mask, eps, n_tokens):
    """Per-token loop: -sum_i sum_t min(r A, clip(r) A) / n_tokens over unmasked tokens."""
    total = 0.0
    for i in range(len(logp)):
        for t in range(len(logp[i])):
            if mask[i][t]:
                r = math.exp(logp[i][t] - old_logp[i][t])
                total += min(r * adv[i], max(min(r, 1 + eps), 1 - eps) * adv[i])
    return -total / n_tokens


def test_loss_value_and_gradient_against_loop():
    g = torch.Generator().manual_seed(2)
    logp = (torch.randn(3, 5, generator=g) * 0.3 - 1).requires_grad_()
    old = logp.detach() + torch.randn(3, 5, generator=g) * 0.3  # ratios both in and out of clip
    adv = torch.tensor([1.5, -0.7, 0.4])
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=torch.float)
    loss = grpo_loss(logp, old, adv, mask, 0.2, n_tokens=10.0)
    ref = naive_loss(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist(), 0.2, 10.0)
    assert abs(loss.item() - ref) < 1e-6
    loss.backward()
    # analytic PPO gradient: d(r)/d(logp) = r; the term is active inside the clip range, or
    # outside it when the unclipped product is the smaller one; masked tokens get nothing
    for i in range(3):
        for t in range(5):
            r = math.exp(logp[i, t].item() - old[i, t].item())
            a = adv[i].item()
            active = 0.8 <= r <= 1.2 or r * a < max(min(r, 1.2), 0.8) * a
            expect = -r * a / 10.0 if mask[i, t] and active else 0.0
            assert abs(logp.grad[i, t].item() - expect) < 1e-6, (i, t)


def test_masked_tokens_get_exactly_zero_gradient():
    logp = torch.randn(2, 4).requires_grad_()
    mask = torch.tensor([[1, 0, 1, 0], [0, 0, 1, 1]], dtype=torch.float)
    grpo_loss(logp, logp.detach(), torch.tensor([1.0, -2.0]), mask, 0.2, 4.0).backward()
    assert logp.grad[mask == 0].eq(0).all()
    assert logp.grad[mask == 1].ne(0).all()


def test_on_policy_gradient_is_reinforce():
    # with old_logp = logp.detach() the ratio is 1: grad = -A / n_tokens on every response token
    logp = torch.randn(2, 3).requires_grad_()
    mask = torch.ones(2, 3)
    grpo_loss(logp, logp.detach(), torch.tensor([2.0, -1.0]), mask, 0.2, 6.0).backward()
    assert torch.allclose(logp.grad, torch.tensor([[-2 / 6] * 3, [1 / 6] * 3]))


def test_pad_batch_masks_response_positions():
    s1 = Sample([5, 6], [7, 8, 9], [-0.1, -0.2, -0.3], False)
    s2 = Sample([5, 6, 7], [8], [-0.4], True)
    ids, attn, targets, mask, elp = pad_batch([s1, s2], pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 7, 8, 0]]
    assert attn.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # targets[t] = ids[t+1]; response tokens 7,8,9 of s1 are targets at t = 1, 2, 3
    assert mask.tolist() == [[0, 1, 1, 1], [0, 0, 1, 0]]
    assert targets[0, 1:4].tolist() == [7, 8, 9] and targets[1, 2].item() == 8
    assert torch.allclose(elp, torch.tensor([[0, -0.1, -0.2, -0.3], [0, 0, -0.4, 0]]))


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
