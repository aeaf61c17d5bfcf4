"""Does the tiny task still learn under each GRPO variant? Runs the real trainer once per variant.

    python bench/loss_variants.py                       # every variant, 300 steps, 2 ranks
    python bench/loss_variants.py --steps 100 --only token_mean seq_mean

Each variant is `torchrun --nproc_per_node N train_grpo.py --config configs/tiny_cpu.yaml` plus
its overrides, in its own output directory. Prints one row per variant: mean reward over the
first and the last 10 steps, the last greedy eval accuracy, mean KL / clip fraction / entropy of
the last 10 steps, and wall time.
"""

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VARIANTS = {
    "token_mean": [],  # the defaults: DAPO's token mean, TIS
    "seq_mean": ["--grpo.loss_agg=seq_mean"],
    "constant": ["--grpo.loss_agg=constant"],
    "dr_grpo": ["--grpo.loss_agg=constant", "--grpo.scale_adv_by_std=false"],
    "dapo": ["--grpo.clip_high=0.28", "--grpo.dynamic_sampling=true", "--grpo.max_gen_rounds=3",
             "--grpo.overlong=penalty", "--grpo.overlong_buffer=2",
             "--grpo.overlong_penalty_factor=0.1"],
    "ppo_kl": ["--grpo.ppo_epochs=2", "--grpo.mini_batches=2", "--grpo.kl_coef=0.01",
               "--grpo.is_correction=seq_mask"],
    "gspo": ["--grpo.policy_loss=gspo", "--grpo.loss_agg=seq_mean",
             "--grpo.is_correction=seq_mask", "--grpo.clip_low=3e-4", "--grpo.clip_high=4e-4"],
    "cispo": ["--grpo.policy_loss=cispo", "--grpo.clip_high=4.0"],
    "sapo": ["--grpo.policy_loss=sapo"],
}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--only", nargs="*", choices=sorted(VARIANTS), default=sorted(VARIANTS))
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_loss_variants"))
    args = p.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    print(f"{'variant':<11} {'first10':>8} {'last10':>7} {'eval':>6} {'kl':>7} {'clip':>6} "
          f"{'ent':>5} {'wall_s':>7}")
    for name in [v for v in VARIANTS if v in args.only]:
        out = os.path.join(args.out, name)
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
               "train_grpo.py", "--config", "configs/tiny_cpu.yaml", f"--train.steps={args.steps}",
               f"--log.out_dir={out}", *VARIANTS[name]]
        t = time.time()
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        wall = time.time() - t
        if proc.returncode != 0:
            print(f"{name:<11} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            continue
        rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        mean = lambda key, part: sum(r.get(key, 0.0) for r in part) / len(part)  # noqa: E731
        evals = [r["eval_pass1"] for r in rows if "eval_pass1" in r]
        print(f"{name:<11} {mean('reward_mean', rows[:10]):8.3f} "
              f"{mean('reward_mean', rows[-10:]):7.3f} {evals[-1] if evals else float('nan'):6.3f} "
              f"{mean('kl', rows[-10:]):7.4f} {mean('clip_frac', rows[-10:]):6.3f} "
              f"{mean('entropy', rows[-10:]):5.2f} {wall:7.0f}", flush=True)


if __name__ == "__main__":
    main()
