"""A crashed run resumed from its checkpoint continues exactly like an uninterrupted run."""

import json
import os
import signal
import time

import pytest
import torch
from safetensors.torch import load_file

import checkpoint
from conftest import FORKS, base_env, crashed_copy, launch


def rows(path):
    return [json.loads(line) for line in open(path)]


@pytest.mark.engine
def test_resume_matches_uninterrupted_run(tiny_task_dir, tmp_path):
    common = ["train_grpo.py", "--config", "configs/tiny_cpu.yaml",
              f"--data.tiny_task_dir={tiny_task_dir}", "--log.eval_every=0",
              "--grpo.prompts_per_step=16", "--rollout.seed_per_step=true", "--log.save_every=3"]
    a, b = tmp_path / "a", tmp_path / "b"
    launch(common + ["--train.steps=6", f"--log.out_dir={a}"])
    # the "crash": a run that stopped after step 5, its newest checkpoint at step 3
    crashed_copy(a, b, 3)
    assert [r["step"] for r in rows(b / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    out = launch(common + ["--train.steps=6", "--train.resume=true", f"--log.out_dir={b}"])
    assert "continuing after step 3" in out

    ra, rb = rows(a / "metrics.jsonl"), rows(b / "metrics.jsonl")
    assert [r["step"] for r in rb] == list(range(1, 7))  # steps 4-6 of the crash were replaced
    for x, y in zip(ra, rb):
        assert x["reward_mean"] == y["reward_mean"] and x["response_len_mean"] == y["response_len_mean"]
        assert abs(x["grad_norm"] - y["grad_norm"]) <= 1e-6 * x["grad_norm"], (x["step"], x, y)
    wa, wb = load_file(a / "final" / "model.safetensors"), load_file(b / "final" / "model.safetensors")
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.allclose(wa[name], wb[name], atol=1e-6, rtol=0), name


def running(pid: int) -> bool:
    """The process exists and is not a zombie (dead, waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.engine
@pytest.mark.main_only  # the checkpoint's own file protocol; the exact resume covers torch's DCP
def test_sigkill_mid_checkpoint_keeps_the_previous_one(tiny_task_dir, tmp_path):
    """A run killed with SIGKILL while writing its step-4 checkpoint leaves step 2's complete,
    and --train.resume=true continues from it."""
    out, marker = tmp_path / "run", tmp_path / "waiting"
    common = ["--config", "configs/tiny_cpu.yaml", f"--data.tiny_task_dir={tiny_task_dir}",
              "--log.eval_every=0", "--grpo.prompts_per_step=16", "--log.save_every=2",
              f"--log.out_dir={out}"]
    log = str(tmp_path / "log")
    FORKS.submit(["tests/workers/kill_in_checkpoint.py", str(marker), "4", *common,
                  "--train.steps=6"], 2, True, base_env(), 600, log, log)
    deadline = time.time() + 600
    while not all(os.path.exists(f"{marker}.{r}") for r in (0, 1)):
        assert not FORKS.answered(), open(log).read()[-4000:]
        assert time.time() < deadline, "the step-4 checkpoint was never reached"
        time.sleep(0.2)
    ranks = [int(open(f"{marker}.{r}").read()) for r in (0, 1)]
    for pid in ranks:  # the crash
        os.kill(pid, signal.SIGKILL)
    assert FORKS.answer() == 128 + signal.SIGKILL  # the job's ranks, reaped
    assert not any(running(pid) for pid in ranks)  # gone, not left sleeping for an hour
    ckpts = out / "checkpoints"
    assert (ckpts / "step_000004.tmp").is_dir()  # the write really was cut short
    assert not (ckpts / "step_000004").exists()
    assert checkpoint.latest_checkpoint(str(out)) == str(ckpts / "step_000002")

    resumed = launch(["train_grpo.py", *common, "--train.steps=5", "--train.resume=true"])
    assert "continuing after step 2" in resumed
    assert [r["step"] for r in rows(out / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    assert checkpoint.complete_checkpoints(str(out)) == [str(ckpts / "step_000002"),
                                                         str(ckpts / "step_000004")]
    assert not (ckpts / "step_000004.tmp").exists()  # the crashed write was cleared
    assert (out / "final" / "model.safetensors").exists()
