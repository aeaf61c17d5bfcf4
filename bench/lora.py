"""LoRA against full fine-tuning at a real model's shapes (random weights): the weight push's
bytes and seconds, and the actor's and its optimizer's bytes per rank. Prints one JSON line.

    python bench/lora.py                 # Qwen2.5-0.5B's shapes, rank 16, one rank; ~3 minutes
    python bench/lora.py --world 2       # the same over 2 ranks

Each way runs in fresh processes (--world ranks under torchrun): the actor built as the
trainer builds it (fsdp_utils.build_actor, compute dtype --dtype), its AdamW state made by one
step on zero gradients, an engine in --dtype beside it, and --pushes timed weight pushes
(the engine's weights woken, weight_sync.load: gather, cast, write into the engine; its KV cache
woken), the median kept. full: every weight,
fp32 master copy and Adam's two fp32 moments for each. lora: adapters of --rank on every linear
layer of the decoder (q, k, v, o, gate, up, down), the base frozen in the compute dtype, Adam's
moments for the adapters only, and the push writes only them, in place. "actor_gb" and "optim_gb"
are one rank's bytes of parameters and of optimizer state (its shards: FSDP2 splits both);
"push_bytes" what one push sends into the engine.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import npu_ops  # noqa: E402  (first: the platform environment before torch loads)

from common import SHAPES, random_qwen2, shut_down  # noqa: E402


def local_bytes(tensors) -> int:
    """Bytes this rank holds of `tensors` (a DTensor's local shard)."""
    import torch

    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.to_local() if hasattr(t, "to_local") else t
            total += t.numel() * t.element_size()
    return total


def measure(args) -> dict:
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp_utils
    import rollout
    import train_grpo
    import weight_sync

    rank, world = train_grpo.init_distributed()
    model = random_qwen2(rank=rank, **SHAPES[args.shape])
    cfg = fsdp_utils.ModelConfig(path=model, param_dtype=args.dtype)
    if args.mode == "lora":
        cfg.lora = fsdp_utils.LoraConfig(rank=args.rank, alpha=2.0 * args.rank)
    # the engine first, on an empty device, as the trainer builds them
    engine = rollout.Engine(rollout.RolloutConfig(
        dtype=args.dtype, max_model_len=256, kv_cache_memory_bytes=64 << 20,
        max_new_tokens=8), model, lora=cfg.lora)
    actor = fsdp_utils.build_actor(cfg, init_device_mesh(npu_ops.device_type(), (world,)))
    opt, _ = fsdp_utils.build_optimizer(fsdp_utils.OptimConfig(), actor, 10)
    for p in actor.parameters():  # Adam's state exists from its first step
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    out = {"actor_gb": local_bytes(actor.parameters()) / 2**30,
           "optim_gb": local_bytes(v for s in opt.state.values() for v in s.values()) / 2**30,
           "params": sum(p.numel() for p in actor.parameters()),
           "trainable": sum(p.numel() for p in actor.parameters() if p.requires_grad)}
    seconds = []
    for _ in range(args.pushes + 1):  # the first one warms up (and registers an adapter)
        t = time.perf_counter()
        engine.wake(["weights"])
        sent = weight_sync.load(actor, engine)
        engine.wake(["kv_cache"])
        npu_ops.synchronize()
        seconds.append(time.perf_counter() - t)
        engine.generate([[1, 2, 3]], n=1)  # the engine uses what it got (a slot, the weights)
    out.update(push_bytes=sent, push_s=statistics.median(seconds[1:]))
    shut_down(engine)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", help="the compute and engine dtype")
    p.add_argument("--pushes", type=int, default=3)
    p.add_argument("--world", type=int, default=1, help="ranks")
    p.add_argument("--mode", choices=("full", "lora"), help="(one way, in this process)")
    args = p.parse_args()
    if args.mode:
        out = measure(args)
        if int(os.environ.get("RANK", "0")) == 0:
            print("RESULT " + json.dumps(out), flush=True)
        return
    import socket

    world = args.world
    result = {"shape": args.shape, "rank": args.rank, "dtype": args.dtype, "world": world,
              "cpus": os.cpu_count()}
    for mode in ("full", "lora"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
               f"--master_port={port}", os.path.abspath(__file__), "--mode", mode, "--shape",
               args.shape, "--rank", str(args.rank), "--dtype", args.dtype, "--pushes",
               str(args.pushes)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if proc.returncode or line is None:
            sys.exit(f"bench/lora.py --mode {mode} failed:\n{proc.stderr[-3000:]}")
        result[mode] = {k: round(v, 4) if isinstance(v, float) else v
                        for k, v in json.loads(line[len("RESULT "):]).items()}
    full, lora = result["full"], result["lora"]
    result["push_bytes_ratio"] = round(lora["push_bytes"] / full["push_bytes"], 5)
    result["push_s_ratio"] = round(lora["push_s"] / full["push_s"], 4)
    result["actor_optim_ratio"] = round((lora["actor_gb"] + lora["optim_gb"])
                                        / (full["actor_gb"] + full["optim_gb"]), 4)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
