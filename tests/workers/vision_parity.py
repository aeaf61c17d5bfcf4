"""Prompts with images after weight pushes: the engine's logprobs equal the trainer's, a frozen
vision tower is not pushed, and a trained one is (with the engine's cached image features
dropped).

The tiny vision task's Qwen2.5-VL (tiny_task arch qwen2_5_vl), an fp32 engine, the whole model as
the actor (build_actor(images=True)). The probe: six of the task's prompts, each with its image,
followed by a few text tokens; the engine's prompt logprobs of those tokens (it expands and
encodes the image itself) against the actor's logprobs of the same tokens as responses of a
packed row (logprobs.run), within 1e-4 as sync_parity.py's fp32 bound.
Rounds:
  0, 1: the tower frozen: the push is the language model's bytes exactly (where the engine
     keeps what a push leaves out: rollout.Engine.keeps_unsent), and the engine changed;
  2: the tower trains (noise on it): the push is every weight's bytes, the engine's logprobs
     equal the trainer's again. The same images as before: an engine that kept its cached
     features of them (vLLM's encoder cache) would still answer with the old tower.
With MAX_PIXELS (data.max_pixels) the trainer's processor and the engine take that bound
(data.load_processor, rollout.engine_media): the task's 56 x 56 images shrink to one merged
patch on both sides, or the engine's expanded ids differ from the trainer's; the engine's
multimodal settings are checked to be engine_media's (no processor cache, no video).
Prints the gaps (VISION gap lines) and VISION_PARITY_OK.
Usage: torchrun --nproc_per_node 2 tests/workers/vision_parity.py TASK_DIR TP [MAX_PIXELS]
"""

import sys

import torch
from torch.distributed.device_mesh import init_device_mesh

import data
import engines
import fsdp_utils
import logprobs
from modeling import vision
import rollout
import weight_sync
from records import Sample

task, max_pixels = sys.argv[1], int(sys.argv[3]) if len(sys.argv) > 3 else 0
sys.argv[1] = f"{task}/model"
model_dir, tp, rank, world, tok, cfg = engines.start(max_num_seqs=32, max_new_tokens=8)
engine = rollout.Engine(cfg, model_dir, tp_group_index=rank // tp,
                        media=rollout.engine_media(1, max_pixels))
mm = engine.llm.llm_engine.vllm_config.model_config.multimodal_config
assert (mm.mm_processor_cache_gb, mm.get_limit_per_prompt("image"),
        mm.get_limit_per_prompt("video")) == (0, 1, 0), mm
assert (mm.mm_processor_kwargs or {}).get("max_pixels") == (max_pixels or None), mm
torch.manual_seed(0)
actor = fsdp_utils.build_actor(fsdp_utils.ModelConfig(path=model_dir, param_dtype="float32"),
                               init_device_mesh("cpu", (world,)), images=True)
opt = torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad], lr=3e-2)

data_cfg = data.DataConfig(path=f"{task}/train.jsonl", image_key="images", chat_template=True,
                           max_pixels=max_pixels)
processor = data.load_processor(data_cfg, model_dir)
examples = data.load_examples(data_cfg, tok, processor=processor)[:6]
media = [vision.media(processor, ex, "images") for ex in examples]
merged = 1 if max_pixels and max_pixels < 56 * 56 else 4  # merged patches an image
assert all(int(m.vision.grid_thw.prod(-1).sum()) == 4 * merged for m in media), media[0].vision
tails = [tok(t, add_special_tokens=False)["input_ids"] for t in
         ["red", "blue<eos>", "greenred", "r", "bluegreen<eos>", "eee"]]
samples = [Sample(ex["prompt_ids"], tail, [0.0] * len(tail), False, vision=m.vision)
           for ex, m, tail in zip(examples, media, tails)]
tower = vision.frozen_tower(actor)
language_bytes = 4 * (sum(p.numel() for n, p in actor.named_parameters() if n not in tower)
                      + actor.lm_head.weight.numel())  # (tied: sent under both names)
every_bytes = language_bytes + 4 * sum(actor.get_parameter(n).numel() for n in tower)


def engine_logprobs() -> torch.Tensor:
    """The engine's logprob of each probe's tail tokens, at temperature 1: its prompt logprobs
    of the prompt (one placeholder per image, expanded by the engine) followed by the tail."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
    outs = engine.llm.generate([{"prompt_token_ids": m.engine_ids + tail,
                                 "multi_modal_data": {"image": m.images}}
                                for m, tail in zip(media, tails)], params, use_tqdm=False)
    found = []
    for s, o in zip(samples, outs):
        assert list(o.prompt_token_ids) == s.prompt_ids + s.response_ids
        lps = o.prompt_logprobs[len(s.prompt_ids):]
        found += [lp[t].logprob for t, lp in zip(s.response_ids, lps)]
    return torch.tensor(found)


def trainer_logprobs() -> torch.Tensor:
    with torch.no_grad():
        mb = logprobs.micro_batch(samples, tok.pad_token_id, True, actor.config)
        return logprobs.run(actor, mb, logprobs.Passes(1.0, chunk=16))["logp"]


previous = None
for round_ in range(3):
    with torch.no_grad():
        for name, p in actor.named_parameters():  # noise on what trains this round
            if name not in tower or round_ == 2:
                p.to_local().add_(torch.randn_like(p.to_local()) * 0.2)
    if round_ == 2:
        vision.tower(actor).requires_grad_(True)  # the tower trains: it must be pushed
    engine.wake(["weights"])
    sent = weight_sync.load(actor, engine)
    engine.wake(["kv_cache"])
    # (vLLM 0.23 takes no push that leaves weights out: there every push is whole)
    want = language_bytes if round_ < 2 and engine.keeps_unsent() else every_bytes
    assert sent == want, (round_, sent, want)
    got, mine = engine_logprobs(), trainer_logprobs()
    worst = (got - mine).abs().max().item()
    print(f"rank {rank} tp {tp} round {round_}: VISION gap max {worst:.2e}, pushed {sent} bytes "
          f"(language model {language_bytes}, all {every_bytes})", flush=True)
    assert worst < 1e-4, worst
    if previous is not None:
        assert (got - previous).abs().max() > 1e-3, "engine did not change after the push"
    previous = got
print(f"rank {rank}: VISION_PARITY_OK", flush=True)
