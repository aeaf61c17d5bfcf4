"""GRPO with a colocated FSDP2 actor and in-process vLLM engine: the config tree and the loop.

Run it
    torchrun --nproc_per_node 2 train_grpo.py --config configs/tiny_cpu.yaml        # CPU, 2 ranks
    torchrun --nproc_per_node 8 train_grpo.py --config configs/x.yaml --optim.lr=1e-6
    python train_grpo.py --config configs/tiny_cpu.yaml                             # world size 1
    # notebook:  from train_grpo import load_config, train
    #            train(load_config("configs/tiny_cpu.yaml", ["--log.out_dir=/tmp/run"]))

One step (`train`): sync the actor's weights into the engine, sample `group_size` responses per
prompt (1: rollout), score them into group-normalised advantages (2: reward), update the actor
on them (3: update), and log (4). The algorithm, what its defaults amount to and its variants
live in grpo.py; the engine in rollout.py; the weight push in weight_sync.py; sharding and
checkpoints in fsdp_utils.py; everything device-specific in npu_ops.py; config parsing and the
checks that need no model in config.py.
"""

import argparse
import dataclasses
import logging
import os
import random
import sys
import time
from dataclasses import dataclass, field

import npu_ops  # first: it sets the Ascend environment before torch (and its backends) load

import torch
import torch.distributed as dist

import config
import data
import fsdp_utils
import grpo
import rewards
import rollout
import tiny_task
import tracking
import weight_sync
from data import DataConfig
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
    steps: int = 100
    seed: int = 0  # data order: step N draws the same prompts, resumed or not
    resume: bool = False  # continue from the newest checkpoint in log.out_dir, if there is one


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)


def load_config(path: str | None = None, overrides: list[str] = ()) -> Config:
    """Defaults < YAML file < `--section.key=value` overrides (config.load). Unknown keys and bad
    types raise, naming the closest valid key."""
    return config.load(Config, path, overrides)


# ----------------------------------------------------------------------------------------------
# the loop


def train(cfg: Config) -> dict:
    """Run GRPO for cfg.train.steps steps; returns the last step's metrics."""
    from torch.distributed.device_mesh import init_device_mesh
    from tqdm import tqdm
    from transformers import AutoTokenizer

    # before the engine or any accelerator runtime starts: npu_ops.setup_env says why
    env = npu_ops.setup_env(graph_mode=not cfg.rollout.enforce_eager, sleep_mode=True,
                            tp_size=cfg.rollout.tp_size)
    rank, world = init_distributed()
    device = npu_ops.local_device()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s", force=True)
    log.info("device %s, backend %s, world %d", npu_ops.device_type(), npu_ops.dist_backend(), world)
    for name, (value, source) in env.items():
        log.info("env %s=%s (%s)", name, value, source)
    with config.bad_input():  # the config and the data, checked before any model loads
        config.validate(cfg, world)
        prepare_run(cfg, rank)
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        examples = data.load_examples(cfg.data, tokenizer)
        eval_examples = (data.load_examples(cfg.data, tokenizer, cfg.data.eval_split,
                                            cfg.data.eval_path)
                         if cfg.log.eval_every and cfg.data.eval_path else examples)
    scorer = rewards.Scorer(cfg.reward)  # a worker process: a hanging reward is cut at its limit
    out = cfg.log.out_dir
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0  # masked anyway
    g, tp, G, P = cfg.grpo, cfg.rollout.tp_size, cfg.grpo.group_size, cfg.grpo.prompts_per_step
    engine_idx, tp_rank, n_engines = rank // tp, rank % tp, world // tp
    per_engine = P // n_engines

    # the engine first: building vLLM reseeds torch
    engine = rollout.Engine(cfg.rollout, cfg.model.path, tp_group_index=engine_idx)
    engine.sleep()  # before the actor loads: its memory goes to training until the first sync
    torch.manual_seed(cfg.train.seed)
    mesh = init_device_mesh(npu_ops.device_type(), (world,))
    actor = fsdp_utils.build_actor(cfg.model, mesh)
    ref = fsdp_utils.build_actor(cfg.model, mesh, reference=True) if g.kl_coef > 0 else None
    opt, sched = fsdp_utils.build_optimizer(cfg.optim, actor, cfg.train.steps)
    offload = {"on": True, "off": False}.get(cfg.model.offload, npu_ops.engine_supports_sleep())
    swap = fsdp_utils.ActorSwap(actor, opt, enabled=offload)  # out while generating, back after
    done, drawn = 0, 0  # steps taken; prompts drawn from the shuffled data (all engine groups)
    ckpt = fsdp_utils.latest_checkpoint(out) if cfg.train.resume else None
    if ckpt:
        state = fsdp_utils.load_checkpoint(ckpt, actor, opt, sched)
        done, drawn = state["step"], state.get("drawn", state["step"] * P)
        log.info("resumed from %s: continuing after step %d", ckpt, done)
    tracker = tracking.Tracker(cfg, rank, done)  # rank 0: jsonl (a crashed tail dropped), wandb
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(cfg.train.seed))
    bar = tqdm(range(done + 1, cfg.train.steps + 1), initial=done, total=cfg.train.steps,
               disable=rank != 0, desc="steps", file=sys.stdout)
    metrics = {}
    try:
        for step in bar:
            t_step, times = time.perf_counter(), {"gen": 0.0, "reward": 0.0}
            # 1) rollout: the actor's weights into the engine (wake weights -> load -> wake KV
            #    cache), then G samples for each of this engine group's next prompts, in rounds:
            #    one, unless dynamic sampling (DAPO) draws fresh prompts to refill the batch
            sync = weight_sync.push(actor, engine, before_kv_cache=swap.out)
            times["sync"] = sync["seconds"]
            gen, rounds = new_rollout(), 0
            while True:
                batch = [examples[order[(drawn + engine_idx * per_engine + i) % len(examples)]]
                         for i in range(per_engine)]  # same prompts on one engine group's ranks
                drawn, rounds = drawn + P, rounds + 1
                seed = (random.Random(f"{cfg.rollout.seed}/{step}/{engine_idx}/{rounds}")
                        .getrandbits(48) if cfg.rollout.seed_per_step else None)
                t = time.perf_counter()
                samples = engine.generate([ex["prompt_ids"] for ex in batch], n=G, seed=seed)
                times["gen"] += time.perf_counter() - t
                # 2) reward: scores, shaped (overlong penalty) into advantages within each group;
                #    with dynamic sampling, the groups whose rewards are all equal are dropped
                t = time.perf_counter()
                score_round(samples, batch, tokenizer, scorer, cfg, gen)
                times["reward"] += time.perf_counter() - t
                kept = kept_per_engine(sum(gen["keep"]), tp)  # groups, one entry per engine group
                if not g.dynamic_sampling or sum(kept) >= P or rounds == g.max_gen_rounds:
                    break
            t = time.perf_counter()
            engine.sleep()  # frees weights + KV cache where the platform can
            times["sleep"] = time.perf_counter() - t
            groups = grpo.take_groups(gen["keep"], kept, engine_idx, P)
            train_idx = [b * G + j for b in groups for j in range(G)  # overlong mask (DAPO)
                         if not (g.overlong == "mask" and gen["samples"][b * G + j].truncated)]

            # 3) update: this rank trains on its 1/tp share of the kept samples
            swap.back()  # the actor's parameters and optimizer state, if they were moved out
            t = time.perf_counter()
            mine = train_idx[tp_rank::tp]
            sums, highs, lows, grad_norm = grpo.train_on_rollout(
                actor, ref, opt, [gen["samples"][i] for i in mine], torch.tensor(gen["adv"])[mine],
                g, pad_id=pad_id, device=device, temperature=cfg.rollout.temperature,
                max_len=cfg.rollout.max_new_tokens, grad_clip=cfg.optim.grad_clip,
                seed=random.Random(f"{cfg.train.seed}/{step}/{rank}").getrandbits(48),
                times=times)  # times["logprobs"]: the old-policy and reference passes
            sched.step()
            times["train"] = time.perf_counter() - t - times["logprobs"]
            times["step"] = time.perf_counter() - t_step

            # 4) log: the step's metrics over all ranks; eval and checkpoints on their schedule
            metrics = tracking.step_metrics(sums, highs, lows, times, gen, len(groups),
                                            len(train_idx), tp_rank, tp)
            metrics.update(step=step, grad_norm=grad_norm, lr=sched.get_last_lr()[0],
                           gen_rounds=rounds, sync_gb=sync["bytes"] / 2**30,
                           mem_peak_gb=npu_ops.memory_gb()["peak"])
            for event, (before, after) in engine.memory.items():  # accelerators only
                metrics.update({f"mem_{event}_before_gb": before, f"mem_{event}_after_gb": after})
            metrics.update(swap.metrics())  # with model.offload: the moves' times and memory
            if cfg.log.eval_every and (step % cfg.log.eval_every == 0 or step == cfg.train.steps):
                scores, rows = evaluate(engine, actor, eval_examples, scorer, tokenizer,
                                        engine_idx, n_engines, cfg.log.eval_k)
                metrics.update(scores)
                tracker.log_samples("eval_samples.jsonl", step,
                                    *(r[:cfg.log.eval_examples] for r in rows))
            tracker.log_step(metrics, bar)
            if cfg.log.samples_every and step % cfg.log.samples_every == 0:
                few = range(0, min(len(gen["texts"]), 4 * G), G)  # the first 4 groups' first
                picked = ([gen[k][i] for i in few] for k in ("examples", "texts", "scores"))
                tracker.log_samples("samples.jsonl", step, *picked)
            if cfg.log.save_every and step % cfg.log.save_every == 0:
                fsdp_utils.save_checkpoint(out, step, actor, opt, sched, cfg.log.keep_checkpoints,
                                           extra={"drawn": drawn})
        fsdp_utils.save_hf(actor, tokenizer, os.path.join(out, "final"), source=cfg.model.path)
    finally:
        tracker.close()
        scorer.close()
        engine.shutdown()
        if dist.is_initialized():  # the engine's shutdown may already have destroyed it
            dist.destroy_process_group()
    return metrics


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
        cfg.data.eval_path = cfg.data.eval_path or os.path.join(cfg.data.tiny_task_dir, "test.jsonl")
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


def new_rollout() -> dict:
    """One step's rollout: lists over its samples (prompt-major) or groups (constant, keep),
    each reward function's values by name, and counts of failed and timed-out reward calls."""
    gen = {k: [] for k in ("samples", "examples", "texts", "scores", "adv", "constant", "keep")}
    return {**gen, "by_name": {}, "errors": 0, "timeouts": 0}


def score_round(samples: list, batch: list, tokenizer, scorer, cfg: Config, gen: dict) -> None:
    """Score one round of samples (G per prompt of `batch`), shape the rewards (overlong penalty)
    into advantages, and add all of it to `gen`. Every rank of an engine group gets the same."""
    g = cfg.grpo
    texts = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
    examples = [ex for ex in batch for _ in range(g.group_size)]
    out = scorer.score(texts, examples)
    shaped = torch.tensor(out["reward"], dtype=torch.float64)  # (B*G,)
    if g.overlong == "penalty":
        lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
        shaped += grpo.overlong_penalty(lengths, cfg.rollout.max_new_tokens, g.overlong_buffer,
                                        g.overlong_penalty_factor)
    constant = grpo.constant_groups(shaped, g.group_size).tolist()  # (B,)
    gen["samples"] += samples
    gen["examples"] += examples
    gen["texts"] += texts
    gen["scores"] += out["reward"]
    gen["adv"] += grpo.group_advantages(shaped, g.group_size, g.adv_eps,
                                        g.scale_adv_by_std).tolist()
    gen["constant"] += constant
    gen["keep"] += [not (c and g.dynamic_sampling) for c in constant]  # constant: no gradient
    for name, values in out["by_name"].items():
        gen["by_name"].setdefault(name, []).extend(values)
    gen["errors"] += out["errors"]
    gen["timeouts"] += out["timeouts"]


def kept_per_engine(kept: int, tp: int) -> list[int]:
    """All-gather this engine group's count of kept groups: one entry per engine group."""
    counts = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([kept]))
    return [int(c) for c in counts[::tp]]


@torch.no_grad()
def evaluate(engine, actor, examples, scorer, tokenizer, engine_idx, n_engines, k: int = 0):
    """Greedy pass@1 (the mean reward of one greedy completion per example) and, with k > 0,
    mean@k (the mean reward of k completions per example at the rollout temperature) over all
    examples, each engine group taking a slice. Returns ({"eval_pass1": .., "eval_mean_at_k": ..},
    (examples, greedy completions, their rewards)) of this rank's slice. The engine holds the
    weights of this step's rollout: the update since then is synced first."""
    weight_sync.push(actor, engine)
    part = examples[engine_idx::n_engines]
    prompts = [ex["prompt_ids"] for ex in part]
    greedy = engine.generate(prompts, n=1, greedy=True)
    sampled = engine.generate(prompts, n=k) if k else []
    engine.sleep()
    texts = tokenizer.batch_decode([s.response_ids for s in greedy + sampled],
                                   skip_special_tokens=True)
    scores = scorer.score(texts, part + [ex for ex in part for _ in range(k)])["reward"]
    # every rank of a tensor-parallel group holds the same scores: count only its first rank
    first = float(dist.get_rank() % (dist.get_world_size() // n_engines) == 0)
    n = len(part)
    total = torch.tensor([sum(scores[:n]), n, sum(scores[n:]), n * k], dtype=torch.float64) * first
    dist.all_reduce(total)
    out = {"eval_pass1": (total[0] / total[1]).item()}
    if k:
        out["eval_mean_at_k"] = (total[2] / total[3]).item()
    return out, (part, texts[:n], scores[:n])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="YAML file; further --section.key=value override it")
    args, overrides = parser.parse_known_args(argv)
    try:
        with config.bad_input():
            cfg = load_config(args.config, overrides)
        train(cfg)
    except config.BadInput as e:  # the user's input: one line, no traceback
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr)
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.exit(2)


if __name__ == "__main__":
    main()
