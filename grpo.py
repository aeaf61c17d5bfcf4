"""The algorithm as formulas: GRPO's advantages, its loss and variants, and a rollout's scoring.

Nothing here knows about engines, files or sharding: a rollout arrives as samples (prompt_ids,
response_ids, the engine's logp of each response token) and rewards, and leaves as advantages
(`score`); the loss is a function of one forward's logprobs and each token's inputs (`Tokens`).
trainer.py applies these formulas (micro-batches, the fused pass over the vocabulary, the
optimizer loop). To try a new loss, edit `grpo_loss`: it is the per-token objective that
training minimises (the fused pass in logprobs.py differentiates it on every chunk of output
rows); each policy loss it can take is a named function citing its paper (`ppo_clip`, `cispo`,
`sapo`, `dppo`, `vespo`). For a new option, add a field to `GRPOConfig` with its domain in the
field's type (config.py). The advantages are `advantages` (by default `group_advantages`),
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
std instead of the group's (Lite PPO), the batch's mean too (REINFORCE++), each reward function
normalised apart (GDPO), asymmetric clipping (DAPO), other surrogates (GSPO, CISPO, SAPO),
several epochs and mini-batches per rollout (PPO), a KL term to a frozen reference (k1/k2/k3,
optionally unbiased), token or sequence masking or truncation instead of TIS, DeepSeek-V3.2's
off-policy sequence mask, dynamic sampling (DAPO), and masking or a soft penalty for responses
cut at the length limit (DAPO).

A multi-turn sample (episodes.py) holds the environment's replies inside its response, with
`mask` 0 there: those tokens get no loss, no importance weight and no KL, count in no token
mean, and stay out of the mismatch and KL metrics. "Response token" above means a token the
model wrote.
"""

import logging
import math
from dataclasses import dataclass
from typing import Annotated

import torch

import tracking
from config import FLAG, BadInput, OneOf, Range, need

log = logging.getLogger("grpo")


LOSS_AGGS = ("token_mean", "seq_mean", "constant", "seq_sum")
POLICY_LOSSES = ("ppo", "gspo", "luspo", "cispo", "sapo", "dppo_tv", "dppo_kl", "vespo")
DPPO = ("dppo_tv", "dppo_kl")
SEQ_RATIO = ("gspo", "luspo")  # surrogates of each sequence's ratio
IS_MODES = ("none", "tis", "token_mask", "seq_truncate", "seq_mask", "seq_geo_mask")
SEQ_IS_MODES = ("seq_truncate", "seq_mask", "seq_geo_mask")  # need whole sequences


@dataclass
class GRPOConfig:
    # between steps (train_grpo.configure): all but the rollout's shape (group_size,
    #   prompts_per_step); kl_coef > 0 only where the run built a reference
    LIVE = ("adv_eps", "scale_adv_by_std", "adv_mean", "adv_std", "reward_agg", "loss_agg",
            "clip_low", "clip_high", "policy_loss", "dppo_ratio_cap", "dppo_anchor", "dual_clip",
            "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "sapo_tau_pos",
            "sapo_tau_neg", "entropy_coef", "top_entropy_quantile", "ppo_epochs", "mini_batches",
            "kl_coef", "kl_estimator", "kl_unbiased", "is_correction", "is_cap", "is_cap_low",
            "off_policy_delta", "dynamic_sampling", "max_gen_rounds", "overlong",
            "overlong_buffer", "overlong_penalty_factor", "micro_batch_tokens", "pack",
            "logprob_chunk")
    group_size: Annotated[int, Range(2)] = 8  # G: responses sampled per prompt
    # over all ranks; each engine group takes an equal slice
    prompts_per_step: Annotated[int, Range(1)] = 32
    adv_eps: Annotated[float, Range(0)] = 1e-6  # added to the group std
    scale_adv_by_std: Annotated[bool, FLAG] = True  # false: adv = r - mean (Dr. GRPO)
    # the std that divides r - mean: its group's (GRPO), or the batch's, every sample of the
    #   step over all engine groups (Lite PPO, arXiv 2508.08221; TRL scale_rewards=batch)
    adv_std: Annotated[str, OneOf("group", "batch")] = "group"
    # the mean that r is taken from: its group's (GRPO), or the batch's, every valid sample of
    #   the step over all engine groups (REINFORCE++, arXiv 2501.03262; verl's
    #   reinforce_plus_plus): a group whose samples are all wrong then still pushes its answers
    #   down (and one all right pushes them up), where its group's mean gives it 0. With
    #   adv_std=batch, or scale_adv_by_std=false
    adv_mean: Annotated[str, OneOf("group", "batch")] = "group"
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
    #   dppo_tv / dppo_kl, DPPO (arXiv 2602.04879; its authors' sail-sg/Stable-RL): sg(min(p /
    #   p_anchor, dppo_ratio_cap)) A log p, 0 where the token's probability left a trust region
    #   measured by a divergence (binary TV or binary KL to the anchor's) instead of the ratio;
    #   bounds clip_high (A > 0) and clip_low (else), divergence-sized; luspo, gspo's surrogate
    #   with each sequence's term times its length (LUSPO, arXiv 2602.05261; TRL's luspo:
    #   loss_agg seq_sum); vespo, sg(phi(w)) A log p with w the sequence's ratio to the
    #   sampling policy (a product, the engine's mismatch folded in) and phi a gamma-shaped
    #   weight, phi(1) = 1, instead of a clip (VESPO, arXiv 2602.10693; TRL 1.16's vespo)
    policy_loss: Annotated[str, OneOf(*POLICY_LOSSES)] = "ppo"
    # dppo_*: the detached ratio's cap (verl's clip_ratio_c, 3 by default)
    dppo_ratio_cap: Annotated[float, Range(1)] = 3.0
    # dppo_*: the policy the trust region and the ratio are measured from: rollout, the one
    #   that sampled (the engine's logprobs; the paper's form, its Takeaway 2), whose ratio is
    #   DPPO's own correction (no grpo.is_correction weight on top: the paper finds stacking
    #   one harmful); old, the policy before the update as the trainer computes it, with
    #   is_correction's weight (the recomputed anchor the paper reports unstable; verl's form)
    dppo_anchor: Annotated[str, OneOf("rollout", "old")] = "rollout"
    # dual-clip PPO (Ye et al. 2020, arXiv 1912.09729, eq. 4): with a negative advantage the
    #   clipped surrogate is at least c x A, so a token whose ratio grew far past the clip
    #   cannot move the loss without bound; 0: off, else c > 1 + clip_high (the paper's 3;
    #   at or below, the floor would cut tokens inside the clip range). ppo, gspo, luspo
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
    # each group's prompt once in the update's packed rows, its responses after it, each
    #   attending to its keys and values (the prompt's forward and backward once a group, its
    #   gradient their sum): on; auto, where it saves work (logprobs.sharing: the repeated
    #   prompts a tenth of the tokens or more); off. Packed rows of a model without
    #   linear-attention layers, without sequence parallelism or routing replay, on an
    #   attention that takes it (fsdp_utils.shared_sdpa); else auto is off, on refused
    shared_prefix: Annotated[str, OneOf("auto", "on", "off")] = "auto"

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
        if self.shared_prefix == "on" and (why := sharing_blocker(cfg)):
            refuse_sharing(why)
        if self.policy_loss in DPPO and self.dppo_anchor == "rollout" and (
                self.is_correction != "none"):
            log.warning("grpo.policy_loss=%s anchored to the rollout: its ratio to the engine's "
                        "logprobs is its correction, and grpo.is_correction=%s is not applied "
                        "on top (grpo.is_correction=none says so and silences this)",
                        self.policy_loss, self.is_correction)


def sharing_blocker(cfg) -> str | None:
    """Why the run's update cannot hold each group's prompt once (grpo.shared_prefix), from its
    config tree: one phrase, or None. The model's own reasons: fsdp_utils.unshared, and before
    it loads hybrid.check."""
    if not cfg.grpo.pack:
        return "needs packed rows (grpo.pack=true)"
    if cfg.model.sp_size > 1:
        return "does not split a row over ranks (model.sp_size > 1)"
    if cfg.model.routing_replay:
        return "does not lay out the engine's routing (model.routing_replay)"
    return None


def refuse_sharing(why: str) -> None:
    """grpo.shared_prefix=on where the update cannot hold each prompt once (`why`: one phrase,
    sharing_blocker's or fsdp_utils.unshared's), in one line: BadInput."""
    raise BadInput(f"config: grpo.shared_prefix=on {why}. Fix: grpo.shared_prefix=auto (off "
                   "where it cannot run), or off")


def validate(cfg: GRPOConfig) -> None:
    """The `grpo` fields across each other, where a surrogate's paper rules a combination out
    (and the advantages' own rules, `validate_advantages`); a one-line ValueError naming the
    fields and the fix."""
    validate_advantages(cfg)
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
    if 0 < cfg.dual_clip <= 1 + cfg.clip_high:
        raise ValueError(f"grpo.dual_clip={cfg.dual_clip} with grpo.clip_high={cfg.clip_high}: "
                         "the floor c x A of a negative advantage's surrogate must lie past the "
                         "clip range, c > 1 + clip_high; within it, it cuts the gradient of "
                         "tokens whose ratio PPO keeps. Fix: grpo.dual_clip=3 (the paper's), or "
                         "0 (off)")
    if cfg.dual_clip and cfg.policy_loss not in ("ppo", *SEQ_RATIO):
        raise ValueError(f"grpo.dual_clip with grpo.policy_loss={cfg.policy_loss}: dual-clip "
                         "bounds PPO's clipped surrogate, which that one does not use. Fix: "
                         "grpo.dual_clip=0, or policy_loss ppo, gspo or luspo")
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


def validate_advantages(cfg: GRPOConfig) -> None:
    """The fields that shape the advantages (adv_mean, adv_std, scale_adv_by_std, reward_agg)
    across each other and the rest: validate's part, the same one-line ValueErrors."""
    if cfg.adv_std == "batch" and not cfg.scale_adv_by_std:
        raise ValueError("grpo.adv_std=batch with grpo.scale_adv_by_std=false: no std divides "
                         "the advantage. Fix: drop one of them")
    if cfg.adv_mean == "batch" and cfg.adv_std == "group" and cfg.scale_adv_by_std:
        raise ValueError("grpo.adv_mean=batch with grpo.adv_std=group: a group whose rewards are "
                         "all equal has std 0, and its advantages would be divided by "
                         "grpo.adv_eps alone. Fix: grpo.adv_std=batch (REINFORCE++), or "
                         "grpo.scale_adv_by_std=false")
    if cfg.adv_mean == "batch" and cfg.dynamic_sampling:
        raise ValueError("grpo.adv_mean=batch with grpo.dynamic_sampling=true: dynamic sampling "
                         "drops the groups whose rewards are all equal, the ones the batch's "
                         "mean gives a signal to. Fix: one of them")
    if cfg.reward_agg == "gdpo" and (cfg.adv_mean, cfg.adv_std, cfg.scale_adv_by_std) != (
            "group", "group", True):
        raise ValueError("grpo.reward_agg=gdpo divides each function's advantage by its group's "
                         "std, then the sum by the batch's: it ignores grpo.adv_mean, grpo.adv_std "
                         "and grpo.scale_adv_by_std. Fix: leave them out")
    if cfg.reward_agg == "gdpo" and cfg.overlong == "penalty":
        raise ValueError("grpo.reward_agg=gdpo with grpo.overlong=penalty: the penalty adds to "
                         "the weighted sum, which GDPO does not normalise. Fix: grpo.overlong="
                         "mask, or reward_agg=sum")


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
    the batch (GDPO). Constant groups (every function constant) and invalid samples get 0; with
    grpo.adv_mean=batch, r - the batch's mean (over its std: REINFORCE++), 0 only for invalid
    samples and a batch whose rewards are all equal."""
    G, eps, std = cfg.group_size, cfg.adv_eps, None
    if cfg.reward_agg == "gdpo":
        x = sum(w * group_advantages(c.contiguous(), G, eps, True, valid)
                for w, c in zip(weights, columns.T))
        mean, std = batch_moments(x, valid, over_engines)
        adv = (x - mean) / (std + eps)
    elif cfg.adv_mean == "batch":
        r = columns[:, 0]
        mean, sd = batch_moments(r, valid, over_engines)
        # every valid reward equal: r - mean then holds only the mean's rounding, a few units of
        #   2^-52 of |mean| (fp64 sums); 1e-12 x (1 + |mean|) is thousands of them
        signal = valid & (sd > 1e-12 * (1 + abs(mean)))
        adv = (r - mean) / (sd + eps) if cfg.scale_adv_by_std else r - mean
        return adv.masked_fill(~signal, 0.0), sd if cfg.scale_adv_by_std else None
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
    logprobs.MicroBatch's order (trainer.token_inputs makes them); `tokens[k]` is the slice k."""
    adv: torch.Tensor  # its advantage (its sample's, or per token: a teacher's signal)
    coef: torch.Tensor  # its weight in the batch's loss (loss_weights: the aggregation)
    written: torch.Tensor  # 1 where the model wrote it, 0 where an environment did
    engine: torch.Tensor  # the engine's logprob of it: the policy that sampled it
    old: torch.Tensor | None = None  # the old policy's logprob; None: on-policy (this forward's)
    is_weight: torch.Tensor | None = None  # the mismatch weight; None: grpo_loss makes it
    ref: torch.Tensor | None = None  # the reference's logprob, for the KL term; None: no KL
    # 0 where the token keeps no policy gradient (grpo.top_entropy_quantile's forking tokens,
    #   off_policy_delta's masked responses), else 1; None: every token keeps it
    keep: torch.Tensor | None = None
    seq_ratio: torch.Tensor | None = None  # gspo, luspo: its sequence's ratio to the old policy
    seq_log_w: torch.Tensor | None = None  # vespo: log of its sequence's ratio (vespo_log_w)

    def __getitem__(self, k: slice) -> "Tokens":
        return Tokens(**{name: None if v is None else v[k] for name, v in vars(self).items()})


def grpo_loss(logp: torch.Tensor, t: Tokens, cfg: GRPOConfig):
    """The per-token objective that training minimises: edit this to try a new loss.

    logp (c,): this forward's logprob of c response tokens under softmax(logits / temperature),
    which the gradient flows through; t: the same tokens' inputs (Tokens, (c,) each). Returns the
    sum of per-token terms each weighed by t.coef (chunks, micro-batches and ranks add up to the
    mean over the global mini-batch), and the count of the model's tokens whose gradient the
    surrogate cut. A term: the ratio to the old policy -> grpo.policy_loss's surrogate -> times
    the engine/trainer mismatch weight -> times the keep mask -> plus the KL to the reference (in
    the loss, as DeepSeekMath). On-policy the old logprob is logp, detached: ratio 1, REINFORCE's
    gradient. No term may mix tokens (logprobs.run differentiates it chunk by chunk): a
    sequence's ratio comes in t.seq_ratio."""
    old = logp.detach() if t.old is None else t.old
    # the token's ratio; gspo, luspo: its sequence's, with each token's share of its gradient
    # (the paper's GSPO-token form: equal advantages within a sequence give GSPO's gradient)
    ratio = (t.seq_ratio * torch.exp(logp - logp.detach()) if cfg.policy_loss in SEQ_RATIO
             else torch.exp(logp - old))
    surrogate, cut = policy_surrogate(logp, old, ratio, t, cfg)
    per_token = -surrogate * correction(old, t, cfg) * (1 if t.keep is None else t.keep)
    if t.ref is not None and cfg.kl_coef > 0:
        kl = kl_penalty(logp, t.ref, cfg.kl_estimator)
        per_token = per_token + cfg.kl_coef * (kl * torch.exp(logp - old) if cfg.kl_unbiased
                                               else kl)
    return (per_token * t.coef).sum(), (cut * t.written).sum()


def correction(old, t: Tokens, cfg: GRPOConfig):
    """Each token's engine/trainer mismatch weight (grpo.is_correction, mismatch_weights), or 1
    where the surrogate holds the mismatch already: vespo's w, DPPO's ratio to the rollout."""
    if cfg.policy_loss == "vespo" or (cfg.policy_loss in DPPO and cfg.dppo_anchor == "rollout"):
        return 1
    if t.is_weight is not None:
        return t.is_weight
    return mismatch_weights(old[None], t.engine[None], t.written[None], cfg.is_correction,
                            cfg.is_cap, cfg.is_cap_low)[0]


def policy_surrogate(logp, old, ratio, t: Tokens, cfg: GRPOConfig):
    """grpo.policy_loss's surrogate of each token (the objective to raise) and where it cut the
    gradient (clipped; sapo, vespo: damped below half)."""
    name = cfg.policy_loss
    if name == "cispo":
        return cispo(logp, ratio, t.adv, cfg.clip_high)
    if name == "sapo":
        return sapo(ratio, t.adv, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
    if name in DPPO:  # anchored to the rollout: the engine's logprobs
        return dppo(logp, t.engine if cfg.dppo_anchor == "rollout" else old, t.adv, cfg)
    if name == "vespo":
        log_w = t.seq_log_w if t.seq_log_w is not None else torch.zeros_like(old)
        return vespo(logp, log_w, t.adv, cfg)
    return ppo_clip(ratio, t.adv, cfg.clip_low, cfg.clip_high, cfg.dual_clip)  # ppo, gspo, luspo


def ppo_clip(ratio, adv, clip_low: float, clip_high: float, dual_clip: float = 0.0):
    """PPO's clipped surrogate min(r A, clip(r, 1 - clip_low, 1 + clip_high) A) (Schulman et al.
    2017, arXiv 1707.06347; DAPO's clip-higher raises clip_high): where the min takes the clipped
    term, no gradient. dual_clip c > 1: with A < 0 at least c A, a constant (dual-clip PPO, Ye et
    al. 2020, arXiv 1912.09729, eq. 4)."""
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high) * adv
    surrogate, cut = torch.minimum(unclipped, clipped), unclipped > clipped
    if dual_clip:
        floor = dual_clip * adv
        low = (adv < 0) & (surrogate < floor)
        surrogate, cut = torch.where(low, floor, surrogate), cut | low
    return surrogate, cut


def cispo(logp, ratio, adv, clip_high: float):
    """CISPO (MiniMax-M1, arXiv 2506.13585): sg(min(r, 1 + clip_high)) A log p, the ratio capped
    and detached, so every token keeps a gradient."""
    weight = ratio.detach().clamp(max=1 + clip_high)
    return weight * adv * logp, weight < ratio


def sapo(ratio, adv, tau_pos: float, tau_neg: float):
    """SAPO (arXiv 2511.20347): 4/tau sigmoid(tau (r - 1)) A, a smooth gate of the ratio (slope 1
    at r = 1) instead of a clip; tau per sign of A."""
    tau = torch.where(adv > 0, adv.new_full((), tau_pos), adv.new_full((), tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1))
    return 4 / tau * gate * adv, 4 * gate * (1 - gate) < 0.5


def dppo(logp, anchor, adv, cfg: GRPOConfig):
    """DPPO (Qi et al. 2026, arXiv 2602.04879, eq. of its section 4; its authors' code,
    sail-sg/Stable-RL core_algos.py compute_policy_loss_with_mask): sg(min(p / p_a,
    dppo_ratio_cap)) A log p, 0 where the token's probability left the trust region around the
    anchor's p_a (dppo_inside): the rollout's, the engine's logprob (grpo.dppo_anchor=rollout,
    the paper's), or the old policy's (old, its recomputed ablation)."""
    inside = dppo_inside(logp.detach(), anchor, adv, cfg)
    weight = torch.exp(logp - anchor).detach().clamp(max=cfg.dppo_ratio_cap)
    return weight * adv * logp * inside, ~inside


def vespo(logp, log_w, adv, cfg: GRPOConfig):
    """VESPO (arXiv 2602.10693; TRL 1.16's vespo): sg(phi(w)) A log p, phi a gamma-shaped weight
    of the sequence's ratio w to the sampling policy (vespo_phi) instead of a clip."""
    phi = vespo_phi(log_w, adv, cfg)
    return phi * adv * logp, phi < 0.5


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


def dppo_inside(logp, anchor, adv, cfg: GRPOConfig):
    """DPPO's trust region (arXiv 2602.04879): whether each token's probability p moved from the
    anchor's q by less than a divergence bound, in the direction its advantage pushes it (A > 0:
    up, bound clip_high; else down, clip_low). Binary TV: p - q; binary KL: KL(Bernoulli(q) ||
    Bernoulli(p)). Detached inputs, bool out."""
    p, q = logp.exp(), anchor.exp()
    if cfg.policy_loss == "dppo_tv":
        up, down = p - q <= cfg.clip_high, p - q >= -cfg.clip_low
    else:  # the 1e-8 keeps log finite at p or q = 1, as the authors'
        kl = q * (anchor - logp) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
        up, down = (kl <= cfg.clip_high) | (p <= q), (kl <= cfg.clip_low) | (p >= q)
    return torch.where(adv > 0, up, down)


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



# ----------------------------------------------------------------------------------------------
# scoring a rollout: pure functions of its rewards, returning new values


@dataclass(frozen=True)
class Scoring:
    """How the run scores its rollouts, made once (train_grpo.build): what the sampler judges
    each finished group by (`judge`) and what `score` makes the step's advantages with."""
    cfg: GRPOConfig
    # an episode's length limit, the overlong penalty's: env.max_tokens with an environment,
    #   else rollout.max_new_tokens
    limit: int
    # env.on_failure=drop: a sample whose environment or reward call failed is out of the loss
    #   and of its group's statistics
    drop_failed: bool = False
    weights: tuple = (1.0,)  # reward.weights, in reward.funcs order: GDPO's


def shaped_rewards(rewards: list, lengths: list, limit: int, cfg: GRPOConfig) -> torch.Tensor:
    """(B*G,) fp64 rewards as the advantages see them: with grpo.overlong=penalty, DAPO's
    overlong penalty added for responses (an episode: all after its prompt) near `limit`."""
    shaped = torch.tensor(rewards, dtype=torch.float64)
    if cfg.overlong == "penalty":
        shaped += overlong_penalty(torch.tensor(lengths, dtype=torch.float64), limit,
                                   cfg.overlong_buffer, cfg.overlong_penalty_factor)
    return shaped


def reward_columns(total: list, by_name: dict, lengths: list, limit: int,
                   cfg: GRPOConfig) -> torch.Tensor:
    """(B*G, K) fp64: what the advantages normalise. K = 1, the weighted sum of the reward
    functions (`total`), shaped (shaped_rewards); with grpo.reward_agg=gdpo each function's own
    values (`by_name`, in reward.funcs order)."""
    if cfg.reward_agg == "gdpo":
        return torch.tensor(list(by_name.values()), dtype=torch.float64).T.reshape(len(total), -1)
    return shaped_rewards(total, lengths, limit, cfg).unsqueeze(1)


def judge(generated, rewards, scoring: Scoring) -> tuple[list[bool], list[bool]]:
    """Finished groups (records.Generated) and their rewards (records.Rewards) -> per sample,
    whether it is out of the loss and of its group's statistics (`dropped`: its environment or a
    reward call failed, with scoring.drop_failed), and per group, whether it may go into the
    update (`keep`: with dynamic sampling (DAPO), not if its rewards (reward_columns) are all
    equal over its valid samples: no signal)."""
    cfg = scoring.cfg
    dropped = [scoring.drop_failed and (e or r) for e, r in zip(generated.failed, rewards.failed)]
    columns = reward_columns(rewards.total, rewards.by_name,
                             [len(s.response_ids) for s in generated.samples], scoring.limit, cfg)
    constant = constant_groups(columns, cfg.group_size, ~torch.tensor(dropped, dtype=torch.bool))
    return dropped, [not (c and cfg.dynamic_sampling) for c in constant.tolist()]


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


def score(rollout, scoring: Scoring, group) -> Scored:
    """The rollout's rewards, shaped (overlong penalty, against scoring.limit tokens) into
    advantages within each group of G (`advantages`; scoring.weights, for GDPO); a sample the
    sampler dropped (rollout.dropped: `judge`) is left out of its group's advantages and of the
    loss. Then the groups this engine group (`group`: rollout.EngineGroup) trains (the kept
    ones, up to grpo.prompts_per_step over all engine groups) and their samples (with
    grpo.overlong=mask, not those cut at the limit). Every rank of an engine group gets the same;
    every rank must call it (a batch std is an all-reduce)."""
    cfg = scoring.cfg
    G, dropped = cfg.group_size, list(rollout.dropped)
    valid = ~torch.tensor(dropped, dtype=torch.bool)
    columns = reward_columns(rollout.rewards, rollout.by_name,
                             [len(s.response_ids) for s in rollout.samples], scoring.limit, cfg)
    adv, batch_std = advantages(columns, list(scoring.weights), valid, cfg,
                                group.sum_over_engines)
    groups = take_groups(rollout.keep, rollout.kept, group.index, cfg.prompts_per_step)
    return Scored(
        adv=adv.tolist(), constant=constant_groups(columns, G, valid).tolist(), dropped=dropped,
        groups=groups, batch_std=batch_std,
        trained=trained_samples(groups, G, dropped, [s.truncated for s in rollout.samples],
                                cfg.overlong == "mask"))
