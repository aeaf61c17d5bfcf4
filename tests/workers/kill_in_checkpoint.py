"""The trainer as torchrun runs it, except that the checkpoint of step KILL_STEP stops after its
shards are written, before it is complete, and waits there to be killed (a crash mid-write).
Usage: torchrun ... tests/workers/kill_in_checkpoint.py MARKER KILL_STEP [train_grpo.py args]
Each rank writes its process id into MARKER.<rank> once it is waiting, for the test to kill it
(torchrun starts each rank in a session of its own, and so does tests/forkserver.py: killing the
launcher's process group would leave the ranks running).
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
        with open(f"{marker}.{os.environ['RANK']}.tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(f"{marker}.{os.environ['RANK']}.tmp", f"{marker}.{os.environ['RANK']}")
        time.sleep(3600)


dcp.save = save_then_wait  # checkpoint.py calls dcp.save through the module
train_grpo.main(sys.argv[3:])
