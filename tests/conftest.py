import os
import socket
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_path(*extra) -> str:
    """PYTHONPATH for a child process: the project, `extra`, then this process's own PYTHONPATH
    (packages can come that way, as on a machine without a package index)."""
    inherited = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    return os.pathsep.join([ROOT, *map(str, extra), *inherited])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], nproc: int = 2, timeout: int = 600, env: dict | None = None) -> str:
    """Run `args` under torchrun with `nproc` CPU ranks; fail the test with its output on error."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path(), **(env or {})}
    proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(args)} exited {proc.returncode}:\n{out[-6000:]}")
    return out


@pytest.fixture(scope="session")
def tiny_task_dir(tmp_path_factory):
    import tiny_task

    return tiny_task.ensure_tiny_task(str(tmp_path_factory.mktemp("tiny") / "task"))


@pytest.fixture(scope="session")
def tiny_models(tiny_task_dir, tmp_path_factory):
    """{"qwen2": model dir, "qwen3": model dir}, same tokenizer."""
    import tiny_task

    qwen3 = tiny_task.ensure_tiny_task(str(tmp_path_factory.mktemp("tiny3") / "task"), arch="qwen3")
    return {"qwen2": f"{tiny_task_dir}/model", "qwen3": f"{qwen3}/model"}


def crashed_copy(run_dir, crashed_dir, step: int) -> None:
    """What a run that crashed after its step-`step` checkpoint leaves, made from a finished run
    of the same config and seeds (the steps are exact: rollout.seed_per_step): that checkpoint,
    and the logs with the finished run's later rows in them, which resume must drop."""
    import shutil

    name = f"step_{step:06d}"
    shutil.copytree(os.path.join(run_dir, "checkpoints", name),
                    os.path.join(crashed_dir, "checkpoints", name))
    for log in ("metrics.jsonl", "samples.jsonl"):
        if os.path.exists(os.path.join(run_dir, log)):
            shutil.copy(os.path.join(run_dir, log), os.path.join(crashed_dir, log))
