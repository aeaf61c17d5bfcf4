"""The algorithm: GRPO's advantages, its loss and variants, and the update over a rollout.

Nothing here knows about engines or files: a rollout arrives as samples (prompt_ids,
response_ids, the engine's logp of each response token) and rewards, and leaves as gradient steps
on the FSDP2 actor. To try a new loss, edit `grpo_loss`: it is the per-token objective that
training minimises (the fused pass in logprobs.py calls it on every chunk of output rows, and
differentiates it there). For a new option, add a field to `GRPOConfig` with its domain in the
field's type (domains.py). The advantages are `advantages` (by default `group_advantages`),
called by `score`.

With the defaults this GRPO is, precisely:
- advantage = (r - mean_group) / (std_group + eps), std unbiased (DeepSeekMath's GRPO); groups
  whose rewards are all exactly equal get advantage 0 (they carry no signal);
- loss = PPO's clipped surrogate averaged over every response token of the global batch (DAPO's
  token-level mean), times a truncated importance weight min(p_trainer / p_engine, 2) per token
  (TIS) for the gap between the engine's sampling and the trainer's logprobs; no KL term, no
  entropy bonus;
- one optimizer step per rollout, so old_logp is the current policy's own (detached) logp, the
  ratio is 1, and the gradient is REINFORCE with group-normalised advantages (TIS-weighted).
Variants, each a few lines selected by the `grpo:` config section (docs/algorithm.md has the table):
sequence-mean (GRPO) or constant (Dr. GRPO) loss normalisation and no std scaling, the batch's
std instead of the group's (Lite PPO), each reward function normalised apart (GDPO), asymmetric
clipping (DAPO), other surrogates (GSPO, CISPO, SAPO), several epochs and mini-batches per
rollout (PPO), a KL term to a frozen reference (k1/k2/k3, optionally unbiased), token or
sequence masking or truncation instead of TIS, DeepSeek-V3.2's off-policy sequence mask, dynamic
sampling (DAPO), and masking or a soft penalty for responses cut at the length limit (DAPO).

A multi-turn sample (episodes.py) holds the environment's replies inside its response, with
`mask` 0 there: those tokens get no loss, no importance weight and no KL, count in no token
mean, and stay out of the mismatch and KL metrics. "Response token" above means a token the
model wrote.
"""

import dataclasses
import math
import time
from dataclasses import dataclass, field
from typing import Annotated

import torch
import torch.distributed as dist

import fsdp_utils
import logprobs
import moe
import tracking
from domains import FLAG, OneOf, Range, need


LOSS_AGGS = ("token_mean", "seq_mean", "constant", "seq_sum")
POLICY_LOSSES = ("ppo", "gspo", "luspo", "cispo", "sapo", "dppo_tv", "dppo_kl", "vespo")
SEQ_RATIO = ("gspo", "luspo")  # surrogates of each sequence's ratio
IS_MODES = ("none", "tis", "token_mask", "seq_truncate", "seq_mask", "seq_geo_mask")
SEQ_IS_MODES = ("seq_truncate", "seq_mask", "seq_geo_mask")  # need whole sequences


@dataclass
class GRPOConfig:
    group_size: Annotated[int, Range(2)] = 8  # G: responses sampled per prompt
    # over all ranks; each engine group takes an equal slice
    prompts_per_step: Annotated[int, Range(1)] = 32
    adv_eps: Annotated[float, Range(0)] = 1e-6  # added to the group std
    scale_adv_by_std: Annotated[bool, FLAG] = True  # false: adv = r - mean (Dr. GRPO)
    # the std that divides r - mean: its group's (GRPO), or the batch's, every sample of the
    #   step over all engine groups (Lite PPO, arXiv 2508.08221; TRL scale_rewards=batch)
    adv_std: Annotated[str, OneOf("group", "batch")] = "group"
    # several reward.funcs: sum, the advantage of their weighted sum; gdpo, each function's
    #   own group advantage, weighted and summed, then normalised over the batch (GDPO, arXiv
    #   2601.05242; TRL multi_objective_aggregation=normalize_then_sum)
    reward_agg: Annotated[str, OneOf("sum", "gdpo")] = "sum"
    # token_mean (DAPO) | seq_mean (GRPO) | constant (Dr. GRPO) | seq_sum: each sequence's sum
    #   over its tokens, averaged over sequences (LUSPO's: a sequence weighs by its length)
    loss_agg: Annotated[str, OneOf(*LOSS_AGGS)] = "token_mean"
    # ratio clipped to [1 - clip_low, 1 + clip_high]
    clip_low: Annotated[float, Range(0, 1, hi_open=True)] = 0.2
    clip_high: Annotated[float, Range(0)] = 0.2  # DAPO's "clip-higher" raises this (0.28)
    # the surrogate (grpo_loss): ppo, PPO's clipped token ratio (GRPO, DAPO); gspo, the
    #   sequence's ratio (geometric mean of its tokens'), clipped (Zheng et al. 2025, arXiv
    #   2507.18071: loss_agg seq_mean, clips of ~3e-4); cispo, the token ratio capped at
    #   1 + clip_high and detached, so every token keeps a gradient (MiniMax-M1, arXiv
    #   2506.13585); sapo, a smooth gate of the ratio instead of the clip (arXiv 2511.20347);
    #   dppo_tv / dppo_kl, DPPO (arXiv 2602.04879, verl's losses of those names): sg(min(ratio,
    #   dppo_ratio_cap)) A log p, 0 where the token's probability left a trust region measured
    #   by a divergence (binary TV or binary KL to the old policy's) instead of the ratio; its
    #   bounds are clip_high (A > 0) and clip_low (A < 0), as in verl; luspo, gspo's surrogate
    #   with each sequence's term times its length (LUSPO, arXiv 2602.05261; TRL's luspo:
    #   loss_agg seq_sum); vespo, sg(phi(w)) A log p with w the sequence's ratio to the
    #   sampling policy (a product, the engine's mismatch folded in) and phi a gamma-shaped
    #   weight, phi(1) = 1, instead of a clip (VESPO, arXiv 2602.10693; TRL 1.16's vespo)
    policy_loss: Annotated[str, OneOf(*POLICY_LOSSES)] = "ppo"
    # dppo_*: the detached ratio's cap (verl's clip_ratio_c, 3 by default)
    dppo_ratio_cap: Annotated[float, Range(1)] = 3.0
    # dual-clip PPO (Ye et al. 2020, arXiv 1912.09729, eq. 4): with a negative advantage the
    #   clipped surrogate is at least c x A, so a token whose ratio grew far past the clip
    #   cannot move the loss without bound; 0: off, else c > 1 (the paper's 3). ppo and gspo
    dual_clip: Annotated[float, Range(0)] = 0.0
    # VESPO's phi(w) = exp(lambda + k log w - lambda w), largest at w = k / lambda (defaults:
    #   TRL 1.16's): k, how fast phi falls below w = k / lambda, for A >= 0
    vespo_k_pos: Annotated[float, Range(0)] = 2.0
    vespo_lambda_pos: Annotated[float, Range(0, lo_open=True)] = 3.0  # lambda, its decay, A >= 0
    vespo_k_neg: Annotated[float, Range(0)] = 3.0  # k for A < 0
    vespo_lambda_neg: Annotated[float, Range(0, lo_open=True)] = 2.0  # lambda for A < 0
    sapo_tau_pos: Annotated[float, Range(0, lo_open=True)] = 1.0  # SAPO's gate temperature, A > 0
    sapo_tau_neg: Annotated[float, Range(0, lo_open=True)] = 1.05  # and A <= 0 (the paper's)
    # an entropy bonus: the loss minus entropy_coef x the mean entropy of the sampling
    #   distribution (the nucleus at rollout.top_p < 1) over the tokens the model wrote (TRL's
    #   entropy_coef); 0: off. No extra pass: its gradient joins the logprobs' in the fused pass
    entropy_coef: Annotated[float, Range(0)] = 0.0
    # rho: only the top rho of the rollout's tokens by entropy keep their policy gradient, the
    #   "forking tokens" (Wang et al. 2025, arXiv 2506.01939, whose rho is 0.2; TRL's
    #   top_entropy_quantile); the threshold is over every rank's tokens, under the policy
    #   before the rollout's first optimizer step; 1: every token. On-policy it takes one more
    #   forward without gradient; off-policy it rides on the old policy's pass
    top_entropy_quantile: Annotated[float, Range(0, 1)] = 1.0
    ppo_epochs: Annotated[int, Range(1)] = 1  # passes over each rollout
    # optimizer steps per pass; >1 epochs or mini-batches: off-policy
    mini_batches: Annotated[int, Range(1)] = 1
    # KL-to-reference loss weight; > 0 builds a frozen reference copy
    kl_coef: Annotated[float, Range(0)] = 0.0
    # Schulman's estimators; k3 as in DeepSeekMath
    kl_estimator: Annotated[str, OneOf("k1", "k2", "k3")] = "k3"
    # the KL term times the ratio to the old policy, so that off-policy tokens estimate the
    #   current policy's KL without bias (DeepSeek-V3.2, arXiv 2512.02556)
    kl_unbiased: Annotated[bool, FLAG] = False
    # engine/trainer mismatch correction (mismatch_weights): per token tis (truncate) or
    #   token_mask (IcePop); per sequence seq_truncate, seq_mask (its ratio: masked importance
    #   sampling), seq_geo_mask (the geometric mean of its tokens' ratios: verl's geometric
    #   level); a mask keeps the ratio as the weight inside its band, 0 outside
    is_correction: Annotated[str, OneOf(*IS_MODES)] = "tis"
    # C: the upper bound of the weight or the band; the masks keep ratios in [C_low, C]
    is_cap: Annotated[float, Range(1, lo_open=True)] = 2.0
    # C_low: the lower bound (truncate: the weight's floor); 0: none for tis, token_mask and
    #   seq_truncate, 1/C for seq_mask and seq_geo_mask
    is_cap_low: Annotated[float, Range(0, 1, hi_open=True)] = 0.0
    # DeepSeek-V3.2's off-policy sequence mask (arXiv 2512.02556, eq. 9): a response with a
    #   negative advantage whose mean log(p_engine / p_trainer) over its tokens exceeds this
    #   gets no policy loss (its KL term stays); 0: off. On, each micro-batch takes one more
    #   pass over the vocabulary (its sequences' logprobs before any gradient)
    off_policy_delta: Annotated[float, Range(0)] = 0.0
    dynamic_sampling: Annotated[bool, FLAG] = False  # drop groups whose rewards are all equal
    # with dynamic sampling: rounds of fresh prompts to refill the batch
    max_gen_rounds: Annotated[int, Range(1)] = 1
    # truncated responses: none | mask (out of the loss) | penalty
    overlong: Annotated[str, OneOf("none", "mask", "penalty")] = "none"
    # penalty: last N tokens before max_new_tokens ramp it to -factor
    overlong_buffer: Annotated[int, Range(0)] = 0
    overlong_penalty_factor: Annotated[float, Range(0)] = 1.0  # the penalty at the limit
    # tokens per forward/backward on one rank (padding counts too when pack is false)
    micro_batch_tokens: Annotated[int, Range(1)] = 8192
    # a micro-batch is one row of samples end to end, no padding (fsdp_utils)
    pack: Annotated[bool, FLAG] = True
    # output-layer rows at a time: at most (chunk x vocab) fp32 logits
    logprob_chunk: Annotated[int, Range(1)] = 1024

    def check(self, cfg, world_size: int) -> None:
        """The section against the run (config.validate calls it): dynamic sampling's rounds,
        the overlong penalty's buffer within a response, then the surrogates' rules
        (`validate`). The batch's arithmetic over ranks: rollout.RolloutConfig.check."""
        need(self.max_gen_rounds == 1 or (self.dynamic_sampling and self.max_gen_rounds > 1),
             f"grpo.max_gen_rounds={self.max_gen_rounds}: more than 1 needs "
             "grpo.dynamic_sampling=true")
        max_new_tokens = cfg.rollout.max_new_tokens
        need(self.overlong != "penalty" or 0 < self.overlong_buffer <= max_new_tokens,
             f"grpo.overlong=penalty needs 0 < grpo.overlong_buffer <= rollout.max_new_tokens "
             f"({max_new_tokens}); got {self.overlong_buffer}")
        validate(self)


def validate(cfg: GRPOConfig) -> None:
    """The `grpo` fields across each other, where a surrogate's paper rules a combination out; a
    one-line ValueError naming the fields and the fix."""
    defaults = GRPOConfig()
    if cfg.policy_loss == "gspo" and cfg.loss_agg != "seq_mean":
        raise ValueError(f"grpo.policy_loss=gspo with grpo.loss_agg={cfg.loss_agg}: GSPO's "
                         "objective is a mean over sequences of each sequence's term, which "
                         "seq_mean alone gives. Fix: grpo.loss_agg=seq_mean")
    if cfg.policy_loss == "luspo" and cfg.loss_agg != "seq_sum":
        raise ValueError(f"grpo.policy_loss=luspo with grpo.loss_agg={cfg.loss_agg}: LUSPO's "
                         "objective is a mean over sequences of each sequence's term times its "
                         "length, which seq_sum alone gives. Fix: grpo.loss_agg=seq_sum")
    if cfg.policy_loss in SEQ_RATIO and cfg.is_correction in ("tis", "token_mask"):
        raise ValueError(f"grpo.policy_loss={cfg.policy_loss} with grpo.is_correction="
                         f"{cfg.is_correction}: it weighs whole sequences, that mode single "
                         "tokens, and a sequence's gradient would depend on how the weights "
                         "spread over its tokens. Fix: grpo.is_correction=seq_mask (or another "
                         "seq_ mode, or none)")
    if cfg.policy_loss == "vespo" and cfg.is_correction in SEQ_IS_MODES:
        raise ValueError(f"grpo.policy_loss=vespo with grpo.is_correction={cfg.is_correction}: "
                         "VESPO folds each token's mismatch weight into its sequence's ratio, "
                         "which a sequence's weight would count once per token. Fix: grpo."
                         "is_correction=tis or token_mask (or none)")
    if 0 < cfg.dual_clip <= 1:
        raise ValueError(f"grpo.dual_clip={cfg.dual_clip}: the lower bound c x A of a negative "
                         "advantage's surrogate needs c > 1 (below, it would cut tokens inside "
                         "the clip range). Fix: grpo.dual_clip=3 (the paper's), or 0 (off)")
    if cfg.dual_clip and cfg.policy_loss not in ("ppo", *SEQ_RATIO):
        raise ValueError(f"grpo.dual_clip with grpo.policy_loss={cfg.policy_loss}: dual-clip "
                         "bounds PPO's clipped surrogate, which that one does not use. Fix: "
                         "grpo.dual_clip=0, or policy_loss ppo, gspo or luspo")
    if cfg.adv_std == "batch" and not cfg.scale_adv_by_std:
        raise ValueError("grpo.adv_std=batch with grpo.scale_adv_by_std=false: no std divides "
                         "the advantage. Fix: drop one of them")
    if cfg.reward_agg == "gdpo" and (cfg.adv_std, cfg.scale_adv_by_std) != ("group", True):
        raise ValueError("grpo.reward_agg=gdpo divides each function's advantage by its group's "
                         "std, then the sum by the batch's: it ignores grpo.adv_std and grpo."
                         "scale_adv_by_std. Fix: leave them out")
    if cfg.reward_agg == "gdpo" and cfg.overlong == "penalty":
        raise ValueError("grpo.reward_agg=gdpo with grpo.overlong=penalty: the penalty adds to "
                         "the weighted sum, which GDPO does not normalise. Fix: grpo.overlong="
                         "mask, or reward_agg=sum")
    ignored = [f"clip_low={cfg.clip_low}"] if cfg.clip_low != defaults.clip_low else []
    if cfg.policy_loss in ("sapo", "vespo") and cfg.clip_high != defaults.clip_high:
        ignored.append(f"clip_high={cfg.clip_high}")
    if cfg.policy_loss in ("sapo", "cispo", "vespo") and ignored:
        uses = {"sapo": "gates with grpo.sapo_tau_pos/sapo_tau_neg",
                "vespo": "weighs with grpo.vespo_k_*/vespo_lambda_*",
                "cispo": "caps the ratio at 1 + grpo.clip_high, with no lower bound"
                }[cfg.policy_loss]
        raise ValueError(f"grpo.policy_loss={cfg.policy_loss} {uses}: it ignores grpo."
                         f"{' and grpo.'.join(ignored)}. Fix: leave them out, or pick "
                         "policy_loss ppo or gspo")


# ----------------------------------------------------------------------------------------------
# the math: small pure functions on tensors. Each variant names the paper it comes from.


def constant_groups(rewards: torch.Tensor, group_size: int, valid=None) -> torch.Tensor:
    """(B*G,) rewards, or (B*G, K): K reward functions' values -> (B,) bool: groups whose rewards
    (each function's) are all exactly equal. An exact test: 0.1 + 0.2 vs 0.3 is float noise, not
    signal, and must not become a 1e8-scale advantage. With `valid` ((B*G,) bool), over each
    group's valid samples: fewer than two is no signal."""
    r = rewards.reshape(-1, group_size, rewards.shape[1] if rewards.dim() == 2 else 1)
    if valid is None:
        return (r == r[:, :1]).all(2).all(1)
    v = valid.view(-1, group_size)
    at = v.to(torch.long).argmax(1).view(-1, 1, 1).expand(-1, 1, r.shape[2])
    first = r.gather(1, at)  # a valid sample's rewards
    return ((r == first).all(2) | ~v).all(1) | (v.sum(1) < 2)


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6,
                     scale_by_std: bool = True, valid=None) -> torch.Tensor:
    """(B*G,) rewards, prompt-major -> (B*G,) advantages: r - mean of its group, divided by the
    group's unbiased std + eps (DeepSeekMath's GRPO), or not divided (Dr. GRPO: the std
    re-weights prompts by difficulty). Constant groups get exactly 0. `valid` ((B*G,) bool):
    the samples that count (a failed environment or reward call does not): each group's mean
    and std are its valid samples', as if the others were not there; those get 0."""
    if valid is not None and bool(valid.all()):
        valid = None
    r = rewards.view(-1, group_size)  # (B, G)
    if valid is None:
        adv, std = r - r.mean(1, keepdim=True), r.std(1, keepdim=True)
    else:
        v = valid.view(-1, group_size)
        n = v.sum(1, keepdim=True)
        adv = (r - (r * v).sum(1, keepdim=True) / n.clamp(min=1)) * v
        std = (adv.square().sum(1, keepdim=True) / (n - 1).clamp(min=1)).sqrt()
    if scale_by_std:
        adv = adv / (std + eps)
    return adv.masked_fill(constant_groups(rewards, group_size, valid).unsqueeze(1), 0.0).view(-1)


def batch_moments(x: torch.Tensor, valid: torch.Tensor, over_engines) -> tuple[float, float]:
    """The mean and unbiased std of x's valid entries over the whole batch: this engine group's
    and every other's, through `over_engines` (a list of floats summed over the engine groups,
    each counted once: rollout.EngineGroup.sum_over_engines, called alike by every rank)."""
    n, total = over_engines([float(valid.sum()), float(x[valid].sum())])
    mean = total / max(n, 1)
    (squares,) = over_engines([float((x[valid] - mean).square().sum())])
    return mean, math.sqrt(squares / max(n - 1, 1))


def advantages(columns: torch.Tensor, weights: list, valid: torch.Tensor, cfg: GRPOConfig,
               over_engines=lambda v: v) -> tuple[torch.Tensor, float | None]:
    """(B*G, K) rewards (`reward_columns`), prompt-major -> (B*G,) advantages, and the batch std
    that divided them (None: the groups' own did). sum (K = 1): group_advantages, or with
    grpo.adv_std=batch, r - its group's mean over the batch's std (Lite PPO). gdpo: each
    function's group advantage, weighted by `weights` and summed, then that sum normalised over
    the batch (GDPO). Constant groups (every function constant) and invalid samples get 0."""
    G, eps, std = cfg.group_size, cfg.adv_eps, None
    if cfg.reward_agg == "gdpo":
        x = sum(w * group_advantages(c.contiguous(), G, eps, True, valid)
                for w, c in zip(weights, columns.T))
        mean, std = batch_moments(x, valid, over_engines)
        adv = (x - mean) / (std + eps)
    else:
        r, by_group = columns[:, 0], cfg.adv_std == "group"
        adv = group_advantages(r, G, eps, cfg.scale_adv_by_std and by_group, valid)
        if not by_group:
            std = batch_moments(r, valid, over_engines)[1]
            adv = adv / (std + eps)
    signal = valid & ~constant_groups(columns, G, valid).repeat_interleave(G)
    return adv.masked_fill(~signal, 0.0), std


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float):
    """DAPO's soft overlong punishment, added to the reward: 0 up to max_len - buffer tokens, then
    falling linearly to -factor at max_len."""
    return -factor * ((lengths - (max_len - buffer)) / buffer).clamp(0.0, 1.0)


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


def mismatch_weights(old_logp, engine_logp, mask, mode: str, cap: float,
                     cap_low: float = 0.0):
    """(N, T) importance weights that correct for the engine sampling from a slightly different
    distribution than the trainer computes (kernels, precision). ratio = p_trainer / p_engine;
    [lo, C] = [cap_low, cap] (for seq_mask and seq_geo_mask, cap_low 0 means 1/C).
    - none: 1;
    - tis: the token's ratio clamped to [lo, C]: truncated importance sampling (Yao et al. 2025,
      "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training");
    - token_mask: the token's ratio where it lies in [lo, C], else 0: IcePop's M(k) = k on
      [alpha, beta] (Ring-1T, arXiv 2510.18855), TRL 1.16's token_mask (lo = 0);
    - seq_truncate: the sequence's ratio (product over its tokens) clamped to [lo, C], for each
      of its tokens;
    - seq_mask: the sequence's ratio where it lies in [lo, C], else 0, for each of its tokens:
      masked importance sampling (Liu et al. 2025, "When Speed Kills Stability"; TRL 1.16's
      sequence_mask, lo = 0);
    - seq_geo_mask: the same with the geometric mean of its tokens' ratios (verl's geometric
      level), which does not shrink with the sequence's length.
    Detached: the weights scale the gradient, they do not get one."""
    log_ratio = ((old_logp - engine_logp) * mask).detach()
    if mode == "none":
        return torch.ones_like(log_ratio)
    lo = cap_low if cap_low > 0 or mode not in ("seq_mask", "seq_geo_mask") else 1 / cap
    if mode in ("tis", "token_mask"):
        ratio = log_ratio.exp()
        return ratio.clamp(lo, cap) if mode == "tis" else masked(ratio, lo, cap)
    seq = log_ratio.sum(1)
    if mode == "seq_geo_mask":
        seq = seq / mask.sum(1).clamp(min=1)
    ratio = seq.exp()
    weight = ratio.clamp(lo, cap) if mode == "seq_truncate" else masked(ratio, lo, cap)
    return weight.unsqueeze(1).expand_as(log_ratio)


def masked(ratio, lo: float, cap: float):
    """The ratio where it lies in [lo, cap], else 0: the masks' weight."""
    return ratio * ((ratio >= lo) & (ratio <= cap)).to(ratio.dtype)


def loss_weights(mask, cfg: GRPOConfig, n_tokens: float, n_seqs: float, max_len: int):
    """(N, T) mask of response tokens -> (N, T) each token's weight in the batch loss (0 off the
    mask): the aggregation over a global mini-batch of n_tokens tokens in n_seqs sequences."""
    if cfg.loss_agg == "token_mean":  # every token of the batch weighs the same (DAPO)
        return mask / n_tokens
    if cfg.loss_agg == "seq_mean":  # mean over tokens, then over sequences (GRPO, DeepSeekMath)
        return mask / (mask.sum(1, keepdim=True).clamp(min=1) * n_seqs)
    if cfg.loss_agg == "seq_sum":  # sum over tokens, mean over sequences (LUSPO)
        return mask / n_seqs
    # constant: sum over tokens / (sequences x max_new_tokens): no length bias (Dr. GRPO)
    return mask / (n_seqs * max_len)


@dataclass(frozen=True)
class Tokens:
    """What the loss takes of each of a micro-batch's K response tokens, (K,) tensors in
    logprobs.MicroBatch's order (`token_inputs` makes them); `tokens[k]` is the slice k."""
    adv: torch.Tensor  # its advantage (its sample's, or per token: a teacher's signal)
    coef: torch.Tensor  # its weight in the batch's loss (loss_weights: the aggregation)
    written: torch.Tensor  # 1 where the model wrote it, 0 where an environment did
    engine: torch.Tensor  # the engine's logprob of it: the policy that sampled it
    old: torch.Tensor | None = None  # the old policy's logprob; None: on-policy (this forward's)
    is_weight: torch.Tensor | None = None  # the mismatch weight; None: grpo_loss makes it
    ref: torch.Tensor | None = None  # the reference's logprob, for the KL term; None: no KL
    seq_ratio: torch.Tensor | None = None  # gspo: its sequence's ratio to the old policy
    seq_keep: torch.Tensor | None = None  # off_policy_delta: 0 where its response is masked
    seq_log_w: torch.Tensor | None = None  # vespo: log of its sequence's ratio (vespo_log_w)
    forking: torch.Tensor | None = None  # top_entropy_quantile: 1 where it keeps its gradient
    ent_coef: torch.Tensor | None = None  # its weight in the entropy bonus; None: no bonus
    top_ids: torch.Tensor | None = None  # (K, k) a teacher's k likeliest tokens (TeacherTopK)
    top_logp: torch.Tensor | None = None  # (K, k) the teacher's logprobs of them
    top_coef: torch.Tensor | None = None  # the forward KL's weight: coef x TeacherTopK.coef

    def __getitem__(self, k: slice) -> "Tokens":
        return Tokens(**{name: None if v is None else v[k] for name, v in vars(self).items()})


def grpo_loss(logp: torch.Tensor, t: Tokens, cfg: GRPOConfig):
    """The per-token objective that training minimises: edit this to try a new loss.

    logp (c,): this forward's logprob of c response tokens under softmax(logits / temperature),
    which the gradient flows through; t: the same tokens' inputs (Tokens, (c,) each). Returns the
    loss of these tokens, a sum of per-token terms each weighed by t.coef (so that chunks,
    micro-batches and ranks add up to the mean over the global mini-batch), and the count of
    tokens the model wrote where the surrogate cut the gradient (clipped; sapo: damped below
    half). Each term: the surrogate of the ratio to the old policy (grpo.policy_loss) times the
    engine/trainer mismatch weight, plus the KL term to the reference (in the loss, not the
    reward: DeepSeekMath). On-policy the old logprob is logp itself, detached: ratio 1, and every
    surrogate's gradient is REINFORCE's. logprobs.run differentiates this function with respect
    to logp alone, inside its pass over the vocabulary: it must be a sum of per-token terms (no
    term may mix tokens; gspo's sequence ratio comes in t.seq_ratio, from a first pass)."""
    old = logp.detach() if t.old is None else t.old
    w = t.is_weight if t.is_weight is not None else mismatch_weights(
        old[None], t.engine[None], t.written[None], cfg.is_correction, cfg.is_cap,
        cfg.is_cap_low)[0]
    # the token's ratio; gspo: its sequence's, with each token's share of its gradient (the
    # paper's GSPO-token form: equal advantages within a sequence give GSPO's gradient)
    ratio = (t.seq_ratio * torch.exp(logp - logp.detach()) if cfg.policy_loss in SEQ_RATIO
             else torch.exp(logp - old))
    if cfg.policy_loss == "vespo":  # sg(phi(w)) A log p; w holds the mismatch: no weight apart
        phi = vespo_phi(t.seq_log_w if t.seq_log_w is not None else torch.zeros_like(old),
                        t.adv, cfg)
        surrogate, cut, w = phi * t.adv * logp, phi < 0.5, 1
    elif cfg.policy_loss == "cispo":  # sg(min(ratio, 1 + clip_high)) A log p: the paper's form
        weight = ratio.detach().clamp(max=1 + cfg.clip_high)
        surrogate, cut = weight * t.adv * logp, weight < ratio
    elif cfg.policy_loss in ("dppo_tv", "dppo_kl"):  # sg(min(ratio, cap)) A log p, in the region
        inside = dppo_inside(logp.detach(), old, t.adv, cfg)
        weight = ratio.detach().clamp(max=cfg.dppo_ratio_cap)
        surrogate, cut = weight * t.adv * logp * inside, ~inside
    elif cfg.policy_loss == "sapo":  # 4/tau sigmoid(tau (ratio - 1)): slope 1 at ratio 1
        tau = torch.where(t.adv > 0, t.adv.new_full((), cfg.sapo_tau_pos),
                          t.adv.new_full((), cfg.sapo_tau_neg))  # in adv's dtype
        gate = torch.sigmoid(tau * (ratio - 1))
        surrogate, cut = 4 / tau * gate * t.adv, 4 * gate * (1 - gate) < 0.5
    else:  # ppo, gspo: the clipped surrogate; where the min takes the clipped term, no gradient
        unclipped = ratio * t.adv
        clipped = ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high) * t.adv
        surrogate, cut = torch.minimum(unclipped, clipped), unclipped > clipped
        if cfg.dual_clip:  # A < 0: at least c A, a constant (dual-clip PPO)
            floor = cfg.dual_clip * t.adv
            low = (t.adv < 0) & (surrogate < floor)
            surrogate, cut = torch.where(low, floor, surrogate), cut | low
    per_token = -surrogate * w * (1 if t.seq_keep is None else t.seq_keep)
    if t.forking is not None:  # only the high-entropy tokens keep a policy gradient
        per_token = per_token * t.forking
    if t.ref is not None and cfg.kl_coef > 0:
        kl = kl_penalty(logp, t.ref, cfg.kl_estimator)
        per_token = per_token + cfg.kl_coef * (kl * torch.exp(logp - old) if cfg.kl_unbiased
                                               else kl)
    return (per_token * t.coef).sum(), (cut * t.written).sum()


def vespo_log_w(logp, old, is_weight, mask):
    """(N, T) -> (N, 1) log w, VESPO's sequence ratio to the sampling policy, detached: the sum
    over the sequence's tokens of log(p / p_old) and of the log of each token's mismatch weight
    (p_old / p_engine, truncated or masked: grpo.is_correction tis or token_mask), clamped as
    TRL 1.16's get_gamma_weights clamps them (each log ratio to [-20, 20], each log weight and
    the sum to [log 1e-8, 20]: a masked token's weight 0 sends w to 1e-8)."""
    floor = math.log(1e-8)
    log_ratio = ((logp - old).detach().clamp(-20, 20) * mask).sum(1, keepdim=True)
    log_is = (is_weight.log().clamp(floor, 20) * mask).sum(1, keepdim=True)
    return (log_ratio + log_is).clamp(floor, 20)


def vespo_phi(log_w, adv, cfg: GRPOConfig):
    """VESPO's weight of each token (arXiv 2602.10693; TRL 1.16's get_gamma_weights):
    phi(w) = exp(lambda + k log w - lambda w), a gamma density's shape scaled so that phi(1) = 1
    (largest at w = k / lambda), k and lambda those of the sign of the token's advantage. log_w:
    its sequence's (vespo_log_w), 0 on-policy without a mismatch weight. Detached."""
    pos = adv >= 0
    k = torch.where(pos, adv.new_full((), cfg.vespo_k_pos), adv.new_full((), cfg.vespo_k_neg))
    lam = torch.where(pos, adv.new_full((), cfg.vespo_lambda_pos),
                      adv.new_full((), cfg.vespo_lambda_neg))
    phi = torch.exp(lam + k * log_w - lam * log_w.exp())
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0).detach()


def dppo_inside(logp, old, adv, cfg: GRPOConfig):
    """DPPO's trust region (arXiv 2602.04879; verl's dppo_tv and dppo_kl): whether each token's
    probability p moved from the old policy's q by less than a divergence bound, in the
    direction its advantage pushes it (A > 0: up, bound clip_high; else down, clip_low). Binary
    TV: p - q; binary KL: KL(Bernoulli(q) || Bernoulli(p)). Detached inputs, bool out."""
    p, q = logp.exp(), old.exp()
    if cfg.policy_loss == "dppo_tv":
        up, down = p - q <= cfg.clip_high, p - q >= -cfg.clip_low
    else:  # the 1e-8 keeps log finite at p or q = 1, as verl's
        kl = q * (old - logp) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
        up, down = (kl <= cfg.clip_high) | (p <= q), (kl <= cfg.clip_low) | (p >= q)
    return torch.where(adv > 0, up, down)


def off_policy_stats(old_logp: list, engine_logp: list, adv: list, delta: float) -> dict:
    """With grpo.off_policy_delta: off_policy_masked_frac, the share of responses the mask
    dropped, judged on the logprobs before the first optimizer step (per-sample (n_i,) tensors
    of the model's tokens; adv: per-sample per-token advantages, a response's by the sign of
    their sum, as in the pass); nothing when it is off."""
    if delta <= 0:
        return {}
    dropped, adv = 0, [float(a.sum()) for a in adv]
    for o, e, a in zip(old_logp, engine_logp, adv):
        kl = float((e.double() - o.double()).mean()) if len(o) else 0.0
        dropped += a < 0 and kl > delta
    return {"off_policy_masked_frac": tracking.Mean(dropped, len(old_logp))}


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


# ----------------------------------------------------------------------------------------------
# scoring a rollout: pure functions of its rewards, returning new values


def shaped_rewards(rewards: list, lengths: list, limit: int, cfg: GRPOConfig) -> torch.Tensor:
    """(B*G,) fp64 rewards as the advantages see them: with grpo.overlong=penalty, DAPO's
    overlong penalty added for responses (an episode: all after its prompt) near `limit`."""
    shaped = torch.tensor(rewards, dtype=torch.float64)
    if cfg.overlong == "penalty":
        shaped += overlong_penalty(torch.tensor(lengths, dtype=torch.float64), limit,
                                   cfg.overlong_buffer, cfg.overlong_penalty_factor)
    return shaped


def dropped_samples(env_failed: list, reward_failed: list, drop: bool) -> list[bool]:
    """Per sample: out of the loss and its group's statistics, its environment or a reward call
    having failed, when `drop` (env.on_failure=drop)."""
    return [drop and (e or r) for e, r in zip(env_failed, reward_failed)]


def reward_columns(total: list, by_name: dict, lengths: list, limit: int,
                   cfg: GRPOConfig) -> torch.Tensor:
    """(B*G, K) fp64: what the advantages normalise. K = 1, the weighted sum of the reward
    functions (`total`), shaped (shaped_rewards); with grpo.reward_agg=gdpo each function's own
    values (`by_name`, in reward.funcs order)."""
    if cfg.reward_agg == "gdpo":
        return torch.tensor(list(by_name.values()), dtype=torch.float64).T.reshape(len(total), -1)
    return shaped_rewards(total, lengths, limit, cfg).unsqueeze(1)


def keep_groups(total: list, by_name: dict, lengths: list, dropped: list, limit: int,
                cfg: GRPOConfig) -> list[bool]:
    """Per group: whether it may go into the update. With dynamic sampling (DAPO) a group whose
    rewards (reward_columns) are all equal over its valid samples is left out: no signal."""
    constant = constant_groups(reward_columns(total, by_name, lengths, limit, cfg),
                               cfg.group_size, ~torch.tensor(dropped, dtype=torch.bool))
    return [not (c and cfg.dynamic_sampling) for c in constant.tolist()]


def take_groups(keep: list, kept: list, engine_idx: int, target: int) -> list[int]:
    """This engine group's groups for the update: the kept ones (keep[b]), at most `target` over
    all engine groups, taken in engine-group order (kept[e]: engine group e's count)."""
    quota = min(kept[engine_idx], max(0, target - sum(kept[:engine_idx])))
    return [b for b, k in enumerate(keep) if k][:quota]


def trained_samples(groups: list, group_size: int, dropped: list, truncated: list,
                    mask_overlong: bool) -> list[int]:
    """The samples of `groups` the update takes: not dropped (a failed environment or reward
    call), and with grpo.overlong=mask, not cut at the length limit."""
    return [i for b in groups for i in range(b * group_size, (b + 1) * group_size)
            if not dropped[i] and not (mask_overlong and truncated[i])]


@dataclass
class Scored:
    """A rollout scored (`score`): advantages, and the samples the update takes."""
    adv: list[float]  # per sample: its advantage within its group, after shaping
    constant: list[bool]  # per group: all (valid) rewards equal, no signal
    dropped: list[bool]  # per sample: out of the loss (a failed environment or reward call)
    groups: list[int]  # this engine group's groups that train
    trained: list[int]  # their samples that train (this engine group's; each rank a share)
    batch_std: float | None = None  # the batch's std that divided the advantages, if one did

    def metrics(self, first: bool) -> dict:
        """The counts of the step's metrics, each once per engine group (its first rank)."""
        one = int(first)
        m = {"groups_constant": tracking.Sum(one * sum(self.constant)),
             "groups_trained": tracking.Sum(one * len(self.groups)),
             "samples_trained": tracking.Sum(one * len(self.trained)),
             "samples_dropped": tracking.Sum(one * sum(self.dropped))}
        if self.batch_std is not None:  # every rank holds the same
            m["adv_batch_std"] = self.batch_std
        return m


def score(rollout, cfg: GRPOConfig, group, limit: int, drop: bool, weights: list) -> Scored:
    """The rollout's rewards, shaped (overlong penalty, against `limit` tokens) into advantages
    within each group of G (`advantages`; `weights`: reward.weights, for GDPO); a sample whose
    environment or reward call failed is, with `drop`, left out of its group's advantages and of
    the loss. Then the groups this engine group (`group`: rollout.EngineGroup) trains (the kept
    ones, up to grpo.prompts_per_step over all engine groups) and their samples (with
    grpo.overlong=mask, not those cut at the limit). Every rank of an engine group gets the same;
    every rank must call it (a batch std is an all-reduce)."""
    G = cfg.group_size
    dropped = dropped_samples(rollout.env_failed, rollout.reward_failed, drop)
    valid = ~torch.tensor(dropped, dtype=torch.bool)
    columns = reward_columns(rollout.rewards, rollout.by_name,
                             [len(s.response_ids) for s in rollout.samples], limit, cfg)
    adv, batch_std = advantages(columns, weights, valid, cfg, group.sum_over_engines)
    groups = take_groups(rollout.keep, rollout.kept, group.index, cfg.prompts_per_step)
    return Scored(
        adv=adv.tolist(), constant=constant_groups(columns, G, valid).tolist(), dropped=dropped,
        groups=groups, batch_std=batch_std,
        trained=trained_samples(groups, G, dropped, [s.truncated for s in rollout.samples],
                                cfg.overlong == "mask"))


# ----------------------------------------------------------------------------------------------
# the update: forward/backward over the rollout (logprobs.py runs the model). Every function here
# runs FSDP collectives, so every rank calls it, with its own share of the samples (possibly none).


@dataclass
class TeacherTopK:
    """A teacher's distribution at each response token, as its k likeliest tokens: per sample,
    (n_i, k) token ids and the teacher's logprobs of them (distill.py, distill.loss:
    forward_top_k). The loss adds coef times the forward KL from it to the policy at each token
    the model wrote, weighed as the token's other terms are (logprobs.top_k_forward_kl)."""
    ids: list
    logp: list
    coef: float

    def of(self, idx: list) -> "TeacherTopK":
        """Those of the samples idx."""
        return TeacherTopK([self.ids[i] for i in idx], [self.logp[i] for i in idx], self.coef)


@dataclass
class Batch:
    """What the update trains on: this rank's samples of a scored rollout and what each feature
    added to them (batcher.py builds it, one transform per feature)."""
    samples: list  # records.Sample (or any object with its fields)
    adv: list  # per sample, its (n_i,) advantage at each response token
    seed: int  # the mini-batches' shuffle; every rank of a sequence-parallel group the same
    step: int = 0  # the step that trains it (the weights version step - 1 sampled it)
    teacher: TeacherTopK | None = None  # a teacher's top k, for the forward KL term
    split: object = None  # seq_parallel.Split: the group whose ranks train these same samples,
    #   each 1/sp of every packed row's tokens; None: no sequence parallelism
    metrics: dict = field(default_factory=dict)  # the transforms' own (a teacher's pass)
    # grpo.top_entropy_quantile: per sample, 1 at the response tokens that keep their policy
    #   gradient (forking_tokens); None: every token
    forking: list | None = None

    @classmethod
    def per_sample(cls, samples: list, adv: torch.Tensor, seed: int, **fields) -> "Batch":
        """A batch whose samples each have one advantage, adv (n,), laid out at every one of
        their response tokens in fp32; `fields`: the others (step, teacher, split)."""
        return cls(samples, [a.float().expand(len(s.response_ids)).clone()
                             for s, a in zip(samples, adv)], seed, **fields)

    def of(self, idx: list) -> "Batch":
        """The samples idx, with what they carry."""
        return dataclasses.replace(
            self, samples=[self.samples[i] for i in idx], adv=[self.adv[i] for i in idx],
            teacher=self.teacher.of(idx) if self.teacher is not None else None,
            forking=[self.forking[i] for i in idx] if self.forking is not None else None)

    @property
    def sp(self) -> int:
        """The ranks that hold these same samples, each summing its own share of the tokens."""
        return self.split.size if self.split is not None else 1


@dataclass(frozen=True)
class Settings:
    """What the update takes of the run besides its samples: fixed for a run."""
    grpo: GRPOConfig
    pad_id: int = 0  # the padding token (padded micro-batches)
    device: object = "cpu"  # where the actor computes
    temperature: float = 1.0  # the engine's sampling temperature (rollout.temperature)
    max_len: int = 1  # the engine's max_new_tokens: Dr. GRPO's constant normaliser
    grad_clip: float = 0.0  # the gradient norm's bound (optim.grad_clip); 0: none
    top_p: float = 1.0  # the engine's nucleus (rollout.top_p): actor and reference logprobs over it


def token_inputs(batch: Batch, mb, old_logp, ref_logp, cfg: GRPOConfig, counts: tuple,
                 max_len: int) -> Tokens:
    """The loss's inputs for each of a micro-batch's K response tokens, on the host, in mb's
    order: from the batch (its samples' per-token advantages, a teacher's top k, the forking
    tokens) and, when given, the old and reference logprobs (per-sample lists); with the old
    logprobs, the mismatch weights from them; gspo and luspo on-policy, their sequence ratio 1.
    counts: the global mini-batch's (tokens, sequences, tokens that keep a gradient), which the
    aggregation and the entropy bonus divide by."""
    def cat(lists):
        return torch.cat([torch.as_tensor(x, dtype=torch.float32) for x in lists])

    engine, old = cat([s.logp for s in batch.samples]), None
    weight = ratio = None
    if old_logp is not None:
        old = cat(old_logp)
        weight = mb.flat(mismatch_weights(mb.padded(old), mb.padded(engine), mb.mask,
                                          cfg.is_correction, cfg.is_cap, cfg.is_cap_low))
    elif cfg.policy_loss in SEQ_RATIO:  # on-policy every sequence's ratio is exactly 1
        ratio = torch.ones_like(engine)
    teacher, coef = batch.teacher, mb.flat(loss_weights(mb.mask, cfg, *counts[:2], max_len))
    written = mb.flat(mb.mask)
    forking = torch.cat(batch.forking) if batch.forking is not None else None
    bonus = None
    if cfg.entropy_coef > 0:  # the mean over the tokens that keep a gradient, kept: counts[2]
        bonus = written * (forking if forking is not None else 1) * (cfg.entropy_coef
                                                                      / max(counts[2], 1))
    return Tokens(adv=torch.cat(batch.adv), coef=coef, written=written, engine=engine,
                  old=old, is_weight=weight, seq_ratio=ratio, forking=forking, ent_coef=bonus,
                  ref=cat(ref_logp) if ref_logp is not None else None,
                  top_ids=torch.cat(teacher.ids) if teacher is not None else None,
                  top_logp=torch.cat(teacher.logp) if teacher is not None else None,
                  top_coef=coef * teacher.coef if teacher is not None else None)


def sequence_ratio(logp, old, mask):
    """(N, T) -> (N, 1) each sequence's ratio to the old policy as GSPO defines it: the
    geometric mean of its tokens' ratios, exp(mean of logp - old over its mask), detached."""
    log_ratio = ((logp - old) * mask).detach()
    return (log_ratio.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)).exp()


def off_policy_keep(logp, engine_logp, mask, adv, delta: float):
    """(N, T) -> (N, 1) DeepSeek-V3.2's off-policy sequence mask: 0 for a sequence whose
    advantage adv (N, 1) is negative and whose mean of engine_logp - logp over its mask (a KL
    estimate between the sampling and the current policy) exceeds delta, else 1. Detached."""
    kl = (((engine_logp - logp) * mask).sum(1, keepdim=True)
          / mask.sum(1, keepdim=True).clamp(min=1)).detach()
    return ((adv >= 0) | (kl <= delta)).to(kl.dtype)


@dataclass(frozen=True)
class MicroLoss:
    """One micro-batch's loss as logprobs.run takes it: `loss(logp, k)`, grpo_loss on the tokens
    k (a slice of K); `whole`, whether it needs every token's logp of this forward before any
    gradient, and `with_whole(logp)`, the loss completed by them (a new MicroLoss): the mismatch
    weights of on-policy seq modes, gspo's and luspo's sequence ratios off-policy, vespo's
    sequence ratios, the off-policy mask; `dense(logp_all, p, k)`, the forward KL to a
    teacher's top k where there is one; `entropy_weights(k)`, the entropy bonus's. t: this
    rank's tokens' inputs; full: every token's (sequence parallel; else t itself)."""
    t: Tokens
    full: Tokens
    mb: object
    cfg: GRPOConfig

    @property
    def whole(self) -> bool:
        cfg, off = self.cfg, self.t.old is not None
        return ((not off and cfg.is_correction in SEQ_IS_MODES)
                or (off and cfg.policy_loss in SEQ_RATIO) or cfg.off_policy_delta > 0
                or (cfg.policy_loss == "vespo" and (off or cfg.is_correction != "none")))

    def with_whole(self, logp) -> "MicroLoss":
        """logp: (K,) every token's logprob under this forward, detached."""
        cfg, mb, full, found = self.cfg, self.mb, self.full, {}

        def mine(x):  # (n, 1) per sequence -> (K_r,) this rank's tokens
            return mb.mine(mb.flat(x.expand_as(mb.mask)))

        if self.t.old is None and cfg.is_correction in SEQ_IS_MODES:
            found["is_weight"] = mb.mine(mb.flat(mismatch_weights(
                mb.padded(logp), mb.padded(full.engine), mb.mask, cfg.is_correction, cfg.is_cap,
                cfg.is_cap_low)))
        if self.t.old is not None and cfg.policy_loss in SEQ_RATIO:
            found["seq_ratio"] = mine(sequence_ratio(mb.padded(logp), mb.padded(full.old),
                                                     mb.mask))
        if cfg.policy_loss == "vespo":  # on-policy the old logprobs are these, the weights new
            old = full.old if full.old is not None else logp
            weight = full.is_weight if full.is_weight is not None else mb.flat(mismatch_weights(
                mb.padded(logp), mb.padded(full.engine), mb.mask, cfg.is_correction, cfg.is_cap,
                cfg.is_cap_low))
            found["seq_log_w"] = mine(vespo_log_w(mb.padded(logp), mb.padded(old),
                                                  mb.padded(weight), mb.mask))
        if cfg.off_policy_delta > 0:  # a row's tokens carry one advantage: their sum has its sign
            found["seq_keep"] = mine(off_policy_keep(
                mb.padded(logp), mb.padded(full.engine), mb.mask,
                mb.padded(full.adv).sum(1, keepdim=True), cfg.off_policy_delta))
        return dataclasses.replace(self, t=dataclasses.replace(self.t, **found))

    def __call__(self, logp, k: slice):
        return grpo_loss(logp, self.t[k], self.cfg)

    def entropy_weights(self, k: slice):
        """The tokens k's weights in the entropy bonus (the loss gains -sum w H), or None."""
        return None if self.t.ent_coef is None else self.t.ent_coef[k]

    def dense(self, logp_all, p, k: slice):
        """The forward KL to the teacher's top k at the tokens k: (loss, dL/d(logits / T)), or
        (0, None) without a teacher."""
        t = self.t
        if t.top_ids is None:
            return 0.0, None
        return logprobs.top_k_forward_kl(logp_all, p, t.top_ids[k], t.top_logp[k], t.top_coef[k])


def accumulate_gradients(actor, batch: Batch, old_logp, ref_logp, cfg: Settings,
                         router: moe.RouterStats | None = None) -> tuple[list, dict]:
    """Forward/backward this rank's share of one global mini-batch (`batch`); gradients
    accumulate in the actor. A mixture of experts routes by the samples' routing where they
    carry it (moe.routing, forward and backward: a recomputed forward routes alike), its routers'
    work added to `router`. old_logp None means on-policy: old_logp is this forward's own logp,
    detached (ratio 1). Returns this forward's logp per sample ((n_i,) CPU tensors, read back
    once) and sums for the metrics: clipped tokens, entropy and the loss, 0-dim tensors left on
    the device."""
    g, samples, device = cfg.grpo, batch.samples, cfg.device
    tokens = float(sum(s.model_tokens for s in samples))
    kept = (tokens if batch.forking is None  # the entropy bonus's tokens
            else float(sum(f.sum() for f in batch.forking)))
    counts = torch.tensor([tokens, float(len(samples)), kept])
    dist.all_reduce(counts)  # the loss is normalised over the global mini-batch
    counts = tuple(x / batch.sp for x in counts.tolist())  # a group's ranks: the same samples
    stats = {k: torch.zeros((), device=device) for k in ("clipped", "entropy", "loss")}
    if counts[0] == 0:  # nothing to learn from on any rank (all ranks see the same counts)
        return [torch.zeros(0)] * len(samples), stats
    actor.train()
    plan, found = logprobs.micro_batch_plan(samples, g.micro_batch_tokens, g.pack,
                                            actor.config, batch.split), []
    for k, idx in enumerate(plan):
        part = batch.of(idx) if idx else Batch([logprobs.DUMMY], [torch.zeros(1)], batch.seed)
        old, ref = ([lp[i] for i in idx] or [[0.0]] if lp is not None else None
                    for lp in (old_logp, ref_logp))
        mb = logprobs.micro_batch(part.samples, cfg.pad_id, g.pack, actor.config, batch.split)
        t = token_inputs(part, mb, old, ref, g, counts, cfg.max_len)
        mb, full = logprobs.to_device(mb, device), logprobs.to_device(t, device)
        loss = MicroLoss(mb.mine(full), full, mb, g)  # this rank's tokens of the row (sp)
        with moe.routing(actor, mb.routing, router if idx else None, mb.real):
            out = logprobs.run(actor, mb, cfg.temperature, g.logprob_chunk, loss,
                               top_p=cfg.top_p)
            logprobs.hold_gathered(actor, hold=k < len(plan) - 1)  # FSDP2 units, till the last
            # FSDP averages gradients over ranks; the loss is a global mean: undo the average
            (out["loss"] * (dist.get_world_size() if idx else 0.0)).backward()
        if idx:
            for name in stats:
                stats[name] = stats[name] + out[name].detach()  # in the wider dtype
            found.append((idx, out["logp"], mb.lengths))
    return logprobs.per_sample(found, len(samples)), stats


def forking_tokens(samples: list, entropy: list, rho: float, split) -> tuple[list, float]:
    """grpo.top_entropy_quantile's selection (Wang et al. 2025, arXiv 2506.01939; TRL 1.16's
    get_high_entropy_mask): the tokens the model wrote whose entropy is at least the (1 - rho)
    quantile of every rank's written tokens' entropies (linear interpolation, as torch.quantile).
    entropy: each sample's (n_i,) per response token. Returns each sample's (n_i,) fp32 1/0 mask
    and the threshold. A sequence-parallel group's ranks hold the same samples: its first
    rank's count. One all-gather of sizes and one of values (gloo: host tensors)."""
    mine = torch.cat([torch.zeros(0), *written(samples, entropy)]).double()
    if split is not None and split.rank > 0:
        mine = mine[:0]
    values = gather_all(mine)
    threshold = quantile(values, 1 - rho) if values.numel() else math.inf
    return [(torch.as_tensor(e).double() >= threshold).float()
            * (1.0 if s.mask is None else torch.tensor(s.mask, dtype=torch.float32))
            for s, e in zip(samples, entropy)], threshold


def gather_all(x: torch.Tensor) -> torch.Tensor:
    """Every rank's 1-d host tensor x, of any length, concatenated in rank order (x itself
    without a process group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return x
    sizes = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([x.numel()]))
    longest = max(int(n) for n in sizes)
    parts = [x.new_zeros(longest) for _ in sizes]
    dist.all_gather(parts, torch.cat([x, x.new_zeros(longest - x.numel())]))
    return torch.cat([p[:int(n)] for p, n in zip(parts, sizes)])


def quantile(x: torch.Tensor, q: float) -> float:
    """torch.quantile(x, q) (linear interpolation between the two nearest ranks) for a 1-d x of
    any length (torch.quantile refuses more than 2^24 values)."""
    v = x.sort().values
    pos = q * (v.numel() - 1)
    lo = min(int(math.floor(pos)), v.numel() - 1)
    hi = min(lo + 1, v.numel() - 1)
    return float(v[lo] + (pos - lo) * (v[hi] - v[lo]))


def written(samples: list, per_token: list) -> list:
    """Each sample's per-response-token values (a tensor or a list) at the tokens the model
    wrote (records.Sample.mask), as tensors."""
    return [torch.as_tensor(v) if s.mask is None
            else torch.as_tensor(v)[torch.tensor(s.mask, dtype=torch.bool)]
            for s, v in zip(samples, per_token)]


def split_mini_batches(n: int, k: int, generator) -> list[list[int]]:
    """A fresh random split of n samples into k mini-batches of near-equal size."""
    order = torch.randperm(n, generator=generator).tolist()
    return [order[j::k] for j in range(k)]


NONFINITE = ("loss", "grad_norm")  # what makes update skip an optimizer step (nonfinite)


def nonfinite(loss: torch.Tensor, norm: torch.Tensor) -> str | None:
    """Which of an optimizer step's loss (this rank's part, 0-dim) and gradient norm (the global
    one, 0-dim, on the same device) is not finite on some rank: "loss", "grad_norm" or None, the
    same answer on every rank. One all-reduce and one read: the step must be decided before the
    optimizer takes it (a NaN in one rank's loss reaches every rank's shards through the
    gradients' reduce-scatter)."""
    flags = torch.stack([loss, norm]).isfinite().logical_not().float()
    if dist.is_initialized():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    bad = flags.tolist()
    return next((what for what, b in zip(NONFINITE, bad) if b), None)


def update(actor, ref, opt, batch: Batch, cfg: Settings) -> dict:
    """grpo.ppo_epochs passes over this rank's samples (`batch`), each split into
    grpo.mini_batches optimizer steps, gradients clipped to cfg.grad_clip (0: off). Returns the
    update's metrics (tracking.reduce): entropy, clip_frac, the engine/trainer mismatch, kl with
    a reference, the mean grad norm, logprobs_time_s (the old-policy and reference passes),
    trained_tokens and trained_rows (the tokens the passes took, and the output layer's rows
    among them). An optimizer step whose loss or gradient norm is not finite is not taken
    (`nonfinite`): `skipped` lists each step's verdict in order (None: taken), and
    nonfinite_loss / nonfinite_grad_norm count them."""
    opt.zero_grad(set_to_none=True)  # what an update cut short (Ctrl-C) may have left
    g, samples, t = cfg.grpo, batch.samples, time.perf_counter()
    # old_logp is the sampling policy as the trainer computes it. On-policy it comes from the
    # update's own forward; otherwise it is recomputed once, before the first optimizer step
    on_policy, old_logp = g.ppo_epochs == 1 and g.mini_batches == 1, None
    forks = g.top_entropy_quantile < 1  # the tokens' entropies, from the same pass
    if forks or not on_policy:
        found = logprobs.sample_pass(actor, samples, cfg, entropy=forks, replay=True,
                                     split=batch.split)
        old_logp = None if on_policy else found["logp"]
    if forks:
        keep, threshold = forking_tokens(samples, found["entropy"], g.top_entropy_quantile,
                                         batch.split)
        batch = dataclasses.replace(batch, forking=keep)
    ref_logp = None
    if ref is not None:  # the frozen reference: out of host memory, or the actor's base (LoRA)
        with fsdp_utils.reference(ref):
            ref_logp = logprobs.sample_logprobs(ref, samples, cfg, split=batch.split)
    logprobs_time = time.perf_counter() - t
    loss_tokens, norms, losses, skipped = 0, [], [], []
    clipped, entropy = torch.zeros((), device=cfg.device), torch.zeros((), device=cfg.device)
    shuffle = torch.Generator().manual_seed(batch.seed)
    router = moe.RouterStats() if moe.routers(actor) else None  # a mixture of experts'
    for epoch in range(g.ppo_epochs):
        for part in split_mini_batches(len(samples), g.mini_batches, shuffle):
            old, ref_lp = ([lp[i] for i in part] if lp is not None else None
                           for lp in (old_logp, ref_logp))
            logp, stats = accumulate_gradients(actor, batch.of(part), old, ref_lp, cfg,
                                               router if epoch == 0 else None)
            if old_logp is None:  # on-policy: the one forward (part: every sample, shuffled)
                old_logp = [lp for _, lp in sorted(zip(part, logp), key=lambda x: x[0])]
            clipped += stats["clipped"]
            loss_tokens += sum(samples[i].model_tokens for i in part)
            if epoch == 0:  # entropy of the policy as it meets this rollout
                entropy += stats["entropy"]
            norms.append(fsdp_utils.clip_grad_norm(actor, cfg.grad_clip))
            losses.append(stats["loss"])
            skipped.append(nonfinite(losses[-1], norms[-1]))
            if skipped[-1] is None:  # else no change to the parameters or the optimizer's state
                opt.step()
            opt.zero_grad(set_to_none=True)
    read = torch.stack([clipped, entropy, *norms, *losses]).tolist()  # one read
    (clipped, entropy), norms, losses = read[:2], read[2:2 + len(norms)], read[2 + len(norms):]
    sums = {"clipped": clipped, "entropy": entropy, "loss_tokens": loss_tokens}
    out = {**update_metrics(batch, old_logp, ref_logp, g, sums, router),
           **optimizer_metrics(norms, losses, skipped), "logprobs_time_s": logprobs_time}
    if forks:  # the share of the model's tokens that kept their gradient, and the bar
        out.update(forking_frac=tracking.Mean(sum(float(k.sum()) for k in keep) / batch.sp,
                                              sum(s.model_tokens for s in samples) / batch.sp),
                   entropy_threshold=tracking.Max(threshold))
    return out


def optimizer_metrics(norms: list, losses: list, skipped: list) -> dict:
    """The optimizer steps' metrics, over the steps taken: the mean grad norm, and the mean loss
    each step minimised (a global mean of which each rank holds the part of its tokens, under
    sequence parallelism too: summed over ranks); the steps not taken, by reason (nonfinite),
    and `skipped`, each step's verdict in order."""
    taken = [i for i, why in enumerate(skipped) if why is None]
    n = max(len(taken), 1)
    return {"grad_norm": sum(norms[i] for i in taken) / n,
            "loss": tracking.Sum(sum(losses[i] for i in taken) / n), "skipped": skipped,
            **{f"nonfinite_{what}": tracking.Max(skipped.count(what)) for what in NONFINITE}}


def update_metrics(batch: Batch, old_logp: list, ref_logp, cfg: GRPOConfig, sums: dict,
                   router) -> dict:
    """`update`'s metrics from its sums (clipped tokens, entropy, the tokens in the loss): the
    policy's entropy, clip_frac, the engine/trainer mismatch (old_logp: the update's own view of
    the sampling policy), kl to the reference, trained_tokens and trained_rows, and a mixture of
    experts' routers (moe.RouterStats). Under sequence parallelism (batch.sp ranks hold the same
    samples) each rank's sums are its own share of the tokens."""
    samples, sp = batch.samples, batch.sp
    tokens, loss_tokens = sum(s.model_tokens for s in samples) / sp, sums["loss_tokens"] / sp
    # the tokens the passes' forwards and backwards saw, and the rows of the output layer among
    # them (the update's FLOPs: fsdp_utils.flops_per_token)
    seen = cfg.ppo_epochs * sum(len(s.prompt_ids) + len(s.response_ids) for s in samples) / sp
    rows = cfg.ppo_epochs * sum(len(s.response_ids) for s in samples) / sp
    old_logp = written(samples, old_logp)  # the metrics below are over the model's tokens
    engine = written(samples, [s.logp for s in samples])
    out = {"entropy": tracking.Mean(sums["entropy"], tokens),
           "clip_frac": tracking.Mean(sums["clipped"], loss_tokens),
           **mismatch_stats(old_logp, engine, cfg.is_cap),
           **off_policy_stats(old_logp, engine, batch.adv, cfg.off_policy_delta),
           "trained_tokens": tracking.Sum(seen), "trained_rows": tracking.Sum(rows)}
    if ref_logp is not None:
        out["kl"] = tracking.Mean(sum(kl_penalty(o, r, cfg.kl_estimator).sum().item()
                                      for o, r in zip(old_logp, written(samples, ref_logp)))
                                  / sp, tokens)
    done = router.totals() if router is not None else {}
    if done:  # the worst rank's worst layer; the others over every position of every rank
        out.update(moe_load_max_mean=tracking.Max(max(done["ratio"])),
                   router_entropy=tracking.Mean(done["entropy"], done["positions"]),
                   routing_differs=tracking.Mean(done["differs"], done["positions"]))
    return out
