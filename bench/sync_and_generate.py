"""Time the colocated phases on a random-init Qwen2 of a chosen size: weight sync and generation.

    torchrun --nproc_per_node 2 bench/sync_and_generate.py --hidden 1024 --layers 8
    torchrun --nproc_per_node 8 bench/sync_and_generate.py --hidden 3584 --layers 28 --dtype bfloat16

Prints one line per repeat and a summary: seconds and GB/s of `weight_sync.push`, and generation
tokens/s for `--prompts` x `--group` samples of `--new-tokens` tokens. Everything runs through the
trainer's own code (fsdp_utils, rollout, weight_sync), so the numbers are the trainer's.
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import fsdp_utils  # noqa: E402
import npu_ops  # noqa: E402
import rollout  # noqa: E402
import tiny_task  # noqa: E402
import weight_sync  # noqa: E402
from train_grpo import init_distributed  # noqa: E402


def random_qwen2(hidden: int, layers: int, rank: int) -> str:
    """A random-init Qwen2 of that size with the tiny task's tokenizer, written once by rank 0
    under the temp dir and reused; returns its directory on every rank."""
    root = os.path.join(tempfile.gettempdir(), f"bench_qwen2_{hidden}x{layers}")
    if rank == 0 and not os.path.exists(os.path.join(root, "READY")):
        tiny = tiny_task.ensure_tiny_task(root + "_tok")  # for its tokenizer
        from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

        tok = AutoTokenizer.from_pretrained(os.path.join(tiny, "model"))
        heads = hidden // 128
        cfg = Qwen2Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 3,
                          num_hidden_layers=layers, num_attention_heads=heads,
                          num_key_value_heads=max(1, heads // 4), head_dim=128,
                          max_position_embeddings=4096, tie_word_embeddings=False,
                          eos_token_id=tok.eos_token_id)
        Qwen2ForCausalLM(cfg).save_pretrained(os.path.join(root, "model"))
        tok.save_pretrained(os.path.join(root, "model"))
        open(os.path.join(root, "READY"), "w").close()
    dist.barrier()
    return os.path.join(root, "model")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    npu_ops.setup_env()
    rank, world = init_distributed()
    path = random_qwen2(args.hidden, args.layers, rank)

    engine_cfg = rollout.RolloutConfig(tp_size=args.tp, dtype=args.dtype, max_model_len=512,
                                       kv_cache_memory_bytes=1 << 30,
                                       max_new_tokens=args.new_tokens, temperature=1.0)
    engine = rollout.Engine(engine_cfg, path, tp_group_index=rank // args.tp)
    engine.sleep()
    actor = fsdp_utils.build_actor(fsdp_utils.ModelConfig(path=path, param_dtype=args.dtype),
                                   init_device_mesh(npu_ops.device_type(), (world,)))
    n_params = sum(p.numel() for p in actor.parameters())
    prompts = [[5 + (i % 9), 3, 6 + (i % 7), 4] for i in range(args.prompts)]
    syncs, gens = [], []
    for r in range(args.repeats):
        sync = weight_sync.push(actor, engine)
        t = time.perf_counter()
        samples = engine.generate(prompts, n=args.group)
        gen = time.perf_counter() - t
        engine.sleep()
        tokens = sum(len(s.response_ids) for s in samples)
        syncs.append(sync)
        gens.append((gen, tokens))
        if rank == 0:
            print(f"repeat {r}: sync {sync['seconds']:.3f}s ({sync['bytes'] / 2**30:.2f} GiB, "
                  f"{sync['bytes'] / 2**30 / sync['seconds']:.2f} GiB/s) | generate {gen:.3f}s "
                  f"{tokens} tokens {tokens / gen:.0f} tok/s", flush=True)
    if rank == 0:
        best_sync = min(s["seconds"] for s in syncs[1:] or syncs)
        best_gen = min(g / max(t, 1) for g, t in gens[1:] or gens)
        print(f"summary: {n_params / 1e6:.0f}M params, world {world}, tp {args.tp}, "
              f"{npu_ops.device_type()} {args.dtype} | sync best {best_sync:.3f}s | generate "
              f"{1 / best_gen:.0f} tok/s per engine (after the first repeat)")
    engine.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
