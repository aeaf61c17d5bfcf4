"""2 ranks: FSDP2-sharded GRPO updates (trainer.accumulate_gradients) equal unsharded updates.

The reference is an unsharded HF model on every rank; its gradient over the whole global batch
comes from a per-sequence loop written independently of the trainer:
loss = -sum_i A_i sum_t logp_it / N. Once its gradient is checked against the sharded one, the
reference's own AdamW steps with the sharded gradient, so both models stay on the same weights
(to the rounding of Adam's elementwise arithmetic) and every step is checked as strictly as the
first. Were each to step with its own gradient, Adam's division by sqrt(v) would turn 1e-7
differences on near-zero gradients into weight differences of order lr, and the later steps would
compare gradients at different weights.
Usage: torchrun --nproc_per_node 2 tests/workers/fsdp_parity.py MODEL_DIR RESHARD GRAD_CKPT
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM

import fsdp_utils
from records import Sample
from tests.reference import batch_of
from train_grpo import Config, init_distributed
from trainer import accumulate_gradients, settings

model_dir, reshard, ckpt = sys.argv[1], sys.argv[2] == "1", sys.argv[3] == "1"
rank, world = init_distributed()
torch.manual_seed(0)
cfg = Config()
cfg.model = fsdp_utils.ModelConfig(path=model_dir, param_dtype="float32",
                                   reshard_after_forward=reshard, gradient_checkpointing=ckpt)
cfg.grpo.micro_batch_tokens = 16  # several micro-batches, and unequal counts across ranks
cfg.grpo.is_correction = "none"  # the samples' engine logp are placeholders
cfg.optim = fsdp_utils.OptimConfig(lr=1e-2, grad_clip=0.5)
actor = fsdp_utils.build_actor(cfg.model, init_device_mesh("cpu", (world,)))
opt, _ = fsdp_utils.build_optimizer(cfg.optim, actor, total_steps=10)
ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, betas=(0.9, 0.999), weight_decay=0.0)

g = torch.Generator().manual_seed(1)
for step in range(3):
    # a global batch of 8 samples with varied lengths; rank r trains on samples r, r+2, ...
    samples = []
    for i in range(8):
        p = torch.randint(3, 15, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
        r = torch.randint(3, 15, (int(torch.randint(1, 7 + 3 * (i % 2), (1,), generator=g)),),
                          generator=g)
        samples.append(Sample(p.tolist(), r.tolist(), [0.0] * len(r), False))
    adv = torch.randn(8, generator=g)
    mine = list(range(rank, 8, world))
    accumulate_gradients(actor, batch_of([samples[i] for i in mine], adv[mine]),
                         settings(cfg.grpo, cfg.rollout.temperature,
                                  max_len=cfg.rollout.max_new_tokens))
    grads = {n: p.grad.full_tensor().clone() for n, p in actor.named_parameters()}  # before clip
    norm = fsdp_utils.clip_grad_norm(actor, cfg.optim.grad_clip).item()
    clipped = {n: p.grad.full_tensor().clone() for n, p in actor.named_parameters()}
    opt.step()
    opt.zero_grad()

    n_tokens = sum(len(s.response_ids) for s in samples)
    loss = 0.0
    for s, a in zip(samples, adv):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        lp = ref(ids).logits[0, :-1].log_softmax(-1)
        for t, tok in enumerate(s.response_ids):
            loss = loss - a * lp[len(s.prompt_ids) - 1 + t, tok] / n_tokens
    loss.backward()
    named = dict(ref.named_parameters())
    grad_err = max((grads[n] - p.grad).abs().max().item() for n, p in named.items())
    grad_max = max(p.grad.abs().max().item() for p in named.values())
    diff_norm = sum(((grads[n].double() - p.grad.double()) ** 2).sum() for n, p in named.items())
    diff_norm = diff_norm.sqrt().item()  # || sharded grad - unsharded grad ||_2, in float64
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.optim.grad_clip).item()
    print(f"rank {rank} step {step}: grad norm {norm:.6f} vs {ref_norm:.6f}, "
          f"max grad error {grad_err:.2e} (max grad {grad_max:.2e})")
    # Same weights, same batch: the gradients differ only by fp32 summation order (over ranks,
    # micro-batches and sequences). Each element sums ~100 per-token terms: rounding that walks
    # randomly moves such a sum by about sqrt(100) * 2^-24 = 6e-7 of its terms' size.
    assert grad_err < 1e-6 * grad_max, (step, grad_err, grad_max)
    # |‖a‖ - ‖b‖| <= ‖a - b‖ (triangle inequality); on top of that, each norm is itself an fp32
    # sum of squares whose relative rounding error is about log2(#elements) * 2^-24 < 2e-6
    assert abs(norm - ref_norm) <= diff_norm + 2e-6 * ref_norm, (step, norm, ref_norm, diff_norm)
    for n, p in named.items():  # the reference's AdamW steps with the sharded run's gradient
        p.grad.copy_(clipped[n])
    ref_opt.step()
    ref_opt.zero_grad()

full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p) for n, p in actor.named_parameters()}
worst = max((full[n] - p).abs().max().item() for n, p in ref.named_parameters())
moved = max((p - q).abs().max().item() for p, q in
            zip(ref.parameters(), AutoModelForCausalLM.from_pretrained(model_dir).parameters()))
print(f"rank {rank}: max |sharded - unsharded| = {worst:.2e}, weights moved by {moved:.2e}")
assert moved > 1e-3, "the updates did not change the weights: the test would prove nothing"
# sharded and unsharded AdamW apply the same elementwise arithmetic to the same gradients: the
# weights may differ by the rounding of a few fp32 operations per step (ulps of lr-sized updates
# on weights of order 1), far below 1e-5, and never by an update (order lr = 1e-2)
assert worst < 1e-5, worst
dist.destroy_process_group()
print("FSDP_PARITY_OK")
