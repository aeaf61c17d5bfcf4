"""On-policy distillation: a teacher model's logprob of every token the student sampled, as the
per-token signal (Agarwal et al. 2023, "On-Policy Distillation of Language Models", GKD, arXiv
2306.13649; Qwen3's small models were trained this way).

The student is the actor: it samples as in GRPO. The teacher is a frozen FSDP2 model built like
the reference (fsdp_utils.build_actor(reference=True): sharded over every rank, in its compute
dtype, parked in host memory except during its pass), so a teacher larger than the student fits.
Once a step, after the rollout, it scores the samples the update takes: one pass over them
(logprobs.sample_logprobs: packed rows, the output layer chunked over the vocabulary, one read
back at the end). Each token the model wrote gets the advantage

    coef * (logp_teacher - logp_student) + reward_coef * A_group

with logp_student the engine's logprob of the token (the policy that sampled it): the
sampled-token estimate of -KL(student || teacher), the reverse KL, which the student lowers by
raising the tokens the teacher likes more than it does (distill.loss: reverse_sampled). Both
logprobs are of softmax(logits / rollout.temperature); at rollout.top_p < 1 the student's is over
the nucleus it sampled from, the teacher's over its whole vocabulary. A_group is GRPO's advantage
of the sample (grpo.score); reward_coef 0 is pure distillation, where the rewards are still
computed and logged. The loss is grpo.grpo_loss, unchanged: its advantages are per token
(batcher.Batch.adv), so the surrogate, the mismatch correction and the masks apply as to GRPO's;
tokens an environment wrote get no loss, as always. The teacher's pass is one transform of the batch
(`teach`, batcher.py), after the others.

distill.loss: forward_top_k uses the teacher's whole distribution at each position the student
visited, known by its top_k tokens: the pass keeps each token's k likeliest tokens and their
logprobs, and the loss adds coef * KL(teacher || student) over those k tokens and one bucket for
the rest (logprobs.top_k_forward_kl, inside the fused pass over the vocabulary), weighed as each
token's other terms; the sampled-token advantage is then reward_coef * A_group alone. It is the
supervised signal of GKD's on-policy forward KL: every token the teacher likes gets pulled up at
once, not only the one sampled. On the tiny task it reached the target in far fewer steps than
reverse_sampled, whose estimate moves one sampled token at a time (docs/distillation.md).

With LoRA the teacher stays whole (only the student has adapters); with partial rollout a carried
token's logp_student is that of the version that wrote it; at rollout.tp_size > 1 each rank
scores its own share of the samples.
"""

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from typing import Annotated

import torch

import batcher
import fsdp_utils
import logprobs
import tracking
from config import Anything, BadInput, OneOf, Range


@dataclass
class DistillConfig:
    """The `distill:` section: a teacher whose per-token logprobs train the student."""

    # between steps (train_grpo.configure): these; the teacher is built of the rest
    LIVE = ("loss", "coef", "top_k", "reward_coef")
    # the teacher: a model directory (or hub id) with the student's tokenizer; "": no teacher
    teacher: Annotated[str, Anything("distill.validate: a directory with config.json, or a hub "
                                     "id", refused=("no/such/dir/x",))] = ""
    # reverse_sampled: the per-token advantage coef * (teacher - student logprob of the sampled
    # token); forward_top_k: coef * the forward KL to the teacher's top_k tokens, in the loss
    loss: Annotated[str, OneOf("reverse_sampled", "forward_top_k")] = "reverse_sampled"
    coef: Annotated[float, Range(0)] = 1.0  # the weight of the teacher's per-token signal
    top_k: Annotated[int, Range(1)] = 32  # forward_top_k: the teacher's tokens kept per token
    # the weight of GRPO's group advantage beside it: 0, pure distillation
    reward_coef: Annotated[float, Range(0)] = 0.0
    # the teacher's compute dtype; "": model.param_dtype
    dtype: Annotated[str, OneOf("", "bfloat16", "float16", "float32")] = ""

    def check(self, cfg, world_size: int) -> None:
        """config.validate's call: the teacher's path and its signal (`validate`)."""
        validate(self, cfg.grpo.dynamic_sampling)

    def check_model(self, cfg, text: dict) -> None:
        """config.check_model's call: the teacher's tokenizer is the student's (`check_files`)."""
        try:
            check_files(self, cfg.model.path)
        except ValueError as e:
            raise BadInput(str(e)) from None


def validate(cfg: DistillConfig, dynamic_sampling: bool) -> None:
    """The section across its fields and grpo's, before any model loads: a one-line ValueError
    naming the field and the fix."""
    teacher = cfg.teacher
    if not teacher:
        return
    if not os.path.isdir(teacher) and teacher.count("/") != 1:
        raise ValueError(f"distill.teacher='{teacher}' is neither a directory nor a hub id "
                         "(org/name). Fix: the directory of a trained model (runs/tiny_cpu/final "
                         "comes from: torchrun --nproc_per_node 2 train_grpo.py --config "
                         "configs/tiny_cpu.yaml)")
    if os.path.isdir(teacher) and not os.path.isfile(os.path.join(teacher, "config.json")):
        raise ValueError(f"distill.teacher='{teacher}' has no config.json: not a Hugging Face "
                         "model directory. Fix: point it at the directory with config.json")
    if cfg.coef == 0 and cfg.reward_coef == 0:
        raise ValueError("distill.coef=0 and distill.reward_coef=0: no token gets a signal. Fix: "
                         "distill.coef=1.0 (the teacher's), or distill.teacher='' (no teacher)")
    if dynamic_sampling and cfg.reward_coef == 0:
        raise ValueError("grpo.dynamic_sampling=true with distill.reward_coef=0: it drops the "
                         "groups whose rewards are equal, which still carry the teacher's signal. "
                         "Fix: grpo.dynamic_sampling=false, or distill.reward_coef > 0")


def check_files(cfg: DistillConfig, student: str) -> None:
    """The teacher's files against the student's (`student`: model.path), reading config.json and
    the tokenizers, no weights: the same vocabulary and special tokens, and an output layer that
    covers it. A one-line ValueError naming distill.teacher. A hub id is left to the loaders;
    the path itself is `validate`'s."""
    from transformers import AutoTokenizer

    teacher = cfg.teacher
    if not (teacher and os.path.isdir(teacher) and os.path.isdir(student)):
        return
    mine, theirs = (AutoTokenizer.from_pretrained(p) for p in (student, teacher))
    if mine.get_vocab() != theirs.get_vocab():
        raise ValueError(f"distill.teacher='{teacher}': its tokenizer's vocabulary differs from "
                         f"model.path's ({len(theirs)} vs {len(mine)} tokens): the teacher must "
                         "score the student's token ids. Fix: a teacher of the same tokenizer")
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if getattr(mine, name) != getattr(theirs, name):
            raise ValueError(f"distill.teacher='{teacher}': its {name} is "
                             f"{getattr(theirs, name)}, model.path's {getattr(mine, name)}. "
                             "Fix: a teacher of the same tokenizer")
    with open(os.path.join(teacher, "config.json")) as f:
        text = json.load(f)
    vocab = text.get("text_config", text).get("vocab_size", len(mine))
    if vocab < len(mine):
        raise ValueError(f"distill.teacher='{teacher}': its output layer has {vocab} rows for "
                         f"{len(mine)} tokens. Fix: a teacher of the same tokenizer")


def build_teacher(cfg: DistillConfig, model: fsdp_utils.ModelConfig, mesh) -> torch.nn.Module:
    """The teacher: a frozen FSDP2 model sharded over `mesh` as the reference is (the actor's
    model settings, its own path and dtype, no adapters), parked in host memory."""
    spec = dataclasses.replace(model, path=cfg.teacher, lora=fsdp_utils.LoraConfig(),
                               param_dtype=cfg.dtype or model.param_dtype)
    return fsdp_utils.build_actor(spec, mesh, reference=True)


def shard_bytes(model: torch.nn.Module) -> int:
    """This rank's bytes of the model's parameters (its FSDP2 shards), wherever they are kept."""
    return sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
               for p in model.parameters())


def token_advantages(samples: list, adv: list, teacher_logp: list, cfg: DistillConfig) -> list:
    """Each sample's per-token advantages, (n_i,) tensors: coef * (teacher - engine logprob) +
    reward_coef * its group advantage (adv: per sample, (n_i,) per token), at every response
    token (the loss masks those an environment wrote); forward_top_k: the second term alone (the
    teacher's is in the loss). fp32, or fp64 where the teacher's logprobs are (tests)."""
    out, coef = [], cfg.coef if cfg.loss == "reverse_sampled" else 0.0
    for s, a, t in zip(samples, adv, teacher_logp):
        engine = torch.tensor(s.logp, dtype=torch.float64)
        x = coef * (t.double() - engine) + cfg.reward_coef * a.double()
        out.append(x.to(torch.promote_types(t.dtype, torch.float32)))
    return out


def teach(batch: batcher.Batch, teacher, cfg: DistillConfig,
          passes: logprobs.Passes) -> batcher.Batch:
    """A batch transform (batcher.py): the teacher's pass over the batch's samples; their
    per-token advantages (`token_advantages`, from the batch's group advantages); with
    distill.loss forward_top_k, the teacher's top k for the loss's forward KL
    (batcher.TeacherTopK); and its metrics: the mean reverse KL to the teacher over the tokens the
    model wrote (distill_kl, the sampled estimate in either mode), the pass's seconds and this
    rank's teacher bytes. passes: how the pass runs (the update's), over the
    teacher's full softmax whatever rollout.top_p: the teacher samples nothing, and the KL is
    to its distribution (the student's side, the engine's logprob, is of the nucleus it
    sampled from). Every rank calls it (FSDP collectives)."""
    t, samples = time.perf_counter(), batch.samples
    k = cfg.top_k if cfg.loss == "forward_top_k" else 0
    # the actor's shared prefix where the teacher takes it (another architecture may not)
    shared = "off" if fsdp_utils.unshared(teacher) else passes.shared_prefix
    with torch.profiler.record_function("step:teacher"), fsdp_utils.reference(teacher):
        teacher_logp, top_logp, top_ids = logprobs.sample_top_k(
            teacher, samples, dataclasses.replace(passes, top_p=1.0, shared_prefix=shared), k,
            split=batch.split)
    seconds = time.perf_counter() - t
    engine = batcher.written(samples, [torch.tensor(s.logp, dtype=torch.float64)
                                    for s in samples])  # the model's tokens only
    taught = batcher.written(samples, teacher_logp)
    kl = sum(float((e.double() - lp.double()).sum()) for e, lp in zip(engine, taught))
    tokens = sum(len(e) for e in engine)
    return dataclasses.replace(
        batch, adv=token_advantages(samples, batch.adv, teacher_logp, cfg),
        teacher=batcher.TeacherTopK(top_ids, top_logp, cfg.coef) if k else None,
        metrics={**batch.metrics, "distill_kl": tracking.Mean(kl, tokens),
                 "teacher_time_s": seconds, "teacher_gb": shard_bytes(teacher) / 2**30})
