"""The push into a bf16 engine leaves it exactly as vLLM's own loader leaves an engine that reads
the same weights from a checkpoint: the two engines' logprobs of a probe batch are equal, bit
for bit (same weights, same kernels, same batch). For models whose bf16 logprobs cannot be told
apart from a wrong layout by a rounding bound (a hybrid with experts, where the bf16 rounding of
the routers' inputs flips experts), this is the exact check. Two runs, as two engines in one
process are not a thing vLLM's external launcher supports:
  push: the actor (fp32, its weights rounded to bf16 values) changed by noise, pushed into an
        engine built from MODEL_DIR; the probe's logprobs written to OUT/pushed.json; then the
        same push with each wrong layout in WRONG that the model has, each probe written too;
        the actor exported to OUT/model (checkpoint.save_hf, the run's export: a
        vision-language MODEL_DIR's language model goes back beside its vision tower);
  load: an engine built from OUT/model; its probe equals the right push's exactly, and every
        wrong layout's differs by more than 1e-2 somewhere (or is NaN).
So a vision-language checkpoint's push (its language model under the checkpoint's names) and
its export are checked together.
Prints PUSH_EQUALS_LOAD_OK (load) or PUSHED_OK (push).
Usage: torchrun --nproc_per_node 2 tests/workers/push_equals_load.py MODEL_DIR TP OUT push|load
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import checkpoint
import engines
import fsdp_utils
import rollout
import weight_sync

model_dir, tp, rank, world, tok, cfg = engines.start(
    max_num_seqs=32, max_new_tokens=8, dtype="bfloat16", enable_prefix_caching=False)
out, mode = sys.argv[3], sys.argv[4]
probe = [tok(t, add_special_tokens=False)["input_ids"] for t in
         ["3+4=7", "0+0=0", "12+34=46+1", "5=5", "8+1=9=9+9", "1+2=3+4=7+0=7+1=8+3+4="]]


def halves_swapped(suffix: str):
    """The experts' fused gate_up_proj (E, 2I, H) with its gate and up halves swapped."""
    return lambda weights: [(n, torch.cat(w.chunk(2, 1)[::-1], 1) if n.endswith(suffix) else w)
                            for n, w in weights]


WRONG = {  # what: (a name the layout needs among the model's, the change)
    "experts' gate/up swapped": ("mlp.experts.gate_up_proj",
                                 halves_swapped("mlp.experts.gate_up_proj")),
    "shared expert's gate/up swapped": ("shared_expert.gate_proj", engines.swap(
        "shared_expert.gate_proj.weight", "shared_expert.up_proj.weight")),
    "in_proj_a/in_proj_b swapped": ("in_proj_a", engines.swap("in_proj_a.weight",
                                                              "in_proj_b.weight")),
    "A_log/dt_bias swapped": ("A_log", engines.swap("A_log", "dt_bias")),
}

if mode == "push":
    engine = rollout.Engine(cfg, model_dir, tp_group_index=rank // tp)
    print(f"rank {rank} loader calls at load {engines.loader_calls()}", flush=True)
    torch.manual_seed(0)
    actor = fsdp_utils.build_actor(fsdp_utils.ModelConfig(path=model_dir, param_dtype="float32"),
                                   init_device_mesh("cpu", (world,)))
    with torch.no_grad():  # another model than MODEL_DIR's, every weight a bf16 value
        for p in actor.parameters():
            local = p.to_local()
            local.add_(torch.randn_like(local) * 0.2).copy_(local.bfloat16().float())
    engine.wake(["weights"])
    weight_sync.load(actor, engine)
    engine.wake(["kv_cache"])
    probes = {"right": engines.prompt_logprobs(engine, probe)}
    real = engine.load_weights
    names = [n for n, _ in actor.named_parameters()]
    for what, (needs, change) in WRONG.items():
        if not any(needs in n for n in names):
            continue
        engine.load_weights = lambda weights, change=change: real(change(list(weights)))
        weight_sync.load(actor, engine)
        probes[what] = engines.prompt_logprobs(engine, probe)
    engine.load_weights = real
    checkpoint.save_hf(actor, tok, os.path.join(out, "model"), source=model_dir)
    if rank == 0:
        with open(os.path.join(out, "pushed.json"), "w") as f:
            json.dump(probes, f)
    engine.shutdown()
    print("PUSHED_OK", flush=True)
else:
    engine = rollout.Engine(cfg, os.path.join(out, "model"), tp_group_index=rank // tp)
    loaded = torch.tensor([x for row in engines.prompt_logprobs(engine, probe) for x in row])
    with open(os.path.join(out, "pushed.json")) as f:
        pushed = {k: torch.tensor([x for row in v for x in row]) for k, v in json.load(f).items()}
    gap = (pushed.pop("right") - loaded).abs().max().item()
    print(f"rank {rank} tp {tp}: |pushed - loaded| logprob max {gap:.3e}", flush=True)
    assert gap == 0.0, gap
    for what, lp in pushed.items():
        wrong = (lp - loaded).abs().max().item()
        print(f"rank {rank} tp {tp}: LAYOUT_CAUGHT {what}: {wrong:.2e}", flush=True)
        assert not wrong <= 1e-2, (what, wrong)  # (NaN, as A_log/dt_bias swapped can give: caught)
    engine.shutdown()
    print("PUSH_EQUALS_LOAD_OK", flush=True)
if dist.is_initialized():
    dist.destroy_process_group()
