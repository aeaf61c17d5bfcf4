"""The trainer as torchrun runs it, except that the checkpoint of step KILL_STEP stops after its
shards are written, before it is complete, and waits there to be killed (a crash mid-write).
Usage: torchrun ... tests/workers/kill_in_checkpoint.py MARKER KILL_STEP [train_grpo.py args]
Each rank touches MARKER.<rank> once it is waiting.
"""

import os
import sys
import time

import torch.distributed.checkpoint as dcp

import train_grpo

marker, kill_step = sys.argv[1], int(sys.argv[2])
real_save = dcp.save


def save_then_wait(state, checkpoint_id):
    real_save(state, checkpoint_id=checkpoint_id)
    if os.path.basename(checkpoint_id.rstrip("/")) == f"step_{kill_step:06d}.tmp":
        open(f"{marker}.{os.environ['RANK']}", "w").close()
        time.sleep(3600)


dcp.save = save_then_wait  # fsdp_utils calls dcp.save through the module
train_grpo.main(sys.argv[3:])
