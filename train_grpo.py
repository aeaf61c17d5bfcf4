"""GRPO with a colocated FSDP2 actor and in-process vLLM engine, in one file you can read.

Run it
    torchrun --nproc_per_node 2 train_grpo.py --config configs/tiny_cpu.yaml        # CPU, 2 ranks
    torchrun --nproc_per_node 8 train_grpo.py --config configs/x.yaml --optim.lr=1e-6
    python train_grpo.py --config configs/tiny_cpu.yaml                             # world size 1
    # notebook:  from train_grpo import load_config, train
    #            train(load_config("configs/tiny_cpu.yaml", ["--log.out_dir=/tmp/run"]))

One step: sync the actor's weights into the engine, sample `group_size` responses per prompt,
score them, normalise rewards within each group into advantages, and update on the clipped
surrogate. With the defaults this GRPO is, precisely:
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

import argparse
import dataclasses
import difflib
import json
import logging
import math
import os
import random
import sys
import time
import typing
from dataclasses import dataclass, field

import npu_ops  # first: it sets the Ascend environment before torch (and its backends) load

import torch
import torch.distributed as dist

import fsdp_utils
import rewards
import rollout
import tiny_task
import weight_sync
from fsdp_utils import ModelConfig, OptimConfig
from rollout import RolloutConfig

log = logging.getLogger("grpo")


# ----------------------------------------------------------------------------------------------
# config: one dataclass per YAML section; each section's class lives next to the code using it


@dataclass
class DataConfig:
    path: str = ""  # jsonl of examples, one JSON object a line
    eval_path: str = ""  # held-out jsonl for log.eval_every (empty: the training prompts)
    prompt_key: str = "prompt"
    answer_key: str = "answer"  # passed to the reward with the rest of the example
    reward: str = "tiny_sum"  # a name in rewards.REWARDS
    prompt_suffix: str = ""  # appended to every prompt, e.g. an instruction on the answer format
    chat_template: bool = False  # wrap the prompt as a user turn with the tokenizer's template
    max_prompt_len: int = 512  # longer prompts are dropped at load time
    tiny_task_dir: str = ""  # if set: create the built-in tiny model + prompts here if missing


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
    micro_batch_tokens: int = 8192  # padded tokens per forward/backward on one rank


@dataclass
class TrainConfig:
    steps: int = 100
    seed: int = 0  # data order: step N draws the same prompts, resumed or not
    resume: bool = False  # continue from the newest checkpoint in log.out_dir, if there is one


@dataclass
class LogConfig:
    out_dir: str = "runs/default"  # metrics.jsonl, config.yaml, samples.jsonl, checkpoints
    samples_every: int = 10  # write a few (prompt, completion, reward) rows every N steps
    eval_every: int = 0  # greedy accuracy on data.eval_path every N steps (0: off)
    save_every: int = 0  # resumable checkpoint every N steps (0: none); HF export at the end
    keep_checkpoints: int = 2  # newest resumable checkpoints kept on disk
    wandb_project: str = ""  # empty: no wandb


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)


def _closest(name: str, options) -> str:
    match = difflib.get_close_matches(name, list(options), n=1, cutoff=0.0)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _coerce(where: str, value, typ):
    """Convert a YAML or command-line value to the field's type, or fail naming the field."""
    try:
        if typ is bool:
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
                return value.lower() in ("true", "1", "yes")
            if isinstance(value, bool):
                return value
            raise ValueError
        if typ is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(float(value)) if isinstance(value, str) and "e" in value else int(value)
        if typ is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)  # PyYAML reads 1e-6 as a string
        if typ is str:
            if isinstance(value, (dict, list)):
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        pass
    raise ValueError(f"config {where}: expected {typ.__name__}, got {value!r}")


def load_config(path: str | None = None, overrides: list[str] = ()) -> Config:
    """Defaults < YAML file < `--section.key=value` overrides. Unknown keys and bad types raise."""
    import yaml

    raw = {}
    if path is not None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config file not found: {path}")
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"config {path}: expected sections (model:, optim:, ...) at top level")
    pairs = [(f"{sec}.{key}", val) for sec, body in raw.items()
             for key, val in (body.items() if isinstance(body, dict) else [(None, body)])]
    args = list(overrides)
    while args:
        arg = args.pop(0)
        if not arg.startswith("--") or "." not in arg:
            raise ValueError(f"bad override {arg!r}: use --section.key=value")
        key, eq, val = arg[2:].partition("=")
        if not eq:
            if not args:
                raise ValueError(f"override {arg} has no value")
            val = args.pop(0)
        pairs.append((key, val))

    cfg = Config()
    sections = {f.name: f for f in dataclasses.fields(Config)}
    for dotted, val in pairs:
        sec, _, key = dotted.partition(".")
        if sec not in sections:
            raise ValueError(f"unknown config section '{sec}'{_closest(sec, sections)}")
        if not key or key == "None":
            raise ValueError(f"config section '{sec}' must be a mapping of keys to values")
        section = getattr(cfg, sec)
        hints = typing.get_type_hints(type(section))
        if key not in hints:
            valid = [f"{sec}.{k}" for k in hints]
            raise ValueError(f"unknown config key '{dotted}'{_closest(dotted, valid)}")
        setattr(section, key, _coerce(dotted, val, hints[key]))
    return cfg


def validate(cfg: Config, world_size: int) -> None:
    """Checks that need no model: fail in a second, not after minutes of loading."""
    r, g = cfg.rollout, cfg.grpo

    def need(ok, msg):
        if not ok:
            raise ValueError(f"config: {msg}")

    need(r.tp_size >= 1 and world_size % r.tp_size == 0,
         f"rollout.tp_size={r.tp_size} must divide the world size {world_size}")
    engines = world_size // r.tp_size
    need(g.group_size >= 2, f"grpo.group_size={g.group_size}: needs >= 2 to form an advantage")
    need(g.prompts_per_step % engines == 0,
         f"grpo.prompts_per_step={g.prompts_per_step} must be a multiple of the number of engine "
         f"groups (world {world_size} / rollout.tp_size {r.tp_size} = {engines})")
    need(g.prompts_per_step // engines * g.group_size % r.tp_size == 0,
         "the samples of one engine group (prompts_per_step / engines * group_size) must split "
         f"evenly over its {r.tp_size} tensor-parallel ranks")
    need(r.max_new_tokens < r.max_model_len,
         f"rollout.max_new_tokens={r.max_new_tokens} must be below rollout.max_model_len")
    need(cfg.data.max_prompt_len + r.max_new_tokens <= r.max_model_len,
         f"data.max_prompt_len + rollout.max_new_tokens must be <= rollout.max_model_len "
         f"({cfg.data.max_prompt_len} + {r.max_new_tokens} > {r.max_model_len})")
    need(cfg.data.reward in rewards.REWARDS,
         f"data.reward='{cfg.data.reward}' is not one of {sorted(rewards.REWARDS)}")
    per_rank = g.prompts_per_step // engines * g.group_size // r.tp_size
    for key, options in (("loss_agg", LOSS_AGGS), ("kl_estimator", ("k1", "k2", "k3")),
                         ("is_correction", ("none", "tis", "seq_mask")),
                         ("overlong", ("none", "mask", "penalty"))):
        need(getattr(g, key) in options, f"grpo.{key}='{getattr(g, key)}': use one of {options}")
    need(0 <= g.clip_low < 1 and g.clip_high >= 0,
         f"grpo.clip_low={g.clip_low} must be in [0, 1) and grpo.clip_high={g.clip_high} >= 0")
    need(g.ppo_epochs >= 1 and 1 <= g.mini_batches <= per_rank,
         f"grpo.ppo_epochs={g.ppo_epochs} must be >= 1 and grpo.mini_batches={g.mini_batches} "
         f"between 1 and the samples per rank ({per_rank})")
    need(g.kl_coef >= 0, f"grpo.kl_coef={g.kl_coef} must be >= 0 (0 turns the KL term off)")
    need(g.is_cap > 1, f"grpo.is_cap={g.is_cap} must be > 1")
    need(g.max_gen_rounds == 1 or (g.dynamic_sampling and g.max_gen_rounds > 1),
         f"grpo.max_gen_rounds={g.max_gen_rounds}: more than 1 needs grpo.dynamic_sampling=true")
    need(g.overlong != "penalty" or 0 < g.overlong_buffer <= r.max_new_tokens,
         f"grpo.overlong=penalty needs 0 < grpo.overlong_buffer <= rollout.max_new_tokens "
         f"({r.max_new_tokens}); got {g.overlong_buffer}")
    need(r.sleep_level in (1, 2), f"rollout.sleep_level={r.sleep_level}: use 1 or 2")
    need(cfg.optim.schedule in ("constant", "cosine"),
         f"optim.schedule='{cfg.optim.schedule}': use constant or cosine")
    need(cfg.optim.lr > 0 and cfg.train.steps >= 1, "optim.lr and train.steps must be positive")
    for name in ("model.param_dtype", "model.reduce_dtype", "rollout.dtype"):
        sec, key = name.split(".")
        need(isinstance(getattr(torch, getattr(getattr(cfg, sec), key), None), torch.dtype),
             f"{name}='{getattr(getattr(cfg, sec), key)}' is not a torch dtype (e.g. bfloat16)")
    npu_ops.kernel_path(cfg.model.fused_kernels)  # raises on a bad mode or a missing kernel lib
    npu_ops.check_platform(not r.enforce_eager, r.temperature, r.top_p)  # graph mode, sampling
    if not cfg.data.tiny_task_dir:
        need(os.path.isfile(cfg.data.path), f"data.path='{cfg.data.path}' is not a file")
        need(not cfg.data.eval_path or os.path.isfile(cfg.data.eval_path),
             f"data.eval_path='{cfg.data.eval_path}' is not a file")
        need(cfg.model.path and (os.path.isdir(cfg.model.path) or cfg.model.path.count("/") == 1),
             f"model.path='{cfg.model.path}' is neither a directory nor a hub id (org/name)")


# ----------------------------------------------------------------------------------------------
# the GRPO math: small pure functions on tensors. Each variant names the paper it comes from.

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


def mismatch_stats(old_logp: list, engine_logp: list, cap: float) -> tuple[dict, dict, dict]:
    """Engine vs trainer logprobs of the sampled tokens, per-sample (n_i,) tensors. Returns
    (sums, maxima, minima) for reduce_metrics: |gap|, the importance ratio p_trainer / p_engine per
    token, the share of tokens above C and of sequences whose ratio leaves [1/C, C]."""
    log_ratio = [o.double() - torch.as_tensor(e, dtype=torch.float64)
                 for o, e in zip(old_logp, engine_logp)]
    flat = torch.cat(log_ratio) if log_ratio else torch.zeros(0, dtype=torch.float64)
    seq = torch.stack([x.sum() for x in log_ratio]) if log_ratio else flat
    ratio = flat.exp()
    sums = {"mm_tokens": flat.numel(), "logp_gap": flat.abs().sum().item(),
            "is_ratio_mean": ratio.sum().item(), "is_above_cap_frac": (ratio > cap).sum().item(),
            "mm_seqs": seq.numel(),
            "seq_outside_cap_frac": (seq.abs() > math.log(cap)).sum().item()}
    empty = not flat.numel()
    return (sums, {"is_ratio_max": 0.0 if empty else ratio.max().item()},
            {"is_ratio_min": math.inf if empty else ratio.min().item()})


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


def plan_micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Group indices, longest first, so each group's (count x max length) fits `budget` tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > budget:
            batches.append(cur)
            cur = []
        cur.append(i)
    return batches + [cur] if cur else batches


# ----------------------------------------------------------------------------------------------
# the update: forward/backward over the rollout. Every function here runs FSDP collectives, so
# every rank calls it, with its own share of the samples (possibly none).

DUMMY = rollout.Sample(prompt_ids=[0], response_ids=[0], logp=[0.0], truncated=False)


def micro_batch_plan(samples: list, budget: int) -> list[list[int]]:
    """plan_micro_batches, topped up with empty entries so that every rank runs as many forwards
    as the busiest (FSDP all-gathers per forward); an empty entry is a zero-loss DUMMY forward."""
    plan = plan_micro_batches([len(s.prompt_ids) + len(s.response_ids) for s in samples], budget)
    n = torch.tensor(len(plan))
    dist.all_reduce(n, op=dist.ReduceOp.MAX)
    return plan + [[]] * (int(n) - len(plan))


def forward_logp(model, samples: list, pad_id: int, device, temperature: float, per_token=None):
    """Returns logp (n, T-1) of the targets, logits (n, T-1, V), mask and padded per-token dict."""
    ids, attn, targets, mask, padded = pad_batch(samples, pad_id, per_token)
    ids, attn, targets, mask = ids.to(device), attn.to(device), targets.to(device), mask.to(device)
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]
    logp = token_logprobs(logits, targets, temperature)
    return logp, logits, mask, {k: v.to(device) for k, v in padded.items()}


@torch.no_grad()
def sample_logprobs(model, samples: list, cfg: Config, pad_id: int, device) -> list:
    """Each sample's response-token logprobs under `model` (old or reference policy): a list of
    (n_i,) fp32 CPU tensors."""
    out = [None] * len(samples)
    model.eval()
    for idx in micro_batch_plan(samples, cfg.grpo.micro_batch_tokens):
        logp, _, mask, _ = forward_logp(model, [samples[i] for i in idx] or [DUMMY], pad_id,
                                        device, cfg.rollout.temperature)
        for row, i in enumerate(idx):
            out[i] = logp[row][mask[row].bool()].float().cpu()
    return out


def accumulate_gradients(actor, samples: list, adv: torch.Tensor, old_logp, ref_logp,
                         cfg: Config, pad_id: int, device) -> tuple[list, dict]:
    """Forward/backward this rank's share of one global mini-batch; gradients accumulate in the
    actor. old_logp None means on-policy: old_logp is this forward's own logp, detached (ratio 1).
    Returns this forward's logp per sample ((n_i,) CPU tensors) and sums for the metrics."""
    g = cfg.grpo
    counts = torch.tensor([float(sum(len(s.response_ids) for s in samples)), float(len(samples))])
    dist.all_reduce(counts)  # the loss is normalised over the global mini-batch
    n_tokens, n_seqs = counts.tolist()
    logps, stats = [torch.zeros(0)] * len(samples), {"clipped": 0.0, "entropy": 0.0}
    if n_tokens == 0:  # nothing to learn from on any rank (all ranks see the same counts)
        return logps, stats
    actor.train()
    for idx in micro_batch_plan(samples, g.micro_batch_tokens):
        extra = {name: [lp[i] for i in idx] or [[0.0]]
                 for name, lp in (("old", old_logp), ("ref", ref_logp)) if lp is not None}
        logp, logits, mask, pt = forward_logp(actor, [samples[i] for i in idx] or [DUMMY], pad_id,
                                              device, cfg.rollout.temperature, extra)
        old = pt["old"] if old_logp is not None else logp.detach()
        is_weight = mismatch_weights(old, pt["engine"], mask, g.is_correction, g.is_cap)
        a = adv[idx] if idx else torch.zeros(1)
        loss, clipped = grpo_loss(logp, old, a.to(device), mask, g, n_tokens, n_seqs,
                                  cfg.rollout.max_new_tokens, is_weight, pt.get("ref"))
        # FSDP averages gradients over ranks; the loss is already a global mean: undo the average
        (loss * (dist.get_world_size() if idx else 0.0)).backward()
        if idx:
            stats["clipped"] += clipped.sum().item()
            stats["entropy"] += masked_entropy_sum(logits.detach(), mask)
            for row, i in enumerate(idx):
                logps[i] = logp[row][mask[row].bool()].detach().float().cpu()
    return logps, stats


def split_mini_batches(n: int, k: int, generator) -> list[list[int]]:
    """A fresh random split of n samples into k mini-batches of near-equal size."""
    order = torch.randperm(n, generator=generator).tolist()
    return [order[j::k] for j in range(k)]


def train_on_rollout(actor, ref, opt, samples: list, adv: torch.Tensor, cfg: Config, pad_id: int,
                     device, seed: int) -> tuple[dict, dict, dict, float]:
    """grpo.ppo_epochs passes over this rank's samples, each split into grpo.mini_batches
    optimizer steps. Returns (sums, maxima, minima) for reduce_metrics and the mean grad norm."""
    g = cfg.grpo
    on_policy = g.ppo_epochs == 1 and g.mini_batches == 1
    # old_logp is the sampling policy as the trainer computes it. On-policy it comes from the
    # update's own forward; otherwise it is recomputed once, before the first optimizer step
    old_logp = None if on_policy else sample_logprobs(actor, samples, cfg, pad_id, device)
    ref_logp = None
    if ref is not None:  # the frozen reference lives off the accelerator between its passes
        fsdp_utils.onload(ref)
        ref_logp = sample_logprobs(ref, samples, cfg, pad_id, device)
        fsdp_utils.offload(ref)
    sums, norms = {"clipped": 0.0, "entropy": 0.0, "loss_tokens": 0.0}, []
    shuffle = torch.Generator().manual_seed(seed)
    for epoch in range(g.ppo_epochs):
        for part in split_mini_batches(len(samples), g.mini_batches, shuffle):
            old, ref_lp = ([lp[i] for i in part] if lp is not None else None
                           for lp in (old_logp, ref_logp))
            logp, stats = accumulate_gradients(actor, [samples[i] for i in part], adv[part],
                                               old, ref_lp, cfg, pad_id, device)
            if old_logp is None:  # on-policy: the single forward saw the sampling policy
                old_logp = [None] * len(samples)
                for k, i in enumerate(part):
                    old_logp[i] = logp[k]
            sums["clipped"] += stats["clipped"]
            sums["loss_tokens"] += sum(len(samples[i].response_ids) for i in part)
            if epoch == 0:  # entropy of the policy as it meets this rollout
                sums["entropy"] += stats["entropy"]
            norms.append(fsdp_utils.clip_grad_norm(actor, cfg.optim.grad_clip))
            opt.step()
            opt.zero_grad(set_to_none=True)
    mm_sums, highs, lows = mismatch_stats(old_logp, [s.logp for s in samples], g.is_cap)
    sums.update(mm_sums)
    if ref_logp is not None:
        sums["kl"] = sum(kl_penalty(o, r, g.kl_estimator).sum().item()
                         for o, r in zip(old_logp, ref_logp))
    return sums, highs, lows, sum(norms) / len(norms)


# ----------------------------------------------------------------------------------------------
# the loop


def init_distributed() -> tuple[int, int]:
    """Join torchrun's process group, or make a world of one (notebook, plain python)."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # not under torchrun: a one-rank world on a free port
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        npu_ops.local_device()  # pick this rank's device before the process group binds one
        dist.init_process_group(npu_ops.dist_backend())
    return dist.get_rank(), dist.get_world_size()


def load_examples(cfg: DataConfig, tokenizer) -> list[dict]:
    """Read the jsonl, tokenise each prompt into example["prompt_ids"], drop over-long prompts."""
    examples, dropped = [], 0
    with open(cfg.path) as f:
        for line in f:
            if not line.strip():
                continue
            ex = json.loads(line)
            text = ex[cfg.prompt_key] + cfg.prompt_suffix
            if cfg.chat_template:
                ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                    add_generation_prompt=True, tokenize=True)
            else:
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) <= cfg.max_prompt_len:
                examples.append({**ex, "prompt_ids": list(ids)})
            else:
                dropped += 1
    log.info("data: %d examples from %s, %d dropped as longer than data.max_prompt_len=%d",
             len(examples), cfg.path, dropped, cfg.max_prompt_len)
    if not examples:
        raise ValueError(f"data.path={cfg.path}: no example with a prompt of at most "
                         f"data.max_prompt_len={cfg.max_prompt_len} tokens")
    return examples


def train(cfg: Config) -> dict:
    """Run GRPO for cfg.train.steps steps; returns the last step's metrics."""
    import yaml
    from torch.distributed.device_mesh import init_device_mesh
    from tqdm import tqdm
    from transformers import AutoTokenizer

    # before the engine or any accelerator runtime starts: npu_ops.setup_env says why
    env = npu_ops.setup_env(graph_mode=not cfg.rollout.enforce_eager, sleep_mode=True,
                            tp_size=cfg.rollout.tp_size)
    rank, world = init_distributed()
    device = npu_ops.local_device()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s", force=True)
    validate(cfg, world)
    log.info("device %s, backend %s, world %d", npu_ops.device_type(), npu_ops.dist_backend(), world)
    for name, (value, source) in env.items():
        log.info("env %s=%s (%s)", name, value, source)
    if cfg.data.tiny_task_dir:
        if rank == 0:  # one writer; the others wait (single node or a shared filesystem)
            tiny_task.ensure_tiny_task(cfg.data.tiny_task_dir)
        dist.barrier()
        cfg.model.path = cfg.model.path or os.path.join(cfg.data.tiny_task_dir, "model")
        cfg.data.path = cfg.data.path or os.path.join(cfg.data.tiny_task_dir, "train.jsonl")
        cfg.data.eval_path = cfg.data.eval_path or os.path.join(cfg.data.tiny_task_dir, "test.jsonl")
    out = cfg.log.out_dir
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "config.yaml"), "w") as f:
            yaml.safe_dump(dataclasses.asdict(cfg), f, sort_keys=False)

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    examples = load_examples(cfg.data, tokenizer)
    eval_examples = (load_examples(dataclasses.replace(cfg.data, path=cfg.data.eval_path), tokenizer)
                     if cfg.log.eval_every and cfg.data.eval_path else examples)
    reward_fn = rewards.REWARDS[cfg.data.reward]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0  # masked anyway
    tp, G = cfg.rollout.tp_size, cfg.grpo.group_size
    engine_idx, tp_rank, n_engines = rank // tp, rank % tp, world // tp
    per_engine = cfg.grpo.prompts_per_step // n_engines

    # the engine first: building vLLM reseeds torch
    engine = rollout.Engine(cfg.rollout, cfg.model.path, tp_group_index=engine_idx)
    engine.sleep()  # before the actor loads: its memory goes to training until the first sync
    torch.manual_seed(cfg.train.seed)
    mesh = init_device_mesh(npu_ops.device_type(), (world,))
    actor = fsdp_utils.build_actor(cfg.model, mesh)
    ref = fsdp_utils.build_actor(cfg.model, mesh, reference=True) if cfg.grpo.kl_coef > 0 else None
    opt, sched = fsdp_utils.build_optimizer(cfg.optim, actor, cfg.train.steps)
    done, drawn = 0, 0  # steps taken; prompts drawn from the shuffled data (all engine groups)
    ckpt = fsdp_utils.latest_checkpoint(out) if cfg.train.resume else None
    if ckpt:
        state = fsdp_utils.load_checkpoint(ckpt, actor, opt, sched)
        done, drawn = state["step"], state.get("drawn", state["step"] * cfg.grpo.prompts_per_step)
        log.info("resumed from %s: continuing after step %d", ckpt, done)
    if rank == 0:  # drop rows of steps after the checkpoint (a crashed run's tail), or all
        for name in ("metrics.jsonl", "samples.jsonl"):
            keep_rows_upto(os.path.join(out, name), done)
    wandb = None
    if cfg.log.wandb_project and rank == 0:
        import wandb

        wandb.init(project=cfg.log.wandb_project, config=dataclasses.asdict(cfg))

    g, P = cfg.grpo, cfg.grpo.prompts_per_step
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(cfg.train.seed))
    metrics_file = open(os.path.join(out, "metrics.jsonl"), "a") if rank == 0 else None
    bar = tqdm(range(done + 1, cfg.train.steps + 1), initial=done, total=cfg.train.steps,
               disable=rank != 0, desc="steps", file=sys.stdout)
    metrics = {}
    try:
        for step in bar:
            t_step, times = time.perf_counter(), {"gen": 0.0, "reward": 0.0}
            # 1) rollout + 2) reward, in rounds: one round, unless dynamic sampling (DAPO) drops
            #    the groups whose rewards are all equal and draws fresh prompts to refill the batch
            sync = weight_sync.push(actor, engine)
            times["sync"] = sync["seconds"]
            gen = {k: [] for k in ("samples", "examples", "texts", "scores", "adv", "constant",
                                   "keep")}
            errors = rounds = 0
            while True:
                batch = [examples[order[(drawn + engine_idx * per_engine + i) % len(examples)]]
                         for i in range(per_engine)]  # same prompts on one engine group's ranks
                drawn, rounds = drawn + P, rounds + 1
                seed = (random.Random(f"{cfg.rollout.seed}/{step}/{engine_idx}/{rounds}")
                        .getrandbits(48) if cfg.rollout.seed_per_step else None)
                errors += generate_and_score(engine, batch, tokenizer, reward_fn, cfg, seed, gen,
                                             times)
                kept = kept_per_engine(sum(gen["keep"]), tp)  # groups, one entry per engine group
                if not g.dynamic_sampling or sum(kept) >= P or rounds == g.max_gen_rounds:
                    break
            t = time.perf_counter()
            engine.sleep()  # frees weights + KV cache where the platform can (level 1 offloads)
            times["sleep"] = time.perf_counter() - t
            groups = take_groups(gen["keep"], kept, engine_idx, P)
            train_idx = [b * G + j for b in groups for j in range(G)  # overlong mask (DAPO)
                         if not (g.overlong == "mask" and gen["samples"][b * G + j].truncated)]

            # 3) update: this rank trains on its 1/tp share of the kept samples
            t = time.perf_counter()
            mine = train_idx[tp_rank::tp]
            shuffle_seed = random.Random(f"{cfg.train.seed}/{step}/{rank}").getrandbits(48)
            sums, highs, lows, grad_norm = train_on_rollout(
                actor, ref, opt, [gen["samples"][i] for i in mine], torch.tensor(gen["adv"])[mine],
                cfg, pad_id, device, shuffle_seed)
            sched.step()
            times["train"] = time.perf_counter() - t
            times["step"] = time.perf_counter() - t_step

            # 4) log: each generated sample counted once over its engine group's ranks
            share = [gen["samples"][i] for i in range(tp_rank, len(gen["samples"]), tp)]
            first = float(tp_rank == 0)
            sums.update(samples=len(share), reward=sum(gen["scores"][tp_rank::tp]),
                        response_tokens=sum(len(s.response_ids) for s in share),
                        prompt_tokens=sum(len(s.prompt_ids) for s in share),
                        truncated=sum(s.truncated for s in share), reward_errors=first * errors,
                        groups_constant=first * sum(gen["constant"]),
                        groups_trained=first * len(groups), samples_trained=first * len(train_idx))
            metrics = reduce_metrics(sums, highs, lows, times)
            metrics.update(step=step, grad_norm=grad_norm, lr=sched.get_last_lr()[0],
                           gen_rounds=rounds, sync_gb=sync["bytes"] / 2**30,
                           mem_peak_gb=npu_ops.memory_gb()["peak"])
            for event, (before, after) in engine.memory.items():  # accelerators only
                metrics.update({f"mem_{event}_before_gb": before, f"mem_{event}_after_gb": after})
            if cfg.log.eval_every and step % cfg.log.eval_every == 0:
                metrics["eval_reward"] = evaluate(engine, actor, eval_examples, reward_fn, tokenizer,
                                                  engine_idx, n_engines)
            if rank == 0:
                metrics_file.write(json.dumps(metrics) + "\n")
                metrics_file.flush()
                bar.write(format_line(metrics, cfg.train.steps))
                if wandb:
                    wandb.log(metrics, step=step)
                if cfg.log.samples_every and step % cfg.log.samples_every == 0:
                    with open(os.path.join(out, "samples.jsonl"), "a") as f:
                        for i in range(0, min(len(gen["texts"]), 4 * G), G):
                            ex = gen["examples"][i]
                            f.write(json.dumps({"step": step, "prompt": ex[cfg.data.prompt_key],
                                                "completion": gen["texts"][i],
                                                "reward": gen["scores"][i],
                                                "answer": ex.get(cfg.data.answer_key)}) + "\n")
            if cfg.log.save_every and step % cfg.log.save_every == 0:
                fsdp_utils.save_checkpoint(out, step, actor, opt, sched, cfg.log.keep_checkpoints,
                                           extra={"drawn": drawn})
        fsdp_utils.save_hf(actor, tokenizer, os.path.join(out, "final"))
    finally:
        if metrics_file:
            metrics_file.close()
        engine.shutdown()
        if dist.is_initialized():  # the engine's shutdown may already have destroyed it
            dist.destroy_process_group()
    return metrics


def generate_and_score(engine, batch: list, tokenizer, reward_fn, cfg: Config, seed, gen: dict,
                       times: dict) -> int:
    """One round of rollout and reward for this engine group's prompts: samples G responses per
    prompt, scores them, shapes the rewards (overlong penalty) into advantages, and appends all
    of it to the lists in `gen`. Every rank of an engine group gets the same. Returns the number
    of rewards that raised."""
    g, t = cfg.grpo, time.perf_counter()
    samples = engine.generate([ex["prompt_ids"] for ex in batch], n=g.group_size, seed=seed)
    times["gen"] += time.perf_counter() - t
    t = time.perf_counter()
    texts = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
    examples = [ex for ex in batch for _ in range(g.group_size)]
    scores, errors = rewards.score(reward_fn, texts, examples)
    shaped = torch.tensor(scores, dtype=torch.float64)  # (B*G,)
    if g.overlong == "penalty":
        lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
        shaped += overlong_penalty(lengths, cfg.rollout.max_new_tokens, g.overlong_buffer,
                                   g.overlong_penalty_factor)
    constant = constant_groups(shaped, g.group_size).tolist()  # (B,)
    gen["samples"] += samples
    gen["examples"] += examples
    gen["texts"] += texts
    gen["scores"] += scores
    gen["adv"] += group_advantages(shaped, g.group_size, g.adv_eps, g.scale_adv_by_std).tolist()
    gen["constant"] += constant
    gen["keep"] += [not (c and g.dynamic_sampling) for c in constant]  # constant: no gradient
    times["reward"] += time.perf_counter() - t
    return errors


def take_groups(keep: list, kept: list, engine_idx: int, target: int) -> list[int]:
    """This engine group's groups for the update: the kept ones (keep[b]), at most `target` over
    all engine groups, taken in engine-group order (kept[e]: engine group e's count)."""
    quota = min(kept[engine_idx], max(0, target - sum(kept[:engine_idx])))
    return [b for b, k in enumerate(keep) if k][:quota]


def kept_per_engine(kept: int, tp: int) -> list[int]:
    """All-gather this engine group's count of kept groups: one entry per engine group."""
    counts = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([kept]))
    return [int(c) for c in counts[::tp]]


def reduce_metrics(sums: dict, highs: dict, lows: dict, times: dict) -> dict:
    """All-reduce this rank's sums (and maxima, minima); return the step's means. Every rank must
    call it, with the same keys."""
    def reduce(d, op):
        t = torch.tensor(list(d.values()), dtype=torch.float64)
        dist.all_reduce(t, op=op)
        return dict(zip(d, t.tolist()))

    s, hi, lo = reduce(sums, dist.ReduceOp.SUM), reduce(highs, dist.ReduceOp.MAX), \
        reduce(lows, dist.ReduceOp.MIN)
    n, tokens = max(s["samples"], 1), max(s["mm_tokens"], 1)  # generated; trained tokens
    m = {"reward_mean": s["reward"] / n, "response_len_mean": s["response_tokens"] / n,
         "truncated_frac": s["truncated"] / n, "reward_errors": int(s["reward_errors"]),
         "groups_constant": int(s["groups_constant"]), "groups_trained": int(s["groups_trained"]),
         "samples_trained": int(s["samples_trained"]),
         "entropy": s["entropy"] / tokens, "clip_frac": s["clipped"] / max(s["loss_tokens"], 1),
         "logp_gap": s["logp_gap"] / tokens, "is_ratio_mean": s["is_ratio_mean"] / tokens,
         "is_ratio_max": hi["is_ratio_max"], "is_ratio_min": lo["is_ratio_min"],
         "is_above_cap_frac": s["is_above_cap_frac"] / tokens,
         "seq_outside_cap_frac": s["seq_outside_cap_frac"] / max(s["mm_seqs"], 1)}
    if "kl" in s:
        m["kl"] = s["kl"] / tokens
    m.update({f"{k}_time_s": v for k, v in times.items()})
    m["tokens_per_s"] = (s["prompt_tokens"] + s["response_tokens"]) / times["step"]
    return m


def keep_rows_upto(path: str, step: int) -> None:
    """Rewrite a jsonl log keeping the rows of steps <= `step` (all rows gone for step 0)."""
    rows = []
    if step and os.path.exists(path):
        with open(path) as f:
            rows = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(path, "w") as f:
        f.writelines(rows)


@torch.no_grad()
def evaluate(engine, actor, examples, reward_fn, tokenizer, engine_idx, n_engines) -> float:
    """Greedy accuracy over all examples (each engine group takes a slice). The engine already
    holds the weights of this step's rollout; the update since then is synced first."""
    weight_sync.push(actor, engine)
    part = examples[engine_idx::n_engines]
    samples = engine.generate([ex["prompt_ids"] for ex in part], n=1, greedy=True)
    engine.sleep()
    texts = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
    scores, _ = rewards.score(reward_fn, texts, part)
    # every rank of a tensor-parallel group holds the same scores: count only its first rank
    tp = dist.get_world_size() // n_engines
    first = dist.get_rank() % tp == 0
    total = torch.tensor([sum(scores) if first else 0.0, len(scores) if first else 0.0])
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def format_line(m: dict, steps: int) -> str:
    line = (f"step {m['step']}/{steps} | reward {m['reward_mean']:.3f} | "
            f"len {m['response_len_mean']:.1f} | ent {m['entropy']:.2f} | "
            + (f"kl {m['kl']:.4f} | " if "kl" in m else "")
            + f"gap {m['logp_gap']:.1e} | "
            f"gen {m['gen_time_s']:.2f}s sync {m['sync_time_s']:.2f}s "
            f"reward {m['reward_time_s']:.2f}s train {m['train_time_s']:.2f}s | "
            f"{m['tokens_per_s']:.0f} tok/s | mem {m['mem_peak_gb']:.1f}G")
    if "eval_reward" in m:
        line += f" | eval {m['eval_reward']:.3f}"
    return line


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="YAML file; further --section.key=value override it")
    args, overrides = parser.parse_known_args(argv)
    train(load_config(args.config, overrides))


if __name__ == "__main__":
    main()
