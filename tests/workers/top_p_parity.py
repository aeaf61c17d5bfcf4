"""At rollout.top_p < 1 the engine's logprob of each token it sampled (processed_logprobs: over
its nucleus, renormalised) equals the trainer's (logprobs.sample_logprobs with the run's top_p),
on the same weights, within 1e-4; the full softmax's is far from it. One rank.
Usage: python tests/workers/top_p_parity.py MODEL_DIR 1
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import engines
import fsdp_utils
import grpo
import logprobs
import rollout
import trainer

model_dir, tp, rank, world, tok, cfg = engines.start(max_num_seqs=64, max_new_tokens=8,
                                                     temperature=0.7, top_p=0.9)
engine = rollout.Engine(cfg, model_dir, tp_group_index=rank // tp)
actor = fsdp_utils.build_actor(fsdp_utils.ModelConfig(path=model_dir, param_dtype="float32"),
                               init_device_mesh("cpu", (world,)))
prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ["1+2=", "3+4=", "0+5="]]
samples = engine.generate(prompts, n=16, seed=0)
engine_lp = torch.tensor([x for s in samples for x in s.logp])
settings = trainer.settings(grpo.GRPOConfig(), temperature=0.7, top_p=0.9).passes
ours = torch.cat(logprobs.sample_logprobs(actor, samples, settings))
full = torch.cat(logprobs.sample_logprobs(
    actor, samples, trainer.settings(grpo.GRPOConfig(), temperature=0.7).passes))
gap, gap_full = (engine_lp - ours).abs().max().item(), (engine_lp - full).abs().max().item()
print(f"rank {rank}: {len(engine_lp)} tokens, max |engine - trainer| logprob at top_p 0.9 "
      f"{gap:.2e}, against the full softmax {gap_full:.2e}", flush=True)
assert gap < 1e-4 and gap_full > 1e-2, (gap, gap_full)
engine.shutdown()
if dist.is_initialized():
    dist.destroy_process_group()
print("TOP_P_PARITY_OK")
