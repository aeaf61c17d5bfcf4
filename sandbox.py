"""The confined child that runs model-written code (envs.python_tool): `run_python`.

The code runs in a fresh Python started by a small launcher (LAUNCHER, run as `python -I -S -c`,
in a session of its own), which confines itself and then forks the child:
- **its own processes, killed whole**: the child is the first process of a new PID namespace,
  with SIGKILL as its parent-death signal; at the limit the launcher kills it, and the kernel
  kills every process of the namespace with it (a grandchild that calls setsid() included).
  Without a PID namespace the launcher is a child subreaper (prctl PR_SET_CHILD_SUBREAPER = 36):
  orphans come back to it, and it kills its descendants until none is left;
- **no network**: a new network namespace (not even a loopback that is up), and where Landlock
  has network rules (ABI 4, Linux 6.7) no TCP bind or connect either;
- **a process limit and hard limits it cannot raise**: run as root, the launcher first becomes
  the unprivileged user 65534, which may raise no hard limit back (that takes CAP_SYS_RESOURCE)
  and to whom the kernel applies RLIMIT_NPROC (it never does to uid 0); in a user namespace of
  its own the count is the sandbox's alone. A non-root user is confined only where it has a user
  namespace (else RLIMIT_NPROC would count the trainer's own threads, and is left unset);
- **a capped directory**: with a mount namespace, its working directory is a tmpfs of `dir_mb`
  MB and `max_files` inodes; elsewhere each file stays under 1 MB (RLIMIT_FSIZE) only;
- **output read up to the limit and no further**: one pipe for stdout and stderr, read in
  chunks until `limit` characters; then it is closed and the child ends at its next write;
- **no signal to the trainer**: a PID namespace has no number for it, user 65534 may not signal
  it, and Landlock's scope (ABI 6, Linux 6.12) forbids any signal leaving the sandbox;
- **files**: Landlock (ABI 1, Linux 5.13): Python's and the system's files to read, its own
  directory to write; the run directory, checkpoints and data are out of its reach.
`missing()` says which of these this host lacks (found by running the launcher once); `check`
refuses a run of the Python tool without file and network isolation unless env.unsafe_ok.

Kernel facts used, from the Linux uapi headers: unshare flags (linux/sched.h) CLONE_NEWNS
0x00020000, CLONE_NEWUSER 0x10000000, CLONE_NEWPID 0x20000000, CLONE_NEWNET 0x40000000; prctl
(linux/prctl.h) PR_SET_PDEATHSIG 1, PR_SET_CHILD_SUBREAPER 36, PR_SET_NO_NEW_PRIVS 38; mount
flags (linux/mount.h) MS_NOSUID 2, MS_NODEV 4, MS_REC 0x4000, MS_PRIVATE 1 << 18; Landlock
(linux/landlock.h): syscalls 444-446, ruleset attribute {handled_access_fs; handled_access_net
(ABI 4); scoped (ABI 6)}, whose size tells the kernel which fields it holds; file rights bits
0-12 (ABI 1), REFER 13 (ABI 2), TRUNCATE 14 (ABI 3), IOCTL_DEV 15 (ABI 5); network rights
BIND_TCP 1 << 0 and CONNECT_TCP 1 << 1; scopes ABSTRACT_UNIX_SOCKET 1 << 0, SIGNAL 1 << 1.

A leaf module: standard library only.
"""

import json
import os
import select
import subprocess
import sys
import tempfile

LAUNCHER = r'''
import ctypes, json, os, resource, select, signal, sys, time
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
done = {}
NEWNS, NEWUSER, NEWPID, NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
def write(path, text):
    with open(path, "w") as f:
        f.write(text)
work, was_root = cfg["workdir"], os.getuid() == 0
def namespaces(flags):  # PID, network, mount (and user) namespaces of the sandbox's own
    if libc.unshare(flags) != 0:
        return False
    done.update(pidns=True, netns=True, mountns=True, userns=bool(flags & NEWUSER))
    return True
def capped_dir(uid, gid):  # its directory: a tmpfs of dir_mb MB and max_files inodes
    opts = f"size={cfg['dir_mb']}m,nr_inodes={cfg['max_files']},mode=700,uid={uid},gid={gid}"
    done["dircap"] = libc.mount(None, b"/", None, 0x4000 | (1 << 18), None) == 0 and libc.mount(
        b"tmpfs", work.encode(), b"tmpfs", 2 | 4, opts.encode()) == 0
pids = None
if was_root:  # root keeps uid 0 (its Python may be where no other user can read) less every
    # capability; uid 0 is exempt from RLIMIT_NPROC, so a pids cgroup (v1, or v2's root) counts
    if namespaces(NEWNS | NEWPID | NEWNET):
        capped_dir(0, 0)
    done["user"] = libc.prctl(23, 8, 0, 0, 0) == 1  # PR_CAPBSET_READ of CAP_SETPCAP: droppable
    for base in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup"):
        try:
            if base == "/sys/fs/cgroup" and "pids" not in open(
                    f"{base}/cgroup.subtree_control").read():
                continue
            pids = f"{base}/grpo-sandbox-{os.getpid()}"
            os.mkdir(pids)
            write(f"{pids}/pids.max", str(cfg.get("max_procs", 32)))
            break
        except OSError:
            pids = None
    done["nproc"] = pids is not None
else:  # a user's own hard limits are out of its reach; in a user namespace of its own its
    done["user"] = True  # processes are counted apart from the trainer's threads
    uid, gid = os.getuid(), os.getgid()
    if namespaces(NEWUSER | NEWNS | NEWPID | NEWNET):
        write("/proc/self/setgroups", "deny")  # the same ids inside: not root there, so no
        write("/proc/self/uid_map", f"{uid} {uid} 1")  # capability is left after exec
        write("/proc/self/gid_map", f"{gid} {gid} 1")
        capped_dir(uid, gid)
    done["nproc"] = bool(done.get("userns"))
if not done.get("pidns"):
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come back here
abi = max(0, libc.syscall(444, None, 0, 1))
done["landlock"] = abi
def finish(code):
    if pids:
        try:
            os.rmdir(pids)
        except OSError:
            pass
    os._exit(code)
if cfg.get("probe"):
    print(json.dumps(done), flush=True)
    finish(0)
me = os.getpid()
child = os.fork()
if child == 0:
    try:
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: die with the launcher
        if os.getppid() != me and not done.get("pidns"):
            os._exit(1)
        if pids:
            write(f"{pids}/cgroup.procs", "0")  # this process, and all it forks
        mb, cpu = cfg["memory_mb"] << 20, cfg["cpu_s"]
        limits = [(resource.RLIMIT_AS, mb), (resource.RLIMIT_CPU, cpu), (resource.RLIMIT_CORE, 0),
                  (resource.RLIMIT_FSIZE, 1 << 20), (resource.RLIMIT_NOFILE, 256)]
        if done["nproc"] and not was_root:
            limits.append((resource.RLIMIT_NPROC, cfg["max_procs"]))
        for what, n in limits:
            resource.setrlimit(what, (n, n))
        if was_root and done["user"]:  # no capability now or after exec: bounding set empty
            cap = 0  # (PR_CAPBSET_DROP 24), no ambient ones (PR_CAP_AMBIENT 47, CLEAR_ALL 4),
            while libc.prctl(24, cap, 0, 0, 0) == 0:  # securebits NOROOT, NO_SETUID_FIXUP and
                cap += 1  # KEEP_CAPS, each locked (PR_SET_SECUREBITS 28): exec gives none back
            libc.prctl(47, 4, 0, 0, 0)
            if libc.prctl(28, 0x2f, 0, 0, 0) != 0:
                os._exit(70)
        if abi >= 1:
            fs = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0) | (
                1 << 15 if abi >= 5 else 0)
            words = [fs] + ([3] if abi >= 4 else []) + ([3] if abi >= 6 else [])
            attr = (ctypes.c_uint64 * len(words))(*words)
            fd = libc.syscall(444, ctypes.byref(attr), ctypes.sizeof(attr), 0)
            class Beneath(ctypes.Structure):
                _pack_ = 1
                _fields_ = [("allowed", ctypes.c_uint64), ("fd", ctypes.c_int32)]
            read_rights, file_rights = 1 | 4 | 8, 1 | 2 | 4 | (1 << 14) | (1 << 15)
            for paths, rights in ((cfg["read"], read_rights), ([work, "/dev/null"], fs)):
                for path in paths:
                    if os.path.exists(path):
                        parent = os.open(path, os.O_PATH | os.O_CLOEXEC)
                        here = rights & fs & (~0 if os.path.isdir(path) else file_rights)
                        libc.syscall(445, fd, 1, ctypes.byref(Beneath(here, parent)), 0)
                        os.close(parent)
            libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS, which restrict_self requires
            if fd < 0 or libc.syscall(446, fd, 0) != 0:
                os._exit(70)  # refuse to run the code less confined than the probe said
        os.chdir(work)
        os.execve(sys.executable, [sys.executable, "-I", "-c", cfg["code"]],
                  {"PATH": os.environ.get("PATH", ""), "HOME": work})
    except BaseException:
        os._exit(70)
def descendants_gone():  # without a PID namespace: kill what came back to us, until none
    while True:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return
        for entry in os.listdir("/proc"):
            try:
                if entry.isdigit() and open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1] \
                        .split()[1] == str(me):
                    os.kill(int(entry), signal.SIGKILL)
            except (OSError, IndexError):
                pass
        time.sleep(0.01)
deadline, status = time.monotonic() + cfg["timeout_s"], None
while status is None:
    pid, st = os.waitpid(child, os.WNOHANG)
    if pid:
        status = st
    elif time.monotonic() > deadline:
        status = "timeout"
    else:
        time.sleep(0.005)
if status == "timeout" or not done.get("pidns"):
    try:
        os.kill(child, signal.SIGKILL)  # with a PID namespace: its every process
    except ProcessLookupError:
        pass
if not done.get("pidns"):
    descendants_gone()
elif status == "timeout":
    os.waitpid(child, 0)
if pids:  # the cgroup's processes: none may outlive the call
    for _ in range(500):
        try:
            for pid in open(f"{pids}/cgroup.procs").read().split():
                os.kill(int(pid), signal.SIGKILL)
            os.rmdir(pids)
            break
        except OSError:
            time.sleep(0.01)
if status == "timeout":
    finish(124)
finish(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))
'''

_found = None


def _python_dirs() -> list[str]:
    return sorted({sys.prefix, sys.base_prefix, sys.exec_prefix,
                   os.path.dirname(os.path.realpath(sys.executable))})


def _launch(cfg: dict) -> subprocess.Popen:
    cfg = {"read": [*_python_dirs(), "/usr", "/lib", "/lib64", "/bin", "/etc", "/dev/urandom"],
           **cfg}
    return subprocess.Popen([sys.executable, "-I", "-S", "-c", LAUNCHER, json.dumps(cfg)],
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
