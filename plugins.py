"""User code the trainer calls: rewards and environments, named in the config as a built-in, an
importable `package.module:function` or a `path/to/file.py:function`.

`resolve` finds a function and checks that it can be called with two arguments, with one-line
errors that name the config field. `Worker` calls functions of one kind in a persistent worker
process, each call with a time limit: a call that hangs is cut (the worker is killed and started
again for the calls left), one that raises or returns what its kind refuses is counted, and the
run goes on. With a time limit of 0 the same calls run in the trainer's own process, where a
breakpoint() in them stops.

A leaf module: it imports nothing from the project (the worker process imports only this module
and the functions' own modules).
"""

import atexit
import importlib.util  # also binds importlib
import inspect
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
import traceback
import types
import weakref
from pathlib import Path

class Failed:
    """The outcome of a call that raised, returned what its kind refuses, or died with its
    worker. The class itself is the marker: it keeps its identity through the worker's pipe."""


def one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())


def _load(where: str):
    """The module a dotted name imports, or the one a .py file path (from the cwd) runs."""
    if not where.endswith(".py"):
        return importlib.import_module(where)
    path = Path(where).resolve(strict=True)  # FileNotFoundError if missing
    name = "_plugin_file" + re.sub(r"\W", "_", str(path.with_suffix("")))  # one module per file
    if name not in sys.modules:
        loader = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(loader)  # dataclasses look it up
        try:
            loader.loader.exec_module(sys.modules[name])
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def resolve(spec: str, field: str, builtins: dict, signature: str):
    """The function `spec` names: a key of `builtins`, `package.module:function` (imported), or
    `path/to/file.py:function` (relative to the working directory), callable with two arguments
    as `signature` says. Raises a one-line ValueError that starts with `field`."""
    if ":" not in spec:
        if spec in builtins:
            return builtins[spec]
        raise ValueError(f"{field}: {spec!r} is not a built-in ({', '.join(builtins)}) nor "
                         "module:function nor file.py:function. Fix: use one of those forms.")
    where, name = spec.rsplit(":", 1)
    err = f"{field}: importing {where!r} failed"
    try:
        module = _load(where)
    except FileNotFoundError:
        raise ValueError(f"{field}: file {where!r} not found (from {os.getcwd()}). "
                         "Fix: give it relative to the working directory, or absolute.") from None
    except ModuleNotFoundError as e:
        if e.name == where or where.startswith(f"{e.name}."):  # not one that it imports
            raise ValueError(f"{field}: module {where!r} not found. Fix: install it, put its "
                             f"folder on PYTHONPATH, or give path/to/file.py:{name}.") from None
        raise ValueError(f"{err}: {one_line(e)}. Fix: install what it imports.") from e
    except Exception as e:
        raise ValueError(f"{err}: {one_line(e)}. Fix: make it import in a fresh Python.") from e
    fn = getattr(module, name, None)
    if fn is None:
        raise ValueError(f"{field}: {where!r} has no {name!r}. Fix: check the name after ':'.")
    if not callable(fn):
        raise ValueError(f"{field}: {spec!r} is a {type(fn).__name__}, not a function. "
                         f"Fix: define it as {signature}.")
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError:
        raise ValueError(f"{field}: {spec!r} cannot be called with two arguments (signature "
                         f"{inspect.signature(fn)}). Fix: define it as {signature}.") from None
    except ValueError:  # some builtins have no signature to check
        pass
    return fn


def call(fn, spec: str, args: tuple, check, shown: set, what: str):
    """check(fn(*args)), or Failed if that raised (with the traceback on stderr the first time for
    each function, so that a broken one is seen)."""
    try:
        return check(fn(*args))
    except Exception:
        if spec not in shown:
            shown.add(spec)
            print(f"{what} {spec!r} failed (counted; shown once):", file=sys.stderr)
            traceback.print_exc()
        return Failed


def _worker(conn, specs: list[str], resolver, check, what: str, parent_pid: int) -> None:
    """The worker process (module level: spawn pickles it, `resolver` and `check` too, by name).
    Resolves the specs, sends "ready", then per job (a list of (function index, args)) one
    outcome per call, in order. Exits on None, EOF or when the trainer is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's; it stops us

    def exit_with_parent():  # never outlive the trainer, even while a call hangs
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=exit_with_parent, daemon=True).start()
    try:
        fns = [resolver(s) for s in specs]
    except Exception as e:
        return conn.send(one_line(e))
    conn.send("ready")
    shown = set()
    try:
        while (job := conn.recv()) is not None:
            for j, args in job:
                conn.send(call(fns[j], specs[j], args, check, shown, what))
    except (EOFError, OSError):  # the parent is gone
        pass


def _stop(proc, conn) -> None:
    conn.close()
    proc.kill()  # at once: it holds no state worth a graceful exit
    proc.join()


class Worker:
    """Functions of one kind (`what`: "reward", "environment") called with a time limit of
    timeout_s per call in one persistent worker process, started on first use; in this process
    with timeout_s 0. `resolver(spec)` finds each function (in the worker too: module-level);
    `check(value)` returns what a call's value stands for, or raises for one the kind refuses.
    `run` returns each call's outcome: that, Failed, or TimeoutError (cut at the limit). Use as a
    context manager, or call close()."""

    START_TIMEOUT_S = 120.0  # for a worker to start and import the functions (no call's time)

    def __init__(self, specs: list[str], resolver, check, timeout_s: float, what: str):
        self.specs, self.resolver, self.check = list(specs), resolver, check
        self.timeout_s, self.what = timeout_s, what
        self.fns = [resolver(s) for s in self.specs] if timeout_s == 0 else None
        self._shown = set()  # in-process: the functions whose failure was shown
        self._proc = self._conn = self._finalizer = None

    def run(self, calls: list[tuple[int, tuple]]) -> list:
        if self.fns is not None:  # in this process
            return [call(self.fns[j], self.specs[j], args, self.check, self._shown, self.what)
                    for j, args in calls]
        try:
            return self._run(calls)
        except BaseException:  # Ctrl-C mid-job: the worker would answer the next job with
            self.close()  # this one's outcomes still on their way; a fresh one starts instead
            raise

    def _run(self, calls: list[tuple[int, tuple]]) -> list:
        out = []
        while len(out) < len(calls):
            conn = self._start()
            try:  # one job: all that is left
                conn.send(calls[len(out):])
            except OSError:  # the worker died while idle: start another
                self.close()
                continue
            while len(out) < len(calls):
                # the worker makes the calls one after another: each gets timeout_s from here
                try:
                    v = conn.recv() if conn.poll(self.timeout_s) else TimeoutError
                    lost = v is TimeoutError
                except (EOFError, OSError):  # the worker died in this call (crash, os._exit)
                    v, lost = Failed, True
                out.append(v)
                if lost:
                    self.close()  # and restart for what is left
                    break
        return out

    def _start(self):
        """The worker's connection; starts a worker if there is none (or it died)."""
        if self._proc is not None and self._proc.is_alive():
            return self._conn
        self.close()
        ctx = multiprocessing.get_context("spawn")  # fork is unsafe with torch/vLLM threads
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker, args=(child, self.specs, self.resolver,
                                                       self.check, self.what, os.getpid()))
        # spawn re-runs the parent's __main__ file in the child (train_grpo.py: torch and the
        # accelerator setup, seconds and hundreds of MB); the worker needs only the functions'
        # own modules: hide it
        main, sys.modules["__main__"] = sys.modules["__main__"], types.ModuleType("__main__")
        try:
            self._proc.start()
        finally:
            sys.modules["__main__"] = main
        child.close()  # so that our end reads EOF if the worker dies
        # stops the worker when this Worker is collected, and at exit: atexit runs this before
        # multiprocessing's own hook (registered earlier), which would wait for it forever
        self._finalizer = weakref.finalize(self, _stop, self._proc, self._conn)
        atexit.register(self._finalizer)
        try:
            msg = self._conn.recv() if self._conn.poll(self.START_TIMEOUT_S) else "no answer"
        except (EOFError, OSError):
            msg = f"it exited with code {self._proc.join(5.0) or self._proc.exitcode}"
        if msg != "ready":
            self.close()
            raise RuntimeError(f"the {self.what} worker did not start ({msg}). Fix: make every "
                               "function importable in a fresh Python process.")
        return self._conn

    def close(self) -> None:
        """Stop the worker, if any (a later run() starts a new one)."""
        if self._finalizer is not None:
            atexit.unregister(self._finalizer)
            self._finalizer()  # runs _stop(proc, conn), once
        self._proc = self._conn = self._finalizer = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
