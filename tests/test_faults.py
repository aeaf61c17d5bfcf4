"""What a run survives (faults.py): a stop signal in the middle of a step (a checkpoint, exit 0,
and a resume that matches a run never stopped), a rank killed under torchrun --max-restarts
(the run finishes by itself, its metrics a run's never stopped), and non-finite optimizer steps
(skipped, bit for bit, counted; the run stops at optim.max_nonfinite in a row)."""

import json
import os
import random

import pytest

import config
import faults
import train_grpo
from conftest import launch, run_python

CLOCK = ("_time_s", "tokens_per_s", "mem_", "train_tflops", "mfu")  # seconds, memory peaks


def rows(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]


def numbers(row: dict) -> dict:
    return {k: v for k, v in row.items() if not any(c in k for c in CLOCK)}


def common(task_dir: str) -> list[str]:
    return ["--config", "configs/tiny_cpu.yaml", f"--data.tiny_task_dir={task_dir}",
            "--log.eval_every=0", "--grpo.prompts_per_step=16", "--rollout.seed_per_step=true",
            "--train.steps=5"]


@pytest.fixture(scope="module")
def uninterrupted(tiny_task_dir, tmp_path_factory) -> list[dict]:
    """The metrics of the 5 steps, run without a stop."""
    out = tmp_path_factory.mktemp("uninterrupted")
    launch(["train_grpo.py", *common(tiny_task_dir), f"--log.out_dir={out}"])
    return [numbers(r) for r in rows(out / "metrics.jsonl")]


@pytest.mark.engine
def test_sigterm_mid_step_stops_after_it_with_a_checkpoint_and_resumes_exactly(
        tiny_task_dir, tmp_path, uninterrupted):
    """Rank 1 alone gets SIGTERM as step 2 begins: both ranks finish step 2, write its
    checkpoint (log.save_every is 0: the stop's own) and exit 0 without starting step 3; the same
    command with --train.resume=auto then runs steps 3-5 as the run that never stopped did."""
    out = tmp_path / "run"
    said = launch(["tests/workers/signalled.py", "SIGTERM", "1", "2", *common(tiny_task_dir),
                   "--log.save_every=0", f"--log.out_dir={out}"])
    assert "stopped by SIGTERM after step 2 of 5" in said and "Resume: " in said, said[-3000:]
    assert [r["step"] for r in rows(out / "metrics.jsonl")] == [1, 2]
    assert (out / "checkpoints" / "step_000002" / "trainer_state.json").exists()
    assert not (out / "final").exists()  # a stopped run is not finished: no export
    again = launch(["train_grpo.py", *common(tiny_task_dir), "--log.save_every=0",
                    f"--log.out_dir={out}", "--train.resume=auto"])
    assert "continuing after step 2" in again
    assert [numbers(r) for r in rows(out / "metrics.jsonl")] == uninterrupted


@pytest.mark.engine
@pytest.mark.slow  # torchrun's own restart; the README's lane restarts a rank in the two-node test
def test_a_rank_killed_under_torchrun_restarts_and_finishes_as_if_never_killed(
        tiny_task_dir, tmp_path, uninterrupted):
    """torchrun --max-restarts=1, a checkpoint every step, train.resume=auto: rank 1 killed with
    SIGKILL as a random step begins; torchrun starts both ranks again, they resume from the
    step before, and the run ends with every step's metrics those of the run never killed."""
    out, step = tmp_path / "run", random.Random().randint(2, 4)
    said = launch(["--max-restarts=1", "tests/workers/signalled.py", "SIGKILL", "1", str(step),
                   *common(tiny_task_dir), "--log.save_every=1", "--train.resume=auto",
                   "--train.dist_timeout_s=120", f"--log.out_dir={out}"], torchrun=True,
                  timeout=900)
    assert f"sending itself SIGKILL in step {step}" in said
    assert f"continuing after step {step - 1}" in said, said[-3000:]
    assert [numbers(r) for r in rows(out / "metrics.jsonl")] == uninterrupted, step
    assert (out / "final" / "model.safetensors").exists()


@pytest.mark.engine
def test_a_rank_killed_on_one_of_two_nodes_restarts_both_as_if_never_killed(
        tiny_task_dir, tmp_path, uninterrupted):
    """Two single-rank nodes (two torchrun agents, a c10d rendezvous on this machine) with
    --max-restarts=1 and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the rank of one is killed as a
    random step begins; its agent restarts it, the other agent restarts its rank as a change
    of membership (each counts its restarts: 1 and 0), both resume from the step before in
    the new round's store, and the run ends with every step's metrics those of the run never
    killed. Without that variable the run is refused in one line (train_grpo.attempt_prefix).
    Both ranks have LOCAL_RANK=0, so anything that took the local rank for the global one (the
    tiny task's creation: the run starts from an empty task dir, file writes, engine groups)
    would clash here: one rank writes the task, each step's line and its metrics, both write
    their checkpoint files."""
    import subprocess
    import sys

    from conftest import ROOT, base_env, free_port

    out, step = tmp_path / "run", random.Random().randint(2, 4)
    port = free_port()
    env = base_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                   SIGNALLED_ONCE=str(tmp_path / "signalled"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
           "--rdzv_backend=c10d", f"--rdzv_endpoint=127.0.0.1:{port}", "--rdzv_id=two",
           "--max-restarts=1", "tests/workers/signalled.py", "SIGKILL", "1", str(step),
           *common(tmp_path / "task"), "--log.save_every=1", "--train.resume=auto",
           "--train.dist_timeout_s=120", f"--log.out_dir={out}"]
    nodes = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [node.communicate(timeout=900)[0] for node in nodes]
    said = "".join(outs)
    assert [node.returncode for node in nodes] == [0, 0], said[-3000:]
    assert f"sending itself SIGKILL in step {step}" in said
    assert f"continuing after step {step - 1}" in said, said[-3000:]
    # one writer of the rows, no duplicate; the task it made is the fixture's (a seeded build)
    assert [numbers(r) for r in rows(out / "metrics.jsonl")] == uninterrupted, step
    for i in range(1, 6):  # each step's line printed once, by rank 0's node of its round
        assert said.count(f"step {i}/5 | reward") == 1, (i, said[-3000:])
    assert len(os.listdir(out / "checkpoints" / "step_000005")) >= 4  # both ranks' files
    shared = {"GROUP_WORLD_SIZE": "2", "TORCHELASTIC_MAX_RESTARTS": "1",
              "TORCHELASTIC_RESTART_COUNT": "0"}
    with pytest.raises(config.BadInput, match="TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every"):
        train_grpo.attempt_prefix({**shared, "TORCHELASTIC_USE_AGENT_STORE": "True"})
    assert train_grpo.attempt_prefix({**shared, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None
    assert train_grpo.attempt_prefix({**shared, "GROUP_WORLD_SIZE": "1"}) == "attempt_0"


@pytest.mark.engine
def test_non_finite_steps_are_skipped_counted_and_stop_the_run_in_a_row(tiny_task_dir,
                                                                        tmp_path):
    out = launch(["tests/workers/nonfinite.py", tiny_task_dir, str(tmp_path / "run")])
    assert out.count("NONFINITE_OK") == 2, out[-3000:]


@pytest.mark.engine
def test_a_step_leaves_nothing_that_grows(tiny_task_dir, tmp_path):
    """tests/workers/step_leaks.py: step 3's objects gone after step 4 (weak references), and no
    kind of object growing a step at a time, with the offload and the push every step."""
    proc = run_python(["tests/workers/step_leaks.py", tiny_task_dir, str(tmp_path / "run")])
    assert proc.returncode == 0 and "STEP_LEAKS_OK" in proc.stdout, proc.stderr[-3000:]


def test_faults_count_stops_at_the_limit_and_a_finite_step_resets_it():
    assert faults.count(0, [None, "loss", None], 4, 2) == 0
    assert faults.count(1, ["grad_norm"], 5, 3) == 2
    with pytest.raises(faults.NonFinite, match=r"^step 7: the loss was not finite in 3 "):
        faults.count(1, [None, "grad_norm", "grad_norm", "loss"], 7, 3)


def test_main_prints_a_stopped_run_s_line_and_exits_1(monkeypatch, capsys):
    """The command line: faults.NonFinite is one line on stderr, exit code 1, no traceback."""
    def stops(cfg):
        raise faults.NonFinite("step 3: the loss was not finite in 3 optimizer steps in a row")

    monkeypatch.setattr(train_grpo, "train", stops)
    with pytest.raises(SystemExit) as stop:
        train_grpo.main(["--config", "configs/tiny_cpu.yaml"])
    err = capsys.readouterr().err
    assert stop.value.code == 1 and err == ("error: step 3: the loss was not finite in 3 "
                                            "optimizer steps in a row\n"), err


def test_resume_true_without_a_checkpoint_is_refused_before_any_model_loads(tiny_task_dir,
                                                                              tmp_path):
    """train.resume=true asks for a checkpoint that must be there (auto starts afresh): one
    line, exit code 2, before the engine or the actor loads."""
    proc = run_python(["train_grpo.py", "--config", "configs/tiny_cpu.yaml",
                       f"--data.tiny_task_dir={tiny_task_dir}", f"--log.out_dir={tmp_path}",
                       "--train.resume=true"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert len(line) == 1 and "train.resume=true: " in line[0] and "no complete checkpoint. " \
        "Fix: train.resume=auto" in line[0], proc.stderr[-3000:]
    assert "vllm" not in proc.stderr.lower() and "Loading" not in proc.stderr
