"""User code the trainer calls: rewards and environments, named in the config as a built-in, an
importable `package.module:function` or a `path/to/file.py:function`.

`resolve` finds a function and checks that it can be called with two arguments, with one-line
errors that name the config field. `Worker` calls functions of one kind in persistent worker
processes, each call with a time limit of its own: plain functions in a pool of processes (a
call each at a time), `async def` functions in one process's event loop (many calls at once).
A call that hangs is cut at its limit (a plain call's worker is killed and replaced) while the
others go on; one that raises or returns what its kind refuses is counted, and the run goes on.
With a time limit of 0 the same calls run in the trainer's own process, where a breakpoint() in
them stops. `Worker` is the front; `Processes` or `InProcess` runs the calls.

A leaf module: it imports nothing from the project (the worker process imports only this module
and the functions' own modules).
"""

import asyncio
import atexit
import collections
import importlib.util  # also binds importlib
import inspect
import multiprocessing
import multiprocessing.connection
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
    """An error as one line: its type and the first line of its message, spaces collapsed."""
    first = next((line for line in str(e).splitlines() if line.strip()), "")
    return " ".join(f"{type(e).__name__}: {first}".split())


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


class Shown(set):
    """The (function, kind of error) pairs whose failure was printed; none is while `quiet` is
    set (Worker.quiet: the calls in flight then fail by design)."""

    def __init__(self, quiet):
        super().__init__()
        self.quiet = quiet


def call(fn, spec: str, args: tuple, check, shown: Shown, what: str):
    """check(fn(*args)), or Failed if that raised (with the traceback on stderr the first time for
    each function and kind of error, so that a broken one is seen, and a flood is not)."""
    try:
        return check(fn(*args))
    except Exception as e:
        return _failed(spec, shown, what, e)


async def acall(fn, spec: str, args: tuple, check, shown: Shown, what: str):
    """call() for an `async def` function."""
    try:
        return check(await fn(*args))
    except Exception as e:
        return _failed(spec, shown, what, e)


def _failed(spec: str, shown: Shown, what: str, e: Exception):
    if (spec, type(e)) not in shown and not shown.quiet.is_set():
        shown.add((spec, type(e)))
        print(f"{what} {spec!r} failed with {type(e).__name__} (counted; each kind of error "
              "shown once):", file=sys.stderr)
        traceback.print_exc()
    return Failed


async def _gather(fns, specs, calls, check, shown, what, concurrency, timeout_s,
                  started=None, ended=None):
    """Run the async calls [(k, function index, args)], at most `concurrency` at once, each cut
    at timeout_s (None: no limit); returns {k: outcome}. started(k) and ended(k, outcome): as
    call k begins and ends."""
    gate, out = asyncio.Semaphore(concurrency), {}

    async def one(k, j, args):
        async with gate:
            if started is not None:
                started(k)
            try:
                out[k] = await asyncio.wait_for(
                    acall(fns[j], specs[j], args, check, shown, what), timeout_s)
            except asyncio.TimeoutError:  # cut at its limit (a cancelled call is no failure)
                out[k] = TimeoutError
            if ended is not None:
                ended(k, out[k])

    await asyncio.gather(*(one(*c) for c in calls))
    return out


def _worker(conn, specs: list[str], resolver, check, what: str, parent_pid: int,
            concurrency: int, quiet) -> None:
    """The worker process (module level: spawn pickles it, `resolver` and `check` too, by name).
    Resolves the specs and sends "ready". Then per job, a list of (k, function index, args):
    plain functions one after another, each outcome sent as (k, outcome); `async def` ones
    (a job of ("async", calls, timeout_s)) in an event loop, sending ("start", k) as each
    begins and (k, outcome) as each ends. Exits on None, EOF or when the trainer is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's; it stops us
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # so is a scheduler's stop: the trainer
    #   finishes its step, which may need us, before it stops (faults.StopSignals)

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
    shown = Shown(quiet)
    # one event loop for the process's life, not one a job: what a job's calls leave behind
    #   finds its loop open later (an HTTP client they made and dropped is closed when the
    #   garbage collector gets to it, on the loop running then: openai 3.57's
    #   AsyncHttpxClientWrapper.__del__; on a closed one each raised "Event loop is closed")
    loop = asyncio.new_event_loop()
    try:
        while (job := conn.recv()) is not None:
            if job[0] == "async":
                _, calls, timeout_s = job
                loop.run_until_complete(_gather(fns, specs, calls, check, shown, what,
                                                concurrency, timeout_s,
                                                lambda k: conn.send(("start", k)),
                                                lambda k, v: conn.send((k, v))))
            else:
                for k, j, args in job:
                    conn.send((k, call(fns[j], specs[j], args, check, shown, what)))
    except (EOFError, OSError):  # the parent is gone
        pass


def _stop(proc, conn) -> None:
    conn.close()
    proc.kill()  # at once: it holds no state worth a graceful exit
    proc.join()


def default_workers() -> int:
    """Worker processes for `workers=0` ("auto"): 16 per CPU of this rank (the CPUs this process
    may run on, shared by the LOCAL_WORLD_SIZE ranks on this node), 2 to 32. That many, as the
    calls mostly wait (a reward that calls a service, an environment that sleeps or runs a
    child) and a pool starts them only while calls wait (Processes)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    return min(32, max(2, cpus * 16 // ranks))


class _Proc:
    """One worker process: its connection, and the calls sent to it and not yet answered
    ({k: the time it began, or None while it waits its turn})."""

    def __init__(self, proc, conn, finalizer):
        self.proc, self.conn, self.finalizer = proc, conn, finalizer
        self.ready, self.calls, self.since = False, {}, time.monotonic()


class InProcess:
    """Worker's calls in this process (timeout_s 0: no limit), where a breakpoint() in them
    stops: plain functions' one after another, then `async def` ones' on an event loop kept
    from job to job (as a worker process keeps one: _worker says why)."""

    def __init__(self, specs, fns, is_async, check, what: str, concurrency: int):
        self.specs, self.fns, self.is_async, self.check = specs, fns, is_async, check
        self.what, self.concurrency = what, concurrency
        self.quiet = threading.Event()  # (Worker.quiet)
        self._shown = Shown(self.quiet)  # the failures shown
        self.loop = None  # this thread's, made at the first async job
        self.helper = None  # (a loop running in a helper thread, that thread), in a notebook

    def run(self, calls: list[tuple[int, tuple]], ended=None) -> list:
        out = [None] * len(calls)
        later = [(k, j, args) for k, (j, args) in enumerate(calls) if self.is_async[j]]
        for k, (j, args) in enumerate(calls):
            if not self.is_async[j]:
                out[k] = call(self.fns[j], self.specs[j], args, self.check, self._shown, self.what)
                if ended is not None:
                    ended(k, out[k])
        for k, v in (self._gather(later, ended) if later else {}).items():
            out[k] = v
        return out

    def _gather(self, calls: list[tuple[int, int, tuple]], ended=None) -> dict:
        """The async calls, run to completion in this process: on this thread's loop, or, when
        this thread already runs one (a notebook's), on a loop running in a helper thread.
        Ctrl-C cancels them either way, so that none runs on past the job it belonged to."""
        job = _gather(self.fns, self.specs, calls, self.check, self._shown, self.what,
                      self.concurrency, None, ended=ended)
        try:
            asyncio.get_running_loop()
            notebook = True
        except RuntimeError:  # (not run in this except: a call's traceback would show it)
            notebook = False
        if not notebook:
            self.loop = self.loop or asyncio.new_event_loop()
            task = self.loop.create_task(job)
            try:
                return self.loop.run_until_complete(task)
            except BaseException:  # Ctrl-C: the task would run on at the next job
                task.cancel()
                self.loop.run_until_complete(asyncio.wait([task]))
                raise
        if self.helper is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(target=loop.run_forever, daemon=True)
            thread.start()
            self.helper = loop, thread
        future, done = asyncio.run_coroutine_threadsafe(job, self.helper[0]), threading.Event()
        future.add_done_callback(lambda _: done.set())
        try:
            done.wait()  # (an interrupted Thread.join would not wait again)
        except BaseException:  # Ctrl-C: the helper's loop would run the calls on, unseen
            future.cancel()  # (thread-safe: the task is cancelled on its loop)
            done.wait()  # (a call that blocks its loop holds it: a second Ctrl-C leaves it)
            raise
        return future.result()

    def close(self) -> None:
        """The loops end (a second close() does nothing)."""
        if self.helper is not None:
            loop, thread = self.helper
            self.helper = None
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10)
            if not loop.is_running():
                loop.close()
        if self.loop is not None and not self.loop.is_running():
            self.loop.close()
            self.loop = None


class Processes:
    """Worker's calls in worker processes, kept from job to job: plain functions' in up to
    `workers`, a call each at a time (a hung call's worker is killed and replaced); `async def`
    ones' in one worker's event loop, `concurrency` at once (killed if it fails to cut a call).
    The pool grows as calls wait: the first worker starts with the first call, more only when
    queued calls have waited PATIENCE_S behind busy workers, so that cheap calls (a reward that
    compares strings) never pay for starting processes they do not need."""

    START_TIMEOUT_S = 120.0  # for a worker to start and import the functions (no call's time)
    PATIENCE_S = 0.2  # queued calls waiting this long behind busy workers start more workers

    def __init__(self, specs, is_async, resolver, check, timeout_s, what, workers, concurrency):
        self.specs, self.is_async, self.resolver, self.check = specs, is_async, resolver, check
        self.timeout_s, self.what = timeout_s, what
        self.workers, self.concurrency = workers, concurrency
        self._plain, self._async = [], []  # the worker processes, _Proc each
        self.quiet = multiprocessing.get_context("spawn").Event()  # (Worker.quiet), theirs too

    def run(self, calls: list[tuple[int, tuple]], ended=None) -> list:
        try:
            return self._run(calls, ended)
        except BaseException:  # Ctrl-C mid-job: the workers would answer the next job with
            self.close()  # this one's outcomes still on their way; fresh ones start instead
            raise

    def _run(self, calls: list[tuple[int, tuple]], ended) -> list:
        out, left = [None] * len(calls), len(calls)
        plain = collections.deque(k for k, (j, _) in enumerate(calls) if not self.is_async[j])
        later = [k for k, (j, _) in enumerate(calls) if self.is_async[j]]
        grace = max(2.0, 0.5 * self.timeout_s)  # an async call the worker's loop failed to cut
        self._served = time.monotonic()  # when the queue last gave a worker calls
        while left:
            self._reap()
            later = self._dispatch(calls, plain, later)
            # wait for an answer, for the first limit to pass, or for the queue's patience
            busy = [w for w in self._plain + self._async if w.calls or not w.ready]
            if not busy:  # (cannot be: every call left is queued to a worker, or running)
                raise RuntimeError(f"{self.what} worker pool: {left} calls and no worker")
            first = min(self._deadline(w, grace) for w in busy)
            if plain and len(self._plain) < self.workers:
                first = min(first, self._served + self.PATIENCE_S)
            wait = None if first == float("inf") else max(0.0, first - time.monotonic())
            for conn in multiprocessing.connection.wait([w.conn for w in busy], wait):
                w = next(w for w in busy if w.conn is conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):  # it died in a call (crash, os._exit) or starting
                    why = f"it exited with code {w.proc.exitcode}"
                    left -= self._lost(w, out, plain, later, Failed, why, ended)
                    continue
                w.since = time.monotonic()
                if not w.ready:
                    if msg != "ready":
                        self._give_up(msg)
                    w.ready = True
                elif msg[0] == "start":
                    w.calls[msg[1]] = w.since
                else:
                    k, out[k] = msg
                    left -= 1
                    if ended is not None:
                        ended(k, out[k])
                    w.calls.pop(k)
                    if w in self._plain and w.calls:  # the next of its calls begins now
                        w.calls[next(iter(w.calls))] = w.since
            now = time.monotonic()
            for w in busy:  # each past its limit: cut, with the calls it was running
                if w.proc is not None and now >= self._deadline(w, grace):
                    left -= self._lost(w, out, plain, later, TimeoutError, "no answer",
                                       ended)
        return out

    def _dispatch(self, calls: list[tuple[int, tuple]], plain, later: list[int]) -> list[int]:
        """Send the queued calls: plain ones one each to idle workers (with one worker, all at
        once, in order), starting workers as the class says; async ones all to one event loop.
        Returns the async calls still to send."""
        now = time.monotonic()
        for w in self._plain:
            if w.ready and not w.calls and plain:
                job = [plain.popleft() for _ in range(len(plain) if self.workers == 1 else 1)]
                self._send(w, [(k, *calls[k]) for k in job], job, now)
                self._served = now
        if plain and not self._plain:  # the first worker
            self._plain.append(self._spawn())
        elif (plain and all(w.ready for w in self._plain)
              and now - self._served >= self.PATIENCE_S):  # waiting behind busy workers
            for _ in range(min(self.workers - len(self._plain), len(plain))):
                self._plain.append(self._spawn())
        if later:
            if not self._async:
                self._async.append(self._spawn())
            w = self._async[0]
            if w.ready and not w.calls:
                self._send(w, ("async", [(k, *calls[k]) for k in later], self.timeout_s),
                           later, None)
                return []
        return later

    def _deadline(self, w: _Proc, grace: float) -> float:
        if not w.ready:
            return w.since + self.START_TIMEOUT_S
        began = min((t for t in w.calls.values() if t is not None), default=float("inf"))
        return began + self.timeout_s + (grace if w in self._async else 0.0)

    def _send(self, w: _Proc, job, ks: list[int], now: float | None) -> None:
        w.calls = dict.fromkeys(ks)
        if now is not None:  # plain calls: the first begins now, each next one when its
            w.calls[ks[0]] = now  # predecessor's outcome arrives
        try:
            w.conn.send(job)
        except OSError:  # it died while idle: none of its calls began; the next wait() reads
            w.calls = dict.fromkeys(ks)  # its end, and they go to another worker

    def _lost(self, w: _Proc, out: list, plain, later: list, outcome, why: str,
              ended=None) -> int:
        """Stop worker `w`: the calls it was running get `outcome`, those it had not begun go
        back in the queue. Returns how many got an outcome. One not yet ready (`why`) fails."""
        if not w.ready:
            self._give_up(why)
        n, waiting = 0, []
        for k, began in w.calls.items():
            if began is not None:
                out[k], n = outcome, n + 1
                if ended is not None:
                    ended(k, outcome)
            else:
                waiting.append(k)
        (later.extend if w in self._async else plain.extendleft)(reversed(waiting))
        self._drop(w)
        return n

    def _give_up(self, why: str):
        self.close()
        raise RuntimeError(f"the {self.what} worker did not start ({why}). Fix: make every "
                           "function importable in a fresh Python process.")

    def _spawn(self) -> _Proc:
        ctx = multiprocessing.get_context("spawn")  # fork is unsafe with torch/vLLM threads
        conn, child = ctx.Pipe()
        proc = ctx.Process(target=_worker, args=(child, self.specs, self.resolver, self.check,
                                                 self.what, os.getpid(), self.concurrency,
                                                 self.quiet))
        # spawn re-runs the parent's __main__ file in the child (train_grpo.py: torch and the
        # accelerator setup, seconds and hundreds of MB); the worker needs only the functions'
        # own modules: hide it
        main, sys.modules["__main__"] = sys.modules["__main__"], types.ModuleType("__main__")
        try:
            proc.start()
        finally:
            sys.modules["__main__"] = main
        child.close()  # so that our end reads EOF if the worker dies
        # stops the worker when these Processes are collected, and at exit: atexit runs this
        # before multiprocessing's own hook (registered earlier), which would wait for it forever
        finalizer = weakref.finalize(self, _stop, proc, conn)
        atexit.register(finalizer)
        return _Proc(proc, conn, finalizer)

    def _reap(self) -> None:
        """Forget the idle workers that died (a fresh one starts when needed)."""
        for w in self._plain + self._async:
            if w.ready and not w.calls and not w.proc.is_alive():
                self._drop(w)

    def _drop(self, w: _Proc) -> None:
        atexit.unregister(w.finalizer)
        w.finalizer()  # runs _stop(proc, conn), once
        w.proc = None
        for pool in (self._plain, self._async):
            if w in pool:
                pool.remove(w)

    def close(self) -> None:
        """Stop the workers, if any (a later run() starts new ones)."""
        for w in self._plain + self._async:
            self._drop(w)


class Worker:
    """Functions of one kind (`what`: "reward", "environment"), each call cut at timeout_s, in
    worker processes (Processes; `workers` 0: default_workers()), or with timeout_s 0 in this
    process (InProcess). `local`: specs called in this process all the same (functions known to
    return in microseconds and never hang, for which a round trip to a worker costs more than
    the call). `resolver(spec)` finds each function (in the workers too: module-level);
    `check(value)` returns what a call's value stands for, or raises for one the kind refuses.
    `run` returns each call's outcome, in order: that, Failed, or TimeoutError (cut at the
    limit). Use as a context manager, or call close()."""

    def __init__(self, specs: list[str], resolver, check, timeout_s: float, what: str,
                 workers: int = 1, concurrency: int = 64, local=()):
        specs, self.workers = list(specs), workers or default_workers()
        fns = [resolver(s) for s in specs]  # (the config's check resolved them already)
        is_async = [inspect.iscoroutinefunction(fn) for fn in fns]
        self.local = set() if timeout_s == 0 else {j for j, s in enumerate(specs) if s in local}
        self.here = InProcess(specs, fns, is_async, check, what, concurrency)
        if timeout_s == 0 or len(self.local) == len(specs):
            self.runner = self.here
            self.fns, self._plain, self._async = fns, [], []  # (what tests read)
        else:
            self.runner = Processes(specs, is_async, resolver, check, timeout_s, what,
                                    self.workers, concurrency)
            self.fns, self._plain, self._async = None, self.runner._plain, self.runner._async
        self.specs = specs

    def run(self, calls: list[tuple[int, tuple]], ended=None) -> list:
        """ended(k, outcome), if given: called (in this thread) as call k's outcome comes."""
        if not self.local or self.runner is self.here:
            return self.runner.run(calls, ended)
        out = [None] * len(calls)
        here = [k for k, (j, _) in enumerate(calls) if j in self.local]
        away = [k for k, (j, _) in enumerate(calls) if j not in self.local]
        for part, runner in ((here, self.here), (away, self.runner)):
            if part:
                told = None if ended is None else (lambda i, v, part=part: ended(part[i], v))
                for k, v in zip(part, runner.run([calls[k] for k in part], told)):
                    out[k] = v
        return out

    def where(self) -> str:
        """Where its calls run, for the start-up log."""
        if self.runner is self.here:
            return "in this process"
        mine = [self.specs[j] for j in sorted(self.local)]
        return (f"up to {self.workers} at once, in worker processes"
                + (f" ({', '.join(mine)} in this process)" if mine else ""))

    def quiet(self, on: bool = True) -> None:
        """With `on`, a failed call prints nothing (still Failed): for the calls in flight as
        their run ends, which fail by design (an agent's endpoint answering "the rollout is
        over"). Off again for the next job."""
        for runner in (self.here, self.runner):
            if on:
                runner.quiet.set()
            else:
                runner.quiet.clear()

    def close(self) -> None:
        try:
            self.runner.close()
        finally:
            self.here.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
