"""GRPO with a colocated FSDP2 actor and in-process vLLM engine, in one file you can read.

Run it
    torchrun --nproc_per_node 2 train_grpo.py --config configs/tiny_cpu.yaml        # CPU, 2 ranks
    torchrun --nproc_per_node 8 train_grpo.py --config configs/x.yaml --optim.lr=1e-6
    python train_grpo.py --config configs/tiny_cpu.yaml                             # world size 1
    # notebook:  from train_grpo import load_config, train
    #            train(load_config("configs/tiny_cpu.yaml", ["--log.out_dir=/tmp/run"]))

One step: sync the actor's weights into the engine, sample `group_size` responses per prompt,
score them, normalise rewards within each group into advantages, and take one optimizer step on
the clipped surrogate. What this GRPO is, precisely:
- advantage = (r - mean_group) / (std_group + eps), std unbiased (as in DeepSeekMath's GRPO);
  groups whose rewards are all exactly equal get advantage 0 (they carry no signal);
- loss = clipped surrogate (PPO), averaged over every response token of the global batch (the
  token-level mean of DAPO), with no KL term and no entropy bonus;
- one optimizer step per rollout, so old_logp is the current policy's own (detached) logp and the
  ratio is 1: the gradient is REINFORCE with group-normalised advantages. The engine's sampling
  logprobs are not used in the loss; their gap to the trainer's is logged as `logp_gap`.
"""

import argparse
import dataclasses
import difflib
import json
import logging
import os
import random
import sys
import time
import typing
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import fsdp_utils
import npu_ops
import rewards
import rollout
import tiny_task
import weight_sync
from fsdp_utils import ModelConfig, OptimConfig
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
class GRPOConfig:
    group_size: int = 8  # G: responses sampled per prompt
    prompts_per_step: int = 32  # over all ranks; each engine group takes an equal slice
    clip_eps: float = 0.2  # PPO ratio clip
    adv_eps: float = 1e-6  # added to the group std
    micro_batch_tokens: int = 8192  # padded tokens per forward/backward on one rank


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


def _closest(name: str, options) -> str:
    match = difflib.get_close_matches(name, list(options), n=1, cutoff=0.0)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _coerce(where: str, value, typ):
    """Convert a YAML or command-line value to the field's type, or fail naming the field."""
    try:
        if typ is bool:
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
                return value.lower() in ("true", "1", "yes")
            if isinstance(value, bool):
                return value
            raise ValueError
        if typ is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(float(value)) if isinstance(value, str) and "e" in value else int(value)
        if typ is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)  # PyYAML reads 1e-6 as a string
        if typ is str:
            if isinstance(value, (dict, list)):
                raise ValueError
            return str(value)
    except (TypeError, ValueError):
        pass
    raise ValueError(f"config {where}: expected {typ.__name__}, got {value!r}")


def load_config(path: str | None = None, overrides: list[str] = ()) -> Config:
    """Defaults < YAML file < `--section.key=value` overrides. Unknown keys and bad types raise."""
    import yaml

    raw = {}
    if path is not None:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"config file not found: {path}")
        with open(path) as f:
            raw = yaml.safe_load(f) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"config {path}: expected sections (model:, optim:, ...) at top level")
    pairs = [(f"{sec}.{key}", val) for sec, body in raw.items()
             for key, val in (body.items() if isinstance(body, dict) else [(None, body)])]
    args = list(overrides)
    while args:
        arg = args.pop(0)
        if not arg.startswith("--") or "." not in arg:
            raise ValueError(f"bad override {arg!r}: use --section.key=value")
        key, eq, val = arg[2:].partition("=")
        if not eq:
            if not args:
                raise ValueError(f"override {arg} has no value")
            val = args.pop(0)
        pairs.append((key, val))

    cfg = Config()
    sections = {f.name: f for f in dataclasses.fields(Config)}
    for dotted, val in pairs:
        sec, _, key = dotted.partition(".")
        if sec not in sections:
            raise ValueError(f"unknown config section '{sec}'{_closest(sec, sections)}")
        if not key or key == "None":
            raise ValueError(f"config section '{sec}' must be a mapping of keys to values")
        section = getattr(cfg, sec)
        hints = typing.get_type_hints(type(section))
        if key not in hints:
            valid = [f"{sec}.{k}" for k in hints]
            raise ValueError(f"unknown config key '{dotted}'{_closest(dotted, valid)}")
        setattr(section, key, _coerce(dotted, val, hints[key]))
    return cfg


def validate(cfg: Config, world_size: int) -> None:
    """Checks that need no model: fail in a second, not after minutes of loading."""
    r, g = cfg.rollout, cfg.grpo

    def need(ok, msg):
        if not ok:
            raise ValueError(f"config: {msg}")

    need(r.tp_size >= 1 and world_size % r.tp_size == 0,
         f"rollout.tp_size={r.tp_size} must divide the world size {world_size}")
    engines = world_size // r.tp_size
    need(g.group_size >= 2, f"grpo.group_size={g.group_size}: needs >= 2 to form an advantage")
    need(g.prompts_per_step % engines == 0,
         f"grpo.prompts_per_step={g.prompts_per_step} must be a multiple of the number of engine "
         f"groups (world {world_size} / rollout.tp_size {r.tp_size} = {engines})")
    need(g.prompts_per_step // engines * g.group_size % r.tp_size == 0,
         "the samples of one engine group (prompts_per_step / engines * group_size) must split "
         f"evenly over its {r.tp_size} tensor-parallel ranks")
    need(r.max_new_tokens < r.max_model_len,
         f"rollout.max_new_tokens={r.max_new_tokens} must be below rollout.max_model_len")
    need(cfg.data.max_prompt_len + r.max_new_tokens <= r.max_model_len,
         f"data.max_prompt_len + rollout.max_new_tokens must be <= rollout.max_model_len "
         f"({cfg.data.max_prompt_len} + {r.max_new_tokens} > {r.max_model_len})")
    need(cfg.data.reward in rewards.REWARDS,
         f"data.reward='{cfg.data.reward}' is not one of {sorted(rewards.REWARDS)}")
    need(r.sleep_level in (1, 2), f"rollout.sleep_level={r.sleep_level}: use 1 or 2")
    need(cfg.optim.schedule in ("constant", "cosine"),
         f"optim.schedule='{cfg.optim.schedule}': use constant or cosine")
    need(cfg.optim.lr > 0 and cfg.train.steps >= 1, "optim.lr and train.steps must be positive")
    for name in ("model.param_dtype", "model.reduce_dtype", "rollout.dtype"):
        sec, key = name.split(".")
        need(isinstance(getattr(torch, getattr(getattr(cfg, sec), key), None), torch.dtype),
             f"{name}='{getattr(getattr(cfg, sec), key)}' is not a torch dtype (e.g. bfloat16)")
    npu_ops.kernel_path(cfg.model.fused_kernels)  # raises on a bad mode or a missing kernel lib
    npu_ops.check_platform(graph_mode=not r.enforce_eager, sleep_level=r.sleep_level)
    if not cfg.data.tiny_task_dir:
        need(os.path.isfile(cfg.data.path), f"data.path='{cfg.data.path}' is not a file")
        need(not cfg.data.eval_path or os.path.isfile(cfg.data.eval_path),
             f"data.eval_path='{cfg.data.eval_path}' is not a file")
        need(cfg.model.path and (os.path.isdir(cfg.model.path) or cfg.model.path.count("/") == 1),
             f"model.path='{cfg.model.path}' is neither a directory nor a hub id (org/name)")


# ----------------------------------------------------------------------------------------------
# the GRPO math: small pure functions on tensors


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """(B*G,) rewards, prompt-major -> (B*G,) advantages, normalised within each group of G."""
    r = rewards.view(-1, group_size)  # (B, G)
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)
    constant = (r == r[:, :1]).all(1, keepdim=True)  # exact test: float noise is not signal
    return torch.where(constant, torch.zeros_like(adv), adv).view(-1)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """(N, T, V) logits, (N, T) targets -> (N, T) log p(target), in fp32."""
    logits = logits.float() / temperature
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)


def grpo_loss(logp, old_logp, adv, mask, clip_eps: float, n_tokens: float) -> torch.Tensor:
    """Clipped surrogate summed over masked tokens and divided by `n_tokens`, the number of
    response tokens in the whole (global) batch: a token-level mean. logp, old_logp, mask:
    (N, T); adv: (N,)."""
    ratio = torch.exp(logp - old_logp)
    adv = adv.unsqueeze(1)  # (N, 1)
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    return -(surrogate * mask).sum() / n_tokens


def pad_batch(samples: list, pad_id: int):
    """Right-pad prompt+response sequences. Returns input_ids (N, T), attention (N, T), targets
    (N, T-1), loss mask (N, T-1) over response tokens, engine logp (N, T-1)."""
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    T = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    attn = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T - 1)
    engine_logp = torch.zeros(len(seqs), T - 1)
    for i, (s, x) in enumerate(zip(samples, seqs)):
        ids[i, :len(x)] = torch.tensor(x)
        attn[i, :len(x)] = 1
        p, n = len(s.prompt_ids), len(s.response_ids)
        mask[i, p - 1:p - 1 + n] = 1  # position t predicts token t+1
        engine_logp[i, p - 1:p - 1 + n] = torch.tensor(s.logp)
    return ids, attn, ids[:, 1:], mask, engine_logp


def plan_micro_batches(lengths: list[int], budget: int) -> list[list[int]]:
    """Group indices, longest first, so each group's (count x max length) fits `budget` tokens."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * lengths[cur[0]] > budget:
            batches.append(cur)
            cur = []
        cur.append(i)
    return batches + [cur] if cur else batches


def policy_update(actor, samples: list, adv: torch.Tensor, cfg: Config, pad_id: int, device) -> float:
    """Forward/backward over this rank's samples in micro-batches; gradients accumulate in the
    actor (the caller steps the optimizer). Every rank must call it (FSDP collectives).
    Returns the summed |trainer logp - engine logp| over response tokens."""
    n_tokens = torch.tensor(float(sum(len(s.response_ids) for s in samples)))
    dist.all_reduce(n_tokens)  # response tokens in the global batch: the loss's denominator
    plan = plan_micro_batches([len(s.prompt_ids) + len(s.response_ids) for s in samples],
                              cfg.grpo.micro_batch_tokens)
    n_micro = torch.tensor(len(plan))
    dist.all_reduce(n_micro, op=dist.ReduceOp.MAX)  # FSDP needs equal forward counts per rank
    plan += [[]] * (int(n_micro) - len(plan))
    actor.train()
    gap_sum = 0.0
    for idx in plan:
        dummy = not idx  # a rank with fewer micro-batches joins the collectives with zero loss
        mb = [samples[i] for i in idx or [0]]
        ids, attn, targets, mask, engine_logp = (t.to(device) for t in pad_batch(mb, pad_id))
        logits = actor(input_ids=ids, attention_mask=attn).logits[:, :-1]  # (n, T-1, V)
        logp = token_logprobs(logits, targets, cfg.rollout.temperature)  # (n, T-1)
        loss = grpo_loss(logp, logp.detach(), adv[idx or [0]].to(device), mask,
                         cfg.grpo.clip_eps, n_tokens.item())
        # FSDP averages gradients over ranks; the loss is already a global mean: undo the average
        (loss * (0.0 if dummy else dist.get_world_size())).backward()
        if not dummy:
            gap_sum += ((logp.detach() - engine_logp).abs() * mask).sum().item()
    return gap_sum


# ----------------------------------------------------------------------------------------------
# the loop


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


def train(cfg: Config) -> dict:
    """Run GRPO for cfg.train.steps steps; returns the last step's metrics."""
    import yaml
    from torch.distributed.device_mesh import init_device_mesh
    from tqdm import tqdm
    from transformers import AutoTokenizer

    # before the engine or any accelerator runtime starts: npu_ops.setup_env says why
    env = npu_ops.setup_env(graph_mode=not cfg.rollout.enforce_eager, sleep_mode=True)
    rank, world = init_distributed()
    device = npu_ops.local_device()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s", force=True)
    validate(cfg, world)
    log.info("device %s, backend %s, world %d", npu_ops.device_type(), npu_ops.dist_backend(), world)
    for name, (value, source) in env.items():
        log.info("env %s=%s (%s)", name, value, source)
    if cfg.data.tiny_task_dir:
        if rank == 0:  # one writer; the others wait (single node or a shared filesystem)
            tiny_task.ensure_tiny_task(cfg.data.tiny_task_dir)
        dist.barrier()
        cfg.model.path = cfg.model.path or os.path.join(cfg.data.tiny_task_dir, "model")
        cfg.data.path = cfg.data.path or os.path.join(cfg.data.tiny_task_dir, "train.jsonl")
        cfg.data.eval_path = cfg.data.eval_path or os.path.join(cfg.data.tiny_task_dir, "test.jsonl")
    out = cfg.log.out_dir
    if rank == 0:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "config.yaml"), "w") as f:
            yaml.safe_dump(dataclasses.asdict(cfg), f, sort_keys=False)

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    examples = load_examples(cfg.data, tokenizer)
    eval_examples = (load_examples(dataclasses.replace(cfg.data, path=cfg.data.eval_path), tokenizer)
                     if cfg.log.eval_every and cfg.data.eval_path else examples)
    reward_fn = rewards.REWARDS[cfg.data.reward]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0  # masked anyway
    tp, G = cfg.rollout.tp_size, cfg.grpo.group_size
    engine_idx, tp_rank, n_engines = rank // tp, rank % tp, world // tp
    per_engine = cfg.grpo.prompts_per_step // n_engines

    # the engine first: building vLLM reseeds torch
    engine = rollout.Engine(cfg.rollout, cfg.model.path, tp_group_index=engine_idx)
    engine.sleep()  # before the actor loads: its memory goes to training until the first sync
    torch.manual_seed(cfg.train.seed)
    mesh = init_device_mesh(npu_ops.device_type(), (world,))
    actor = fsdp_utils.build_actor(cfg.model, mesh)
    opt, sched = fsdp_utils.build_optimizer(cfg.optim, actor, cfg.train.steps)
    done = 0  # steps already taken
    ckpt = fsdp_utils.latest_checkpoint(out) if cfg.train.resume else None
    if ckpt:
        done = fsdp_utils.load_checkpoint(ckpt, actor, opt, sched)
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
            t_step, times = time.perf_counter(), {}
            # 1) rollout: same prompts on the ranks of one engine group, other prompts elsewhere
            start = (step - 1) * cfg.grpo.prompts_per_step + engine_idx * per_engine
            batch = [examples[order[(start + i) % len(examples)]] for i in range(per_engine)]
            sync = weight_sync.push(actor, engine)
            times["sync"], t = sync["seconds"], time.perf_counter()
            seed = (random.Random(f"{cfg.rollout.seed}/{step}/{engine_idx}").getrandbits(48)
                    if cfg.rollout.seed_per_step else None)
            samples = engine.generate([ex["prompt_ids"] for ex in batch], n=G, seed=seed)  # (B*G,)
            times["gen"], t = time.perf_counter() - t, time.perf_counter()
            engine.sleep()  # frees weights + KV cache where the platform can (level 1 offloads)
            times["sleep"], t = time.perf_counter() - t, time.perf_counter()

            # 2) reward: every rank of the engine group scores all of its samples (same result)
            texts = tokenizer.batch_decode([s.response_ids for s in samples],
                                           skip_special_tokens=True)
            group_examples = [ex for ex in batch for _ in range(G)]
            scores, reward_errors = rewards.score(reward_fn, texts, group_examples)
            adv = group_advantages(torch.tensor(scores), G, cfg.grpo.adv_eps)  # (B*G,)
            times["reward"], t = time.perf_counter() - t, time.perf_counter()

            # 3) update: this rank trains on its 1/tp share of the engine group's samples
            mine = list(range(tp_rank, len(samples), tp))
            gap_sum = policy_update(actor, [samples[i] for i in mine], adv[mine], cfg, pad_id, device)
            grad_norm = fsdp_utils.clip_grad_norm(actor, cfg.optim.grad_clip)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            times["train"] = time.perf_counter() - t
            times["step"] = time.perf_counter() - t_step

            # 4) log
            metrics = reduce_metrics([samples[i] for i in mine], [scores[i] for i in mine],
                                     reward_errors if tp_rank == 0 else 0, gap_sum, times)
            metrics.update(step=step, grad_norm=grad_norm, lr=sched.get_last_lr()[0],
                           sync_gb=sync["bytes"] / 2**30, mem_peak_gb=npu_ops.memory_gb()["peak"])
            if cfg.log.eval_every and step % cfg.log.eval_every == 0:
                metrics["eval_reward"] = evaluate(engine, actor, eval_examples, reward_fn, tokenizer,
                                                  engine_idx, n_engines)
            if rank == 0:
                metrics_file.write(json.dumps(metrics) + "\n")
                metrics_file.flush()
                bar.write(format_line(metrics, cfg.train.steps))
                if wandb:
                    wandb.log(metrics, step=step)
                if cfg.log.samples_every and step % cfg.log.samples_every == 0:
                    with open(os.path.join(out, "samples.jsonl"), "a") as f:
                        for ex, text, r in list(zip(group_examples, texts, scores))[::G][:4]:
                            f.write(json.dumps({"step": step, "prompt": ex[cfg.data.prompt_key],
                                                "completion": text, "reward": r,
                                                "answer": ex.get(cfg.data.answer_key)}) + "\n")
            if cfg.log.save_every and step % cfg.log.save_every == 0:
                fsdp_utils.save_checkpoint(out, step, actor, opt, sched, cfg.log.keep_checkpoints)
        fsdp_utils.save_hf(actor, tokenizer, os.path.join(out, "final"))
    finally:
        if metrics_file:
            metrics_file.close()
        engine.shutdown()
        if dist.is_initialized():  # the engine's shutdown may already have destroyed it
            dist.destroy_process_group()
    return metrics


def reduce_metrics(samples: list, scores: list, reward_errors: int, gap_sum: float,
                   times: dict) -> dict:
    """Means over the global batch from each rank's share; every rank must call it."""
    resp = sum(len(s.response_ids) for s in samples)
    sums = torch.tensor([sum(scores), len(samples), resp, sum(len(s.prompt_ids) for s in samples),
                         sum(s.truncated for s in samples), gap_sum, reward_errors],
                        dtype=torch.float64)
    dist.all_reduce(sums)
    reward, n, resp, prompt, truncated, gap, errors = sums.tolist()
    return {"reward_mean": reward / n, "response_len_mean": resp / n,
            "truncated_frac": truncated / n, "reward_errors": int(errors),
            "logp_gap": gap / max(resp, 1), **{f"{k}_time_s": v for k, v in times.items()},
            "tokens_per_s": (prompt + resp) / times["step"]}


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
            f"len {m['response_len_mean']:.1f} | gap {m['logp_gap']:.1e} | "
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
