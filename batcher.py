"""The batch the update trains on: a scored rollout, this rank's share of it, through each
feature's transform.

`Batcher.build(ro, scored, step)` takes the samples grpo.score chose (scored.trained: this
engine group's) and returns one `Batch`: this rank's samples, each one's advantage at every
response token, the seed of the mini-batches' shuffle, and what the transforms added. It starts
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
   per-token advantages and its top k;
5. the passes without gradient the update's config needs, each over the batch's samples:
   `old_policy` (their logprobs before the update, off-policy, and each token's entropy for
   forking), `forking` (the tokens that keep their policy gradient), `reference` (the frozen
   reference's logprobs, for the KL term).
A new transform is one more function in that list. Those with a pass run FSDP collectives:
every rank applies them.
"""

import dataclasses
import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import fsdp_utils
import logprobs
import records
import rollout
import tracking


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
    """What the update trains on: this rank's samples of a scored rollout and what each
    transform added to them, per sample where it is a list (`of` slices them all)."""
    samples: list  # records.Sample (or any object with its fields)
    adv: list  # per sample, its (n_i,) advantage at each response token
    seed: int  # the mini-batches' shuffle; every rank of a sequence-parallel group the same
    step: int = 0  # the step that trains it (the weights version step - 1 sampled it)
    teacher: TeacherTopK | None = None  # a teacher's top k, for the forward KL term
    split: object = None  # seq_parallel.Split: the group whose ranks train these same samples,
    #   each 1/sp of every packed row's tokens; None: no sequence parallelism
    metrics: dict = field(default_factory=dict)  # the transforms' own (their passes' seconds)
    # per sample (n_i,), the policy before the update (old_policy): its logprobs, off-policy
    #   (None: on-policy, the update's own forward is it), and its entropy at each token
    old_logp: list | None = None
    entropy: list | None = None
    # grpo.top_entropy_quantile: per sample, 1 at the response tokens that keep their policy
    #   gradient (`forking`); None: every token
    forking: list | None = None
    ref_logp: list | None = None  # per sample (n_i,): the frozen reference's (`reference`)

    @classmethod
    def per_sample(cls, samples: list, adv: torch.Tensor, seed: int, **fields) -> "Batch":
        """A batch whose samples each have one advantage, adv (n,), laid out at every one of
        their response tokens in fp32; `fields`: the others (step, teacher, split)."""
        return cls(samples, [a.float().expand(len(s.response_ids)).clone()
                             for s, a in zip(samples, adv)], seed, **fields)

    def of(self, idx: list) -> "Batch":
        """The samples idx, with what they carry."""
        def pick(values):
            return None if values is None else [values[i] for i in idx]

        return dataclasses.replace(
            self, samples=pick(self.samples), adv=pick(self.adv), old_logp=pick(self.old_logp),
            entropy=pick(self.entropy), forking=pick(self.forking), ref_logp=pick(self.ref_logp),
            teacher=self.teacher.of(idx) if self.teacher is not None else None)

    def stand_in(self) -> "Batch":
        """One zero-loss sample (logprobs.DUMMY) with the logprobs this batch carries: the
        forward a rank runs when it has no sample for a micro-batch every rank runs."""
        def zero(values):
            return None if values is None else [torch.zeros(1)]

        return Batch([logprobs.DUMMY], [torch.zeros(1)], self.seed,
                     old_logp=zero(self.old_logp), ref_logp=zero(self.ref_logp))

    @property
    def sp(self) -> int:
        """The ranks that hold these same samples, each summing its own share of the tokens."""
        return self.split.size if self.split is not None else 1


def share(ro, scored, group, step: int, seed: int) -> Batch:
    """This rank's samples of the rollout `ro` (records.Rollout) that `scored` (grpo.Scored)
    trains: every group.size-th from its tp_rank (rollout.EngineGroup), an agent's earlier
    samples before each, and their advantages as fp32 per response token."""
    mine = scored.trained[group.tp_rank::group.size]
    samples, adv = records.with_earlier([ro.samples[i] for i in mine],
                                        torch.tensor(scored.adv)[mine])
    return Batch.per_sample(samples, adv, seed, step=step)


class Batcher:
    """Builds each step's Batch: `share`, then `transforms` in order (module docstring).
    group: this rank's rollout.EngineGroup; seed: train.seed, of which each step's shuffle seed
    comes (rollout.seed_from, with the step and this rank)."""

    def __init__(self, group, seed: int, rank: int, transforms: list):
        self.group, self.seed, self.rank, self.transforms = group, seed, rank, transforms

    def build(self, ro, scored, step: int) -> Batch:
        batch = share(ro, scored, self.group, step, rollout.seed_from(self.seed, step, self.rank))
        for transform in self.transforms:
            batch = transform(batch)
        return batch


# ----------------------------------------------------------------------------------------------
# the passes without gradient: their results are fields of the batch


def timed(batch: Batch, started: float, **fields) -> Batch:
    """`batch` with `fields`, its logprobs_time_s grown by the seconds since `started`."""
    seconds = batch.metrics.get("logprobs_time_s", 0.0) + time.perf_counter() - started
    return dataclasses.replace(batch, metrics={**batch.metrics, "logprobs_time_s": seconds},
                               **fields)


def old_policy(batch: Batch, actor, passes: logprobs.Passes, keep_logp: bool,
               entropy: bool) -> Batch:
    """A batch transform: the actor before the update over the batch's samples, in one pass
    without gradient (a mixture of experts routed as the engine routed them): with keep_logp
    their logprobs (old_logp: off-policy, grpo.ppo_epochs or mini_batches > 1, every optimizer
    step's ratio is to them), with entropy each token's entropy (for `forking`). The update
    takes the entropies again this way before each optimizer step but the first, off-policy
    (trainer.forking_now)."""
    t = time.perf_counter()
    found = logprobs.sample_pass(actor, batch.samples, passes, entropy=entropy, replay=True,
                                 split=batch.split)
    return timed(batch, t, old_logp=found["logp"] if keep_logp else batch.old_logp,
                 entropy=found.get("entropy"))


def forking(batch: Batch, rho: float) -> Batch:
    """A batch transform, after old_policy, on-policy (off-policy the update chooses them for
    each optimizer step: trainer.forking_now): the forking tokens (`forking_tokens`) of the
    batch's entropies, and their metrics: forking_frac, the share of the model's tokens that
    keep their gradient, and entropy_threshold, the bar."""
    keep, threshold = forking_tokens(batch.samples, batch.entropy, rho, batch.split)
    tokens = sum(s.model_tokens for s in batch.samples) / batch.sp
    metrics = {**batch.metrics, "entropy_threshold": tracking.Max(threshold),
               "forking_frac": tracking.Mean(sum(float(k.sum()) for k in keep) / batch.sp,
                                             tokens)}
    return dataclasses.replace(batch, forking=keep, metrics=metrics)


def reference(batch: Batch, ref, passes: logprobs.Passes) -> Batch:
    """A batch transform: the frozen reference's logprobs of the batch's samples (ref_logp, for
    grpo.kl_coef's term), in one pass without gradient; the reference comes out of host memory
    for it, or is the actor's base with adapters (fsdp_utils.reference)."""
    t = time.perf_counter()
    with fsdp_utils.reference(ref):
        ref_logp = logprobs.sample_logprobs(ref, batch.samples, passes, split=batch.split)
    return timed(batch, t, ref_logp=ref_logp)


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
