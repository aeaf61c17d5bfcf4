"""Non-finite optimizer steps on the tiny task (2 ranks, fp32, optim.max_nonfinite=2): a NaN put
into rank 0's loss at step 2 and an inf into one of rank 1's gradients at step 4. Neither step
changes a parameter shard or an optimizer state tensor (bit for bit), each is counted in the
metrics under its quantity, and the run goes on: steps 3 and 5 train. Then steps 6 and 7 both
poisoned, two in a row: step 7 raises faults.NonFinite, one line naming the step and the
quantity.
Prints NONFINITE_OK on every rank when every check passed; any failure raises.
Usage: torchrun --nproc_per_node 2 tests/workers/nonfinite.py TASK_DIR OUT_DIR"""

import os
import sys

import torch
import torch.distributed as dist

import faults
import trainer
from train_grpo import load_config, setup, train_step

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/workers
from states import same_state, state  # noqa: E402

task_dir, out_dir = sys.argv[1:3]
cfg = load_config("configs/tiny_cpu.yaml", [
    f"--data.tiny_task_dir={task_dir}", f"--log.out_dir={out_dir}", "--log.eval_every=0",
    "--grpo.prompts_per_step=8", "--train.steps=8", "--optim.max_nonfinite=2"])
POISON = {2: (0, "loss"), 4: (1, "grad"), 6: (0, "loss"), 7: (1, "grad")}  # step: rank, where
real = trainer.accumulate_gradients
now = {"step": 0}


def poisoned(actor, batch, *args, **kwargs):
    """The real forward and backward; then, at a poisoned step on its rank, a NaN loss (what
    this rank reports: its gradients stay finite, so only the loss can stop the step) or an inf
    in the first gradient's first element (the loss stays finite)."""
    logp, stats = real(actor, batch, *args, **kwargs)
    rank, where = POISON.get(now["step"], (None, None))
    if rank == dist.get_rank() and where == "loss":
        stats["loss"] = stats["loss"] * float("nan")
    if rank == dist.get_rank() and where == "grad":
        grad = next(p.grad for p in actor.parameters() if p.grad is not None)
        (grad.to_local() if hasattr(grad, "to_local") else grad).view(-1)[0] = float("inf")
    return logp, stats


trainer.accumulate_gradients = poisoned
with setup(cfg) as run:
    seen = []
    for step in (1, 2, 3, 4, 5):
        now["step"], before = step, state(run)
        m = train_step(run)
        seen.append((m["nonfinite_loss"], m["nonfinite_grad_norm"]))
        if step in POISON:
            same_state(before, state(run), f"step {step}")
        else:  # a taken step moved every rank's shards
            assert any(not torch.equal(v, state(run)[k]) for k, v in before.items()
                       if k.startswith("param")), step
    assert seen == [(0, 0), (1, 0), (0, 0), (0, 1), (0, 0)], seen
    assert run.nonfinite == 0  # step 5 ended the streak
    now["step"] = 6
    train_step(run)
    assert run.nonfinite == 1
    now["step"] = 7
    try:
        train_step(run)
        raise AssertionError("two non-finite steps in a row did not stop the run")
    except faults.NonFinite as e:
        said = str(e)
    assert said.startswith("step 7: the grad norm was not finite in 2 optimizer steps in a "
                           "row (optim.max_nonfinite=2)") and "\n" not in said, said
    print(f"rank {dist.get_rank()}: {said}")
print("NONFINITE_OK")
