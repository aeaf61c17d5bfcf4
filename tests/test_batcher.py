"""The batch between scoring and the update (batcher.py): this rank's share of a scored rollout,
its advantages per token, the shuffle's seed, and the transforms in their order."""

import functools
import types

import pytest
import torch

import batcher
from collect import partial
import grpo
import reference
import rollout
from records import Sample


def sample(n: int, earlier=None, versions=None) -> Sample:
    return Sample([1, 2], list(range(3, 3 + n)), [-0.5] * n, False, versions=versions,
                  earlier=earlier)


def test_share_takes_this_ranks_slice_with_per_token_advantages():
    """Rank 1 of a tensor-parallel pair takes every second trained sample from the second; each
    gets its advantage at every response token (fp32, rounded as the host's float list is), an
    agent's earlier samples go before it with the episode's advantage at each of their own
    tokens, and the seed is the one given."""
    before = [sample(2), sample(5)]
    samples = [sample(3), sample(4, earlier=before), sample(1), sample(6), sample(2)]
    ro = types.SimpleNamespace(samples=samples)
    scored = types.SimpleNamespace(trained=[0, 1, 3, 4], adv=[0.1, -0.3, 9.0, 0.7, 1.5])
    group = types.SimpleNamespace(tp_rank=1, size=2)
    batch = batcher.share(ro, scored, group, step=7, seed=123)
    # trained[1::2] = samples 1 and 4; sample 1 brings its two earlier ones first
    assert batch.samples == [before[0], before[1], samples[1], samples[4]]
    want = [-0.3, -0.3, -0.3, 1.5]
    assert [len(a) for a in batch.adv] == [2, 5, 4, 2]
    for a, value in zip(batch.adv, want):
        assert a.dtype == torch.float32
        assert torch.equal(a, torch.full_like(a, torch.tensor(value).item()))
    assert (batch.seed, batch.step, batch.teacher, batch.split) == (123, 7, None, None)


def test_the_batcher_applies_its_transforms_in_order_with_the_ranks_seed():
    seen = []

    def mark(name, batch):
        seen.append(name)
        return batcher.Batch(batch.samples[1:], batch.adv[1:], batch.seed, batch.step,
                          metrics={**batch.metrics, name: len(seen)})

    ro = types.SimpleNamespace(samples=[sample(1), sample(2), sample(3)])
    scored = types.SimpleNamespace(trained=[0, 1, 2], adv=[1.0, 2.0, 3.0])
    group = types.SimpleNamespace(tp_rank=0, size=1)
    made = batcher.Batcher(group, seed=5, rank=3,
                           transforms=[functools.partial(mark, "a"), functools.partial(mark, "b")])
    batch = made.build(ro, scored, step=2)
    assert seen == ["a", "b"] and batch.metrics == {"a": 1, "b": 2}
    assert batch.samples == ro.samples[2:] and float(batch.adv[0][0]) == 3.0
    assert batch.seed == rollout.seed_from(5, 2, 3) != rollout.seed_from(5, 2, 2)


def test_stale_tokens_mask_what_older_weights_wrote():
    """partial.stale_tokens at step 3 (the engine held version 2): a token of version 1 gets mask
    0, one of version 2 keeps its own mask; samples without versions stay as they are."""
    old = sample(4, versions=[1, 1, 2, 2])
    old.mask = [1, 0, 1, 0]
    fresh = sample(2)
    batch = batcher.Batch([old, fresh], [torch.ones(4), torch.ones(2)], 0, step=3)
    out = partial.stale_tokens(batch, "mask")
    assert out.samples[0].mask == [0, 0, 1, 0] and out.samples[1] is fresh
    assert old.mask == [1, 0, 1, 0]  # a new batch, the rollout's samples untouched
    assert partial.stale_tokens(batch, "keep").samples == batch.samples


def test_a_batch_slice_keeps_what_its_samples_carry():
    teacher = batcher.TeacherTopK([torch.zeros(1, 2), torch.ones(2, 2)], [torch.zeros(1, 2),
                                                                      torch.ones(2, 2)], 0.5)
    per = [[torch.full((n,), float(10 * k + n)) for n in (1, 2)] for k in range(4)]
    batch = batcher.Batch([sample(1), sample(2)], [torch.zeros(1), torch.ones(2)], 9,
                          teacher=teacher, old_logp=per[0], entropy=per[1], forking=per[2],
                          ref_logp=per[3])
    part = batch.of([1])
    assert part.samples == batch.samples[1:] and torch.equal(part.adv[0], torch.ones(2))
    assert torch.equal(part.teacher.ids[0], torch.ones(2, 2)) and part.teacher.coef == 0.5
    for k, name in enumerate(("old_logp", "entropy", "forking", "ref_logp")):
        assert len(getattr(part, name)) == 1 and getattr(part, name)[0] is per[k][1], name
    assert part.seed == 9 and batch.sp == 1
    stand_in = batch.stand_in()  # a rank's empty micro-batch: zero logprobs where they ride
    assert [len(stand_in.old_logp[0]), len(stand_in.ref_logp[0])] == [1, 1]
    assert stand_in.forking is None and stand_in.teacher is None
    assert batcher.Batch([], [], 0).stand_in().old_logp is None


@pytest.mark.parametrize("epochs,minis,rho,kl,want", [
    (1, 1, 1.0, 0.0, []),  # on-policy, no forking, no KL: the update's forward is all
    (1, 2, 1.0, 0.0, ["old_policy"]),
    (1, 1, 0.3, 0.0, ["old_policy", "forking"]),  # on-policy: the pass for the entropies only
    (2, 1, 0.3, 0.1, ["old_policy", "reference"]),  # off-policy: forking at each step
])
def test_the_passes_without_gradient_are_batch_transforms(epochs, minis, rho, kl, want):
    """train_grpo.batch_transforms lists the passes the update's config needs, in order, after
    the features' own: the old policy (its logprobs kept off-policy only, the entropies with
    forking), the forking tokens, the reference."""
    import train_grpo

    g = grpo.GRPOConfig(ppo_epochs=epochs, mini_batches=minis, top_entropy_quantile=rho,
                        kl_coef=kl)
    run = types.SimpleNamespace(applied=train_grpo.Config(grpo=g), split=None, teacher=None,
                                actor="actor", ref="ref" if kl else None,
                                settings=reference.settings(g))
    found = train_grpo.batch_transforms(run)
    assert [t.func.__name__ for t in found] == want
    if want:
        old = found[0].keywords
        assert (old["keep_logp"], old["entropy"]) == (epochs * minis > 1, rho < 1)
