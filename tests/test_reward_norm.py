"""How rewards become advantages beyond the group's own statistics: grpo.adv_std=batch (Lite
PPO's batch std), grpo.adv_mean=batch (REINFORCE++: the batch's mean too) and
grpo.reward_agg=gdpo (GDPO's per-function normalisation), against naive per-sample loops in
Python floats, hand-computed cases, and the batch taken over two engine groups through a real
all-reduce (tests/workers/batch_norm.py on 2 gloo ranks).

These options change the advantages only: the update gets them as numbers, so the fused pass
sees nothing new (its equality with the unfused computation for any advantages is in
test_fused_logprobs.py).

Tolerance: the loops and grpo.advantages compute the same fp64 expressions in other orders, over
at most 40 rewards of size <= 3 divided by stds >= 0.1: differences of a few units of 2^-52 of
values below 100, far under 1e-12."""

import json
import math
import random
import types

import pytest
import torch

import grpo
from conftest import launch
from grpo import GRPOConfig
from records import Sample

TOL = 1e-12


def mean(xs):
    return sum(xs) / len(xs)


def stdev(xs):  # unbiased
    m = mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def naive_batch(engines, G, eps):
    """Lite PPO: r - its group's mean (over valid samples) / (the std of every valid reward of
    every engine group + eps); 0 for invalid samples and for groups with < 2 valid samples or
    all valid rewards equal. engines: [(rewards, valid)], one per engine group."""
    sd = stdev([r for rewards, valid in engines for r, v in zip(rewards, valid) if v])
    out = []
    for rewards, valid in engines:
        adv = [0.0] * len(rewards)
        for b in range(0, len(rewards), G):
            idx = [i for i in range(b, b + G) if valid[i]]
            vals = [rewards[i] for i in idx]
            if len(vals) >= 2 and len(set(vals)) > 1:
                for i in idx:
                    adv[i] = (rewards[i] - mean(vals)) / (sd + eps)
        out.append(adv)
    return out


def naive_reinforce_pp(engines, eps, scale=True):
    """REINFORCE++: r - the mean of every valid reward of every engine group, over their std +
    eps (or not divided); 0 for invalid samples only: a group whose rewards are all equal keeps
    its r - mean. engines: [(rewards, valid)], one per engine group."""
    pooled = [r for rewards, valid in engines for r, v in zip(rewards, valid) if v]
    m, sd = mean(pooled), stdev(pooled)
    return [[((r - m) / (sd + eps) if scale else r - m) if v else 0.0
             for r, v in zip(rewards, valid)] for rewards, valid in engines]


def naive_gdpo(engines, weights, G, eps):
    """GDPO (arXiv 2601.05242): each function's value - its group's mean, over its group's std +
    eps (0 where that function is constant in the group), weighted and summed; then that sum -
    its mean over every valid sample of every engine group, over their std + eps. A group where
    every function is constant, and an invalid sample, get 0. engines: [(by_name, valid)]."""
    sums, signal = [], []
    for by_name, valid in engines:
        x, has = [0.0] * len(valid), [False] * len(valid)
        for b in range(0, len(valid), G):
            idx = [i for i in range(b, b + G) if valid[i]]
            for w, values in zip(weights, by_name):
                vals = [values[i] for i in idx]
                if len(vals) >= 2 and len(set(vals)) > 1:
                    for i in idx:
                        x[i] += w * (values[i] - mean(vals)) / (stdev(vals) + eps)
                        has[i] = True
        sums.append(x)
        signal.append(has)
    pooled = [x for xs, (_, valid) in zip(sums, engines) for x, v in zip(xs, valid) if v]
    m, sd = mean(pooled), stdev(pooled)
    return [[(x - m) / (sd + eps) if has else 0.0 for x, has in zip(xs, hs)]
            for xs, hs in zip(sums, signal)]


def make_case(seed, groups, G=4, funcs=2):
    """Random rewards on a coarse grid (0, 0.5, 1), some samples invalid, some groups constant."""
    rng = random.Random(seed)
    by_name = [[rng.choice([0.0, 0.5, 1.0]) for _ in range(groups * G)] for _ in range(funcs)]
    for values in by_name:  # one group constant in every function
        values[:G] = [1.0] * G
    for i in range(G, 2 * G):  # one group where each function varies, their plain sum does not
        by_name[0][i], by_name[1][i] = (1.0, 0.0) if i % 2 else (0.0, 1.0)
    valid = [rng.random() > 0.15 or G <= i < 2 * G for i in range(groups * G)]
    return by_name, valid


WEIGHTS = [1.0, 1.0]


def columns(by_name, weights, agg):
    funcs = torch.tensor(by_name, dtype=torch.float64).T
    if agg == "gdpo":
        return funcs
    return (funcs * torch.tensor(weights, dtype=torch.float64)).sum(1, keepdim=True)


def total(by_name, weights):
    return [sum(w * v[i] for w, v in zip(weights, by_name)) for i in range(len(by_name[0]))]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batch_std_equals_the_naive_loop(seed):
    by_name, valid = make_case(seed, groups=5)
    cfg = GRPOConfig(group_size=4, adv_std="batch")
    adv, std = grpo.advantages(columns(by_name, WEIGHTS, "sum"), WEIGHTS, torch.tensor(valid), cfg)
    r = total(by_name, WEIGHTS)
    want = naive_batch([(r, valid)], 4, cfg.adv_eps)[0]
    assert max(abs(a - b) for a, b in zip(adv.tolist(), want)) < TOL
    assert abs(std - stdev([x for x, v in zip(r, valid) if v])) < TOL


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("scale", [True, False])
def test_batch_mean_equals_the_naive_loop(seed, scale):
    """grpo.adv_mean=batch: the group of four 2.0s (make_case's constant group) gets a signal,
    of the sign of 2 - the batch's mean."""
    by_name, valid = make_case(seed, groups=5)
    cfg = GRPOConfig(group_size=4, adv_mean="batch", adv_std="batch", scale_adv_by_std=scale)
    adv, std = grpo.advantages(columns(by_name, WEIGHTS, "sum"), WEIGHTS, torch.tensor(valid), cfg)
    r = total(by_name, WEIGHTS)
    want = naive_reinforce_pp([(r, valid)], cfg.adv_eps, scale)[0]
    assert max(abs(a - b) for a, b in zip(adv.tolist(), want)) < TOL
    first = [a for a, v in zip(adv[:4].tolist(), valid) if v]
    assert first and min(first) > 0  # 2.0 is the largest reward
    assert (std is None) == (not scale)


def test_batch_mean_hand_computed():
    """G = 2, eps 0, rewards 1, 0 | 0, 0: the batch's mean is 0.25, the squared deviations
    0.5625 + 3 x 0.0625 = 0.75, the unbiased std sqrt(0.75 / 3) = 0.5; advantages 0.75 / 0.5
    and -0.25 / 0.5: the all-wrong group gets -0.5 each where GRPO gives it 0. Undivided
    (scale_adv_by_std=false), r - 0.25. Rewards all 0.1 (whose float sum is not exactly 0.4):
    every advantage exactly 0."""
    valid = torch.ones(4, dtype=torch.bool)
    r = torch.tensor([[1.0], [0.0], [0.0], [0.0]], dtype=torch.float64)
    cfg = GRPOConfig(group_size=2, adv_eps=0.0, adv_mean="batch", adv_std="batch")
    adv, std = grpo.advantages(r, [1.0], valid, cfg)
    assert adv.tolist() == [1.5, -0.5, -0.5, -0.5] and std == 0.5
    cfg = GRPOConfig(group_size=2, adv_mean="batch", scale_adv_by_std=False)
    assert grpo.advantages(r, [1.0], valid, cfg)[0].tolist() == [0.75, -0.25, -0.25, -0.25]
    cfg = GRPOConfig(group_size=2, adv_eps=0.0, adv_mean="batch", adv_std="batch")
    adv, _ = grpo.advantages(torch.full((4, 1), 0.1, dtype=torch.float64), [1.0], valid, cfg)
    assert adv.tolist() == [0.0] * 4


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("weights", [[1.0, 1.0], [2.0, 0.5]])
def test_gdpo_equals_the_naive_loop(seed, weights):
    by_name, valid = make_case(seed, groups=5)
    cfg = GRPOConfig(group_size=4, reward_agg="gdpo")
    adv, std = grpo.advantages(columns(by_name, weights, "gdpo"), weights, torch.tensor(valid), cfg)
    want = naive_gdpo([(by_name, valid)], weights, 4, cfg.adv_eps)[0]
    assert max(abs(a - b) for a, b in zip(adv.tolist(), want)) < TOL
    assert std > 0
    if weights[0] == weights[1]:  # the group of 1 + 0 and 0 + 1: its functions' advantages
        #   cancel, and the batch's mean (0 up to rounding: each group's sums add up to 0) is left
        assert adv[4:8].abs().max() < TOL


def test_hand_computed():
    """G = 2, eps 0. Rewards 1, 0 | 1, 1: the batch's mean is 0.75, its squared deviations sum to
    0.75, the unbiased std is sqrt(0.75 / 3) = 0.5; the first group's r - mean is +-0.5, so
    +-1 (the group std, sqrt(0.5), would give +-0.707); the constant group gets 0.
    GDPO, weights 2 and 1: f1 = 1, 0 | 1, 1 and f2 = 0, 1 | 1, 0. In its group, f1 of the first
    is +-0.5 / sqrt(0.5) = +-1/sqrt(2) and f2 -+1/sqrt(2): sums 2/sqrt(2) - 1/sqrt(2) =
    +-1/sqrt(2); the second group's f1 is constant (0), f2 gives +-1/sqrt(2). The four sums
    a, -a, a, -a (a = 1/sqrt(2)) have mean 0 and unbiased std sqrt(4 a^2 / 3) = sqrt(2/3):
    each advantage is +-a / sqrt(2/3) = +-sqrt(3)/2."""
    valid = torch.ones(4, dtype=torch.bool)
    cfg = GRPOConfig(group_size=2, adv_eps=0.0, adv_std="batch")
    adv, std = grpo.advantages(torch.tensor([[1.0], [0.0], [1.0], [1.0]], dtype=torch.float64),
                               [1.0], valid, cfg)
    assert adv.tolist() == [1.0, -1.0, 0.0, 0.0] and std == 0.5
    funcs = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    cfg = GRPOConfig(group_size=2, adv_eps=0.0, reward_agg="gdpo")
    adv, _ = grpo.advantages(funcs, [2.0, 1.0], valid, cfg)
    h = math.sqrt(3) / 2
    assert torch.allclose(adv, torch.tensor([h, -h, h, -h], dtype=torch.float64), rtol=0,
                          atol=TOL)


def test_defaults_unchanged():
    """grpo.advantages with the defaults is group_advantages, bit for bit."""
    by_name, valid = make_case(0, groups=5)
    r = torch.tensor(total(by_name, WEIGHTS), dtype=torch.float64)
    for scale in (True, False):
        cfg = GRPOConfig(group_size=4, scale_adv_by_std=scale)
        adv, std = grpo.advantages(r.unsqueeze(1), WEIGHTS, torch.tensor(valid), cfg)
        assert std is None
        assert torch.equal(adv, grpo.group_advantages(r, 4, cfg.adv_eps, scale,
                                                      torch.tensor(valid)))


def test_dynamic_sampling_keeps_what_gdpo_can_learn_from():
    """A group whose weighted sum is constant while its functions are not: dynamic sampling
    drops it under reward_agg=sum, keeps it under gdpo; a group constant in every function is
    dropped by both."""
    by_name = {"a": [1.0, 0.0, 1.0, 1.0], "b": [0.0, 1.0, 1.0, 1.0]}
    total = [1.0, 1.0, 2.0, 2.0]
    for agg, want in (("sum", [False, False]), ("gdpo", [True, False])):
        cfg = GRPOConfig(group_size=2, dynamic_sampling=True, reward_agg=agg)
        generated = types.SimpleNamespace(failed=[False] * 4,
                                          samples=[Sample([1], [2, 3, 4], [0.0] * 3, False)] * 4)
        rewards = types.SimpleNamespace(total=total, by_name=by_name, failed=[False] * 4)
        assert grpo.judge(generated, rewards, grpo.Scoring(cfg, 8)) == ([False] * 4, want)


@pytest.mark.parametrize("overrides, says", [
    (dict(adv_std="batch", scale_adv_by_std=False), "grpo.adv_std=batch with grpo.scale_adv"),
    (dict(reward_agg="gdpo", adv_std="batch"), "it ignores grpo.adv_mean"),
    (dict(reward_agg="gdpo", scale_adv_by_std=False), "it ignores grpo.adv_mean"),
    (dict(reward_agg="gdpo", overlong="penalty", overlong_buffer=2), "grpo.overlong=penalty"),
    (dict(adv_mean="batch"), "grpo.adv_mean=batch with grpo.adv_std=group"),
    (dict(adv_mean="batch", adv_std="batch", dynamic_sampling=True), "drops the groups"),
    (dict(reward_agg="gdpo", adv_mean="batch", scale_adv_by_std=False), "ignores grpo.adv_mean"),
])
def test_refused(overrides, says):
    with pytest.raises(ValueError, match=says):
        grpo.validate(GRPOConfig(**overrides))


def test_over_two_engine_groups(tmp_path):
    """The batch is every engine group's samples: 2 gloo ranks as 2 engine groups (tp 1) with
    different rewards each equal the naive loop over both; as 1 engine group of 2 ranks (tp 2),
    its rewards count once (both ranks equal the naive loop over engine group 0 alone)."""
    cases = [make_case(seed, groups=groups) for seed, groups in ((3, 4), (4, 6))]
    path = tmp_path / "case.json"
    path.write_text(json.dumps({"G": 4, "weights": [2.0, 0.5], "engines": [
        {"by_name": b, "valid": v} for b, v in cases]}))
    launch(["tests/workers/batch_norm.py", str(path), str(tmp_path)])
    got = {(rank, int(key[0]), key[2:]): adv for rank in (0, 1)
           for key, adv in json.loads((tmp_path / f"adv_{rank}.json").read_text()).items()}
    eps = GRPOConfig().adv_eps
    both = [(total(b, [2.0, 0.5]), v) for b, v in cases]
    want = {"batch": naive_batch(both, 4, eps), "gdpo": naive_gdpo(cases, [2.0, 0.5], 4, eps),
            "mean": naive_reinforce_pp(both, eps)}
    alone = {"batch": naive_batch(both[:1], 4, eps), "mean": naive_reinforce_pp(both[:1], eps),
             "gdpo": naive_gdpo(cases[:1], [2.0, 0.5], 4, eps)}
    assert len(got) == 12
    for mode in ("batch", "gdpo", "mean"):
        for rank in (0, 1):
            for tp, expect in ((1, want[mode][rank]), (2, alone[mode][0])):
                adv = got[(rank, tp, mode)]
                assert len(adv) == len(expect)
                assert max(abs(a - b) for a, b in zip(adv, expect)) < TOL, (rank, tp, mode)
