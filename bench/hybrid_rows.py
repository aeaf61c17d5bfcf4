"""The update of a Qwen3.5 hybrid on a skewed mix of lengths, its rows planned as first fit
alone plans them and with the padding bound (logprobs.LINEAR_PADDING), on the tiny task's
random-init hybrid (tiny_task.build_tiny_model, no download), one rank. Prints one JSON line.

    python bench/hybrid_rows.py
    python bench/hybrid_rows.py --long 2200 --short 100 150 --count 10 --budget 4096

The mix: one --long-token sample and --count samples of each --short length. For each plan:
its rows, the largest samples x longest of a row (the positions the Gated DeltaNet layers run),
the bytes autograd saves for the backward (common.saved_bytes) and the best of --repeats
forward+backward passes after a warm-up (common.timed).
"""

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import npu_ops  # noqa: E402  (first: the platform environment before torch loads)
import torch  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import batcher  # noqa: E402
import fsdp_utils  # noqa: E402
import logprobs  # noqa: E402
import trainer  # noqa: E402
from common import saved_bytes, timed  # noqa: E402
from records import Sample  # noqa: E402
from tasks import tiny_task  # noqa: E402
from train_grpo import init_distributed, load_config  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--long", type=int, default=2200)
    p.add_argument("--short", type=int, nargs="+", default=[100, 150])
    p.add_argument("--count", type=int, default=10)
    p.add_argument("--budget", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    init_distributed()
    path = os.path.join(tempfile.mkdtemp(), "model")
    tiny_task.build_tiny_model(15, 1, 0, arch="qwen3_5").save_pretrained(path)
    actor = fsdp_utils.build_actor(fsdp_utils.ModelConfig(path=path, param_dtype="float32"),
                                   init_device_mesh(npu_ops.device_type(), (1,)))
    g = torch.Generator().manual_seed(0)
    lengths = [args.long] + [n for _ in range(args.count) for n in args.short]
    samples = [Sample(torch.randint(2, 15, (n - 8,), generator=g).tolist(),
                      torch.randint(2, 15, (8,), generator=g).tolist(), [-1.0] * 8, False)
               for n in lengths]
    cfg = load_config(None, [f"--grpo.micro_batch_tokens={args.budget}"]).grpo
    settings = trainer.settings(cfg, max_len=8, device=npu_ops.local_device())
    batch = batcher.Batch.per_sample(samples, torch.linspace(-1, 1, len(samples)), 0)
    out, bound = {"tokens": sum(lengths), "budget": args.budget}, logprobs.LINEAR_PADDING
    for name, padding in (("first_fit", 10**6), ("bounded", bound)):
        logprobs.LINEAR_PADDING = padding
        plan = logprobs.micro_batch_plan(samples, args.budget, True, actor.config)
        out[f"{name}_rows"] = len(plan)
        out[f"{name}_padded_max"] = max(len(b) * max(lengths[i] for i in b) for b in plan)

        def step():
            actor.zero_grad(set_to_none=True)
            trainer.accumulate_gradients(actor, batch, settings)

        out[f"{name}_activation_gb"] = round(saved_bytes(step) / 2**30, 3)
        out[f"{name}_s"] = round(timed(step, args.repeats, pick=min), 3)
    logprobs.LINEAR_PADDING = bound
    out["time_ratio"] = round(out["bounded_s"] / out["first_fit_s"], 3)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
