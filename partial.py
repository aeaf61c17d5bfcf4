"""Partial rollout: a step stops waiting for its longest response.

In a synchronous step every sample waits for the slowest one, and decoding a long tail runs the
engine at a batch of a few sequences while the rest of the device waits. With
`rollout.partial.enabled`, each engine group keeps groups in flight from step to step
(`PartialRollout`) and a step's generation stops early, by one rule or both:
- a token budget per round (`round_tokens`): a sample writes at most that many tokens a round;
  after each round the complete groups leave, fresh ones take their places, and the step ends
  at the first round's end at which its share is complete. Every carried sample writes a whole
  round's budget each step, so it is done within ceil(max_new_tokens / round_tokens) steps (a
  turn's limit, in an episode): staleness stays bounded;
- over-sampling (`oversample` > 1): ceil(oversample x the engine group's share of
  grpo.prompts_per_step) groups in flight. With no round budget, generation stops the moment
  the share is complete and the requests still running are aborted where they are: the
  shortest wait, but a long sample moves on only while the short ones of a step run, so it can
  starve over many steps (max_staleness then drops it, and with it a long answer). With a
  round budget, the groups in flight are more, and the stop waits for the round's end.
An unfinished sample keeps its tokens, the engine's logprob of each and the weights version that
wrote each (records.Sample.versions: the number of steps trained); the next step continues it
first, as its prompt and tokens so far with the room left, under the new weights. A group is
trained once all its samples are done, and each engine group trains its share of complete
groups, as without partial rollout.

A token written by older weights is off-policy. The importance correction against the engine's
logprobs (grpo.is_correction) covers it as it covers the engine/trainer gap; `stale: mask` gives
it no loss instead; a group whose oldest token is more than `max_staleness` versions old at the
start of a step is dropped (counted in partial_dropped): whole, because leaving out only its
long samples would bias the group's advantages against long answers.

Multi-turn episodes go on too: a turn can stop at a round's end and continue in a later one,
and the environment answers it once it is over (episodes.EpisodeRunner does both). With dynamic
sampling, a complete group whose rewards are all equal does not count towards the share and a
fresh one takes its place: at most grpo.max_gen_rounds x (groups in flight + share) are drawn
in a step. With tensor parallelism every rank of an engine group makes the same decisions from
the same outputs and carries the same groups. A checkpoint keeps each rank's carried groups
(state_dict); eval never sees them. Each engine group draws its own prompts from the shuffled
data (every group.count-th, from its index), so the groups need not wait for each other.
"""

import copy
import dataclasses
import logging
import math
import time

import records
import rollout
from tracking import Max, Mean, Sum

log = logging.getLogger("grpo")


class PartialRollout:
    """An engine group's groups in flight, carried from step to step (lists of group_size
    episodes.Episode, oldest first), and the rounds of a step (`collect`). cfg: the run's config
    tree (its rollout.partial, rollout and grpo sections); group: the rollout.EngineGroup;
    prompts[i]: the i-th prompt of the shuffled data, of which this engine group takes every
    group.count-th from its index; runner: the episodes.EpisodeRunner; score(generated) ->
    (records.Rewards, keep per group): the sampler's scoring of finished groups."""

    def __init__(self, cfg, group, prompts, engine, runner, score):
        self.cfg, self.group, self.prompts = cfg.rollout.partial, group, prompts
        self.engine, self.runner, self.score = engine, runner, score
        self.seed = cfg.rollout.seed if cfg.rollout.seed_per_step else None
        self.share = cfg.grpo.prompts_per_step // group.count  # the groups it trains a step
        self.group_size = cfg.grpo.group_size
        self.in_flight = math.ceil(self.share * self.cfg.oversample)
        self.cap = cfg.grpo.max_gen_rounds * (self.in_flight + self.share)  # drawn in a step
        self.groups, self.drawn = [], 0  # in flight; prompts drawn so far
        self.step, self.saved = 0, None  # the step collected last, and the state it began from
        self.counts = {"dropped": 0, "generated": 0}

    def collect(self, step: int) -> records.Rollout:
        """Step `step`'s rollout: `share` complete groups (fewer only if the draws ran out), each
        scored as it completes, carried groups first. The engine holds the weights of step - 1
        steps trained. Collecting a step again (the last try never finished: an error, Ctrl-C)
        starts again from the state it began from."""
        if step == self.step:
            self.load_state_dict(self.saved)
        self.step, self.saved = step, copy.deepcopy(self.state_dict())
        version = step - 1
        stale = [g for g in self.groups if version - oldest(g, version) > self.cfg.max_staleness]
        self.groups = [g for g in self.groups if all(g is not s for s in stale)]
        self.counts = {"dropped": len(stale) * self.group_size, "generated": 0}
        pieces, env, kept, drawn, rounds = [], records.EnvCalls(), 0, 0, 0
        seconds = {"gen": 0.0, "reward": 0.0}
        while True:
            drawn += self.refill(drawn)
            need = self.share - kept
            live = [e for g in self.groups for e in g if not e.over]
            if live and sum(done(g) for g in self.groups) < need:
                t, rounds = time.perf_counter(), rounds + 1
                seed = None if self.seed is None else rollout.seed_from(
                    self.seed, step, self.group.index, rounds)
                env += self.round(live, need, version, seed)
                seconds["gen"] += time.perf_counter() - t
            take = [g for g in self.groups if done(g)][:need]
            self.groups = [g for g in self.groups if all(g is not t for t in take)]
            if take:
                t = time.perf_counter()
                piece = self.runner.finish([e for g in take for e in g], records.EnvCalls(), True)
                rewards, keep = self.score(piece)
                pieces.append((piece, rewards, keep))
                kept += sum(keep)
                seconds["reward"] += time.perf_counter() - t
            if kept >= self.share or (drawn >= self.cap and all(done(g) for g in self.groups)):
                break
        return records.Rollout.join(pieces, self.group.per_engine(kept), env, rounds, seconds)

    def refill(self, drawn: int) -> int:
        """Fresh groups in the places of those gone, at most cap drawn in a step (`drawn` so
        far); returns how many it drew."""
        n = 0
        while len(self.groups) < self.in_flight and drawn + n < self.cap:
            example = self.prompts[self.group.index + self.group.count * self.drawn]
            self.groups.append([self.runner.start(example) for _ in range(self.group_size)])
            self.drawn, n = self.drawn + 1, n + 1
        return n

    def round(self, live: list, need: int, version: int, seed) -> records.EnvCalls:
        """One engine call for every live episode's turn: at most round_tokens of it, or with no
        budget, stopped as soon as `need` groups have no turn left to write; then the
        environment answers the turns that ended. Returns its calls' counts."""
        budget = self.cfg.round_tokens or math.inf
        limits = [e.limit - len(e.pending[0]) for e in live]
        asks = [min(m, budget) for m in limits]
        group = {id(e): k for k, g in enumerate(self.groups) for e in g}
        writing = {}  # group -> its episodes whose turn goes on
        for e in live:
            writing[group[id(e)]] = writing.get(group[id(e)], 0) + 1
        out = [len(self.groups) - len(writing)]  # groups with no turn left to write

        def stop(i: int, how: str) -> bool:
            if how == "stop" or asks[i] == limits[i]:  # its turn is over
                writing[group[id(live[i])]] -= 1
                out[0] += writing[group[id(live[i])]] == 0
            return out[0] >= need

        outs = self.engine.stream([e.prompt_ids + e.ids + e.pending[0] for e in live], asks,
                                  seed, stop=None if self.cfg.round_tokens else stop)
        ended = []
        for e, (ids, logp, how) in zip(live, outs):
            self.counts["generated"] += len(ids)
            if self.runner.advance(e, ids, logp, how, version):
                ended.append(e)
        return self.runner.respond(ended)[1]

    def state_dict(self) -> dict:
        return {"engine": (self.group.index, self.group.count), "drawn": self.drawn,
                "groups": [[e.state() for e in g] for g in self.groups]}

    def resume(self, state: dict | None, step: int) -> None:
        """The groups a checkpoint of `step` carried (its rank's state, from
        checkpoint.load_checkpoint), if it was saved with as many engine groups; else none, and
        the log says so."""
        self.step, self.saved = step, None
        carry = (state or {}).get("carry")
        if carry is None or tuple(carry["engine"]) != (self.group.index, self.group.count):
            log.warning("partial rollout: the checkpoint holds no carried groups for engine group "
                        "%d of %d (saved without partial rollout, or with other engine groups): "
                        "starting with none", self.group.index, self.group.count)
            return
        self.load_state_dict(carry)
        log.info("partial rollout: resumed %d carried groups", len(self.groups))

    def load_state_dict(self, state: dict) -> None:
        self.drawn = state["drawn"]
        self.groups = [[self.runner.restore(copy.deepcopy(s)) for s in g]
                       for g in state["groups"]]

    def metrics(self, trained: list, version: int) -> dict:
        """The step's partial-rollout metrics (tracking.reduce): the samples and tokens carried
        to the next step, those dropped as too stale, the tokens generated (counted once per
        engine group), and over this rank's `trained` samples: the staleness of each (versions
        between its oldest token and the weights trained) and the share of stale tokens."""
        carried = [e for g in self.groups for e in g]
        held = sum(sum(e.mask) + len(e.pending[0] if e.pending else ()) for e in carried)
        return metrics(trained, version, int(self.group.first), len(carried), held, self.counts)


def metrics(trained: list, version: int, first: int, carried: int, held: int,
            counts: dict) -> dict:
    """PartialRollout.metrics' numbers (agents.PartialAgents' too): `carried` samples holding
    `held` model tokens go on to the next step; counts: "dropped" and "generated" this step;
    `first`: 1 on an engine group's first rank, which counts the group's numbers once."""
    ages = [age(s, version) for s in trained]
    written = [v for s in trained for v, m in zip(s.versions, s.mask or [1] * len(s.versions))
               if m]
    return {"partial_carried": Sum(first * carried), "partial_carried_tokens": Sum(first * held),
            "partial_dropped": Sum(first * counts["dropped"]),
            "gen_tokens": Sum(first * counts["generated"]),
            "stale_mean": Mean(sum(ages), len(ages)), "stale_max": Max(max(ages, default=0)),
            "stale_token_frac": Mean(sum(v < version for v in written), len(written))}


def done(group: list) -> bool:
    return all(e.over for e in group)


def oldest(group: list, version: int) -> int:
    """The oldest weights version among the model tokens the episodes of `group` hold (their
    turns, and the turn each is writing); `version` when they hold none."""
    found = [v for e in group for v, m in zip(e.versions, e.mask) if m]
    found += [v for e in group if e.pending for v in e.pending[2]]
    return min(found, default=version)


def age(sample, version: int) -> int:
    """Versions between a sample's oldest model token and the weights `version`."""
    mask = sample.mask or [1] * len(sample.versions)
    return version - min((v for v, m in zip(sample.versions, mask) if m), default=version)


def for_update(samples: list, version: int, stale: str) -> list:
    """The samples as the update sees them: with stale "mask", a token written by older weights
    (versions < version) gets mask 0, so no loss, no importance weight, no KL."""
    if stale == "keep":
        return samples
    return [s if s.versions is None else dataclasses.replace(s, mask=[
        int(m and v == version) for m, v in zip(s.mask or [1] * len(s.versions), s.versions)])
        for s in samples]


def stale_tokens(batch, stale: str):
    """A batch transform (batcher.py): its samples as `for_update` leaves them, against the
    weights version that sampled the step (batch.step - 1)."""
    return dataclasses.replace(batch, samples=for_update(batch.samples, batch.step - 1, stale))
