"""A run forked and rewound, as a notebook does it, on the tiny task (fp32, seed_per_step).

MODE exact: one step, a snapshot, 3 steps, restore, the same 3 steps: the second three must
give every metric (clocks aside), every parameter and every optimizer state tensor of the
first three, bit for bit, and metrics.jsonl the rows of one run. Feature checks by the
overrides: offload really moved, LoRA trains its adapters alone, partial rollout carried groups
across the snapshot, a reference gave a KL.
MODE variants (world size 1): one step, a snapshot; a step collected, restored, replayed on its
rollout (equal, bit for bit); then variants.compare of ppo and cispo over 2 steps, whose first
step's losses are predicted in fp64 from the same tensors (tests/reference.py's formulas).
Prints REWIND_OK on every rank when every check passed; any failure raises.
Usage: python tests/workers/rewind.py MODE CONFIG TASK_DIR OUT_DIR [--section.key=value ...]
(under torchrun for 2 ranks; CONFIG a file of configs/)"""

import json
import math
import os
import sys

import torch

from train_grpo import load_config, setup, train_step

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/workers
from states import same_state, state  # noqa: E402

mode, config_file, task_dir, out_dir = sys.argv[1:5]
CLOCK = ("_time_s", "tokens_per_s", "mem_", "train_tflops", "mfu")  # seconds, memory peaks
TURN = ("sync_gb", "offload_host_gb", "replay")  # what an engine turn reports, a replay not


def numbers(metrics: dict, also=()) -> dict:
    return {k: v for k, v in metrics.items() if not any(c in k for c in CLOCK + tuple(also))}


def exact(run, overrides) -> None:
    first_metrics = train_step(run)
    snap = run.snapshot()
    at_snap = state(run)
    trained = {k: v for k, v in at_snap.items() if k.startswith("param")}
    mine = sum(v.numel() * v.element_size() for k, v in at_snap.items()
               if torch.is_tensor(v) and (k.startswith("optim") or any(
                   p.requires_grad and f"param {n}" == k for n, p in run.actor.named_parameters())))
    assert snap.bytes == mine, (snap.bytes, mine)  # what it says it costs
    one = [train_step(run) for _ in range(3)]
    after_one = state(run)
    moved = [k for k in trained if not torch.equal(trained[k], after_one[k])]
    assert moved, "three steps changed no parameter: the comparison would prove nothing"
    run.restore(snap)
    assert run.step == 1
    same_state(state(run), at_snap, "restored")
    two = [train_step(run) for _ in range(3)]
    for a, b in zip(one, two):
        assert numbers(a) == numbers(b), {k: (a[k], b.get(k)) for k in numbers(a)
                                          if a[k] != b.get(k)}
    same_state(after_one, state(run), "after the same 3 steps")
    if run.rank == 0:
        with open(os.path.join(out_dir, "metrics.jsonl")) as f:
            steps = [json.loads(line)["step"] for line in f]
        assert steps == [1, 2, 3, 4], steps  # the first three's rows went with the restore
    if "--model.offload=on" in overrides:
        assert one[0]["offload_host_gb"] > 0
    if run.cfg.model.lora.rank:
        assert moved and all("lora_" in k for k in moved), moved
    if "--rollout.partial.enabled=true" in overrides:
        assert first_metrics["partial_carried"] > 0, "nothing was carried across the snapshot"
    if run.cfg.grpo.kl_coef > 0:
        assert one[-1]["kl"] > 0


def predicted_losses(run, last, names_cfgs) -> dict:
    """The first step's loss of each (name, GRPOConfig), from the batch it trained on and the
    actor's logprobs of it now, by tests/reference.py's fp64 formulas; and each one's bound:
    the trainer sums at most a few thousand fp32 terms (each rounded to 2^-24 of itself) from
    logprobs its own forward made (packed otherwise: fp32 rounding, < 1e-5 of |logp| + 1)."""
    import grpo
    import logprobs
    import reference

    samples, adv = last.batch.samples, last.batch.adv
    logp = logprobs.sample_logprobs(run.actor, samples, run.settings.passes)
    width = max(len(s.response_ids) for s in samples)
    pad = lambda rows: torch.stack([torch.nn.functional.pad(torch.as_tensor(r).double(),  # noqa
                                                            (0, width - len(r))) for r in rows])
    lp, engine, a = pad(logp), pad([s.logp for s in samples]), pad(adv)[:, 0]
    mask = pad([s.mask or [1] * len(s.response_ids) for s in samples])
    n_tokens, out = float(mask.sum()), {}
    for name, cfg in names_cfgs:
        w = grpo.mismatch_weights(lp, engine, mask, cfg.is_correction, cfg.is_cap)
        loss, _ = reference.padded_loss(lp, lp, a, mask, cfg, n_tokens, len(samples),
                                        run.cfg.rollout.max_new_tokens, w)
        terms, _ = reference.padded_terms(lp, lp, a, cfg, w, mask=mask)
        weights = grpo.loss_weights(mask, cfg, n_tokens, len(samples),
                                    run.cfg.rollout.max_new_tokens)
        size = float((terms.abs() * weights).sum() + (w * a[:, None].abs() * weights).sum())
        out[name] = (float(loss), (mask.sum().item() * 2**-24 + 1e-5) * size)
    return out


def variants(run) -> None:
    import dataclasses

    from workflows.variants import compare

    train_step(run)
    snap = run.snapshot()
    collected = train_step(run)
    last, after = run.last, state(run)
    run.restore(snap)
    replayed = train_step(run, replay=last.rollout)
    assert replayed["replay"] == 1 and replayed["gen_time_s"] == 0.0
    assert numbers(collected, TURN) == numbers(replayed, TURN)
    same_state(after, state(run), "the replay")
    run.restore(snap)
    cispo = ["--grpo.policy_loss=cispo", "--grpo.clip_high=4.0"]
    out = compare(run, {"ppo": [], "cispo": cispo}, steps=2, evaluate=True)
    assert run.step == 1
    ppo, cis = out.metrics["ppo"], out.metrics["cispo"]
    assert numbers(ppo[0], TURN) == numbers(collected, TURN)  # the first variant's step: the same
    assert all(m["replay"] == 1 for m in cis) and len(out.rollouts) == 2
    g = run.cfg.grpo
    want = predicted_losses(run, last, [
        ("ppo", g), ("cispo", dataclasses.replace(g, policy_loss="cispo", clip_high=4.0))])
    for name, m in (("ppo", ppo[0]), ("cispo", cis[0])):
        value, bound = want[name]
        assert abs(m["loss"] - value) <= bound, (name, m["loss"], value, bound)
    gap = abs(want["ppo"][0] - want["cispo"][0])
    assert gap > 100 * max(want["ppo"][1], want["cispo"][1]), want  # they really differ
    # at ratio 1 (on-policy) CISPO's gradient is PPO's: the same norm, to fp32's rounding
    assert math.isclose(ppo[0]["grad_norm"], cis[0]["grad_norm"], rel_tol=1e-5), (ppo, cis)
    # and so the same steps: CISPO ends where PPO does, to that rounding
    assert ppo[-1]["apart"] == 0.0 and ppo[-1]["moved"] > 0
    assert cis[-1]["apart"] <= 1e-4 * ppo[-1]["moved"], (cis[-1], ppo[-1])
    assert set(out.evals) == {"ppo", "cispo"} and "eval_pass1" in out.evals["ppo"]
    print("\n" + out.table())
    print(json.dumps({"predicted": want, "ppo": ppo[0]["loss"], "cispo": cis[0]["loss"]}))


overrides = [f"--data.tiny_task_dir={task_dir}", f"--log.out_dir={out_dir}",
             "--log.eval_every=0", "--log.samples_every=0", "--grpo.prompts_per_step=16",
             "--rollout.seed_per_step=true", *sys.argv[5:]]
with setup(load_config(config_file, overrides)) as run:
    exact(run, overrides) if mode == "exact" else variants(run)
print("REWIND_OK", flush=True)
