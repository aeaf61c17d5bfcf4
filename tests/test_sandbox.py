"""The Python tool's sandbox (sandbox.run_python): each escape is tried, and fails. Where this
host lacks a protection, its test asserts that sandbox.missing() names it, then skips."""

import os
import signal
import socket
import subprocess
import sys
import time
import types
import uuid

import pytest

from collect import sandbox

pytestmark = pytest.mark.main_only  # the kernel's confinement: no library version enters

run = sandbox.run_python


def protected(phrase: str) -> None:
    """Skip, with the reason, if missing() names `phrase` (and only then)."""
    gone = [g for g in sandbox.missing() if g.startswith(phrase)]
    if gone:
        pytest.skip(gone[0])


def alive(marker: str) -> list[int]:
    """The processes whose command line holds `marker`."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and marker.encode() in open(f"/proc/{entry}/cmdline", "rb").read():
                pids.append(int(entry))
        except OSError:
            pass
    return pids


def test_plain_runs_and_the_limits_of_before():
    assert run("print(6 * 7)") == "42\n"
    assert run("open('here.txt', 'w').write('ok'); print(open('here.txt').read())") == "ok\n"
    assert run("while True: pass", timeout_s=1.0) == "timed out after 1 s"
    assert "MemoryError" in run("x = bytearray(2_000_000_000)", memory_mb=256)


def test_no_network_to_a_listening_localhost_socket():
    protected("network isolation")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        server.settimeout(0.5)
        port = server.getsockname()[1]
        out = run(f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
                  "print('connected')")
        assert "connected" not in out and "Error" in out, out
        with pytest.raises(socket.timeout):
            server.accept()  # nothing ever reached it


def test_a_fork_loop_is_bounded_and_ended():
    protected("process-count limit")
    marker = uuid.uuid4().hex
    code = (f"import os, time  # {marker}\nn = 0\nfor _ in range(10_000):\n    try:\n"
            "        if os.fork() == 0:\n            time.sleep(60)\n            os._exit(0)\n"
            "        n += 1\n    except OSError:\n        break\nprint('forked', n)")
    t = time.perf_counter()
    out = run(code, timeout_s=3.0, max_procs=16)
    assert time.perf_counter() - t < 3.0 + 5.0
    assert out.startswith("forked") and int(out.split()[1]) < 16, out
    assert alive(marker) == []  # every child is gone with the call


def test_a_grandchild_that_leaves_its_group_dies_at_the_limit():
    marker = uuid.uuid4().hex
    code = (f"import os, time  # {marker}\nif os.fork() == 0:\n    os.setsid()\n"
            "    if os.fork() == 0:\n        time.sleep(60)\n    os._exit(0)\nprint('parent done')")
    assert run(code, timeout_s=2.0).startswith("parent done")
    time.sleep(0.2)
    assert alive(marker) == []


def test_no_signal_reaches_the_trainer():
    protected("signals")
    got = []
    old = signal.signal(signal.SIGUSR1, lambda *_: got.append(1))
    try:
        out = run(f"import os, signal\nos.kill({os.getpid()}, signal.SIGUSR1)\nprint('sent')")
        time.sleep(0.2)
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert got == [] and "sent" not in out, out


def test_hard_limits_cannot_be_raised_back():
    protected("hard limits")
    out = run("import resource\nfor name in ('RLIMIT_AS', 'RLIMIT_CPU', 'RLIMIT_FSIZE'):\n"
              "    what = getattr(resource, name)\n    try:\n"
              "        resource.setrlimit(what, (resource.RLIM_INFINITY,) * 2)\n"
              "        print(name, 'raised')\n    except (ValueError, OSError) as e:\n"
              "        print(name, 'refused')")
    assert out.split() == ["RLIMIT_AS", "refused", "RLIMIT_CPU", "refused", "RLIMIT_FSIZE",
                           "refused"], out
    # nor does it hold a capability that could (CAP_SYS_RESOURCE, where root has it): its
    # bounding set is empty (prctl PR_CAPBSET_READ = 23, for each capability up to 40)
    caps = ("import ctypes\nlibc = ctypes.CDLL(None)\n"
            "print(sum(libc.prctl(23, c, 0, 0, 0) == 1 for c in range(41)))")
    assert run(caps) == "0\n"


def test_many_files_stop_at_the_cap():
    protected("directory cap")
    out = run("n = 0\ntry:\n    while n < 100_000:\n        open(f'f{n}', 'w').close()\n"
              "        n += 1\nexcept OSError as e:\n    print(n, e.errno)", max_files=64)
    n, errno = map(int, out.split())
    assert n < 64 and errno == 28, out  # ENOSPC: the tmpfs has no inode left
    big = run("try:\n    with open('big', 'wb') as f:\n        for _ in range(64):\n"
              "            f.write(b'x' * (1 << 19))\nexcept OSError as e:\n    print(e.errno)",
              dir_mb=4)
    assert big.split()[-1] in ("27", "28"), big  # EFBIG (1 MB a file) or ENOSPC (4 MB in all)


def test_output_is_read_up_to_the_limit_and_no_further():
    t = time.perf_counter()
    out = run("while True:\n    print('x' * 1000)", timeout_s=30.0, limit=5000)
    assert time.perf_counter() - t < 10.0  # not the 30 s limit: the child ends at its next write
    assert out.endswith("\n[cut]") and len(out) == 5000 + len("\n[cut]")


def test_the_run_directory_is_out_of_reach(tmp_path):
    protected("file isolation")
    secret = tmp_path / "run" / "checkpoint.txt"
    secret.parent.mkdir()
    secret.write_text("weights")
    assert "PermissionError" in run(f"print(open({str(secret)!r}).read())")
    assert "PermissionError" in run(f"open({str(secret.parent / 'x')!r}, 'w')")
    assert secret.read_text() == "weights" and not (secret.parent / "x").exists()


def test_check_refuses_a_host_without_isolation(monkeypatch):
    monkeypatch.setattr(sandbox, "_found", {"landlock": 3, "netns": False, "pidns": True,
                                            "nproc": True, "user": True, "dircap": True})
    gone = sandbox.missing()
    assert [g.split(":")[0] for g in gone] == ["network isolation"]
    with pytest.raises(ValueError, match=r"^env\.name: python: .*network isolation.*unsafe_ok"):
        sandbox.check(unsafe_ok=False)
    assert sandbox.check(unsafe_ok=True) == gone
    monkeypatch.setattr(sandbox, "_found", {"landlock": 0, "netns": True, "pidns": False,
                                            "nproc": False, "user": True, "dircap": False})
    assert [g.split(":")[0] for g in sandbox.missing()] == [
        "file isolation", "PID namespace", "process-count limit", "directory cap"] + (
        [] if os.getuid() == 0 else ["signals"])


def test_the_python_tool_says_at_start_up_what_its_sandbox_lacks(monkeypatch, caplog):
    """episodes.validate (before any model loads): `env.name: python` on a host without network
    isolation refuses to start, unless env.unsafe_ok, which logs what is missing."""
    import logging

    import episodes

    monkeypatch.setattr(sandbox, "_found", {"landlock": 3, "netns": False, "pidns": True,
                                            "nproc": True, "user": True, "dircap": True})
    with pytest.raises(ValueError, match="env.unsafe_ok: true"):
        episodes.validate(episodes.EnvConfig(name="python"), 16, 512)
    with caplog.at_level(logging.WARNING, logger="grpo"):
        episodes.validate(episodes.EnvConfig(name="python", unsafe_ok=True), 16, 512)
        episodes.validate(episodes.EnvConfig(name="retry"), 16, 512)  # not the model's code
    (record,) = caplog.records
    assert "network isolation" in record.getMessage()


def test_the_launcher_is_a_module_that_runs_nothing_at_import():
    """sandbox_child imports in a fresh Python that would fail at the first fork, exec, exit or
    libc load, and prints nothing; then the interpreter has no child process."""
    code = ("import ctypes, os\n"
            "def refuse(*args, **kwargs):\n"
            "    raise AssertionError('ran at import')\n"
            "for name in ('fork', 'execve', '_exit', 'mkdir', 'chdir', 'kill'):\n"
            "    setattr(os, name, refuse)\n"
            "ctypes.CDLL = refuse\n"
            "import sandbox_child\n"
            "try:\n"
            "    os.waitpid(-1, os.WNOHANG)\n"
            "except ChildProcessError:\n"
            "    pass\n"
            "else:\n"
            "    raise AssertionError('a child process')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(sandbox.CHILD),
                         capture_output=True, text=True, timeout=60)
    assert (out.returncode, out.stdout, out.stderr) == (0, "", "")


def test_a_launcher_traceback_names_its_file(monkeypatch):
    """The launcher runs as a file: an error in it (here a config that is not JSON, handed to
    it by sandbox._launch) points at a line of sandbox_child.py."""
    monkeypatch.setattr(sandbox, "json", types.SimpleNamespace(dumps=lambda cfg: "{not json"))
    proc = sandbox._launch({})
    out, _ = proc.communicate(timeout=60)
    out = out.decode()
    assert proc.returncode == 1, out
    assert 'sandbox_child.py", line ' in out and ", in main" in out, out
    assert "JSONDecodeError" in out and "<string>" not in out, out
