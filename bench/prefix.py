"""The update's seconds and activation memory with each group's prompt once in its row
(grpo.shared_prefix on), and as auto picks, against the prompt repeated (off), on a random-init
Qwen2 built from a config (no download), one rank. Prints one JSON line per shape.

    python bench/prefix.py                                    # 1024-token prompts, then tiny's
    python bench/prefix.py --prompt 1024 --response 128 --group 8 --groups 1

Shapes: --groups groups of --group responses of --response tokens after a --prompt-token
prompt; then the tiny task's (prompts of 5 tokens, responses of 3, 32 groups of 8: a rank's
share of configs/tiny_cpu.yaml) unless --no-tiny. Both layouts fit one row (micro_batch_tokens:
the repeated layout's tokens). activation_gb: the bytes autograd saves for the backward
(common.saved_bytes); seconds: the best of --repeats forward+backward passes
(trainer.accumulate_gradients) after a warm-up (common.timed); *_ratio: on's and auto's
over off's; auto: whether auto shared.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import npu_ops  # noqa: E402  (first: the platform environment before torch loads)
import torch  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import batcher  # noqa: E402
import fsdp_utils  # noqa: E402
import logprobs  # noqa: E402
import trainer  # noqa: E402
from common import random_qwen2, saved_bytes, timed  # noqa: E402
from records import Sample  # noqa: E402
from train_grpo import init_distributed, load_config  # noqa: E402


def groups(prompt: int, response: int, size: int, count: int) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(count):
        ids = torch.randint(2, 15, (prompt,), generator=g).tolist()
        out += [Sample(list(ids), torch.randint(2, 15, (response,), generator=g).tolist(),
                       [-1.0] * response, False) for _ in range(size)]
    return out


def measure(actor, samples: list, repeats: int) -> dict:
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    cfg = load_config(None, [f"--grpo.micro_batch_tokens={tokens}"]).grpo
    adv = torch.linspace(-1, 1, len(samples))
    out = {"tokens": tokens}
    for mode in ("off", "on", "auto"):
        settings = trainer.settings(cfg, max_len=len(samples[0].response_ids),
                                    device=npu_ops.local_device(), shared_prefix=mode)
        batch = batcher.Batch.per_sample(samples, adv, 0)

        def step(settings=settings, batch=batch):
            actor.zero_grad(set_to_none=True)
            trainer.accumulate_gradients(actor, batch, settings)

        out[f"{mode}_activation_gb"] = round(saved_bytes(step) / 2**30, 4)
        out[f"{mode}_s"] = round(timed(step, repeats, pick=min), 4)
    for mode in ("on", "auto"):
        out[f"{mode}_time_ratio"] = round(out[f"{mode}_s"] / out["off_s"], 3)
        out[f"{mode}_activation_ratio"] = round(out[f"{mode}_activation_gb"]
                                                / out["off_activation_gb"], 3)
    out["auto"] = logprobs.sharing(samples, logprobs.Passes(shared_prefix="auto"))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--response", type=int, default=128)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-tiny", action="store_true", help="the first shape alone")
    args = p.parse_args()
    rank, _ = init_distributed()
    path = random_qwen2(args.hidden, args.layers, rank)
    actor = fsdp_utils.build_actor(fsdp_utils.ModelConfig(path=path, param_dtype="float32"),
                                   init_device_mesh(npu_ops.device_type(), (1,)))
    shapes = [(args.prompt, args.response, args.group, args.groups)]
    shapes += [] if args.no_tiny else [(5, 3, 8, 32)]
    for prompt, response, size, count in shapes:
        out = {"prompt": prompt, "response": response, "group": size, "groups": count,
               **measure(actor, groups(prompt, response, size, count), args.repeats)}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
