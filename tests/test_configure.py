"""Changing a built run between steps (train_grpo.configure, the one door): every config field
is either applied to every part that uses it or refused in one line; the refusals' rules; and on
the engine, edits that change the next step, by run.configure and by a direct edit of run.cfg
alike (tests/workers/configure.py)."""

import dataclasses
import types

import pytest

import config
import train_grpo
from conftest import run_python

# Every field of the config tree, decided: applied between steps (its section's LIVE), or built
# into a part at setup (refused). A new field fails test_every_field_is_decided until it is
# added to one of these, and to its section's LIVE if it is live.
APPLIED = {
    "optim.lr", "optim.weight_decay", "optim.beta1", "optim.beta2", "optim.grad_clip",
    "optim.max_nonfinite", "rollout.temperature", "rollout.top_p", "rollout.seed",
    "rollout.seed_per_step", "rollout.partial.round_tokens", "rollout.partial.oversample",
    "rollout.partial.stale", "rollout.partial.max_staleness", "grpo.adv_eps",
    "grpo.scale_adv_by_std", "grpo.adv_mean", "grpo.adv_std", "grpo.reward_agg", "grpo.loss_agg",
    "grpo.clip_low", "grpo.clip_high", "grpo.policy_loss", "grpo.dppo_ratio_cap", "grpo.dppo_anchor",
    "grpo.dual_clip", "grpo.vespo_k_pos", "grpo.vespo_lambda_pos", "grpo.vespo_k_neg",
    "grpo.vespo_lambda_neg", "grpo.sapo_tau_pos", "grpo.sapo_tau_neg", "grpo.entropy_coef",
    "grpo.top_entropy_quantile", "grpo.ppo_epochs", "grpo.mini_batches", "grpo.kl_coef",
    "grpo.kl_estimator", "grpo.kl_unbiased", "grpo.is_correction", "grpo.is_cap",
    "grpo.is_cap_low", "grpo.off_policy_delta", "grpo.dynamic_sampling", "grpo.max_gen_rounds",
    "grpo.overlong", "grpo.overlong_buffer", "grpo.overlong_penalty_factor",
    "grpo.micro_batch_tokens", "grpo.pack", "grpo.logprob_chunk", "distill.loss",
    "distill.coef", "distill.top_k", "distill.reward_coef", "train.steps", "train.stop_at_reward",
    "log.samples_every",
    "log.eval_every", "log.eval_k", "log.eval_examples", "log.save_every",
    "log.keep_checkpoints"
}

REFUSED = {
    "model.path", "model.param_dtype", "model.reduce_dtype", "model.reshard_after_forward",
    "model.gradient_checkpointing", "model.attn_implementation", "model.fused_kernels",
    "model.offload", "model.lora.rank", "model.lora.alpha", "model.lora.dropout",
    "model.lora.train_final_norm",
    "model.lora.target_modules", "model.routing_replay", "model.train_vision", "model.sp_size",
    "optim.warmup_steps", "optim.schedule", "optim.min_lr_ratio", "rollout.tp_size",
    "rollout.dtype", "rollout.max_model_len", "rollout.max_num_seqs",
    "rollout.gpu_memory_utilization", "rollout.kv_cache_memory_bytes", "rollout.enforce_eager",
    "rollout.enable_prefix_caching", "rollout.enable_chunked_prefill", "rollout.block_size",
    "rollout.sleep_level", "rollout.sleep_extra_cleanup", "rollout.matmul_allreduce",
    "rollout.expert_parallel", "rollout.max_new_tokens", "rollout.sync_by",
    "rollout.partial.enabled", "data.path", "data.split", "data.config_name", "data.eval_path",
    "data.eval_split", "data.preset", "data.prompt_key", "data.answer_key",
    "data.prompt_suffix", "data.system_prompt", "data.chat_template", "data.image_key",
    "data.max_pixels",
    "data.max_prompt_len", "data.tiny_task_dir", "data.tiny_task_arch", "data.tiny_task_chat",
    "data.tiny_task_format_steps",
    "reward.funcs", "reward.weights", "reward.timeout_s", "reward.workers",
    "reward.concurrency", "env.name", "env.kind", "env.tool_parser", "env.max_turns",
    "env.max_tokens", "env.timeout_s", "env.workers", "env.concurrency", "env.on_failure",
    "env.reply_role", "env.unsafe_ok", "grpo.group_size", "grpo.prompts_per_step",
    "grpo.shared_prefix",
    "distill.teacher", "distill.dtype", "train.seed", "train.resume", "train.dist_timeout_s",
    "log.out_dir", "log.wandb", "log.wandb_project", "log.run_name", "log.wandb_tags",
    "log.profile_steps"
}


def test_every_field_is_decided():
    names = [name for name, *_ in config.fields(train_grpo.Config())]
    assert set(names) == APPLIED | REFUSED and not APPLIED & REFUSED, (
        set(names) ^ (APPLIED | REFUSED))
    assert config.live_fields(train_grpo.Config()) == APPLIED


def run_of(ref=None):
    """What refusal reads of a run: its reference (None: not built)."""
    return types.SimpleNamespace(ref=ref)


def edited(**changes):
    """The default config with {"section.key": value} changes."""
    cfg = train_grpo.Config()
    for dotted, value in changes.items():
        *path, key = dotted.split(".")
        section = cfg
        for part in path:
            section = getattr(section, part)
        setattr(section, key, value)
    return cfg


@pytest.mark.parametrize("field, value, says", [
    ("model.path", "other", "built its parts with it at setup"),
    ("rollout.max_model_len", 128, "built its parts with it at setup"),
    ("grpo.group_size", 4, "built its parts with it at setup"),
    ("grpo.kl_coef", 0.1, "needs a reference model"),
    ("log.wandb", "online", "built its parts with it at setup"),
])
def test_a_field_a_part_was_built_with_is_refused_in_one_line(field, value, says):
    why = train_grpo.refusal(run_of(), train_grpo.Config(), edited(**{field: value}))
    assert why and "\n" not in why and field in why and says in why and "Fix:" in why, why


def test_what_the_run_can_take_is_not_refused():
    old = train_grpo.Config()
    assert train_grpo.refusal(run_of(), old, edited(**{"grpo.clip_high": 0.28})) is None
    assert train_grpo.refusal(run_of(), old, edited(**{"optim.lr": 3e-6})) is None
    # a KL term where the run built a reference; and back to none
    assert train_grpo.refusal(run_of(ref=object()), old, edited(**{"grpo.kl_coef": 0.1})) is None
    with_kl = edited(**{"grpo.kl_coef": 0.1})
    assert train_grpo.refusal(run_of(), with_kl, train_grpo.Config()) is None
    # the steps of a constant schedule, not of a cosine one (built for the steps it had)
    assert train_grpo.refusal(run_of(), old, edited(**{"train.steps": 500})) is None
    cosine = edited(**{"optim.schedule": "cosine"})
    longer = dataclasses.replace(cosine, train=dataclasses.replace(cosine.train, steps=500))
    assert "cosine" in train_grpo.refusal(run_of(), cosine, longer)
    # two changes: the first refused field is named
    both = edited(**{"optim.lr": 3e-6, "rollout.dtype": "float32"})
    assert "rollout.dtype" in train_grpo.refusal(run_of(), old, both)


@pytest.mark.engine
def test_edits_between_steps_change_the_next_step_or_are_refused(tiny_task_dir, tmp_path):
    proc = run_python(["tests/workers/configure.py", tiny_task_dir, str(tmp_path / "run")])
    assert proc.returncode == 0 and "CONFIGURE_OK" in proc.stdout, proc.stderr[-4000:]
    print(proc.stdout[-3000:])
