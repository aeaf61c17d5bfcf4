"""2 ranks: weight_sync.gather_rows (all the adapters in one all-gather) against each tensor's own
DTensor.full_tensor, for adapters whose rows do not split evenly: rank 3 (2 rows on rank 0, 1 on
rank 1) and rank 1 (rank 1 holds no row)."""

import sys

import npu_ops  # noqa: F401, I001  (first: the platform environment before torch loads)
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fsdp_utils
import weight_sync
from train_grpo import init_distributed

model_dir = sys.argv[1]
rank, world = init_distributed()
for lora_rank in (3, 1):
    cfg = fsdp_utils.ModelConfig(path=model_dir, param_dtype="float32")
    cfg.lora.rank, cfg.lora.alpha = lora_rank, 2.0 * lora_rank
    torch.manual_seed(0)
    actor = fsdp_utils.build_actor(cfg, init_device_mesh("cpu", (world,)))
    with torch.no_grad():  # lora_B starts at zero: give every adapter values to compare
        for p in actor.parameters():
            if p.requires_grad:
                p.to_local().normal_()
    weights = [p for n, p in actor.named_parameters() if "lora_" in n]
    rows = {w.to_local().shape[0] for w in weights if w.shape[0] == lora_rank}  # the lora_A
    assert rows == {[2, 1][rank] if lora_rank == 3 else 1 - rank}, (lora_rank, rows)
    whole = weight_sync.gather_rows(weights, torch.bfloat16)
    for w, got in zip(weights, whole, strict=True):
        expected = w.detach().full_tensor().to(torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got, expected), (lora_rank, w.shape)
    stats = {"bytes": 0}
    pairs = weight_sync.full_adapters(actor, torch.float32, stats)
    assert len(pairs) == len(weights) // 2 and stats["bytes"] == 4 * sum(w.numel() for w in weights)
    print(f"rank {rank}, adapters of rank {lora_rank}: {len(weights)} tensors, {rows} rows of A")
# torn down here, not at interpreter exit: torch 2.10 once aborted there with the group still up
dist.destroy_process_group()
print("ADAPTER_GATHER_OK")
