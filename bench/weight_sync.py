"""Weight sync against its floor, on a random-init Qwen2 built from a config (no download). Prints
one JSON line (rank 0).

    torchrun --nproc_per_node 2 bench/weight_sync.py            # 1024 x 9 layers: 105M params
    python bench/weight_sync.py                                 # world size 1
    torchrun --nproc_per_node 8 bench/weight_sync.py --shape qwen2.5-0.5b --dtype bfloat16
    torchrun --nproc_per_node 2 bench/weight_sync.py --layers 4 --experts 32   # a Qwen3-MoE

push: an engine turn (`weight_sync.EngineTurn`, no offload) as the trainer takes it (wake,
gather, cast, load into the engine's storage with `weight_sync.load`, prefix-cache reset, sleep),
both ways of gathering (`rollout.sync_by`: one all-gather per tensor, and one per FSDP unit, the
default); best of `--repeats` after one warm-up.
floor, measured in the same run on the same process group: a bare all-gather of the same bytes
(every rank's shard of every parameter, in one collective) plus one plain copy of all the bytes,
what any push must at least do. ratio = push / floor (unit_ratio: the same for "unit").
With --experts (a mixture of experts): also per_expert_s, the default push with each expert's
matrices handed over one by one (rollout.per_expert, what a vLLM without fused-expert loading
gets), and per_expert_ratio.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import npu_ops  # noqa: E402  (first: the platform environment before torch loads)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import fsdp_utils  # noqa: E402
import rollout  # noqa: E402
import weight_sync  # noqa: E402
from common import add_model_args, model_from_args, shut_down, timed  # noqa: E402
from train_grpo import init_distributed  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(p, hidden=1024, layers=9)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    npu_ops.setup_env()
    rank, world = init_distributed()
    path = model_from_args(args, rank)
    engine = rollout.Engine(rollout.RolloutConfig(dtype=args.dtype, max_model_len=256,
                                                  kv_cache_memory_bytes=64 << 20,
                                                  max_new_tokens=4), path, tp_group_index=rank)
    engine.sleep()
    actor = fsdp_utils.build_actor(fsdp_utils.ModelConfig(path=path, param_dtype=args.dtype),
                                   init_device_mesh(npu_ops.device_type(), (world,)))
    turn = weight_sync.EngineTurn(actor, None, engine, offload_on=False)

    def push():
        with turn:  # entering: wake, push; leaving: the engine asleep
            pass

    engine.cfg.sync_by = "tensor"
    push_s = timed(push, args.repeats, min)
    engine.cfg.sync_by = "unit"
    unit_s = timed(push, args.repeats, min)
    per_expert_s = None
    if args.experts:  # the same push, the experts split as for vLLM 0.23
        fused, rollout.FUSED_EXPERTS_VLLM = rollout.FUSED_EXPERTS_VLLM, set()
        per_expert_s = timed(push, args.repeats, min)
        rollout.FUSED_EXPERTS_VLLM = fused
    dtype, device = getattr(torch, args.dtype), npu_ops.local_device()
    shard = torch.tensor(sum(p.to_local().numel() for p in actor.parameters()))
    dist.all_reduce(shard, op=dist.ReduceOp.MAX)  # shards differ a little; FSDP gathers padded
    shard = int(shard)
    local = torch.ones(shard, dtype=dtype, device=device)
    gathered = torch.empty(shard * world, dtype=dtype, device=device)
    sent = round(turn.metrics()["sync_gb"] * 2**30)  # the bytes pushed
    total = sent // dtype.itemsize
    src, dst = torch.ones(total, dtype=dtype, device=device), torch.empty(total, dtype=dtype,
                                                                          device=device)

    def floor():
        dist.all_gather_into_tensor(gathered, local)
        dst.copy_(src)

    floor_s = timed(floor, args.repeats, min)
    if rank == 0:
        print(json.dumps({
            "device": npu_ops.device_type(), "world": world, "dtype": args.dtype,
            "params_m": round(sum(p.numel() for p in actor.parameters()) / 1e6, 1),
            "gb": round(sent / 2**30, 3), "push_s": round(push_s, 3),
            "push_gb_per_s": round(sent / 2**30 / push_s, 2),
            "floor_s": round(floor_s, 3), "ratio": round(push_s / floor_s, 2),
            "unit_s": round(unit_s, 3), "unit_ratio": round(unit_s / floor_s, 2),
            **({"per_expert_s": round(per_expert_s, 3),
                "per_expert_ratio": round(per_expert_s / floor_s, 2)} if per_expert_s else {})}),
              flush=True)
    shut_down(engine)


if __name__ == "__main__":
    main()
