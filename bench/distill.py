"""How many steps on-policy distillation saves: the tiny task's random student trained by GRPO
(configs/tiny_cpu.yaml) and by a teacher's logprobs (configs/distill_cpu.yaml), from the same
initial weights at the same seed, each until its greedy eval reaches --target.

    python bench/distill.py                 # 2 ranks; stops each run at the target
    python bench/distill.py --full          # each run to its configured steps

The teacher, runs/tiny_cpu/final, is the README's first run; if it is missing it is made first
(the command is printed). Both runs evaluate every --eval-every steps (`log.eval_every`). Prints
one line per run (the first step whose eval_pass1 >= target, or "-", the last eval, the mean
per-step time, wall time) and their ratio.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEACHER = "runs/tiny_cpu/final"


def torchrun(nproc: int, args: list) -> list:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
            "train_grpo.py", *args]


def evals(path: str) -> list:
    """[(step, eval_pass1, step_time_s)] of the eval rows of a metrics.jsonl written so far."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.endswith("\n")]
    return [(r["step"], r["eval_pass1"], r["step_time_s"]) for r in rows if "eval_pass1" in r]


def run(name: str, cmd: list, out: str, target: float, full: bool, env: dict) -> dict:
    """One training, ended at the first eval >= target unless `full`."""
    metrics = os.path.join(out, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    os.makedirs(out, exist_ok=True)
    t = time.time()
    with open(os.path.join(out, "bench.log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        while proc.poll() is None:
            time.sleep(2)
            if not full and any(e >= target for _, e, _ in evals(metrics)):
                os.killpg(proc.pid, signal.SIGTERM)  # torchrun and its ranks
                proc.wait()
                break
        else:
            if proc.returncode != 0:
                sys.exit(f"{name}: exit {proc.returncode}; its output: {log.name}")
    with open(metrics) as f:
        rows = [json.loads(line) for line in f if line.endswith("\n")]
    found = evals(metrics)
    reached = next((step for step, e, _ in found if e >= target), None)
    return {"reached": reached, "last_eval": found[-1][1] if found else float("nan"),
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
    for name, config in (("grpo", "configs/tiny_cpu.yaml"), ("distill", "configs/distill_cpu.yaml")):
        out = os.path.join(args.out, name)
        cmd = torchrun(args.nproc, ["--config", config, f"--log.out_dir={out}",
                                    f"--log.eval_every={args.eval_every}"])
        r = found[name] = run(name, cmd, out, args.target, args.full, env)
        print(f"{name:<8} {r['reached'] if r['reached'] else '-':>7} {r['last_eval']:9.3f} "
              f"{r['step_s']:7.3f} {r['teacher_s']:9.3f} {r['wall_s']:7.0f}", flush=True)
    grpo, dist = found["grpo"]["reached"], found["distill"]["reached"]
    if grpo and dist:
        print(f"steps to eval {args.target}: distill / grpo = {dist} / {grpo} = {dist / grpo:.2f}")


if __name__ == "__main__":
    main()
