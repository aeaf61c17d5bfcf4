"""The push (weight_sync.load, in the engine's turn: weight_sync.EngineTurn) with a recording
engine: order, names, dtype, on a plain and an FSDP2 model; the engine's wake order and sleep."""

import time

import pytest
import torch

import fsdp_utils
from tasks import tiny_task
import weight_sync
from conftest import launch
from rollout import RolloutConfig


class RecordingEngine:
    def __init__(self, dtype):
        self.cfg, self.lora = RolloutConfig(dtype=dtype), None
        self.calls, self.received = [], {}

    def wake(self, tags):
        self.calls.append(("wake", tuple(tags)))

    def load_weights(self, pairs):
        self.calls.append(("load_weights",))
        for name, tensor in pairs:  # consumed lazily, as vLLM's worker does
            self.received[name] = tensor.clone()

    def sleep(self):
        self.calls.append(("sleep",))


def push(model, engine) -> None:
    """One engine turn without the offload: wake, push, sleep."""
    with weight_sync.EngineTurn(model, None, engine, offload_on=False):
        pass


def test_push_order_names_dtype_and_tied_head(monkeypatch):
    import offload

    model = tiny_task.build_tiny_model(vocab_size=15, eos_id=1, pad_id=0)
    engine = RecordingEngine("bfloat16")
    opt = torch.optim.Adam(model.parameters())
    model(torch.tensor([[1, 2]])).logits.sum().backward()
    opt.step()  # Adam's state exists: there is something to move
    moves, real = {"to_host": 0.2, "to_device": 0.1}, dict(vars(offload.HostCopy))

    def recorded(name):
        def move(copy, *args):
            what = name if name == "to_device" else ("actor" if args[0] is not None
                                                     else "optimizer")
            engine.calls.append((name, what))
            time.sleep(moves[name])
            return real[name](copy, *args)
        return move

    for name in moves:
        monkeypatch.setattr(offload.HostCopy, name, recorded(name))
    t = time.perf_counter()
    with weight_sync.EngineTurn(model, opt, engine, offload_on=True) as turn:
        engine.calls.append(("generate",))
    wall = time.perf_counter() - t
    stats = turn.metrics()
    # weights wake first, then the load, then the KV cache: never load into a sleeping engine;
    # the optimizer state leaves before the weights wake, the actor between the load and the KV
    # cache; after the turn the engine sleeps and both come back; the moves' time is not the
    # sync's
    assert engine.calls == [("to_host", "optimizer"), ("wake", ("weights",)), ("load_weights",),
                            ("to_host", "actor"), ("wake", ("kv_cache",)), ("generate",),
                            ("sleep",), ("to_device", "to_device"), ("to_device", "to_device")]
    assert 0 < stats["sync_time_s"] <= wall - 0.6 and stats["offload_out_time_s"] >= 0.4
    assert stats["offload_in_time_s"] >= 0.2
    # every checkpoint tensor, under its HF name, including the tied lm_head sent explicitly;
    # each decoder layer's tensors together and in order, the embedding and the head last
    names = list(engine.received)
    assert names[-2:] == ["model.embed_tokens.weight", "lm_head.weight"]
    layer_of = [int(n.split(".")[2]) for n in names if n.startswith("model.layers.")]
    assert layer_of == sorted(layer_of) and names.index("model.norm.weight") > len(layer_of) - 1
    assert set(engine.received) == set(model.state_dict())
    assert "lm_head.weight" in engine.received
    for name, tensor in model.state_dict().items():
        assert engine.received[name].dtype == torch.bfloat16
        assert torch.equal(engine.received[name], tensor.to(torch.bfloat16)), name
    assert stats["sync_gb"] * 2**30 == sum(t.numel() * 2 for t in model.state_dict().values())


def test_wrapper_prefixes_are_stripped():
    assert fsdp_utils.hf_name("_orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.up_proj"
                               ".weight") == "model.layers.0.mlp.up_proj.weight"


class FakeLLM:
    """Records what rollout.Engine asks of vLLM's LLM; the worker side is a recording stub."""

    def __init__(self):
        from vllm.config import VllmConfig

        self.calls, self.loaded = [], []
        runner = type("Runner", (), {"reload_weights": lambda _, weights_iterator,
                                     is_checkpoint_format: self.loaded.extend(
                                         n for n, _ in weights_iterator),
                                     "get_model": lambda _: torch.nn.Module()})()
        self.worker = type("Worker", (), {"vllm_config": VllmConfig(), "model_runner": runner})()
        calls = self.calls  # LLM.llm_engine: the encoder cache a push drops
        self.llm_engine = type("LLMEngine", (), {"reset_encoder_cache": lambda _: calls.append(
            ("reset_encoder_cache",))})()

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def collective_rpc(self, method, kwargs=None):
        self.calls.append(("collective_rpc",))
        return [method(self.worker, **(kwargs or {}))]

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def engine_with(fake):
    import rollout

    engine = object.__new__(rollout.Engine)  # skip building a real LLM
    engine.cfg, engine.can_sleep, engine.llm = RolloutConfig(), True, fake
    engine.kv_cache_awake, engine.weights_awake = True, True
    engine.memory = rollout.EngineMemory()
    engine.lora = engine.adapter = engine.adapter_dir = None
    return engine


@pytest.mark.engine
def test_engine_guards_the_wake_order():
    import pytest

    fake = FakeLLM()
    engine = engine_with(fake)
    engine.sleep()
    with pytest.raises(RuntimeError, match="engine weights are asleep"):
        engine.load_weights(iter([("w", torch.zeros(1))]))
    with pytest.raises(RuntimeError, match="wake the weights"):
        engine.wake(["kv_cache"])
    engine.wake(["weights"])
    engine.load_weights(iter([("a", torch.zeros(1)), ("b", torch.ones(1))]))
    engine.wake(["kv_cache"])
    assert engine.kv_cache_awake and fake.loaded == ["a", "b"]
    # the prefix cache is dropped right after the load, before anything can generate
    # level 2 by default: the worker restores buffers at the first wake, which must be "weights"
    assert fake.calls == [("sleep", 2), ("wake_up", ("weights",)), ("collective_rpc",),
                          ("reset_prefix_cache",), ("reset_encoder_cache",),
                          ("wake_up", ("kv_cache",))]


@pytest.mark.engine
def test_a_wake_without_room_is_a_python_error_before_the_engine_maps(monkeypatch):
    """vLLM-Ascend 0.23's wake maps each asleep allocation with aclrtMallocPhysical and throws
    from C++ when that fails (camem_allocator.cpp create_and_map): the process ends with no
    Python traceback. Before each wake the engine reads what it will map back from the sleep
    allocator's table (each allocation's size at handle[1], its tag) and compares it with the
    device's free memory: too little is a MemoryError naming both and the fix, raised before
    vLLM is asked to map anything."""
    import types

    import npu_ops
    import rollout

    GiB = 2**30
    table = {i: types.SimpleNamespace(handle=(0, size, i), tag=tag) for i, (size, tag) in
             enumerate([(4 * GiB, "weights"), (2 * GiB, "weights"), (3 * GiB, "kv_cache")])}
    monkeypatch.setattr(rollout, "_sleep_allocator",
                        lambda: types.SimpleNamespace(pointer_to_data=table))
    free = {"gb": 5.5}
    monkeypatch.setattr(npu_ops, "device_free_gb", lambda: free["gb"])
    fake = FakeLLM()
    engine = engine_with(fake)
    engine.sleep()
    with pytest.raises(MemoryError, match=r"maps back 6.00 GiB but 5.50 GiB .* free. Fix: lower "
                                          r"rollout.gpu_memory_utilization"):
        engine.wake(["weights"])
    assert fake.calls == [("sleep", 2)] and not engine.weights_awake  # vLLM was asked nothing
    free["gb"] = 6.0
    engine.wake(["weights"])
    free["gb"] = 2.9  # the KV cache's 3 GiB: the actor still on the device, say
    with pytest.raises(MemoryError, match=r"engine wake \(kv_cache\): it maps back 3.00 GiB"):
        engine.wake(["kv_cache"])
    free["gb"] = 3.0
    engine.wake(["kv_cache"])
    assert fake.calls == [("sleep", 2), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",))]


class AscendExtraCleanup(FakeLLM):
    """vLLM-Ascend 0.23's NPUWorker with enable_sleep_mode_extra_cleanup, on a pretend device
    (`device["used"]` GiB of `device["total"]`). sleep (worker/worker.py:216-233): the extra
    cleanup first (device_allocator/sleep_mem_optimized.py, HcclSleepWakeupManager.sleep:
    HCCL's communicators destroyed, their buffers freed), then the allocator unmaps its whole
    table (camem.py sleep). wake_up (worker.py:240-280): the allocator maps the tags'
    allocations (aclrtMallocPhysical, which throws from C++ when the device is full: the
    process ends), then the extra cleanup's wakeup restores HCCL's communicators at the first
    wake after a sleep, whatever its tags (restore_hccl: a no-op once restored)."""

    def __init__(self, device: dict, table: dict, hccl_gb: float):
        super().__init__()
        self.device, self.table, self.hccl_gb, self.hccl_up = device, table, hccl_gb, True

    def allocate(self, gb: float, what: str) -> None:
        if self.device["used"] + gb > self.device["total"]:
            raise SystemExit(f"terminate called: {what} ({gb} GiB) on a full device")
        self.device["used"] += gb

    def sleep(self, level):
        super().sleep(level)
        self.device["used"] -= self.hccl_gb + sum(d.handle[1] for d in self.table.values()) / 2**30
        self.hccl_up = False

    def wake_up(self, tags):
        self.allocate(sum(d.handle[1] for d in self.table.values() if d.tag in tags) / 2**30,
                      "aclrtMallocPhysical")
        if not self.hccl_up:
            self.allocate(self.hccl_gb, "HCCL's buffers")
            self.hccl_up = True
        super().wake_up(tags)


@pytest.mark.engine
def test_the_wake_room_counts_what_the_extra_cleanup_allocates_again(monkeypatch):
    """With rollout.sleep_extra_cleanup, vLLM-Ascend's sleep also frees HCCL's buffers, outside
    the sleep allocator's table, and its first wake after allocates them again: the room check
    counts them (measured at the sleep as what it freed beyond the table), so a wake short of
    them is a MemoryError before vLLM maps anything, not a process ended in C++."""
    import types

    import npu_ops
    import rollout

    GiB = 2**30
    table = {i: types.SimpleNamespace(handle=(0, size, i), tag=tag) for i, (size, tag) in
             enumerate([(6 * GiB, "weights"), (3 * GiB, "kv_cache")])}
    device = {"used": 5.0 + 9.0 + 1.5, "total": 16.0}  # the trainer's 5, the engine's 9 + 1.5
    monkeypatch.setattr(rollout, "_sleep_allocator",
                        lambda: types.SimpleNamespace(pointer_to_data=table))
    monkeypatch.setattr(npu_ops, "device_memory_used_gb", lambda: device["used"])
    monkeypatch.setattr(npu_ops, "device_free_gb", lambda: device["total"] - device["used"])
    monkeypatch.setattr(npu_ops, "release_cached_memory", lambda: None)
    monkeypatch.setattr(npu_ops, "device_type", lambda: "npu")
    fake = AscendExtraCleanup(device, table, hccl_gb=1.5)
    engine = engine_with(fake)
    engine.memory = rollout.EngineMemory(npu_ops.sleep_rebuilds(True))
    engine.sleep()
    device["used"] += 4.0  # the update's activations: 1 GiB free beyond the weights' 6
    with pytest.raises(MemoryError, match=r"engine wake \(weights\): it maps back 6.00 GiB and "
                       r"rebuilds 1.50 GiB that rollout.sleep_extra_cleanup freed .* but 7.00 "
                       "GiB of device memory is free"):
        engine.wake(["weights"])
    assert fake.calls == [("sleep", 2)]  # vLLM was asked nothing
    device["used"] -= 0.5  # exactly the room
    engine.wake(["weights"])
    assert engine.memory.rebuilt_gb == 0.0  # all back at the first wake
    device["used"] -= 5.5  # the actor's shards to host memory
    engine.wake(["kv_cache"])  # 3 GiB, and nothing else to rebuild
    # (after the weights' wake on an NPU, the experts' layout put back: none in a dense model)
    assert fake.calls == [("sleep", 2), ("wake_up", ("weights",)), ("collective_rpc",),
                          ("wake_up", ("kv_cache",))]
    assert not npu_ops.sleep_rebuilds(False)


@pytest.mark.engine
def test_with_adapters_the_engine_sleeps_its_kv_cache_only_where_vllm_can():
    """With LoRA the base stays loaded: where vLLM has release_kv_cache_memory (0.32) the sleep
    is level 0 plus that release, the weights stay awake and only the KV cache wakes; where it
    has not (0.23, 0.26), level 1, which keeps a host copy of the weights and the adapter's slots
    (level 2 would drop them), and both wake."""
    import fsdp_utils

    class KeepsWeights(FakeLLM):
        def release_kv_cache_memory(self):
            self.calls.append(("release_kv_cache_memory",))

    for fake, expected in [
            (KeepsWeights(), [("sleep", 0), ("release_kv_cache_memory",),
                              ("wake_up", ("kv_cache",))]),
            (FakeLLM(), [("sleep", 1), ("wake_up", ("weights",)), ("wake_up", ("kv_cache",))])]:
        engine = engine_with(fake)
        engine.lora = fsdp_utils.LoraConfig(rank=8)
        engine.sleep()
        engine.wake(["weights"])
        engine.wake(["kv_cache"])
        assert fake.calls == expected, type(fake).__name__
        assert engine.weights_awake and engine.kv_cache_awake


@pytest.mark.engine
def test_wake_releases_the_trainers_cache_first_and_logs_memory(monkeypatch):
    """vLLM-Ascend maps the engine's memory at wake-up without emptying torch_npu's cache: the
    engine does it first, on every platform that sleeps, and records device memory around each
    sleep and wake."""
    import npu_ops

    fake = FakeLLM()
    used = iter(range(100))
    monkeypatch.setattr(npu_ops, "release_cached_memory", lambda: fake.calls.append(("release",)))
    monkeypatch.setattr(npu_ops, "device_memory_used_gb", lambda: float(next(used)))
    engine = engine_with(fake)
    engine.sleep()
    engine.wake(["weights"])
    engine.load_weights(iter([("a", torch.zeros(1))]))
    engine.wake(["kv_cache"])
    assert [c for c in fake.calls if c[0] not in ("collective_rpc", "reset_prefix_cache",
                                                  "reset_encoder_cache")] == [
        ("sleep", 2), ("release",), ("wake_up", ("weights",)), ("release",),
        ("wake_up", ("kv_cache",))]
    assert engine.memory.events == {"sleep": (0.0, 1.0), "wake_weights": (2.0, 3.0),
                                    "wake_kv_cache": (4.0, 5.0)}


@pytest.mark.engine
def test_a_sleeping_engine_wakes_before_it_shuts_down(monkeypatch):
    """vLLM's sleep-mode allocator fails (CUDA) or throws (Ascend) when the memory of a sleeping
    engine is freed: shutdown wakes what sleeps first, each tag once, and nothing that is awake."""
    import vllm.distributed.parallel_state as parallel_state

    for before in ("asleep", "weights awake", "awake"):
        fake = FakeLLM()
        monkeypatch.setattr(parallel_state, "cleanup_dist_env_and_memory",
                            lambda: fake.calls.append(("cleanup",)))
        engine = engine_with(fake)
        if before != "awake":
            engine.sleep()
        if before == "weights awake":
            engine.wake(["weights"])
        fake.calls.clear()
        engine.shutdown()
        woken = {"asleep": [("wake_up", ("weights",)), ("wake_up", ("kv_cache",))],
                 "weights awake": [("wake_up", ("kv_cache",))], "awake": []}[before]
        assert fake.calls == woken + [("cleanup",)], before
        assert not hasattr(engine, "llm")


def test_only_the_rotary_reload_warning_is_dropped():
    import logging

    import rollout

    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        rollout.quiet_rotary_reload_warning()
        rollout.quiet_rotary_reload_warning()  # idempotent: one filter
        for layer in ("RotaryEmbedding", "AscendRotaryEmbedding", "FusedMMInputNorm",
                      "QKVParallelLinear"):
            logger.warning("%s: Failed to load weights", layer)
        logger.warning("something else about RotaryEmbedding")
    finally:
        logger.removeHandler(handler)
    assert seen == ["QKVParallelLinear: Failed to load weights",
                    "something else about RotaryEmbedding"]
    assert len(logger.filters) == 1


def test_units_and_both_gathers_of_an_fsdp_model(tiny_models, tmp_path):
    """weight_sync.units: the root's own tensors, then one unit per decoder layer, every parameter
    once. Both ways of gathering (sync_by tensor, unit) send every tensor whole, in the engine's
    dtype (bf16 here, cast from the fp32 shards), bit-equal to the gathered parameter cast. The
    2-rank sync test counts the collectives."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import fsdp_utils

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = fsdp_utils.build_actor(fsdp_utils.ModelConfig(path=tiny_models["qwen2"],
                                                              param_dtype="float32"),
                                       init_device_mesh("cpu", (1,)))
        groups = weight_sync.units(model)
        layers = model.config.num_hidden_layers
        # the decoder layers first; the root (embedding, final norm) last, the embedding last
        assert [unit for unit, _ in groups] == [*model.model.layers, model]
        assert groups[-1][1] == ["model.norm.weight", "model.embed_tokens.weight"]
        assert {n for _, names in groups for n in names} == {n for n, _ in model.named_parameters()}
        assert [len(names) for _, names in groups][:-1] == [
            len(list(model.model.layers[0].parameters()))] * layers
        for sync_by in ("tensor", "unit"):
            engine = RecordingEngine("bfloat16")
            engine.cfg.sync_by = sync_by
            push(model, engine)
            assert set(engine.received) == {n for n, _ in model.named_parameters()} | {
                "lm_head.weight"}  # the tiny model ties its embeddings
            for name, p in model.named_parameters():
                expected = p.full_tensor().to(torch.bfloat16)
                assert torch.equal(engine.received[name], expected), (sync_by, name)
    finally:
        dist.destroy_process_group()


def test_a_llama_shards_and_syncs_under_its_family_names(tmp_path):
    """A family other than Qwen (Llama, tied embeddings) through build_actor and push: one FSDP
    unit per decoder layer where its family row says they are, and the shared embedding sent
    under both of the row's names."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    import fsdp_utils

    LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=64, intermediate_size=128,
                                 num_hidden_layers=3, num_attention_heads=2,
                                 tie_word_embeddings=True)).save_pretrained(tmp_path / "llama")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        model = fsdp_utils.build_actor(fsdp_utils.ModelConfig(path=str(tmp_path / "llama"),
                                                              param_dtype="float32"),
                                       init_device_mesh("cpu", (1,)))
        assert [unit for unit, _ in weight_sync.units(model)] == [*model.model.layers, model]
        engine = RecordingEngine("float32")
        push(model, engine)
        assert set(engine.received) == {n for n, _ in model.named_parameters()} | {
            "lm_head.weight"}
        assert torch.equal(engine.received["lm_head.weight"],
                           engine.received["model.embed_tokens.weight"])
    finally:
        dist.destroy_process_group()


def test_all_adapters_in_one_all_gather_equal_each_one_gathered_alone(tiny_task_dir):
    """weight_sync.gather_rows on 2 ranks, adapters whose rows split unevenly (or leave a rank
    none), bit-equal to each tensor's own full_tensor (tests/workers/adapter_gather.py)."""
    out = launch(["tests/workers/adapter_gather.py", f"{tiny_task_dir}/model"])
    assert out.count("ADAPTER_GATHER_OK") == 2, out[-3000:]


def test_fused_experts_split_as_the_checkpoint_holds_them(tiny_models):
    """rollout.per_expert (the push into a vLLM whose loader takes per-expert names only, as
    0.23's) turns a Qwen3-MoE's pushed tensors into exactly the names and values transformers
    writes to the checkpoint that vLLM loads at start: save_pretrained's safetensors, read
    back, are the reference. A gate/up swap or a transposed matrix would differ here."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import rollout

    path = tiny_models["qwen3_moe"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    stats = {"bytes": 0}
    pushed = dict(rollout.per_expert(weight_sync.iter_full_params(model, torch.float32, stats)))
    saved = load_file(f"{path}/model.safetensors")
    experts = [n for n in saved if ".mlp.experts." in n]
    assert len(experts) == 2 * 8 * 3  # 2 layers, 8 experts, gate/up/down each
    assert set(saved) <= set(pushed) and set(pushed) - set(saved) <= {"lm_head.weight"}
    for name in saved:
        assert torch.equal(pushed[name], saved[name]), name
    assert any(not torch.equal(pushed[n], saved[n.replace("gate_proj", "up_proj")])
               for n in experts if "gate_proj" in n)  # gate and up are not one tensor twice
