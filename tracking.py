"""Tracking: the step's metrics over all ranks, the console line, the run directory's jsonl
files and wandb.

Rank 0 writes, into log.out_dir: metrics.jsonl (one row per step), samples.jsonl (a few
(prompt, completion, reward) rows every log.samples_every steps) and eval_samples.jsonl (scored
eval examples); wandb, when log.wandb is online or offline, gets the same rows and the resolved
config. scripts/plot_metrics.py draws a run's metrics.jsonl.
"""

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from typing import Annotated

import torch
import torch.distributed as dist

from config import Anything, Items, OneOf, Range, need


@dataclass
class LogConfig:
    # between steps (train_grpo.configure): these; files and wandb open with the rest
    LIVE = ("samples_every", "eval_every", "eval_k", "eval_examples", "save_every",
            "keep_checkpoints")
    # metrics.jsonl, config.yaml, samples.jsonl, checkpoints
    out_dir: Annotated[str, Anything("config.validate: a directory that can be written",
                                     refused=("/etc/hostname/run",))] = "runs/default"
    # write a few (prompt, completion, reward) rows every N steps (0: never)
    samples_every: Annotated[int, Range(0)] = 10
    # eval on the held-out set every N steps and after the last (0: off)
    eval_every: Annotated[int, Range(0)] = 0
    # > 0: also mean@k, k samples per eval prompt at the rollout temperature
    eval_k: Annotated[int, Range(0)] = 0
    # scored eval examples written to eval_samples.jsonl per eval
    eval_examples: Annotated[int, Range(0)] = 4
    # resumable checkpoint every N steps (0: none); HF export at the end
    save_every: Annotated[int, Range(0)] = 0
    keep_checkpoints: Annotated[int, Range(1)] = 2  # newest complete checkpoints kept on disk
    # online | offline (synced later with `wandb sync`) | disabled
    wandb: Annotated[str, OneOf("online", "offline", "disabled")] = "disabled"
    wandb_project: Annotated[str, Anything("a name: wandb takes any")] = "grpo"  # its project
    # wandb run name; empty: the last part of out_dir
    run_name: Annotated[str, Anything("a name: wandb takes any")] = ""
    # tags of the wandb run
    wandb_tags: Annotated[list[str], Anything("names: wandb takes any")] = field(
        default_factory=list)
    # steps to profile, e.g. [3, 4]: a trace per rank under out_dir/profile (docs/metrics.md)
    profile_steps: Annotated[list[int], Items(Range(1))] = field(default_factory=list)

    def check(self, cfg, world_size: int) -> None:
        """out_dir a directory that can be written, or made in one (config.validate calls it)."""
        out = os.path.abspath(self.out_dir)
        need(not os.path.exists(out) or os.path.isdir(out),
             f"log.out_dir='{self.out_dir}' is a file. Fix: give a directory path")
        existing = out
        while not os.path.exists(existing):  # the nearest ancestor that exists must take files
            existing = os.path.dirname(existing)
        need(os.path.isdir(existing) and os.access(existing, os.W_OK | os.X_OK),
             f"log.out_dir='{self.out_dir}' cannot be written ({existing} is not a writable "
             "directory). Fix: choose a directory you can write")

    def eval_due(self, step: int, steps: int) -> bool:
        """Whether step `step` of a run of `steps` ends with an eval: every eval_every steps,
        and the last step."""
        return bool(self.eval_every) and (step % self.eval_every == 0 or step == steps)

log = logging.getLogger("grpo")


def log_to_console(rank: int) -> logging.Handler | None:
    """The trainer's log lines: INFO from rank 0, warnings from the others. Where the process has
    no logging set up (a plain run), a handler of its own, returned so that close() removes it;
    else (a notebook, an application) they go to the handlers already there, left as they are."""
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    if logging.getLogger().handlers or log.handlers:
        return None
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    log.addHandler(handler)
    return handler


class Tracker:
    """Rank 0's outputs of a run; on other ranks every method does nothing."""

    def __init__(self, cfg, rank: int, done: int):
        """cfg: the whole resolved config. done: steps already taken (resume): the rows of later
        steps, a crashed run's tail, are dropped from the jsonl files; all rows when 0."""
        self.cfg, self.log_cfg, self.active = cfg, cfg.log, rank == 0
        self.metrics_file, self.wandb = None, None
        if not self.active:
            return
        out = self.log_cfg.out_dir
        for name in ("metrics.jsonl", "samples.jsonl", "eval_samples.jsonl"):
            keep_rows_upto(os.path.join(out, name), done)
        self.metrics_file = open(os.path.join(out, "metrics.jsonl"), "a")
        if self.log_cfg.wandb != "disabled":
            import wandb

            self.wandb = wandb.init(
                project=self.log_cfg.wandb_project, mode=self.log_cfg.wandb,
                name=self.log_cfg.run_name or os.path.basename(os.path.normpath(out)),
                tags=self.log_cfg.wandb_tags, config=dataclasses.asdict(cfg), dir=out,
                resume="allow")

    def configure(self, cfg) -> None:
        """The run's config, changed between steps (train_grpo.configure): its step count and
        sample fields (the files and wandb stay those it opened)."""
        self.cfg, self.log_cfg = cfg, cfg.log

    def log_step(self, metrics: dict, bar) -> None:
        """A row of metrics.jsonl, the console line (through the progress bar), wandb."""
        if not self.active:
            return
        self.metrics_file.write(json.dumps(metrics) + "\n")
        self.metrics_file.flush()
        bar.write(format_line(metrics, self.cfg.train.steps))
        if self.wandb:
            self.wandb.log(metrics, step=metrics["step"])

    def rewind(self, step: int) -> None:
        """The jsonl files back to their rows of steps <= `step` (a restored snapshot:
        train_grpo.Run.restore). wandb's rows stay: it takes no step twice."""
        if not self.active:
            return
        self.metrics_file.close()
        for name in ("metrics.jsonl", "samples.jsonl", "eval_samples.jsonl"):
            keep_rows_upto(os.path.join(self.log_cfg.out_dir, name), step)
        self.metrics_file = open(os.path.join(self.log_cfg.out_dir, "metrics.jsonl"), "a")

    def log_samples(self, name: str, step: int, examples: list, texts: list, scores: list) -> None:
        """(prompt, completion, reward, answer) rows into `name` (samples.jsonl, ...)."""
        if not self.active:
            return
        data = self.cfg.data
        with open(os.path.join(self.log_cfg.out_dir, name), "a") as f:
            for ex, text, score in zip(examples, texts, scores):
                f.write(json.dumps({"step": step, "prompt": ex[data.prompt_key],
                                    "completion": text, "reward": score,
                                    "answer": ex.get("answer")}) + "\n")

    def close(self) -> None:
        if self.metrics_file:
            self.metrics_file.close()
        if self.wandb:
            self.wandb.finish()


# A step's metrics come from every phase as {name: value}, each value saying how it combines
# over ranks; `reduce` does all of them at once (one all-reduce per kind). A plain number is this
# rank's own (the clock of rank 0, a norm every rank shares) and is not reduced.


@dataclass
class Mean:
    """The mean over all ranks: the sum of the totals over the sum of the counts (0 if none)."""
    total: float
    count: float


@dataclass
class Sum:
    value: float


@dataclass
class Max:
    value: float


@dataclass
class Min:
    value: float


def _floats(values: list) -> list[float]:
    """Python floats of numbers and 0-d tensors, the tensors read in one transfer."""
    tensors = [v for v in values if torch.is_tensor(v)]
    read = iter(torch.stack([t.detach().double().reshape(()) for t in tensors]).cpu().tolist()
                if tensors else [])
    return [next(read) if torch.is_tensor(v) else float(v) for v in values]


def reduce(stats: dict) -> dict:
    """The step's metrics over all ranks. Every rank must call it, with the same names."""
    parts = {"sum": [], "max": [], "min": []}  # (name, kind, slot) per reduced number
    values = {"sum": [], "max": [], "min": []}
    for name, v in stats.items():
        if isinstance(v, Mean):
            parts["sum"].append(name)
            values["sum"] += [v.total, v.count]
        elif isinstance(v, (Sum, Max, Min)):
            op = {Sum: "sum", Max: "max", Min: "min"}[type(v)]
            parts[op].append(name)
            values[op].append(v.value)
    out = {}
    for op, reduce_op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX),
                          ("min", dist.ReduceOp.MIN)):
        if not parts[op]:
            continue
        t = torch.tensor(_floats(values[op]), dtype=torch.float64)
        dist.all_reduce(t, op=reduce_op)
        got = iter(t.tolist())
        for name in parts[op]:
            if isinstance(stats[name], Mean):
                total, count = next(got), next(got)
                out[name] = total / count if count else 0.0
            else:
                value = next(got)
                out[name] = int(value) if isinstance(stats[name].value, int) else value
    return {name: out.get(name, v) for name, v in stats.items()}


def keep_rows_upto(path: str, step: int) -> None:
    """Rewrite a jsonl log keeping the rows of steps <= `step` (all rows gone for step 0)."""
    rows = []
    if step and os.path.exists(path):
        with open(path) as f:
            rows = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(path, "w") as f:
        f.writelines(rows)


def format_line(m: dict, steps: int) -> str:
    line = (f"step {m['step']}/{steps} | reward {m['reward_mean']:.3f} | "
            f"len {m['response_len_mean']:.1f} | ent {m['entropy']:.2f} | "
            + (f"kl {m['kl']:.4f} | " if "kl" in m else "")
            + f"gap {m['logp_gap']:.1e} | "
            f"gen {m['gen_time_s']:.2f}s sync {m['sync_time_s']:.2f}s "
            f"reward {m['reward_time_s']:.2f}s train {m['train_time_s']:.2f}s | "
            f"{m['tokens_per_s']:.0f} tok/s | mem {m['mem_peak_gb']:.1f}G")
    if "eval_pass1" in m:
        line += f" | eval {m['eval_pass1']:.3f}"
    if "eval_mean_at_k" in m:
        line += f" mean@k {m['eval_mean_at_k']:.3f}"
    return line
