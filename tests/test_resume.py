"""A crashed run resumed from its checkpoint continues exactly like an uninterrupted run."""

import json

import torch
from safetensors.torch import load_file

from conftest import launch


def rows(path):
    return [json.loads(line) for line in open(path)]


def test_resume_matches_uninterrupted_run(tiny_task_dir, tmp_path):
    common = ["train_grpo.py", "--config", "configs/tiny_cpu.yaml",
              f"--data.tiny_task_dir={tiny_task_dir}", "--log.eval_every=0",
              "--grpo.prompts_per_step=16", "--rollout.seed_per_step=true", "--log.save_every=3"]
    a, b = tmp_path / "a", tmp_path / "b"
    launch(common + ["--train.steps=6", f"--log.out_dir={a}"])
    # the "crash": a run that stopped after step 5, its newest checkpoint at step 3
    launch(common + ["--train.steps=5", f"--log.out_dir={b}"])
    assert [r["step"] for r in rows(b / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    out = launch(common + ["--train.steps=6", "--train.resume=true", f"--log.out_dir={b}"])
    assert "continuing after step 3" in out

    ra, rb = rows(a / "metrics.jsonl"), rows(b / "metrics.jsonl")
    assert [r["step"] for r in rb] == list(range(1, 7))  # steps 4-5 of the crash were replaced
    for x, y in zip(ra, rb):
        assert x["reward_mean"] == y["reward_mean"] and x["response_len_mean"] == y["response_len_mean"]
        assert abs(x["grad_norm"] - y["grad_norm"]) <= 1e-6 * x["grad_norm"], (x["step"], x, y)
    wa, wb = load_file(a / "final" / "model.safetensors"), load_file(b / "final" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.allclose(wa[name], wb[name], atol=1e-6, rtol=0), name
