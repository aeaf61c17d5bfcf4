"""The batch the update trains on: a scored rollout, this rank's share of it, through each
feature's transform.

`Batcher.build(ro, scored, step)` takes the samples grpo.score chose (scored.trained: this
engine group's) and returns one grpo.Batch: this rank's samples, each one's advantage at every
response token, the seed of the mini-batches' shuffle, and what the features added. It starts
from `share` and then applies the run's transforms in order, each a function batch -> batch that
returns a new batch (train_grpo.batch_transforms composes them once, at setup):
1. share: this rank's slice of its engine group's samples (each rank of an engine group holds the
   same rollout); an agent's episode brings its earlier samples (records.with_earlier), each
   trained with the episode's advantage;
2. stale tokens (partial.stale_tokens, with rollout.partial.stale mask): a token an older
   version wrote gets no loss;
3. the sequence-parallel gather (seq_parallel.gather_batch, with model.sp_size > 1): the group's
   ranks train the union of their shares, each 1/sp of every packed row;
4. the teacher's signal (distill.teach, with distill.teacher): its pass over the samples,
   per-token advantages and its top k.
A new transform is one more function in that list.
"""

import torch

import grpo
import records
import rollout


def share(ro, scored, group, step: int, seed: int) -> grpo.Batch:
    """This rank's samples of the rollout `ro` (records.Rollout) that `scored` (grpo.Scored)
    trains: every group.size-th from its tp_rank (rollout.EngineGroup), an agent's earlier
    samples before each, and their advantages as fp32 per response token."""
    mine = scored.trained[group.tp_rank::group.size]
    samples, adv = records.with_earlier([ro.samples[i] for i in mine],
                                        torch.tensor(scored.adv)[mine])
    return grpo.Batch.per_sample(samples, adv, seed, step=step)


class Batcher:
    """Builds each step's grpo.Batch: `share`, then `transforms` in order (module docstring).
    group: this rank's rollout.EngineGroup; seed: train.seed, of which each step's shuffle seed
    comes (rollout.seed_from, with the step and this rank)."""

    def __init__(self, group, seed: int, rank: int, transforms: list):
        self.group, self.seed, self.rank, self.transforms = group, seed, rank, transforms

    def build(self, ro, scored, step: int) -> grpo.Batch:
        batch = share(ro, scored, self.group, step, rollout.seed_from(self.seed, step, self.rank))
        for transform in self.transforms:
            batch = transform(batch)
        return batch
