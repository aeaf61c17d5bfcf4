"""The trainer as torchrun runs it, except that rank RANK sends itself SIGNAL (a name: SIGTERM,
SIGKILL) as step STEP begins collecting, on the launcher's first attempt only (torchrun's
TORCHELASTIC_RESTART_COUNT 0, or none; with SIGNALLED_ONCE set, once: while no file of that
path exists, which it then writes: on several nodes each agent counts its own restarts): a
scheduler's stop, or a rank that dies, mid-step.
Usage: torchrun ... tests/workers/signalled.py SIGNAL RANK STEP [train_grpo.py args]
"""

import os
import signal
import sys

import sampler
import train_grpo

name, rank, step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
once = os.environ.get("SIGNALLED_ONCE")
first = (not os.path.exists(once) if once
         else os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0")
real = sampler.Sampler.collect


def collect(self, at: int):
    if first and at == step and int(os.environ["RANK"]) == rank:
        print(f"rank {rank}: sending itself {name} in step {at}", flush=True)
        if once:
            open(once, "w").close()
        os.kill(os.getpid(), getattr(signal, name))
    return real(self, at)


sampler.Sampler.collect = collect
train_grpo.main(sys.argv[4:])
