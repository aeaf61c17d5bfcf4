"""The agents' endpoint against the engine alone, on the tiny chat task. Prints one JSON line.

    python bench/agents.py                     # 512 episodes of one call; about a minute
    python bench/agents.py --episodes 64       # a quick look

The same work four ways, each response --tokens long (EOS ignored, as bench/step.py does):
`floor`, the episodes' prompts in one engine.generate; then agents.AgentRunner with an agent
that makes its one call through the `openai` client: `shared`, one httpx client per event loop
passed to each episode's AsyncOpenAI (the pooled form); `fresh`, an AsyncOpenAI opened per
episode; `ready`, the client handed to the agent (envs.with_client, as
examples/calculator_agent.py's `solve` takes it). Reported: each one's seconds and its ratio
to the floor. The agents' worker starts before the timed runs (a warm-up rollout of a few
episodes).
"""

import argparse
import asyncio
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_HTTP = {}


def _request(example: dict) -> dict:
    return {"model": "policy", "messages": [{"role": "user", "content": example["prompt"]}],
            "max_tokens": int(os.environ.get("BENCH_AGENT_TOKENS", "8"))}


async def shared(base_url: str, example: dict) -> float:
    import httpx
    from openai import AsyncOpenAI

    loop = asyncio.get_running_loop()
    if loop not in _HTTP:
        _HTTP.clear()
        _HTTP[loop] = httpx.AsyncClient(timeout=120)
    client = AsyncOpenAI(base_url=base_url, api_key="unused", http_client=_HTTP[loop],
                         max_retries=0)
    await client.chat.completions.create(**_request(example))
    return 1.0


async def fresh(base_url: str, example: dict) -> float:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        await client.chat.completions.create(**_request(example))
    return 1.0


async def ready(client, example: dict) -> float:
    await client.chat.completions.create(**_request(example))
    return 1.0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--episodes", type=int, default=512)
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--task-dir", default=os.path.join(ROOT, "runs", "tiny_agent_task"))
    args = p.parse_args()
    os.environ["BENCH_AGENT_TOKENS"] = str(args.tokens)  # the agents' worker inherits it
    sys.path.insert(0, ROOT)
    import npu_ops  # noqa: F401  (first: the platform environment before torch loads)
    from collect import agents
    import data
    import episodes
    import rollout
    from tasks import tiny_task
    import train_grpo
    from common import shut_down
    from transformers import AutoTokenizer

    train_grpo.init_distributed()  # a world of one, for the engine (or torchrun's)
    task = tiny_task.ensure_tiny_task(args.task_dir, chat=True)
    tok = AutoTokenizer.from_pretrained(os.path.join(task, "model"))
    examples = data.load_examples(data.DataConfig(path=os.path.join(task, "train.jsonl"),
                                                  chat_template=True), tok)
    batch = [examples[i % len(examples)] for i in range(args.episodes)]
    engine = rollout.Engine(rollout.RolloutConfig(
        dtype="float32", max_model_len=64, kv_cache_memory_bytes=64 << 20,
        max_new_tokens=args.tokens, max_num_seqs=256), os.path.join(task, "model"))
    engine.ignore_eos = True  # every response --tokens long, in every mode
    out = {"episodes": args.episodes, "tokens": args.tokens, "concurrency": args.concurrency}
    t = time.perf_counter()
    floor = engine.generate([ex["prompt_ids"] for ex in batch], n=1)
    out["floor_s"] = round(time.perf_counter() - t, 3)
    assert {len(s.response_ids) for s in floor} == {args.tokens}
    me = os.path.abspath(__file__)
    for mode in ("shared", "fresh", "ready"):
        cfg = episodes.EnvConfig(kind="agent", name=f"{me}:{mode}", max_turns=1,
                                 max_tokens=args.tokens, timeout_s=120.0,
                                 concurrency=args.concurrency)
        runner = agents.AgentRunner(cfg, tok, args.tokens, 64, "policy")
        runner.run(engine, batch[:4], 1)  # the worker up, the agent's imports done
        t = time.perf_counter()
        gen = runner.run(engine, batch, 1)
        took = time.perf_counter() - t
        runner.close()
        assert not any(gen.failed) and {len(s.response_ids) for s in gen.samples} == {args.tokens}
        out[f"{mode}_s"] = round(took, 3)
        out[f"{mode}_vs_floor"] = round(out[f"{mode}_s"] / out["floor_s"], 2)
    shut_down(engine)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
