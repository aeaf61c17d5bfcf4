"""How many steps on-policy distillation saves: the tiny task's random student trained by GRPO
(configs/tiny_cpu.yaml), by a teacher's top k (configs/distill_cpu.yaml, distill.loss
forward_top_k) and by the sampled-token reverse KL (the same with distill.loss reverse_sampled),
from the same initial weights at the same seed, each until its greedy eval reaches --target.

    python bench/distill.py                 # 2 ranks; stops each run at the target
    python bench/distill.py --full          # each run to its configured steps

The teacher, runs/tiny_cpu/final, is the README's first run; if it is missing it is made first
(the command is printed). The runs evaluate every --eval-every steps (`log.eval_every`). Prints
one line per run (the first step whose eval_pass1 >= target, or "-", the last eval, the mean
per-step time and teacher time, wall time) and each distillation's ratio to GRPO.
"""

import argparse
import os
import subprocess
import sys
import time

from common import read_rows, train_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEACHER = "runs/tiny_cpu/final"
RUNS = (("grpo", "configs/tiny_cpu.yaml", []),
        ("distill", "configs/distill_cpu.yaml", []),  # distill.loss: forward_top_k
        ("reverse", "configs/distill_cpu.yaml", ["--distill.loss=reverse_sampled"]))


def torchrun(nproc: int, args: list) -> list:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            "train_grpo.py", *args]


def run(name: str, cmd: list, out: str, target: float, full: bool, env: dict) -> dict:
    """One training, ended at the first eval >= target unless `full`."""
    metrics = os.path.join(out, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    os.makedirs(out, exist_ok=True)
    t = time.time()
    evals = lambda: [r for r in read_rows(metrics) if "eval_pass1" in r]  # noqa: E731
    error = train_until(cmd, os.path.join(out, "bench.log"), env,
                        None if full else lambda: any(r["eval_pass1"] >= target for r in evals()))
    if error:
        sys.exit(f"{name}: {error}")
    rows, found = read_rows(metrics), evals()
    reached = next((r["step"] for r in found if r["eval_pass1"] >= target), None)
    return {"reached": reached, "last_eval": found[-1]["eval_pass1"] if found else float("nan"),
            "step_s": sum(r["step_time_s"] for r in rows) / len(rows),
            "teacher_s": sum(r.get("teacher_time_s", 0.0) for r in rows) / len(rows),
            "wall_s": time.time() - t}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--full", action="store_true")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_distill"))
    args = p.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if not os.path.isfile(os.path.join(ROOT, TEACHER, "config.json")):
        cmd = torchrun(args.nproc, ["--config", "configs/tiny_cpu.yaml"])
        print(f"the teacher {TEACHER} is missing; making it first:\n  "
              f"{' '.join(cmd[1:]).replace('-m torch.distributed.run', 'torchrun')}", flush=True)
        made = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if made.returncode != 0:
            sys.exit(f"the teacher's run failed (exit {made.returncode}):\n{made.stderr[-3000:]}")
    print(f"{'run':<8} {'reached':>7} {'last_eval':>9} {'step_s':>7} {'teacher_s':>9} "
          f"{'wall_s':>7}", flush=True)
    found = {}
    for name, config, extra in RUNS:
        out = os.path.join(args.out, name)
        cmd = torchrun(args.nproc, ["--config", config, f"--log.out_dir={out}",
                                    f"--log.eval_every={args.eval_every}", *extra])
        r = found[name] = run(name, cmd, out, args.target, args.full, env)
        print(f"{name:<8} {r['reached'] if r['reached'] else '-':>7} {r['last_eval']:9.3f} "
              f"{r['step_s']:7.3f} {r['teacher_s']:9.3f} {r['wall_s']:7.0f}", flush=True)
    grpo = found["grpo"]["reached"]
    for name in ("distill", "reverse"):
        if grpo and found[name]["reached"]:
            print(f"steps to eval {args.target}: {name} / grpo = {found[name]['reached']} / "
                  f"{grpo} = {found[name]['reached'] / grpo:.2f}")


if __name__ == "__main__":
    main()
