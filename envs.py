"""Built-in environments for multi-turn rollouts (episodes.py runs them).

An environment is a function `fn(messages: list[dict], example: dict)` (or an `async def` one),
named in the `env:` config section like a reward: a built-in from ENVS, `package.module:function`
or `path/to/file.py:function`. After each model turn it gets the episode so far as chat messages
(the prompt's, each model turn as {"role": "assistant", ...}, each earlier reply) and the dataset
row, and returns its reply: text (a turn in the role of `env.reply_role`), a {"role", "content"}
message (e.g. role "tool" for a tool's output), or None when the episode is over. It runs in
worker processes (env.workers of them, or for an `async def` one an event loop with
env.concurrency calls at once) with a time limit per call, like the rewards; it keeps no state
between calls (derive it from the messages), so a cut call loses nothing but its own episode.

This module is what the environment worker imports (with the plugins named in the config): it
keeps to the standard library.
"""

import os
import re
import resource
import subprocess
import sys
import tempfile

import plugins


def retry(messages: list[dict], example: dict):
    """The built-in task with a second chance: an answer that is not the right number alone gets
    the question again, and the model answers once more; the right one ends the episode. (Its
    reward, rewards.tiny_sum, scores the last answer.)"""
    if messages[-1]["content"].strip() == str(example["answer"]).strip():
        return None
    return example["prompt"]


_CODE = re.compile(r"```(?:python|py)?\s*\n(.*?)```", re.DOTALL)


def python_tool(messages: list[dict], example: dict):
    """Math with a Python tool: a model turn that holds a ```python block gets the output of its
    last block back as a tool message (run_python); a turn without one is the final answer."""
    blocks = _CODE.findall(messages[-1]["content"])
    if not blocks:
        return None
    return {"role": "tool", "content": run_python(blocks[-1])}


# Landlock (Linux 5.13 and later, no privileges needed) confines a process and its children to
# the files under the paths it is given: the child that runs the model's code reads Python and
# the system libraries, and writes only its own temporary directory. The syscalls and structures
# are the kernel's uapi (linux/landlock.h): create_ruleset 444, add_rule 445, restrict_self 446 on
# every architecture; each ABI version adds access rights (2: refer, 3: truncate).
_READ_FILE, _READ_DIR, _EXECUTE = 1 << 2, 1 << 3, 1 << 0
_FILE_RIGHTS = _EXECUTE | (1 << 1) | _READ_FILE | (1 << 14)  # what a rule on a file may grant


def _landlock_abi() -> int:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return max(0, libc.syscall(444, None, 0, 1))  # LANDLOCK_CREATE_RULESET_VERSION


def _landlock(read: list[str], write: list[str]) -> bool:
    """Restrict this process to reading (and executing) under `read` and to anything under
    `write`; every other file is out of reach. False where the kernel has no Landlock."""
    import ctypes

    abi = _landlock_abi()
    if abi < 1:
        return False
    handled = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0) | (1 << 14 if abi >= 3 else 0)

    class Ruleset(ctypes.Structure):
        _fields_ = [("handled_access_fs", ctypes.c_uint64)]

    class PathBeneath(ctypes.Structure):
        _pack_ = 1
        _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]

    libc = ctypes.CDLL(None, use_errno=True)
    ruleset = Ruleset(handled)
    fd = libc.syscall(444, ctypes.byref(ruleset), ctypes.sizeof(ruleset), 0)
    if fd < 0:
        return False
    for paths, rights in ((read, _EXECUTE | _READ_FILE | _READ_DIR), (write, handled)):
        for path in paths:
            if not os.path.exists(path):
                continue
            rights_here = rights & handled & (_FILE_RIGHTS if os.path.isfile(path) else ~0)
            parent = os.open(path, os.O_PATH | os.O_CLOEXEC)
            libc.syscall(445, fd, 1, ctypes.byref(PathBeneath(rights_here, parent)), 0)
            os.close(parent)
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS, which restrict_self requires
    done = libc.syscall(446, fd, 0) == 0
    os.close(fd)
    return done


def _confine(workdir: str, memory_mb: int, cpu_s: int):
    def apply():  # in the child, before it runs the code
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))  # no file over 1 MB
        python = {sys.prefix, sys.base_prefix, sys.exec_prefix,
                  os.path.dirname(os.path.realpath(sys.executable))}
        _landlock(read=[*python, "/usr", "/lib", "/lib64", "/bin", "/etc", "/dev/urandom"],
                  write=[workdir, "/dev/null"])
    return apply


def run_python(code: str, timeout_s: float = 5.0, memory_mb: int = 512, limit: int = 2000) -> str:
    """Run `code` in a fresh Python and return what it printed (stdout, then stderr), cut to
    `limit` characters. The process gets an empty temporary directory as its working directory
    and HOME, no environment but PATH, isolated mode (-I: no PYTHONPATH, no user site), at most
    `memory_mb` MB of address space, `timeout_s` of CPU time and of wall time, no file over 1 MB,
    and (Landlock, Linux 5.13 and later) no file outside Python's and the system's, which it may
    only read, and its own directory: the run directory, checkpoints and data are out of its
    reach. Where the kernel has no Landlock (`sandboxed()` is False) that last limit is missing:
    run untrusted code in a container there."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            proc = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp, capture_output=True,
                                  text=True, timeout=timeout_s, stdin=subprocess.DEVNULL,
                                  env={"PATH": os.environ.get("PATH", ""), "HOME": tmp},
                                  preexec_fn=_confine(tmp, memory_mb, int(timeout_s) + 1))
            out = proc.stdout + proc.stderr
            if proc.returncode < 0:  # a signal: SIGXCPU from the CPU time limit, or SIGKILL
                out += f"killed by signal {-proc.returncode}"
        except subprocess.TimeoutExpired:
            out = f"timed out after {timeout_s:g} s"
    return out if len(out) <= limit else out[:limit] + "\n[cut]"


def sandboxed() -> bool:
    """Whether run_python can keep the code away from the files outside its directory."""
    return _landlock_abi() >= 1


ENVS = {"retry": retry, "python": python_tool}
SIGNATURE = "def fn(messages: list[dict], example: dict) -> str | dict | None"


def resolve(spec: str):
    """The environment `spec` names (an ENVS key, module:function or file.py:function); raises a
    one-line ValueError naming env.name."""
    return plugins.resolve(spec, "env.name", ENVS, SIGNATURE)


def as_reply(value) -> dict | None:
    """An environment's answer as a message ({"role": None for the configured role, "content"}),
    or None when the episode is over; anything else is the environment's failure."""
    if value is None:
        return None
    if isinstance(value, str):
        return {"role": None, "content": value}
    if (isinstance(value, dict) and isinstance(value.get("role"), str)
            and isinstance(value.get("content"), str)):
        return {"role": value["role"], "content": value["content"]}
    raise TypeError(f"returned {value!r}: not text, a {{'role', 'content'}} message or None")
