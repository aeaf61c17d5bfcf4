"""Does the tiny task still learn under each GRPO variant, and how fast? Runs the real trainer
once per variant and seed.

    python bench/loss_variants.py                       # every variant, seed 0, 300 steps, 2 ranks
    python bench/loss_variants.py --steps 100 --only token_mean seq_mean
    python bench/loss_variants.py --seeds 0 1 2 --until-reached    # steps to 0.9, three seeds

Each run is `torchrun --nproc_per_node N train_grpo.py --config configs/tiny_cpu.yaml` plus the
variant's overrides and `--train.seed=S --rollout.seed=S` (the data order and the engine's
sampling; the tiny model's initial weights are the task's), in its own output directory. Prints
one row per run: the step at which the mean reward over the last 10 steps first reached
`--target` ("-" if it never did), the mean reward over the first and the last 10 steps, the last
greedy eval accuracy, mean KL / clip fraction / entropy of the last 10 steps, and wall time;
with several seeds, one more row per variant: the median of its steps to the target (a run that
never reached it counts as more than --steps). `--until-reached` ends each run as soon as it
reaches the target (its last-10 and eval columns are then those of that moment).
"""

import argparse
import os
import statistics
import sys
import time

from common import read_rows, train_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VARIANTS = {
    "token_mean": [],  # the defaults: DAPO's token mean, TIS
    "seq_mean": ["--grpo.loss_agg=seq_mean"],
    "constant": ["--grpo.loss_agg=constant"],
    "dr_grpo": ["--grpo.loss_agg=constant", "--grpo.scale_adv_by_std=false"],
    "batch_std": ["--grpo.adv_std=batch"],
    "gdpo": ["--grpo.reward_agg=gdpo"],  # one reward function: its group's, then the batch's
    "dapo": ["--grpo.clip_high=0.28", "--grpo.dynamic_sampling=true", "--grpo.max_gen_rounds=3",
             "--grpo.overlong=penalty", "--grpo.overlong_buffer=2",
             "--grpo.overlong_penalty_factor=0.1"],
    "ppo_kl": ["--grpo.ppo_epochs=2", "--grpo.mini_batches=2", "--grpo.kl_coef=0.01",
               "--grpo.is_correction=seq_mask"],
    "kl_unbiased": ["--grpo.ppo_epochs=2", "--grpo.mini_batches=2", "--grpo.kl_coef=0.01",
                    "--grpo.kl_unbiased=true"],
    "off_policy": ["--grpo.ppo_epochs=2", "--grpo.mini_batches=2",
                   "--grpo.off_policy_delta=0.001"],
    "token_mask": ["--grpo.is_correction=token_mask", "--grpo.is_cap_low=0.5"],
    "seq_truncate": ["--grpo.is_correction=seq_truncate"],
    "seq_geo_mask": ["--grpo.is_correction=seq_geo_mask"],
    "gspo": ["--grpo.policy_loss=gspo", "--grpo.loss_agg=seq_mean",
             "--grpo.is_correction=seq_mask", "--grpo.clip_low=3e-4", "--grpo.clip_high=4e-4"],
    "cispo": ["--grpo.policy_loss=cispo", "--grpo.clip_high=4.0"],
    "sapo": ["--grpo.policy_loss=sapo"],
    "seq_mask": ["--grpo.is_correction=seq_mask"],
    # off-policy (4 optimizer steps a rollout), where a trust region or a bound can act
    "dppo_tv": ["--grpo.policy_loss=dppo_tv", "--grpo.ppo_epochs=2", "--grpo.mini_batches=2",
                "--grpo.clip_low=0.1", "--grpo.clip_high=0.1"],
    "dppo_kl": ["--grpo.policy_loss=dppo_kl", "--grpo.ppo_epochs=2", "--grpo.mini_batches=2",
                "--grpo.clip_low=0.05", "--grpo.clip_high=0.05"],
    "dual_clip": ["--grpo.dual_clip=3", "--grpo.ppo_epochs=2", "--grpo.mini_batches=2"],
    "luspo": ["--grpo.policy_loss=luspo", "--grpo.loss_agg=seq_sum",
              "--grpo.is_correction=seq_mask", "--grpo.clip_low=3e-4", "--grpo.clip_high=4e-4"],
    "vespo": ["--grpo.policy_loss=vespo"],
    "entropy_bonus": ["--grpo.entropy_coef=0.01"],
    "forking_tokens": ["--grpo.top_entropy_quantile=0.2"],
    "forking_half": ["--grpo.top_entropy_quantile=0.5"],
    "top_p": ["--rollout.top_p=0.9"],
}
WINDOW = 10  # steps in the reward's moving mean


def reached(rows: list, target: float):
    """The first step whose mean reward over the last WINDOW steps is >= target, or None."""
    for i in range(WINDOW, len(rows) + 1):
        if sum(r["reward_mean"] for r in rows[i - WINDOW:i]) / WINDOW >= target:
            return rows[i - 1]["step"]
    return None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--until-reached", action="store_true")
    p.add_argument("--only", nargs="*", choices=sorted(VARIANTS), default=sorted(VARIANTS))
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "bench_loss_variants"))
    args = p.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    print(f"{'variant':<13} {'seed':>4} {'reached':>7} {'first10':>8} {'last10':>7} {'eval':>6} "
          f"{'kl':>7} {'clip':>6} {'ent':>5} {'wall_s':>7}")
    for name in [v for v in VARIANTS if v in args.only]:
        steps_to = []
        for seed in args.seeds:
            out = os.path.join(args.out, f"{name}_seed{seed}")
            os.makedirs(args.out, exist_ok=True)
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
                   "train_grpo.py", "--config", "configs/tiny_cpu.yaml",
                   f"--train.steps={args.steps}", f"--train.seed={seed}", f"--rollout.seed={seed}",
                   f"--log.out_dir={out}", *VARIANTS[name]]
            metrics = os.path.join(out, "metrics.jsonl")
            if os.path.exists(metrics):
                os.remove(metrics)
            t = time.time()
            stop = lambda: reached(read_rows(metrics), args.target) is not None  # noqa: E731
            error = train_until(cmd, f"{out}.log", env, stop if args.until_reached else None)
            rows, wall = read_rows(metrics), time.time() - t
            if error or not rows:
                print(f"{name:<13} {seed:>4} failed ({error or 'no metrics'})", flush=True)
                continue
            step = reached(rows, args.target)
            steps_to.append(step if step is not None else args.steps + 1)
            mean = lambda key, part: sum(r.get(key, 0.0) for r in part) / len(part)  # noqa: E731
            evals = [r["eval_pass1"] for r in rows if "eval_pass1" in r]
            print(f"{name:<13} {seed:>4} {step if step is not None else '-':>7} "
                  f"{mean('reward_mean', rows[:10]):8.3f} {mean('reward_mean', rows[-10:]):7.3f} "
                  f"{evals[-1] if evals else float('nan'):6.3f} {mean('kl', rows[-10:]):7.4f} "
                  f"{mean('clip_frac', rows[-10:]):6.3f} {mean('entropy', rows[-10:]):5.2f} "
                  f"{wall:7.0f}", flush=True)
        if len(args.seeds) > 1 and steps_to:
            median = statistics.median(steps_to)
            shown = f">{args.steps}" if median > args.steps else f"{median:g}"
            print(f"{name:<13} {'all':>4} {shown:>7}   (median steps to {args.target} over "
                  f"{len(steps_to)} seeds)", flush=True)


if __name__ == "__main__":
    main()
