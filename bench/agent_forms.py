"""The agent of configs/agent_cpu.yaml in its two forms, trained side by side: each a run of the
real trainer on N ranks for --steps steps. Prints one JSON line.

    python bench/agent_forms.py                 # 2 ranks, 30 steps each; about 3 minutes
    python bench/agent_forms.py --steps 10
    python bench/agent_forms.py --steps 2 --grpo.prompts_per_step=8   # config overrides follow

`solve` (examples/calculator_agent.py) is handed a ready client (envs.with_client: one
AsyncOpenAI a worker, with_options per episode); `solve_from_url` makes an AsyncOpenAI per
episode from its base URL, as the `openai` package's docs show, and drops it unclosed.
Reported for each: the median over steps of gen_time_s (the first step left out: the agents'
worker starts in it), the last-10 reward, and the tracebacks in its output (the runs before
the agents' event loop lived as long as their worker printed one per client), with the
ratio of the two forms' generation times.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile

from common import read_rows, train_until

FORMS = ("solve", "solve_from_url")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--out", default=None, help="the runs' directory (default: a temp dir)")
    args, extra = p.parse_known_args()  # the rest: --section.key=value for both runs
    out_root = args.out or tempfile.mkdtemp(prefix="agent_forms_")
    os.makedirs(out_root, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = {"steps": args.steps, "nproc": args.nproc}
    for form in FORMS:
        out = os.path.join(out_root, form)
        log = os.path.join(out_root, f"{form}.log")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={args.nproc}",
               "train_grpo.py", "--config", "configs/agent_cpu.yaml",
               f"--env.name=examples/calculator_agent.py:{form}", f"--train.steps={args.steps}",
               "--log.eval_every=0", f"--log.out_dir={out}", *extra]
        failed = train_until(cmd, log, env)
        if failed:
            raise SystemExit(f"{form}: {failed}")
        rows = read_rows(os.path.join(out, "metrics.jsonl"))
        with open(log) as f:
            text = f.read()
        result[form] = {
            "gen_time_s": round(statistics.median(r["gen_time_s"] for r in rows[1:]), 4),
            "reward_last10": round(statistics.mean(r["reward_mean"] for r in rows[-10:]), 3),
            "tracebacks": text.count("Traceback"),
            "event_loop_closed": text.count("Event loop is closed")}
    result["from_url_over_ready"] = round(result["solve_from_url"]["gen_time_s"]
                                          / result["solve"]["gen_time_s"], 3)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
