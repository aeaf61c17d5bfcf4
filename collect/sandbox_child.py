"""The sandbox's launcher: confines itself, then forks and execs the model's code (sandbox.py).

Run by sandbox._launch as `python -I -S sandbox_child.py CFG_JSON`, in a session of its own. CFG
holds `workdir`, `read` (the paths the code may read), `dir_mb` and `max_files`; with `probe` it
prints, as one JSON line, what it could confine (`pidns`, `netns`, `mountns`, `userns`,
`dircap`, `user`, `nproc`, `landlock`: the Landlock ABI) and exits; else `code`, `timeout_s`,
`cpu_s`, `memory_mb` and `max_procs` run the code. Its exit status is the code's, 128 + the
signal that ended it, EXIT_TIMEOUT at `timeout_s`, or EXIT_UNCONFINED where it cannot confine
the code as far as the probe said.

Kernel facts used, from the Linux uapi headers named beside each constant below. Landlock's
ruleset attribute is {handled_access_fs; handled_access_net (ABI 4); scoped (ABI 6)}, and its size
tells the kernel which fields it holds; a path rule is {allowed_access; parent_fd}, packed.

Standard library only, and nothing of the project: this file runs before any confinement, in a
Python that reads no site-packages. Nothing runs at import.
"""

import ctypes
import json
import os
import resource
import signal
import sys
import time

# unshare(2) flags, linux/sched.h
CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

# prctl(2) options, linux/prctl.h
PR_SET_PDEATHSIG = 1
PR_CAPBSET_READ = 23
PR_CAPBSET_DROP = 24
PR_SET_SECUREBITS = 28
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4  # PR_CAP_AMBIENT's second argument

CAP_SETPCAP = 8  # linux/capability.h: the one that lets a process drop from its bounding set

# securebits, linux/securebits.h
SECBIT_NOROOT = 1 << 0  # uid 0 gains no capability at exec
SECBIT_NOROOT_LOCKED = 1 << 1
SECBIT_NO_SETUID_FIXUP = 1 << 2  # a uid change from or to 0 moves no capability
SECBIT_NO_SETUID_FIXUP_LOCKED = 1 << 3
SECBIT_KEEP_CAPS_LOCKED = 1 << 5  # KEEP_CAPS (1 << 4) stays off
NO_ROOT_SECUREBITS = (SECBIT_NOROOT | SECBIT_NOROOT_LOCKED | SECBIT_NO_SETUID_FIXUP
                      | SECBIT_NO_SETUID_FIXUP_LOCKED | SECBIT_KEEP_CAPS_LOCKED)  # 0x2f

# mount(2) flags, linux/mount.h
MS_NOSUID = 2
MS_NODEV = 4
MS_REC = 0x4000
MS_PRIVATE = 1 << 18

# Landlock syscalls, asm-generic/unistd.h (the same number on every architecture)
SYS_landlock_create_ruleset = 444
SYS_landlock_add_rule = 445
SYS_landlock_restrict_self = 446

# Landlock, linux/landlock.h
LANDLOCK_CREATE_RULESET_VERSION = 1 << 0  # create_ruleset's flag: return the ABI version
LANDLOCK_RULE_PATH_BENEATH = 1
LANDLOCK_ACCESS_FS_EXECUTE = 1 << 0  # file rights: bits 0-12 since ABI 1
LANDLOCK_ACCESS_FS_WRITE_FILE = 1 << 1
LANDLOCK_ACCESS_FS_READ_FILE = 1 << 2
LANDLOCK_ACCESS_FS_READ_DIR = 1 << 3
LANDLOCK_ACCESS_FS_REMOVE_DIR = 1 << 4
LANDLOCK_ACCESS_FS_REMOVE_FILE = 1 << 5
LANDLOCK_ACCESS_FS_MAKE_CHAR = 1 << 6
LANDLOCK_ACCESS_FS_MAKE_DIR = 1 << 7
LANDLOCK_ACCESS_FS_MAKE_REG = 1 << 8
LANDLOCK_ACCESS_FS_MAKE_SOCK = 1 << 9
LANDLOCK_ACCESS_FS_MAKE_FIFO = 1 << 10
LANDLOCK_ACCESS_FS_MAKE_BLOCK = 1 << 11
LANDLOCK_ACCESS_FS_MAKE_SYM = 1 << 12
LANDLOCK_ACCESS_FS_REFER = 1 << 13  # ABI 2
LANDLOCK_ACCESS_FS_TRUNCATE = 1 << 14  # ABI 3
LANDLOCK_ACCESS_FS_IOCTL_DEV = 1 << 15  # ABI 5
LANDLOCK_ACCESS_NET_BIND_TCP = 1 << 0  # network rights: ABI 4
LANDLOCK_ACCESS_NET_CONNECT_TCP = 1 << 1
LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # scopes: ABI 6
LANDLOCK_SCOPE_SIGNAL = 1 << 1

# (first ABI, rights it added): the file rights a ruleset handles are those the kernel knows
FS_RIGHTS_BY_ABI = ((1, (LANDLOCK_ACCESS_FS_MAKE_SYM << 1) - 1), (2, LANDLOCK_ACCESS_FS_REFER),
                    (3, LANDLOCK_ACCESS_FS_TRUNCATE), (5, LANDLOCK_ACCESS_FS_IOCTL_DEV))
NET_RIGHTS_ABI, SCOPES_ABI = 4, 6
NET_RIGHTS = LANDLOCK_ACCESS_NET_BIND_TCP | LANDLOCK_ACCESS_NET_CONNECT_TCP  # all denied
SCOPES = LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET | LANDLOCK_SCOPE_SIGNAL  # none leaves the sandbox
READ_RIGHTS = (LANDLOCK_ACCESS_FS_EXECUTE | LANDLOCK_ACCESS_FS_READ_FILE
               | LANDLOCK_ACCESS_FS_READ_DIR)
# the rights a rule on a file (not a directory) may hold; the kernel refuses the others there
FILE_RIGHTS = (LANDLOCK_ACCESS_FS_EXECUTE | LANDLOCK_ACCESS_FS_WRITE_FILE
               | LANDLOCK_ACCESS_FS_READ_FILE | LANDLOCK_ACCESS_FS_TRUNCATE
               | LANDLOCK_ACCESS_FS_IOCTL_DEV)

# exit statuses
EXIT_TIMEOUT = 124  # as coreutils' timeout(1)
EXIT_UNCONFINED = 70  # EX_SOFTWARE, sysexits.h: the code did not run
EXIT_ORPHANED = 1  # the launcher died before the child could ask to die with it
SIGNAL_EXIT_BASE = 128  # the shell's convention: 128 + the signal that ended the code

# the code's limits that the config does not set
FILE_MAX_BYTES = 1 << 20
OPEN_FILES_MAX = 256
DEFAULT_MAX_PROCS = 32  # the probe's pids cgroup: its config names no max_procs
WAIT_POLL_S = 0.005  # how often the launcher looks whether the child has ended
KILL_POLL_S = 0.01  # how often it looks again for processes left to kill
CGROUP_TRIES = 500  # tries, KILL_POLL_S apart, to empty and remove the pids cgroup


class PathBeneath(ctypes.Structure):
    """struct landlock_path_beneath_attr (linux/landlock.h), packed."""
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


# ---- the launcher confines itself ---------------------------------------------------------

def namespaces(libc, flags: int) -> dict:
    """Unshare the namespaces in `flags` (CLONE_NEW*); the probe's keys for them, or {} if the
    kernel refused. The PID namespace is the next child's: it is that namespace's first process."""
    if libc.unshare(flags) != 0:
        return {}
    return {"pidns": True, "netns": True, "mountns": True, "userns": bool(flags & CLONE_NEWUSER)}


def capped_dir(libc, cfg: dict, uid: int, gid: int) -> bool:
    """Mount a tmpfs of `dir_mb` MB and `max_files` inodes on the work directory, seen only in
    this mount namespace (mounts made private first); True if it is there."""
    opts = f"size={cfg['dir_mb']}m,nr_inodes={cfg['max_files']},mode=700,uid={uid},gid={gid}"
    return libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) == 0 and libc.mount(
        b"tmpfs", cfg["workdir"].encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts.encode()) == 0


def pids_cgroup(max_procs: int) -> str | None:
    """A new pids cgroup of at most `max_procs` processes, in cgroup v1's pids hierarchy or v2's
    root where that delegates pids; its path, or None."""
    for base in ("/sys/fs/cgroup/pids", "/sys/fs/cgroup"):
        try:
            if base == "/sys/fs/cgroup" and "pids" not in read(f"{base}/cgroup.subtree_control"):
                continue
            pids = f"{base}/grpo-sandbox-{os.getpid()}"
            os.mkdir(pids)
            write(f"{pids}/pids.max", str(max_procs))
            return pids
        except OSError:
            pass
    return None


def confine_root(libc, cfg: dict) -> tuple[dict, str | None]:
    """As root: namespaces and the capped directory; the code keeps uid 0 (its Python may be
    where no other user can read) less every capability, and since uid 0 is exempt from
    RLIMIT_NPROC, a pids cgroup counts its processes. The probe's keys, and the cgroup."""
    done = namespaces(libc, CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET)
    if done:
        done["dircap"] = capped_dir(libc, cfg, 0, 0)
    done["user"] = libc.prctl(PR_CAPBSET_READ, CAP_SETPCAP, 0, 0, 0) == 1  # it can drop them
    pids = pids_cgroup(cfg.get("max_procs", DEFAULT_MAX_PROCS))
    done["nproc"] = pids is not None
    return done, pids


def confine_user(libc, cfg: dict) -> dict:
    """As a user: its own hard limits are out of its reach; in a user namespace of its own its
    processes are counted apart from the trainer's threads. The probe's keys."""
    done = {"user": True}
    uid, gid = os.getuid(), os.getgid()
    spaces = namespaces(libc, CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET)
    done.update(spaces)
    if spaces:  # the same ids inside: not root there, so no capability is left after exec
        write("/proc/self/setgroups", "deny")
        write("/proc/self/uid_map", f"{uid} {uid} 1")
        write("/proc/self/gid_map", f"{gid} {gid} 1")
        done["dircap"] = capped_dir(libc, cfg, uid, gid)
    done["nproc"] = bool(done.get("userns"))
    return done


def finish(code: int, pids: str | None) -> None:
    """Remove the pids cgroup (if still there) and exit with `code`."""
    if pids:
        try:
            os.rmdir(pids)
        except OSError:
            pass
    os._exit(code)


# ---- the child confines itself further, then execs the code --------------------------------

def set_limits(cfg: dict, nproc: bool) -> None:
    """Hard limits, equal to the soft ones: a process may lower them, never raise them back."""
    limits = [(resource.RLIMIT_AS, cfg["memory_mb"] << 20), (resource.RLIMIT_CPU, cfg["cpu_s"]),
              (resource.RLIMIT_CORE, 0), (resource.RLIMIT_FSIZE, FILE_MAX_BYTES),
              (resource.RLIMIT_NOFILE, OPEN_FILES_MAX)]
    if nproc:
        limits.append((resource.RLIMIT_NPROC, cfg["max_procs"]))
    for what, n in limits:
        resource.setrlimit(what, (n, n))


def drop_capabilities(libc) -> bool:
    """No capability now or after exec, for uid 0: the bounding set emptied, no ambient one,
    and securebits that give none back at exec, locked. True if the securebits took."""
    cap = 0
    while libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:  # until the first unknown one
        cap += 1
    libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    return libc.prctl(PR_SET_SECUREBITS, NO_ROOT_SECUREBITS, 0, 0, 0) == 0


def landlock(libc, abi: int, read_paths: list[str], workdir: str) -> bool:
    """Restrict this process, and what it execs, to reading and executing `read_paths` and to
    anything in `workdir` and /dev/null; from ABI 4 no TCP bind or connect, from ABI 6 no signal
    or abstract Unix socket outside. True if the kernel enforces it."""
    fs = 0
    for since, rights in FS_RIGHTS_BY_ABI:
        if abi >= since:
            fs |= rights
    words = [fs] + ([NET_RIGHTS] if abi >= NET_RIGHTS_ABI else []) + (
        [SCOPES] if abi >= SCOPES_ABI else [])
    attr = (ctypes.c_uint64 * len(words))(*words)  # the ruleset attribute, as long as ABI knows
    fd = libc.syscall(SYS_landlock_create_ruleset, ctypes.byref(attr), ctypes.sizeof(attr), 0)
    for paths, rights in ((read_paths, READ_RIGHTS), ([workdir, "/dev/null"], fs)):
        for path in paths:
            if os.path.exists(path):
                parent = os.open(path, os.O_PATH | os.O_CLOEXEC)
                here = rights & fs & (~0 if os.path.isdir(path) else FILE_RIGHTS)
                libc.syscall(SYS_landlock_add_rule, fd, LANDLOCK_RULE_PATH_BENEATH,
                             ctypes.byref(PathBeneath(here, parent)), 0)
                os.close(parent)
    libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # which restrict_self requires
    return fd >= 0 and libc.syscall(SYS_landlock_restrict_self, fd, 0) == 0


def confine_and_exec(libc, cfg: dict, done: dict, pids: str | None, launcher: int,
                     was_root: bool) -> None:
    """In the forked child: die with the `launcher`, join the pids cgroup, set the limits, drop
    root's capabilities, apply Landlock, then exec the code in the work directory. Exits
    EXIT_UNCONFINED rather than run the code less confined than the probe said."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != launcher and not done.get("pidns"):  # it died before the line above
        os._exit(EXIT_ORPHANED)
    if pids:
        write(f"{pids}/cgroup.procs", "0")  # this process, and all it forks
    set_limits(cfg, nproc=done["nproc"] and not was_root)
    if was_root and done["user"] and not drop_capabilities(libc):
        os._exit(EXIT_UNCONFINED)
    if done["landlock"] >= 1 and not landlock(libc, done["landlock"], cfg["read"],
                                              cfg["workdir"]):
        os._exit(EXIT_UNCONFINED)
    os.chdir(cfg["workdir"])
    os.execve(sys.executable, [sys.executable, "-I", "-c", cfg["code"]],
              {"PATH": os.environ.get("PATH", ""), "HOME": cfg["workdir"]})


# ---- the launcher waits, then leaves no process behind -------------------------------------

def descendants_gone(launcher: int) -> None:
    """Without a PID namespace: reap, and kill what came back to the `launcher` (a child
    subreaper), until it has no child left."""
    while True:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return
        for entry in os.listdir("/proc"):
            try:  # /proc/PID/stat: "pid (comm) state ppid ..."; comm may hold ") "
                if entry.isdigit() and read(f"/proc/{entry}/stat").rsplit(")", 1)[1] \
                        .split()[1] == str(launcher):
                    os.kill(int(entry), signal.SIGKILL)
            except (OSError, IndexError):
                pass
        time.sleep(KILL_POLL_S)


def empty_cgroup(pids: str) -> None:
    """Kill the pids cgroup's processes and remove it: none may outlive the call."""
    for _ in range(CGROUP_TRIES):
        try:
            for pid in read(f"{pids}/cgroup.procs").split():
                os.kill(int(pid), signal.SIGKILL)
            os.rmdir(pids)
            break
        except OSError:
            time.sleep(KILL_POLL_S)


def wait_and_kill(child: int, timeout_s: float, pidns: bool, pids: str | None,
                  launcher: int) -> int:
    """Wait for `child` up to `timeout_s`, then kill it and every process it left; the exit
    status to report: EXIT_TIMEOUT, 128 + a signal, or the child's own."""
    deadline, status = time.monotonic() + timeout_s, None
    while status is None:
        pid, st = os.waitpid(child, os.WNOHANG)
        if pid:
            status = st
        elif time.monotonic() > deadline:
            status = "timeout"
        else:
            time.sleep(WAIT_POLL_S)
    if status == "timeout" or not pidns:
        try:
            os.kill(child, signal.SIGKILL)  # with a PID namespace: its every process
        except ProcessLookupError:
            pass
    if not pidns:
        descendants_gone(launcher)
    elif status == "timeout":
        os.waitpid(child, 0)
    if pids:
        empty_cgroup(pids)
    if status == "timeout":
        return EXIT_TIMEOUT
    if os.WIFSIGNALED(status):
        return SIGNAL_EXIT_BASE + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def main(argv: list[str]) -> None:
    """argv[1]: the config, JSON (the module's docstring). Never returns: exits."""
    cfg = json.loads(argv[1])
    libc = ctypes.CDLL(None, use_errno=True)
    was_root = os.getuid() == 0
    if was_root:
        done, pids = confine_root(libc, cfg)
    else:
        done, pids = confine_user(libc, cfg), None
    if not done.get("pidns"):
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans come back here
    done["landlock"] = max(0, libc.syscall(SYS_landlock_create_ruleset, None, 0,
                                           LANDLOCK_CREATE_RULESET_VERSION))
    if cfg.get("probe"):
        print(json.dumps(done), flush=True)
        finish(0, pids)
    launcher = os.getpid()
    child = os.fork()
    if child == 0:
        try:
            confine_and_exec(libc, cfg, done, pids, launcher, was_root)
        except BaseException:
            os._exit(EXIT_UNCONFINED)
    finish(wait_and_kill(child, cfg["timeout_s"], bool(done.get("pidns")), pids, launcher), pids)


if __name__ == "__main__":
    main(sys.argv)
