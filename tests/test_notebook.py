"""The one-step API as a notebook uses it: errors caught between steps, a second setup(), the
caller's config and logging, close()."""

import json

import pytest
import torch

from conftest import run_python

pytestmark = pytest.mark.engine

@pytest.fixture(scope="module")
def uninterrupted(tiny_task_dir, tmp_path_factory):
    """{config: (metrics, parameters)} of tests/workers/caught_error.py with no error, made once."""
    runs = {}

    def get(config):
        if config not in runs:
            runs[config] = caught_error_run(config, "none", tiny_task_dir,
                                            tmp_path_factory.mktemp(f"plain_{config}"))
        return runs[config]
    return get


def caught_error_run(config: str, mode: str, task_dir: str, out: str):
    proc = run_python(["tests/workers/caught_error.py", config, mode, task_dir, f"{out}/run",
                       f"{out}/last"])
    assert proc.returncode == 0 and "CAUGHT_ERROR_DONE" in proc.stdout, proc.stderr[-4000:]
    assert ("CAUGHT" in proc.stdout.replace("CAUGHT_ERROR_DONE", "")) == (mode != "none")
    with open(f"{out}/last.json") as f:
        return json.load(f), torch.load(f"{out}/last.pt")


@pytest.mark.parametrize("config, mode", [  # the npu-stack lane: the engine's own interruption
    pytest.param("tiny", "reward", marks=pytest.mark.main_only),
    pytest.param("multiturn", "env", marks=pytest.mark.main_only), ("tiny", "generate")])
def test_a_caught_error_leaves_the_next_step_as_if_it_never_happened(
        uninterrupted, tiny_task_dir, tmp_path, config, mode):
    """A notebook with model.offload on and a reference: Ctrl-C inside a reward, inside an
    environment, or inside the engine's generation, caught; the steps after it give the same
    metrics and the same parameters, element for element, as a run in which it never
    happened. Before the switch was one guarded step, the error left the actor parked and the
    engine awake, and the data position moved on."""
    metrics, params = caught_error_run(config, mode, tiny_task_dir, str(tmp_path))
    want_metrics, want_params = uninterrupted(config)
    clock = ("_time_s", "tokens_per_s", "mem_", "train_tflops", "mfu")  # over seconds
    same = {k: v for k, v in want_metrics.items() if not any(c in k for c in clock)}
    assert {k: metrics[k] for k in same} == same
    assert metrics["offload_host_gb"] > 0  # the offload really ran
    assert params.keys() == want_params.keys()
    assert all(torch.equal(params[n], want_params[n]) for n in params)


@pytest.mark.main_only  # the notebook's plumbing: no version enters beyond the other tests'
def test_setup_leaves_the_callers_config_and_logging_and_close_always_ends_the_run(
        tiny_task_dir, tmp_path):
    """In one process, as a notebook: setup() works on a copy of the config it is given, adds
    no handler where the process has logging set up (its lines reach the caller's handler), and
    refuses a second setup() while the run is open, naming the way out; a step in which every
    group is dropped (dynamic sampling, constant rewards) trains nothing and reports a zero norm;
    close() ends every part even when one of them raises, and a second close() does nothing."""
    code = f"""
import copy, io, logging
import torch.distributed as dist
import train_grpo
from train_grpo import load_config, setup, train_step

cfg = load_config("configs/tiny_cpu.yaml", ["--data.tiny_task_dir={tiny_task_dir}",
                  "--log.out_dir={tmp_path}", "--grpo.prompts_per_step=8", "--log.eval_every=0"])
given = copy.deepcopy(cfg)
root, seen = logging.getLogger(), io.StringIO()
root.addHandler(logging.StreamHandler(seen))
handlers, grpo_handlers = list(root.handlers), list(logging.getLogger("grpo").handlers)
run = setup(cfg)
assert cfg == given and run.cfg is not cfg, "setup changed the caller's config"
assert run.cfg.model.path and not cfg.model.path  # the tiny task's path went into the copy
assert root.handlers == handlers and logging.getLogger("grpo").handlers == grpo_handlers
assert "device cpu" in seen.getvalue(), "the run's log lines did not reach the caller's handler"
try:
    setup(cfg)
    raise SystemExit("a second setup() was not refused")
except RuntimeError as e:
    assert "already open" in str(e) and "close()" in str(e) and len(str(e).splitlines()) == 1
assert train_grpo.open_run() is run
train_step(run)  # the open run is unharmed
# no token to learn from on any rank: dynamic sampling drops every group (all rewards equal)
import rewards, torch
before = [p.detach().clone() for p in run.actor.parameters()]
run.sampler.scorer.close()
run.sampler.scorer = rewards.Scorer(rewards.RewardConfig(
    funcs=["tests/workers/interrupting.py:nothing"]))
run.cfg.grpo.dynamic_sampling = True
m = train_step(run)
assert m["groups_trained"] == 0 and m["samples_trained"] == 0 and m["grad_norm"] == 0.0, m
assert all(torch.equal(p, b) for p, b in zip(run.actor.parameters(), before))
scorer, engine = run.sampler.scorer, run.engine
procs = [w.proc for w in scorer.worker._plain + scorer.worker._async]
assert procs and all(p.is_alive() for p in procs), "the step ran no reward worker"

def broken():
    raise OSError("disk gone")

run.tracker.close = broken  # a part that fails to close: the others must close all the same
try:
    run.close()
    raise SystemExit("close() swallowed the error")
except OSError as e:
    assert "disk gone" in str(e)
assert not any(p.is_alive() for p in procs), "a reward worker outlived close()"
assert not hasattr(engine, "llm"), "the engine was not shut down"
assert not dist.is_initialized() and train_grpo.open_run() is None
run.close()  # again: nothing left to do, no error
print("NOTEBOOK_OK")
"""
    proc = run_python(["-c", code])
    assert proc.returncode == 0 and "NOTEBOOK_OK" in proc.stdout, proc.stderr[-4000:]
