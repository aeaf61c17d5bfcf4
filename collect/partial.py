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

One loop serves every form (`PartialRollout.collect`: the refill, the staleness drop, the take
and scoring of complete groups, the metrics and a checkpoint's state); what a group is and how it
is generated is a source's: `Streams` for episodes (the rounds above), agents.PartialAgents for
agents that speak OpenAI, whose calls the engine serves as they come (agents.py).
"""

import copy
import dataclasses
import logging
import math
import time
from typing import Protocol

import grpo
import records
import rollout
from tracking import Max, Mean, Sum

log = logging.getLogger("grpo")


class Source(Protocol):
    """What PartialRollout asks of where its groups come from (`Streams`, agents.PartialAgents).
    A group: a list of group_size episodes, the source's own objects."""
    leads: bool  # this rank decides; else it takes the leading rank's answers (agree)
    keeps: bool  # groups are plain data: a checkpoint keeps them, a step run again restarts
    made: int  # the tokens generated in the step so far

    def configure(self, cfg) -> None: ...  # the run's config tree, at setup and changed
    def begin(self, step: int) -> None: ...  # a step's collection starts
    def start(self, examples: list, first: int) -> list: ...  # a group per example, drawn first..
    def done(self, group: list) -> bool: ...  # all its episodes are over
    def oldest(self, group: list, version: int) -> int: ...  # its oldest model token's version
    def drop(self, groups: list) -> None: ...  # they leave, too stale: end what they run
    def generate(self, groups: list, need: int, round_index: int) -> object: ...  # a round
    def generated(self, groups: list) -> records.Generated: ...  # complete groups as samples
    def exhausted(self, groups: list) -> bool: ...  # draws spent: whether these end the step
    def agree(self, answer): ...  # take's answer, the leading rank's, on every rank of the group
    def held(self, groups: list) -> int: ...  # the model tokens they hold
    def state(self, groups: list) -> list: ...  # as a checkpoint keeps them
    def restore(self, states: list) -> list: ...  # back from `state`'s
    def resumed(self, carried: int | None) -> None: ...  # a resume's log line
    def close(self) -> None: ...  # work in flight ended


class PartialRollout:
    """An engine group's groups in flight, carried from step to step (lists of group_size
    episodes, oldest first), and the loop of a step (`collect`): the refill, the staleness drop,
    generation until the step's groups are complete, their scoring as they complete; the
    metrics and a checkpoint's state. How groups start and are generated is its source's
    (`Source`): `Streams` (episodes.EpisodeRunner's episodes, in rounds of engine.stream) or
    agents.PartialAgents (agents whose calls the engine serves). cfg: the run's config tree (its
    rollout.partial and grpo sections); group: the rollout.EngineGroup; prompts[i]: the i-th
    prompt of the shuffled data, of which this engine group takes every group.count-th from its
    index; scorer: rewards.Scorer; scoring: grpo.Scoring, what finished groups are judged by."""

    def __init__(self, cfg, group, prompts, source: Source, scorer, scoring):
        self.group, self.prompts, self.source, self.scorer = group, prompts, source, scorer
        self.configure(cfg, scoring)
        self.groups, self.drawn = [], 0  # in flight; prompts drawn so far
        self.step, self.saved = 0, None  # the step collected last, and the state it began from
        self.counts = {"dropped": 0, "generated": 0}

    def configure(self, cfg, scoring) -> None:
        """The run's config (its rollout.partial and grpo sections) and scoring: at setup, and
        changed between steps (train_grpo.configure), its source's too."""
        self.cfg, self.scoring = cfg.rollout.partial, scoring
        self.share = cfg.grpo.prompts_per_step // self.group.count  # the groups it trains a step
        self.group_size = cfg.grpo.group_size
        self.in_flight = math.ceil(self.share * self.cfg.oversample)
        self.cap = cfg.grpo.max_gen_rounds * (self.in_flight + self.share)  # drawn in a step
        self.source.configure(cfg)

    def collect(self, step: int) -> records.Rollout:
        """Step `step`'s rollout: `share` complete groups (fewer only if the draws ran out), each
        scored as it completes, carried groups first. The engine holds the weights of step - 1
        steps trained. Collecting a step again (the last try never finished: an error, Ctrl-C)
        starts again from the state it began from, where the source's groups are data
        (`keeps`); agents run on instead."""
        if step == self.step and self.source.keeps:
            self.load_state_dict(self.saved)
        self.step, self.saved = step, copy.deepcopy(self.state_dict())
        self.source.begin(step)
        self.drop_stale(step - 1)
        pieces, env, kept, drawn, rounds = [], records.EnvCalls(), 0, 0, 0
        seconds = {"gen": 0.0, "reward": 0.0}
        while True:
            drawn += self.refill(drawn) if self.source.leads else 0
            need, t = self.share - kept, time.perf_counter()
            calls = self.source.generate(self.groups, need, rounds + 1)
            if calls is not None:  # a round ran
                rounds, env = rounds + 1, env + calls
                seconds["gen"] += time.perf_counter() - t
            t = time.perf_counter()
            # a rank that does not lead holds no groups: it gets what the leading rank took
            piece, over = self.source.agree(self.take(need, drawn) if self.source.leads else None)
            if piece is not None:
                rewards = self.scorer.score(piece.texts, piece.examples, piece.failed)
                dropped, keep = grpo.judge(piece, rewards, self.scoring)
                pieces.append((piece, rewards, dropped, keep))
                kept, env = kept + sum(keep), env + piece.env
                seconds["reward"] += time.perf_counter() - t
            if kept >= self.share or over:
                break
        self.counts["generated"] = self.source.made
        return records.Rollout.join(pieces, self.group.per_engine(kept), env, rounds, seconds)

    def drop_stale(self, version: int) -> None:
        """The groups whose oldest token is more than max_staleness versions older than the
        weights `version` leave, whole (counted in partial_dropped)."""
        stale = [g for g in self.groups
                 if version - self.source.oldest(g, version) > self.cfg.max_staleness]
        self.source.drop(stale)
        self.groups = [g for g in self.groups if all(g is not s for s in stale)]
        self.counts = {"dropped": len(stale) * self.group_size, "generated": 0}

    def refill(self, drawn: int) -> int:
        """Fresh groups in the places of those gone, at most cap drawn in a step (`drawn` so
        far), started by the source; returns how many it drew."""
        n = max(0, min(self.in_flight - len(self.groups), self.cap - drawn))
        if n:
            examples = [self.prompts[self.group.index + self.group.count * (self.drawn + k)]
                        for k in range(n)]
            self.groups += self.source.start(examples, self.drawn)
            self.drawn += n
        return n

    def take(self, need: int, drawn: int) -> tuple:
        """The complete groups (at most `need`, oldest first) as one records.Generated (None if
        none), and whether the step ends without more: its draws spent (`drawn` of cap) and the
        groups left as the source's `exhausted` says."""
        take = [g for g in self.groups if self.source.done(g)][:need]
        self.groups = [g for g in self.groups if all(g is not t for t in take)]
        piece = self.source.generated(take) if take else None
        return piece, drawn >= self.cap and self.source.exhausted(self.groups)

    def state_dict(self) -> dict:
        return {"engine": (self.group.index, self.group.count), "drawn": self.drawn,
                "groups": self.source.state(self.groups)}

    def resume(self, state: dict | None, step: int) -> None:
        """The data position and the groups a checkpoint of `step` carried (its rank's state,
        from checkpoint.load_checkpoint), if it was saved with as many engine groups; the
        source's log line says what goes on."""
        self.step, self.saved = step, None
        carry = (state or {}).get("carry")
        mine = carry is not None and tuple(carry["engine"]) == (self.group.index,
                                                                self.group.count)
        if mine:
            self.load_state_dict(carry)
        self.source.resumed(len(self.groups) if mine else None)

    def load_state_dict(self, state: dict) -> None:
        self.drawn = state["drawn"]
        self.groups = self.source.restore(state["groups"])

    def metrics(self, trained: list, version: int) -> dict:
        """The step's partial-rollout metrics (tracking.reduce): the samples and tokens carried
        to the next step, those dropped as too stale, the tokens generated (counted once per
        engine group), and over this rank's `trained` samples: the staleness of each (versions
        between its oldest token and the weights trained) and the share of stale tokens."""
        carried = sum(len(g) for g in self.groups)
        return metrics(trained, version, int(self.group.first), carried,
                       self.source.held(self.groups), self.counts)

    def close(self) -> None:
        """The source's work in flight ended (agents: their calls answered, their jobs joined)."""
        self.source.close()


class Streams:
    """PartialRollout's source for episodes.EpisodeRunner's episodes: each turn a request of
    engine.stream, generated in rounds. Every rank of an engine group makes the same decisions
    from the same outputs (`leads`), and an episode is plain data that a checkpoint keeps and a
    step run again starts from (`keeps`). cfg: the run's config tree; group: the
    rollout.EngineGroup; runner: the episodes.EpisodeRunner."""

    leads, keeps = True, True

    def __init__(self, cfg, group, engine, runner):
        self.group, self.engine, self.runner = group, engine, runner
        self.configure(cfg)
        self.step, self.made = 0, 0  # the step being collected; the tokens it generated

    def configure(self, cfg) -> None:
        self.cfg, self.group_size = cfg.rollout.partial, cfg.grpo.group_size
        self.seed = cfg.rollout.seed if cfg.rollout.seed_per_step else None

    def begin(self, step: int) -> None:
        self.step, self.made = step, 0

    def start(self, examples: list[dict], first: int) -> list:
        """A group of fresh episodes per example (drawn `first`, first + 1, ...)."""
        return [[self.runner.start(example) for _ in range(self.group_size)]
                for example in examples]

    def done(self, group: list) -> bool:
        return all(e.over for e in group)

    def oldest(self, group: list, version: int) -> int:
        """The oldest weights version among the model tokens the episodes of `group` hold (their
        turns, and the turn each is writing); `version` when they hold none."""
        found = [v for e in group for v, m in zip(e.versions, e.mask) if m]
        found += [v for e in group if e.pending for v in e.pending[2]]
        return min(found, default=version)

    def drop(self, groups: list) -> None:
        """Nothing of theirs runs between rounds: they are left as they are."""

    def generate(self, groups: list, need: int, round_index: int) -> records.EnvCalls | None:
        """Round `round_index` of the step, unless `need` groups are complete or no episode is
        live: one engine call for every live episode's turn, at most round_tokens of it, or with
        no budget, stopped as soon as `need` groups have no turn left to write; then the
        environment answers the turns that ended. Returns its calls' counts, None when no round
        ran."""
        live = [e for g in groups for e in g if not e.over]
        if not live or sum(self.done(g) for g in groups) >= need:
            return None
        seed = None if self.seed is None else rollout.seed_from(
            self.seed, self.step, self.group.index, round_index)
        budget = self.cfg.round_tokens or math.inf
        limits = [e.limit - len(e.pending[0]) for e in live]
        asks = [min(m, budget) for m in limits]
        group = {id(e): k for k, g in enumerate(groups) for e in g}
        writing = {}  # group -> its episodes whose turn goes on
        for e in live:
            writing[group[id(e)]] = writing.get(group[id(e)], 0) + 1
        out = [len(groups) - len(writing)]  # groups with no turn left to write

        def stop(i: int, how: str) -> bool:
            if how == "stop" or asks[i] == limits[i]:  # its turn is over
                writing[group[id(live[i])]] -= 1
                out[0] += writing[group[id(live[i])]] == 0
            return out[0] >= need

        outs = self.engine.stream([e.prompt_ids + e.ids + e.pending[0] for e in live], asks,
                                  seed, stop=None if self.cfg.round_tokens else stop)
        ended = []
        for e, (ids, logp, how) in zip(live, outs):
            self.made += len(ids)
            if self.runner.advance(e, ids, logp, how, self.step - 1):
                ended.append(e)
        return self.runner.respond(ended)[1]

    def generated(self, groups: list) -> records.Generated:
        return self.runner.finish([e for g in groups for e in g], records.EnvCalls(), True)

    def exhausted(self, groups: list) -> bool:
        """With the step's draws spent, whether `groups` end it: none has a turn to write."""
        return all(self.done(g) for g in groups)

    def agree(self, answer):
        return answer  # every rank took the same

    def held(self, groups: list) -> int:
        """The model tokens the episodes of `groups` hold, the turns they are writing included."""
        return sum(sum(e.mask) + len(e.pending[0] if e.pending else ())
                   for g in groups for e in g)

    def state(self, groups: list) -> list:
        return [[e.state() for e in g] for g in groups]

    def restore(self, states: list) -> list:
        return [[self.runner.restore(copy.deepcopy(s)) for s in g] for g in states]

    def resumed(self, carried: int | None) -> None:
        """The log line of a resume: `carried` groups restored, None if the checkpoint had none
        for this engine group."""
        if carried is None:
            log.warning("partial rollout: the checkpoint holds no carried groups for engine group "
                        "%d of %d (saved without partial rollout, or with other engine groups): "
                        "starting with none", self.group.index, self.group.count)
        else:
            log.info("partial rollout: resumed %d carried groups", carried)

    def close(self) -> None:
        """Nothing runs between steps."""


def metrics(trained: list, version: int, first: int, carried: int, held: int,
            counts: dict) -> dict:
    """PartialRollout.metrics' numbers: `carried` samples holding `held` model tokens go on to
    the next step; counts: "dropped" and "generated" this step; `first`: 1 on an engine group's
    first rank, which counts the group's numbers once."""
    ages = [age(s, version) for s in trained]
    written = [v for s in trained for v, m in zip(s.versions, s.mask or [1] * len(s.versions))
               if m]
    return {"partial_carried": Sum(first * carried), "partial_carried_tokens": Sum(first * held),
            "partial_dropped": Sum(first * counts["dropped"]),
            "gen_tokens": Sum(first * counts["generated"]),
            "stale_mean": Mean(sum(ages), len(ages)), "stale_max": Max(max(ages, default=0)),
            "stale_token_frac": Mean(sum(v < version for v in written), len(written))}


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
