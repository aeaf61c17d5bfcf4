"""The algorithm: GRPO's advantages, its loss and variants, and the update over a rollout.

Nothing here knows about engines or files: a rollout arrives as samples (prompt_ids,
response_ids, the engine's logp of each response token) and rewards, and leaves as gradient steps
on the FSDP2 actor. To try a new loss, edit `grpo_loss` (and, for a new option, `GRPOConfig` and
the option lists in `LOSS_AGGS` / config.validate).

With the defaults this GRPO is, precisely:
- advantage = (r - mean_group) / (std_group + eps), std unbiased (DeepSeekMath's GRPO); groups
  whose rewards are all exactly equal get advantage 0 (they carry no signal);
- loss = PPO's clipped surrogate averaged over every response token of the global batch (DAPO's
  token-level mean), times a truncated importance weight min(p_trainer / p_engine, 2) per token
  (TIS) for the gap between the engine's sampling and the trainer's logprobs; no KL term, no
  entropy bonus;
- one optimizer step per rollout, so old_logp is the current policy's own (detached) logp, the
  ratio is 1, and the gradient is REINFORCE with group-normalised advantages (TIS-weighted).
Variants, each a few lines selected by the `grpo:` config section (README has the table):
sequence-mean (GRPO) or constant (Dr. GRPO) loss normalisation and no std scaling, asymmetric
clipping (DAPO), several epochs and mini-batches per rollout (PPO), a KL term to a frozen
reference (k1/k2/k3), sequence-level masking instead of TIS, dynamic sampling (DAPO), and
masking or a soft penalty for responses cut at the length limit (DAPO).
"""

import contextlib
import math
import time
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist

import fsdp_utils
import tracking


@dataclass
class GRPOConfig:
    group_size: int = 8  # G: responses sampled per prompt
    prompts_per_step: int = 32  # over all ranks; each engine group takes an equal slice
    adv_eps: float = 1e-6  # added to the group std
    scale_adv_by_std: bool = True  # false: adv = r - mean (Dr. GRPO)
    loss_agg: str = "token_mean"  # token_mean (DAPO) | seq_mean (GRPO) | constant (Dr. GRPO)
    clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_high: float = 0.2  # DAPO's "clip-higher" raises this (0.28)
    ppo_epochs: int = 1  # passes over each rollout
    mini_batches: int = 1  # optimizer steps per pass; >1 epochs or mini-batches: off-policy
    kl_coef: float = 0.0  # KL-to-reference loss weight; > 0 builds a frozen reference copy
    kl_estimator: str = "k3"  # k1 | k2 | k3 (Schulman's estimators; k3 as in DeepSeekMath)
    is_correction: str = "tis"  # engine/trainer mismatch: none | tis | seq_mask
    is_cap: float = 2.0  # C: TIS weight cap; seq_mask keeps sequence ratios in [1/C, C]
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal (DAPO)
    max_gen_rounds: int = 1  # with dynamic sampling: rounds of fresh prompts to refill the batch
    overlong: str = "none"  # truncated responses: none | mask (out of the loss) | penalty
    overlong_buffer: int = 0  # penalty: last N tokens before max_new_tokens ramp it to -factor
    overlong_penalty_factor: float = 1.0
    micro_batch_tokens: int = 8192  # tokens per forward/backward on one rank (padding counts
    #   too when pack is false)
    pack: bool = True  # a micro-batch is one row of samples end to end, no padding (fsdp_utils)
    logprob_chunk: int = 1024  # output-layer rows at a time: at most (chunk x vocab) fp32 logits


# ----------------------------------------------------------------------------------------------
# the math: small pure functions on tensors. Each variant names the paper it comes from.

LOSS_AGGS = ("token_mean", "seq_mean", "constant")


def constant_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B*G,) rewards -> (B,) bool: groups whose rewards are all exactly equal. An exact test:
    0.1 + 0.2 vs 0.3 is float noise, not signal, and must not become a 1e8-scale advantage."""
    r = rewards.view(-1, group_size)
    return (r == r[:, :1]).all(1)


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6,
                     scale_by_std: bool = True) -> torch.Tensor:
    """(B*G,) rewards, prompt-major -> (B*G,) advantages: r - mean of its group, divided by the
    group's unbiased std + eps (DeepSeekMath's GRPO), or not divided (Dr. GRPO: the std
    re-weights prompts by difficulty). Constant groups get exactly 0."""
    r = rewards.view(-1, group_size)  # (B, G)
    adv = r - r.mean(1, keepdim=True)
    if scale_by_std:
        adv = adv / (r.std(1, keepdim=True) + eps)
    return adv.masked_fill(constant_groups(rewards, group_size).unsqueeze(1), 0.0).view(-1)


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float):
    """DAPO's soft overlong punishment, added to the reward: 0 up to max_len - buffer tokens, then
    falling linearly to -factor at max_len."""
    return -factor * ((lengths - (max_len - buffer)) / buffer).clamp(0.0, 1.0)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """(N, T, V) logits, (N, T) targets -> (N, T) log p(target), in fp32."""
    logits = logits.float() / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)


def kl_penalty(logp, ref_logp, estimator: str):
    """Per-token estimate of KL(policy || reference) from tokens sampled by the policy, after
    Schulman's "Approximating KL Divergence": k1 = log(p/q) is unbiased but noisy and can be
    negative; k2 = log(p/q)^2 / 2; k3 = q/p - 1 - log(q/p) is unbiased and >= 0 (DeepSeekMath)."""
    log_r = ref_logp - logp  # log(q/p)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r ** 2
    return torch.expm1(log_r) - log_r  # k3


def mismatch_weights(old_logp, engine_logp, mask, mode: str, cap: float):
    """(N, T) importance weights that correct for the engine sampling from a slightly different
    distribution than the trainer computes (kernels, precision). ratio = p_trainer / p_engine.
    - none: 1;
    - tis: min(ratio, C) per token: truncated importance sampling (Yao et al. 2025, "Your
      Efficient RL Framework Secretly Brings You Off-Policy RL Training");
    - seq_mask: 1 for a sequence whose ratio (product over its tokens) lies in [1/C, C], else 0:
      masked importance sampling (Liu et al. 2025, "When Speed Kills Stability").
    Detached: the weights scale the gradient, they do not get one."""
    log_ratio = ((old_logp - engine_logp) * mask).detach()
    if mode == "none":
        return torch.ones_like(log_ratio)
    if mode == "tis":
        return log_ratio.exp().clamp(max=cap)
    inside = log_ratio.sum(1).abs() <= math.log(cap)  # seq_mask
    return inside.to(log_ratio.dtype).unsqueeze(1).expand_as(log_ratio)


def grpo_loss(logp, old_logp, adv, mask, g: GRPOConfig, n_tokens: float, n_seqs: float,
              max_len: int, is_weight=None, ref_logp=None):
    """The loss of one micro-batch, normalised over the whole global mini-batch (n_tokens response
    tokens in n_seqs sequences), so micro-batches and ranks add up to the batch's loss.
    logp, old_logp, mask, is_weight, ref_logp: (N, T); adv: (N,).
    Returns the loss and (N, T) bool of the tokens where the clip was active."""
    ratio = torch.exp(logp - old_logp)
    adv = adv.unsqueeze(1)  # (N, 1)
    clipped_ratio = ratio.clamp(1 - g.clip_low, 1 + g.clip_high)  # DAPO "clip-higher" if high > low
    unclipped_term, clipped_term = ratio * adv, clipped_ratio * adv
    per_token = -torch.minimum(unclipped_term, clipped_term)  # PPO's clipped surrogate
    clipped = unclipped_term > clipped_term  # the min took the clipped term: no gradient here
    if is_weight is not None:
        per_token = per_token * is_weight
    if ref_logp is not None and g.kl_coef > 0:  # KL in the loss, not the reward (DeepSeekMath)
        per_token = per_token + g.kl_coef * kl_penalty(logp, ref_logp, g.kl_estimator)
    per_token = per_token * mask
    if g.loss_agg == "token_mean":  # every token of the batch weighs the same (DAPO)
        loss = per_token.sum() / n_tokens
    elif g.loss_agg == "seq_mean":  # mean over tokens, then over sequences (GRPO, DeepSeekMath)
        loss = (per_token.sum(1) / mask.sum(1).clamp(min=1)).sum() / n_seqs
    else:  # constant: sum over tokens / (sequences x max_new_tokens): no length bias (Dr. GRPO)
        loss = per_token.sum() / (n_seqs * max_len)
    return loss, clipped & mask.bool()


@torch.no_grad()
def masked_entropy_sum(logits: torch.Tensor, mask: torch.Tensor, chunk: int = 256) -> float:
    """Sum of the policy's entropy over masked positions of (N, T, V) logits, chunk rows at a
    time: a (chunk x V) fp32 tensor at most, never (tokens x V)."""
    rows = logits[mask.bool()]  # (n_tokens, V), in the logits' dtype
    total = 0.0
    for part in rows.split(chunk):
        logp = part.float().log_softmax(-1)
        total -= (logp.exp() * logp).sum().item()
    return total


def mismatch_stats(old_logp: list, engine_logp: list, cap: float) -> dict:
    """Engine vs trainer logprobs of the sampled tokens, per-sample (n_i,) tensors, as metrics
    (tracking.reduce): the mean |gap|, the importance ratio p_trainer / p_engine per token (mean,
    max, min), the share of tokens above C and of sequences whose ratio leaves [1/C, C]."""
    log_ratio = [o.double() - torch.as_tensor(e, dtype=torch.float64)
                 for o, e in zip(old_logp, engine_logp)]
    flat = torch.cat(log_ratio) if log_ratio else torch.zeros(0, dtype=torch.float64)
    seq = torch.stack([x.sum() for x in log_ratio]) if log_ratio else flat
    ratio, n = flat.exp(), flat.numel()
    empty = not n
    return {"logp_gap": tracking.Mean(flat.abs().sum().item(), n),
            "is_ratio_mean": tracking.Mean(ratio.sum().item(), n),
            "is_ratio_max": tracking.Max(0.0 if empty else ratio.max().item()),
            "is_ratio_min": tracking.Min(math.inf if empty else ratio.min().item()),
            "is_above_cap_frac": tracking.Mean((ratio > cap).sum().item(), n),
            "seq_outside_cap_frac": tracking.Mean((seq.abs() > math.log(cap)).sum().item(),
                                                  seq.numel())}


def pad_batch(samples: list, pad_id: int, per_token: dict | None = None):
    """Right-pad prompt+response sequences. Returns input_ids (N, T), attention (N, T), targets
    (N, T-1), loss mask (N, T-1) over response tokens, and a dict of (N, T-1) tensors placed at
    the response positions: "engine" (the engine's logp) and every entry of `per_token`, a list
    with one sequence of per-response-token values for each sample."""
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    T = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    attn = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T - 1)
    values = {"engine": [s.logp for s in samples], **(per_token or {})}
    padded = {k: torch.zeros(len(seqs), T - 1) for k in values}
    for i, (s, x) in enumerate(zip(samples, seqs)):
        ids[i, :len(x)] = torch.tensor(x)
        attn[i, :len(x)] = 1
        p, n = len(s.prompt_ids), len(s.response_ids)
        mask[i, p - 1:p - 1 + n] = 1  # position t predicts token t+1
        for k, v in values.items():
            padded[k][i, p - 1:p - 1 + n] = torch.as_tensor(v[i], dtype=torch.float32)
    return ids, attn, ids[:, 1:], mask, padded


def plan_micro_batches(lengths: list[int], budget: int, packed: bool = False) -> list[list[int]]:
    """Group indices, longest first, so that each group fits `budget` tokens: packed, its total
    length (first fit); padded, its (count x max length)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if packed:
        batches, room = [], []
        for i in order:
            fits = next((b for b, r in enumerate(room) if lengths[i] <= r), None)
            if fits is None:
                batches.append([])
                room.append(budget)
                fits = len(room) - 1
            batches[fits].append(i)
            room[fits] -= lengths[i]
        return batches
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > budget:
            batches.append(cur)
            cur = []
        cur.append(i)
    return batches + [cur] if cur else batches


def take_groups(keep: list, kept: list, engine_idx: int, target: int) -> list[int]:
    """This engine group's groups for the update: the kept ones (keep[b]), at most `target` over
    all engine groups, taken in engine-group order (kept[e]: engine group e's count)."""
    quota = min(kept[engine_idx], max(0, target - sum(kept[:engine_idx])))
    return [b for b, k in enumerate(keep) if k][:quota]


# ----------------------------------------------------------------------------------------------
# the update: forward/backward over the rollout. Every function here runs FSDP collectives, so
# every rank calls it, with its own share of the samples (possibly none).

# a zero-loss stand-in sample (any object with these fields is a sample here)
DUMMY = types.SimpleNamespace(prompt_ids=[0], response_ids=[0], logp=[0.0], truncated=False)


def micro_batch_plan(samples: list, budget: int, packed: bool) -> list[list[int]]:
    """plan_micro_batches, topped up with empty entries so that every rank runs as many forwards
    as the busiest (FSDP all-gathers per forward); an empty entry is a zero-loss DUMMY forward."""
    plan = plan_micro_batches([len(s.prompt_ids) + len(s.response_ids) for s in samples], budget,
                              packed)
    n = torch.tensor(len(plan))
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return plan + [[]] * (int(n) - len(plan))


def _chunk_logp(hidden, weight, bias, targets, once: list, temperature: float):
    """(c, H) final hidden states -> (c,) logp of `targets` under softmax(logits / temperature),
    and the entropy sum of the raw logits (a float, not differentiated) over the (c,) bool rows
    that `once` holds, if it holds any: taken out here, so that backward's recompute of this
    chunk, which calls again with the same list, skips the entropy."""
    logits = torch.nn.functional.linear(hidden, weight, bias)  # (c, V) in the compute dtype
    rows = once.pop() if once else None
    entropy = masked_entropy_sum(logits[None].detach(), rows[None]) if rows is not None else 0.0
    return token_logprobs(logits[None], targets[None], temperature)[0], entropy


@contextlib.contextmanager
def logprob_head(model, targets, rows, temperature: float, chunk: int):
    """While active, the model's output layer returns, in place of its (B, T, vocab) logits, a
    (B, T, 1) tensor: the logprob of `targets` (B, T) under softmax(logits / temperature), `chunk`
    rows at a time, each chunk's logits recomputed in backward (activation checkpointing): at most
    (chunk x vocab) fp32 logits exist at once. The entropy sum over `rows` (B, T; None: no
    entropy) lands in the yielded dict. The result leaves through the model's output, where
    FSDP's backward hooks see
    it: the output layer's weights are gathered for the forward and again for the backward."""
    from torch.utils.checkpoint import checkpoint

    head, found = model.get_output_embeddings(), {"entropy": 0.0}

    def forward(self, hidden):  # (B, T, H)
        flat, tg = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        rw = None if rows is None else rows.reshape(-1)
        parts = []
        for s in range(0, flat.shape[0], chunk):
            once = [] if rw is None else [rw[s:s + chunk]]
            logp, entropy = checkpoint(_chunk_logp, flat[s:s + chunk], self.weight, self.bias,
                                       tg[s:s + chunk], once, temperature, use_reentrant=False)
            parts.append(logp)
            found["entropy"] += entropy
        # a copy, not a view of the concatenation: FSDP2 warns when the model's output is a view
        # (an in-place op on it would skip its backward hooks); (tokens,) floats, a cheap copy
        return torch.cat(parts).view(*hidden.shape[:-1], 1).clone()

    head.forward = types.MethodType(forward, head)
    try:
        yield found
    finally:
        del head.forward


def forward_logp(model, samples: list, pad_id: int, device, temperature: float, per_token=None,
                 packed: bool = True, chunk: int = 1024, entropy: bool = True):
    """Returns logp (n, T-1) of the targets, the entropy sum over the loss mask (0.0 without
    `entropy`), the mask and the padded per-token dict, all in pad_batch's (n, T-1) layout.
    packed: the samples run end to end in one row, position ids restarting at each (no
    padding); else as a padded batch."""
    ids, attn, targets, mask, padded = pad_batch(samples, pad_id, per_token)
    n, T = ids.shape
    targets = torch.nn.functional.pad(targets, (0, 1), value=pad_id)  # (n, T): t predicts t+1
    rows = torch.nn.functional.pad(mask, (0, 1)).bool()  # (n, T): where entropy is taken
    if packed:
        real = attn.bool()  # (n, T): the tokens, row-major: sample after sample
        positions = torch.arange(T).expand(n, T)[real][None]  # restarting at 0 for each sample
        inputs = {"input_ids": ids[real][None], "position_ids": positions}
        targets, rows = targets[real][None], rows[real][None]  # (1, N)
    else:
        inputs = {"input_ids": ids, "attention_mask": attn}
    rows = rows.to(device) if entropy else None
    with logprob_head(model, targets.to(device), rows, temperature, chunk) as found:
        logp = model(**{k: v.to(device) for k, v in inputs.items()}).logits[..., 0]
    if packed:  # back to one padded row per sample
        logp = logp.new_zeros(n, T).masked_scatter(real.to(device), logp[0])
    padded = {k: v.to(device) for k, v in padded.items()}
    return logp[:, :-1], found["entropy"], mask.to(device), padded


@torch.no_grad()
def sample_logprobs(model, samples: list, g: GRPOConfig, pad_id: int, device,
                    temperature: float) -> list:
    """Each sample's response-token logprobs under `model` (old or reference policy): a list of
    (n_i,) fp32 CPU tensors."""
    out = [None] * len(samples)
    model.eval()
    for idx in micro_batch_plan(samples, g.micro_batch_tokens, g.pack):
        logp, _, mask, _ = forward_logp(model, [samples[i] for i in idx] or [DUMMY], pad_id,
                                        device, temperature, None, g.pack, g.logprob_chunk,
                                        entropy=False)
        for row, i in enumerate(idx):
            out[i] = logp[row][mask[row].bool()].float().cpu()
    return out


def accumulate_gradients(actor, samples: list, adv: torch.Tensor, old_logp, ref_logp,
                         g: GRPOConfig, pad_id: int, device, temperature: float,
                         max_len: int) -> tuple[list, dict]:
    """Forward/backward this rank's share of one global mini-batch; gradients accumulate in the
    actor. old_logp None means on-policy: old_logp is this forward's own logp, detached (ratio 1).
    Returns this forward's logp per sample ((n_i,) CPU tensors) and sums for the metrics.
    temperature: the engine's sampling temperature; max_len: its max_new_tokens."""
    counts = torch.tensor([float(sum(len(s.response_ids) for s in samples)), float(len(samples))])
    dist.all_reduce(counts)  # the loss is normalised over the global mini-batch
    n_tokens, n_seqs = counts.tolist()
    logps, stats = [torch.zeros(0)] * len(samples), {"clipped": 0.0, "entropy": 0.0}
    if n_tokens == 0:  # nothing to learn from on any rank (all ranks see the same counts)
        return logps, stats
    actor.train()
    for idx in micro_batch_plan(samples, g.micro_batch_tokens, g.pack):
        extra = {name: [lp[i] for i in idx] or [[0.0]]
                 for name, lp in (("old", old_logp), ("ref", ref_logp)) if lp is not None}
        logp, entropy, mask, pt = forward_logp(actor, [samples[i] for i in idx] or [DUMMY], pad_id,
                                               device, temperature, extra, g.pack, g.logprob_chunk)
        old = pt["old"] if old_logp is not None else logp.detach()
        is_weight = mismatch_weights(old, pt["engine"], mask, g.is_correction, g.is_cap)
        a = adv[idx] if idx else torch.zeros(1)
        loss, clipped = grpo_loss(logp, old, a.to(device), mask, g, n_tokens, n_seqs, max_len,
                                  is_weight, pt.get("ref"))
        # FSDP averages gradients over ranks; the loss is already a global mean: undo the average
        (loss * (dist.get_world_size() if idx else 0.0)).backward()
        if idx:
            stats["clipped"] += clipped.sum().item()
            stats["entropy"] += entropy
            for row, i in enumerate(idx):
                logps[i] = logp[row][mask[row].bool()].detach().float().cpu()
    return logps, stats


def split_mini_batches(n: int, k: int, generator) -> list[list[int]]:
    """A fresh random split of n samples into k mini-batches of near-equal size."""
    order = torch.randperm(n, generator=generator).tolist()
    return [order[j::k] for j in range(k)]


def train_on_rollout(actor, ref, opt, samples: list, adv: torch.Tensor, g: GRPOConfig, *,
                     pad_id: int, device, seed: int, temperature: float, max_len: int,
                     grad_clip: float) -> dict:
    """grpo.ppo_epochs passes over this rank's samples, each split into grpo.mini_batches
    optimizer steps, gradients clipped to `grad_clip` (0: off). `temperature` and `max_len` are
    the engine's sampling temperature and max_new_tokens. Returns the update's metrics
    (tracking.reduce): entropy, clip_frac, the engine/trainer mismatch, kl with a reference, the
    mean grad norm, and logprobs_time_s, the seconds of the old-policy and reference passes
    before the first optimizer step."""
    t = time.perf_counter()
    on_policy = g.ppo_epochs == 1 and g.mini_batches == 1
    # old_logp is the sampling policy as the trainer computes it. On-policy it comes from the
    # update's own forward; otherwise it is recomputed once, before the first optimizer step
    old_logp = (None if on_policy
                else sample_logprobs(actor, samples, g, pad_id, device, temperature))
    ref_logp = None
    if ref is not None:  # the frozen reference lives off the accelerator between its passes
        fsdp_utils.onload(ref)
        ref_logp = sample_logprobs(ref, samples, g, pad_id, device, temperature)
        fsdp_utils.offload(ref)
    logprobs_time = time.perf_counter() - t
    clipped, entropy, loss_tokens, norms = 0.0, 0.0, 0, []
    shuffle = torch.Generator().manual_seed(seed)
    for epoch in range(g.ppo_epochs):
        for part in split_mini_batches(len(samples), g.mini_batches, shuffle):
            old, ref_lp = ([lp[i] for i in part] if lp is not None else None
                           for lp in (old_logp, ref_logp))
            logp, stats = accumulate_gradients(actor, [samples[i] for i in part], adv[part],
                                               old, ref_lp, g, pad_id, device, temperature, max_len)
            if old_logp is None:  # on-policy: the single forward saw the sampling policy
                old_logp = [None] * len(samples)
                for k, i in enumerate(part):
                    old_logp[i] = logp[k]
            clipped += stats["clipped"]
            loss_tokens += sum(len(samples[i].response_ids) for i in part)
            if epoch == 0:  # entropy of the policy as it meets this rollout
                entropy += stats["entropy"]
            norms.append(fsdp_utils.clip_grad_norm(actor, grad_clip))
            opt.step()
            opt.zero_grad(set_to_none=True)
    tokens = sum(len(s.response_ids) for s in samples)
    out = {"entropy": tracking.Mean(entropy, tokens),
           "clip_frac": tracking.Mean(clipped, loss_tokens),
           **mismatch_stats(old_logp, [s.logp for s in samples], g.is_cap)}
    if ref_logp is not None:
        out["kl"] = tracking.Mean(sum(kl_penalty(o, r, g.kl_estimator).sum().item()
                                      for o, r in zip(old_logp, ref_logp)), tokens)
    return {**out, "grad_norm": sum(norms) / len(norms), "logprobs_time_s": logprobs_time}
