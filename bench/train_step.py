"""Training throughput, packed vs padded micro-batches, and peak memory, chunked vs unchunked
logprobs, through the trainer's own update (trainer.accumulate_gradients on the FSDP2 actor that
fsdp_utils.build_actor makes) on a random-init Qwen2 built from a config (no download). Prints
one JSON line.

    python bench/train_step.py                       # CPU defaults: a 5.7M-parameter model
    python bench/train_step.py --world 2             # the same batch over 2 ranks (torchrun)
    python bench/train_step.py --shape qwen2.5-0.5b --samples 64 --dtype bfloat16  # accelerator

The batch: `--samples` sequences whose lengths run from `--min-len` to 4x that (prompt of
`--prompt` tokens included): `--lengths uniform` spreads them evenly; `skewed` (the default) puts
most near the short end with a tail to the long one, as sampled responses are (GSM8K: most
short, a few near the limit): length = min * 4 ** (x ** 2) for x evenly over [0, 1]; `fixed`
makes every one `--min-len` long (bench/step.py's batch, whose responses all run to the limit).
Each variant runs in fresh processes (a process's peak memory only grows), `--world` of them
under torchrun, rank r taking samples r, r + world, ... as the trainer splits a batch:
- packed / padded: grpo.pack true / false, tokens per second of real (unpadded) tokens over all
  ranks, forward and backward, median of `--repeats` after one warm-up;
- chunked / unchunked: grpo.logprob_chunk 1024 / all rows at once; the peak memory of the steps
  above what the process held before them, rank 0 (accelerator: max_memory_allocated; CPU: the
  resident-memory high-water mark, reset before the steps).
Beside the packed update, in the same process and on the same micro-batches (rank 0's), its
floors, each the median of `--repeats`:
- gemm: the matrix multiplies of the same shapes timed alone on random tensors of the compute
  dtype: for every linear layer (q, k, v, o, gate, up, down of each decoder layer) over the
  micro-batch's tokens and the output layer over its response tokens (the rows the loss needs),
  three GEMMs each (forward; backward: input and weight gradients). Attention's own products,
  the norms and the elementwise work are left out;
- bare: a plain Hugging Face forward/backward of the same model (fp32 weights, autocast to the
  compute dtype, no FSDP), the same packed rows (position ids; transformers' attention for the
  platform), unchunked logits in fp32 and a logprob loss; no optimizer step in either (null
  when those logits do not fit in device memory).
With `--profile FILE`, one more packed pass runs under the profiler: its ops by device time go to
FILE, and the line gets `update_profile`, the counts of bench/common.py's `profiled` (kernel
launches, synchronisations, host reads, ...) and `update_tflops`, the matrix TFLOP/s of the
packed pass (fsdp_utils.flops_per_token over its seconds).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import npu_ops  # noqa: E402  (first: the platform environment before torch loads)
from common import add_model_args, model_from_args, profiled, timed  # noqa: E402

VARIANTS = {"packed": dict(pack=True, logprob_chunk=1024),
            "padded": dict(pack=False, logprob_chunk=1024),
            "unchunked": dict(pack=True, logprob_chunk=10**9)}


def reset_peak() -> None:
    """Start the peak afresh: the device allocator's, or on CPU the process's resident-memory
    high-water mark (Linux: writing 5 to /proc/self/clear_refs resets VmHWM)."""
    if npu_ops.device_type() == "cpu":
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    else:
        npu_ops.device_module().reset_peak_memory_stats()


def peak_gb() -> float:
    """The peak since reset_peak, in GiB: max_memory_allocated, or on CPU VmHWM."""
    if npu_ops.device_type() != "cpu":
        return npu_ops.memory_gb()["peak"]
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 2**20


def run_one(args, variant: str) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import batcher
    import fsdp_utils
    import grpo
    import logprobs
    import trainer
    from records import Sample
    from train_grpo import init_distributed

    npu_ops.setup_env()
    rank, world = init_distributed()
    device = npu_ops.local_device()
    path = model_from_args(args, rank)
    model = fsdp_utils.build_actor(
        fsdp_utils.ModelConfig(path=path, param_dtype=args.dtype, fused_kernels=args.kernels),
        init_device_mesh(npu_ops.device_type(), (world,)))
    vocab = model.config.vocab_size
    n, lo = args.samples, args.min_len
    g = torch.Generator().manual_seed(1)
    x = [i / max(n - 1, 1) for i in range(n)]
    spread = {"uniform": lambda t: lo * (1 + 3 * t), "skewed": lambda t: lo * 4 ** (t * t),
              "fixed": lambda t: lo}[args.lengths]
    lengths = [round(spread(t)) for t in x]
    samples = [Sample(torch.randint(0, vocab, (args.prompt,), generator=g).tolist(),
                      torch.randint(0, vocab, (length - args.prompt,), generator=g).tolist(),
                      [], False) for length in lengths]
    for s in samples:
        s.logp = [-1.0] * len(s.response_ids)
    adv = torch.randn(n, generator=g)
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)  # all ranks
    rows = sum(len(s.response_ids) for s in samples)  # the output layer's, all ranks
    samples, adv = samples[rank::world], adv[rank::world]  # this rank's share
    gcfg = grpo.GRPOConfig(micro_batch_tokens=args.micro_batch_tokens, **VARIANTS[variant])

    batch = batcher.Batch.per_sample(samples, adv, 0)
    settings = trainer.settings(gcfg, max_len=4 * lo, device=device)

    def step():
        model.zero_grad(set_to_none=True)
        trainer.accumulate_gradients(model, batch, settings)
        npu_ops.synchronize()

    before = npu_ops.memory_gb()["allocated"]
    reset_peak()  # the peak of the steps, not of loading the model
    step()  # warm-up
    times = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    peak = peak_gb() - before
    n_params = sum(p.numel() for p in model.parameters())
    out = {"variant": variant, "tokens": tokens, "params_m": round(n_params / 1e6, 1),
           "tokens_per_s": tokens / statistics.median(times), "step_s": statistics.median(times),
           "peak_gb_above_start": peak}
    if variant == "packed":
        body, head = fsdp_utils.flops_per_token(model)
        out["update_tflops"] = (body * tokens + head * rows) / out["step_s"] / world / 1e12
        if args.profile:
            out["update_profile"] = profiled(step, args.profile)
        plan = [[samples[i] for i in idx] for idx in
                logprobs.micro_batch_plan(samples, gcfg.micro_batch_tokens, True)]
        out["gemm_s"] = gemm_floor(model.config, plan, getattr(torch, args.dtype), device,
                                   args.repeats)
        try:  # unchunked fp32 logits: at 1.5B, 16384 tokens a row outgrew an 80 GB H100
            out["bare_s"] = bare_floor(path, plan, getattr(torch, args.dtype), device,
                                       args.repeats)
        except torch.OutOfMemoryError:
            out["bare_s"] = None
    dist.destroy_process_group()
    return out


def gemm_floor(cfg, plan: list, dtype, device, repeats: int) -> float:
    """Seconds of the forward and backward GEMMs of every linear layer and the output layer over
    the micro-batches of `plan` (lists of samples), timed alone: each distinct shape once, times
    the number of its uses."""
    import collections

    import torch

    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    hd = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    layer = [(H, q), (H, kv), (H, kv), (q, H), (H, I), (H, I), (I, H)]  # (in, out) per linear
    uses = collections.Counter()
    for batch in plan:
        n = sum(len(s.prompt_ids) + len(s.response_ids) for s in batch)
        k = sum(len(s.response_ids) for s in batch)
        for rows, (d_in, d_out), count in [(n, x, cfg.num_hidden_layers) for x in layer] + [
                (k, (H, V), 1)]:
            # forward (rows, in) @ (in, out); input gradient (rows, out) @ (out, in); weight
            # gradient (out, rows) @ (rows, in)
            for shape in ((rows, d_in, d_out), (rows, d_out, d_in), (d_out, rows, d_in)):
                uses[shape] += count
    total = 0.0
    for (m, k, n), count in uses.items():
        a = torch.randn(m, k, dtype=dtype, device=device)
        b = torch.randn(k, n, dtype=dtype, device=device)
        total += count * timed(lambda: a @ b, repeats)
    return total


def bare_floor(path: str, plan: list, dtype, device, repeats: int) -> float:
    """Seconds of a plain Hugging Face forward/backward over the micro-batches of `plan`."""
    import torch
    from transformers import AutoModelForCausalLM

    # plain transformers' attention for the platform: its flash_attention_2 route where the
    # trainer would take the fused kernel, sdpa elsewhere
    fused = npu_ops.attention_implementation("auto") == npu_ops.FUSION_ATTENTION
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32,
        attn_implementation="flash_attention_2" if fused else "sdpa").to(device)
    batches = []
    for batch in plan:
        ids = [t for s in batch for t in s.prompt_ids + s.response_ids]
        pos = [t for s in batch for t in range(len(s.prompt_ids) + len(s.response_ids))]
        mask = [float(len(s.prompt_ids) <= j < len(s.prompt_ids) + len(s.response_ids))
                for s in batch  # position j - 1 predicts a response token
                for j in range(1, len(s.prompt_ids) + len(s.response_ids) + 1)]
        batches.append([torch.tensor(x, device=device)[None] for x in (ids, pos, mask)])

    def step():
        model.zero_grad(set_to_none=True)
        for ids, pos, mask in batches:
            with torch.autocast(npu_ops.device_type(), dtype=dtype,
                                enabled=dtype != torch.float32):
                logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
            logp = logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
            (-(logp * mask[:, :-1]).sum() / mask.sum()).backward()

    return timed(step, repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(p, hidden=256, layers=2, heads=4, kv_heads=2, intermediate=704, vocab=16384,
                   tie=1)
    for name, default in (("samples", 16), ("prompt", 32), ("min-len", 96),
                          ("micro-batch-tokens", 8192), ("repeats", 3), ("world", 1)):
        p.add_argument(f"--{name}", type=int, default=default)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--lengths", choices=["skewed", "uniform", "fixed"], default="skewed")
    p.add_argument("--profile", help="a file for the profile of one packed pass")
    p.add_argument("--kernels", default="auto", help="model.fused_kernels (compiled: A/B it)")
    p.add_argument("--one", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        result = run_one(args, args.one)
        if int(os.environ.get("RANK", "0")) == 0:
            print(json.dumps(result))
        return
    launch = ([sys.executable] if args.world == 1 else
              [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={args.world}"])
    results = {}
    for variant in VARIANTS:  # each in fresh processes: peak memory is per process
        out = subprocess.run([*launch, __file__, *sys.argv[1:], "--one", variant],
                             capture_output=True, text=True, check=True,
                             env={**os.environ, "OMP_NUM_THREADS": os.environ.get(  # a core
                                 "OMP_NUM_THREADS", str(max(1, os.cpu_count() // args.world)))})
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    pk, pd, un = results["packed"], results["padded"], results["unchunked"]
    update, gemm, bare = pk["step_s"], pk["gemm_s"], pk["bare_s"]
    print(json.dumps({
        "device": npu_ops.device_type(), "world": args.world, "params_m": pk["params_m"],
        "dtype": args.dtype, "samples": args.samples,
        "lengths": [args.min_len, 4 * args.min_len], "spread": args.lengths,
        "tokens": pk["tokens"], "packed_tokens_per_s": round(pk["tokens_per_s"]),
        "padded_tokens_per_s": round(pd["tokens_per_s"]),
        "packed_speedup": round(pk["tokens_per_s"] / pd["tokens_per_s"], 2),
        "peak_gb_chunked": round(pk["peak_gb_above_start"], 3),
        "peak_gb_unchunked": round(un["peak_gb_above_start"], 3),
        "update_s": round(update, 4), "gemm_floor_s": round(gemm, 4),
        "bare_fwd_bwd_s": bare and round(bare, 4),  # None: it ran out of memory
        "update_over_gemm": round(update / gemm, 2),
        "update_over_bare": bare and round(update / bare, 2),
        "bare_over_gemm": bare and round(bare / gemm, 2),
        "update_tflops": round(pk["update_tflops"], 2),
        **{k: pk[k] for k in ("update_profile",) if k in pk}}))


if __name__ == "__main__":
    main()
