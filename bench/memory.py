"""Memory over a long run: does a step leave memory behind? The trainer runs `--steps` steps
(the tiny config by default, 2 ranks, the offload on: the actor and its optimizer state moved to
host memory and back, and the weights pushed into the engine, every step) and each step's
`mem_host_gb` (the largest rank's resident host memory after it) and, on an accelerator,
`mem_device_gb` are fitted with a line after `--warmup` steps. Prints one JSON line: the first
and last values and the slope as MiB per 100 steps.

    python bench/memory.py --steps 500                       # CPU: the tiny config, 2 ranks
    python bench/memory.py --steps 500 --nproc 1 --config configs/qwen2.5-0.5b-gsm8k-cuda1.yaml

Further `--section.key=value` arguments go to the trainer.
"""

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import read_rows, train_until  # noqa: E402


def slope(xs: list, ys: list) -> float:
    """The least-squares slope of ys over xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def growth(rows: list, key: str, warmup: int) -> dict | None:
    """`key`'s first and last value (GiB) and its fitted growth in MiB per 100 steps, over the
    steps after `warmup`; None if the rows lack it."""
    kept = [r for r in rows if r["step"] > warmup and key in r]
    if len(kept) < 2:
        return None
    per_step = slope([r["step"] for r in kept], [r[key] for r in kept])
    return {"first_gb": round(kept[0][key], 4), "last_gb": round(kept[-1][key], 4),
            "mib_per_100_steps": round(per_step * 1024 * 100, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=100, help="steps left out of the fit")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--config", default="configs/tiny_cpu.yaml")
    parser.add_argument("--out", default=None, help="the run's directory (default: a temp one)")
    args, extra = parser.parse_known_args()
    if args.steps <= args.warmup + 1:
        parser.error("--steps must exceed --warmup by 2 or more: the fit needs two steps")
    out = args.out or tempfile.mkdtemp(prefix="bench_memory_")
    os.makedirs(out, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
           "train_grpo.py", "--config", args.config, f"--train.steps={args.steps}",
           "--model.offload=on", "--log.eval_every=0", "--log.samples_every=0",
           "--log.save_every=0", f"--log.out_dir={out}", *extra]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    failed = train_until(cmd, os.path.join(out, "bench.log"), env)
    if failed:
        sys.exit(f"bench/memory.py: the run failed: {failed}")
    rows = read_rows(os.path.join(out, "metrics.jsonl"))
    print(json.dumps({"steps": len(rows), "warmup": args.warmup, "nproc": args.nproc,
                      "host": growth(rows, "mem_host_gb", args.warmup),
                      "device": growth(rows, "mem_device_gb", args.warmup), "out": out}))


if __name__ == "__main__":
    main()
