"""Draw a run's metrics.jsonl into one PNG: reward and eval, response length, KL and entropy, the
engine/trainer mismatch, and the time of each phase of a step.

    python scripts/plot_metrics.py runs/x/metrics.jsonl              # writes runs/x/metrics.png
    python scripts/plot_metrics.py runs/x/metrics.jsonl -o plot.png --smooth 10

Curves whose metric a run did not log (kl without a reference, eval without log.eval_every) are
left out; a panel with none is left empty.
"""

import argparse
import json
import os

# (title, metrics, log scale)
PANELS = [
    ("reward", ["reward_mean", "eval_pass1", "eval_mean_at_k"], False),
    ("response length (tokens)", ["response_len_mean"], False),
    ("KL to reference, entropy", ["kl", "entropy"], False),
    ("mean |engine - trainer| logprob", ["logp_gap"], True),
    ("importance ratio p_trainer / p_engine", ["is_ratio_min", "is_ratio_mean", "is_ratio_max"],
     False),
    ("seconds per step", ["gen_time_s", "sync_time_s", "reward_time_s", "logprobs_time_s",
                          "train_time_s", "sleep_time_s", "step_time_s"], True),
]


def smooth(values: list, window: int) -> list:
    """Trailing mean over `window` points (1: unchanged)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(rows: list[dict], path: str, window: int = 1, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (name, keys, log_scale) in zip(axes.flat, PANELS):
        for key in keys:
            points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if not points:
                continue
            steps, values = zip(*points)
            sparse = len(points) < len(rows) / 2  # eval: a few points, drawn as markers
            ax.plot(steps, values if sparse else smooth(list(values), window), label=key,
                    marker="o" if sparse else None, linewidth=1.2)
        ax.set_title(name)
        ax.set_xlabel("step")
        if log_scale and ax.lines:
            ax.set_yscale("log")
        if ax.lines:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("metrics", help="a run's metrics.jsonl")
    parser.add_argument("-o", "--out", help="PNG to write (default: beside metrics.jsonl)")
    parser.add_argument("--smooth", type=int, default=1, help="trailing mean over N steps")
    args = parser.parse_args(argv)
    with open(args.metrics) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise SystemExit(f"{args.metrics} has no rows")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.metrics)), "metrics.png")
    plot(rows, out, max(1, args.smooth), title=os.path.dirname(os.path.abspath(args.metrics)))
    print(out)


if __name__ == "__main__":
    main()
