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
import json
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
import fsdp_utils
import grpo
import rewards
import rollout
import tiny_task
import weight_sync
from fsdp_utils import ModelConfig, OptimConfig
from grpo import GRPOConfig
from rollout import RolloutConfig

log = logging.getLogger("grpo")


# ----------------------------------------------------------------------------------------------
# config: one dataclass per YAML section; each section's class lives next to the code using it


@dataclass
class DataConfig:
    path: str = ""  # jsonl of examples, one JSON object a line
    eval_path: str = ""  # held-out jsonl for log.eval_every (empty: the training prompts)
    prompt_key: str = "prompt"
    answer_key: str = "answer"  # passed to the reward with the rest of the example
    reward: str = "tiny_sum"  # a name in rewards.REWARDS
    prompt_suffix: str = ""  # appended to every prompt, e.g. an instruction on the answer format
    chat_template: bool = False  # wrap the prompt as a user turn with the tokenizer's template
    max_prompt_len: int = 512  # longer prompts are dropped at load time
    tiny_task_dir: str = ""  # if set: create the built-in tiny model + prompts here if missing


@dataclass
class TrainConfig:
    steps: int = 100
    seed: int = 0  # data order: step N draws the same prompts, resumed or not
    resume: bool = False  # continue from the newest checkpoint in log.out_dir, if there is one


@dataclass
class LogConfig:
    out_dir: str = "runs/default"  # metrics.jsonl, config.yaml, samples.jsonl, checkpoints
    samples_every: int = 10  # write a few (prompt, completion, reward) rows every N steps
    eval_every: int = 0  # greedy accuracy on data.eval_path every N steps (0: off)
    save_every: int = 0  # resumable checkpoint every N steps (0: none); HF export at the end
    keep_checkpoints: int = 2  # newest resumable checkpoints kept on disk
    wandb_project: str = ""  # empty: no wandb


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    data: DataConfig = field(default_factory=DataConfig)
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
    config.validate(cfg, world)
    log.info("device %s, backend %s, world %d", npu_ops.device_type(), npu_ops.dist_backend(), world)
    for name, (value, source) in env.items():
        log.info("env %s=%s (%s)", name, value, source)
    prepare_run(cfg, rank)
    out = cfg.log.out_dir

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    examples = load_examples(cfg.data, tokenizer)
    eval_examples = (load_examples(dataclasses.replace(cfg.data, path=cfg.data.eval_path), tokenizer)
                     if cfg.log.eval_every and cfg.data.eval_path else examples)
    reward_fn = rewards.REWARDS[cfg.data.reward]
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
    done, drawn = 0, 0  # steps taken; prompts drawn from the shuffled data (all engine groups)
    ckpt = fsdp_utils.latest_checkpoint(out) if cfg.train.resume else None
    if ckpt:
        state = fsdp_utils.load_checkpoint(ckpt, actor, opt, sched)
        done, drawn = state["step"], state.get("drawn", state["step"] * P)
        log.info("resumed from %s: continuing after step %d", ckpt, done)
    if rank == 0:  # drop rows of steps after the checkpoint (a crashed run's tail), or all
        for name in ("metrics.jsonl", "samples.jsonl"):
            keep_rows_upto(os.path.join(out, name), done)
    wandb = None
    if cfg.log.wandb_project and rank == 0:
        import wandb

        wandb.init(project=cfg.log.wandb_project, config=dataclasses.asdict(cfg))

    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(cfg.train.seed))
    metrics_file = open(os.path.join(out, "metrics.jsonl"), "a") if rank == 0 else None
    bar = tqdm(range(done + 1, cfg.train.steps + 1), initial=done, total=cfg.train.steps,
               disable=rank != 0, desc="steps", file=sys.stdout)
    metrics = {}
    try:
        for step in bar:
            t_step, times = time.perf_counter(), {"gen": 0.0, "reward": 0.0}
            # 1) rollout: the actor's weights into the engine (wake weights -> load -> wake KV
            #    cache), then G samples for each of this engine group's next prompts, in rounds:
            #    one, unless dynamic sampling (DAPO) draws fresh prompts to refill the batch
            sync = weight_sync.push(actor, engine)
            times["sync"] = sync["seconds"]
            gen, errors, rounds = {k: [] for k in GEN_KEYS}, 0, 0
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
                errors += score_round(samples, batch, tokenizer, reward_fn, cfg, gen)
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
            t = time.perf_counter()
            mine = train_idx[tp_rank::tp]
            sums, highs, lows, grad_norm = grpo.train_on_rollout(
                actor, ref, opt, [gen["samples"][i] for i in mine], torch.tensor(gen["adv"])[mine],
                g, pad_id=pad_id, device=device, temperature=cfg.rollout.temperature,
                max_len=cfg.rollout.max_new_tokens, grad_clip=cfg.optim.grad_clip,
                seed=random.Random(f"{cfg.train.seed}/{step}/{rank}").getrandbits(48))
            sched.step()
            times["train"] = time.perf_counter() - t
            times["step"] = time.perf_counter() - t_step

            # 4) log: the step's metrics over all ranks; eval and checkpoints on their schedule
            metrics = step_metrics(sums, highs, lows, times, gen, errors, len(groups),
                                   len(train_idx), tp_rank, tp)
            metrics.update(step=step, grad_norm=grad_norm, lr=sched.get_last_lr()[0],
                           gen_rounds=rounds, sync_gb=sync["bytes"] / 2**30,
                           mem_peak_gb=npu_ops.memory_gb()["peak"])
            for event, (before, after) in engine.memory.items():  # accelerators only
                metrics.update({f"mem_{event}_before_gb": before, f"mem_{event}_after_gb": after})
            if cfg.log.eval_every and step % cfg.log.eval_every == 0:
                metrics["eval_reward"] = evaluate(engine, actor, eval_examples, reward_fn, tokenizer,
                                                  engine_idx, n_engines)
            if rank == 0:
                write_logs(metrics, gen, cfg, metrics_file, bar, wandb)
            if cfg.log.save_every and step % cfg.log.save_every == 0:
                fsdp_utils.save_checkpoint(out, step, actor, opt, sched, cfg.log.keep_checkpoints,
                                           extra={"drawn": drawn})
        fsdp_utils.save_hf(actor, tokenizer, os.path.join(out, "final"))
    finally:
        if metrics_file:
            metrics_file.close()
        engine.shutdown()
        if dist.is_initialized():  # the engine's shutdown may already have destroyed it
            dist.destroy_process_group()
    return metrics


def prepare_run(cfg: Config, rank: int) -> None:
    """Create the built-in tiny task if asked (rank 0 writes, the others wait: one node or a shared
    filesystem) and point the config at it; write the resolved config to the run directory."""
    import yaml

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


def load_examples(cfg: DataConfig, tokenizer) -> list[dict]:
    """Read the jsonl, tokenise each prompt into example["prompt_ids"], drop over-long prompts."""
    examples, dropped = [], 0
    with open(cfg.path) as f:
        for line in f:
            if not line.strip():
                continue
            ex = json.loads(line)
            text = ex[cfg.prompt_key] + cfg.prompt_suffix
            if cfg.chat_template:
                ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                    add_generation_prompt=True, tokenize=True)
            else:
                ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) <= cfg.max_prompt_len:
                examples.append({**ex, "prompt_ids": list(ids)})
            else:
                dropped += 1
    log.info("data: %d examples from %s, %d dropped as longer than data.max_prompt_len=%d",
             len(examples), cfg.path, dropped, cfg.max_prompt_len)
    if not examples:
        raise ValueError(f"data.path={cfg.path}: no example with a prompt of at most "
                         f"data.max_prompt_len={cfg.max_prompt_len} tokens")
    return examples


# one step's rollout, as lists over its samples (prompt-major) or its groups (constant, keep)
GEN_KEYS = ("samples", "examples", "texts", "scores", "adv", "constant", "keep")


def score_round(samples: list, batch: list, tokenizer, reward_fn, cfg: Config, gen: dict) -> int:
    """Score one round of samples (G per prompt of `batch`), shape the rewards (overlong penalty)
    into advantages, and append all of it to the lists in `gen`. Every rank of an engine group
    gets the same. Returns the number of rewards that raised."""
    g = cfg.grpo
    texts = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
    examples = [ex for ex in batch for _ in range(g.group_size)]
    scores, errors = rewards.score(reward_fn, texts, examples)
    shaped = torch.tensor(scores, dtype=torch.float64)  # (B*G,)
    if g.overlong == "penalty":
        lengths = torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64)
        shaped += grpo.overlong_penalty(lengths, cfg.rollout.max_new_tokens, g.overlong_buffer,
                                        g.overlong_penalty_factor)
    constant = grpo.constant_groups(shaped, g.group_size).tolist()  # (B,)
    gen["samples"] += samples
    gen["examples"] += examples
    gen["texts"] += texts
    gen["scores"] += scores
    gen["adv"] += grpo.group_advantages(shaped, g.group_size, g.adv_eps,
                                        g.scale_adv_by_std).tolist()
    gen["constant"] += constant
    gen["keep"] += [not (c and g.dynamic_sampling) for c in constant]  # constant: no gradient
    return errors


def kept_per_engine(kept: int, tp: int) -> list[int]:
    """All-gather this engine group's count of kept groups: one entry per engine group."""
    counts = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([kept]))
    return [int(c) for c in counts[::tp]]


def step_metrics(sums: dict, highs: dict, lows: dict, times: dict, gen: dict, errors: int,
                 groups_trained: int, samples_trained: int, tp_rank: int, tp: int) -> dict:
    """The step's metrics over all ranks (every rank must call): the update's sums plus the
    rollout's, each generated sample counted once over its engine group's ranks."""
    share = [gen["samples"][i] for i in range(tp_rank, len(gen["samples"]), tp)]
    first = float(tp_rank == 0)
    sums.update(samples=len(share), reward=sum(gen["scores"][tp_rank::tp]),
                response_tokens=sum(len(s.response_ids) for s in share),
                prompt_tokens=sum(len(s.prompt_ids) for s in share),
                truncated=sum(s.truncated for s in share), reward_errors=first * errors,
                groups_constant=first * sum(gen["constant"]),
                groups_trained=first * groups_trained, samples_trained=first * samples_trained)
    return reduce_metrics(sums, highs, lows, times)


def reduce_metrics(sums: dict, highs: dict, lows: dict, times: dict) -> dict:
    """All-reduce this rank's sums (and maxima, minima); return the step's means. Every rank must
    call it, with the same keys."""
    def reduce(d, op):
        t = torch.tensor(list(d.values()), dtype=torch.float64)
        dist.all_reduce(t, op=op)
        return dict(zip(d, t.tolist()))

    s, hi, lo = reduce(sums, dist.ReduceOp.SUM), reduce(highs, dist.ReduceOp.MAX), \
        reduce(lows, dist.ReduceOp.MIN)
    n, tokens = max(s["samples"], 1), max(s["mm_tokens"], 1)  # generated; trained tokens
    m = {"reward_mean": s["reward"] / n, "response_len_mean": s["response_tokens"] / n,
         "truncated_frac": s["truncated"] / n, "reward_errors": int(s["reward_errors"]),
         "groups_constant": int(s["groups_constant"]), "groups_trained": int(s["groups_trained"]),
         "samples_trained": int(s["samples_trained"]),
         "entropy": s["entropy"] / tokens, "clip_frac": s["clipped"] / max(s["loss_tokens"], 1),
         "logp_gap": s["logp_gap"] / tokens, "is_ratio_mean": s["is_ratio_mean"] / tokens,
         "is_ratio_max": hi["is_ratio_max"], "is_ratio_min": lo["is_ratio_min"],
         "is_above_cap_frac": s["is_above_cap_frac"] / tokens,
         "seq_outside_cap_frac": s["seq_outside_cap_frac"] / max(s["mm_seqs"], 1)}
    if "kl" in s:
        m["kl"] = s["kl"] / tokens
    m.update({f"{k}_time_s": v for k, v in times.items()})
    m["tokens_per_s"] = (s["prompt_tokens"] + s["response_tokens"]) / times["step"]
    return m


def write_logs(metrics: dict, gen: dict, cfg: Config, metrics_file, bar, wandb) -> None:
    """Rank 0: a row of metrics.jsonl, the console line, wandb, and every log.samples_every steps
    a few (prompt, completion, reward) rows of samples.jsonl."""
    step, G = metrics["step"], cfg.grpo.group_size
    metrics_file.write(json.dumps(metrics) + "\n")
    metrics_file.flush()
    bar.write(format_line(metrics, cfg.train.steps))
    if wandb:
        wandb.log(metrics, step=step)
    if cfg.log.samples_every and step % cfg.log.samples_every == 0:
        with open(os.path.join(cfg.log.out_dir, "samples.jsonl"), "a") as f:
            for i in range(0, min(len(gen["texts"]), 4 * G), G):
                ex = gen["examples"][i]
                f.write(json.dumps({"step": step, "prompt": ex[cfg.data.prompt_key],
                                    "completion": gen["texts"][i], "reward": gen["scores"][i],
                                    "answer": ex.get(cfg.data.answer_key)}) + "\n")


def keep_rows_upto(path: str, step: int) -> None:
    """Rewrite a jsonl log keeping the rows of steps <= `step` (all rows gone for step 0)."""
    rows = []
    if step and os.path.exists(path):
        with open(path) as f:
            rows = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(path, "w") as f:
        f.writelines(rows)


@torch.no_grad()
def evaluate(engine, actor, examples, reward_fn, tokenizer, engine_idx, n_engines) -> float:
    """Greedy accuracy over all examples (each engine group takes a slice). The engine already
    holds the weights of this step's rollout; the update since then is synced first."""
    weight_sync.push(actor, engine)
    part = examples[engine_idx::n_engines]
    samples = engine.generate([ex["prompt_ids"] for ex in part], n=1, greedy=True)
    engine.sleep()
    texts = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
    scores, _ = rewards.score(reward_fn, texts, part)
    # every rank of a tensor-parallel group holds the same scores: count only its first rank
    tp = dist.get_world_size() // n_engines
    first = dist.get_rank() % tp == 0
    total = torch.tensor([sum(scores) if first else 0.0, len(scores) if first else 0.0])
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def format_line(m: dict, steps: int) -> str:
    line = (f"step {m['step']}/{steps} | reward {m['reward_mean']:.3f} | "
            f"len {m['response_len_mean']:.1f} | ent {m['entropy']:.2f} | "
            + (f"kl {m['kl']:.4f} | " if "kl" in m else "")
            + f"gap {m['logp_gap']:.1e} | "
            f"gen {m['gen_time_s']:.2f}s sync {m['sync_time_s']:.2f}s "
            f"reward {m['reward_time_s']:.2f}s train {m['train_time_s']:.2f}s | "
            f"{m['tokens_per_s']:.0f} tok/s | mem {m['mem_peak_gb']:.1f}G")
    if "eval_reward" in m:
        line += f" | eval {m['eval_reward']:.3f}"
    return line


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", help="YAML file; further --section.key=value override it")
    args, overrides = parser.parse_known_args(argv)
    train(load_config(args.config, overrides))


if __name__ == "__main__":
    main()
