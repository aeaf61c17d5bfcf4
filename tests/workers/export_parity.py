"""The Hugging Face export (checkpoint.save_hf) is the trained actor: transformers and the vLLM
engine, each loading the exported directory, give the FSDP actor's logprobs within 1e-4 (fp32).
Usage: torchrun --nproc_per_node 2 tests/workers/export_parity.py MODEL_DIR EXPORT_DIR
"""

import json
import os
import sys

import torch
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM, AutoTokenizer

import checkpoint
import engines
import fsdp_utils
import npu_ops
import rollout
from tests.reference import token_logprobs
from train_grpo import init_distributed

model_dir, out = sys.argv[1], sys.argv[2]
npu_ops.setup_env()
rank, world = init_distributed()
tok = AutoTokenizer.from_pretrained(model_dir)
torch.manual_seed(0)
actor = fsdp_utils.build_actor(fsdp_utils.ModelConfig(path=model_dir, param_dtype="float32"),
                               init_device_mesh("cpu", (world,)))
opt = torch.optim.AdamW(actor.parameters(), lr=3e-2)
for step in range(2):  # real updates on rank-specific targets: the export is not the base model
    target = torch.tensor([tok(f"{rank}+{step}={rank + step}")["input_ids"]])
    (-token_logprobs(actor(input_ids=target).logits[:, :-1], target[:, 1:]).mean()).backward()
    opt.step()
    opt.zero_grad()
checkpoint.save_hf(actor, tok, out, source=model_dir)
for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json"):
    assert os.path.isfile(os.path.join(out, name)), name
with open(os.path.join(model_dir, "generation_config.json")) as f, \
        open(os.path.join(out, "generation_config.json")) as g:
    assert json.load(f)["eos_token_id"] == json.load(g)["eos_token_id"]


def logprobs(model, seqs):
    with torch.no_grad():
        return [token_logprobs(model(input_ids=torch.tensor([s])).logits[:, :-1],
                               torch.tensor([s[1:]]))[0] for s in seqs]


def worst(a, b):
    return max((x - torch.as_tensor(y)).abs().max().item() for x, y in zip(a, b))


probe = [tok(t, add_special_tokens=False)["input_ids"]
         for t in ("3+4=7", "0+0=0", "12+34=46+1", "5=5", "8+1=9=9+9")]
trainer = logprobs(actor, probe)
base = logprobs(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), probe)
hf = logprobs(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32), probe)
assert worst(trainer, base) > 1e-3, "the updates did not change the model: nothing is tested"
assert worst(trainer, hf) < 1e-4, worst(trainer, hf)

cfg = rollout.RolloutConfig(dtype="float32", max_model_len=64, max_num_seqs=8,
                            kv_cache_memory_bytes=16 << 20, max_new_tokens=4)
engine = rollout.Engine(cfg, out, tp_group_index=rank)  # loads the export from disk
gap = worst(trainer, engines.prompt_logprobs(engine, probe))
print(f"rank {rank}: |trainer - transformers| {worst(trainer, hf):.1e}, "
      f"|trainer - vLLM| {gap:.1e}, |trainer - base| {worst(trainer, base):.1e}", flush=True)
assert gap < 1e-4, gap
engine.shutdown()
print("EXPORT_PARITY_OK")
