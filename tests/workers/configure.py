"""Changes to a built run between steps, as a notebook makes them (train_grpo.configure), on the
tiny task at world size 1 (fp32, seed_per_step). After a restore to one snapshot, each edit made
through run.configure and as a direct edit of run.cfg, then one step: on the very rollout the
unedited step trained on for the update's fields, a fresh one for the engine's sampling. Each
step's parameters must differ from the unedited step's, and be the same bit for bit by either
door; after a temperature or top_p edit the engine and the trainer must take logprobs of the
same distribution (logp_gap at fp32's level). A refused edit raises one line before anything
runs, and leaves run.cfg as the run applied it. Prints CONFIGURE_OK.
Usage: python tests/workers/configure.py TASK_DIR OUT_DIR"""

import os
import sys

import torch

import config
from train_grpo import load_config, setup, train_step

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/workers
from states import state  # noqa: E402

task_dir, out_dir = sys.argv[1:3]
cfg = load_config("configs/tiny_cpu.yaml", [
    f"--data.tiny_task_dir={task_dir}", f"--log.out_dir={out_dir}", "--log.eval_every=0",
    "--log.samples_every=0", "--rollout.seed_per_step=true", "--grpo.prompts_per_step=16"])
# (field, value, a fresh rollout: the engine's sampling changed), and what goes with the edit in
# both the edited and the unedited step: clip_high bites only where the ratio moves, off-policy;
# in a second epoch every token of a positive advantage was pushed up by the first
EDITS = [("optim.lr", 1.5e-3, False, []), ("optim.grad_clip", 1e-3, False, []),
         ("optim.weight_decay", 0.5, False, []), ("grpo.loss_agg", "seq_mean", False, []),
         ("grpo.clip_high", 0.001, False, ["--grpo.mini_batches=4", "--grpo.ppo_epochs=2"]),
         ("rollout.temperature", 0.7, True, []), ("rollout.top_p", 0.9, True, [])]
REFUSED = [("grpo.kl_coef", 0.5, "needs a reference model"),
           ("rollout.max_new_tokens", 3, "built its parts with it"),
           ("model.lora.rank", 8, "built its parts with it")]


def params(run) -> dict:
    return {k: v for k, v in state(run).items() if k.startswith("param")}


def edit(run, door: str, name: str, value) -> None:
    """`name` set to `value` through one door: run.configure, or run.cfg itself (applied by the
    next train_step)."""
    if door == "configure":
        run.configure(f"--{name}={value}")
        return
    *path, key = name.split(".")
    section = run.cfg
    for part in path:
        section = getattr(section, part)
    setattr(section, key, value)


with setup(cfg) as run:
    for _ in range(12):  # past the first steps, where nearly every group's rewards are equal
        train_step(run)
    snap = run.snapshot()
    for name, value, fresh, also in EDITS:
        run.restore(snap)
        if also:
            run.configure(*also)
        plain = train_step(run)  # the unedited step (with what goes with the edit)
        rollout, before = run.last.rollout, params(run)
        after = {}
        for door in ("configure", "direct"):
            run.restore(snap)
            if also:
                run.configure(*also)
            edit(run, door, name, value)
            m = train_step(run, replay=None if fresh else rollout)
            after[door] = params(run)
            assert any(not torch.equal(before[k], after[door][k]) for k in before), (name, door)
            assert run.applied == run.cfg and run.settings.grpo == run.applied.grpo
            if fresh:  # the engine sampled, and the trainer scored, the same distribution
                assert (run.engine.cfg.temperature, run.engine.cfg.top_p) == (
                    run.settings.passes.temperature, run.settings.passes.top_p) == (
                    run.applied.rollout.temperature, run.applied.rollout.top_p)
                assert m["logp_gap"] < 1e-5 and plain["logp_gap"] < 1e-5, (name, m["logp_gap"])
        assert all(torch.equal(after["configure"][k], after["direct"][k]) for k in before), name
        print(f"{name}={value}: the step moved the parameters, alike by both doors", flush=True)
    run.restore(snap)
    applied = run.applied
    for name, value, says in REFUSED:
        for door in ("configure", "direct"):
            edit_now = (lambda: edit(run, door, name, value)) if door == "configure" else (
                lambda: (edit(run, door, name, value), train_step(run)))
            try:
                edit_now()
                raise AssertionError(f"{name}={value} by {door} was not refused")
            except config.BadInput as e:
                line = str(e)
                assert "\n" not in line and name in line and says in line and "Fix:" in line, line
            assert run.cfg == applied and run.applied is applied and run.step == snap.step
        print(f"{name}={value}: refused in one line by both doors: {line}", flush=True)
    train_step(run)  # and the run goes on
print("CONFIGURE_OK")
