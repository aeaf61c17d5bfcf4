"""Evaluation on held-out prompts: greedy pass@1 and, with log.eval_k, mean@k at the rollout
temperature, each engine group taking a slice of the examples. It never sees partial rollout's
carried samples (partial.py): a fresh engine call of its own, between two steps.
"""

import torch
import torch.distributed as dist

import tracking
import weight_sync
from tracking import Mean


@torch.no_grad()
def run(switch, examples, scorer, eps, engine_idx, n_engines, k: int = 0):
    """Greedy pass@1 (the mean reward of one greedy completion, or episode, per example) and,
    with k > 0, mean@k (the mean reward of k at the rollout temperature) over all examples,
    each engine group taking a slice; `eps` runs them (episodes.Episodes). Returns
    ({"eval_pass1": .., "eval_mean_at_k": ..}, (examples, greedy completions, their rewards))
    of this rank's slice. The engine (switch.engine) holds the weights of this step's rollout:
    the update since then is synced first, in a turn of the engine guarded as a rollout's is
    (offload.Switch: the actor and its optimizer state out of device memory meanwhile)."""
    engine = switch.engine
    with switch.engine_turn():
        weight_sync.push(switch.actor, engine, before_weights=switch.optimizer_out,
                         before_kv_cache=switch.actor_out)
        part = examples[engine_idx::n_engines]
        greedy = eps.run(engine, part, 1, greedy=True)
        if k:
            greedy.extend(eps.run(engine, part, k))
        engine.sleep()
    scores = scorer.score(greedy.texts, greedy.examples, greedy.failed)["reward"]
    # every rank of a tensor-parallel group holds the same scores: count only its first rank
    first = dist.get_rank() % (dist.get_world_size() // n_engines) == 0
    n = len(part)
    out = tracking.reduce({"eval_pass1": Mean(sum(scores[:n]) * first, n * first),
                           "eval_mean_at_k": Mean(sum(scores[n:]) * first, n * k * first)})
    if not k:
        del out["eval_mean_at_k"]
    return out, (part, greedy.completions()[:n], scores[:n])
