"""Activation memory and seconds of one update's forward and backward at one long packed row,
sequence parallel (model.sp_size) 1 against 2, on a random-init Qwen2 built from a config (no
download). Prints one JSON line (rank 0).

    torchrun --nproc_per_node 2 bench/seq_parallel.py                   # 8192 tokens, fp32
    torchrun --nproc_per_node 2 bench/seq_parallel.py --tokens 16384 --hidden 512

Every rank holds the same samples (two of tokens / 2: the model's 4096 positions hold one);
at sp 1 each rank runs the whole row, at sp 2 each half of it. activation_gb: the bytes of the
tensors autograd saves for the backward during the forward (torch.autograd.graph's
saved_tensors_hooks, each storage counted once): what the backward keeps alive, per rank. The
weights and their gradients, the same either way, are not in it. seconds: the best of
--repeats forward+backward passes (trainer.accumulate_gradients) after one warm-up.
"""

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import npu_ops  # noqa: E402  (first: the platform environment before torch loads)
import torch  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import batcher  # noqa: E402
import fsdp_utils  # noqa: E402
from modeling import seq_parallel  # noqa: E402
import trainer  # noqa: E402
from common import random_qwen2, saved_bytes  # noqa: E402
from records import Sample  # noqa: E402
from train_grpo import init_distributed, load_config  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    npu_ops.setup_env(sp_size=2)  # sp_size 2 runs here too (the expansion mode it may take)
    rank, world = init_distributed()
    path = random_qwen2(args.hidden, args.layers, rank)
    half = args.tokens // 2
    g = torch.Generator().manual_seed(0)
    samples = [Sample(torch.randint(2, 15, (half // 2,), generator=g).tolist(),
                      torch.randint(2, 15, (half - half // 2,), generator=g).tolist(),
                      [-1.0] * (half - half // 2), False) for _ in range(2)]
    cfg = load_config(None, [f"--grpo.micro_batch_tokens={args.tokens}"]).grpo
    adv, out = torch.tensor([1.0, -1.0]), {"tokens": args.tokens, "world": world}
    for sp in (1, 2):
        spec = fsdp_utils.ModelConfig(path=path, param_dtype="float32", sp_size=sp)
        actor = fsdp_utils.build_actor(spec, init_device_mesh(npu_ops.device_type(), (world,)))

        batch = batcher.Batch.per_sample(samples, adv, 0, split=seq_parallel.split(sp))
        settings = trainer.settings(cfg, max_len=half, device=npu_ops.local_device())

        def step(actor=actor, batch=batch, settings=settings):
            trainer.accumulate_gradients(actor, batch, settings)

        out[f"sp{sp}_activation_gb"] = round(saved_bytes(step) / 2**30, 4)
        seconds = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - t)
        out[f"sp{sp}_s"] = round(min(seconds), 3)
    out["activation_ratio"] = round(out["sp2_activation_gb"] / out["sp1_activation_gb"], 3)
    if rank == 0:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
