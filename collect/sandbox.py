"""The confined child that runs model-written code (envs.python_tool): `run_python`.

The code runs in a fresh Python started by a small launcher (sandbox_child.py, run as
`python -I -S sandbox_child.py CFG`, in a session of its own), which confines itself and then
forks the child:
- **its own processes, killed whole**: the child is the first process of a new PID namespace,
  with SIGKILL as its parent-death signal; at the limit the launcher kills it, and the kernel
  kills every process of the namespace with it (a grandchild that calls setsid() included).
  Without a PID namespace the launcher is a child subreaper (prctl PR_SET_CHILD_SUBREAPER):
  orphans come back to it, and it kills its descendants until none is left;
- **no network**: a new network namespace (not even a loopback that is up), and where Landlock
  has network rules (ABI 4, Linux 6.7) no TCP bind or connect either;
- **a process limit and hard limits it cannot raise**: run as root, the code keeps uid 0 (its
  Python may be where no other user can read) less every capability, now and after exec, so it
  may raise no hard limit back (that takes CAP_SYS_RESOURCE); the kernel never applies
  RLIMIT_NPROC to uid 0, so a pids cgroup counts its processes. As another user, in a user
  namespace of its own, RLIMIT_NPROC counts the sandbox's processes alone; without one it would
  count the trainer's own threads, and is left unset;
- **a capped directory**: with a mount namespace, its working directory is a tmpfs of `dir_mb`
  MB and `max_files` inodes; elsewhere each file stays under 1 MB (RLIMIT_FSIZE) only;
- **output read up to the limit and no further**: one pipe for stdout and stderr, read in
  chunks until `limit` characters; then it is closed and the child ends at its next write;
- **no signal to the trainer**: a PID namespace has no number for it, and Landlock's scope
  (ABI 6, Linux 6.12) forbids any signal leaving the sandbox;
- **files**: Landlock (ABI 1, Linux 5.13): Python's and the system's files to read, its own
  directory to write; the run directory, checkpoints and data are out of its reach.
`missing()` says which of these this host lacks (found by running the launcher once); `check`
refuses a run of the Python tool without file and network isolation unless env.unsafe_ok.

The kernel facts (syscall, prctl and flag numbers, each with its uapi header) are in
sandbox_child.py.

A leaf module: standard library only.
"""

import json
import os
import select
import subprocess
import sys
import tempfile

# the launcher, run as a file so that its tracebacks name their lines
CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")

_found = None


def _python_dirs() -> list[str]:
    return sorted({sys.prefix, sys.base_prefix, sys.exec_prefix,
                   os.path.dirname(os.path.realpath(sys.executable))})


def _launch(cfg: dict) -> subprocess.Popen:
    cfg = {"read": [*_python_dirs(), "/usr", "/lib", "/lib64", "/bin", "/etc", "/dev/urandom"],
           **cfg}
    return subprocess.Popen([sys.executable, "-I", "-S", CHILD, json.dumps(cfg)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            env={"PATH": os.environ.get("PATH", "")})


def protections() -> dict:
    """What the launcher achieves on this host (found once, by running it without code)."""
    global _found
    if _found is None:
        with tempfile.TemporaryDirectory() as tmp:
            proc = _launch({"workdir": tmp, "probe": True, "dir_mb": 1, "max_files": 16})
            out, _ = proc.communicate(timeout=60)
        _found = json.loads(out.decode().strip().splitlines()[-1])
    return _found


def missing() -> list[str]:
    """The protections this host cannot give the model's code, one phrase each."""
    p, gone = protections(), []
    if p["landlock"] < 1:
        gone.append("file isolation: no Landlock (Linux 5.13+): the code can read every file "
                    "its user can, the run directory included")
    if not p.get("netns") and p["landlock"] < 4:
        gone.append(f"network isolation: no network namespace and no Landlock network rules "
                    f"(ABI {p['landlock']} < 4, Linux 6.7+)")
    if not p.get("pidns"):
        gone.append("PID namespace: a process that leaves its group is killed only if it is "
                    "still the sandbox's descendant (child subreaper)")
    if not p.get("nproc"):
        gone.append("process-count limit: neither a user of its own nor a user namespace")
    if not p.get("user"):
        gone.append("hard limits: still root (no CAP_SETUID to become user 65534): the code "
                    "can raise its limits back")
    if not p.get("dircap"):
        gone.append("directory cap: no mount namespace for a sized tmpfs (only a 1 MB cap per "
                    "file)")
    if not p.get("pidns") and p["landlock"] < 6 and not (p.get("user") and os.getuid() == 0):
        gone.append("signals: no PID namespace, no Landlock signal scope (ABI 6, Linux 6.12) "
                    "and the trainer's own user: the code can signal the trainer")
    return gone


def check(unsafe_ok: bool) -> list[str]:
    """Raise a one-line ValueError when the model's code would run without file or network
    isolation and `unsafe_ok` is False; else return missing() (for a start-up warning)."""
    gone = missing()
    vital = [g for g in gone if g.startswith(("file isolation", "network"))]
    if vital and not unsafe_ok:
        raise ValueError(f"env.name: python: this host gives the model's code no "
                         f"{' and no '.join(g.split(':')[0] for g in vital)} ({'; '.join(vital)}). "
                         "Fix: run on Linux 5.13+ with Landlock, in a container, or set "
                         "env.unsafe_ok: true to run it anyway")
    return gone


def run_python(code: str, timeout_s: float = 5.0, memory_mb: int = 512, limit: int = 2000,
               dir_mb: int = 64, max_files: int = 256, max_procs: int = 32) -> str:
    """Run `code` in a fresh, confined Python (the module's docstring says how) and return what
    it printed (stdout and stderr, as they came), cut to `limit` characters. Its limits:
    `timeout_s` of wall and CPU time, `memory_mb` MB of address space, `max_procs` processes,
    a directory of `dir_mb` MB and `max_files` files (where the host has a mount namespace), no
    file over 1 MB, 256 open files."""
    with tempfile.TemporaryDirectory() as tmp:
        proc = _launch({"workdir": tmp, "code": code, "timeout_s": timeout_s,
                        "cpu_s": int(timeout_s) + 1, "memory_mb": memory_mb, "dir_mb": dir_mb,
                        "max_files": max_files, "max_procs": max_procs})
        out, fd, cut = b"", proc.stdout.fileno(), False
        while len(out) <= limit * 4:  # UTF-8: at most 4 bytes a character
            if not select.select([fd], [], [], timeout_s + 10.0)[0]:
                break  # the launcher enforces the limit; this only guards against it hanging
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            out += chunk
        else:
            cut = True
        proc.stdout.close()  # the child's next write fails: it ends, or the limit ends it
        try:
            code_ = proc.wait(timeout_s + 10.0)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            code_ = proc.wait()
    text = out.decode(errors="replace")
    if code_ == 124:
        text += f"timed out after {timeout_s:g} s"
    elif code_ == 70 and not text:
        text = "the sandbox could not confine the code"
    elif code_ > 128 and not cut:  # a signal: SIGXCPU from the CPU limit, or SIGKILL
        text += f"killed by signal {code_ - 128}"
    return text if len(text) <= limit and not cut else text[:limit] + "\n[cut]"
