"""2 ranks, fp64: the update's forward and backward with model.sp_size=2 (each rank half of
every packed row, Ulysses attention) against sp_size=1 on the same samples (both ranks holding
all of them): each sample's logprobs, the loss, the entropy and the clipped tokens summed over
the ranks, and every parameter's gradient, gathered whole; with per-token options, and with the
sequence-level ones (seq_mask / seq_truncate weights, GSPO's ratio, the off-policy mask: every
token's logprobs gathered in the group first), and VESPO with the entropy bonus on given
forking tokens. Then the old policy's pass with its entropies, and top_entropy_quantile's
threshold (batcher.forking_tokens) over every token once.
Samples: five, 67 tokens in all, three micro-batches whose packed rows split mid-sample and one
of odd length; an episode whose environment wrote 3 of its tokens. MODEL_DIR: a Qwen2 with 4
query heads and KV_HEADS key/value heads (1: fewer than the ranks, replicated), or a Qwen3.5
hybrid (its Gated DeltaNet layers split by heads and channels: hybrid.conv, hybrid.chunk_rule).
Prints SP_PARITY_OK.
Usage: torchrun --nproc_per_node 2 tests/workers/sp_parity.py MODEL_DIR
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import batcher
import fsdp_utils
import logprobs
from modeling import seq_parallel
import trainer
from records import Sample
from tests.reference import batch_of
from train_grpo import init_distributed, load_config

model_dir = sys.argv[1]
rank, world = init_distributed()
mesh = init_device_mesh("cpu", (world,))
BASE = ["--grpo.micro_batch_tokens=32", "--grpo.logprob_chunk=8", "--grpo.is_correction=none"]
cfg = load_config(None, BASE).grpo
g = torch.Generator().manual_seed(0)
samples = []
for prompt, response in ((3, 8), (7, 10), (2, 5), (9, 12), (4, 7)):
    s = Sample(torch.randint(2, 15, (prompt,), generator=g).tolist(),
               torch.randint(2, 15, (response,), generator=g).tolist(), [], False)
    s.logp = (-torch.rand(response, generator=g, dtype=torch.float64)).tolist()
    samples.append(s)
samples[3].mask = [1] * 4 + [0] * 3 + [1] * 5  # an environment's three tokens
adv = torch.tensor([0.5, -1.0, 0.25, 1.5, -0.75], dtype=torch.float64)
CASES = {  # the loss's options; old: an old policy's logprobs given (off-policy) or not;
    # forks: batcher.Batch.forking given (the tokens that keep their policy gradient)
    "token": ([], False, False),
    "sequence, on-policy": (["--grpo.is_correction=seq_truncate",
                             "--grpo.off_policy_delta=0.05"], False, False),
    "sequence, off-policy": (["--grpo.policy_loss=gspo", "--grpo.loss_agg=seq_mean",
                              "--grpo.is_correction=seq_mask", "--grpo.off_policy_delta=0.05"],
                             True, False),
    "vespo, entropy bonus, forking tokens": (["--grpo.policy_loss=vespo",
                                              "--grpo.is_correction=tis",
                                              "--grpo.entropy_coef=0.1"], False, True)}
# Qwen3.5 (a hybrid): transformers computes its RMSNorms and its Gated DeltaNet decay in fp32
# whatever the model's dtype (`x.float()`, `weight.float()`, `A_log.float()`), so their weights'
# gradients would be sums over the tokens of fp32 products, rounded at 2^-24 each in another
# order at sp 2 (1.6e-7 of the largest, measured). Here `.float()` leaves an fp64 tensor as it
# is, so that fp64 compares the two layouts, not fp32's rounding.
FLOAT = torch.Tensor.float
torch.Tensor.float = lambda t, *a, **k: t if t.dtype == torch.float64 else FLOAT(t, *a, **k)
old_logp = [torch.tensor(s.logp) - 0.1 * torch.rand(len(s.logp), generator=g, dtype=torch.float64)
            for s in samples]
forking = [(torch.rand(len(s.response_ids), generator=g) < 0.5).float()
           * torch.tensor(s.mask or [1] * len(s.response_ids), dtype=torch.float32)
           for s in samples]
got = {}
for sp in (1, 2):
    spec = fsdp_utils.ModelConfig(path=model_dir, param_dtype="float64", reduce_dtype="float64",
                                  attn_implementation="sdpa", sp_size=sp)
    actor = fsdp_utils.build_actor(spec, mesh)
    split = seq_parallel.split(sp)  # the group build_actor made (None at sp 1)
    plan = logprobs.micro_batch_plan(samples, cfg.micro_batch_tokens, cfg.pack, actor.config,
                                     split)
    rows = [sum(len(samples[i].prompt_ids) + len(samples[i].response_ids) for i in idx)
            for idx in plan]
    assert len(plan) == 3 and any(r % 2 for r in rows), rows  # a row padded to a multiple of 2
    for case, (options, off, forks) in CASES.items():
        c = load_config(None, [*BASE, *options]).grpo
        actor.zero_grad(set_to_none=True)
        logp, stats = trainer.accumulate_gradients(
            actor, batch_of(samples, adv, split=split, forking=forking if forks else None,
                            old_logp=old_logp if off else None),
            trainer.settings(c, 0.7, max_len=16))
        sums = torch.stack([stats["loss"], stats["entropy"], stats["clipped"]])
        dist.all_reduce(sums)
        grads = {n: p.grad.full_tensor() for n, p in actor.named_parameters()}
        got[sp, case] = (logp, sums, grads)
    found = logprobs.sample_pass(actor, samples, trainer.settings(cfg, 0.7).passes,
                                 entropy=True, split=split)
    got[sp, "old"], got[sp, "entropy"] = found["logp"], found["entropy"]
    # grpo.top_entropy_quantile's threshold, over every token once: at sp 2 a group's ranks
    # hold the same samples (one counts); at sp 1 each rank takes half of them
    mine = samples if sp == 2 else samples[rank::2]
    ent = found["entropy"] if sp == 2 else found["entropy"][rank::2]
    every = torch.cat(batcher.written(samples, found["entropy"])).double()
    keep, threshold = batcher.forking_tokens(mine, ent, 0.3, split)
    assert abs(threshold - torch.quantile(every, 0.7).item()) < 1e-12, (sp, threshold)
    kept = torch.tensor([sum(float(k.sum()) for k in keep)])
    if sp == 1:
        dist.all_reduce(kept)
    assert kept.item() == (every >= threshold).sum().item() > 0, (sp, kept)
for name in ("old", "entropy"):
    assert all((a - b).abs().max() < 1e-12 for a, b in zip(got[1, name], got[2, name])), name
for case in CASES:
    (l1, s1, g1), (l2, s2, g2) = got[1, case], got[2, case]
    assert all((a - b).abs().max() < 1e-12 for a, b in zip(l1, l2)), (case, "logprobs")
    assert abs(s1[0] - s2[0]) <= 1e-12 * abs(s1[0]), (case, s1, s2)  # the loss, each token once
    assert abs(s1[1] / 2 - s2[1]) <= 1e-12 * abs(s2[1]), (case, s1, s2)  # sp 1: all tokens twice
    assert s1[2] / 2 == s2[2], (case, s1, s2)  # clipped tokens
    for name in g1:
        scale = g1[name].abs().max()
        assert scale > 0, (case, name)
        assert (g1[name] - g2[name]).abs().max() <= 1e-10 * scale, (case, name)
    print(f"rank {rank}: {case}: sp 2 equals sp 1", flush=True)
dist.destroy_process_group()
print("SP_PARITY_OK")
