"""The update: grpo.py's formulas applied to a batch, epochs x mini-batches of accumulate, clip,
step; nothing else.

`update(actor, opt, batch, settings)` takes the batch as batcher.py built it, with everything a
pass without gradient added to it before (the old policy's logprobs, the forking tokens, the
reference's logprobs, a teacher's signal: batch transforms), and runs grpo.ppo_epochs passes
over it, each split into grpo.mini_batches optimizer steps. A mini-batch's gradient is
accumulated over micro-batches (`accumulate_gradients`: packed rows through logprobs.run, whose
fused output layer differentiates grpo.grpo_loss chunk by chunk), clipped, and taken unless its
loss or norm is not finite. Every function here runs FSDP collectives, so every rank calls it,
with its own share of the samples (possibly none).
"""

import dataclasses
import functools
import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

import batcher
import fsdp_utils
import grpo
import logprobs
from modeling import moe
import tracking

log = logging.getLogger("grpo")


@dataclass(frozen=True)
class Settings:
    """What the update takes of the run besides its batch."""
    grpo: grpo.GRPOConfig
    passes: logprobs.Passes = logprobs.Passes()  # how the model runs (micro-batches, chunks, ...)
    max_len: int = 1  # the engine's max_new_tokens: Dr. GRPO's constant normaliser
    grad_clip: float = 0.0  # the gradient norm's bound (optim.grad_clip); 0: none


def settings(g: grpo.GRPOConfig, temperature: float = 1.0, top_p: float = 1.0,
             max_len: int = 1, grad_clip: float = 0.0, pad_id: int = 0, device="cpu",
             shared_prefix: str = "off") -> Settings:
    """The update's settings from the grpo section (its micro-batches and chunks) and what the
    update takes of the rest of the run: the engine's sampling distribution (temperature, top_p)
    and max_new_tokens (max_len), optim.grad_clip, the padding token, the device, and
    grpo.shared_prefix as the actor runs it (`shared_prefix`)."""
    passes = logprobs.Passes(temperature, top_p, g.logprob_chunk, g.micro_batch_tokens, g.pack,
                             pad_id, device, shared_prefix)
    return Settings(g, passes, max_len, grad_clip)


def shared_prefix(actor, cfg) -> str:
    """grpo.shared_prefix as the built actor can run it: "off" where it cannot (the config:
    grpo.sharing_blocker; the model: fsdp_utils.unshared), said once for auto and refused in one
    line for on; else as set."""
    why = grpo.sharing_blocker(cfg) or fsdp_utils.unshared(actor)
    if why and cfg.grpo.shared_prefix == "on":
        grpo.refuse_sharing(why)
    if why and cfg.grpo.shared_prefix == "auto":
        log.info("grpo.shared_prefix=auto: off, as it %s", why)
    return "off" if why else cfg.grpo.shared_prefix


@dataclass
class Result:
    """What an update did: its metrics (tracking.reduce) and each optimizer step's verdict, in
    order: None where it was taken, else what was not finite ("loss" or "grad_norm")."""
    metrics: dict
    skipped: list


def update(actor, opt, batch: batcher.Batch, cfg: Settings) -> Result:
    """grpo.ppo_epochs passes over this rank's samples (`batch`), each split into
    grpo.mini_batches optimizer steps, gradients clipped to cfg.grad_clip (0: off). The metrics:
    entropy, clip_frac, the engine/trainer mismatch, kl with a reference, the mean grad norm and
    loss, trained_tokens and trained_rows (the tokens the passes took, and the output layer's rows
    among them). An optimizer step whose loss or gradient norm is not finite is not taken
    (`nonfinite`), and counted (nonfinite_loss, nonfinite_grad_norm)."""
    opt.zero_grad(set_to_none=True)  # what an update cut short (Ctrl-C) may have left
    g, samples, device = cfg.grpo, batch.samples, cfg.passes.device
    # the sampling policy as the trainer computes it: the pass before the update (off-policy),
    # else the update's own forward
    view = batch.old_logp
    loss_tokens, seen, norms, losses, skipped, forks = 0, 0, [], [], [], []
    clipped, entropy = torch.zeros((), device=device), torch.zeros((), device=device)
    shuffle = torch.Generator().manual_seed(batch.seed)
    router = moe.RouterStats() if moe.routers(actor) else None  # a mixture of experts'
    reselect = g.top_entropy_quantile < 1 and g.ppo_epochs * g.mini_batches > 1
    for epoch in range(g.ppo_epochs):
        for k, part in enumerate(split_mini_batches(len(samples), g.mini_batches, shuffle)):
            mini = batch.of(part)
            if reselect:  # off-policy: this optimizer step's forking tokens, under its policy
                mini = forking_now(actor, mini, cfg, moved=bool(epoch or k))
                forks.append(mini.metrics)
            logp, stats = accumulate_gradients(actor, mini, cfg, router if epoch == 0 else None)
            if view is None:  # on-policy: the one forward (part: every sample, shuffled)
                view = [lp for _, lp in sorted(zip(part, logp), key=lambda x: x[0])]
            clipped += stats["clipped"]
            loss_tokens += sum(samples[i].model_tokens for i in part)
            seen += stats["seen"]
            if epoch == 0:  # entropy of the policy as it meets this rollout
                entropy += stats["entropy"]
            norms.append(fsdp_utils.clip_grad_norm(actor, cfg.grad_clip))
            losses.append(stats["loss"])
            skipped.append(nonfinite(losses[-1], norms[-1]))
            if skipped[-1] is None:  # else no change to the parameters or the optimizer's state
                opt.step()
            opt.zero_grad(set_to_none=True)
    read = torch.stack([clipped, entropy, *norms, *losses]).tolist()  # one read
    sums = {"clipped": read[0], "entropy": read[1], "loss_tokens": loss_tokens, "seen": seen}
    norms, losses = read[2:2 + len(norms)], read[2 + len(norms):]
    out = {**update_metrics(batch, view, g, sums, router),
           **optimizer_metrics(norms, losses, skipped)}
    if forks:  # over the optimizer steps: the model's tokens that kept their gradient, the bar
        out.update(forking_frac=tracking.Mean(sum(m["forking_frac"].total for m in forks),
                                              sum(m["forking_frac"].count for m in forks)),
                   entropy_threshold=tracking.Max(max(m["entropy_threshold"].value
                                                      for m in forks)))
    return Result(out, skipped)


def forking_now(actor, mini: batcher.Batch, cfg: Settings, moved: bool) -> batcher.Batch:
    """Off-policy (more than one optimizer step a rollout), one step's forking tokens, chosen
    as TRL chooses them at every step: grpo.top_entropy_quantile over the entropies of the
    step's own tokens (every rank's) under the policy about to take it. For the first step
    that is the policy before the update (its entropies came with the batch); once the policy
    has `moved`, a pass without gradient over the step's samples takes them again."""
    if moved:
        mini = batcher.old_policy(mini, actor, cfg.passes, keep_logp=False, entropy=True)
    return batcher.forking(mini, cfg.grpo.top_entropy_quantile)


def accumulate_gradients(actor, batch: batcher.Batch, cfg: Settings,
                         router: moe.RouterStats | None = None) -> tuple[list, dict]:
    """Forward/backward this rank's share of one global mini-batch (`batch`); gradients
    accumulate in the parameters' .grad (FSDP2 reduce-scatters them at each backward). Each
    micro-batch's loss is grpo.grpo_loss on its tokens (`objective`), normalised over the global
    mini-batch. A mixture of experts routes by the samples' routing where they carry it
    (moe.routing, forward and backward: a recomputed forward routes alike), its routers' work
    added to `router`. Without batch.old_logp the update is on-policy: the old logprob is this
    forward's own, detached (ratio 1). Returns this forward's logp per sample ((n_i,) CPU
    tensors, read back once) and sums for the metrics: clipped tokens, entropy and the loss,
    0-dim tensors left on the device, and "seen", the tokens its rows held (an int)."""
    g, samples, how = cfg.grpo, batch.samples, cfg.passes
    tokens = float(sum(s.model_tokens for s in samples))
    kept = (tokens if batch.forking is None  # the entropy bonus's tokens
            else float(sum(f.sum() for f in batch.forking)))
    counts = torch.tensor([tokens, float(len(samples)), kept])
    dist.all_reduce(counts)  # the loss is normalised over the global mini-batch
    counts = tuple(x / batch.sp for x in counts.tolist())  # a group's ranks: the same samples
    stats = {k: torch.zeros((), device=how.device) for k in ("clipped", "entropy", "loss")}
    if counts[0] == 0:  # nothing to learn from on any rank (all ranks see the same counts)
        return [torch.zeros(0)] * len(samples), {**stats, "seen": 0}
    actor.train()
    shared = logprobs.sharing(samples, how)  # each group's prompt once in its row
    plan, found, seen = logprobs.micro_batch_plan(samples, how.micro_batch_tokens, how.pack,
                                                  actor.config, batch.split, shared), [], 0
    for k, idx in enumerate(plan):
        part = batch.of(idx) if idx else batch.stand_in()
        mb = logprobs.micro_batch(part.samples, how.pad_id, how.pack, actor.config, batch.split,
                                  shared)
        full = logprobs.to_device(objective(part, mb, cfg, counts), how.device)
        mb = logprobs.to_device(mb, how.device)
        with moe.routing(actor, mb.routing, router if idx else None, mb.real):
            out = logprobs.run(actor, mb, how, this_rank(full, mb, g))
            logprobs.hold_gathered(actor, hold=k < len(plan) - 1)  # FSDP2 units, till the last
            # FSDP averages gradients over ranks; the loss is a global mean: undo the average
            (out["loss"] * (dist.get_world_size() if idx else 0.0)).backward()
        if idx:
            for name in stats:
                stats[name] = stats[name] + out[name].detach()  # in the wider dtype
            found.append((idx, out["logp"], mb.lengths))
            seen += logprobs.row_tokens(part.samples, shared)
    return logprobs.per_sample(found, len(samples)), {**stats, "seen": seen}


def objective(batch: batcher.Batch, mb, cfg: Settings, counts: tuple) -> logprobs.Objective:
    """One micro-batch's loss as the fused pass takes it, on the host, in mb's order: grpo_loss
    and its inputs for each response token (grpo.Tokens) from the batch (its samples'
    per-token advantages, the old and reference logprobs, the forking tokens); with the old
    logprobs, the mismatch weights from them; gspo and luspo on-policy, their sequence ratio 1.
    Beside it, the entropy bonus's weights and a teacher's top k. counts: the global
    mini-batch's (tokens, sequences, tokens that keep a gradient), which the aggregation and
    the entropy bonus divide by."""
    def cat(lists):
        return torch.cat([torch.as_tensor(x, dtype=torch.float32) for x in lists])

    g, teacher = cfg.grpo, batch.teacher
    engine, old, weight, ratio = cat([s.logp for s in batch.samples]), None, None, None
    if batch.old_logp is not None:
        old = cat(batch.old_logp)
        weight = mb.flat(grpo.mismatch_weights(mb.padded(old), mb.padded(engine), mb.mask,
                                               g.is_correction, g.is_cap, g.is_cap_low))
    elif g.policy_loss in grpo.SEQ_RATIO:  # on-policy every sequence's ratio is exactly 1
        ratio = torch.ones_like(engine)
    coef = mb.flat(grpo.loss_weights(mb.mask, g, *counts[:2], cfg.max_len))
    written = mb.flat(mb.mask)
    forking = torch.cat(batch.forking) if batch.forking is not None else None
    bonus = None
    if g.entropy_coef > 0:  # the mean over the tokens that keep a gradient, kept: counts[2]
        bonus = written * (forking if forking is not None else 1) * (g.entropy_coef
                                                                      / max(counts[2], 1))
    tokens = grpo.Tokens(adv=torch.cat(batch.adv), coef=coef, written=written, engine=engine,
                         old=old, is_weight=weight, seq_ratio=ratio, keep=forking,
                         ref=cat(batch.ref_logp) if batch.ref_logp is not None else None)
    return logprobs.Objective(
        functools.partial(grpo.grpo_loss, cfg=g), tokens, entropy_weights=bonus,
        top_ids=torch.cat(teacher.ids) if teacher is not None else None,
        top_logp=torch.cat(teacher.logp) if teacher is not None else None,
        top_coef=coef * teacher.coef if teacher is not None else None)


def this_rank(full: logprobs.Objective, mb, cfg: grpo.GRPOConfig) -> logprobs.Objective:
    """This rank's tokens of the objective (sequence parallel; else all of them), with the
    sequence terms the loss needs from this forward's logprobs first, where it needs any: the
    mismatch weights of on-policy seq modes, gspo's and luspo's sequence ratios off-policy,
    vespo's sequence ratios, the off-policy mask."""
    t, off = full.terms, full.terms.old is not None
    needs = ((not off and cfg.is_correction in grpo.SEQ_IS_MODES)
             or (off and cfg.policy_loss in grpo.SEQ_RATIO) or cfg.off_policy_delta > 0
             or (cfg.policy_loss == "vespo" and (off or cfg.is_correction != "none")))
    part = mb.mine(full)
    if not needs:
        return part
    return dataclasses.replace(part, sequences=functools.partial(
        sequence_terms, t=part.terms, full=t, mb=mb, cfg=cfg))


def sequence_terms(logp, t: grpo.Tokens, full: grpo.Tokens, mb, cfg: grpo.GRPOConfig):
    """The tokens' inputs `t` (this rank's) completed by what each sequence's tokens give
    together under this forward: logp (K,), every token's logprob, detached; full: every
    token's inputs."""
    found = {}

    def mine(x):  # (n, 1) per sequence -> (K_r,) this rank's tokens
        return mb.mine(mb.flat(x.expand_as(mb.mask)))

    if t.old is None and cfg.is_correction in grpo.SEQ_IS_MODES:
        found["is_weight"] = mb.mine(mb.flat(grpo.mismatch_weights(
            mb.padded(logp), mb.padded(full.engine), mb.mask, cfg.is_correction, cfg.is_cap,
            cfg.is_cap_low)))
    if t.old is not None and cfg.policy_loss in grpo.SEQ_RATIO:
        found["seq_ratio"] = mine(grpo.sequence_ratio(mb.padded(logp), mb.padded(full.old),
                                                      mb.mask))
    if cfg.policy_loss == "vespo":  # on-policy the old logprobs are these, the weights new
        old = full.old if full.old is not None else logp
        weight = full.is_weight if full.is_weight is not None else mb.flat(
            grpo.mismatch_weights(mb.padded(logp), mb.padded(full.engine), mb.mask,
                                  cfg.is_correction, cfg.is_cap, cfg.is_cap_low))
        found["seq_log_w"] = mine(grpo.vespo_log_w(mb.padded(logp), mb.padded(old),
                                                   mb.padded(weight), mb.mask))
    if cfg.off_policy_delta > 0:  # a row's tokens carry one advantage: their sum has its sign
        keep = mine(grpo.off_policy_keep(
            mb.padded(logp), mb.padded(full.engine), mb.mask,
            mb.padded(full.adv).sum(1, keepdim=True), cfg.off_policy_delta))
        found["keep"] = keep if t.keep is None else keep * t.keep
    return dataclasses.replace(t, **found)


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


def optimizer_metrics(norms: list, losses: list, skipped: list) -> dict:
    """The optimizer steps' metrics, over the steps taken: the mean grad norm, and the mean loss
    each step minimised (a global mean of which each rank holds the part of its tokens, under
    sequence parallelism too: summed over ranks); the steps not taken, by reason (nonfinite)."""
    taken = [i for i, why in enumerate(skipped) if why is None]
    n = max(len(taken), 1)
    return {"grad_norm": sum(norms[i] for i in taken) / n,
            "loss": tracking.Sum(sum(losses[i] for i in taken) / n),
            **{f"nonfinite_{what}": tracking.Max(skipped.count(what)) for what in NONFINITE}}


def update_metrics(batch: batcher.Batch, old_logp: list, cfg: grpo.GRPOConfig, sums: dict,
                   router) -> dict:
    """`update`'s metrics from its sums (clipped tokens, entropy, the tokens in the loss): the
    policy's entropy, clip_frac, the engine/trainer mismatch (old_logp: the update's own view of
    the sampling policy), kl to the reference, trained_tokens and trained_rows, and a mixture of
    experts' routers (moe.RouterStats). Under sequence parallelism (batch.sp ranks hold the same
    samples) each rank's sums are its own share of the tokens."""
    samples, sp = batch.samples, batch.sp
    tokens, loss_tokens = sum(s.model_tokens for s in samples) / sp, sums["loss_tokens"] / sp
    # the tokens the passes' forwards and backwards saw (a shared prompt once a row), and the
    # rows of the output layer among them (the update's FLOPs: fsdp_utils.flops_per_token)
    seen = sums["seen"] / sp
    rows = cfg.ppo_epochs * sum(len(s.response_ids) for s in samples) / sp
    old_logp = batcher.written(samples, old_logp)  # the metrics below are over the model's tokens
    engine = batcher.written(samples, [s.logp for s in samples])
    out = {"entropy": tracking.Mean(sums["entropy"], tokens),
           "clip_frac": tracking.Mean(sums["clipped"], loss_tokens),
           **mismatch_stats(old_logp, engine, cfg.is_cap),
           **off_policy_stats(old_logp, engine, batch.adv, cfg.off_policy_delta),
           "trained_tokens": tracking.Sum(seen), "trained_rows": tracking.Sum(rows)}
    if batch.ref_logp is not None:
        out["kl"] = tracking.Mean(sum(grpo.kl_penalty(o, r, cfg.kl_estimator).sum().item()
                                      for o, r in zip(old_logp, batcher.written(
                                          samples, batch.ref_logp))) / sp, tokens)
    done = router.totals() if router is not None else {}
    if done:  # the worst rank's worst layer; the others over every position of every rank
        out.update(moe_load_max_mean=tracking.Max(max(done["ratio"])),
                   router_entropy=tracking.Mean(done["entropy"], done["positions"]),
                   routing_differs=tracking.Mean(done["differs"], done["positions"]))
    return out


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
