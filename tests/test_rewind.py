"""Fork and rewind in a notebook, with the engine (tests/workers/rewind.py): a snapshot, three
steps, a restore and the same three steps give the same metrics, parameters and optimizer state
bit for bit, in a world of one and on 2 ranks with the offload and a reference, with LoRA, with
partial rollout; a replayed rollout trains exactly as the step that collected it; two variants
of the update from one snapshot on the same rollout, their first losses as tests/reference.py's
fp64 formulas predict them. snapshot.py alone: tests/test_snapshot.py."""

import pytest

from conftest import launch, run_python

pytestmark = pytest.mark.engine


def test_a_world_of_one_rewinds_exactly(tiny_task_dir, tmp_path):
    proc = run_python(["tests/workers/rewind.py", "exact", "configs/tiny_cpu.yaml",
                       tiny_task_dir, str(tmp_path / "run")])
    assert proc.returncode == 0 and "REWIND_OK" in proc.stdout, proc.stderr[-4000:]


@pytest.mark.parametrize("config, overrides", [
    pytest.param("tiny_cpu", ["--model.offload=on", "--grpo.kl_coef=0.05"], id="offload-ref"),
    pytest.param("lora_cpu", ["--grpo.kl_coef=0.01"], id="lora",
                 marks=pytest.mark.main_only),  # (the npu-engine lane: the other two)
    pytest.param("multiturn_cpu", ["--rollout.partial.enabled=true",
                                   "--rollout.partial.round_tokens=2",
                                   "--rollout.partial.oversample=1.5"], id="partial"),
])
def test_two_ranks_rewind_exactly(tiny_task_dir, tmp_path, config, overrides):
    """offload-ref: the actor and Adam's state moved to host memory around every engine turn,
    a frozen reference parked there; lora: the adapters and their state alone, the base the
    reference; partial: episodes carried mid-turn across the snapshot (multi-turn)."""
    out = launch(["tests/workers/rewind.py", "exact", f"configs/{config}.yaml", tiny_task_dir,
                  str(tmp_path / "run"), *overrides], timeout=900)
    assert out.count("REWIND_OK") == 2, out[-4000:]


def test_variants_replay_one_rollout_as_predicted(tiny_task_dir, tmp_path):
    proc = run_python(["tests/workers/rewind.py", "variants", "configs/tiny_cpu.yaml",
                       tiny_task_dir, str(tmp_path / "run")])
    assert proc.returncode == 0 and "REWIND_OK" in proc.stdout, proc.stderr[-4000:]
    print(proc.stdout[-3000:])


@pytest.mark.main_only  # the command line's plumbing over compare (tested above)
def test_the_command_line_compares_and_refuses_in_one_line(tiny_task_dir, tmp_path):
    """python -m workflows.variants: a run's step, then two variants for two steps on the same rollouts, their
    table and metrics; the run's own files hold its step alone. A variant that would change the
    sampling is refused with one line naming the field, before any model loads."""
    import json

    common = ["-m", "workflows.variants", "--config", "configs/tiny_cpu.yaml",
              f"--data.tiny_task_dir={tiny_task_dir}", f"--log.out_dir={tmp_path}/run",
              "--grpo.prompts_per_step=16", "--log.eval_every=0"]
    proc = run_python([*common, "--before", "1", "--steps", "2", "--evaluate", "--variant", "ppo",
                       "--variant", "dr: --grpo.loss_agg=constant --grpo.scale_adv_by_std=false"])
    assert proc.returncode == 0, proc.stderr[-4000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| variant | step | loss |") and len(table) == 2 + 4
    out = json.loads(next(x for x in reversed(proc.stdout.splitlines()) if x.startswith("{")))
    ppo, dr = out["metrics"]["ppo"], out["metrics"]["dr"]
    assert [m["step"] for m in ppo] == [m["step"] for m in dr] == [2, 3]
    assert [m["reward_mean"] for m in ppo] == [m["reward_mean"] for m in dr]  # same rollouts
    assert ppo[0]["loss"] != dr[0]["loss"] and set(out["evals"]) == {"ppo", "dr"}
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [1]

    refused = run_python([*common, "--variant", "hot: --rollout.temperature=0.5"])
    assert refused.returncode == 2 and "actor:" not in refused.stderr
    line = refused.stderr.strip().splitlines()[-1]
    assert line.startswith("error: variant 'hot': rollout.temperature") and "Fix:" in line
