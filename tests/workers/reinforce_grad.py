"""2 ranks: the first optimizer step of trainer.update takes the REINFORCE gradient.

With no mismatch correction, the first update of a rollout sees ratio 1 (on-policy, or old_logp
recomputed by the same weights), so its gradient must equal that of
    -sum_i c_i A_i sum_t logp_it        (+ kl_coef * sum_i c_i sum_t k(logp_it, ref_it))
over the samples of the first global mini-batch, where c_i is the aggregation's weight:
1/N_tokens (token_mean), 1/(N_seqs |o_i|) (seq_mean), 1/(N_seqs max_new_tokens) (constant),
1/N_seqs (seq_sum).
The reference is an unsharded HF model and a per-sequence loop, written apart from the trainer.
Also checked: the frozen FSDP2 reference returns the unsharded model's logprobs and takes no
gradient; old_logp is recomputed only when there is more than one update per rollout.
Usage: torchrun --nproc_per_node 2 tests/workers/reinforce_grad.py MODEL_DIR
"""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM

import fsdp_utils
import logprobs
import offload
from grpo import LOSS_AGGS
from records import Sample
from tests.reference import batch_of, update
from train_grpo import Config, init_distributed
from trainer import settings as make_settings, split_mini_batches

model_dir = sys.argv[1]
rank, world = init_distributed()
torch.manual_seed(0)
cfg = Config()
cfg.model = fsdp_utils.ModelConfig(path=model_dir, param_dtype="float32")
cfg.grpo.micro_batch_tokens = 16  # several micro-batches, unequal counts across ranks
cfg.grpo.is_correction = "none"
cfg.optim.grad_clip = 0.0  # the recorded gradient is the raw one
cfg.rollout.max_new_tokens = 12
settings = make_settings(cfg.grpo, cfg.rollout.temperature,  # (cfg.grpo changes case by case)
                         max_len=cfg.rollout.max_new_tokens, grad_clip=cfg.optim.grad_clip)
mesh = init_device_mesh("cpu", (world,))
actor = fsdp_utils.build_actor(cfg.model, mesh)
ref_model = fsdp_utils.build_actor(cfg.model, mesh, reference=True)
hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)

g = torch.Generator().manual_seed(1)
samples = []  # a global batch of 12 with varied lengths; rank r holds samples r, r+2, ...
for i in range(12):
    p = torch.randint(3, 15, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g)
    r = torch.randint(3, 15, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g)
    samples.append(Sample(p.tolist(), r.tolist(), [0.0] * len(r), False))
adv = torch.randn(12, generator=g)
mine = list(range(rank, 12, world))


def hf_logp(s):
    lp = hf(torch.tensor([s.prompt_ids + s.response_ids])).logits[0, :-1].log_softmax(-1)
    return torch.stack([lp[len(s.prompt_ids) - 1 + t, tok] for t, tok in enumerate(s.response_ids)])


# the reference: FSDP2, frozen, its weights in host memory (running it there is refused, not a
# read of freed memory); brought back to the device, the same logprobs as the HF model
try:
    ref_model(torch.tensor([[3, 4]]))
    raise AssertionError("a model whose weights are in host memory ran")
except RuntimeError as e:
    assert "host memory (offload.to_host)" in str(e)
offload.to_device(ref_model)
ref_lp = logprobs.sample_logprobs(ref_model, [samples[i] for i in mine], settings.passes)
with torch.no_grad():
    for i, lp in zip(mine, ref_lp):
        assert torch.allclose(lp, hf_logp(samples[i]), atol=1e-5), i
assert not any(p.requires_grad for p in ref_model.parameters())


class FirstStep:
    """An optimizer stand-in that records the gradient of each step and changes nothing."""

    def __init__(self):
        self.grads = []

    def step(self):
        self.grads.append({n: p.grad.full_tensor().clone() for n, p in actor.named_parameters()})

    def zero_grad(self, set_to_none=True):
        actor.zero_grad(set_to_none=set_to_none)


recomputed = []  # the models of every pass without gradient (old policy, reference)
real_sample_pass = logprobs.sample_pass


def counting_sample_pass(model, *args, **kwargs):
    recomputed.append(model)
    return real_sample_pass(model, *args, **kwargs)


logprobs.sample_pass = counting_sample_pass

cases = [(agg, epochs, epochs, 0.0, "k3") for epochs in (1, 2) for agg in LOSS_AGGS]
cases += [("seq_mean", 1, 1, 0.5, "k1"), ("token_mean", 2, 3, 0.5, "k3")]
for agg, epochs, n_mb, kl_coef, est in cases:
    cfg.grpo.loss_agg, cfg.grpo.ppo_epochs, cfg.grpo.mini_batches = agg, epochs, n_mb
    cfg.grpo.kl_coef, cfg.grpo.kl_estimator = kl_coef, est
    opt, recomputed[:] = FirstStep(), []
    update(actor, ref_model if kl_coef else None, opt,
           batch_of([samples[i] for i in mine], adv[mine], 7), settings)
    assert len(opt.grads) == epochs * n_mb
    on_policy = epochs == 1 and n_mb == 1
    assert (actor in recomputed) == (not on_policy), (agg, epochs, n_mb)

    # which samples made the first global mini-batch: each rank's first part, gathered
    part = split_mini_batches(len(mine), n_mb, torch.Generator().manual_seed(7))[0]
    firsts = [None] * world
    dist.all_gather_object(firsts, [mine[k] for k in part])
    first = sorted(i for f in firsts for i in f)
    n_tokens = sum(len(samples[i].response_ids) for i in first)
    hf.zero_grad()
    loss = 0.0
    for i in first:
        s = samples[i]
        c = {"token_mean": 1 / n_tokens, "seq_mean": 1 / (len(first) * len(s.response_ids)),
             "constant": 1 / (len(first) * cfg.rollout.max_new_tokens),
             "seq_sum": 1 / len(first)}[agg]
        lp = hf_logp(s)
        loss = loss - c * adv[i] * lp.sum()
        if kl_coef:  # the reference is the initial model: hf's own logp, detached
            x = lp.detach() - lp
            k = -x if est == "k1" else torch.expm1(x) - x
            loss = loss + kl_coef * c * k.sum()
    loss.backward()
    err = max((opt.grads[0][n] - p.grad).abs().max().item() for n, p in hf.named_parameters())
    top = max(p.grad.abs().max().item() for p in hf.parameters())
    print(f"rank {rank} {agg} epochs={epochs} mini_batches={n_mb} kl={kl_coef}{est}: "
          f"first-step grad error {err:.2e} (max grad {top:.2e})")
    assert top > 1e-4 and err < 1e-5 * top, (agg, epochs, n_mb, err, top)

# Several real updates per rollout (PPO): every step's gradient equals that of the clipped
# surrogate on an unsharded model trained alongside with the same splits, ratios taken against
# the logprobs from before the first step.
logprobs.sample_pass = real_sample_pass
cfg.grpo.loss_agg, cfg.grpo.kl_coef = "token_mean", 0.0
cfg.grpo.ppo_epochs, cfg.grpo.mini_batches = 2, 2
cfg.grpo.clip_low, cfg.grpo.clip_high = 0.1, 0.15
grads = []


class Recording(torch.optim.AdamW):
    def step(self):
        grads.append({n: p.grad.full_tensor().clone() for n, p in actor.named_parameters()})
        return super().step()


update(actor, None, Recording(actor.parameters(), lr=3e-3),
       batch_of([samples[i] for i in mine], adv[mine], 11), settings)
hf_opt = torch.optim.AdamW(hf.parameters(), lr=3e-3)
with torch.no_grad():
    old = {i: hf_logp(samples[i]) for i in range(12)}
split_gen, k, n_clipped = torch.Generator().manual_seed(11), 0, 0
for epoch in range(2):
    for part in split_mini_batches(len(mine), 2, split_gen):
        batches = [None] * world
        dist.all_gather_object(batches, [mine[j] for j in part])
        batch = [i for b in batches for i in b]
        n_tokens = sum(len(samples[i].response_ids) for i in batch)
        hf_opt.zero_grad()
        loss = 0.0
        for i in batch:
            ratio = (hf_logp(samples[i]) - old[i]).exp()
            a = adv[i]
            loss = loss - torch.minimum(ratio * a, ratio.clamp(0.9, 1.15) * a).sum() / n_tokens
            n_clipped += int(((ratio < 0.9) | (ratio > 1.15)).sum())
        loss.backward()
        err = max((grads[k][n] - p.grad).abs().max().item() for n, p in hf.named_parameters())
        top = max(p.grad.abs().max().item() for p in hf.parameters())
        print(f"rank {rank} PPO step {k}: grad error {err:.2e} (max grad {top:.2e})")
        # every step starts from the same weights (hf steps with the sharded gradient, below),
        # so every step is held to the first step's bound (see fsdp_parity.py)
        assert err < 1e-5 * top, (k, err, top)
        for n, p in hf.named_parameters():
            p.grad.copy_(grads[k][n])
        hf_opt.step()
        k += 1
print(f"rank {rank}: {n_clipped} token ratios left the clip range during the PPO steps")
assert n_clipped > 0, "the clip never engaged: the PPO check would not test it"
dist.destroy_process_group()
print("REINFORCE_OK")
