"""Rank 0's outputs: metrics rows, sample rows, and a wandb run in offline mode (no network)."""

import glob
import json
import os

import pytest

import tracking
from train_grpo import Config

pytestmark = pytest.mark.main_only  # rows, files and wandb: no torch or engine version enters


class Bar:
    def __init__(self):
        self.lines = []

    def write(self, line):
        self.lines.append(line)


def test_tracker_writes_rows_and_an_offline_wandb_run(tmp_path):
    cfg = Config()
    cfg.log.out_dir, cfg.log.wandb, cfg.log.wandb_tags = str(tmp_path), "offline", ["t1", "t2"]
    cfg.train.steps = 2
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    tracker = tracking.Tracker(cfg, rank=0, done=1)  # resumed after step 1: rows 2, 3 dropped
    bar = Bar()
    metrics = {"step": 2, "reward_mean": 0.5, "response_len_mean": 3.0, "entropy": 1.0,
               "logp_gap": 1e-7, "gen_time_s": 0.1, "sync_time_s": 0.1, "reward_time_s": 0.0,
               "train_time_s": 0.2, "tokens_per_s": 100.0, "mem_peak_gb": 1.0, "eval_pass1": 0.25}
    tracker.log_step(metrics, bar)
    tracker.log_samples("samples.jsonl", 2, [{"prompt": "1+1=", "answer": "2"}], ["2"], [1.0])
    tracker.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert rows == [{"step": 1}, metrics]
    assert bar.lines == [tracking.format_line(metrics, 2)] and "eval 0.250" in bar.lines[0]
    assert json.loads((tmp_path / "samples.jsonl").read_text()) == {
        "step": 2, "prompt": "1+1=", "completion": "2", "reward": 1.0, "answer": "2"}
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    assert len(runs) == 1 and glob.glob(os.path.join(runs[0], "run-*.wandb"))


def test_other_ranks_write_nothing(tmp_path):
    cfg = Config()
    cfg.log.out_dir, cfg.log.wandb = str(tmp_path), "offline"
    tracker = tracking.Tracker(cfg, rank=1, done=0)
    tracker.log_step({"step": 1}, Bar())
    tracker.close()
    assert os.listdir(tmp_path) == []
