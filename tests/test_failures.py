"""Failures out of the loss: a sample whose environment or reward call failed gets no gradient,
and its group's advantages are those of the group without it (env.on_failure=drop)."""

import statistics

import torch

import grpo
import reference
from tasks import tiny_task
import trainer
from records import Sample
from test_packing import world_of_one  # noqa: F401 (fixture)


def test_advantages_over_the_valid_samples_equal_a_naive_loop():
    g = torch.Generator().manual_seed(0)
    G = 5
    rewards = torch.rand(4 * G, generator=g, dtype=torch.float64)
    valid = torch.ones(4 * G, dtype=torch.bool)
    valid[[1, 3]] = False  # group 0: three valid
    valid[G:G + 4] = False  # group 1: one valid: no signal
    rewards[2 * G + 1] = rewards[2 * G + 3] = rewards[2 * G]  # group 2: the valid ones equal
    valid[[2 * G + 2, 2 * G + 4]] = False
    for scale in (True, False):
        adv = grpo.group_advantages(rewards, G, 1e-6, scale, valid)
        for b in range(4):
            idx = [b * G + j for j in range(G) if valid[b * G + j]]
            r = [rewards[i].item() for i in idx]
            for i in range(b * G, (b + 1) * G):
                if i not in idx or len(set(r)) < 2:
                    assert adv[i] == 0, (b, i)
                    continue
                want = rewards[i].item() - statistics.mean(r)
                if scale:
                    want /= statistics.stdev(r) + 1e-6
                assert abs(adv[i].item() - want) < 1e-12, (b, i)
    assert grpo.constant_groups(rewards, G, valid).tolist() == [False, True, True, False]
    # every sample valid: the same numbers as without a mask
    assert torch.equal(grpo.group_advantages(rewards, G, valid=torch.ones_like(valid)),
                       grpo.group_advantages(rewards, G))


def test_trained_samples_leave_out_the_dropped_and_with_mask_the_cut():
    dropped = [False, True, False, False, False, False, True, False]
    truncated = [False, False, True, False, False, False, False, True]
    assert grpo.trained_samples([0, 1], 4, dropped, truncated, False) == [0, 2, 3, 4, 5, 7]
    assert grpo.trained_samples([1], 4, dropped, truncated, True) == [4, 5]


def gradients(model, samples, adv):
    model.zero_grad()
    g = grpo.GRPOConfig(is_correction="tis")
    trainer.accumulate_gradients(model, reference.batch_of(samples, adv),
                                 reference.settings(g))
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_a_failed_sample_moves_no_parameter(world_of_one):
    """A group of 4 in which sample 1's call failed (scored 0) trains exactly as the group of
    the other 3 would alone; training on it with reward 0 (env.on_failure=zero) does not."""
    model = tiny_task.build_tiny_model(15, 1, 0, seed=3).double()
    gen = torch.Generator().manual_seed(1)
    samples = [Sample(torch.randint(2, 15, (3,), generator=gen).tolist(),
                      torch.randint(2, 15, (n,), generator=gen).tolist(), [0.0] * n, False)
               for n in (4, 7, 2, 5)]
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0], dtype=torch.float64)
    dropped = [False, True, False, False]
    valid = ~torch.tensor(dropped)
    adv = grpo.group_advantages(rewards, 4, valid=valid)
    mine = grpo.trained_samples([0], 4, dropped, [False] * 4, False)
    got = gradients(model, [samples[i] for i in mine], adv[mine])
    alone = [0, 2, 3]  # the group as if the failed sample had never been drawn
    want = gradients(model, [samples[i] for i in alone],
                     grpo.group_advantages(rewards[alone], 3))
    for name, grad in want.items():  # fp64; the two differ only in how the std was summed
        assert grad.abs().max() > 0, name
        assert torch.allclose(got[name], grad, rtol=1e-10, atol=1e-14), name
    zero = gradients(model, samples, grpo.group_advantages(rewards, 4))  # on_failure=zero
    assert any(not torch.allclose(zero[n], want[n]) for n in want)
