"""One GRPO step, phase by phase, through the trainer's own loop, beside the generation floor.
Prints one JSON line (rank 0).

    python bench/step.py                                         # configs/tiny_cpu.yaml, 1 rank
    torchrun --nproc_per_node 2 bench/step.py --rollout.max_new_tokens=32 --rollout.max_model_len=64
    python bench/step.py --config configs/qwen2.5-0.5b-gsm8k-cuda1.yaml --shape qwen2.5-0.5b \
        --prompt-len 128 --rollout.max_new_tokens=512        # a random model of real shapes

It runs `train_grpo.train` for `--steps` steps of `--config`, further `--section.key=value`
arguments overriding it (no eval, no checkpoints, no wandb, a temporary out_dir). With --shape
or --hidden the model is a random-init Qwen2 of those shapes (bench/common.py) and the data
`--prompt-len`-token prompts of the tiny task's alphabet, scored by the tiny task's reward.
Two bench-only changes to the engine:
- every response runs to `rollout.max_new_tokens` (EOS ignored), so runs and steps compare;
- the floor: beside each rollout `generate`, a bare `LLM.generate` of the same prompts with the
  same n, temperature, top_p and max_tokens (and nothing else: no logprobs, no per-prompt
  seeds), on the same engine in the same process, the prefix cache emptied before each of the
  two; which of them goes first alternates from step to step.
The line holds the median over the steps after the first of each phase's seconds (rank 0's
clock): generate (the trainer's, without the floor), sync (wake, gather, load), reward, sleep,
logprobs (old-policy and reference passes, when the variant has them), train (the update),
switch_out/in (model.offload); step is the step's wall time without the floor. Then
generate / floor, tokens per second (response tokens per engine; prompt + response tokens of the
whole step per rank), and on accelerators the device memory that the engine's sleep and the
context switch (switch_out) freed.
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
import rollout  # noqa: E402
import train_grpo  # noqa: E402
from common import add_model_args, model_from_args  # noqa: E402
from data import DataConfig  # noqa: E402
from rewards import RewardConfig  # noqa: E402

PHASES = ("generate", "floor", "sync", "reward", "sleep", "logprobs", "train", "switch_out",
          "switch_in", "step")


class BenchEngine(rollout.Engine):
    """The trainer's engine, responses forced to full length, with the floor measured beside
    every rollout generate. `steps` gets one entry per weight load (one per training step)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ignore_eos = True
        self.steps = []

    def load_weights(self, named_tensors) -> None:
        super().load_weights(named_tensors)
        self.steps.append(dict(generate=0.0, floor=0.0, tokens=0, floor_tokens=0))

    def generate(self, prompt_ids, n, greedy=False, seed=None):
        from vllm import SamplingParams

        if greedy:
            return super().generate(prompt_ids, n, greedy, seed)
        step = self.steps[-1]
        params = SamplingParams(n=n, temperature=self.cfg.temperature, top_p=self.cfg.top_p,
                                max_tokens=self.cfg.max_new_tokens, ignore_eos=True)

        def floor():
            self.llm.reset_prefix_cache()
            t = time.perf_counter()
            outs = self.llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params,
                                     use_tqdm=False)
            step["floor"] += time.perf_counter() - t
            step["floor_tokens"] += sum(len(c.token_ids) for o in outs for c in o.outputs)

        floor_first = len(self.steps) % 2 == 0
        if floor_first:
            floor()
        self.llm.reset_prefix_cache()
        t = time.perf_counter()
        samples = super().generate(prompt_ids, n, greedy, seed)
        step["generate"] += time.perf_counter() - t
        step["tokens"] += sum(len(s.response_ids) for s in samples)
        if not floor_first:
            floor()
        return samples


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

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return round(sum(p.numel() for p in model.parameters()) / 1e6, 1)


def summary(rows: list[dict], steps: list[dict], cfg, world: int) -> dict:
    """The JSON line: medians over the steps after the first (all steps if there is one)."""
    rows, steps = rows[1:] or rows, steps[1:] or steps
    phase = {name: [] for name in PHASES}
    for row, s in zip(rows, steps):
        for name in ("sync", "reward", "sleep", "logprobs", "train", "switch_out", "switch_in"):
            phase[name].append(row.get(f"{name}_time_s", 0.0))
        phase["generate"].append(s["generate"])
        phase["floor"].append(s["floor"])
        phase["step"].append(row["step_time_s"] - s["floor"])
    med = {name: statistics.median(v) for name, v in phase.items()}
    ratios = [s["generate"] / s["floor"] for s in steps]
    # tokens_per_s: prompt + response tokens of all ranks over the step's time (with the floor)
    step_tokens = statistics.median(r["tokens_per_s"] * r["step_time_s"] for r in rows)
    out = {"device": npu_ops.device_type(), "world": world, "params_m": params_m(cfg.model.path),
           "dtype": cfg.rollout.dtype, "new_tokens": cfg.rollout.max_new_tokens,
           "response_tokens": [s["tokens"] for s in steps],  # per engine, each measured step
           "floor_response_tokens": [s["floor_tokens"] for s in steps],
           "steps_measured": len(steps), "seconds": {k: round(v, 4) for k, v in med.items()},
           "generate_over_floor": round(statistics.median(ratios), 3),
           "generate_over_floor_range": [round(min(ratios), 3), round(max(ratios), 3)],
           "generate_tokens_per_s": round(statistics.median(
               s["tokens"] / s["generate"] for s in steps)),
           "floor_tokens_per_s": round(statistics.median(
               s["floor_tokens"] / s["floor"] for s in steps)),
           "step_tokens_per_s_per_rank": round(step_tokens / med["step"] / world)}
    last = rows[-1]
    for event in ("sleep", "switch_out"):  # accelerators: device memory before - after
        if f"mem_{event}_before_gb" in last:
            out[f"mem_freed_by_{event}_gb"] = round(
                last[f"mem_{event}_before_gb"] - last[f"mem_{event}_after_gb"], 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompt-len", type=int, default=16, help="with a random model: its prompts")
    add_model_args(p)
    args, overrides = p.parse_known_args()
    out = tempfile.mkdtemp(prefix="bench_step_")
    cfg = train_grpo.load_config(args.config, [
        *overrides, f"--train.steps={args.steps}", f"--log.out_dir={out}", "--log.eval_every=0",
        "--log.save_every=0", "--log.samples_every=0", "--log.wandb=disabled"])
    if args.shape or args.hidden:  # a random model of those shapes, prompts of the tiny alphabet
        npu_ops.setup_env(graph_mode=not cfg.rollout.enforce_eager, tp_size=cfg.rollout.tp_size)
        rank, _ = train_grpo.init_distributed()  # train() joins the same process group
        cfg.model.path = model_from_args(args, rank)
        prompts = os.path.join(out, f"prompts_{rank}.jsonl")  # every rank writes its own copy
        synthetic_prompts(prompts, 4 * cfg.grpo.prompts_per_step, args.prompt_len)
        cfg.data = DataConfig(path=prompts, max_prompt_len=args.prompt_len)
        cfg.reward = RewardConfig(funcs=["tiny_sum"])
    engines = []

    def bench_engine(*a, **k):  # train() builds its engine through rollout.Engine
        engines.append(BenchEngine(*a, **k))
        return engines[-1]

    rollout.Engine = bench_engine
    train_grpo.train(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        world = int(os.environ.get("WORLD_SIZE", "1"))
        print(json.dumps(summary(rows, engines[0].steps, cfg, world)), flush=True)
    shutil.rmtree(out, ignore_errors=True)  # this rank's (the final export: 2 GB for 0.5B fp32)


if __name__ == "__main__":
    main()
