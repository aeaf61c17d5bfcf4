"""One rank on an accelerator (a GPU or an NPU): what CPU cannot show about memory and bf16
numerics (tests/test_device.py runs it).

1. The engine's turn (weight_sync.EngineTurn, model.offload on) gives the device back: after
   both moves to host memory, the device memory in use (every allocator, as the engine sees it)
   fell by at least 90% of the actor's fp32 shards plus Adam's state, the pinned host memory is
   exactly the copied bytes, and leaving the turn restores every element of both.
2. After a bf16 weight sync, the engine's logprobs of a probe batch equal the trainer's (bf16
   compute, the same bf16 weights) within a bound from bf16 rounding: each of the 2L + 2 places
   where the two implementations may round a normalised activation differently (the embedding,
   each layer's attention and MLP output, the final norm) moves a logit by at most about one bf16
   unit (2^-8 relative), and a logprob by about twice that; the mean gap must stay below
   2 (2L + 2) 2^-8 and the largest below 4 times that. A stale or garbled sync is off by O(1).
3. The engine's sleep frees at least its KV cache.
4. An update in which no rank has a token to learn from (every group dropped) runs: its
   gradient norm is a device tensor like any other step's.
Prints DEVICE_CHECKS_OK and one JSON line of what it measured.
Usage: python tests/workers/device_checks.py MODEL_DIR
"""

import json
import sys

import npu_ops  # noqa: I001  (first: the platform environment before torch loads)
import torch
from torch.distributed.device_mesh import init_device_mesh

import engines
import fsdp_utils
import grpo
import offload
import rollout
import trainer
import weight_sync
from records import Sample
from tests.reference import batch_of, token_logprobs
from train_grpo import init_distributed

KV_BYTES = 1 << 30

model_dir = sys.argv[1]
npu_ops.setup_env(sleep_mode=True)
rank, world = init_distributed()
assert npu_ops.device_type() != "cpu" and npu_ops.engine_supports_sleep()
device = npu_ops.local_device()
engine = rollout.Engine(rollout.RolloutConfig(dtype="bfloat16", max_model_len=256,
                                              kv_cache_memory_bytes=KV_BYTES, max_new_tokens=8),
                        model_dir)
used = npu_ops.device_memory_used_gb
before_sleep = used()
engine.sleep()
freed_by_sleep = before_sleep - used()
torch.manual_seed(0)
actor = fsdp_utils.build_actor(fsdp_utils.ModelConfig(path=model_dir, param_dtype="bfloat16"),
                               init_device_mesh(npu_ops.device_type(), (world,)))
opt, _ = fsdp_utils.build_optimizer(fsdp_utils.OptimConfig(lr=1e-4), actor, 10)
g = grpo.GRPOConfig(is_correction="none")
vocab = actor.config.vocab_size
gen = torch.Generator().manual_seed(1)
samples = [Sample(torch.randint(0, vocab, (16,), generator=gen).tolist(),
                  torch.randint(0, vocab, (24,), generator=gen).tolist(), [0.0] * 24, False)
           for _ in range(8)]
settings = trainer.settings(g, max_len=24, grad_clip=1.0, device=device)
trainer.update(actor, opt, batch_of(samples, torch.randn(8, generator=gen)), settings)
held = offload.device_tensors(actor, opt)
state_bytes = sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t
                                                         for t in held}.values())
before = [t.cpu() for t in held]  # every element, to compare after the move back
turn = weight_sync.EngineTurn(actor, opt, engine, offload_on=True)

# 2) the sync, in the engine's turn as the loop takes it: the optimizer state to host memory
#    before the weights wake, the actor between the load and the KV cache's wake
allocated = []  # torch's allocator around the moves (the engine's pool is not in the change)
state_to_host, params_to_host = turn.state.to_host, turn.params.to_host


def optimizer_out(*args):
    allocated.append(npu_ops.memory_gb()["allocated"])
    state_to_host(*args)


def actor_out(*args):
    params_to_host(*args)
    allocated.append(npu_ops.memory_gb()["allocated"])


turn.state.to_host, turn.params.to_host = optimizer_out, actor_out
probe = [s.prompt_ids + s.response_ids for s in samples]
with turn:  # leaving it: the engine asleep, the actor and its optimizer state back
    stats = turn.metrics()
    freed_by_offload = (stats["mem_optimizer_out_before_gb"] - stats["mem_optimizer_out_after_gb"]
                        + stats["mem_actor_out_before_gb"] - stats["mem_actor_out_after_gb"])
    host_bytes = turn.params.host_bytes + turn.state.host_bytes
    copied = sum(sum(c.layout) if c.away else 0 for c in (turn.params, turn.state))
    assert host_bytes == copied == state_bytes, (host_bytes, copied, state_bytes)
    engine_lp = engines.prompt_logprobs(engine, probe)
assert len(allocated) == 2, allocated
assert all(torch.equal(t.cpu(), b) for t, b in zip(held, before)), "the moves changed a value"
# 4) no token to learn from on any rank: the norm must come back on the device, not the CPU
empty = trainer.update(actor, opt, batch_of([], torch.zeros(0), 1), settings).metrics
assert empty["grad_norm"] == 0.0, empty
with torch.no_grad():
    gaps = []
    for ids, elp in zip(probe, engine_lp):
        t = torch.tensor([ids], device=device)
        lp = token_logprobs(actor(input_ids=t).logits[:, :-1], t[:, 1:])[0].float().cpu()
        gaps.append((lp - torch.tensor(elp)).abs())
gaps = torch.cat(gaps)
layers = actor.config.num_hidden_layers
bound = 2 * (2 * layers + 2) * 2.0**-8
result = {"state_gb": state_bytes / 2**30, "freed_by_offload_gb": freed_by_offload,
          "host_gb": host_bytes / 2**30,
          "allocated_freed_by_offload_gb": allocated[0] - allocated[1],
          "kv_cache_gb": KV_BYTES / 2**30, "freed_by_sleep_gb": freed_by_sleep,
          "logp_gap_mean": gaps.mean().item(), "logp_gap_max": gaps.max().item(),
          "logp_gap_bound": bound}
print(json.dumps(result), flush=True)
assert freed_by_offload >= 0.9 * state_bytes / 2**30, result
assert freed_by_sleep >= KV_BYTES / 2**30, result
assert result["logp_gap_mean"] < bound and result["logp_gap_max"] < 4 * bound, result
engine.shutdown()
print("DEVICE_CHECKS_OK")
