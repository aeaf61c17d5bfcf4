"""A step's rollout, collected in one call: `Sampler.collect(step)`.

The sampler holds what a rollout needs: the engine, the episodes (episodes.EpisodeRunner), the
reward functions (rewards.Scorer) and the shuffled prompts. It collects in one of two forms,
behind the same call:
- rounds (the default): this engine group's slice of grpo.prompts_per_step prompts, G episodes
  each, played to their end; with dynamic sampling (DAPO), fresh prompts in further rounds until
  the engine groups together kept prompts_per_step groups with signal, at most
  grpo.max_gen_rounds rounds;
- partial rollout (rollout.partial.enabled): partial.PartialRollout, which carries unfinished
  samples from step to step and stops a step's generation early, its groups episodes in rounds
  (partial.Streams) or, with env.kind agent, agents whose calls are carried
  (agents.PartialAgents).
Either way it scores each finished group as it comes (its rewards, and grpo.judge: which samples
drop out and whether it may train) and returns one records.Rollout, made in one place
(records.Rollout.join).

The two forms stay apart: the rounds generate the G samples of a prompt as one request of n=G
(engine.generate), whose samples differ from G requests of one (engine.stream), so that one form
for both would change every default run's samples.

A step collected again (its last try raised: a reward, Ctrl-C) draws the same prompts: the data
position moves on only when a later step begins (or partial rollout's state, likewise).
"""

import copy
import time

import torch

from collect import agents, partial
import grpo
import records
import rollout
import tracking
from tracking import Mean


class Sampler:
    """cfg: the run's config tree; engine: rollout.Engine; runner: episodes.EpisodeRunner; scorer:
    rewards.Scorer; prompts: data.Shuffled (prompts[i], the i-th drawn); group:
    rollout.EngineGroup; scoring: grpo.Scoring, what a finished group is judged by."""

    def __init__(self, cfg, engine, runner, scorer, prompts, group, scoring):
        self.cfg, self.engine, self.runner, self.scorer = cfg, engine, runner, scorer
        self.prompts, self.group, self.scoring = prompts, group, scoring
        self.step, self.start, self.drawn = 0, 0, 0  # the step collected last; data positions
        self.partial = None
        if cfg.rollout.partial.enabled:
            kind = agents.PartialAgents if cfg.env.kind == "agent" else partial.Streams
            self.partial = partial.PartialRollout(cfg, group, prompts,
                                                  kind(cfg, group, engine, runner), scorer,
                                                  scoring)

    def collect(self, step: int) -> records.Rollout:
        """Step `step`'s rollout (module docstring)."""
        # the ranks of an engine must sample alike, and vLLM draws from torch's default generator
        # where a request has no seed: every rank's the same again, whatever each drew since
        # (rank 0 alone draws LoRA's initial adapters; dropout draws per token it trains)
        torch.manual_seed(rollout.seed_from(self.cfg.rollout.seed, step, self.group.index))
        if self.partial is not None:
            return self.partial.collect(step)
        if step != self.step:  # a new step: the last one went through
            self.step, self.start = step, self.drawn
        g = self.cfg.grpo
        per_engine = g.prompts_per_step // self.group.count
        pieces, seconds, drawn = [], {"gen": 0.0, "reward": 0.0}, self.start
        while True:
            first = drawn + self.group.index * per_engine  # each engine group its own slice
            batch = [self.prompts[first + i] for i in range(per_engine)]
            drawn += g.prompts_per_step
            seed = (rollout.seed_from(self.cfg.rollout.seed, step, self.group.index,
                                      len(pieces) + 1) if self.cfg.rollout.seed_per_step else None)
            t = time.perf_counter()
            with torch.profiler.record_function("step:generate"):
                generated = self.runner.run(self.engine, batch, g.group_size, seed=seed)
            seconds["gen"] += time.perf_counter() - t
            t = time.perf_counter()
            with torch.profiler.record_function("step:reward"):
                rewards = self.scorer.score(generated.texts, generated.examples, generated.failed)
                pieces.append((generated, rewards, *grpo.judge(generated, rewards, self.scoring)))
            seconds["reward"] += time.perf_counter() - t
            kept = self.group.per_engine(sum(k for *_, keep in pieces for k in keep))
            if (not g.dynamic_sampling or sum(kept) >= g.prompts_per_step
                    or len(pieces) == g.max_gen_rounds):
                break
        self.drawn = drawn
        env = sum((p.env for p, *_ in pieces), records.EnvCalls())
        return records.Rollout.join(pieces, kept, env, len(pieces), seconds)

    def configure(self, cfg, scoring) -> None:
        """The run's config and scoring, changed between steps (train_grpo.configure), here and
        in partial rollout."""
        self.cfg, self.scoring = cfg, scoring
        if self.partial is not None:
            self.partial.configure(cfg, scoring)

    @torch.no_grad()
    def evaluate(self, turn, examples: list, k: int = 0) -> tuple[dict, tuple]:
        """Held-out prompts outside any step (no data drawn, nothing carried: partial rollout's
        samples never seen), each engine group taking a slice of `examples`, in an engine turn
        of its own (`turn`, weight_sync.EngineTurn: the update since the rollout pushed first):
        greedy pass@1 (the mean reward of one greedy completion, or episode, per example) and,
        with k > 0, mean@k (the mean reward of k at the rollout temperature). Returns
        ({"eval_pass1": .., "eval_mean_at_k": ..}, (examples, greedy completions, their
        rewards)) of this rank's slice."""
        group = self.group
        part = examples[group.index::group.count]
        with turn:
            runs = [self.runner.run(self.engine, part, 1, greedy=True)] + (
                [self.runner.run(self.engine, part, k)] if k else [])
        texts, rows = [t for r in runs for t in r.texts], [x for r in runs for x in r.examples]
        scores = self.scorer.score(texts, rows, [f for r in runs for f in r.failed]).total
        first, n = int(group.first), len(part)  # each engine group's scores counted once
        out = tracking.reduce({"eval_pass1": Mean(sum(scores[:n]) * first, n * first),
                               "eval_mean_at_k": Mean(sum(scores[n:]) * first, n * k * first)})
        if not k:
            del out["eval_mean_at_k"]
        return out, (part, records.shown(rows[:n], texts[:n]), scores[:n])

    def close(self) -> None:
        """Stop the reward and environment workers (the engine is the run's to shut down)."""
        try:
            if self.partial is not None:  # the agents it has in flight end first
                self.partial.close()
            self.scorer.close()
        finally:
            self.runner.close()

    def metrics(self, trained: list, version: int) -> dict:
        """Partial rollout's part of the step's metrics (partial.PartialRollout.metrics), over
        this rank's `trained` samples; none without it."""
        return self.partial.metrics(trained, version) if self.partial is not None else {}

    def state_dict(self) -> dict:
        """What a checkpoint keeps: the data position (every rank alike) and, with partial
        rollout, this rank's carried groups."""
        return {"drawn": self.drawn,
                "carry": self.partial.state_dict() if self.partial is not None else None}

    def snapshot(self) -> dict:
        """Everything `rewind` needs to put the sampler back where it is now, copied: the data
        positions and partial rollout's carried groups, as of the last step collected (a step
        collected again draws the same). Agents in flight under partial rollout live in their
        worker processes and cannot be copied: a one-line error."""
        if self.partial is not None and not self.partial.source.keeps:
            raise RuntimeError("snapshot: partial rollout with env.kind agent keeps agents in "
                               "flight in their worker processes, which a snapshot cannot copy. "
                               "Fix: rollout.partial.enabled=false for runs you snapshot")
        state = {"step": self.step, "start": self.start, "drawn": self.drawn, "partial": None}
        if self.partial is not None:
            p = self.partial
            state["partial"] = {"step": p.step, "saved": p.saved, "state": p.state_dict()}
        return copy.deepcopy(state)

    def rewind(self, state: dict) -> None:
        """Back to a `snapshot` (which stays as it was: it may be rewound to again)."""
        state = copy.deepcopy(state)
        self.step, self.start, self.drawn = state["step"], state["start"], state["drawn"]
        if self.partial is not None:
            p, saved = self.partial, state["partial"]
            p.step, p.saved = saved["step"], saved["saved"]
            p.load_state_dict(saved["state"])

    def resume(self, state: dict, step: int) -> None:
        """The state of a checkpoint of `step` (checkpoint.load_checkpoint's: "drawn", and this
        rank's "rank" state)."""
        self.step, self.drawn = step, state.get("drawn", step * self.cfg.grpo.prompts_per_step)
        if self.partial is not None:
            self.partial.resume(state["rank"], step)
