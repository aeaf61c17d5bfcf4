"""What a run does about the faults that end runs: a stop signal, and optimizer steps that are not
finite.

- **A stop signal** (SIGTERM, which a scheduler sends before it preempts a job, or SIGUSR1, which
  SLURM can be asked to send a while before the time limit): `StopSignals` records it and
  the step in progress goes on; after it, every rank agrees to stop (`StopSignals.agreed`),
  and train_grpo.train writes a checkpoint and returns, so the process exits 0. Under torchrun,
  a signal to torchrun itself is passed to the ranks, which get 30 s to exit before torchrun
  kills them (torch 2.10 to 2.13, distributed/elastic/multiprocessing/api.py: `close`,
  timeout 30; 2.13's torchrun takes `--shutdown-timeout` or TORCH_ELASTIC_SHUTDOWN_TIMEOUT,
  2.10 and 2.11 nothing): a step and a checkpoint that take longer need the signal sent to the
  ranks alone, or the longer timeout.
- **A non-finite optimizer step**: trainer.update does not take it (trainer.nonfinite); `count`
  keeps the run's count of such steps in a row and stops the run at optim.max_nonfinite with
  one line (`NonFinite`).
"""

import logging
import signal
import threading

import torch
import torch.distributed as dist

log = logging.getLogger("grpo")

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class NonFinite(RuntimeError):
    """optim.max_nonfinite optimizer steps in a row were not finite: the run stops."""


def count(streak: int, skipped: list, step: int, limit: int) -> int:
    """The non-finite optimizer steps in a row after a step's (`skipped`: trainer.update's verdict
    of each of its optimizer steps, None for one taken), from `streak` before it; raises
    NonFinite, one line naming the step and the quantity, once it reaches `limit`."""
    for what in skipped:
        streak = streak + 1 if what else 0
        if streak >= limit:
            raise NonFinite(
                f"step {step}: the {what.replace('_', ' ')} was not finite in {streak} optimizer "
                f"steps in a row (optim.max_nonfinite={limit}), so none of them changed the "
                "parameters or the optimizer's state. Fix: look at these steps' samples "
                "(samples.jsonl, metrics.jsonl's nonfinite_*), lower optim.lr, or train in "
                "float32 (model.param_dtype); the newest checkpoint resumes before them")
    return streak


class StopSignals:
    """Within `with StopSignals() as s:` SIGTERM and SIGUSR1 are recorded instead of ending the
    process; `s.agreed()` after each step says, the same on every rank, whether any rank got one
    (its name) or not (None). The handlers before are put back on leaving. Outside the main
    thread (where Python cannot install a handler) nothing is installed."""

    def __init__(self):
        self.got, self.before = 0, {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self.before = {s: signal.signal(s, self._record) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.before.items():
            signal.signal(s, handler)
        self.before = {}

    def _record(self, signum: int, frame) -> None:
        if not self.got:
            log.warning("got %s: stopping after this step, with a checkpoint",
                        signal.Signals(signum).name)
        self.got = self.got or signum

    def agreed(self) -> str | None:
        """The signal some rank got (the largest number, if several), or None; every rank must
        call (one all-reduce of one number on the host)."""
        got = torch.tensor([self.got], dtype=torch.int64)
        if dist.is_initialized():
            dist.all_reduce(got, op=dist.ReduceOp.MAX)
        return signal.Signals(int(got)).name if int(got) else None
