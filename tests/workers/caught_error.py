"""One process, no torchrun, as a notebook: setup() with model.offload on and a reference, one
step, then (MODE) a step that Ctrl-C cuts inside a reward, inside an environment or inside the
engine's generation, caught; then two more steps. Writes the last step's metrics and the actor's
parameters to OUT.json / OUT.pt, for a comparison with MODE none (the error never happened).
CONFIG: tiny (configs/tiny_cpu.yaml) or multiturn (configs/multiturn_cpu.yaml, whose environment
is the interrupting one).
Usage: python tests/workers/caught_error.py CONFIG MODE TASK_DIR OUT_DIR OUT [OVERRIDE ...]
(--section.key=value overrides after OUT: the device tests' engine dtype)"""

import json
import sys

import plugins
from train_grpo import load_config, setup, train_step

config, mode, task_dir, out_dir, out = sys.argv[1:6]
spec = "tests/workers/interrupting.py"
args = [f"--data.tiny_task_dir={task_dir}", f"--log.out_dir={out_dir}", "--log.eval_every=0",
        "--grpo.prompts_per_step=8", "--model.offload=on", "--grpo.kl_coef=0.05",
        "--rollout.seed_per_step=true", f"--reward.funcs={spec}:reward", "--reward.timeout_s=0",
        *sys.argv[6:]]
if config == "multiturn":
    args += [f"--env.name={spec}:env", "--env.timeout_s=0"]
plugin = sys.modules[plugins.resolve(f"{spec}:reward", "test", {}, "").__module__]

import torch  # noqa: E402

with setup(load_config(f"configs/{config}_cpu.yaml", args)) as run:
    train_step(run)
    if mode != "none":
        if mode == "generate":  # Ctrl-C in the engine's second scheduler step
            engine, step, calls = run.engine.llm.llm_engine, run.engine.llm.llm_engine.step, []

            def interrupted_step():
                calls.append(1)
                if len(calls) == 2:
                    raise KeyboardInterrupt
                return step()

            engine.step = interrupted_step
        else:
            plugin.ARMED = True
        try:
            train_step(run)
            raise SystemExit("the armed step did not raise")
        except KeyboardInterrupt:
            print("CAUGHT", flush=True)
        if mode == "generate":
            del engine.step  # the class's own again
            assert len(calls) == 2
        assert not plugin.ARMED and run.step == 1
    train_step(run)
    metrics = train_step(run)
    assert run.step == 3
    torch.save({n: p.full_tensor() for n, p in run.actor.named_parameters()}, out + ".pt")
    with open(out + ".json", "w") as f:
        json.dump(metrics, f)
print("CAUGHT_ERROR_DONE")
