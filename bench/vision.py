"""Does the tiny vision task's reward come from seeing? The same config trained twice: on the
task's images, and on the same rows whose images are all one grey (blanked).

    python bench/vision.py                       # configs/vlm_cpu.yaml, 300 steps, 2 ranks
    python bench/vision.py --steps 100 --out /tmp/vision

Each run is `torchrun --nproc_per_node N train_grpo.py --config configs/vlm_cpu.yaml` in its own
output directory; the blanked one reads a copy of the task's train and test rows whose image
paths point at grey images of the same size (the model, the prompts and the answers the same).
Prints one JSON line per run: the mean reward over the first and the last 10 steps, the last
greedy eval accuracy, and the wall time. Three colours: a model that cannot see scores at most
about 1/3 (always the same colour), or 0.5 per answer (`tiny_colour`'s half credit) if it writes
more after it.
"""

import argparse
import json
import os
import sys
import time

from common import read_rows, train_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def blanked(task: str, out: str) -> str:
    """A copy of the task's rows in `out`, every image replaced by a grey one of its size."""
    from PIL import Image

    os.makedirs(os.path.join(out, "images"), exist_ok=True)
    for name in ("train.jsonl", "test.jsonl"):
        rows = [json.loads(line) for line in open(os.path.join(task, name))]
        for row in rows:
            paths = []
            for path in row["images"]:
                grey = os.path.join(out, "images", os.path.basename(path))
                Image.new("RGB", Image.open(path).size, (128, 128, 128)).save(grey)
                paths.append(grey)
            row["images"] = paths
        with open(os.path.join(out, name), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=os.path.join(ROOT, "configs", "vlm_cpu.yaml"))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", default="runs/bench_vision")
    args = p.parse_args()
    from tasks import tiny_task
    from train_grpo import load_config

    cfg = load_config(args.config, [])
    task = os.path.abspath(os.path.join(ROOT, cfg.data.tiny_task_dir))
    tiny_task.ensure_tiny_task(task, arch=cfg.data.tiny_task_arch)
    grey = blanked(task, os.path.abspath(os.path.join(args.out, "blank_task")))
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for name, extra in (("seeing", []), ("blanked", [f"--data.path={grey}/train.jsonl",
                                                      f"--data.eval_path={grey}/test.jsonl"])):
        out = os.path.abspath(os.path.join(args.out, name))
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
               "--master_port=29571", "train_grpo.py", "--config", args.config,
               f"--train.steps={args.steps}", f"--log.out_dir={out}",
               f"--data.tiny_task_dir={task}", *extra]
        start = time.time()
        failed = train_until(cmd, os.path.join(args.out, f"{name}.log"), env)
        rows = read_rows(os.path.join(out, "metrics.jsonl"))
        mean = lambda part: round(sum(r["reward_mean"] for r in part) / max(len(part), 1), 3)  # noqa: E731
        evals = [r["eval_pass1"] for r in rows if "eval_pass1" in r]
        print(json.dumps({"run": name, "steps": len(rows), "first10": mean(rows[:10]),
                          "last10": mean(rows[-10:]), "eval": evals[-1] if evals else None,
                          "wall_s": round(time.time() - start), "failed": failed}), flush=True)


if __name__ == "__main__":
    main()
