"""The worker pool of plugins.Worker: calls side by side in `workers` processes and in an event
loop, each cut at its own limit while the others go on, dead workers replaced. Timings are
checked against the arithmetic of the sleeps: one limit, not one per hung call; about
ceil(calls / workers) sleeps, well under the serial sum."""

import asyncio
import os
import signal
import sys
import threading
import time

import pytest

import plugins

pytestmark = pytest.mark.main_only  # the standard library's processes: no library version enters

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "workers"))  # (spawn passes sys.path)
import pool_fns  # noqa: E402

FNS = ["pool_fns:nap", "pool_fns:anap"]  # 0: plain, 1: async


def worker(timeout_s=1.0, workers=4, concurrency=16):
    return plugins.Worker(FNS, pool_fns.resolve, str, timeout_s, "test", workers, concurrency)


def grown(w, n: int) -> None:
    """Bring the pool up to its n workers: calls slower than the pool's patience make it grow
    (plugins.Processes), instant ones would leave it at one."""
    w.run([(0, (i, {"s": 4 * plugins.Processes.PATIENCE_S})) for i in range(n)])
    assert len(w._plain) == n, len(w._plain)


def timed(w, calls):
    t = time.perf_counter()
    out = w.run(calls)
    return out, time.perf_counter() - t


def pid(value: str) -> str:
    return value.split("@")[1]


def test_hung_and_failing_calls_among_healthy_ones():
    """Two hung calls, one that raises and one whose worker dies, among eight healthy ones: the
    healthy values arrive, and the whole job takes one limit (the hung calls ran side by side),
    where cutting them one after another takes two."""
    with worker(timeout_s=1.0, workers=4) as w:
        grown(w, 4)  # the four workers are up
        modes = ["hang", "hang", "boom", "die"] + [None] * 8
        out, took = timed(w, [(0, (i, {"mode": m, "s": 0.1})) for i, m in enumerate(modes)])
        assert out[:4] == [TimeoutError, TimeoutError, plugins.Failed, plugins.Failed]
        assert [v.split("@")[0] for v in out[4:]] == [str(i) for i in range(4, 12)]
        assert 1.0 <= took < 2 * 1.0, took
        # the cut and the dead workers are gone; the next job starts fresh ones and runs
        assert all(v.startswith(str(i)) for i, v in enumerate(w.run([(0, (i, {}))
                                                                      for i in range(6)])))


def test_plain_calls_run_side_by_side():
    """16 calls of 0.25 s on 4 workers: ceil(16 / 4) * 0.25 = 1 s, where one worker takes 4 s."""
    with worker(workers=4, timeout_s=5.0) as w:
        grown(w, 4)
        out, took = timed(w, [(0, (i, {"s": 0.25})) for i in range(16)])
    assert [v.split("@")[0] for v in out] == [str(i) for i in range(16)]
    assert len({pid(v) for v in out}) == 4
    assert 1.0 <= took < 2.0, took


def test_the_pool_grows_only_while_calls_wait():
    """Cheap calls never start a second worker: one worker takes its share of the queue and is
    idle again before the queue's patience passes. Slow ones do: 8 calls of 0.5 s on up to 8
    workers start all 8, 7 of them once the first has kept the queue waiting for the
    patience."""
    with worker(workers=8, timeout_s=5.0) as w:
        out = w.run([(0, (i, {})) for i in range(64)])
        assert len({pid(v) for v in out}) == 1 and len(w._plain) == 1
        out = w.run([(0, (i, {"s": 0.5})) for i in range(8)])
        assert len(w._plain) == 8 and len({pid(v) for v in out}) >= 2


def test_a_worker_that_died_while_idle_is_replaced():
    with worker(workers=2) as w:
        first = w.run([(0, (i, {"s": 0.2})) for i in range(2)])  # both workers busy once
        os.kill(int(pid(first[0])), signal.SIGKILL)
        time.sleep(0.2)
        out = w.run([(0, (i, {"s": 0.2})) for i in range(4)])
    assert [v.split("@")[0] for v in out] == ["0", "1", "2", "3"]
    assert pid(first[0]) not in {pid(v) for v in out}


def test_async_calls_share_one_event_loop():
    """64 calls awaiting 0.2 s with concurrency 16: ceil(64 / 16) * 0.2 = 0.8 s, not 12.8 s."""
    with worker(concurrency=16, timeout_s=5.0) as w:
        w.run([(1, (0, {}))])
        out, took = timed(w, [(1, (i, {"s": 0.2})) for i in range(64)])
    assert [v.split("@")[0] for v in out] == [str(i) for i in range(64)]
    assert len({pid(v) for v in out}) == 1
    assert 0.8 <= took < 2.0, took


def test_async_calls_cut_at_their_limit():
    """A coroutine that never returns is cut at the limit while its siblings finish. One that
    blocks the loop with synchronous code is cut by killing its worker (at the limit and a
    grace of 2 s): the call in flight beside it is lost with it (cut), and the calls that had
    not started (concurrency 2) run in a fresh worker."""
    with worker(timeout_s=1.0, concurrency=2) as w:
        out, took = timed(w, [(1, (i, {"mode": m, "s": 0.1}))
                              for i, m in enumerate(["hang", None, "boom", None, None])])
        assert out[0] is TimeoutError and out[2] is plugins.Failed
        assert [out[i].split("@")[0] for i in (1, 3, 4)] == ["1", "3", "4"]
        assert 1.0 <= took < 2.0, took
        out, took = timed(w, [(1, (i, {"mode": m}))
                              for i, m in enumerate(["block", None, None, None])])
        assert out[:2] == [TimeoutError, TimeoutError]
        assert [v.split("@")[0] for v in out[2:]] == ["2", "3"]
        assert 1.0 + 2.0 <= took, took


def test_plain_and_async_functions_in_one_job():
    with worker(workers=2) as w:
        out = w.run([(i % 2, (i, {"s": 0.05})) for i in range(8)])
    assert [v.split("@")[0] for v in out] == [str(i) for i in range(8)]
    plain, asynchronous = {pid(v) for v in out[::2]}, {pid(v) for v in out[1::2]}
    assert not plain & asynchronous and len(asynchronous) == 1


def test_in_process_async_calls_inside_a_running_event_loop():
    """timeout_s 0 calls in this process; an async function's calls run on an event loop of
    their own, in a helper thread when this thread already runs one (a notebook's)."""
    w = worker(timeout_s=0)
    calls = [(1, (i, {"s": 0.1})) for i in range(8)] + [(0, (8, {})), (1, (9, {"mode": "boom"}))]

    async def in_a_notebook():
        return w.run(calls)

    for out in (w.run(calls), asyncio.run(in_a_notebook())):
        assert [v.split("@")[0] for v in out[:9]] == [str(i) for i in range(9)]
        assert {pid(v) for v in out[:9]} == {str(os.getpid())} and out[9] is plugins.Failed


@pytest.mark.parametrize("in_a_loop", [False, True])
def test_ctrl_c_cancels_in_process_async_calls(in_a_loop):
    """Ctrl-C 0.3 s into an in-process job whose async calls nap 5 s returns at once, and no call
    runs on: the loop kept for the next job (in a helper thread where this one runs a loop, a
    notebook's) holds no task of them; close() ends that thread."""
    w = worker(timeout_s=0)
    calls = [(1, (i, {"s": 5.0})) for i in range(3)]

    async def in_a_notebook():
        return w.run(calls)

    def interrupt(*_):
        raise KeyboardInterrupt

    threads = threading.active_count()
    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        t = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):
            asyncio.run(in_a_notebook()) if in_a_loop else w.run(calls)
        took = time.perf_counter() - t
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert 0.3 <= took < 0.3 + 2.0, took
    loop = w.runner.helper[0] if in_a_loop else w.runner.loop
    if in_a_loop:  # (the cancellation reaches the helper's loop through its thread)
        while asyncio.run_coroutine_threadsafe(_tasks(), loop).result() and (
                time.perf_counter() < t + 0.3 + 2.0):
            time.sleep(0.01)
        assert not asyncio.run_coroutine_threadsafe(_tasks(), loop).result()
    else:
        assert not asyncio.all_tasks(loop)
    w.close()
    assert threading.active_count() == threads and loop.is_closed()


async def _tasks() -> set:
    """The tasks of the running loop other than this one."""
    return asyncio.all_tasks() - {asyncio.current_task()}


@pytest.mark.parametrize("cpus, ranks, expected", [
    (4, None, 32),  # 4 * 16 / 1 = 64, at most 32
    (2, "2", 16),  # 2 * 16 / 2
    (3, "2", 24),  # 3 / 2 = 1.5 CPUs a rank, * 16
    (4, "8", 8),  # half a CPU a rank, * 16
    (16, "8", 32),
    (1, "16", 2),  # 1 / 16 CPU a rank: 1, at least 2
    (1, "4", 4),
])
def test_default_workers_is_16_per_cpu_of_this_rank(monkeypatch, cpus, ranks, expected):
    """The CPUs this process may run on count, not the machine's (a container or a taskset);
    with no affinity to ask (macOS), os.cpu_count()."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(cpus)), raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 1000)
    if ranks is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
    assert plugins.default_workers() == expected
    monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    assert plugins.default_workers() == expected


def test_workers_0_runs_slow_plain_calls_side_by_side(monkeypatch):
    """workers=0 is default_workers(), at least 16 with one rank on a node (16 per CPU): 8 calls
    that sleep 1 s each start 8 workers (the first at once, 7 more when the queue has waited
    plugins.Processes.PATIENCE_S, 0.2 s) and take one sleep, 1 s, where the 2 workers of the
    floor take 8 / 2 * 1 = 4 s and one takes 8 s. Bound 1 + 2.5 s, under 4 s: the patience and
    the start of the 8 fresh Pythons, slow on a loaded 2-core machine, are in it."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with worker(timeout_s=30.0, workers=0) as w:
        assert w.workers == plugins.default_workers() >= 8
        out, took = timed(w, [(0, (i, {"s": 1.0})) for i in range(8)])
        assert len(w._plain) == 8
    assert [v.split("@")[0] for v in out] == [str(i) for i in range(8)]
    assert 1.0 <= took < 1.0 + 2.5, took


@pytest.fixture
def models_server():
    """A local HTTP/1.1 server answering GET /v1/models, its connections kept alive (so a client
    dropped unclosed holds one open on the loop it was made on)."""
    import http.server
    import json

    class Models(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            body = json.dumps({"object": "list", "data": [
                {"id": "m", "object": "model", "created": 0, "owned_by": "test"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()


@pytest.mark.parametrize("timeout_s", [5.0, 0], ids=["worker-process", "in-process"])
def test_clients_dropped_by_one_job_close_cleanly_in_the_next(models_server, timeout_s, capfd):
    """Async calls that each make an OpenAI client and drop it unclosed, over three jobs: the
    clients the garbage collector finds in a later job close on the loop they were made on, so
    nothing is printed. With a loop a job (asyncio.run), each printed a traceback ending in
    "RuntimeError: Event loop is closed". Each call collects (gc.collect) what earlier ones
    dropped: in this process, with this test's heap frozen before (~0.4 s a collection of the
    test session's heap otherwise; what the calls make is collected alike)."""
    import gc

    pytest.importorskip("openai")
    gc.freeze()
    try:
        with plugins.Worker(["pool_fns:leaky"], pool_fns.resolve, str, timeout_s, "test", 1,
                            8) as w:
            for job in range(3):
                out = w.run([(0, (i, {"url": models_server})) for i in range(8)])
                assert all(v is not plugins.Failed for v in out), out
    finally:
        gc.unfreeze()
    err = capfd.readouterr().err
    assert "Event loop is closed" not in err and "Traceback" not in err, err[-3000:]


@pytest.mark.parametrize("timeout_s", [5.0, 0], ids=["worker-process", "in-process"])
def test_each_kind_of_error_is_shown_once_with_its_traceback(timeout_s, capfd):
    """Forty failing calls of two kinds: two tracebacks on stderr, one a kind, each named; every
    call counted as failed."""
    with worker(timeout_s=timeout_s, workers=1) as w:
        out = w.run([(0, (i, {"mode": "boom" if i % 2 else "bad"})) for i in range(40)])
    assert out == [plugins.Failed] * 40
    err = capfd.readouterr().err
    assert err.count("Traceback") == 2, err[-3000:]
    assert err.count("failed with RuntimeError") == err.count("failed with ValueError") == 1


@pytest.mark.parametrize("timeout_s", [5.0, 0], ids=["worker-process", "in-process"])
def test_calls_failing_while_quiet_print_nothing(timeout_s, capfd):
    """Worker.quiet, set as an agent's endpoint closes on the calls in flight (collect/agents.py:
    Serving.close): the calls that fail while it is set (in a worker process already running,
    or here) are counted as failed and print nothing; once it is off, the first failure of
    that kind prints its traceback."""
    with worker(timeout_s=timeout_s, workers=1) as w:
        assert w.run([(1, (0, {}))])[0] != plugins.Failed  # (its worker process, if any: up)
        quiet = threading.Timer(0.1, w.quiet)  # while the calls nap
        quiet.start()
        assert w.run([(1, (i, {"mode": "late", "s": 1.5})) for i in range(4)]) == \
            [plugins.Failed] * 4
        quiet.join()
        assert "Traceback" not in capfd.readouterr().err
        w.quiet(False)
        assert w.run([(1, (0, {"mode": "boom"}))]) == [plugins.Failed]
    err = capfd.readouterr().err
    assert err.count("Traceback") == 1 and "failed with RuntimeError" in err, err[-3000:]
