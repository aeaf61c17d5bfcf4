"""Partial rollout against steps that wait for their longest response, on a long-tail workload:
generation seconds per step, tokens per second, carried and stale shares. Prints one JSON line.

    python bench/partial.py                     # 30 steps each way; about 3 minutes on 2 cores
    python bench/partial.py --steps 8           # a quick look

The workload: --prompts groups of --group-size samples a step, each sample's length drawn from
a Pareto distribution (shape --alpha, scale --scale tokens: most are short, a few run to the
--max-new cap), the engine ignoring EOS so that every sample writes exactly its length. Both
ways draw the same prompts in the same order, each sample with the same length, on a
random-init Qwen2 (hidden 128, 2 layers, 4k positions: bench/common.py) in fp32, one rank.
  off: each step generates its groups in one engine call (rollout.Engine.generate, a request a
       sample with its own length) and waits for the longest;
  on:  partial.PartialRollout with rollout.partial's --round-tokens and --oversample, the
       weights version counted up each step as training would (no training here: generation
       alone is timed; the version only tells stale tokens from fresh ones).
Reported per step, the first --warmup steps left out: generation seconds (mean), tokens written
per second, and for `on` the samples and tokens carried to the next step, the share of trained
tokens written in an earlier step (stale), staleness in steps (mean, max) and dropped samples.
"""

import argparse
import json
import math
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def lengths(k: int, group_size: int, args) -> list[int]:
    """The response lengths of the group of the k-th prompt drawn: the same in both ways."""
    rng = random.Random(f"{args.seed}/{k}")
    return [min(args.max_new, math.ceil(args.scale * rng.paretovariate(args.alpha)))
            for _ in range(group_size)]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--prompts", type=int, default=16, help="groups trained a step")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--alpha", type=float, default=1.1, help="Pareto shape: smaller, longer tail")
    p.add_argument("--scale", type=float, default=6.0, help="Pareto scale: the shortest length")
    p.add_argument("--round-tokens", type=int, default=32)
    p.add_argument("--oversample", type=float, default=1.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, default=32,
                   help="KV-cache block: a resumed request's prompt is cached in whole blocks")
    args = p.parse_args()
    sys.path.insert(0, ROOT)
    import npu_ops  # noqa: F401  (first: the platform environment before torch loads)
    from collect import partial
    import episodes
    import grpo
    import records
    import rollout
    import train_grpo
    from common import random_qwen2, shut_down
    from transformers import AutoTokenizer

    train_grpo.init_distributed()  # a world of one, for the engine
    model = random_qwen2(hidden=128, layers=2, rank=0)
    tok = AutoTokenizer.from_pretrained(model)
    G, share = args.group_size, args.prompts
    examples = [{"prompt": f"{a}+{b}=", "answer": str(a + b),
                 "prompt_ids": tok(f"{a}+{b}=", add_special_tokens=False)["input_ids"]}
                for a in range(10) for b in range(10)]
    engine = rollout.Engine(rollout.RolloutConfig(
        dtype="float32", max_model_len=args.max_new + 16, max_num_seqs=1024,
        kv_cache_memory_bytes=512 << 20, max_new_tokens=args.max_new,
        block_size=args.block_size), model)
    engine.ignore_eos = True  # every sample writes exactly its drawn length
    out = {"steps": args.steps, "warmup": args.warmup, "prompts": share, "group_size": G,
           "max_new": args.max_new, "alpha": args.alpha, "scale": args.scale,
           "round_tokens": args.round_tokens, "oversample": args.oversample,
           "block_size": args.block_size,
           "cpus": os.cpu_count()}

    def summary(gen_s: list, tokens: list) -> dict:
        gen_s, tokens = gen_s[args.warmup:], tokens[args.warmup:]
        return {"gen_s_per_step": round(sum(gen_s) / len(gen_s), 4),
                "tokens_per_s": round(sum(tokens) / sum(gen_s), 1)}

    # off: each step's groups in one call, waiting for the longest
    gen_s, tokens = [], []
    for s in range(args.steps):
        ks = range(s * share, (s + 1) * share)
        prompts = [examples[k % len(examples)]["prompt_ids"] for k in ks for _ in range(G)]
        limits = [n for k in ks for n in lengths(k, G, args)]
        t = time.perf_counter()
        done = engine.generate(prompts, n=1, seed=s * 10_000, max_tokens=limits)
        gen_s.append(time.perf_counter() - t)
        tokens.append(sum(len(x.response_ids) for x in done))
        assert [len(x.response_ids) for x in done] == limits
    out["off"] = summary(gen_s, tokens)

    # on: the groups in flight carried from step to step
    cfg = train_grpo.load_config(None, [
        f"--grpo.group_size={G}", f"--grpo.prompts_per_step={share}",
        f"--rollout.max_new_tokens={args.max_new}", "--rollout.partial.enabled=true",
        f"--rollout.partial.round_tokens={args.round_tokens}",
        f"--rollout.partial.oversample={args.oversample}",
        f"--rollout.partial.max_staleness={args.steps}",  # none dropped: all the work done
        "--rollout.seed_per_step=true", f"--rollout.seed={args.seed}"])  # each round seeded
    runner = episodes.EpisodeRunner(episodes.EnvConfig(), tok, False, "prompt", args.max_new)
    start, started = runner.start, {}

    def start_with_its_length(example):  # the j-th sample of the k-th prompt drawn
        e = start(example)
        j = started[example["k"]] = started.get(example["k"], -1) + 1
        e.limit = lengths(example["k"], G, args)[j]
        return e

    class Zeros:  # no reward: every group kept (no dynamic sampling), for the step to count
        def score(self, texts, examples, failed=()):
            return records.Rewards([0.0] * len(texts), {}, [False] * len(texts))

    class Drawn:  # prompts[k]: the k-th prompt drawn, marked with k
        def __getitem__(self, k):
            return {**examples[k % len(examples)], "k": k}

    runner.start = start_with_its_length
    group = rollout.EngineGroup(1)
    pr = partial.PartialRollout(cfg, group, Drawn(), partial.Streams(cfg, group, engine, runner),
                                Zeros(), grpo.Scoring(cfg.grpo, args.max_new))
    gen_s, tokens, rows = [], [], []
    for s in range(args.steps):
        ro = pr.collect(s + 1)  # the engine holds the weights of s steps trained
        m = pr.metrics(ro.samples, s)
        assert all(len(x.response_ids) == len(x.versions) for x in ro.samples)
        gen_s.append(ro.seconds["gen"])
        tokens.append(m["gen_tokens"].value)
        rows.append(m)
    on = summary(gen_s, tokens)
    rows = rows[args.warmup:]
    stale = sum(r["stale_token_frac"].total for r in rows)
    trained = sum(r["stale_token_frac"].count for r in rows)
    on.update(samples_carried=round(sum(r["partial_carried"].value for r in rows) / len(rows), 1),
              tokens_carried=round(sum(r["partial_carried_tokens"].value for r in rows)
                                   / len(rows), 1),
              stale_token_share=round(stale / trained, 4),
              stale_mean=round(sum(r["stale_mean"].total for r in rows)
                               / sum(r["stale_mean"].count for r in rows), 3),
              stale_max=max(r["stale_max"].value for r in rows),
              dropped=sum(r["partial_dropped"].value for r in rows))
    out["on"] = on
    out["on_over_off"] = round(on["gen_s_per_step"] / out["off"]["gen_s_per_step"], 4)
    print(json.dumps(out), flush=True)
    shut_down(engine)


if __name__ == "__main__":
    main()
