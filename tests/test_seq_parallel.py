"""Ulysses sequence parallelism (seq_parallel.py, model.sp_size) on 2 CPU ranks against one
process's computation on the whole row, in fp64. Tolerance: the same fp64 sums in other orders
(attention over at most 21 keys, products of 32 terms; gradients summed over two ranks in FSDP's
reduce-scatter instead of once): errors ~1e-15 relative; 1e-12 (1e-10 of the largest for
gradients, which sum over every token) still catches a token or head in the wrong place, a lost
target at a split or a token counted twice, each of which changes the result at 1e-2 and
more."""

import shutil

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import launch


def test_ulysses_attention_equals_attention_on_the_whole_row():
    out = launch(["tests/workers/ulysses_attention.py"])
    assert out.count("ULYSSES_OK") == 2, out[-3000:]
    assert out.count(": equal") == 10


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_sp_2_updates_as_sp_1(tiny_models, tmp_path, kv_heads):
    """The tiny Qwen2 (4 heads over 2 KV heads), and a copy with 1 KV head (replicated)."""
    path = tmp_path / "model"
    shutil.copytree(tiny_models["qwen2"], path)
    if kv_heads != 2:
        cfg = AutoConfig.from_pretrained(path)
        cfg.num_key_value_heads = kv_heads
        with torch.random.fork_rng():
            torch.manual_seed(4)
            AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    out = launch(["tests/workers/sp_parity.py", str(path)])
    assert out.count("SP_PARITY_OK") == 2, out[-3000:]
    assert out.count("sp 2 equals sp 1") == 8


def test_sp_2_updates_as_sp_1_on_a_hybrid(tiny_hybrid):
    """The tiny Qwen3.5: two Gated DeltaNet layers (4 value heads, 1,024 convolution channels)
    between its full-attention ones, fp64 throughout (the worker lifts transformers' `.float()`
    casts: its comment says why)."""
    out = launch(["tests/workers/sp_parity.py", tiny_hybrid])
    assert out.count("SP_PARITY_OK") == 2, out[-3000:]
    assert out.count("sp 2 equals sp 1") == 8


def test_the_option_is_refused_where_it_cannot_work(tiny_task_dir, tiny_models, tmp_path):
    """One line each, before any model loads: a world it does not divide, padded batches, an
    attention it cannot wrap, and heads that do not split (read from config.json)."""
    import config
    from train_grpo import load_config, resolve

    def refused(*overrides, world=2, model_check=False):
        cfg = resolve(load_config("configs/tiny_cpu.yaml",
                                  [f"--data.tiny_task_dir={tiny_task_dir}", *overrides]))
        with pytest.raises(config.BadInput) as e:
            config.check_model(cfg) if model_check else config.validate(cfg, world)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "divide the world size 3" in refused("--model.sp_size=2", "--grpo.prompts_per_step=63",
                                                world=3)
    assert "grpo.pack=false" in refused("--model.sp_size=2", "--grpo.pack=false")
    assert "'eager'" in refused("--model.sp_size=2", "--model.attn_implementation=eager")
    path = tmp_path / "model"  # 4 heads, 2 KV heads: 3 ranks cannot share them
    shutil.copytree(tiny_models["qwen2"], path)
    assert "4 attention heads" in refused("--model.sp_size=3", f"--model.path={path}",
                                          model_check=True)
