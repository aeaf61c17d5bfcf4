"""2 ranks: seq_parallel.attention around fsdp_utils.packed_sdpa, each rank holding half of a
packed row's tokens, against packed_sdpa on the whole row in one process (fp64): the output
and the gradients of query, key and value, each rank's half of them. Three samples, two of them
across the split; 4 query heads over 4 KV heads, 2 (grouped) and 1 (fewer KV heads than ranks:
replicated), and 6 over 3 (replicated to 6: each copy must stay beside its original, or a query
head meets another head's keys); then the same around npu_ops.fusion_attention on the tests'
stand-in of the NPU kernel (tests/test_npu_attention.py), the row's ends as host ints.
Prints ULYSSES_OK.
Usage: torchrun --nproc_per_node 2 tests/workers/ulysses_attention.py
"""

import os
import sys
import types

import torch
import torch.distributed as dist

import fsdp_utils
from modeling import seq_parallel

dist.init_process_group("gloo")
rank, sp = dist.get_rank(), dist.get_world_size()
group = dist.new_group(list(range(sp)))
module = types.SimpleNamespace(training=False)
lengths = [5, 9, 4]  # 18 tokens: rank 0 holds 0..8, rank 1 holds 9..17
N, n, d = sum(lengths), sum(lengths) // sp, 32
position_ids = torch.cat([torch.arange(x) for x in lengths])[None]
cu = torch.tensor([0, 5, 14, 18], dtype=torch.int32)
row = dict(position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9,
           max_length_k=9)
mine = slice(rank * n, (rank + 1) * n)
attention = seq_parallel.attention(fsdp_utils.packed_sdpa, group)
for H, kv in ((4, 4), (4, 2), (4, 1), (6, 3)):
    g = torch.Generator().manual_seed(kv)  # the same whole row on both ranks
    q, k, v = (torch.randn(1, h, N, d, dtype=torch.float64, generator=g) for h in (H, kv, kv))
    w = torch.randn(1, N, H, d, dtype=torch.float64, generator=g)  # the output's weights

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    want, _ = fsdp_utils.packed_sdpa(module, *leaves, None, position_ids=position_ids,
                                     cu_seq_lens_q=cu, max_length_q=9)
    (want * w).sum().backward()
    local = [x[:, :, mine].clone().requires_grad_() for x in (q, k, v)]
    got, _ = attention(module, *local, None, position_ids=position_ids[:, mine], row=row)
    (got * w[:, mine]).sum().backward()
    assert got.shape == (1, n, H, d), got.shape
    assert (got - want[:, mine]).abs().max() < 1e-12, (kv, (got - want[:, mine]).abs().max())
    for a, b in zip(local, leaves):  # each rank's tokens' gradients, summed over the heads it
        assert (a.grad - b.grad[:, :, mine]).abs().max() < 1e-12, kv  # did not compute too
    print(f"rank {rank} kv heads {kv}: equal", flush=True)
# the NPU's varlen kernel inside the all-to-alls, on the tests' stand-in of npu_fusion_attention
# (its documented arguments checked on every call; the numbers from the plain-torch reference)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from test_npu_attention import StandInFusionAttention  # noqa: E402

import npu_ops  # noqa: E402

npu_ops.STAND_IN = StandInFusionAttention()
ends = tuple(int(x) for x in cu[1:])
fused = seq_parallel.attention(npu_ops.fusion_attention, group)
g = torch.Generator().manual_seed(7)
q, k, v = (torch.randn(1, h, N, d, dtype=torch.float64, generator=g) for h in (4, 2, 2))
want, _ = npu_ops.fusion_attention(module, q, k, v, None, packed_ends=ends)
got, _ = fused(module, *(x[:, :, mine] for x in (q, k, v)), None,
               row=dict(row, packed_ends=ends))
assert (got - want[:, mine]).abs().max() < 1e-12, (got - want[:, mine]).abs().max()
print(f"rank {rank} fused kernel stand-in: equal", flush=True)
dist.destroy_process_group()
print("ULYSSES_OK")
