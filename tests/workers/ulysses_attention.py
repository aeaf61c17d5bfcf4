"""2 ranks: seq_parallel.attention around fsdp_utils.packed_sdpa, each rank holding half of a
packed row's tokens, against packed_sdpa on the whole row in one process (fp64): the output
and the gradients of query, key and value, each rank's half of them. Three samples, two of them
across the split; 4 query heads over 4 KV heads, 2 (grouped) and 1 (fewer KV heads than ranks:
replicated), and 6 over 3 (replicated to 6: each copy must stay beside its original, or a query
head meets another head's keys). Prints ULYSSES_OK.
Usage: torchrun --nproc_per_node 2 tests/workers/ulysses_attention.py
"""

import types

import torch
import torch.distributed as dist

import fsdp_utils
import seq_parallel

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
dist.destroy_process_group()
print("ULYSSES_OK")
