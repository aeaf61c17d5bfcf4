"""Our step beside TRL's on one machine: TRL's GRPOTrainer in its colocated mode (vLLM in the
same process, sleep mode) and bench/step.py, on the same random-init model and the same
synthetic prompts, each run in a fresh process, ours then TRL's for each shape. Prints one JSON
line per run as it ends, then a summary line: per shape the median step after the first of
each, and ours / TRL's.

    python bench/vs_trl.py --shapes qwen2.5-0.5b qwen2.5-1.5b --steps 4 --out /tmp/vs_trl

TRL is needed only here: `pip install trl==1.16.0` (accelerate comes with it). The work of a step,
the same in both: 64 prompts of `--prompt-len` tokens (bench/step.py's synthetic prompts), 8
responses each, every response `--new-tokens` long (EOS ignored), at temperature 1; the engine in
bf16 (TRL's is told so: it would take the checkpoint's fp32), `--gpu-memory` of the device for
it, sleeping between rollouts; the update in bf16 autocast over fp32 weights and AdamW state, one
optimizer step per rollout, token-mean loss, no KL term, gradients clipped to 1, per-token
importance weights capped at 2 against the engine's logprobs (TRL: token_truncate), no gradient
checkpointing. Ours runs `--config` (configs/qwen2.5-0.5b-gsm8k-cuda1.yaml: packed micro-batches
of 16384 tokens); TRL's micro-batch is `--trl-micro` sequences per shape (32 ran out of memory
at 1.5B on an H100; 8 fits), with gradient accumulation up to the 512 samples. TRL recomputes
the old policy's logprobs in a forward of its own before the update (its importance weights
need them); ours takes them from the update's own forward. Step times: TRL's between its
`on_step_begin` and `on_step_end` callbacks, the device drained at each; ours the trainer's
`step_time_s`.
With `--budget-s`, each run's timeout is the time left, and a run started with under a minute
left is skipped and named in the summary. Logs of every run stay in `--out`.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import npu_ops  # noqa: E402  (first: the platform environment before torch loads)
from common import SHAPES, random_qwen2  # noqa: E402

PROMPTS, G = 64, 8
TRL_MICRO = {"qwen2.5-0.5b": 32, "qwen2.5-1.5b": 8}


def last_json(text: str) -> dict:
    lines = [line for line in text.splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def run_logged(cmd: list[str], log: str, timeout: float) -> dict:
    """Run `cmd`, its output into the file `log`; its last JSON line (empty when none), with
    the exit code and the wall seconds."""
    t = time.perf_counter()
    with open(log, "w") as f:
        try:
            code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
        except subprocess.TimeoutExpired:
            code = 124
    with open(log, errors="replace") as f:
        out = last_json(f.read())
    return {**out, "exit": code, "wall_s": round(time.perf_counter() - t, 1)}


def ours(args, shape: str, out: str, timeout: float) -> dict:
    cmd = [sys.executable, os.path.join(HERE, "step.py"), "--config", args.config, "--shape", shape,
           "--prompt-len", str(args.prompt_len), "--steps", str(args.steps),
           f"--rollout.max_new_tokens={args.new_tokens}", f"--grpo.prompts_per_step={PROMPTS}",
           f"--grpo.group_size={G}", f"--rollout.gpu_memory_utilization={args.gpu_memory}",
           "--rollout.temperature=1.0", "--grpo.kl_coef=0", "--optim.grad_clip=1.0",
           "--grpo.is_correction=tis", "--grpo.is_cap=2.0", "--grpo.loss_agg=token_mean",
           "--model.gradient_checkpointing=false", "--model.param_dtype=bfloat16",
           "--rollout.dtype=bfloat16", *([] if shape in args.floor_shapes else ["--no-floor"]),
           *(f"--{item}" for item in args.ours_set)]
    got = run_logged(cmd, os.path.join(out, f"ours_{shape}.log"), timeout)
    return {"trainer": "ours", "shape": shape, **got}


def trl(args, shape: str, model: str, prompts: str, out: str, timeout: float) -> dict:
    micro = args.trl_micro.get(shape, 8)
    cmd = [sys.executable, os.path.abspath(__file__), "--trl-worker", "--trl-sync", args.trl_sync,
           "--model", model,
           "--prompts", prompts, "--steps", str(args.steps), "--micro", str(micro),
           "--new-tokens", str(args.new_tokens), "--gpu-memory", str(args.gpu_memory)]
    got = run_logged(cmd, os.path.join(out, f"trl_{shape}.log"), timeout)
    return {"trainer": "trl", "shape": shape, "micro": micro, **got}


def reload_sync(self) -> None:
    """TRL's weight sync for engines whose model no longer loads weights outside vLLM's loading
    context (vLLM 0.32, as the CPU check runs): TRL's own named tensors, written in place by
    vLLM's layerwise reload as rollout.py writes ours."""
    import rollout

    if self.enable_sleep_mode:
        self.llm.wake_up(tags=["weights"])
        self._llm_weights_sleeping = False
    rollout._reload_weights_in_place(self.llm, list(self._iter_named_params()))
    self.llm.reset_prefix_cache()


def trl_worker(args) -> None:
    """One TRL run in this process; prints its JSON line last."""
    import datasets
    import torch
    import trl as trl_lib
    import trl.generation.vllm_generation as vllm_generation  # TRL 1.16: builds its LLM here
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    build = vllm_generation.LLM
    vllm_generation.LLM = lambda *a, **kw: build(*a, **{**kw, "dtype": "bfloat16"})
    if args.trl_sync == "reload":
        vllm_generation.VLLMGeneration.sync_weights = reload_sync
    with open(args.prompts) as f:
        rows = [{"prompt": json.loads(line)["prompt"]} for line in f]
    per_step = PROMPTS * G
    config = trl_lib.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="vs_trl_"), report_to="none", save_strategy="no",
        seed=0, bf16=True, use_cpu=npu_ops.device_type() == "cpu", max_steps=args.steps,
        learning_rate=1e-6, weight_decay=0.01,
        lr_scheduler_type="constant", max_grad_norm=1.0, beta=0.0, loss_type="dapo",
        per_device_train_batch_size=args.micro, gradient_accumulation_steps=per_step // args.micro,
        num_generations=G, max_completion_length=args.new_tokens, temperature=1.0,
        gradient_checkpointing=False, use_vllm=True, vllm_mode="colocate",
        vllm_enable_sleep_mode=npu_ops.engine_supports_sleep(),  # (vLLM on CPU: none)
        vllm_gpu_memory_utilization=args.gpu_memory,
        vllm_max_model_length=args.max_model_len, vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=2.0,
        generation_kwargs={"ignore_eos": True}, logging_steps=1, log_completions=False,
        dataloader_num_workers=0)
    times, begun = [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            npu_ops.synchronize()
            begun.append(time.perf_counter())

        def on_step_end(self, *a, **kw):
            npu_ops.synchronize()
            times.append(time.perf_counter() - begun[-1])
            print(json.dumps({"step": len(times), "s": round(times[-1], 3)}), flush=True)

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    trainer = trl_lib.GRPOTrainer(
        model=model, processing_class=tokenizer, args=config, callbacks=[Clock()],
        train_dataset=datasets.Dataset.from_list(rows),
        reward_funcs=lambda completions, **kw: [float(len(c) % 2) for c in completions])
    trainer.train()
    last = next((h for h in reversed(trainer.state.log_history) if "loss" in h), {})
    print(json.dumps({"trl": trl_lib.__version__, "step_s": [round(t, 3) for t in times],
                      "median_step_s": statistics.median(times[1:] or times),
                      "peak_gb": round(npu_ops.memory_gb()["peak"], 2),
                      "last_log": {k: v for k, v in last.items() if isinstance(v, (int, float))
                                   and k.startswith(("completions/mean_length", "loss",
                                                     "grad_norm", "sampling/"))}}), flush=True)


def summary(results: list[dict], skipped: list[str]) -> dict:
    """Per shape: each trainer's median step after the first, and ours / TRL's."""
    table = {}
    for r in results:
        if r.get("exit") != 0:
            continue
        med = (r["seconds"]["step"] if r["trainer"] == "ours" else r["median_step_s"])
        row = table.setdefault(r["shape"], {})
        row[f"{r['trainer']}_step_s"] = round(med, 3)
        if r["trainer"] == "ours":
            row.update({k: r[k] for k in ("generate_over_floor", "mfu", "train_tflops")
                        if k in r}, ours_seconds=r["seconds"])
    for row in table.values():
        if "ours_step_s" in row and "trl_step_s" in row:
            row["ours_over_trl"] = round(row["ours_step_s"] / row["trl_step_s"], 3)
    return {"summary": table, "skipped": skipped,
            "failed": [f"{r['trainer']} {r['shape']} (exit {r['exit']})" for r in results
                       if r.get("exit") != 0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b"],
                   choices=sorted(SHAPES))
    p.add_argument("--steps", type=int, default=4, help="per run; the first is not measured")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=1536)
    p.add_argument("--gpu-memory", type=float, default=0.4)
    p.add_argument("--config", default=os.path.join(os.path.dirname(HERE), "configs",
                                                    "qwen2.5-0.5b-gsm8k-cuda1.yaml"))
    p.add_argument("--trl-micro", type=json.loads, default=TRL_MICRO,
                   help="JSON: sequences per TRL micro-batch, per shape")
    p.add_argument("--floor-shapes", nargs="*", default=None,
                   help="shapes whose run of ours also times the bare generation (default all)")
    p.add_argument("--ours-set", nargs="*", default=[], metavar="SECTION.KEY=VALUE",
                   help="more overrides of ours, e.g. model.fused_kernels=compiled")
    p.add_argument("--budget-s", type=float, default=0, help="0: no limit")
    p.add_argument("--timeout-s", type=float, default=900, help="per run")
    p.add_argument("--out", default=None, help="a folder for the logs and results.jsonl")
    p.add_argument("--trl-only", action="store_true", help="skip ours (a check of the TRL side)")
    p.add_argument("--trl-sync", choices=["own", "reload"], default="own",
                   help="TRL's weight sync: its own (per-tensor load_weights), or vLLM's "
                        "layerwise reload, for vLLM 0.32 where its own fails (the CPU check)")
    p.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--prompts", help=argparse.SUPPRESS)
    p.add_argument("--micro", type=int, default=8, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_worker:
        return trl_worker(args)
    args.floor_shapes = args.shapes if args.floor_shapes is None else args.floor_shapes
    out = args.out or tempfile.mkdtemp(prefix="vs_trl_")
    os.makedirs(out, exist_ok=True)
    start, results, skipped = time.perf_counter(), [], []
    from step import synthetic_prompts  # the prompts ours makes for itself, the same seed

    for shape in args.shapes:
        model = random_qwen2(rank=0, **SHAPES[shape])  # written once; ours finds it there
        prompts = synthetic_prompts(os.path.join(tempfile.mkdtemp(prefix="vs_trl_"), "p.jsonl"),
                                    4 * PROMPTS, args.prompt_len)
        for who in ([] if args.trl_only else ["ours"]) + ["trl"]:
            left = args.budget_s - (time.perf_counter() - start) if args.budget_s else 1e9
            if left < 60:  # not even the engine's start
                skipped.append(f"{who} {shape}")
                continue
            timeout = min(args.timeout_s, left)
            r = (ours(args, shape, out, timeout) if who == "ours"
                 else trl(args, shape, model, prompts, out, timeout))
            results.append(r)
            print(json.dumps(r), flush=True)
            with open(os.path.join(out, "results.jsonl"), "a") as f:
                f.write(json.dumps(r) + "\n")
    print(json.dumps(summary(results, skipped)), flush=True)


if __name__ == "__main__":
    main()
