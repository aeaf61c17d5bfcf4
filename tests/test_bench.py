"""The benchmarks end to end, small: bench/step.py on 2 ranks (the trainer's loop with the floor
beside each rollout), bench/envs.py, bench/partial.py, and the others' plumbing."""

import json

import pytest

from conftest import launch


@pytest.mark.engine
@pytest.mark.main_only  # the bench script's own plumbing
def test_step_bench_forces_full_length_and_times_every_phase(tiny_task_dir):
    out = launch(["bench/step.py", "--steps", "2", f"--data.tiny_task_dir={tiny_task_dir}"])
    line = json.loads(next(x for x in reversed(out.splitlines()) if x.startswith("{")))
    # tiny_cpu.yaml: 64 prompts x 8 samples over 2 engines, 4 new tokens each. Without the
    # forced length, the tiny model stops early (EOS) in most samples and these counts fall.
    assert line["world"] == 2 and line["steps_measured"] == 1
    assert line["response_tokens"] == [32 * 8 * 4] and line["floor_response_tokens"] == [1024]
    sec = line["seconds"]
    assert all(sec[k] > 0 for k in ("generate", "floor", "sync", "reward", "train", "step"))
    assert sec["logprobs"] == 0  # on-policy, no reference: no extra logprob pass
    assert line["train_tflops"] > 0 and "mfu" not in line  # no peak known for a CPU
    # generation's tokens per second: the step's response tokens over its generate seconds
    # (rounded to 1e-4 s, the rate to 1 token/s)
    tokens, g = line["response_tokens"][0], sec["generate"]
    assert abs(line["generate_tokens_per_s"] - tokens / g) <= 0.5 + tokens * 5e-5 / g ** 2
    # one measured step: the ratio is that step's; the seconds are rounded to 1e-4, the ratio
    # to 1e-3, which bounds their disagreement
    g, f, r = sec["generate"], sec["floor"], line["generate_over_floor"]
    assert abs(r - g / f) <= (g / f) * (5e-5 / g + 5e-5 / f) + 5e-4


@pytest.mark.engine
@pytest.mark.main_only  # the bench script's own plumbing
@pytest.mark.slow  # worker pools of fresh processes; the README's lane times the pools' calls
#   against their sleeps' arithmetic (tests/test_plugins.py) and runs environments in them
def test_envs_bench_times_every_mode(tiny_task_dir):
    """bench/envs.py, small: every mode runs the episodes to their 3 turns and scores them, and
    the pooled and async modes take less than serial, whose naps alone are 3 x 16 x 10 ms."""
    out = launch(["bench/envs.py", "--episodes", "16", "--env-sleep", "0.01",
                  "--reward-sleep", "0.01", "--workers", "4", "--concurrency", "8",
                  "--task-dir", tiny_task_dir], nproc=1)
    line = json.loads(next(x for x in reversed(out.splitlines()) if x.startswith("{")))
    assert line["episodes"] == 16 and line["turns"] == 3
    env, reward = line["env"], line["reward"]
    assert env["serial"]["per_turn_s"] >= 16 * 0.01 and reward["serial"]["seconds"] >= 16 * 0.01
    for mode in ("pooled", "async"):
        assert env[mode]["per_turn_s"] < env["serial"]["per_turn_s"]
        assert env[mode]["over_serial"] == round(
            env[mode]["per_turn_s"] / env["serial"]["per_turn_s"], 4)


@pytest.mark.engine
@pytest.mark.main_only  # the bench script's own plumbing
def test_partial_bench_runs_both_ways_on_the_same_lengths():
    """bench/partial.py, small: both ways write every sample's drawn length (the script checks
    each: off per sample, on by each trained sample's versions), and partial rollout carries
    samples from step to step on this long-tail workload."""
    out = launch(["bench/partial.py", "--steps", "4", "--warmup", "1", "--prompts", "2",
                  "--max-new", "64"], nproc=1)
    line = json.loads(next(x for x in reversed(out.splitlines()) if x.startswith("{")))
    off, on = line["off"], line["on"]
    assert off["gen_s_per_step"] > 0 and on["gen_s_per_step"] > 0
    assert line["on_over_off"] == round(on["gen_s_per_step"] / off["gen_s_per_step"], 4)
    assert on["samples_carried"] > 0 and on["dropped"] == 0 and 0 <= on["stale_token_share"] <= 1


@pytest.mark.engine
@pytest.mark.main_only  # the bench script's own plumbing
def test_weight_sync_bench_on_a_mixture_of_experts():
    """bench/weight_sync.py --experts, small: a random Qwen3-MoE pushed both ways and with each
    expert split out (rollout.per_expert), each against the floor."""
    out = launch(["bench/weight_sync.py", "--hidden", "256", "--layers", "2", "--experts", "4",
                  "--repeats", "1"])
    row = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert row["params_m"] > 0 and row["gb"] > 0
    for key in ("ratio", "unit_ratio", "per_expert_ratio"):
        assert row[key] > 0, row


@pytest.mark.main_only  # the bench script's own plumbing (no engine)
def test_seq_parallel_bench_halves_the_activations():
    """bench/seq_parallel.py, small: a 512-token row at sp 1 and 2 on 2 ranks; each rank keeps
    fewer activations at sp 2 (the exact ratio is the bench's to print)."""
    out = launch(["bench/seq_parallel.py", "--tokens", "512", "--layers", "2", "--repeats", "1"])
    row = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    assert 0 < row["activation_ratio"] < 0.8, row


@pytest.mark.engine
@pytest.mark.main_only  # the bench script's own plumbing
def test_agents_bench_times_the_endpoint_against_the_engine(tmp_path):
    """bench/agents.py, small: every agent form's run writes as many tokens as the engine's
    floor does, and the ratios are each run's seconds over the floor's."""
    out = launch(["bench/agents.py", "--episodes", "16", "--tokens", "4",
                  "--task-dir", str(tmp_path / "task")], nproc=1)
    line = json.loads(next(x for x in reversed(out.splitlines()) if x.startswith("{")))
    assert line["episodes"] == 16 and line["tokens"] == 4 and line["floor_s"] > 0
    for mode in ("shared", "fresh", "ready"):
        assert line[f"{mode}_vs_floor"] == round(line[f"{mode}_s"] / line["floor_s"], 2)


@pytest.mark.engine
@pytest.mark.main_only  # the bench script's own plumbing
@pytest.mark.slow  # two torchrun runs; tests/test_agents.py trains each form in the README's lane
def test_agent_forms_bench_trains_both_forms_without_a_traceback(tmp_path):
    """bench/agent_forms.py, small: both forms of the example agent train, their outputs hold
    no traceback, and the ratio is the two medians'."""
    out = launch(["bench/agent_forms.py", "--steps", "2", "--nproc", "1", "--out",
                  str(tmp_path), "--grpo.prompts_per_step=8"], nproc=1, timeout=900)
    line = json.loads(next(x for x in reversed(out.splitlines()) if x.startswith("{")))
    ready, url = line["solve"], line["solve_from_url"]
    assert ready["tracebacks"] == url["tracebacks"] == url["event_loop_closed"] == 0
    assert line["from_url_over_ready"] == round(url["gen_time_s"] / ready["gen_time_s"], 3)


@pytest.mark.engine
@pytest.mark.main_only  # the bench script's own plumbing
@pytest.mark.slow  # torchrun's fresh ranks; the README's lane checks that a step leaves nothing
#   that grows (tests/test_faults.py: weak references to step 3's objects)
def test_memory_bench_fits_the_growth_of_host_memory(tiny_task_dir, tmp_path):
    """bench/memory.py, small: the run's host memory per step, fitted after the warm-up."""
    out = launch(["bench/memory.py", "--steps", "8", "--warmup", "2", "--out", str(tmp_path),
                  f"--data.tiny_task_dir={tiny_task_dir}", "--grpo.prompts_per_step=8"],
                 nproc=1)
    line = json.loads(out.strip().splitlines()[-1])
    assert line["steps"] == 8 and line["device"] is None, line  # (CPU: no device memory)
    assert 0 < line["host"]["first_gb"] and isinstance(line["host"]["mib_per_100_steps"], float)
