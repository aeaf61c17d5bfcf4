"""The start every engine worker shares: its arguments (MODEL_DIR TP), the platform's
environment, the process group, the tokenizer, and an fp32 engine config for the tiny model."""

import sys

import npu_ops
import rollout
from train_grpo import init_distributed


def start(**engine) -> tuple:
    """(model_dir, tp, rank, world, tokenizer, rollout.RolloutConfig) of this worker; `engine`:
    RolloutConfig fields beyond tp_size, fp32, 64 positions and a 16 MiB KV cache."""
    from transformers import AutoTokenizer

    model_dir, tp = sys.argv[1], int(sys.argv[2])
    npu_ops.setup_env()
    rank, world = init_distributed()
    cfg = rollout.RolloutConfig(tp_size=tp, dtype="float32", max_model_len=64,
                                kv_cache_memory_bytes=16 << 20, **engine)
    return model_dir, tp, rank, world, AutoTokenizer.from_pretrained(model_dir), cfg
