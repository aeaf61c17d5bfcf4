"""What a step leaves alive, on the tiny task in a world of one with the offload on (the actor and
its optimizer state out to host memory and back, a push into the engine, every step): the objects
of step 3 (its rollout, its samples, scores and batch, the batch's tensors) must all be gone
after step 4 has replaced them (weak references), and no kind of object may grow by one a step
(gc's count by type after steps 4, 7 and 10: a list or cache that keeps something of every step
grows by 3 or more in both stretches; a dict or list of numbers and strings alone is not tracked by
gc, so not counted). Prints STEP_LEAKS_OK when every check passed; any failure raises.
Usage: python tests/workers/step_leaks.py TASK_DIR OUT_DIR"""

import collections
import gc
import os
import sys
import weakref

import torch

from train_grpo import load_config, setup, train_step

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/workers
from growth import grown  # noqa: E402

task_dir, out_dir = sys.argv[1:3]
cfg = load_config("configs/tiny_cpu.yaml", [
    f"--data.tiny_task_dir={task_dir}", f"--log.out_dir={out_dir}", "--log.eval_every=0",
    "--grpo.prompts_per_step=8", "--train.steps=10", "--model.offload=on"])

with setup(cfg) as run:
    for _ in range(3):  # what fills once (the engine's, the allocator's) fills here
        train_step(run)
    last = run.last
    held = [last.rollout, last.scored, last.batch, *last.rollout.samples,
            *(v for v in vars(last.batch).values() if torch.is_tensor(v))]
    refs = [weakref.ref(x) for x in held]
    del last, held
    train_step(run)
    gc.collect()
    alive = [type(r()).__qualname__ for r in refs if r() is not None]
    assert not alive, f"step 3's objects alive after step 4: {collections.Counter(alive)}"
    n, refs, alive = len(refs), None, None
    found, moved = grown(lambda: train_step(run))
    assert not found, f"objects that grew by 3 or more in steps 5-7 and again in 8-10: {found}"
    print(f"{n} objects of step 3 gone after step 4; from step 4 to step 10 no kind of object "
          f"grew a step at a time (the most any kind moved: {moved})")
print("STEP_LEAKS_OK")
