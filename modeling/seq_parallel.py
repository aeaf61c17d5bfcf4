"""Ulysses sequence parallelism for attention (Jacobs et al. 2023, "DeepSpeed Ulysses", arXiv
2309.14509): the ranks of a sequence-parallel group each hold 1/sp of a packed row's tokens;
around attention, one all-to-all gives each rank every token for 1/sp of the heads, attention
runs on whole samples, and a second all-to-all gives each rank its own tokens back, all heads.

This module holds `attention(inner, group)`, a transformers attention function around another
(packed_sdpa, npu_ops.fusion_attention), the all-to-alls with their gradients, the groups
(`split`), and the batch's gather (`gather_batch`: a group's ranks train the union of their
samples). Each rank's share of a row is logprobs.split_row's; the loss's sums over the group,
grpo's (batcher.Batch.split).
"""

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over `group` of x (sp, ...): block j goes to rank j, block r of the
    result came from rank r. Its gradient is the same exchange of the incoming gradient."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    """all_to_all_single into a fresh contiguous tensor (a gradient may arrive as a strided
    view, and empty_like would keep its strides: the collective writes memory in order)."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x, group=group)
    return out


def heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """(1, H, n, d) this rank's n tokens, every head -> (1, H / sp, sp * n, d) every rank's
    tokens in rank order, this rank's H / sp heads (rank r: heads r * H / sp onwards)."""
    sp = dist.get_world_size(group)
    _, h, n, d = x.shape
    blocks = x.reshape(sp, h // sp, n, d)  # block j: the heads rank j takes
    got = _AllToAll.apply(blocks, group)  # block r: rank r's tokens, my heads
    return got.transpose(0, 1).reshape(1, h // sp, sp * n, d)


def sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """(1, sp * n, H / sp, d) every token, this rank's heads -> (1, n, H, d) this rank's n
    tokens, every head: heads_to_sequence undone, in the (batch, tokens, heads, dim) layout
    transformers' attention functions return."""
    sp = dist.get_world_size(group)
    _, total, h, d = x.shape
    n = total // sp
    blocks = x.reshape(sp, n, h, d)  # block j: rank j's tokens
    got = _AllToAll.apply(blocks, group)  # block r: my tokens, rank r's heads
    return got.transpose(0, 1).reshape(1, n, sp * h, d)


def kv_copies(heads: int, kv: int, sp: int) -> int:
    """How many times each of `kv` key/value heads is repeated for sp ranks to split them with
    the `heads` query heads: r = sp / gcd(kv, sp), the least that lets sp divide kv x r. A
    one-line ValueError where sp does not divide the query heads, or kv x r does not."""
    r = sp // math.gcd(kv, sp)
    if heads % sp or heads % (kv * r):
        raise ValueError(f"model.sp_size={sp}: the model's {heads} attention heads and {kv} KV "
                         "heads do not split over it (each KV head repeated "
                         f"{r} times must divide the heads). Fix: an sp_size that divides them")
    return r


def replicated_kv(key: torch.Tensor, value: torch.Tensor, heads: int, sp: int):
    """Key and value heads repeated so that sp divides their count and it still divides the
    query's `heads` (grouped-query attention with fewer KV heads than ranks): each KV head
    kv_copies times in a row, which keeps every query head's KV head."""
    r = kv_copies(heads, key.shape[1], sp)
    if r == 1:
        return key, value
    return key.repeat_interleave(r, dim=1), value.repeat_interleave(r, dim=1)


def attention(inner, group):
    """A transformers attention function: `inner` (query (1, H, N, d) of a packed row, its
    boundaries in position_ids / cu_seq_lens_q / max_length_q) run on every token of the row for
    H / sp heads, where each rank of `group` holds n = N / sp of the row's tokens in rank order.
    The boundaries passed to it must be the whole row's (`row` keyword: position_ids,
    cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k of the whole row, and the group,
    which a hybrid's Gated DeltaNet layers read: hybrid.conv), given by the caller; the query,
    key and value it gets are this rank's tokens."""

    def forward(module, query, key, value, attention_mask, row=None, **kwargs):
        key, value = replicated_kv(key, value, query.shape[1], dist.get_world_size(group))
        q, k, v = (heads_to_sequence(x, group) for x in (query, key, value))
        whole = {k: x for k, x in (row or {}).items() if k != "group"}
        out, _ = inner(module, q, k, v, attention_mask, **{**kwargs, **whole})
        return sequence_to_heads(out, group), None

    # the whole row reaches `inner`: its limit on a row's samples is this function's too
    # (logprobs.packed_sample_cap reads it)
    forward.max_samples = getattr(inner, "max_samples", 0)
    return forward


@dataclass(frozen=True)
class Split:
    """This rank's place in its sequence-parallel group: the group, its rank there, its size."""
    group: object
    rank: int
    size: int


_SPLITS: dict = {}


def split(sp: int) -> Split | None:
    """The sequence-parallel group of this rank: sp consecutive ranks (every rank makes every
    group, in order, the first time); None for sp 1."""
    if sp == 1:
        return None
    if sp not in _SPLITS:
        world, rank = dist.get_world_size(), dist.get_rank()
        for first in range(0, world, sp):
            group = dist.new_group(list(range(first, first + sp)))
            if first <= rank < first + sp:
                _SPLITS[sp] = Split(group, rank - first, sp)
    return _SPLITS[sp]


def gather_tokens(x: torch.Tensor, bounds: list, where: Split) -> torch.Tensor:
    """Each rank's (K_r, ...) values of one micro-batch's tokens, K_r = bounds[r + 1] -
    bounds[r] (every rank knows them), concatenated in rank order: (K, ...), one all-gather."""
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    most = max(sizes)
    padded = x.new_zeros((most, *x.shape[1:]))
    padded[:x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded.contiguous(), group=where.group)
    return torch.cat([p[:k] for p, k in zip(parts, sizes)])


def gather_batch(batch, where: Split):
    """A batch transform (batcher.py): the group's batch, every rank's samples and advantages
    concatenated in rank order (host objects), the group's first rank's shuffle seed (its ranks
    must split the mini-batches alike), and the group, by which each rank runs its share of
    every row. Every rank of the group calls it."""
    got = [None] * where.size
    dist.all_gather_object(got, (batch.samples, batch.adv, batch.seed), group=where.group)
    return dataclasses.replace(batch, samples=[s for part in got for s in part[0]],
                               adv=[a for part in got for a in part[1]], seed=got[0][2],
                               split=where)
