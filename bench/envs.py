"""Environment and reward calls, serial vs pooled vs async, on the tiny model. Prints one JSON
line.

    python bench/envs.py                       # 512 episodes of 3 turns; about 2.5 minutes
    python bench/envs.py --episodes 32         # a quick look

Each mode runs the same rollout (episodes.EpisodeRunner on a real engine, the tiny task's
model, seeded) with an environment that always answers after a nap of --env-sleep seconds
(50 ms), so every episode takes env.max_turns = 3 turns and the environment is called 3 times
per episode (the third answer meets the turn limit). Modes: serial (env.workers 1: the calls one
after another), pooled (env.workers --workers, 16: plain functions in that many processes),
async (an `async def` environment awaiting the same nap, env.concurrency --concurrency, 64).
Reported: the environment's seconds per turn (records.Generated.env.seconds / 3) and each mode's
ratio to serial; the same for a reward that naps --reward-sleep seconds (20 ms) over the
rollout's samples (rewards.Scorer, one call per sample). The pools start before the timed
rollout (warm-up jobs as wide as the pool, until every worker answered one): their start-up is
reported apart, as `start_s`.
"""

import argparse
import asyncio
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAP = {"env": 0.05, "reward": 0.02}  # set from the arguments; read in the workers from the env


def _nap(kind: str) -> float:
    return float(os.environ.get(f"BENCH_{kind.upper()}_SLEEP", NAP[kind]))


# each answers a warm-up call ({"warm": seconds}) after that nap with the worker's process id

def env_plain(messages, example):
    if "warm" in example:
        time.sleep(example["warm"])
        return str(os.getpid())
    time.sleep(_nap("env"))
    return example["prompt"]


async def env_async(messages, example):
    if "warm" in example:
        await asyncio.sleep(example["warm"])
        return str(os.getpid())
    await asyncio.sleep(_nap("env"))
    return example["prompt"]


def reward_plain(completion, example):
    if "warm" in example:
        time.sleep(example["warm"])
        return float(os.getpid())
    time.sleep(_nap("reward"))
    return 1.0


async def reward_async(completion, example):
    if "warm" in example:
        await asyncio.sleep(example["warm"])
        return float(os.getpid())
    await asyncio.sleep(_nap("reward"))
    return 1.0


def warm_up(worker, first_arg, width: int) -> float:
    """Seconds until the pool is up: jobs of `width` calls until each went to a worker of its
    own, so that none starts inside the timed run. The pool grows only while calls wait behind
    busy workers (plugins.Processes.PATIENCE_S): with more than one worker, each warm-up call
    naps twice that, so that the first job starts the rest of the pool, and the first ready
    workers take the calls of the others still starting."""
    import plugins

    nap = 2 * plugins.Processes.PATIENCE_S if width > 1 else 0.0
    t = time.perf_counter()
    while len({repr(v) for v in worker.run([(0, (first_arg, {"warm": nap}))] * width)}) < width:
        pass
    return time.perf_counter() - t


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--episodes", type=int, default=512)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--env-sleep", type=float, default=NAP["env"])
    p.add_argument("--reward-sleep", type=float, default=NAP["reward"])
    p.add_argument("--task-dir", default=os.path.join(ROOT, "runs", "tiny_task"))
    args = p.parse_args()
    os.environ["BENCH_ENV_SLEEP"], os.environ["BENCH_REWARD_SLEEP"] = (
        str(args.env_sleep), str(args.reward_sleep))  # the workers inherit them
    sys.path.insert(0, ROOT)
    import npu_ops  # noqa: F401  (first: the platform environment before torch loads)
    import data
    import episodes
    import rewards
    import rollout
    from tasks import tiny_task
    import train_grpo
    from common import shut_down
    from transformers import AutoTokenizer

    train_grpo.init_distributed()  # a world of one, for the engine (or torchrun's)
    task = tiny_task.ensure_tiny_task(args.task_dir)
    tok = AutoTokenizer.from_pretrained(os.path.join(task, "model"))
    examples = data.load_examples(data.DataConfig(path=os.path.join(task, "train.jsonl")), tok)
    G, turns, max_new = 8, 3, 4
    batch = [examples[i % len(examples)] for i in range(args.episodes // G)]
    engine = rollout.Engine(rollout.RolloutConfig(
        dtype="float32", max_model_len=64, kv_cache_memory_bytes=64 << 20,
        max_new_tokens=max_new), os.path.join(task, "model"))
    me = os.path.abspath(__file__)
    modes = {"serial": ("plain", 1), "pooled": ("plain", args.workers),
             "async": ("async", args.workers)}
    out = {"episodes": len(batch) * G, "turns": turns, "env_sleep_s": args.env_sleep,
           "reward_sleep_s": args.reward_sleep, "workers": args.workers,
           "concurrency": args.concurrency, "cpus": os.cpu_count(), "env": {}, "reward": {}}
    for mode, (kind, workers) in modes.items():
        cfg = episodes.EnvConfig(name=f"{me}:env_{kind}", max_turns=turns,
                                 max_tokens=turns * max_new + (turns - 1) * 8, timeout_s=10.0,
                                 workers=workers, concurrency=args.concurrency)
        runner = episodes.EpisodeRunner(cfg, tok, False, "prompt", max_new)
        width = workers if kind == "plain" else 1
        start_s = warm_up(runner.worker, [], width)
        gen = runner.run(engine, batch, G, seed=0)
        runner.close()
        assert gen.env.errors == gen.env.timeouts == 0 and set(gen.turns) == {turns}, gen.turns
        out["env"][mode] = {"per_turn_s": round(gen.env.seconds / turns, 4),
                            "start_s": round(start_s, 3)}
        scorer = rewards.Scorer(rewards.RewardConfig(
            funcs=[f"{me}:reward_{kind}"], timeout_s=10.0, workers=workers,
            concurrency=args.concurrency))
        start_s = warm_up(scorer.worker, "", width)
        t = time.perf_counter()
        scored = scorer.score(gen.texts, gen.examples)
        took = time.perf_counter() - t
        scorer.close()
        assert scored.total == [1.0] * len(gen.texts), scored.errors
        out["reward"][mode] = {"seconds": round(took, 4), "start_s": round(start_s, 3)}
    for part, key in (("env", "per_turn_s"), ("reward", "seconds")):
        serial = out[part]["serial"][key]
        for mode in ("pooled", "async"):
            out[part][mode]["over_serial"] = round(out[part][mode][key] / serial, 4)
    print(json.dumps(out), flush=True)
    shut_down(engine)


if __name__ == "__main__":
    main()
