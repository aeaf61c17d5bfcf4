"""GRPO with a colocated FSDP2 actor and in-process vLLM engine: the config tree and the loop.

Run it
    torchrun --nproc_per_node 2 train_grpo.py --config configs/tiny_cpu.yaml        # CPU, 2 ranks
    torchrun --nproc_per_node 8 train_grpo.py --config configs/x.yaml --optim.lr=1e-6
    python train_grpo.py --config configs/tiny_cpu.yaml                             # world size 1
Step it (a notebook, world size 1)
    from train_grpo import load_config, setup, train_step
    run = setup(load_config("configs/tiny_cpu.yaml", ["--log.out_dir=/tmp/run"]))
    metrics, ro = train_step(run, return_rollout=True)   # ro.texts, ro.scores, ro.adv, ...
    run.close()                                          # or: with setup(cfg) as run: ...

One step (`train_step`): sync the actor's weights into the engine, sample `group_size` responses
per prompt (1: rollout), score them into group-normalised advantages (2: reward), update the
actor on them (3: update), and log (4). The algorithm, what its defaults amount to and its
variants live in grpo.py; the engine and the rollout's record in rollout.py; the weight push in
weight_sync.py; the actor in fsdp_utils.py; checkpoints in checkpoint.py; everything
device-specific in npu_ops.py; config parsing and the checks that need no model in config.py.
"""

import argparse
import copy
import dataclasses
import logging
import os
import random
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Annotated

import npu_ops  # first: it sets the Ascend environment before torch (and its backends) load

import torch
import torch.distributed as dist

import checkpoint
import config
import data
import episodes
import evaluation
import fsdp_utils
import grpo
import offload
import partial
import records
import rewards
import rollout
import tiny_task
import tracking
import weight_sync
from data import DataConfig
from domains import FLAG, Range
from episodes import EnvConfig
from fsdp_utils import ModelConfig, OptimConfig
from grpo import GRPOConfig
from rewards import RewardConfig
from rollout import RolloutConfig
from tracking import LogConfig

log = logging.getLogger("grpo")


# ----------------------------------------------------------------------------------------------
# config: one dataclass per YAML section; each section's class lives next to the code using it


@dataclass
class TrainConfig:
    steps: Annotated[int, Range(1)] = 100
    seed: Annotated[int, Range(0)] = 0  # data order: step N draws the same prompts, resumed or not
    # continue from the newest checkpoint in log.out_dir, if there is one
    resume: Annotated[bool, FLAG] = False


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
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
    cfg: Config
    rank: int = 0
    world: int = 1
    tokenizer: object = None
    examples: list = field(default_factory=list)  # the training prompts (data.load_examples)
    eval_examples: list = field(default_factory=list)
    scorer: rewards.Scorer = None
    episodes: "episodes.Episodes" = None  # one turn per sample, or episodes with an environment
    engine: rollout.Engine = None
    actor: torch.nn.Module = None
    ref: torch.nn.Module = None  # the frozen reference, with grpo.kl_coef > 0
    opt: torch.optim.Optimizer = None
    sched: object = None
    switch: offload.Switch = None  # the actor out of device memory while the engine works
    carry: partial.Carry = None  # rollout.partial: groups in flight from step to step
    tracker: tracking.Tracker = None
    order: torch.Tensor = None  # the shuffled data: step N draws the same prompts in every run
    step: int = 0  # steps taken
    drawn: int = 0  # prompts drawn from `order` so far, over all engine groups
    bar: object = None
    log_handler: logging.Handler = None  # the one setup added, if the process had none

    def __post_init__(self):  # engine groups: consecutive ranks of rollout.tp_size (validated)
        tp = max(1, self.cfg.rollout.tp_size)
        self.engine_idx, self.tp_rank, self.n_engines = *divmod(self.rank, tp), self.world // tp

    def close(self) -> None:
        """Stop the reward worker and the engine, and leave the process group. The actor, its
        optimizer and the reference are let go first: a sleeping engine wakes to shut down
        cleanly, and needs their memory (rollout.Engine.shutdown). Every part is closed even if
        another raised (the first error is raised at the end); a second call does nothing."""
        global _OPEN
        parts, engine = [self.bar, self.tracker, self.scorer, self.episodes], self.engine
        self.bar = self.tracker = self.scorer = self.episodes = self.engine = None
        self.actor = self.ref = self.opt = self.sched = self.switch = None
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

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


_OPEN = None  # a weak reference to the Run that setup() returned and close() has not ended


def open_run() -> Run | None:
    """The run setup() returned that is not closed yet, if any."""
    return _OPEN() if _OPEN is not None else None


def setup(cfg: Config) -> Run:
    """Everything a run needs: the process group (torchrun's, or a world of one), the checks that
    need no model, the data, the reward worker, the engine, the actor (and reference), the
    optimizer, the data order and the tracker; resumed from the newest checkpoint if
    cfg.train.resume. What was built is torn down again if a later part fails. The run works on
    a copy of `cfg` (run.cfg); one run at a time in a process (a second setup() raises)."""
    from torch.distributed.device_mesh import init_device_mesh
    from tqdm import tqdm
    from transformers import AutoTokenizer

    global _OPEN
    if (other := open_run()) is not None:
        raise RuntimeError(f"setup: a run is already open in this process (log.out_dir="
                           f"{other.cfg.log.out_dir}, step {other.step}): call its close() "
                           "first (train_grpo.open_run() returns it)")
    cfg = copy.deepcopy(cfg)
    # before the engine or any accelerator runtime starts: npu_ops.setup_env says why
    env = npu_ops.setup_env(graph_mode=not cfg.rollout.enforce_eager, sleep_mode=True,
                            tp_size=cfg.rollout.tp_size)
    run = Run(cfg, *init_distributed())
    _OPEN = weakref.ref(run)
    try:
        run.log_handler = tracking.log_to_console(run.rank)
        log.info("device %s, backend %s, world %d", npu_ops.device_type(),
                 npu_ops.dist_backend(), run.world)
        for name, (value, source) in env.items():
            log.info("env %s=%s (%s)", name, value, source)
        config.validate(cfg, run.world)  # the checks that need no model: BadInput, in a second
        prepare_run(cfg, run.rank)
        config.check_model(cfg)  # positions, KV cache, chat template: from the model's files
        config.check_host_memory(cfg, run.world)  # the parks' bytes: from config.json
        run.tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        run.examples = data.load_examples(cfg.data, run.tokenizer)
        run.eval_examples = (data.load_examples(cfg.data, run.tokenizer, cfg.data.eval_split,
                                                cfg.data.eval_path)
                             if cfg.log.eval_every and cfg.data.eval_path else run.examples)
        group = episodes.EngineGroup(cfg.rollout.tp_size)  # rewards, environments: once an engine
        run.scorer = rewards.Scorer(cfg.reward, group)  # worker processes: a hang is cut
        run.episodes = episodes.Episodes(cfg.env, run.tokenizer, cfg.data.chat_template,
                                         cfg.data.prompt_key, cfg.rollout.max_new_tokens, group)
        if cfg.rollout.partial.enabled:  # draw(i): the i-th prompt of the shuffled data
            run.carry = partial.Carry(cfg, (run.engine_idx, run.n_engines), run.tp_rank == 0,
                                      lambda i: run.examples[run.order[i % len(run.examples)]])
        # the engine first: building vLLM reseeds torch
        run.engine = rollout.Engine(cfg.rollout, cfg.model.path, tp_group_index=run.engine_idx,
                                    lora=cfg.model.lora)  # with adapters: LoRA on
        run.engine.sleep()  # before the actor loads: the memory is training's until the sync
        torch.manual_seed(cfg.train.seed)
        mesh = init_device_mesh(npu_ops.device_type(), (run.world,))
        run.actor = fsdp_utils.build_actor(cfg.model, mesh)
        if cfg.grpo.kl_coef > 0:  # with adapters, the actor's base (fsdp_utils.reference)
            run.ref = (run.actor if cfg.model.lora.rank
                       else fsdp_utils.build_actor(cfg.model, mesh, reference=True))
        run.opt, run.sched = fsdp_utils.build_optimizer(cfg.optim, run.actor, cfg.train.steps)
        run.switch = offload.Switch(run.actor, run.opt, run.engine,
                                    enabled=offload.enabled(cfg.model.offload))
        ckpt = checkpoint.latest_checkpoint(cfg.log.out_dir) if cfg.train.resume else None
        if ckpt:
            state = checkpoint.load_checkpoint(ckpt, run.actor, run.opt, run.sched)
            run.step = state["step"]
            run.drawn = state.get("drawn", run.step * cfg.grpo.prompts_per_step)
            if run.carry is not None:
                run.carry.resume(state["rank"], run.episodes)
            log.info("resumed from %s: continuing after step %d", ckpt, run.step)
        run.tracker = tracking.Tracker(cfg, run.rank, run.step)  # a crashed tail is dropped
        run.order = torch.randperm(len(run.examples),
                                   generator=torch.Generator().manual_seed(cfg.train.seed))
        run.bar = tqdm(total=cfg.train.steps, initial=run.step, disable=run.rank != 0,
                       desc="steps", file=sys.stdout)
        return run
    except BaseException:
        try:
            run.close()
        except BaseException:  # noqa: B036  (the error that stopped setup is the one to see)
            pass
        raise


# ----------------------------------------------------------------------------------------------
# the loop


def train_step(run: Run, return_rollout: bool = False):
    """One GRPO step on every rank. Returns the step's metrics (those of metrics.jsonl), and with
    return_rollout the rollout itself (records.Rollout: samples, texts, scores, advantages)."""
    cfg, g, tp = run.cfg, run.cfg.grpo, run.cfg.rollout.tp_size
    step, t_step = run.step + 1, time.perf_counter()
    npu_ops.reset_peak_memory()
    # 1) rollout: the actor's weights into the engine (wake weights -> load -> wake KV cache),
    #    then G samples (episodes, with an environment) for each of this engine group's next
    #    prompts, in rounds: one, unless dynamic sampling (DAPO) draws fresh prompts to refill;
    #    with partial rollout, the carried samples first, stopping early (partial.py). The
    #    engine's turn is guarded: leaving it, whatever raised (a reward, Ctrl-C), the engine
    #    sleeps and the actor and its optimizer state are back (offload.Switch); the data position
    #    moves only when the step is done, so that a step run again draws the same prompts
    drawn = run.drawn
    with run.switch.engine_turn():
        sync = weight_sync.push(run.actor, run.engine, before_weights=run.switch.optimizer_out,
                                before_kv_cache=run.switch.actor_out)
        ro, times = records.Rollout(), {"gen": 0.0, "reward": 0.0, "sync": sync["seconds"]}
        while run.carry is None:
            batch, drawn = draw_prompts(run, drawn)
            t = time.perf_counter()
            generated = run.episodes.run(run.engine, batch, g.group_size,
                                         seed=round_seed(run, step, ro.rounds + 1))
            times["gen"] += time.perf_counter() - t
            # 2) reward: scores, shaped (overlong penalty) into advantages within each group;
            #    with dynamic sampling, the groups whose rewards are all equal are dropped
            t = time.perf_counter()
            ro.extend(score(run, generated))
            times["reward"] += time.perf_counter() - t
            kept = grpo.kept_per_engine(sum(ro.keep), tp)  # groups, one entry per engine group
            if (not g.dynamic_sampling or sum(kept) >= g.prompts_per_step
                    or ro.rounds == g.max_gen_rounds):
                break
        if run.carry is not None:  # partial: each group scored as in 2) once it is complete
            ro = run.carry.rollout(run.engine, run.episodes, lambda r: score(run, r), run.step,
                                   times, lambda k: round_seed(run, step, k))
            kept = grpo.kept_per_engine(sum(ro.keep), tp)
        t = time.perf_counter()
        run.engine.sleep()  # frees weights + KV cache where the platform can
        times["sleep"] = time.perf_counter() - t
    groups = grpo.take_groups(ro.keep, kept, run.engine_idx, g.prompts_per_step)
    ro.trained = grpo.trained_samples(groups, g.group_size, ro.dropped,
                                      [s.truncated for s in ro.samples], g.overlong == "mask")

    # 3) update: this rank trains on its 1/tp share of the kept samples
    t = time.perf_counter()
    mine = ro.trained[run.tp_rank::tp]
    samples = partial.for_update([ro.samples[i] for i in mine], run.step,  # stale: mask
                                 cfg.rollout.partial.stale)
    update = grpo.train_on_rollout(
        run.actor, run.ref, run.opt, samples, torch.tensor(ro.adv)[mine],
        g, pad_id=run.tokenizer.pad_token_id or 0, device=npu_ops.local_device(),
        temperature=cfg.rollout.temperature, max_len=cfg.rollout.max_new_tokens,
        grad_clip=cfg.optim.grad_clip,
        seed=random.Random(f"{cfg.train.seed}/{step}/{run.rank}").getrandbits(48))
    run.sched.step()
    run.drawn = drawn
    if run.carry is not None:  # the groups it carries are the next step's
        run.carry.commit()
    times["logprobs"] = update.pop("logprobs_time_s")  # the old-policy and reference passes
    times["train"] = time.perf_counter() - t - times["logprobs"]
    times["step"] = time.perf_counter() - t_step
    run.step = step

    # 4) log: the step's metrics over all ranks; eval and checkpoints on their schedule
    metrics = tracking.reduce({
        "step": step, **ro.metrics(len(groups), run.tp_rank, tp, bool(cfg.env.name)),
        **update, **(run.carry.metrics(samples, step - 1) if run.carry else {}),
        "lr": run.sched.get_last_lr()[0], "gen_rounds": ro.rounds,
        "sync_gb": sync["bytes"] / 2**30, "trainable_params": fsdp_utils.trainable(run.actor),
        "mem_peak_gb": npu_ops.memory_gb()["peak"] - run.engine.allocated_gb,
        **{f"{k}_time_s": v for k, v in times.items()}, **run.engine.memory_metrics(),
        **run.switch.metrics()})
    metrics["tokens_per_s"] = metrics.pop("tokens") / times["step"]
    if run.carry is not None:  # generated this step, carried tokens included
        metrics["gen_tokens_per_s"] = metrics.pop("gen_tokens") / max(times["gen"], 1e-9)
    if cfg.log.eval_every and (step % cfg.log.eval_every == 0 or step == cfg.train.steps):
        scores, rows = evaluation.run(run.switch, run.eval_examples, run.scorer, run.episodes,
                                      run.engine_idx, run.n_engines, cfg.log.eval_k)
        metrics.update(scores)
        run.tracker.log_samples("eval_samples.jsonl", step,
                                *(r[:cfg.log.eval_examples] for r in rows))
    run.tracker.log_step(metrics, run.bar)
    run.bar.update(1)
    if cfg.log.samples_every and step % cfg.log.samples_every == 0:
        few = range(0, min(len(ro.texts), 4 * g.group_size), g.group_size)  # 4 groups' first
        shown = ro.completions()
        run.tracker.log_samples("samples.jsonl", step, [ro.examples[i] for i in few],
                                [shown[i] for i in few], [ro.scores[i] for i in few])
    if cfg.log.save_every and step % cfg.log.save_every == 0:
        checkpoint.save_checkpoint(cfg.log.out_dir, step, run.actor, run.opt, run.sched,
                                   cfg.log.keep_checkpoints, extra={"drawn": run.drawn},
                                   rank={"carry": run.carry and run.carry.state_dict()})
    return (metrics, ro) if return_rollout else metrics


def train(cfg: Config) -> dict:
    """Run GRPO for cfg.train.steps steps and export the actor to log.out_dir/final; returns the
    last step's metrics."""
    metrics = {}
    with setup(cfg) as run:
        while run.step < run.cfg.train.steps:
            metrics = train_step(run)
        checkpoint.save_hf(run.actor, run.tokenizer, os.path.join(run.cfg.log.out_dir, "final"),
                           source=run.cfg.model.path,  # the run's copy: the tiny task's path
                           lora=run.cfg.model.lora)
    return metrics


def round_seed(run: Run, step: int, k: int) -> int | None:
    """The seed of the step's k-th generation round, with rollout.seed_per_step; else None."""
    return (random.Random(f"{run.cfg.rollout.seed}/{step}/{run.engine_idx}/{k}").getrandbits(48)
            if run.cfg.rollout.seed_per_step else None)


def draw_prompts(run: Run, drawn: int) -> tuple[list[dict], int]:
    """This engine group's next prompts (the same on each of its ranks) from the shuffled data,
    `drawn` prompts in; every engine group draws its own slice of the step's prompts_per_step.
    Returns them and the position after the step's."""
    per_engine = run.cfg.grpo.prompts_per_step // run.n_engines
    start = drawn + run.engine_idx * per_engine
    batch = [run.examples[run.order[(start + i) % len(run.examples)]] for i in range(per_engine)]
    return batch, drawn + run.cfg.grpo.prompts_per_step


def score(run: Run, ro: records.Rollout) -> records.Rollout:
    """One round's rollout scored: its rewards, shaped (overlong penalty) into advantages within
    each group of G. A sample whose environment or a reward call failed scores 0 and, with
    env.on_failure=drop, is left out of its group's advantages and the loss. Every rank of an
    engine group gets the same."""
    g, G = run.cfg.grpo, run.cfg.grpo.group_size
    out = run.scorer.score(ro.texts, ro.examples, ro.failed)
    ro.scores, ro.by_name = out["reward"], out["by_name"]
    shaped = torch.tensor(ro.scores, dtype=torch.float64)  # (B*G,)
    if g.overlong == "penalty":  # an episode's length: all after its prompt, against its limit
        lengths = torch.tensor([len(s.response_ids) for s in ro.samples], dtype=torch.float64)
        limit = run.cfg.env.max_tokens if run.cfg.env.name else run.cfg.rollout.max_new_tokens
        shaped += grpo.overlong_penalty(lengths, limit, g.overlong_buffer,
                                        g.overlong_penalty_factor)
    env_failed, drop = ro.failed or [False] * len(ro.scores), run.cfg.env.on_failure == "drop"
    ro.dropped = [drop and (e or r) for e, r in zip(env_failed, out["failed"])]
    valid = ~torch.tensor(ro.dropped, dtype=torch.bool)
    ro.constant = grpo.constant_groups(shaped, G, valid).tolist()  # (B,)
    ro.keep = [not (c and g.dynamic_sampling) for c in ro.constant]  # constant: no gradient
    ro.adv = grpo.group_advantages(shaped, G, g.adv_eps, g.scale_adv_by_std, valid).tolist()
    ro.errors, ro.timeouts = out["errors"], out["timeouts"]
    return ro


def prepare_run(cfg: Config, rank: int) -> None:
    """Create the built-in tiny task if asked (rank 0 writes, the others wait: one node or a shared
    filesystem) and point the config at it; write the resolved config to the run directory."""
    import yaml

    cfg.data = data.apply_preset(cfg.data)  # its columns and paths, for everything after
    if cfg.data.tiny_task_dir:
        if rank == 0:
            tiny_task.ensure_tiny_task(cfg.data.tiny_task_dir)
        dist.barrier()
        cfg.model.path = cfg.model.path or os.path.join(cfg.data.tiny_task_dir, "model")
        cfg.data.path = cfg.data.path or os.path.join(cfg.data.tiny_task_dir, "train.jsonl")
        cfg.data.eval_path = (cfg.data.eval_path
                              or os.path.join(cfg.data.tiny_task_dir, "test.jsonl"))
    if rank == 0:
        os.makedirs(cfg.log.out_dir, exist_ok=True)
        with open(os.path.join(cfg.log.out_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(dataclasses.asdict(cfg), f, sort_keys=False)


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


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="YAML file; further --section.key=value override it")
    args, overrides = parser.parse_known_args(argv)
    try:
        train(load_config(args.config, overrides))
    except config.BadInput as e:  # the user's input, found by our checks: one line, no traceback
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr)
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(2)


if __name__ == "__main__":
    main()
