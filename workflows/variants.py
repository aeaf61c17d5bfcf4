"""Variants of a run's update trained on the very same rollouts from the very same state, side by
side: `compare(run, variants, steps)`, in a notebook (world size 1) or on every rank.

    from train_grpo import load_config, setup, train_step
    from workflows.variants import compare
    run = setup(load_config("configs/tiny_cpu.yaml", ["--log.out_dir=/tmp/run"]))
    for _ in range(20):
        train_step(run)
    out = compare(run, {"ppo": [], "cispo": ["--grpo.policy_loss=cispo"]}, steps=3)
    print(out.table())                                  # the run is back at step 20

or from the shell, a fresh run (`--before` steps first) and its table (`main`):

    python -m workflows.variants --config configs/tiny_cpu.yaml --before 20 --steps 3 \\
        --variant ppo --variant "cispo: --grpo.policy_loss=cispo --grpo.clip_high=4"

How: a snapshot of the run (train_grpo.Run.snapshot); the first variant collects `steps`
rollouts as a step does and trains on them; each other variant is restored to the snapshot and
trains on those rollouts (train_grpo.train_step's replay); the run is restored at the end,
whatever raised. The first step of every variant is on-policy (the same weights sampled it);
later steps of the other variants train on samples that the first variant's weights drew, which
their own `logp_gap` and `is_ratio_*` show. Nothing is written to the run's files: no metrics
rows, samples, eval or checkpoint on schedule.

A variant is `--section.key=value` overrides of the run's config that change what the update
does with a given rollout: grpo's fields, except those that shape the rollout itself
(`COLLECTING`), and the optimizer's `OPTIMIZER` fields. Anything else (the engine's sampling,
the model, the data) would change what is collected, and is refused before any step runs, as
a variant that needs a part the run did not build (a reference for grpo.kl_coef > 0).
"""

import argparse
import dataclasses
import json
import os
import shlex
import sys

import torch
import torch.distributed as dist

import config
import tracking
import train_grpo
from workflows import snapshot
from config import BadInput

# grpo's fields that shape the rollout or its groups, not its update
COLLECTING = ("grpo.group_size", "grpo.prompts_per_step", "grpo.dynamic_sampling",
              "grpo.max_gen_rounds")
OPTIMIZER = ("optim.lr", "optim.beta1", "optim.beta2", "optim.weight_decay", "optim.grad_clip")
# the metrics `Comparison.table` shows by default
COLUMNS = ("loss", "grad_norm", "clip_frac", "entropy", "is_ratio_mean", "moved", "apart")


def variant_config(base, name: str, overrides: list[str], world: int | None = None,
                   reference: bool = True):
    """The config `base` with `overrides`, refused where it changes more than the update
    (module docstring) or needs a reference and `reference` is False: BadInput naming the
    field; with `world`, checked as a run's config is (config.validate) at that world size."""
    cfg = config.override(base, overrides)
    if world is not None:
        config.validate(cfg, world)
    before = {name: value for name, value, *_ in config.fields(base)}
    changed = [k for k, v, *_ in config.fields(cfg) if v != before[k]]
    for key in changed:
        if not ((key.startswith("grpo.") and key not in COLLECTING) or key in OPTIMIZER):
            raise BadInput(f"variant {name!r}: {key} changes how the rollout is collected or what "
                           "the run built, not the update. Fix: a variant changes grpo's fields "
                           f"(not {', '.join(COLLECTING)}) or {', '.join(OPTIMIZER)}; compare "
                           "other changes as separate runs")
    if cfg.grpo.kl_coef > 0 and not reference:
        raise BadInput(f"variant {name!r}: grpo.kl_coef > 0 needs a reference model, which this "
                       "run did not build. Fix: start the run with grpo.kl_coef > 0 (a variant "
                       "may then set it to 0)")
    return cfg


@dataclasses.dataclass
class Comparison:
    """compare's result: `metrics[variant]`, each step's metrics; `evals[variant]`, the
    held-out eval after its steps (compare(evaluate=True)); `rollouts`, the rollouts every
    variant trained on, one a step."""
    metrics: dict
    evals: dict
    rollouts: list

    def table(self, columns=COLUMNS) -> str:
        """A Markdown table: a row per variant and step, the `columns` it has (`moved`: the
        norm of the parameters' change since the snapshot; `apart`: from the first variant's
        parameters after the same step), then the eval's pass@1 where there is one."""
        shown = [c for c in columns if any(c in m for rows in self.metrics.values() for m in rows)]
        head = ["variant", "step", *shown] + (["eval_pass1"] if self.evals else [])
        lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for name, rows in self.metrics.items():
            for k, m in enumerate(rows):
                cells = [name, str(m["step"])] + [_cell(m.get(c)) for c in shown]
                if self.evals:
                    last = k == len(rows) - 1
                    cells.append(_cell(self.evals[name].get("eval_pass1")) if last else "")
                lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)


def _cell(value) -> str:
    return "" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


@torch.no_grad()
def distance(actor, params: dict) -> float:
    """The norm of (the actor's trained parameters - `params`, host copies of this rank's
    shards of them), over all ranks."""
    total = torch.zeros((), dtype=torch.float64)
    for name, p in snapshot.trained(actor).items():
        diff = snapshot.host_copy(p).double() - params[name].double()
        total += diff.pow(2).sum()
    if dist.is_initialized():
        dist.all_reduce(total)  # (gloo: host tensors)
    return float(total.sqrt())


def compare(run, variants: dict, steps: int = 1, evaluate: bool = False) -> Comparison:
    """Train each of `variants` ({name: [--section.key=value, ...]}, the first usually [] for
    the run's own config) for `steps` steps from the run's state now, on the same rollouts
    (module docstring); with `evaluate`, the held-out eval of each after its steps
    (sampler.Sampler.evaluate: log.eval_k's mean@k too). The run is back where it was
    afterwards. Every rank must call, with the same arguments. Holds a snapshot (run.snapshot) and one more copy
    of the trained parameters in host memory."""
    if not variants or steps < 1:
        raise BadInput("compare: give at least one variant and steps >= 1")
    configs = {name: variant_config(run.applied, name, list(o), run.world, run.ref is not None)
               for name, o in variants.items()}
    for cfg in configs.values():  # nothing written: no eval, samples or checkpoint on schedule
        cfg.log = dataclasses.replace(cfg.log, eval_every=0, samples_every=0, save_every=0)
    snap = run.snapshot()
    out, first = Comparison({}, {}, []), None
    parts = run.tracker, run.profiler  # (a tracker of another rank than 0 writes nothing)
    run.tracker = tracking.Tracker(run.applied, -1, snap.step)
    run.profiler = train_grpo.StepProfiler([], run.applied.log.out_dir, run.rank)
    try:
        for k, (name, cfg) in enumerate(configs.items()):
            if k:
                run.restore(snap)
            train_grpo.configure(run, cfg)
            rows = []
            for s in range(steps):
                m = train_grpo.train_step(run, replay=out.rollouts[s] if k else None)
                if not k:
                    out.rollouts.append(run.last.rollout)
                rows.append(m)
            rows[-1]["moved"] = distance(run.actor, snap.state["params"])
            if first is None:
                first = {n: snapshot.host_copy(p)
                         for n, p in snapshot.trained(run.actor).items()}
            rows[-1]["apart"] = distance(run.actor, first)
            out.metrics[name] = rows
            if evaluate:
                scores, _ = run.sampler.evaluate(run.turn, run.eval_examples,
                                                 run.applied.log.eval_k)
                out.evals[name] = scores
    finally:
        run.tracker, run.profiler = parts
        run.restore(snap)
    return out


def parse_variant(text: str) -> tuple[str, list[str]]:
    """"NAME: --section.key=value ..." (or "NAME" alone: the run's own config) -> (NAME,
    [overrides])."""
    name, _, overrides = text.partition(":")
    return name.strip(), shlex.split(overrides)


def parser() -> argparse.ArgumentParser:
    """`main`'s flags; the ones it does not know are the run's --section.key=value overrides."""
    p = argparse.ArgumentParser(description="Variants of a run's update trained on the same "
                                "rollouts from one state of the run, side by side")
    p.add_argument("--config", required=True, help="the run's YAML file")
    p.add_argument("--before", type=int, default=0, help="steps the run takes first")
    p.add_argument("--steps", type=int, default=1, help="steps each variant takes")
    p.add_argument("--variant", action="append", default=[], metavar="'NAME[: OVERRIDES]'",
                   help="a variant: its name, then --section.key=value overrides (repeat)")
    p.add_argument("--evaluate", action="store_true", help="the held-out eval of each")
    return p


def main(argv=None) -> None:
    """The command line (module docstring): a run of --config and its --section.key=value
    overrides, --before steps, then `compare` of the --variant's; rank 0 prints the table and a
    JSON line of every variant's metrics."""
    args, overrides = parser().parse_known_args(argv)
    try:
        cfg = train_grpo.load_config(args.config, overrides)
        variants = dict(parse_variant(v) for v in args.variant) or {"run": []}
        for name, changes in variants.items():  # a bad one fails now, before anything loads
            variant_config(cfg, name, changes, reference=cfg.grpo.kl_coef > 0)
        with train_grpo.setup(cfg) as run:
            for _ in range(args.before):
                train_grpo.train_step(run)
            out, rank = compare(run, variants, args.steps, args.evaluate), run.rank
        if rank == 0:  # (after the run's progress bar is gone)
            print(out.table())
            print(json.dumps({"metrics": out.metrics, "evals": out.evals}))
    except BadInput as e:  # one line, no traceback (as train_grpo.main)
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
