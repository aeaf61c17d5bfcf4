"""A mixture of experts' push after a wake on vLLM-Ascend 0.23, on CPU: the engine's turn
(rollout.Engine: sleep, wake weights, push) against a stand-in worker whose two Ascend sides are
written from vLLM-Ascend 0.23.0's source and whose reload is vLLM's own:
- the loading: AscendUnquantizedFusedMoEMethod.process_weights_after_loading
  (ops/fused_moe/fused_moe.py:112-119) replaces w13_weight (E, 2I, H) and w2_weight (E, H, I)
  with new contiguous Parameters, transposed: (E, H, 2I) and (E, I, H), the kernel's layout;
- the wake: NPUWorker.wake_up (worker/worker.py:251-270) swaps them for Parameters holding
  transposed views, back in checkpoint shape, over the same storage;
- the reload: the installed vLLM's layerwise reload (0.32 in the main lane, 0.23 in the
  npu-stack lane: model_loader/reload/layerwise.py), as the model runner's reload_weights calls
  it with checkpoint-format weights (vLLM 0.23 v1/worker/gpu_model_runner.py, 0.32
  model_loader/reload/inplace.py).
A level-2 sleep is a NaN fill of every parameter's storage (the memory is unmapped; the wake maps
fresh pages at the same addresses), so a value the push does not write shows."""

import pytest
import torch

import npu_ops
import rollout

pytestmark = pytest.mark.engine

E, INTER, HIDDEN = 4, 8, 32  # w13 (E, 2I, H) = (4, 16, 32): no shape equals its transpose


class AscendUnquantizedMoE:
    """process_weights_after_loading as vLLM-Ascend 0.23.0 ops/fused_moe/fused_moe.py:112-119
    (its _maybe_pad_weight pads on ROCm only: the identity here)."""

    def process_weights_after_loading(self, layer):
        w13_data = layer.w13_weight.data.transpose(1, 2).contiguous()
        layer.w13_weight = torch.nn.Parameter(w13_data, requires_grad=False)
        w2_data = layer.w2_weight.data.transpose(1, 2).contiguous()
        layer.w2_weight = torch.nn.Parameter(w2_data, requires_grad=False)


class Experts(torch.nn.Module):
    """A routed-experts layer as vLLM creates it (fused_moe/unquantized_fused_moe_method.py,
    create_weights): checkpoint-layout Parameters whose weight_loader writes one expert's shard."""

    def __init__(self):
        super().__init__()
        from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

        method = type("Method", (AscendUnquantizedMoE, QuantizeMethodBase),
                      {"create_weights": lambda *a, **k: None, "apply": lambda *a, **k: None})
        self.quant_method = method()
        for name, shape in (("w13_weight", (E, 2 * INTER, HIDDEN)),
                            ("w2_weight", (E, HIDDEN, INTER))):
            param = torch.nn.Parameter(torch.empty(shape), requires_grad=False)
            param.weight_loader = self.weight_loader
            self.register_parameter(name, param)

    def weight_loader(self, param, loaded_weight, shard_id: str, expert_id: int):
        rows = {"w1": slice(0, INTER), "w3": slice(INTER, 2 * INTER), "w2": slice(None)}[shard_id]
        param.data[expert_id, rows].copy_(loaded_weight)


class Model(torch.nn.Module):
    """Two layers of experts; load_weights takes the names rollout.as_vllm_loads gives the
    installed vLLM: transformers 5's fused tensors (0.32) or one per expert (0.23)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Module() for _ in range(2))
        for layer in self.layers:
            layer.mlp = torch.nn.Module()
            layer.mlp.experts = Experts()

    def load_weights(self, weights):
        shards = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
        for name, t in weights:
            parts = name.split(".")  # layers.{l}.mlp.experts. ...
            experts = self.layers[int(parts[1])].mlp.experts
            if parts[-1] == "gate_up_proj":  # (E, 2I, H), the gate's rows first
                for e in range(E):
                    experts.w13_weight.weight_loader(experts.w13_weight, t[e, :INTER], "w1", e)
                    experts.w13_weight.weight_loader(experts.w13_weight, t[e, INTER:], "w3", e)
            elif parts[-1] == "down_proj":  # (E, H, I)
                for e in range(E):
                    experts.w2_weight.weight_loader(experts.w2_weight, t[e], "w2", e)
            else:  # layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight
                param = experts.w2_weight if parts[5] == "down_proj" else experts.w13_weight
                param.weight_loader(param, t, shards[parts[5]], int(parts[4]))


class Runner:
    """The model runner's reload_weights, checkpoint-format branch, on the real layerwise
    reload; the model as the engine loaded it first (vLLM 0.23 model_loader/utils.py:62
    records the checkpoint layout at construction, then the load, then the processing)."""

    def __init__(self, hf):
        from vllm.model_executor.model_loader.reload import record_metadata_for_reloading

        self.model = Model()
        record_metadata_for_reloading(self.model)
        self.model.load_weights(rollout.as_vllm_loads(hf.items()))
        for layer in self.model.layers:
            layer.mlp.experts.quant_method.process_weights_after_loading(layer.mlp.experts)

    def get_model(self):
        return self.model

    def reload_weights(self, weights_iterator, is_checkpoint_format=True):
        from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                             initialize_layerwise_reload)

        assert is_checkpoint_format
        initialize_layerwise_reload(self.model)
        self.model.load_weights(weights_iterator)
        finalize_layerwise_reload(self.model, None)


def ascend_wake_up(model, tags, hidden_size=HIDDEN, quant_config=None):
    """NPUWorker.wake_up's swap, vLLM-Ascend 0.23.0 worker/worker.py:251-270."""
    if quant_config is None and (tags is None or "weights" in tags):
        for name, param in model.named_parameters():
            if "w2_weight" in name and param.shape[2] == hidden_size:
                parts = name.split(".")
                parent_module = model.get_submodule(".".join(parts[:-1]))
                w2_data = torch.nn.Parameter(param.transpose(1, 2), requires_grad=False)
                setattr(parent_module, parts[-1], w2_data)
            elif "w13_weight" in name and param.shape[1] == hidden_size:
                parts = name.split(".")
                parent_module = model.get_submodule(".".join(parts[:-1]))
                w13_data = torch.nn.Parameter(param.transpose(1, 2), requires_grad=False)
                setattr(parent_module, parts[-1], w13_data)


class AscendLLM:
    """vLLM's LLM as rollout.Engine reaches it, its worker in this process (external launcher);
    sleep level 2 drops the weights' contents, level 1 keeps them."""

    def __init__(self, hf):
        from vllm.config import VllmConfig

        self.worker = type("Worker", (), {"vllm_config": VllmConfig(),
                                          "model_runner": Runner(hf)})()
        self.level = None
        # (LLM.llm_engine: a push ends by dropping its cached image features)
        self.llm_engine = type("LLMEngine", (), {"reset_encoder_cache": lambda self: None})()

    def sleep(self, level):
        self.level = level
        if level == 2:
            for param in self.worker.model_runner.model.parameters():
                param.data.fill_(float("nan"))

    def wake_up(self, tags):
        ascend_wake_up(self.worker.model_runner.model, tags)

    def collective_rpc(self, method, args=(), kwargs=None):
        return [method(self.worker, *args, **(kwargs or {}))]

    def reset_prefix_cache(self):
        pass


def checkpoint(seed: int) -> dict:
    """Transformers 5's fused expert tensors of both layers."""
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.mlp.experts.{n}": torch.randn(shape, generator=g)
            for i in range(2) for n, shape in (("gate_up_proj", (E, 2 * INTER, HIDDEN)),
                                                ("down_proj", (E, HIDDEN, INTER)))}


def engine_on(llm, level=2):
    engine = object.__new__(rollout.Engine)  # skip building a real LLM
    engine.cfg, engine.can_sleep, engine.llm = rollout.RolloutConfig(sleep_level=level), True, llm
    engine.kv_cache_awake, engine.weights_awake = True, True
    engine.memory = rollout.EngineMemory()
    engine.lora = engine.adapter = engine.adapter_dir = None
    return engine


def assert_kernel_layout(llm, hf: dict, storages: list):
    """Each layer's experts as the Ascend kernel reads them: contiguous (E, H, 2I) and (E, I, H)
    holding the checkpoint's values transposed, in the storage the engine loaded first."""
    for i, layer in enumerate(llm.worker.model_runner.model.layers):
        for name, ckpt in (("w13_weight", "gate_up_proj"), ("w2_weight", "down_proj")):
            t = getattr(layer.mlp.experts, name)
            assert t.is_contiguous(), (i, name, t.shape, t.stride())
            torch.testing.assert_close(t, hf[f"layers.{i}.mlp.experts.{ckpt}"].transpose(1, 2),
                                       rtol=0, atol=0)
            assert t.data_ptr() == storages.pop(0), (i, name)


def storages_of(llm) -> list:
    return [getattr(layer.mlp.experts, name).data_ptr()
            for layer in llm.worker.model_runner.model.layers
            for name in ("w13_weight", "w2_weight")]


def test_the_stand_in_push_after_an_ascend_wake_raises_where_the_view_stays():
    """The control: vLLM-Ascend's swap and vLLM's layerwise copy meet as issue 50 read them,
    (E, H, 2I) copied into a (E, 2I, H) view."""
    llm = AscendLLM(checkpoint(0))
    llm.sleep(2)
    llm.wake_up(["weights"])
    with pytest.raises(RuntimeError, match="must match the size"):
        llm.worker.model_runner.reload_weights(rollout.as_vllm_loads(checkpoint(1).items()))


def test_a_push_after_each_ascend_wake_writes_the_kernels_layout(monkeypatch):
    """rollout.Engine's turns on the stand-in: every push after a level-2 wake lands in the
    kernel's layout, in the storage the engine loaded first (which its graphs would hold)."""
    monkeypatch.setattr(npu_ops, "wake_transposes_experts", lambda: True)
    llm = AscendLLM(checkpoint(0))
    storages = storages_of(llm)
    assert_kernel_layout(llm, checkpoint(0), list(storages))
    engine = engine_on(llm)
    for step in (1, 2, 3):
        engine.sleep()
        engine.wake(["weights"])
        engine.load_weights(iter(checkpoint(step).items()))
        engine.wake(["kv_cache"])
        assert_kernel_layout(llm, checkpoint(step), list(storages))


def test_a_wake_without_a_push_gives_back_the_loaded_layout(monkeypatch):
    """Level 1 keeps the weights' values (LoRA's base, which no push rewrites): after the wake
    the experts are the loaded tensors again, not the views the engine would generate from."""
    monkeypatch.setattr(npu_ops, "wake_transposes_experts", lambda: True)
    llm = AscendLLM(checkpoint(0))
    storages = storages_of(llm)
    engine = engine_on(llm, level=1)
    engine.sleep()
    engine.wake(["weights"])
    assert_kernel_layout(llm, checkpoint(0), list(storages))


def test_the_restore_leaves_a_quantized_model_and_contiguous_tensors_alone():
    """vLLM-Ascend's wake swaps nothing in a quantized model, whose methods may keep transposed
    views on purpose; a contiguous tensor is as its loading left it."""
    import types

    llm = AscendLLM(checkpoint(0))
    assert rollout._experts_as_loaded(llm.worker) == 0  # after loading: contiguous
    llm.wake_up(["weights"])
    experts = llm.worker.model_runner.model.layers[0].mlp.experts
    quantized = types.SimpleNamespace(vllm_config=types.SimpleNamespace(quant_config=object()),
                                      model_runner=llm.worker.model_runner)
    assert rollout._experts_as_loaded(quantized) == 0 and not experts.w13_weight.is_contiguous()
    assert rollout._experts_as_loaded(llm.worker) == 4 and experts.w13_weight.is_contiguous()
