"""Training throughput, packed vs padded micro-batches, and peak memory, chunked vs unchunked
logprobs, through the trainer's own update (grpo.accumulate_gradients) on a random-init Qwen2
built from a config (no download). Prints one JSON line.

    python bench/train_step.py                       # CPU defaults: a 3.7M-parameter model
    python bench/train_step.py --hidden 896 --layers 24 --heads 14 --kv-heads 2 --vocab 151936 \
        --intermediate 4864 --samples 64 --dtype bfloat16   # Qwen2.5-0.5B's shapes, accelerator

The batch: `--samples` sequences whose lengths run from `--min-len` to 4x that (prompt of
`--prompt` tokens included): `--shape uniform` spreads them evenly; `skewed` (the default) puts
most near the short end with a tail to the long one, as sampled responses are (GSM8K: most
short, a few near the limit): length = min * 4 ** (x ** 2) for x evenly over [0, 1]. Each variant
runs in a fresh process (a process's peak memory only grows):
- packed / padded: grpo.pack true / false, tokens per second of real (unpadded) tokens, forward and
  backward, median of `--repeats` after one warm-up;
- chunked / unchunked: grpo.logprob_chunk 1024 / all rows at once; the peak memory of the step
  above what the process held before it (accelerator: max_memory_allocated; CPU: peak RSS).
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import npu_ops  # noqa: E402  (first: the platform environment before torch loads)

VARIANTS = {"packed": dict(pack=True, logprob_chunk=1024),
            "padded": dict(pack=False, logprob_chunk=1024),
            "unchunked": dict(pack=True, logprob_chunk=10**9)}


def run_one(args, variant: str) -> dict:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, Qwen2Config

    import fsdp_utils
    import grpo
    from rollout import Sample
    from train_grpo import init_distributed

    npu_ops.setup_env()
    init_distributed()
    device = npu_ops.local_device()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      intermediate_size=args.intermediate, tie_word_embeddings=True,
                      max_position_embeddings=4 * args.min_len + 8)
    attn = npu_ops.attention_implementation("auto")
    attn = fsdp_utils.register_packed_sdpa() if attn == "sdpa" else attn
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn,
                                             dtype=getattr(torch, args.dtype)).to(device)
    n, lo = args.samples, args.min_len
    g = torch.Generator().manual_seed(1)
    x = [i / max(n - 1, 1) for i in range(n)]
    lengths = [round(lo * (1 + 3 * t) if args.shape == "uniform" else lo * 4 ** (t * t)) for t in x]
    samples = [Sample(torch.randint(0, args.vocab, (args.prompt,), generator=g).tolist(),
                      torch.randint(0, args.vocab, (length - args.prompt,), generator=g).tolist(),
                      [], False) for length in lengths]
    for s in samples:
        s.logp = [-1.0] * len(s.response_ids)
    adv = torch.randn(n, generator=g)
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    gcfg = grpo.GRPOConfig(micro_batch_tokens=args.micro_batch_tokens, **VARIANTS[variant])

    def step():
        model.zero_grad(set_to_none=True)
        grpo.accumulate_gradients(model, samples, adv, None, None, gcfg, 0, device, 1.0, 4 * lo)
        npu_ops.synchronize()

    before = npu_ops.memory_gb()
    step()  # warm-up
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    after = npu_ops.memory_gb()
    if npu_ops.device_type() == "cpu":  # peak RSS over the process; its size before the steps
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20 - before["allocated"]
    else:
        peak = after["peak"] - before["allocated"]
    dist.destroy_process_group()
    return {"variant": variant, "tokens": tokens, "tokens_per_s": tokens / statistics.median(times),
            "step_s": statistics.median(times), "peak_gb_above_start": peak}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("hidden", 256), ("layers", 2), ("heads", 4), ("kv-heads", 2),
                          ("vocab", 16384), ("intermediate", 704), ("samples", 16),
                          ("prompt", 32), ("min-len", 96), ("micro-batch-tokens", 8192),
                          ("repeats", 3)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--shape", choices=["skewed", "uniform"], default="skewed")
    p.add_argument("--one", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(args, args.one)))
        return
    results = {}
    for variant in VARIANTS:  # each in a fresh process: peak memory is per process
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", variant],
                             capture_output=True, text=True, check=True,
                             env={**os.environ, "OMP_NUM_THREADS": os.environ.get(
                                 "OMP_NUM_THREADS", "2")})
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    pk, pd, un = results["packed"], results["padded"], results["unchunked"]
    print(json.dumps({
        "device": npu_ops.device_type(), "model": {k: getattr(args, k) for k in (
            "hidden", "layers", "vocab", "dtype")}, "samples": args.samples,
        "lengths": [args.min_len, 4 * args.min_len], "shape": args.shape,
        "tokens": pk["tokens"], "packed_tokens_per_s": round(pk["tokens_per_s"]),
        "padded_tokens_per_s": round(pd["tokens_per_s"]),
        "packed_speedup": round(pk["tokens_per_s"] / pd["tokens_per_s"], 2),
        "peak_gb_chunked": round(pk["peak_gb_above_start"], 3),
        "peak_gb_unchunked": round(un["peak_gb_above_start"], 3)}))


if __name__ == "__main__":
    main()
