"""One GRPO step, phase by phase, through the trainer's own step, beside the generation floor.
Prints one JSON line (rank 0).

    python bench/step.py                                         # configs/tiny_cpu.yaml, 1 rank
    torchrun --nproc_per_node 2 bench/step.py --rollout.max_new_tokens=32 --rollout.max_model_len=64
    python bench/step.py --config configs/qwen2.5-0.5b-gsm8k-cuda1.yaml --shape qwen2.5-0.5b \
        --prompt-len 128 --rollout.max_new_tokens=512        # a random model of real shapes

It runs `train_grpo.setup` and `--steps` calls of `train_grpo.train_step` on `--config`, further
`--section.key=value` arguments overriding it (no eval, no checkpoints, no wandb, a temporary
out_dir). With --shape or --hidden the model is a random-init Qwen2 of those shapes
(bench/common.py) and the data `--prompt-len`-token prompts of the tiny task's alphabet, scored by
the tiny task's reward. Bench-only: every response runs to `rollout.max_new_tokens` (EOS ignored,
`Engine.ignore_eos`), so that runs and steps compare. The floor: after each step, a bare
`LLM.generate` of the step's prompts with the same n, temperature, top_p and max_tokens (and
nothing else: no logprobs, no per-prompt seeds), on the same engine in the same process, woken and
synced as for a rollout (the prefix cache emptied).
The line holds the median over the steps after the first of each phase's seconds (rank 0's
clock, from metrics.jsonl): generate, sync (wake, gather, load), reward, sleep, logprobs
(old-policy and reference passes, when the variant has them), train (the update),
offload_out/in (model.offload: the actor and its optimizer state to host memory and back), and
the step; every step's seconds (the first included); the floor and generate / floor (none with
--no-floor); tokens per second (response tokens per engine; prompt + response tokens of the
whole step per rank); the median engine/trainer logprob gap; the update's TFLOP/s per device
and, on a GPU whose peak npu_ops knows, its utilisation (the metrics `train_tflops`, `mfu`);
and on accelerators the device memory that the engine's sleep and the moves of the optimizer
state and the actor to host memory (optimizer_out, actor_out) freed, beside the host memory
those moves fill (offload_host_gb).
"""

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import npu_ops  # noqa: E402  (first: the platform environment before torch loads)
import train_grpo  # noqa: E402
from common import add_model_args, model_from_args  # noqa: E402
from data import DataConfig  # noqa: E402
from rewards import RewardConfig  # noqa: E402

PHASES = ("generate", "floor", "sync", "reward", "sleep", "logprobs", "train", "offload_out",
          "offload_in", "step")


def floor(run, ro) -> dict:
    """A bare LLM.generate of the rollout's prompts on the run's engine, in the run's engine turn
    as for a rollout (woken and synced, the actor and its optimizer state in host memory
    meanwhile with model.offload): its seconds and response tokens. The engine sleeps again
    after (leaving the turn)."""
    from vllm import SamplingParams

    r, G = run.cfg.rollout, run.cfg.grpo.group_size
    prompts = [{"prompt_token_ids": s.prompt_ids} for s in ro.samples[::G]]
    params = SamplingParams(n=G, temperature=r.temperature, top_p=r.top_p,
                            max_tokens=r.max_new_tokens, ignore_eos=True)
    with run.turn:  # wakes weights and KV cache around the push; empties the prefix cache
        t = time.perf_counter()
        outs = run.engine.llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t
    return {"floor": seconds, "floor_tokens": sum(len(c.token_ids) for o in outs
                                                  for c in o.outputs),
            "tokens": sum(len(s.response_ids) for s in ro.samples)}


def synthetic_prompts(path: str, n: int, length: int) -> str:
    """`n` prompts of `length` characters ("a+b+...=", one token each with the tiny task's
    character-level tokenizer), answer 0."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            body = "".join(rng.choice("0123456789+") for _ in range(length - 1)) + "="
            f.write(json.dumps({"prompt": body, "answer": "0"}) + "\n")
    return path


def params_m(path: str) -> float:
    """Parameters of the checkpoint at `path`, in millions (built on the meta device)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    import checkpoint

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            checkpoint.language_config(AutoConfig.from_pretrained(path)))
    return round(sum(p.numel() for p in model.parameters()) / 1e6, 1)


def summary(rows: list[dict], steps: list[dict], cfg, world: int) -> dict:
    """The JSON line: medians over the steps after the first (all steps if there is one)."""
    every = [round(r["step_time_s"], 3) for r in rows]
    rows, steps = rows[1:] or rows, steps[1:] or steps
    phase = {name: [] for name in PHASES if name != "floor"}
    for row in rows:
        for name in ("sync", "reward", "sleep", "logprobs", "train", "offload_out", "offload_in",
                     "step"):
            phase[name].append(row.get(f"{name}_time_s", 0.0))
        phase["generate"].append(row["gen_time_s"])
    if all("floor" in s for s in steps):
        phase["floor"] = [s["floor"] for s in steps]
    med = {name: statistics.median(v) for name, v in phase.items()}
    # tokens_per_s: prompt + response tokens of all ranks over the step's time
    step_tokens = statistics.median(r["tokens_per_s"] * r["step_time_s"] for r in rows)
    out = {"device": npu_ops.device_type(), "world": world, "params_m": params_m(cfg.model.path),
           "dtype": cfg.rollout.dtype, "new_tokens": cfg.rollout.max_new_tokens,
           "response_tokens": [s["tokens"] for s in steps],  # per engine, each measured step
           "step_s": every,  # every step's, the first included
           "steps_measured": len(steps), "seconds": {k: round(v, 4) for k, v in med.items()},
           "generate_tokens_per_s": round(statistics.median(
               s["tokens"] / row["gen_time_s"] for row, s in zip(rows, steps))),
           "step_tokens_per_s_per_rank": round(step_tokens / med["step"] / world),
           "logp_gap": statistics.median(r["logp_gap"] for r in rows),
           "train_tflops": round(statistics.median(r["train_tflops"] for r in rows), 2)}
    if "floor" in med:
        ratios = [row["gen_time_s"] / s["floor"] for row, s in zip(rows, steps)]
        out.update(floor_response_tokens=[s["floor_tokens"] for s in steps],
                   generate_over_floor=round(statistics.median(ratios), 3),
                   generate_over_floor_range=[round(min(ratios), 3), round(max(ratios), 3)],
                   floor_tokens_per_s=round(statistics.median(
                       s["floor_tokens"] / s["floor"] for s in steps)))
    if "mfu" in rows[0]:
        out["mfu"] = round(statistics.median(r["mfu"] for r in rows), 4)
    last = rows[-1]
    for event in ("sleep", "optimizer_out", "actor_out"):  # accelerators: in use before - after
        if f"mem_{event}_before_gb" in last:
            out[f"mem_freed_by_{event}_gb"] = round(
                last[f"mem_{event}_before_gb"] - last[f"mem_{event}_after_gb"], 2)
    if "offload_host_gb" in last:  # what the moves out hold on the host: the bytes to free
        out["offload_host_gb"] = round(last["offload_host_gb"], 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompt-len", type=int, default=16, help="with a random model: its prompts")
    p.add_argument("--floor", action=argparse.BooleanOptionalAction, default=True,
                   help="the bare LLM.generate after each step (--no-floor: none)")
    add_model_args(p)
    args, overrides = p.parse_known_args()
    out = tempfile.mkdtemp(prefix="bench_step_")
    cfg = train_grpo.load_config(args.config, [
        *overrides, f"--train.steps={args.steps}", f"--log.out_dir={out}", "--log.eval_every=0",
        "--log.save_every=0", "--log.samples_every=0", "--log.wandb=disabled"])
    if args.shape or args.hidden:  # a random model of those shapes, prompts of the tiny alphabet
        npu_ops.setup_env(graph_mode=not cfg.rollout.enforce_eager,
                          matmul_allreduce=cfg.rollout.matmul_allreduce, sp_size=cfg.model.sp_size)
        rank, _ = train_grpo.init_distributed()  # setup() joins the same process group
        cfg.model.path = model_from_args(args, rank)
        prompts = os.path.join(out, f"prompts_{rank}.jsonl")  # every rank writes its own copy
        synthetic_prompts(prompts, 4 * cfg.grpo.prompts_per_step, args.prompt_len)
        cfg.data = DataConfig(path=prompts, max_prompt_len=args.prompt_len)
        cfg.reward = RewardConfig(funcs=["tiny_sum"])
    rows, steps = [], []
    with train_grpo.setup(cfg) as run:
        run.engine.ignore_eos = True  # bench-only: every response runs to max_new_tokens
        for _ in range(args.steps):
            metrics = train_grpo.train_step(run)
            ro = run.last.rollout
            rows.append(metrics)
            steps.append(floor(run, ro) if args.floor else
                          {"tokens": sum(len(s.response_ids) for s in ro.samples)})
        rank, world, cfg = run.rank, run.world, run.cfg  # the run's copy: the model's path
    if rank == 0:  # after the run's close: its progress bar has ended its line
        print(json.dumps(summary(rows, steps, cfg, world)), flush=True)
    shutil.rmtree(out, ignore_errors=True)  # this rank's temporary run directory


if __name__ == "__main__":
    main()
