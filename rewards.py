"""Reward functions: pure `(completion: str, example: dict) -> float`, run on CPU.

Name them in the `reward:` config section (RewardConfig): a built-in from REWARDS, an importable
`package.module:function`, or a `path/to/file.py:function`. `validate` resolves every one before
any model loads. `Scorer` runs them in a separate worker process so that a reward that raises,
returns garbage or hangs gives 0 for that call and is counted, instead of ending a run hours in.
Rewards stay on a coarse grid (0 or 1 here): float sums such as 0.1 + 0.2 make a "constant" group's
std ~1e-8 instead of 0, which the advantage would blow up (train_grpo detects such groups anyway).
"""

import atexit
import functools
import importlib.util  # also binds importlib
import inspect
import logging
import multiprocessing
import numbers
import os
import re
import signal
import sys
import threading
import time
import traceback
import types
import weakref
from dataclasses import dataclass, field
from math import isfinite
from pathlib import Path

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _to_number(text: str):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def tiny_sum(completion: str, example: dict) -> float:
    """The built-in `a+b=` task: 1 if the completion starts with the right number and stops there.

    "7" and "7 ..." score 1; "77", "8" and "" score 0.
    """
    m = re.match(r"\s*(\d+)(?!\d)", completion)
    return float(m is not None and m.group(1) == str(example["answer"]).strip())


def gsm8k(completion: str, example: dict) -> float:
    """GSM8K-style exact final answer: 1 if the completion's final number equals the reference's.

    The completion's answer is the number after the last `####` if there is one, else after the
    last `\\boxed{`, else the last number in the text. The reference may be a full GSM8K solution
    (`... #### 72`) or the bare number. Numbers compare as values: "1,000" == "1000.0".
    """
    ref = str(example["answer"])
    ref = ref.rsplit("####", 1)[-1]
    ref_num = _to_number(ref.strip())
    if ref_num is None:
        raise ValueError(f"reference answer is not a number: {example['answer']!r}")
    for marker in ("####", "\\boxed{"):
        if marker in completion:
            completion = completion.rsplit(marker, 1)[-1]
            nums = _NUMBER.findall(completion)
            return float(bool(nums) and _to_number(nums[0]) == ref_num)
    nums = _NUMBER.findall(completion)
    return float(bool(nums) and _to_number(nums[-1]) == ref_num)


# \boxed first: it is the answer even when more numbers follow it. No math-verify timeouts: they
# use signal.alarm, which fails outside the main thread; Scorer enforces the time limit instead.
_parse = functools.partial(parse, extraction_config=[
    LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()], parsing_timeout=None)
for _log in ("math_verify.parser", "math_verify.grader"):  # drop its warning about exactly that
    logging.getLogger(_log).addFilter(lambda r: not r.getMessage().startswith("Timeout is disab"))


def math(completion: str, example: dict) -> float:
    """1.0 if math-verify finds the completion's final answer equal to `example["answer"]`, else 0.

    The completion's answer is its `\\boxed{}`, else the rest of the line after its last `####`,
    else what math-verify extracts (LaTeX or a number). The reference may be bare ("0.5",
    "\\frac{1}{2}"), a GSM8K solution ("... #### 72") or hold a `\\boxed{}`. Values compare
    mathematically ("\\frac{1}{2}" == "0.5", "1,000" == "1000"). Raises on an unparsable reference.
    """
    gold = str(example["answer"]).rsplit("####", 1)[-1].strip()
    # bare LaTeX such as \sqrt{2} is found only between $...$; "72 dollars" only outside them
    gold_parsed = _parse(gold) or _parse(f"${gold}$")
    if not gold_parsed:
        raise ValueError(f"reference answer cannot be parsed: {example['answer']!r}")
    if "\\boxed" not in completion and "####" in completion:
        completion = completion.rsplit("####", 1)[-1].split("\n", 1)[0]
    pred = _parse(completion)
    return float(bool(pred) and verify(gold_parsed, pred, timeout_seconds=None))


def answer_format(completion: str, example: dict) -> float:
    """1.0 if the completion states a final answer: a non-empty `\\boxed{...}` with balanced
    braces, or a line starting with `####` followed by something; else 0.0."""
    if re.search(r"^[ \t]*####[ \t]*\S", completion, re.MULTILINE):
        return 1.0
    for m in re.finditer(r"\\boxed\{", completion):
        depth, end = 1, m.end()
        while depth and end < len(completion):
            depth += {"{": 1, "}": -1}.get(completion[end], 0)
            end += 1
        if depth == 0 and completion[m.end():end - 1].strip():
            return 1.0
    return 0.0


REWARDS = {"tiny_sum": tiny_sum, "gsm8k": gsm8k, "math": math, "format": answer_format}


@dataclass
class RewardConfig:
    """The `reward:` section: which functions score a sample, their weights, their time limit."""

    funcs: list[str] = field(default_factory=lambda: ["tiny_sum"])  # REWARDS key, mod:fn, a.py:fn
    weights: list[float] = field(default_factory=list)  # one per func (empty: 1.0 each); summed
    timeout_s: float = 10.0  # time limit of one reward call on one sample (a cut call scores 0);
    #   0: call the functions in this process, no time limit (breakpoint() works in a reward)


def _one_line(e: BaseException) -> str:
    return " ".join(f"{type(e).__name__}: {e}".split())


def _load(where: str):
    """The module a dotted name imports, or the one a .py file path (from the cwd) runs."""
    if not where.endswith(".py"):
        return importlib.import_module(where)
    path = Path(where).resolve(strict=True)  # FileNotFoundError if missing
    name = "_reward_file" + re.sub(r"\W", "_", str(path.with_suffix("")))  # one module per file
    if name not in sys.modules:
        loader = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(loader)  # dataclasses look it up
        try:
            loader.loader.exec_module(sys.modules[name])
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def resolve(spec: str):
    """The reward function `spec` names: a REWARDS key, `package.module:function` (imported), or
    `path/to/file.py:function` (relative to the working directory). Raises a one-line ValueError."""
    if ":" not in spec:
        if spec in REWARDS:
            return REWARDS[spec]
        raise ValueError(f"reward.funcs: {spec!r} is not a built-in reward ({', '.join(REWARDS)}) "
                         "nor module:function nor file.py:function. Fix: use one of those forms.")
    where, name = spec.rsplit(":", 1)
    err = f"reward.funcs: importing {where!r} failed"
    try:
        module = _load(where)
    except FileNotFoundError:
        raise ValueError(f"reward.funcs: file {where!r} not found (from {os.getcwd()}). "
                         "Fix: give it relative to the working directory, or absolute.") from None
    except ModuleNotFoundError as e:
        if e.name == where or where.startswith(f"{e.name}."):  # not one that it imports
            raise ValueError(f"reward.funcs: module {where!r} not found. Fix: install it, put its "
                             f"folder on PYTHONPATH, or give path/to/file.py:{name}.") from None
        raise ValueError(f"{err}: {_one_line(e)}. Fix: install what it imports.") from e
    except Exception as e:
        raise ValueError(f"{err}: {_one_line(e)}. Fix: make it import in a fresh Python.") from e
    fn, sig = getattr(module, name, None), "def fn(completion: str, example: dict) -> float"
    if fn is None:
        raise ValueError(f"reward.funcs: {where!r} has no {name!r}. Fix: check the name after ':'.")
    if not callable(fn):
        raise ValueError(f"reward.funcs: {spec!r} is a {type(fn).__name__}, not a function. "
                         f"Fix: define it as {sig}.")
    try:
        inspect.signature(fn).bind("", {})
    except TypeError:
        raise ValueError(f"reward.funcs: {spec!r} cannot be called as fn(completion, example) "
                         f"(signature {inspect.signature(fn)}). Fix: define it as {sig}.") from None
    except ValueError:  # some builtins have no signature to check
        pass
    return fn


def validate(cfg: RewardConfig) -> None:
    """Check the `reward:` section before any model loads, resolving every function (so a bad
    plugin fails now, not at the first step). Raises a one-line ValueError naming the field."""
    funcs, weights = cfg.funcs, cfg.weights
    if not funcs:
        raise ValueError("reward.funcs: empty. Fix: name at least one reward, e.g. [math, format].")
    for spec in funcs:
        if funcs.count(spec) > 1:  # by_name is keyed by spec
            raise ValueError(f"reward.funcs: {spec!r} is listed twice. Fix: use reward.weights.")
        resolve(spec)
    if weights and len(weights) != len(funcs):
        raise ValueError(f"reward.weights: {len(weights)} weights for {len(funcs)} funcs. "
                         "Fix: give one weight per function, or none (1.0 each).")
    if not cfg.timeout_s >= 0:
        raise ValueError(f"reward.timeout_s: {cfg.timeout_s} is negative. Fix: e.g. 10.0 "
                         "(seconds), or 0 to call the rewards in this process.")


def _worker(conn, specs: list[str], parent_pid: int) -> None:
    """The worker process (module level: spawn pickles it by reference). Sends "ready" once the
    specs resolve, then per job (texts, examples, first function for the first sample) one float,
    or None for a failed call, per (sample, function) in order. Exits on None, EOF or orphaning."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's; it stops us

    def exit_with_parent():  # never outlive the trainer, even while a reward hangs
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=exit_with_parent, daemon=True).start()
    try:
        fns = [resolve(s) for s in specs]
    except Exception as e:
        return conn.send(_one_line(e))
    conn.send("ready")
    shown = set()
    try:
        while (job := conn.recv()) is not None:
            texts, examples, j0 = job
            for i, (text, example) in enumerate(zip(texts, examples)):
                for j in range(j0 if i == 0 else 0, len(fns)):
                    conn.send(_call(fns[j], specs[j], text, example, shown))
    except (EOFError, OSError):  # the parent is gone
        pass


def _call(fn, spec: str, text: str, example: dict, shown: set):
    """fn(text, example) as a float, or None if it raised or returned no finite number (with its
    traceback on stderr the first time for each function)."""
    try:
        v = fn(text, example)
        if not (isinstance(v, numbers.Real) and isfinite(v)):
            raise TypeError(f"returned {v!r}, not a finite number")
        return float(v)
    except Exception:
        if spec not in shown:  # once per function, so that a broken one is seen
            shown.add(spec)
            print(f"reward {spec!r} failed; scored 0 and counted (shown once):", file=sys.stderr)
            traceback.print_exc()
        return None


def _stop(proc, conn) -> None:
    conn.close()
    proc.kill()  # at once: it holds no state worth a graceful exit
    proc.join()


class Scorer:
    """Scores samples with the `reward:` functions in one persistent worker process, started on
    first use. A call that hangs is cut at timeout_s (the worker is killed and restarted); one
    that raises, returns a non-finite or non-number value, or kills the worker is counted; both
    score 0. With timeout_s 0 the functions run in this process instead, with no time limit:
    the same scores, and a breakpoint() in a reward stops there. Use as a context manager, or
    call close()."""

    START_TIMEOUT_S = 120.0  # for a worker to start and import the plugins (no call's time)

    def __init__(self, cfg: RewardConfig):
        validate(cfg)
        self.specs, self.timeout_s = list(cfg.funcs), cfg.timeout_s
        self.weights = list(cfg.weights) or [1.0] * len(self.specs)
        self._fns = [resolve(s) for s in self.specs] if self.timeout_s == 0 else None
        self._shown = set()  # in-process: the functions whose failure was shown
        self._proc = self._conn = self._finalizer = None

    def score(self, texts: list[str], examples: list[dict]) -> dict:
        """{"reward": weighted sum per sample, "by_name": {spec: unweighted values per sample},
        "errors": calls that failed, "timeouts": calls cut at timeout_s}; those calls score 0."""
        if len(texts) != len(examples):
            raise ValueError(f"Scorer.score: {len(texts)} texts but {len(examples)} examples")
        n, nf = len(texts), len(self.specs)
        values, errors, timeouts = [[0.0] * n for _ in range(nf)], 0, 0
        calls = (self._in_process if self._fns else self._in_worker)(texts, examples)
        for k, v in enumerate(calls):  # call k is sample k // nf, function k % nf
            if isinstance(v, float):
                values[k % nf][k // nf] = v
            errors += v is None or v is EOFError
            timeouts += v is TimeoutError
        reward = [sum(w * vals[i] for w, vals in zip(self.weights, values)) for i in range(n)]
        return {"reward": reward, "by_name": dict(zip(self.specs, values)),
                "errors": errors, "timeouts": timeouts}

    def _in_process(self, texts: list[str], examples: list[dict]):
        for text, example in zip(texts, examples):
            for fn, spec in zip(self._fns, self.specs):
                yield _call(fn, spec, text, example, self._shown)

    def _in_worker(self, texts: list[str], examples: list[dict]):
        """Each call's result in order: a float, None (failed), EOFError (the worker died in it)
        or TimeoutError (cut at timeout_s)."""
        nf, k = len(self.specs), 0
        while k < len(texts) * nf:
            conn = self._start()
            try:  # one job: all that is left
                conn.send((texts[k // nf:], examples[k // nf:], k % nf))
            except OSError:  # the worker died while idle: start another
                self.close()
                continue
            while k < len(texts) * nf:
                # the worker makes the calls one after another: each gets timeout_s from here
                try:
                    v = conn.recv() if conn.poll(self.timeout_s) else TimeoutError
                except (EOFError, OSError):  # the worker died in this call (crash, os._exit)
                    v = EOFError
                yield v
                k += 1
                if v is EOFError or v is TimeoutError:
                    self.close()  # and restart for what is left
                    break

    def _start(self):
        """The worker's connection; starts a worker if there is none (or it died)."""
        if self._proc is not None and self._proc.is_alive():
            return self._conn
        self.close()
        ctx = multiprocessing.get_context("spawn")  # fork is unsafe with torch/vLLM threads
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker, args=(child, self.specs, os.getpid()))
        # spawn re-runs the parent's __main__ file in the child (train_grpo.py: torch and the
        # accelerator setup, seconds and hundreds of MB); the worker needs only this module: hide it
        main, sys.modules["__main__"] = sys.modules["__main__"], types.ModuleType("__main__")
        try:
            self._proc.start()
        finally:
            sys.modules["__main__"] = main
        child.close()  # so that our end reads EOF if the worker dies
        # stops the worker when this Scorer is collected, and at exit: atexit runs this before
        # multiprocessing's own hook (registered earlier), which would wait for it forever
        self._finalizer = weakref.finalize(self, _stop, self._proc, self._conn)
        atexit.register(self._finalizer)
        try:
            msg = self._conn.recv() if self._conn.poll(self.START_TIMEOUT_S) else "no answer"
        except (EOFError, OSError):
            msg = f"it exited with code {self._proc.join(5.0) or self._proc.exitcode}"
        if msg != "ready":
            self.close()
            raise RuntimeError(f"reward.funcs: the reward worker did not start ({msg}). "
                               "Fix: make every function importable in a fresh Python process.")
        return self._conn

    def close(self) -> None:
        """Stop the worker, if any (a later score() starts a new one)."""
        if self._finalizer is not None:
            atexit.unregister(self._finalizer)
            self._finalizer()  # runs _stop(proc, conn), once
        self._proc = self._conn = self._finalizer = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
