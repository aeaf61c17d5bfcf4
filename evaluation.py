"""Evaluation on held-out prompts: greedy pass@1 and, with log.eval_k, mean@k at the rollout
temperature, each engine group taking a slice of the examples. It never sees partial rollout's
carried samples (partial.py): a fresh engine call of its own, between two steps.
"""

import torch

import records
import tracking
from tracking import Mean


def due(cfg, step: int, steps: int) -> bool:
    """Whether step `step` of a run of `steps` ends with an eval (cfg: the log section): every
    log.eval_every steps, and the last step."""
    return bool(cfg.eval_every) and (step % cfg.eval_every == 0 or step == steps)


@torch.no_grad()
def run(turn, sampler, examples, k: int = 0):
    """Greedy pass@1 (the mean reward of one greedy completion, or episode, per example) and,
    with k > 0, mean@k (the mean reward of k at the rollout temperature) over all examples,
    each engine group taking a slice, in an engine turn of its own (`turn`,
    weight_sync.EngineTurn: the update since the rollout pushed first). sampler: the run's
    sampler.Sampler, which plays the episodes and scores them. Returns ({"eval_pass1": ..,
    "eval_mean_at_k": ..}, (examples, greedy completions, their rewards)) of this rank's slice."""
    group = sampler.group
    part = examples[group.index::group.count]
    with turn:
        runs = [sampler.play(part, 1, greedy=True)] + ([sampler.play(part, k)] if k else [])
    texts, rows = [t for r in runs for t in r.texts], [x for r in runs for x in r.examples]
    failed = [f for r in runs for f in r.failed]
    scores = sampler.rewards(texts, rows, failed)
    first, n = int(group.first), len(part)  # each engine group's scores counted once
    out = tracking.reduce({"eval_pass1": Mean(sum(scores[:n]) * first, n * first),
                           "eval_mean_at_k": Mean(sum(scores[n:]) * first, n * k * first)})
    if not k:
        del out["eval_mean_at_k"]
    return out, (part, records.shown(rows[:n], texts[:n]), scores[:n])
