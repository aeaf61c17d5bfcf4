"""Plain statements of what the trainer computes another way, for tests to compare against: the
logprobs and entropy of whole (N, T, V) logits, GRPO's loss on a padded batch, a padded batch
itself, and the Ascend fused attention kernel's contract. Nothing here is called by the trainer.
"""


import math

import types

import torch

import batcher
import grpo
import logprobs
import trainer


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """(N, T, V) logits, (N, T) targets -> (N, T) log p(target), in fp32: what logprobs.py
    computes without ever holding (N, T, V) logits."""
    logits = logits.float() / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)


@torch.no_grad()
def masked_entropy_sum(logits: torch.Tensor, mask: torch.Tensor, chunk: int = 256) -> float:
    """Sum of the entropy of softmax(logits) over masked positions of (N, T, V) logits, chunk
    rows at a time: the entropy metric that logprobs.py computes in its pass over the logits."""
    rows = logits[mask.bool()]  # (n_tokens, V), in the logits' dtype
    total = 0.0
    for part in rows.split(chunk):
        logp = part.float().log_softmax(-1)
        total -= (logp.exp() * logp).sum().item()
    return total


def padded_terms(logp, old_logp, adv, cfg, is_weight, ref_logp=None, mask=None, engine=None,
                 forking=None):
    """Each token's term of GRPO's loss on (N, T) padded tensors, adv (N,): the surrogate of
    grpo.policy_loss (PPO's clipped surrogate of exp(logp - old_logp); GSPO's of each
    sequence's geometric-mean ratio over `mask`, differentiated through that mean, LUSPO's the
    same; CISPO's detached capped ratio times logp; SAPO's gate; VESPO's detached gamma weight
    of each sequence's ratio, the mismatch weights inside it, times A logp), times the mismatch
    weight (not VESPO's), times `forking` (N, T) where given, plus kl_coef times the KL
    estimate; and where the surrogate cut the gradient. Written apart from grpo.grpo_loss, each
    from its paper's formula."""
    ratio = (logp - old_logp).exp()
    a = adv[:, None]
    policy = getattr(cfg, "policy_loss", "ppo")
    if policy in ("gspo", "luspo"):  # s_i = exp(mean over the sequence of log ratios), a row's
        ratio = (((logp - old_logp) * mask).sum(1, keepdim=True)
                 / mask.sum(1, keepdim=True).clamp(min=1)).exp().expand_as(logp)
    if policy == "vespo":  # VESPO (arXiv 2602.10693), as TRL 1.16's get_gamma_weights
        floor = math.log(1e-8)
        log_w = (((logp.detach() - old_logp).clamp(-20, 20) * mask).sum(1, keepdim=True)
                 + (is_weight.log().clamp(floor, 20) * mask).sum(1, keepdim=True)).clamp(floor, 20)
        k = torch.where(a >= 0, cfg.vespo_k_pos, cfg.vespo_k_neg)
        lam = torch.where(a >= 0, cfg.vespo_lambda_pos, cfg.vespo_lambda_neg)
        phi = (lam + k * log_w - lam * log_w.exp()).exp()  # (N, 1)
        surrogate, cut = phi * a * logp, (phi < 0.5).expand_as(logp)
        is_weight = torch.ones_like(is_weight)  # inside phi already
    elif policy == "cispo":
        weight = ratio.detach().clamp(max=1 + cfg.clip_high)
        surrogate, cut = weight * a * logp, ratio > 1 + cfg.clip_high
    elif policy in ("dppo_tv", "dppo_kl"):  # DPPO (arXiv 2602.04879): sg(min(r, cap)) A log p
        # in the divergence's trust region around the anchor, else 0; the anchor the rollout's
        # (the engine's logprobs, whose ratio is the correction: no weight on top) or the old's
        rollout = getattr(cfg, "dppo_anchor", "rollout") == "rollout"
        anchor = engine if rollout else old_logp
        p, q = logp.detach().exp(), anchor.exp()
        if policy == "dppo_tv":
            up, down = p - q <= cfg.clip_high, q - p <= cfg.clip_low
        else:
            kl = q * (anchor - logp.detach()) + (1 - q) * ((1 - q + 1e-8) / (1 - p + 1e-8)).log()
            up, down = (kl <= cfg.clip_high) | (p <= q), (kl <= cfg.clip_low) | (p >= q)
        inside = torch.where(a > 0, up, down)
        r = (logp - anchor).exp().detach().clamp(max=cfg.dppo_ratio_cap)
        surrogate, cut = r * a * logp * inside, ~inside
        is_weight = torch.ones_like(is_weight) if rollout else is_weight
    elif policy == "sapo":
        tau = torch.where(a > 0, a.new_full((), cfg.sapo_tau_pos), a.new_full((), cfg.sapo_tau_neg))
        gate = torch.sigmoid(tau * (ratio - 1))
        surrogate, cut = 4 / tau * gate * a, 4 * gate * (1 - gate) < 0.5
    else:
        bounded = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high)
        surrogate, cut = torch.minimum(ratio * a, bounded * a), ratio * a > bounded * a
        if getattr(cfg, "dual_clip", 0):  # dual-clip PPO (arXiv 1912.09729): A < 0, >= c A
            low = (a < 0) & (surrogate < cfg.dual_clip * a)
            surrogate, cut = torch.where(low, (cfg.dual_clip * a).expand_as(logp), surrogate), \
                cut | low
    terms = -surrogate * is_weight
    if getattr(cfg, "off_policy_delta", 0) > 0:  # DeepSeek-V3.2: drop a negative-advantage
        #   response whose mean log(p_engine / p_current) exceeds delta, for each of its tokens
        n = mask.sum(1, keepdim=True).clamp(min=1)
        kl = ((engine - logp.detach()) * mask).sum(1, keepdim=True) / n
        terms = terms * ~((a < 0) & (kl > cfg.off_policy_delta))
    if forking is not None:  # the high-entropy tokens alone keep a policy gradient
        terms = terms * forking
    if ref_logp is not None and cfg.kl_coef > 0:  # unbiased: times pi / pi_old (DeepSeek-V3.2)
        kl = grpo.kl_penalty(logp, ref_logp, cfg.kl_estimator)
        terms = terms + cfg.kl_coef * kl * ((logp - old_logp).exp()
                                            if getattr(cfg, "kl_unbiased", False) else 1)
    return terms, cut


def padded_loss(logp, old_logp, adv, mask, cfg, n_tokens: float, n_seqs: float, max_len: int,
                is_weight, ref_logp=None, engine=None, forking=None):
    """GRPO's loss over a padded batch (N, T), normalised over a global mini-batch of n_tokens
    response tokens in n_seqs sequences (grpo.loss_weights), and the (N, T) bool tokens where
    the surrogate cut the gradient, on the mask."""
    terms, cut = padded_terms(logp, old_logp, adv, cfg, is_weight, ref_logp, mask, engine,
                              forking)
    weights = grpo.loss_weights(mask, cfg, n_tokens, n_seqs, max_len)
    return (terms * weights).sum(), cut & mask.bool()


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


def fusion_attention_reference(query, key, value, head_num, input_layout, atten_mask=None,
                               scale=1.0, keep_prob=1.0, sparse_mode=0, actual_seq_qlen=None,
                               actual_seq_kvlen=None, **unused):
    """The Ascend fused attention kernel's contract (npu_ops.fusion_attention names its document)
    for the two layouts npu_ops uses, in fp32:
    - "TND": query (T, N, D), key/value (T, Nkv, D) holding samples end to end; actual_seq_qlen
      and actual_seq_kvlen are the samples' cumulative ends (host ints), attention stays in a
      sample;
    - "BNSD": (B, N, S, D).
    atten_mask is True where a score is masked out. sparse_mode 2 and 3 take the compressed
    2048 x 2048 causal mask and mean causal within each sample (for a sample's equal query and
    key lengths the two agree); 0 takes the mask as given ((B, 1, S, S) or (S, S)). Nkv must
    divide N (grouped-query attention). No dropout. Returns (output,), as the kernel returns its
    output first; the output has the query's dtype."""
    if keep_prob != 1.0:
        raise NotImplementedError("fusion_attention_reference: no dropout")
    axis = -2 if input_layout == "TND" else 1  # the heads
    assert query.shape[axis] == head_num and head_num % key.shape[axis] == 0, key.shape

    def attend(q, k, v, mask):  # q (..., N, S, D); k, v (..., Nkv, S, D); mask True = out
        groups = q.shape[-3] // k.shape[-3]
        k, v = (x.repeat_interleave(groups, dim=-3).float() for x in (k, v))
        scores = (q.float() @ k.transpose(-1, -2)) * scale
        if mask is not None:
            scores = scores.masked_fill(mask, float("-inf"))
        return (scores.softmax(-1) @ v).to(q.dtype)

    def causal(n, device):
        return torch.ones(n, n, dtype=torch.bool, device=device).triu(1)

    if input_layout == "TND":
        assert list(actual_seq_qlen) == list(actual_seq_kvlen), "self-attention only"
        outs, start = [], 0
        for end in actual_seq_qlen:  # host ints: no read of the device
            q, k, v = (x[start:end].transpose(0, 1) for x in (query, key, value))
            mask = causal(end - start, q.device) if sparse_mode in (2, 3) else None
            outs.append(attend(q, k, v, mask).transpose(0, 1))
            start = end
        return (torch.cat(outs),)
    assert input_layout == "BNSD", input_layout
    mask = causal(query.shape[2], query.device) if sparse_mode in (2, 3) else atten_mask
    return (attend(query, key, value, mask),)


def batch_of(samples: list, adv: torch.Tensor, seed: int = 0, **fields) -> batcher.Batch:
    """A batcher.Batch of `samples` whose advantages adv (n,) are each sample's at every one of
    its response tokens, in fp32 (as batcher.share lays them out); `fields`: the Batch's others
    (teacher, split, step, old_logp, ref_logp, forking)."""
    return batcher.Batch.per_sample(samples, adv, seed, **fields)


def settings(cfg, temperature: float = 1.0, max_len: int = 64, top_p: float = 1.0,
             grad_clip: float = 0.0, **passes) -> trainer.Settings:
    """trainer.settings of the grpo section `cfg` for tests on the host: pad id 0, device cpu
    unless `passes` say."""
    return trainer.settings(cfg, temperature, top_p, max_len, grad_clip, **passes)


def prepared(batch, actor, ref, s: trainer.Settings):
    """`batch` through the passes without gradient that train_step gives the update under
    s.grpo (train_grpo.batch_transforms, the product's own list: the old policy, forking, the
    reference), for a run of `actor` and its reference `ref` (or None)."""
    import train_grpo

    run = types.SimpleNamespace(applied=train_grpo.Config(grpo=s.grpo), split=batch.split,
                                teacher=None, actor=actor, ref=ref, settings=s)
    for transform in train_grpo.batch_transforms(run):
        batch = transform(batch)
    return batch


def update(actor, ref, opt, batch, s: trainer.Settings) -> dict:
    """The update as train_step runs it (the passes before it: `prepared`): its metrics and the
    passes', with each optimizer step's verdict under "skipped"."""
    batch = prepared(batch, actor, ref, s)
    result = trainer.update(actor, opt, batch, s)
    return {**batch.metrics, **result.metrics, "skipped": result.skipped}


def weighted_sum(logp, w):
    """A loss for logprobs.Objective: the sum of w x logp over the tokens, and their logp summed
    as its count."""
    return (logp * w).sum(), logp.sum()


def weighted(w, bonus=None) -> logprobs.Objective:
    """An arbitrary loss to compare gradients with, as the fused pass takes one: the sum of
    w x logp (w (K,)), with an entropy bonus of weight `bonus` (K,) at each token if given; no
    sequence terms, no teacher."""
    return logprobs.Objective(weighted_sum, w, entropy_weights=bonus)
