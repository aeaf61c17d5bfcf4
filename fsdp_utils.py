"""The actor: build and shard it with FSDP2, its attention for packed rows, the model families
it knows, and its optimizer and schedule. Moving it to host memory is offload.py's; checkpoints
and the export are checkpoint.py's.

FSDP2 idioms (after torchtitan): build on the meta device, `fully_shard` every decoder layer and
then the root, materialise shards with `to_empty`, and fill them from one full copy read on rank 0
(`broadcast_from_rank0`), so a node never holds world_size copies of the checkpoint in memory.
Parameters stay fp32 (the optimizer's master copy); `MixedPrecisionPolicy` casts them for compute.
"""

import contextlib
import dataclasses
import logging
import math
import os
from dataclasses import dataclass, field
from typing import Annotated

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.optim.adam import adam

import checkpoint
from modeling import hybrid, kernels, moe, seq_parallel, vision
import npu_ops
import offload
from config import DTYPE, FLAG, Anything, BadInput, Items, OneOf, Range, need

log = logging.getLogger("grpo")


# The decoder's linear layers, by their Hugging Face names in the families we know (FAMILIES):
# where LoRA adapters may go (vLLM's LoRA layers take these, packed as qkv and gate_up).
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# a hybrid's (Qwen3.5's) Gated DeltaNet projections: named in model.lora.target_modules, not
# adapted by default
LORA_MODULES_LINEAR = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")


@dataclass
class LoraConfig:
    LIVE = ()  # between steps (train_grpo.configure): none, built into the actor
    # adapters of this rank on a frozen base (peft); 0: off, every weight trained
    rank: Annotated[int, Range(0, 512)] = 0
    alpha: Annotated[float, Range(0, lo_open=True)] = 16.0  # the update is scaled by alpha / rank
    dropout: Annotated[float, Range(0, 1, hi_open=True)] = 0.0  # on the adapters' input
    # the decoder's linear layers that get adapters (a hybrid's Gated DeltaNet ones where named)
    target_modules: Annotated[list[str], Items(OneOf(*LORA_MODULES, *LORA_MODULES_LINEAR))] = \
        field(default_factory=lambda: list(LORA_MODULES))
    # the final norm (before the output layer) trains in full beside the adapters, and each push
    #   writes it into the engine's base (vLLM's LoRA covers no norm): with a frozen norm and
    #   output layer the adapters cannot scale the logits (docs/lora.md says when that binds)
    train_final_norm: Annotated[bool, FLAG] = False

    def check(self, cfg, world_size: int) -> None:
        """config.validate's call: adapters name the layers they go on; a final norm that
        trains beside adapters, with adapters and without a reference (the base is the
        reference with adapters, and this norm would no longer be the base's)."""
        need(not self.rank or self.target_modules, "model.lora.target_modules is empty with "
             "model.lora.rank > 0. Fix: name the layers that get adapters, e.g. "
             f"[{', '.join(LORA_MODULES)}]")
        need(not self.train_final_norm or self.rank, "model.lora.train_final_norm=true without "
             "adapters (model.lora.rank=0): every weight trains already. Fix: "
             "model.lora.train_final_norm=false, or model.lora.rank > 0")
        need(not self.train_final_norm or cfg.grpo.kl_coef == 0, "model.lora.train_final_norm="
             f"true with grpo.kl_coef={cfg.grpo.kl_coef}: the reference is the actor with its "
             "adapters off, and its final norm would be the trained one, not the base's. Fix: "
             "grpo.kl_coef=0, or model.lora.train_final_norm=false")


@dataclass
class ModelConfig:
    LIVE = ()  # between steps (train_grpo.configure): none, built into the actor and engine
    # local directory or hub id of a HF causal LM (Qwen2/Qwen3 tested)
    path: Annotated[str, Anything("config.validate: a directory with config.json, or a hub id",
                                  refused=("no/such/dir/x",))] = ""
    param_dtype: Annotated[str, DTYPE] = "bfloat16"  # compute dtype (MixedPrecisionPolicy)
    reduce_dtype: Annotated[str, DTYPE] = "float32"  # gradient reduce-scatter dtype
    reshard_after_forward: Annotated[bool, FLAG] = True  # True = ZeRO-3; False = ZeRO-2
    #   (faster below ~7B)
    gradient_checkpointing: Annotated[bool, FLAG] = False  # recompute activations in backward
    # auto: npu_ops picks the platform's fused attention; else a name transformers knows
    attn_implementation: Annotated[str, OneOf(
        "auto", "sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention",
        "packed_sdpa", "npu_fusion")] = "auto"
    # see kernels.kernel_path
    fused_kernels: Annotated[str, OneOf("auto", "fused", "compiled", "reference", "off")] = "auto"
    # params + optimizer state in host memory while the engine generates: auto = on where the
    # engine sleeps on an accelerator beside the actor, off on CPU
    offload: Annotated[str, OneOf("auto", "on", "off")] = "auto"
    lora: LoraConfig = field(default_factory=LoraConfig)  # adapters on a frozen base
    # a mixture of experts: the actor's passes route each token by the experts the engine chose
    #   for it, its gates from its own router (moe.py); where the engine returns its routing
    routing_replay: Annotated[bool, FLAG] = False
    # prompts with images (data.image_key): the vision tower trains too (else frozen)
    train_vision: Annotated[bool, FLAG] = False
    # sequence parallel (Ulysses): this many consecutive ranks share each packed row of the
    #   update, 1/sp of its tokens each, attention over all tokens for 1/sp of the heads
    sp_size: Annotated[int, Range(1)] = 1

    def check(self, cfg, world_size: int) -> None:
        """The section against the run, before any model loads (config.validate calls it): a
        mixture of experts' options where they can work (whether the model has experts:
        check_model), sequence parallelism where it is built (packed rows, an attention that
        takes a row's boundaries), the kernels and attention this platform has, and path a
        model directory or a hub id."""
        r = cfg.rollout
        need(not r.expert_parallel or r.tp_size > 1, "rollout.expert_parallel=true with "
             "rollout.tp_size=1: one rank holds every expert anyway. Fix: rollout.tp_size > 1")
        need(not self.routing_replay or not (cfg.env.name or r.partial.enabled),
             "model.routing_replay=true with episodes (env.name) or partial rollout: a sample "
             "written over several engine calls carries no routing yet. Fix: "
             "model.routing_replay=false, or one-turn samples")
        if (sp := self.sp_size) > 1:
            need(world_size % sp == 0, f"model.sp_size={sp} must divide the world size "
                 f"{world_size}")
            need(cfg.grpo.pack, f"model.sp_size={sp} with grpo.pack=false: sequence parallel "
                 "splits packed rows. Fix: grpo.pack=true")
            attn = npu_ops.attention_implementation(self.attn_implementation)
            need(attn in ("sdpa", "packed_sdpa", npu_ops.FUSION_ATTENTION),
                 f"model.sp_size={sp} with attention {attn!r}: Ulysses wraps packed_sdpa or the "
                 "platform's fused attention. Fix: model.attn_implementation=auto")
        kernels.kernel_path(self.fused_kernels)  # a bad mode, or a missing kernel library
        npu_ops.attention_implementation(self.attn_implementation)  # likewise
        npu_ops.check_experts(r.expert_parallel, self.routing_replay)  # what the engine returns
        path = self.path
        need(path and (os.path.isdir(path) or path.count("/") == 1),
             f"model.path='{path}' is neither a directory nor a hub id (org/name)")
        need(not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")),
             f"model.path='{path}' has no config.json: not a Hugging Face model directory. Fix: "
             "point model.path at the directory with config.json and the weights")

    def check_model(self, cfg, text: dict) -> None:
        """sp_size against the model's attention heads, a mixture of experts' options against a
        model that has experts, what a hybrid model cannot do yet (hybrid.check), and adapters
        on a family we know (`text`: the model's config.json, its language part).
        config.check_model calls it."""
        heads, kind = text.get("num_attention_heads"), text.get("model_type")
        if self.sp_size > 1 and heads:
            try:
                seq_parallel.kv_copies(heads, text.get("num_key_value_heads") or heads,
                                       self.sp_size)
            except ValueError as e:
                raise BadInput(f"config: {e}") from None
        for name, on in (("model.routing_replay", self.routing_replay),
                         ("rollout.expert_parallel", cfg.rollout.expert_parallel)):
            need(not on or moe.is_moe(text), f"{name}=true on a {kind!r} model, which has no "
                 f"experts. Fix: {name}=false")
        if not cfg.data.image_key:  # (with images the whole model trains: data's check)
            self._check_language_model()
        hybrid.check(text, self.sp_size, cfg.rollout.dtype, cfg.grpo.shared_prefix)
        need(not self.lora.rank or kind in FAMILIES, f"model.lora.rank={self.lora.rank} on a "
             f"{kind!r} model: adapters go on the linear layers fsdp_utils.LORA_MODULES names, "
             f"in the families of fsdp_utils.FAMILIES ({', '.join(FAMILIES)}). Fix: add the "
             "family's row (and its layers' names), or model.lora.rank=0")
        if self.lora.rank:
            self._check_targets(text)

    def _check_targets(self, text: dict) -> None:
        """Adapter targets the model has and the push can deliver (`text`: config.json's
        language part): Gated DeltaNet projections on a hybrid only (elsewhere they would match
        nothing); on a mixture of experts, no MLP names (peft would put them on the fused
        experts, whose adapters the push does not send to vLLM's fused-MoE LoRA layers), and
        not on CPU (npu_ops.check_moe_lora)."""
        targets, kind = self.lora.target_modules, text.get("model_type")
        linear = sorted(set(targets) & set(LORA_MODULES_LINEAR))
        need(not linear or hybrid.has_linear_attention(text),
             f"model.lora.target_modules has {', '.join(linear)}, which a {kind!r} model has "
             "not (a hybrid's Gated DeltaNet projections): they would match nothing. Fix: "
             "leave them out")
        if moe.is_moe(text):
            mlp = sorted(set(targets) & {"gate_proj", "up_proj", "down_proj"})
            need(not mlp, f"model.lora.target_modules has {', '.join(mlp)} on a mixture of "
                 f"experts ({kind}): peft puts them on the fused experts, whose adapters the "
                 "push does not send to the engine's fused-MoE LoRA layers. Fix: the attention "
                 "projections only, e.g. [q_proj, k_proj, v_proj, o_proj]")
            try:
                npu_ops.check_moe_lora()
            except ValueError as e:
                raise BadInput(f"config: {e}") from None

    def _check_language_model(self) -> None:
        """A vision-language checkpoint (config.json with a vision_config: every Qwen3.5 release
        is one) trains its language model: transformers builds it alone from the checkpoint
        (AutoModelForCausalLM), the push names its weights as the checkpoint does
        (checkpoint.language_prefix), adapters too, and the export puts them back beside the
        vision tower. Refused in one line where transformers has no language model alone for
        the family."""
        import json

        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        with open(os.path.join(self.path, "config.json")) as f:
            top = json.load(f)
        if "vision_config" not in top:
            return
        kind = top.get("model_type")
        need(kind in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, f"model.path: {self.path} is a "
             f"vision-language checkpoint ({kind}) whose language model transformers does not "
             "build alone (AutoModelForCausalLM). Fix: a checkpoint of the language model alone")

    def check_host_memory(self, cfg, world_size: int) -> None:
        """BadInput if this node's ranks cannot hold in host memory the actor and its Adam state
        (with offload), the reference (with grpo.kl_coef > 0) and the teacher (with
        distill.teacher); the bytes come from the models' config.json
        (offload.host_bytes_per_rank), not their weights. config.check_host_memory calls it."""
        compute, lora = getattr(torch, self.param_dtype), self.lora.rank > 0
        ref_dtype = compute if cfg.grpo.kl_coef > 0 and not lora else None  # LoRA: the base
        on, teacher = offload.enabled(self.offload), cfg.distill.teacher
        if not (on or ref_dtype or teacher):
            return
        tower = ("" if not cfg.data.image_key else "trained" if self.train_vision else "frozen")
        need_bytes = offload.host_bytes_per_rank(self.path, world_size, on, ref_dtype,
                                                 compute if lora else None, tower)
        if os.path.isdir(teacher):  # parked like a reference, in its own dtype
            need_bytes += offload.host_bytes_per_rank(teacher, world_size, False, getattr(
                torch, cfg.distill.dtype or self.param_dtype))
        try:
            offload.check_host_memory(need_bytes, int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                                      offload.host_memory_available())
        except ValueError as e:
            raise BadInput(str(e)) from None


@dataclass
class OptimConfig:
    # between steps (train_grpo.configure): these; the schedule is built of the rest
    LIVE = ("lr", "weight_decay", "beta1", "beta2", "grad_clip", "max_nonfinite")
    lr: Annotated[float, Range(0, 1, lo_open=True)] = 1e-6  # AdamW's peak learning rate
    weight_decay: Annotated[float, Range(0, 1)] = 0.0  # AdamW's decoupled weight decay
    beta1: Annotated[float, Range(0, 1, hi_open=True)] = 0.9  # AdamW's first-moment decay
    beta2: Annotated[float, Range(0, 1, hi_open=True)] = 0.999  # second-moment decay
    warmup_steps: Annotated[int, Range(0)] = 0  # linear warmup from 0 to lr
    # constant | cosine (after warmup, down to min_lr_ratio * lr)
    schedule: Annotated[str, OneOf("constant", "cosine")] = "constant"
    min_lr_ratio: Annotated[float, Range(0, 1)] = 0.0  # cosine: the last step's lr / lr
    grad_clip: Annotated[float, Range(0)] = 1.0  # max global grad norm; 0 disables
    # optimizer steps in a row whose loss or grad norm is not finite (each skipped: no change
    #   to the parameters or the optimizer's state) before the run stops (faults.py)
    max_nonfinite: Annotated[int, Range(1)] = 3


# Packed micro-batches (grpo.pack): several samples in one row, position ids restarting at 0 for
# each, no padding; attention must stay within a sample. The trainer passes the row's boundaries
# from the host (logprobs.micro_batch: cu_seq_lens_q/k, max_length_q/k, as transformers' flash
# attention takes them), so no layer reads them back from the device. flash_attention_2
# (transformers' integrations for both accelerators; npu_ops.attention_implementation picks it)
# runs its varlen kernels on them (not run here). Elsewhere the actor uses "packed_sdpa":
# transformers' sdpa for padded batches, and for a packed row, each sample's queries, keys and
# values scattered into a padded (samples, heads, longest, dim) block and run causally: attention
# costs what padding costs, everything else (projections, MLP, output layer) runs on real tokens
# only. transformers' own packed sdpa path would build a dense (tokens x tokens) mask instead.


def packed_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                position_ids=None, cu_seq_lens_q=None, max_length_q=None, **kwargs):
    """A transformers attention function; query (1, heads, N, dim) for a packed row. Its
    boundaries: cu_seq_lens_q (samples + 1,) and max_length_q (an int) when given, else read from
    the position ids (two reads back to the host per layer); a row whose groups share their
    prompt (kwargs' shared_segments: logprobs.shared_row) goes to shared_sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (segments := kwargs.get("shared_segments")) is not None:
        return shared_sdpa(module, query, key, value, segments, scaling, dropout)

    if attention_mask is not None and attention_mask.dim() == 2:  # (B, T): 1 = token, 0 = pad
        T = attention_mask.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=query.device).tril()
        attention_mask = causal & attention_mask.bool()[:, None, None, :]  # (B, 1, T, T)
    if attention_mask is not None or position_ids is None or query.shape[0] != 1:
        # padded batches come right-padded and unmasked: causally, no token sees the padding
        # after it, and padded positions carry no loss
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    window = kwargs.get("sliding_window")
    pos = position_ids[0]  # (N,): 0, 1, ... for each sample in turn
    seq = (pos == 0).cumsum(0) - 1  # (N,) each token's sample
    if cu_seq_lens_q is not None and max_length_q is not None:
        n, longest = cu_seq_lens_q.shape[0] - 1, int(max_length_q)
    else:
        n, longest = int(seq[-1]) + 1, int(pos.max()) + 1
    if window is not None and window < longest:
        raise ValueError(f"packed_sdpa: sliding window {window} < sample length {longest}")

    def pad(x):  # (1, h, N, d) -> (n, h, longest, d)
        out = x.new_zeros(n, x.shape[1], longest, x.shape[3])
        out[seq, :, pos] = x[0].transpose(0, 1)
        return out

    out = torch.nn.functional.scaled_dot_product_attention(
        pad(query), pad(key), pad(value), is_causal=True, scale=scaling,
        dropout_p=dropout if module.training else 0.0, enable_gqa=key.shape[1] != query.shape[1])
    return out[seq, :, pos].unsqueeze(0), None  # (1, N, h, d), as transformers' sdpa returns


def shared_sdpa(module, query, key, value, segments: dict, scaling=None, dropout=0.0):
    """Attention over a packed row whose groups hold their prompt once (logprobs.shared_row):
    query (1, h, N, d), key and value (1, h_kv, N, d). Each prompt attends causally to itself;
    each response to its prompt's keys and values, gathered in front of its own, and causally
    to its own: bottom-right alignment, segments["keep"] (logprobs.segment_layout). Only keys and
    values are gathered (a response's prompt K/V, once per response); their gradients add up
    over the group's responses as the gather's backward sums them. Returns (1, N, h, d)."""
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # (N, h, d)
    gqa, drop = key.shape[1] != query.shape[1], dropout if module.training else 0.0
    out = q.new_zeros(q.shape)  # (N, h, d): every position written once, below

    def attend(rows, kv_rows, **mask):  # (S, L) positions -> (S, L, h, d)
        return torch.nn.functional.scaled_dot_product_attention(
            q[rows].transpose(1, 2), k[kv_rows].transpose(1, 2), v[kv_rows].transpose(1, 2),
            scale=scaling, dropout_p=drop, enable_gqa=gqa, **mask).transpose(1, 2)

    for rows, real, kv, mask in (
            (segments["prompt"], segments["prompt_real"], segments["prompt"],
             {"is_causal": True}),
            (segments.get("query"), segments.get("query_real"), segments.get("kv"),
             {"attn_mask": segments.get("keep")})):
        if rows is not None:
            out = out.index_put((rows[real],), attend(rows, kv, **mask)[real])
    return out[None], None


packed_sdpa.shares_prefix = True  # rows whose groups hold their prompt once (trainer.shared_prefix)


def unshared(model) -> str | None:
    """Why `model` cannot take rows whose groups hold their prompt once (logprobs.shared_row),
    one phrase, or None: linear-attention layers (a response would start from a recurrent state
    its prompt never wrote), or an attention function without `shares_prefix` (packed_sdpa's
    is True)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if hybrid.has_linear_attention(model.config):
        return ("does not carry a prompt's recurrent state into its responses (the model's "
                "linear-attention layers)")
    config = getattr(model.config, "text_config", None) or model.config
    attn = getattr(config, "_attn_implementation", None) or ""
    if not getattr(ALL_ATTENTION_FUNCTIONS.get(attn), "shares_prefix", False):
        return f"needs an attention that takes shared rows, which {attn} does not"
    return None


def register_attention(attn: str, split=None) -> str:
    """The attn_implementation to build the actor with: "sdpa" becomes "packed_sdpa" (sdpa that
    packed rows can use); "packed_sdpa" and npu_ops' fused attention are registered with
    transformers. Neither has a mask function of its own, so transformers builds no mask for them
    and hands them the attention_mask as given (None, or a (B, T) padding mask they make causal
    themselves): with a mask function, transformers 5.19's create_causal_mask reads the position
    ids back to the host once per forward (masking_utils.find_packed_sequence_indices). split
    (seq_parallel.Split): the same, inside Ulysses' all-to-alls, as "ulysses_<name>"."""
    from transformers import AttentionInterface

    attn = "packed_sdpa" if attn == "sdpa" else attn
    if attn == "packed_sdpa":
        AttentionInterface.register(attn, packed_sdpa)
    elif attn == npu_ops.FUSION_ATTENTION:
        AttentionInterface.register(attn, npu_ops.fusion_attention)
    if split is not None:
        inner = packed_sdpa if attn == "packed_sdpa" else npu_ops.fusion_attention
        AttentionInterface.register(f"ulysses_{attn}", seq_parallel.attention(inner, split.group))
        attn = f"ulysses_{attn}"
    return attn


# Model families, by config.json's model_type: where the decoder layers are (one FSDP unit each),
# the names under which a tied model's shared embedding is the input embedding and the output
# layer (weight_sync sends it under both), and whether npu_ops' fused kernels (RMSNorm, SwiGLU MLP,
# rotary embedding) are written for it. A model_type not listed gets the defaults (the names most
# Hugging Face decoder-only models use) and no fused kernels. To train another family, add a row.
@dataclass(frozen=True)
class Family:
    layers: str = "model.layers"
    embedding: str = "model.embed_tokens.weight"
    output: str = "lm_head.weight"
    norm: str = "model.norm.weight"  # the final norm, before the output layer
    fused_kernels: bool = False  # kernels.patch_qwen applies


FAMILIES = {
    "qwen2": Family(fused_kernels=True),
    "qwen3": Family(fused_kernels=True),
    "qwen3_5_moe_text": Family(),  # its mixture-of-experts form (moe.py)
    "qwen3_5_text": Family(),  # Qwen3.5's language model: Gated DeltaNet packed by hybrid.py
    # vision-language models whole (prompts with images: build_actor(images=True))
    **{kind: Family(layers="model.language_model.layers",
                    embedding="model.language_model.embed_tokens.weight",
                    norm="model.language_model.norm.weight")
       for kind in ("qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe")},
    "llama": Family(),
    "mistral": Family(),
}


WRAPPER_PREFIXES = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def hf_name(name: str) -> str:
    """A parameter's or module's Hugging Face name: without the prefixes that torch.compile,
    activation checkpointing or FSDP1 wrappers add (FSDP2 keeps the names as they are)."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


def family(model_type: str) -> Family:
    return FAMILIES.get(model_type, Family())


def patch_kernels(model: torch.nn.Module, mode: str) -> list[str]:
    """model.fused_kernels applied to `model` (kernels.kernel_path says which path); returns
    what was done, for the log. `auto` patches only the families whose row says the kernels are
    written for them and leaves any other model as transformers builds it."""
    path = kernels.kernel_path(mode)
    kind = model.config.model_type
    if path is None:
        return ["none"]
    if mode == "auto" and not family(kind).fused_kernels:
        return [f"none (fused kernels are not written for model_type {kind!r}; left as "
                "transformers builds it)"]
    return kernels.patch_qwen(model, path)  # explicit fused/reference: raises for other models


def adapt_to_checkpoint(model: torch.nn.Module, path: str, hf_cfg, images: bool = False) -> None:
    """What the model built from `path` needs beyond transformers' class: a hybrid's Gated
    DeltaNet layers patched for packed rows (hybrid.patch), and a vision-language checkpoint's
    naming and path kept on the model for the push and the export (`checkpoint_prefix`,
    `checkpoint_path`). images: the model is the whole vision-language model, named as
    transformers names it (vision.patch keeps the packed row's boundaries from its tower)."""
    if hybrid.patch(model):  # Gated DeltaNet layers: each sample of a packed row apart
        log.info("linear attention: Gated DeltaNet, packed rows split by hybrid.py")
    if images:
        vision.patch(model)
        model.checkpoint_prefix, model.checkpoint_path = "model.", None
        log.info("a vision-language model with its tower (%s)", type(model).__name__)
        return
    model.checkpoint_prefix = checkpoint.language_prefix(path, hf_cfg)
    # a vision-language checkpoint: the push sends its other tensors from its files
    model.checkpoint_path = path if hasattr(hf_cfg, "vision_config") else None
    if model.checkpoint_prefix != "model.":
        log.info("a vision-language checkpoint: its language model trains, named %s* there",
                 model.checkpoint_prefix)


def units(model: torch.nn.Module, model_type: str, images: bool, train_vision: bool) -> list:
    """The modules build_actor makes FSDP2 units of, under the whole model's: each decoder layer,
    and with images the vision tower (frozen unless train_vision)."""
    out = list(model.get_submodule(family(model_type).layers))
    if images:
        out.append(vision.tower(model))
        vision.tower(model).requires_grad_(train_vision)
    return out


def experts_kernel(hf_cfg, param_dtype: str) -> dict:
    """A mixture of experts' kernel, by the compute dtype, as transformers' from_config takes it
    ({} for a model without experts)."""
    if not moe.is_moe(hf_cfg):
        return {}
    kernel, why = npu_ops.experts_implementation(getattr(torch, param_dtype))
    log.info("experts: %s (%s)", kernel, why)
    return {"experts_implementation": kernel}


def build_actor(cfg: ModelConfig, mesh, reference: bool = False, images: bool = False,
                train_vision: bool = False) -> torch.nn.Module:
    """Load a HF causal LM, shard it over `mesh` with FSDP2 and return it (params fp32).
    reference=True: a frozen copy for the KL term instead: params stored in the compute dtype
    (nothing to update, so no fp32 master copy), no gradients, and moved to host memory
    (offload.to_host) between its forward passes. With model.lora: adapters on a frozen base held
    in the compute dtype (add_adapters), rank 0's initial adapters sent to every rank.
    images=True, on a vision-language checkpoint: the whole model, for prompts with images
    (`units`; vision.patch); else such a checkpoint's language model alone."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    hf_cfg = AutoConfig.from_pretrained(cfg.path)
    images = images and vision.is_vision_language(hf_cfg)
    # a vision-language checkpoint's language part, unless the images need the whole model
    text = hf_cfg if images else checkpoint.language_config(hf_cfg)
    auto = AutoModelForImageTextToText if images else AutoModelForCausalLM
    attn = npu_ops.attention_implementation(cfg.attn_implementation)
    split = seq_parallel.split(cfg.sp_size)  # sequence parallel: this rank's group, or None
    attn = register_attention(attn, split)
    lora = cfg.lora.rank > 0 and not reference
    dtype = getattr(torch, cfg.param_dtype) if reference or lora else torch.float32
    experts = experts_kernel(hf_cfg, cfg.param_dtype)
    with torch.device("meta"):
        model = auto.from_config(text, dtype=dtype, attn_implementation=attn, **experts)
    adapt_to_checkpoint(model, cfg.path, hf_cfg, images)
    if lora:
        add_adapters(model, cfg.lora)
    patched = patch_kernels(model, cfg.fused_kernels)  # (the MLP's calls its projections)
    log.info("%s: attention %s; kernels: %s", "reference" if reference else "actor", attn,
             "; ".join(patched))
    full = None
    if dist.get_rank() == 0:
        full = auto.from_pretrained(cfg.path, config=text, dtype=dtype, **experts)
        if lora:  # the adapters' initial values: lora_A random (this rank's RNG), lora_B 0
            add_adapters(full, cfg.lora)
    if cfg.gradient_checkpointing and not reference:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, cfg.param_dtype),
                              reduce_dtype=getattr(torch, cfg.reduce_dtype))
    for unit in units(model, text.model_type, images, train_vision and not reference):
        fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=cfg.reshard_after_forward)
    model.to_empty(device=npu_ops.local_device())
    set_model_state_dict(model, full.state_dict() if full is not None else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    # Buffers that are not in the checkpoint (rotary inv_freq) were left uninitialised by
    # to_empty: take rank 0's freshly constructed ones.
    ref = dict(full.named_buffers()) if full is not None else {}
    for name, buf in model.named_buffers():
        if dist.get_rank() == 0:
            buf.copy_(ref[name])
        dist.broadcast(buf, src=0)
    del full
    log.info("%s: %d parameters, %d of them trained", "reference" if reference else "actor",
             sum(p.numel() for p in model.parameters()), trainable(model))
    if reference:
        model.requires_grad_(False)
        model.eval()
        offload.to_host(model)
    return model


def add_adapters(model: torch.nn.Module, cfg: LoraConfig) -> None:
    """LoRA on `model`, in place (peft.inject_adapter_in_model: it stays the transformers model
    it was, its config, body and output layer where they were): each target linear layer wraps
    its frozen base (`...q_proj.base_layer.weight`) beside lora_A (rank x in) and lora_B (out x
    rank, zero at first), its output the base's plus alpha / rank x B(A(dropout(x))). Every other
    weight is frozen too, but the final norm with cfg.train_final_norm. The adapters (and that
    norm) are fp32, the optimizer's master copy; the base keeps the model's dtype (the compute
    dtype: nothing updates it)."""
    import peft

    peft.inject_adapter_in_model(peft.LoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules)), model)
    for _, module in adapters(model):
        module.lora_A.float()
        module.lora_B.float()
    if cfg.train_final_norm:
        norm = model.get_submodule(family(model.config.model_type).norm.rsplit(".", 1)[0])
        norm.float().requires_grad_(True)


def adapters(model: torch.nn.Module) -> list:
    """[(the adapted layer's Hugging Face name, its peft LoRA layer)], in the model's order;
    [] for a model without adapters."""
    return [(hf_name(name), m) for name, m in model.named_modules()
            if hasattr(m, "lora_A") and hasattr(m, "base_layer")]


@contextlib.contextmanager
def reference(ref: torch.nn.Module):
    """`ref` as the frozen reference for a forward pass: a separate reference brought out of
    host memory (offload.on_device), or, for an actor with adapters (model.lora), the actor
    itself with its adapters off: the base model, the reference for free. peft's own switch
    (enable_adapters) would also flip the adapters' requires_grad, which FSDP2 reads to reduce
    gradients: only the flag peft's forward reads is set here."""
    layers = [m for _, m in adapters(ref)]
    if not layers:
        with offload.on_device(ref):
            yield ref
        return
    for m in layers:
        m._disable_adapters = True
    try:
        yield ref
    finally:
        for m in layers:
            m._disable_adapters = False


def trainable(model: torch.nn.Module) -> int:
    """The parameters that train (all of them, or with adapters theirs), over every rank."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def flops_per_token(model: torch.nn.Module) -> tuple[int, int]:
    """The update's matrix-multiply FLOPs per token, forward and backward: (per token the model
    reads, per row of the output layer). A weight matrix of n elements costs 2n a token forward
    and 4n backward (input and weight gradients), 2n where it is frozen (adapters: no weight
    gradient). The input embedding is a lookup (no FLOPs); the output layer runs only on the rows
    the loss reads (logprobs.py), so it is counted apart. Left out: attention's own products,
    which grow with the sequence, and the vectors (norms, biases). Over every rank."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    cost = lambda p: (6 if p.requires_grad else 4) * p.numel()  # noqa: E731
    body = sum(cost(p) for p in model.parameters()
               if p.dim() >= 2 and p is not emb and p is not head)
    return body, cost(head)


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (under no_grad, its own storage: in-place ops write the
    DTensor); any other tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


class ShardAdamW(torch.optim.AdamW):
    """torch's AdamW with its state laid out as torch lays it out (so checkpoints and the offload
    see no difference), whose step runs torch's own arithmetic (`torch.optim.adam.adam`, the
    function AdamW.step calls) on each rank's shards instead of on DTensors.

    AdamW is elementwise, and a parameter, its gradient and its two moments share one placement
    (fully_shard's Shard(0)), so a shard's update is that part of the whole's, bitwise. Why not
    hand torch's step the DTensors: on torch 2.10 and 2.11 (what accelerator nodes run now) it
    leaks a step at a time. Its foreach path (accelerators' default) leaves tuples of specs that
    nothing refers to, from every DTensor op given a list (measured, not traced to its line);
    its one-tensor path (CPU's) adds an entry per parameter per step, keyed on the step size, to
    the never-emptied `FakeTensorMode.cache` (torch/_subclasses/fake_tensor.py) as DTensor's
    sharding propagation (torch/distributed/tensor/_sharding_prop.py) runs each new step size.
    torch 2.13 does neither. Measured in tests/workers/step_leaks.py and shard_adamw.py;
    docs/benchmarks.md has the numbers. DTensor's dispatch also costs host time per op."""

    def __init__(self, params, **options):
        other = sorted(k for k in ("amsgrad", "maximize", "fused", "capturable", "differentiable")
                       if options.get(k))
        if other:  # (the step below runs plain AdamW: these would be dropped without a word)
            raise ValueError(f"ShardAdamW runs plain AdamW; {', '.join(other)} is not written "
                             "for it. Fix: torch.optim.AdamW on the DTensors")
        super().__init__(params, **options)

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "ShardAdamW.step takes no closure"
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if isinstance(p, DTensor) and p.grad.placements != p.placements:
                    raise ValueError(f"a gradient placed {p.grad.placements} on a parameter "
                                     f"placed {p.placements}: ShardAdamW needs them alike")
                state = self.state[p]
                if not state:  # as torch.optim.Adam._init_group (no amsgrad, fused, capturable)
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            states = [self.state[p] for p in params]
            beta1, beta2 = group["betas"]
            adam(  # (its signature is the same in torch 2.10 to 2.13)
                [local(p) for p in params], [local(p.grad) for p in params],
                [local(s["exp_avg"]) for s in states], [local(s["exp_avg_sq"]) for s in states],
                [], [s["step"] for s in states], foreach=group["foreach"],
                decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2,
                lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                maximize=False)


def build_optimizer(cfg: OptimConfig, model: torch.nn.Module, total_steps: int):
    """AdamW on the parameters that train (with adapters, theirs only) and its schedule."""
    params, cfg = [p for p in model.parameters() if p.requires_grad], dataclasses.replace(cfg)
    opt = ShardAdamW(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2),
                     weight_decay=cfg.weight_decay)  # (its schedule reads its own copy of cfg)

    def lr_factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        progress = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)


def configure_optimizer(opt, sched, cfg: OptimConfig) -> None:
    """AdamW's learning rate, betas and weight decay from `cfg`, changed between steps
    (train_grpo.configure): in each param group, the learning rate times the schedule's factor
    of the step, and the schedule's base for the steps to come."""
    for i, group in enumerate(opt.param_groups):
        factor = sched.lr_lambdas[i](sched.last_epoch)
        group.update(betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay,
                     initial_lr=cfg.lr, lr=cfg.lr * factor)
    sched.base_lrs = [cfg.lr] * len(opt.param_groups)


@torch.no_grad()
def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm across shards; returns the norm before clipping, a 0-dim
    tensor left on the parameters' device (the caller reads a step's norms back at once); 0 on
    the device when no rank had a token to learn from (no gradient at all).

    torch's arithmetic on DTensors, done on this rank's shards: each parameter's norm (summed
    across the mesh as DTensor reduces a norm: square, all-reduce, root; each element lives on
    one rank), the norm of those norms, and clip_grad_norm_'s factor. On shards for the reasons
    ShardAdamW gives: clip_grad_norm_ on DTensors leaks on torch 2.10 and 2.11."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), device=params[0].device if params else "cpu")
    shards = [local(g) for g in grads]
    norms = torch.stack(torch._foreach_norm(shards, 2.0))
    if isinstance(grads[0], DTensor):
        norms = norms ** 2
        dist.all_reduce(norms, group=grads[0].device_mesh.get_group())
        norms = norms ** 0.5
    norm = torch.linalg.vector_norm(norms, 2.0)
    if max_norm > 0:
        torch._foreach_mul_(shards, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
    return norm
