"""Partial rollout (partial.py) with a scripted engine whose every number can be worked out by
hand: which tokens each step writes, which weights version wrote them, what is carried, what is
trained, how stale it is; a step cut by an error and run again; dynamic sampling; a multi-turn
episode cut mid-turn and between turns. The real engine: test_partial_engine.py."""

import copy
import types

import pytest

from collect import partial
import episodes
import grpo
import records
from test_packing import model_for, world_of_one  # noqa: F401 (fixture)
from train_grpo import load_config

EOS, TAG = 0, 10  # sample j of a group writes TAG + j until its last token, EOS


class CharTokenizer:
    """One id per character (its code), EOS 0: what episodes.py asks of a tokenizer."""

    def __call__(self, text, add_special_tokens=False, split_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i != EOS or not skip_special_tokens)


class LengthEngine:
    """rollout.Engine.stream as vLLM drives it: every running request writes one token per
    engine step; as each ends, stop(i, how) is asked, and once it says True the requests still
    running are aborted after that step, keeping what they wrote. A prompt is one token (100 +
    the example's index) and what the sample wrote so far; the j-th fresh request of a prompt is
    its sample j, whose turn t is lengths[prompt][j][t - 1] tokens long (its last one EOS)."""

    def __init__(self, lengths: dict):
        self.lengths, self.fresh, self.prompts = lengths, {}, []

    def stream(self, prompts, max_tokens, seed=None, greedy=False, stop=None):
        self.prompts.append([list(p) for p in prompts])
        reqs = []
        for p, ask in zip(prompts, max_tokens):
            written = p[1:]
            if written:
                j = written[0] - TAG
            else:
                j = self.fresh[p[0]] = self.fresh.get(p[0], -1) + 1
            turn = written.count(EOS) + 1
            tail = 0  # the current turn's tokens so far: the tags after the last other token
            while tail < len(written) and TAG <= written[-1 - tail] < 100:
                tail += 1
            left = self.lengths[p[0]][j][turn - 1] - tail
            reqs.append({"j": j, "left": left, "ask": ask, "out": [], "how": None})
        running, stopping = list(range(len(reqs))), False
        while running and not stopping:
            for i in list(running):
                r = reqs[i]
                r["left"] -= 1
                r["out"].append(EOS if r["left"] == 0 else TAG + r["j"])
                if r["left"] == 0 or len(r["out"]) == r["ask"]:
                    r["how"] = "stop" if r["left"] == 0 else "length"
                    running.remove(i)
                    stopping = (stop is not None and stop(i, r["how"])) or stopping
        return [(r["out"], [-0.5] * len(r["out"]), r["how"]) for r in reqs]


def example(k: int) -> dict:
    return {"prompt": f"q{k}", "prompt_ids": [100 + k], "answer": "7"}


class scorer:
    """A stand-in of rewards.Scorer for PartialRollout: a group's rewards are 1, 0, 1, ..., all
    equal for the examples in `constant` (with dynamic sampling grpo.judge drops such a group).
    `seen`: the groups it scored; `before(examples)`: called first."""

    def __init__(self, group_size: int, constant=(), before=None):
        self.group_size, self.constant, self.before, self.seen = group_size, constant, before, []

    def score(self, texts, examples, failed=()):
        if self.before is not None:
            self.before(examples)
        n = len(texts)
        self.seen.append([examples[i]["prompt"] for i in range(0, n, self.group_size)])
        total = [1.0 if examples[i]["prompt"] in self.constant else float(i % 2 == 0)
                 for i in range(n)]
        return records.Rewards(total, {"r": total}, [False] * n)


ONE_ENGINE = types.SimpleNamespace(index=0, count=1, first=True, per_engine=lambda n: [n])


def carry(tmp_path, engine, score, *overrides, env: str = "", group_size: int = 2,
          share: int = 1):
    cfg = load_config(None, [f"--grpo.group_size={group_size}",
                             f"--grpo.prompts_per_step={share}",
                             "--rollout.partial.enabled=true", *overrides])
    runner = episodes.EpisodeRunner(episodes.EnvConfig(name=env, timeout_s=0, max_tokens=32),
                                    CharTokenizer(), False, "prompt", 16)
    examples = [example(k) for k in range(8)]
    source = partial.Streams(cfg, ONE_ENGINE, engine, runner)
    return partial.PartialRollout(cfg, ONE_ENGINE, examples, source, score,
                                  grpo.Scoring(cfg.grpo, 16)), runner


def step(c, version):
    """Step version + 1 (its weights: `version` steps trained): the rollout, the samples kept,
    and the partial-rollout metrics over them."""
    ro = c.collect(version + 1)
    trained = [ro.samples[i] for i in range(len(ro.samples))
               if ro.keep[i // c.group_size]]
    m = {k: getattr(v, "value", v) for k, v in c.metrics(trained, version).items()}
    for k in ("stale_mean", "stale_token_frac"):
        m[k] = m[k].total / m[k].count if m[k].count else 0.0
    return ro, trained, m


# A: lengths 2 and 9, B: 3 and 4, C: 1 and 1, D: 5 and 6, E: 2 and 2 (one turn each)
LENGTHS = {100: [[2], [9]], 101: [[3], [4]], 102: [[1], [1]], 103: [[5], [6]],
           104: [[2], [2]]}


def test_carried_samples_and_their_staleness_over_three_steps(tmp_path):
    """Over-sampling 2 groups in flight for a share of 1. Step 1 (weights version 0): B ends
    after 4 engine steps, A2 is cut at 4 of its 9 tokens. Step 2 (version 1): C ends at once,
    A2 writes 1 more. Step 3 (version 2): A2 writes its last 4 and A is trained: each of its
    samples 2 versions old, 7 of its 11 tokens stale; D is carried with 4 tokens each."""
    engine, score = LengthEngine(LENGTHS), scorer(2)
    c, eps = carry(tmp_path, engine, score, "--rollout.partial.oversample=2")
    ro, trained, m = step(c, 0)
    assert [s.response_ids for s in trained] == [[TAG, TAG, EOS], [TAG + 1] * 3 + [EOS]]
    assert (m["gen_tokens"], m["partial_carried"], m["partial_carried_tokens"]) == (13, 2, 6)
    assert (m["stale_mean"], m["stale_max"], m["stale_token_frac"]) == (0, 0, 0)
    ro, trained, m = step(c, 1)
    assert [s.prompt_ids for s in trained] == [[102], [102]]
    assert (m["gen_tokens"], m["partial_carried_tokens"]) == (3, 7)
    # A2 resumed as its prompt and what it wrote so far, with the room it has left
    assert [100] + [TAG + 1] * 4 in engine.prompts[1]
    ro, trained, m = step(c, 2)
    assert [s.prompt_ids for s in trained] == [[100], [100]]
    a2 = trained[1]
    assert a2.response_ids == [TAG + 1] * 8 + [EOS] and len(a2.logp) == 9
    assert a2.versions == [0, 0, 0, 0, 1, 2, 2, 2, 2] and trained[0].versions == [0, 0]
    assert (m["stale_mean"], m["stale_max"]) == (2, 2)
    assert m["stale_token_frac"] == pytest.approx(7 / 11, abs=0)  # 2 of A1, 5 of A2
    assert (m["gen_tokens"], m["partial_carried"], m["partial_carried_tokens"]) == (12, 2, 8)
    assert m["partial_dropped"] == 0
    # stale: mask: the tokens older weights wrote get no loss (mask 0), the rest keep theirs
    masked = partial.for_update(trained, 2, "mask")
    assert masked[0].mask == [0, 0] and masked[1].mask == [0] * 5 + [1] * 4
    assert partial.for_update(trained, 2, "keep") is trained


def test_a_group_older_than_max_staleness_is_dropped_whole(tmp_path):
    """As above with max_staleness 1: at step 3, A (its oldest token from version 0) is 2
    versions old and leaves whole, counted; E (2 tokens each) is trained instead, and D goes on
    with the 2 tokens each it wrote meanwhile."""
    engine, score = LengthEngine(LENGTHS), scorer(2)
    c, eps = carry(tmp_path, engine, score, "--rollout.partial.oversample=2",
                   "--rollout.partial.max_staleness=1")
    step(c, 0)
    step(c, 1)
    ro, trained, m = step(c, 2)
    assert m["partial_dropped"] == 2 and [s.prompt_ids for s in trained] == [[104], [104]]
    assert (m["partial_carried"], m["partial_carried_tokens"]) == (2, 4)


def test_a_round_budget_moves_every_carried_sample_on_each_step(tmp_path):
    """round_tokens 2: rounds of at most 2 tokens a sample, the step ending at the first round's
    end with its share complete. Step 1: B completes in round 2, A2 has written 4. Step 2: C
    completes in round 1, and A2 wrote its 2 meanwhile (over-sampling alone gave it 1). Step 3:
    A2's last 3 in two rounds; D carried with 4 tokens each."""
    engine, score = LengthEngine(LENGTHS), scorer(2)
    c, eps = carry(tmp_path, engine, score, "--rollout.partial.oversample=2",
                   "--rollout.partial.round_tokens=2")
    _, trained, m = step(c, 0)
    assert [s.prompt_ids for s in trained] == [[101], [101]] and m["gen_tokens"] == 13
    _, trained, m = step(c, 1)
    assert [s.prompt_ids for s in trained] == [[102], [102]] and m["gen_tokens"] == 4
    _, trained, m = step(c, 2)
    assert trained[1].versions == [0, 0, 0, 0, 1, 1, 2, 2, 2]
    assert (m["gen_tokens"], m["partial_carried_tokens"], m["stale_max"]) == (11, 8, 2)


def test_a_step_cut_by_an_error_runs_again_from_where_the_last_one_left(tmp_path):
    """Ctrl-C in a reward of step 2, caught (a notebook): step 2 run again carries, trains and
    counts exactly what it would have without the error."""
    def run(interrupt: bool):
        engine, fired = LengthEngine(LENGTHS), []

        def flaky(examples):
            if interrupt and not fired and examples[0]["prompt"] == "q2":
                fired.append(1)
                raise KeyboardInterrupt
        c, eps = carry(tmp_path, engine, scorer(2, before=flaky),
                       "--rollout.partial.oversample=2")
        out = [step(c, 0)]
        if interrupt:
            with pytest.raises(KeyboardInterrupt):
                step(c, 1)
            engine.fresh = copy.deepcopy(fresh_after_step_1)  # the engine forgets, as vLLM's
        out += [step(c, v) for v in (1, 2)]
        return [([s.response_ids for s in t], [s.versions for s in t], m) for _, t, m in out]

    fresh_after_step_1 = {100: 1, 101: 1}  # the scripted engine's count of fresh requests
    assert run(True) == run(False)


def test_dynamic_sampling_replaces_a_constant_group(tmp_path):
    """With dynamic sampling, C completes in step 2 with all rewards equal: it does not count
    towards the share, and the step goes on until A completes (4 more engine steps), which is
    trained; both are scored, C marked not kept."""
    engine, score = LengthEngine(LENGTHS), scorer(2, constant={"q2"})
    c, eps = carry(tmp_path, engine, score, "--rollout.partial.oversample=2",
                   "--grpo.dynamic_sampling=true", "--grpo.max_gen_rounds=2")
    step(c, 0)
    ro, trained, m = step(c, 1)
    assert score.seen[1:] == [["q2"], ["q0"]] and ro.keep == [False, True]
    assert [s.prompt_ids for s in trained] == [[100], [100]]
    assert trained[1].versions == [0] * 4 + [1] * 5  # A2: 4 from step 1, 5 from step 2


ENV = """
CALLS = []

def again(messages, example):
    CALLS.append((example["prompt"], sum(m["role"] == "assistant" for m in messages)))
    return "ok" if CALLS[-1][1] == 1 else None  # a second try, then over
"""


def test_a_multi_turn_episode_continues_mid_turn_and_between_turns(tmp_path):
    """Two model turns per episode, the environment answering "ok" after the first. Step 1:
    B (turns of 2 and 1 tokens) ends in its second round; A1's first turn ends in the same
    engine step, so A1 is carried between its turns, and A2 in the middle of its first (3 of
    5 tokens). Step 2 (version 1): both finish. Each sample holds its turns and the reply in
    order, the reply masked; the environment answered every finished turn once."""
    (tmp_path / "env.py").write_text(ENV)
    lengths = {100: [[3, 3], [5, 2]], 101: [[2, 1], [2, 1]], 102: [[9, 9], [9, 9]]}
    engine, score = LengthEngine(lengths), scorer(2)
    c, eps = carry(tmp_path, engine, score, "--rollout.partial.oversample=2",
                   env=f"{tmp_path}/env.py:again")
    _, trained, _ = step(c, 0)
    assert [s.prompt_ids for s in trained] == [[101], [101]]
    a1, a2 = c.groups[0]
    assert (a1.turns, a1.pending, a2.turns, a2.pending[0]) == (1, ([], [], []), 0, [TAG + 1] * 3)
    _, trained, m = step(c, 1)
    ok = [ord("o"), ord("k")]
    assert trained[0].response_ids == [TAG, TAG, EOS] + ok + [TAG, TAG, EOS]
    assert trained[0].mask == [1, 1, 1, 0, 0, 1, 1, 1]
    assert trained[0].versions[:3] + trained[0].versions[5:] == [0, 0, 0, 1, 1, 1]
    assert trained[1].response_ids == [TAG + 1] * 4 + [EOS] + ok + [TAG + 1, EOS]
    assert trained[1].versions[:5] + trained[1].versions[7:] == [0, 0, 0, 1, 1, 1, 1]
    assert (m["stale_mean"], m["stale_token_frac"]) == (1, pytest.approx(6 / 13, abs=0))
    calls = eps.worker.fns[0].__globals__["CALLS"]
    assert sorted(calls) == sorted([("q1", 1), ("q1", 1), ("q1", 2), ("q1", 2), ("q0", 1),
                                    ("q0", 2), ("q0", 1), ("q0", 2)])


def test_stale_mask_gives_the_older_weights_tokens_no_gradient(world_of_one):
    """With stale: mask, the update's parameter gradients (a packed micro-batch) equal a naive
    loop's over the tokens this step's weights wrote only, one sample at a time: each token's
    -adv x ratio x min(ratio to the engine, 2), averaged over those tokens; with stale: keep
    the older tokens move the parameters too. The model is fp64, the logprobs fp32 in both
    (tests/reference.py, logprobs.py): the two sum the same fp32 terms in other orders, so
    they agree to a few fp32 roundings of the gradient's scale, 1e-6 of the largest entry."""
    import torch

    import grpo
    import reference
    import trainer
    from records import Sample

    model = model_for("qwen2").double()  # packed rows attend within each sample
    gen = torch.Generator().manual_seed(2)
    samples = []
    for n, fresh_from in ((6, 4), (5, 0), (4, 4)):  # the last: all its tokens stale
        ids = torch.randint(2, 15, (n,), generator=gen).tolist()
        engine = (-torch.rand(n, generator=gen, dtype=torch.float64)).tolist()
        samples.append(Sample(torch.randint(2, 15, (3,), generator=gen).tolist(), ids, engine,
                              False, None, [1] * fresh_from + [2] * (n - fresh_from)))
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)
    g = grpo.GRPOConfig(is_correction="tis", is_cap=2.0)

    def update(view):
        model.zero_grad()
        trainer.accumulate_gradients(model, reference.batch_of(view, adv),
                                     reference.settings(g))
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    got = update(partial.for_update(samples, 2, "mask"))
    model.zero_grad()
    fresh = sum(v == 2 for s in samples for v in s.versions)
    for s, a in zip(samples, adv):
        t = torch.tensor([s.prompt_ids + s.response_ids])
        logp = reference.token_logprobs(model(input_ids=t).logits[:, :-1], t[:, 1:])[0, 2:]
        w = (logp.detach() - torch.tensor(s.logp, dtype=torch.float64)).exp().clamp(max=2.0)
        ratio = (logp - logp.detach()).exp()
        keep = torch.tensor([v == 2 for v in s.versions], dtype=torch.float64)
        (-(a * ratio * w * keep).sum() / fresh).backward()
    scale = max(p.grad.abs().max().item() for p in model.parameters())
    for name, p in model.named_parameters():
        assert p.grad.abs().max() > 0, name
        assert (got[name] - p.grad).abs().max() <= 1e-6 * scale, name
    kept = update(partial.for_update(samples, 2, "keep"))
    assert any(not torch.allclose(kept[n], got[n]) for n in got)
