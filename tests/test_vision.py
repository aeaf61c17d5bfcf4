"""Image prompts in packed rows (vision.py, logprobs.micro_batch), in fp64, on a tiny random
Qwen2.5-VL, a tiny random Qwen3-VL (whose tower also feeds its features into the first decoder
layers) and a tiny random Qwen3.5 (a Gated DeltaNet layer and a full-attention one, hybrid.py):
- vision.positions, and each sample's block of a packed row's positions, equal transformers'
  own get_rope_index of that sample (prompt and response) computed alone;
- each sample of a packed row of image and text prompts gets the logprobs it gets alone;
- the fused pass's logprobs and gradients (vision tower included) equal transformers' forward of
  each sample alone, given only its token ids, images and grids (transformers computes its own
  positions), differentiated by autograd;
- the mutation: a response that resumes at the prompt's length instead of one past its largest
  position (the usual slip: image tokens take fewer positions than tokens) moves the logprobs.

Tolerance: everything in fp64, the same arithmetic in another order (packed or alone, chunked or
whole): 1e-10 relative on logprobs, 1e-8 of the largest gradient (as tests/test_fused_logprobs.py
bounds fp64 sums over a few hundred terms). The mutation moves logprobs by 1e-3 and more."""

import copy
import inspect
import os

import pytest
import torch

import fsdp_utils
import logprobs
from modeling import hybrid, vision
import reference
from records import Sample
from test_hybrid import logp_packed_and_alone  # the same pass, packed and each alone
from test_packing import world_of_one  # noqa: F401 (fixture)

IMAGE, START, END, VOCAB = 120, 122, 123, 128
PATCH, MERGE, TEMPORAL = 14, 2, 2
ARCHS = pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl", "qwen3_5"])


def vl_model(arch: str, attn: str):
    """A tiny random vision-language model in fp64: 2 text layers (head_dim 32), 2 vision
    blocks of patches 14 merged 2 x 2."""
    import transformers

    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [4, 6, 6]})
    tower = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=PATCH,
                 spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL, in_channels=3)
    if arch == "qwen2_5_vl":
        tower.update(out_hidden_size=64, window_size=56, fullatt_block_indexes=[1])
        config, cls = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
    elif arch == "qwen3_vl":
        text.update(head_dim=32, rope_parameters={**text["rope_parameters"],
                                                  "mrope_interleaved": True})
        tower.update(out_hidden_size=64, num_position_embeddings=64,
                     deepstack_visual_indexes=[0])
        config, cls = transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration
    else:  # qwen3_5: a Gated DeltaNet layer and a full-attention one (hybrid.py)
        text.update(head_dim=32, layer_types=["linear_attention", "full_attention"],
                    linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_conv_kernel_dim=4,
                    rope_parameters={**text["rope_parameters"], "mrope_interleaved": True,
                                     "partial_rotary_factor": 1.0})
        tower.update(out_hidden_size=64, num_position_embeddings=64)
        config, cls = transformers.Qwen3_5Config, transformers.Qwen3_5ForConditionalGeneration
    cfg = config(text_config=text, vision_config=tower, image_token_id=IMAGE, video_token_id=121,
                 vision_start_token_id=START, vision_end_token_id=END)
    torch.manual_seed(0)
    model = cls._from_config(cfg, attn_implementation=attn).double()
    vision.patch(model)
    hybrid.patch(model)
    return model


def image(grid, g):
    """An image's patches for `grid` (t, h, w), random."""
    t, h, w = grid
    return torch.randn(t * h * w, 3 * TEMPORAL * PATCH * PATCH, generator=g, dtype=torch.float64)


def prompt_with(grids, g, text=3):
    """Prompt ids: text, then each image between its start and end tokens, then text."""
    ids = torch.randint(2, 100, (text,), generator=g).tolist()
    for t, h, w in grids:
        ids += [START] + [IMAGE] * (t * h * w // MERGE ** 2) + [END]
        ids += torch.randint(2, 100, (2,), generator=g).tolist()
    return ids


def samples_of(layout, seed=0):
    """Samples of (image grids, response length): images of several shapes, two in one prompt,
    and a text-only prompt between them."""
    g, out = torch.Generator().manual_seed(seed), []
    for grids, r in layout:
        ids = prompt_with(grids, g)
        grid = torch.tensor(grids, dtype=torch.long).reshape(-1, 3)
        v = (vision.Vision(torch.cat([image(x, g) for x in grids]), grid,
                           vision.positions(ids, IMAGE, grid, MERGE)) if grids else None)
        out.append(Sample(ids, torch.randint(2, 100, (r,), generator=g).tolist(),
                          [0.0] * r, False, vision=v))
    return out


LAYOUT = [([(1, 4, 6)], 7), ([], 5), ([(1, 4, 4), (1, 6, 4)], 9), ([(1, 2, 2)], 1)]


def rope_index(model, ids, grid):
    """transformers' own multimodal positions of one sequence, whatever its version's
    signature (5.19 takes the token types; older ones find the images by their token id)."""
    ids = torch.tensor([ids])
    kwargs = {"image_grid_thw": grid if len(grid) else None}
    if "mm_token_type_ids" in inspect.signature(model.model.get_rope_index).parameters:
        kwargs["mm_token_type_ids"] = (ids == IMAGE).int()
    return model.model.get_rope_index(ids, **kwargs)[0][:, 0]


def forward_alone(model, s):
    """transformers' forward of one sample given its ids and images only: (L, vocab) logits."""
    ids = torch.tensor([s.prompt_ids + s.response_ids])
    kwargs = {}
    if s.vision is not None:
        kwargs = {"pixel_values": s.vision.pixel_values, "image_grid_thw": s.vision.grid_thw}
        if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
            kwargs["mm_token_type_ids"] = (ids == IMAGE).int()
    return model(input_ids=ids, use_cache=False, **kwargs).logits[0]


@ARCHS
def test_each_samples_positions_in_a_packed_row_are_transformers_own(arch):
    model = vl_model(arch, "sdpa")
    samples = samples_of(LAYOUT)
    mb = logprobs.micro_batch(samples, 0, True, model.config)
    pos = mb.inputs["position_ids"][:, 0]  # (4, R)
    k = 0
    for s in samples:
        n = len(s.prompt_ids) + len(s.response_ids)
        grid = s.vision.grid_thw if s.vision is not None else torch.zeros(0, 3, dtype=torch.long)
        want = (rope_index(model, s.prompt_ids + s.response_ids, grid) if len(grid)
                else torch.arange(n).expand(3, n))
        assert torch.equal(pos[1:, k:k + n], want)
        assert torch.equal(pos[0, k:k + n], torch.arange(n))  # text positions restart
        k += n
    assert k == pos.shape[1]
    assert torch.equal(mb.inputs["image_grid_thw"],
                       torch.cat([s.vision.grid_thw for s in samples if s.vision is not None]))


@ARCHS
def test_a_packed_row_of_image_prompts_gives_each_sample_its_own_logprobs(arch):
    model = vl_model(arch, fsdp_utils.register_attention("sdpa"))
    packed, alone = logp_packed_and_alone(model, samples_of(LAYOUT))
    assert (packed - alone).abs().max() < 1e-10 * alone.abs().max()


@ARCHS
def test_the_fused_pass_is_transformers_forward_of_each_sample(arch):
    """logprobs.run on one packed row (chunks of 5) against transformers' forward of each sample
    alone, log softmax(logits / 0.7), its own positions; logprobs and every gradient."""
    model = vl_model(arch, fsdp_utils.register_attention("sdpa"))
    # the tower's attention is not the language model's (causal, packed) function
    assert vision.tower(model).config._attn_implementation == "sdpa"
    assert model.model.language_model.config._attn_implementation == "packed_sdpa"
    twin = copy.deepcopy(model)
    twin.config._attn_implementation = "sdpa"
    samples = samples_of(LAYOUT, seed=1)
    K = sum(len(s.response_ids) for s in samples)
    w = torch.randn(K, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    out = logprobs.run(model, logprobs.micro_batch(samples, 0, True, model.config),
                       logprobs.Passes(0.7, chunk=5), reference.weighted(w))
    out["loss"].backward()
    want, k = [], 0
    for s in samples:
        z = forward_alone(twin, s)[len(s.prompt_ids) - 1:-1] / 0.7
        lp = z.log_softmax(-1).gather(1, torch.tensor(s.response_ids)[:, None])[:, 0]
        want.append(lp)
        (lp * w[k:k + len(lp)]).sum().backward()
        k += len(lp)
    want = torch.cat(want)
    assert (out["logp"] - want.detach()).abs().max() < 1e-10 * want.abs().max()
    top = max(q.grad.abs().max() for q in twin.parameters() if q.grad is not None)
    grads = 0
    for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        if q.grad is None:  # not on the path to any logit (none expected but unused tokens')
            assert p.grad is None or p.grad.abs().max() == 0, name
            continue
        grads += "visual" in name
        assert (p.grad - q.grad).abs().max() < 1e-8 * top, name
    assert grads > 0  # the tower's weights got theirs


@ARCHS
def test_a_response_resuming_at_the_prompts_length_moves_the_logprobs(arch, monkeypatch):
    model = vl_model(arch, fsdp_utils.register_attention("sdpa"))
    samples = samples_of(LAYOUT)
    with torch.no_grad():
        want = torch.cat([forward_alone(model, s)[len(s.prompt_ids) - 1:-1].div(0.7)
                          .log_softmax(-1).gather(1, torch.tensor(s.response_ids)[:, None])[:, 0]
                          for s in samples])

    def slip(s):  # the response at prompt length + j, not one past the image's positions
        n, p = len(s.prompt_ids) + len(s.response_ids), len(s.prompt_ids)
        pos = torch.arange(n).expand(3, n).clone()
        if s.vision is not None:
            pos[:, :p] = s.vision.positions
        return pos

    packed, _ = logp_packed_and_alone(model, samples)
    assert (packed - want).abs().max() < 1e-10 * want.abs().max()
    monkeypatch.setattr(vision, "sample_positions", slip)
    moved, _ = logp_packed_and_alone(model, samples)
    assert (moved - want).abs().max() > 1e-3


def test_a_prompt_whose_placeholders_do_not_fit_its_grid_is_refused():
    grid = torch.tensor([[1, 4, 4]])
    with pytest.raises(ValueError, match="4 placeholder tokens expected"):
        vision.positions([5, IMAGE, IMAGE, 6], IMAGE, grid, MERGE)
    with pytest.raises(ValueError, match="2 images given, 1 found"):
        vision.positions([5] + [IMAGE] * 4, IMAGE, torch.tensor([[1, 4, 4], [1, 2, 2]]), MERGE)


@ARCHS
def test_without_the_text_row_a_packed_row_attends_across_its_samples(arch, monkeypatch):
    """The mutation: the three multimodal rows alone (transformers' unpacked form). transformers
    then hands the attention no position ids, and the row is one sequence."""
    model = vl_model(arch, fsdp_utils.register_attention("sdpa"))
    real = vision.row_inputs

    def three(samples, text):
        out = real(samples, text)
        return {**out, "position_ids": out["position_ids"][1:]}

    monkeypatch.setattr(vision, "row_inputs", three)
    samples = samples_of(LAYOUT)
    packed, alone = logp_packed_and_alone(model, samples)
    first = len(samples[0].response_ids)
    assert (packed[:first] - alone[:first]).abs().max() < 1e-10 * alone.abs().max()
    assert (packed[first:] - alone[first:]).abs().max() > 1e-3


@pytest.mark.usefixtures("world_of_one")
def test_the_actor_with_images_is_the_whole_model_its_tower_frozen(tmp_path):
    """build_actor(images=True) on a vision-language checkpoint: the whole model under FSDP2
    (one rank), whose logprobs on a packed row of image prompts are transformers' own forward
    of each sample (fp32: the same sums in another order, a few ulp of fp32 over the 64-wide
    layers: 1e-5 relative); the tower frozen (no gradient, not counted as trained), the language
    model trained."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForImageTextToText

    vl_model("qwen2_5_vl", "sdpa").float().save_pretrained(tmp_path)
    cfg = fsdp_utils.ModelConfig(path=str(tmp_path), param_dtype="float32")
    actor = fsdp_utils.build_actor(cfg, init_device_mesh("cpu", (1,)), images=True)
    hf = AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.float32)
    samples = samples_of(LAYOUT, seed=3)
    for s in samples:
        if s.vision is not None:
            s.vision.pixel_values = s.vision.pixel_values.float()
    K = sum(len(s.response_ids) for s in samples)
    out = logprobs.run(actor, logprobs.micro_batch(samples, 0, True, actor.config),
                       logprobs.Passes(0.7, chunk=5), reference.weighted(torch.ones(K)))
    out["loss"].backward()
    with torch.no_grad():
        want = torch.cat([forward_alone(hf, s)[len(s.prompt_ids) - 1:-1].div(0.7)
                          .log_softmax(-1).gather(1, torch.tensor(s.response_ids)[:, None])[:, 0]
                          for s in samples])
    assert (out["logp"] - want).abs().max() < 1e-5 * want.abs().max()
    tower = {n for n, _ in actor.named_parameters() if n.startswith("model.visual.")}
    assert tower and fsdp_utils.trainable(actor) == sum(
        p.numel() for n, p in actor.named_parameters() if n not in tower)
    for name, p in actor.named_parameters():
        assert (p.grad is None) == (name in tower), name


def test_a_prompt_with_images_through_the_checkpoints_processor(tiny_vl_hybrid, tmp_path):
    """vision.encode with a Qwen3.5 checkpoint's processor (patches of 16, merged 2 x 2): each
    image's placeholder expanded to its merged patches, the positions transformers' own, and
    the same image given as a PIL image, a path, bytes or datasets' {"bytes", "path"} encoded
    alike."""
    from PIL import Image
    from transformers import AutoProcessor, Qwen3_5ForConditionalGeneration

    if not os.path.exists(os.path.join(tiny_vl_hybrid, "processor_config.json")):
        pytest.skip("the processor needs torchvision (not in the npu-torch lane)")
    processor = AutoProcessor.from_pretrained(tiny_vl_hybrid)
    model = Qwen3_5ForConditionalGeneration.from_pretrained(tiny_vl_hybrid)
    g = torch.Generator().manual_seed(0)
    pics = [Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8)
                            .numpy()) for h, w in ((64, 96), (64, 64))]
    slot = "<|vision_start|><|image_pad|><|vision_end|>"
    text = f"a+b= {slot} and {slot} ="
    ids, v = vision.encode(processor, text, pics)
    image = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert v.grid_thw.tolist() == [[1, 4, 6], [1, 4, 4]]
    assert ids.count(image) == 6 + 4 and v.pixel_values.shape[0] == 24 + 16
    kwargs = {"image_grid_thw": v.grid_thw}
    if "mm_token_type_ids" in inspect.signature(model.model.get_rope_index).parameters:
        kwargs["mm_token_type_ids"] = (torch.tensor([ids]) == image).int()
    want = model.model.get_rope_index(torch.tensor([ids]), **kwargs)[0][:, 0]
    assert torch.equal(v.positions, want)
    path = str(tmp_path / "p.png")
    pics[0].save(path)
    raw = open(path, "rb").read()
    one = vision.encode(processor, f"x {slot}", [pics[0]])
    for same in (path, raw, {"bytes": raw, "path": None}, {"bytes": None, "path": path}):
        ids2, v2 = vision.encode(processor, f"x {slot}", [same])
        assert ids2 == one[0] and torch.equal(v2.pixel_values, one[1].pixel_values)
    with pytest.raises(ValueError, match="not int"):
        vision.load_image(3)


def test_a_placeholder_token_in_a_response_is_text_as_in_the_engine():
    """The model may write an image or video placeholder token; the engine embeds it as text
    (only the prompt's placeholders take an image's features). The packed pass (vision.patch's
    hooks) against a forward built by hand the same way: the ids' own embeddings, the image
    features scattered into the prompt's placeholders only, the language model on that at the
    sample's positions; each sample alone."""
    model = vl_model("qwen2_5_vl", fsdp_utils.register_attention("sdpa"))
    samples = samples_of(LAYOUT, seed=4)
    samples[0].response_ids[2], samples[2].response_ids[0] = IMAGE, 121  # image, video token
    with torch.no_grad():
        packed = logprobs.run(model, logprobs.micro_batch(samples, 0, True, model.config),
                              logprobs.Passes(0.7, chunk=16))["logp"]
        want, inner = [], model.model
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            h = inner.get_input_embeddings()(ids)
            if s.vision is not None:
                feats = inner.visual(s.vision.pixel_values, grid_thw=s.vision.grid_thw)
                feats = getattr(feats, "pooler_output", feats)
                slots = torch.zeros_like(ids, dtype=torch.bool)
                slots[0, :len(s.prompt_ids)] = ids[0, :len(s.prompt_ids)] == IMAGE
                h = h.masked_scatter(slots[..., None], torch.cat(list(feats)) if isinstance(
                    feats, (list, tuple)) else feats)
            pos = vision.sample_positions(s)[:, None]
            out = inner.language_model(inputs_embeds=h, position_ids=pos).last_hidden_state
            z = model.lm_head(out)[0, len(s.prompt_ids) - 1:-1] / 0.7
            want.append(z.log_softmax(-1).gather(1, torch.tensor(s.response_ids)[:, None])[:, 0])
    want = torch.cat(want)
    assert (packed - want).abs().max() < 1e-10 * want.abs().max()


def test_the_data_of_the_tiny_vision_task_through_its_processor(tiny_vision_task):
    """data.load_examples with data.image_key: each example's ids with its image's placeholder
    expanded to its 2 x 2 merged patches, the engine's ids with one placeholder, the text
    between them; vision.media then gives the same ids' patches (16 of 14 x 14 pixels x 3
    channels x 2 frames), grid and positions."""
    from transformers import AutoProcessor, AutoTokenizer

    import data

    root = tiny_vision_task
    processor = AutoProcessor.from_pretrained(f"{root}/model")
    tok = AutoTokenizer.from_pretrained(f"{root}/model")
    cfg = data.DataConfig(path=f"{root}/train.jsonl", image_key="images", chat_template=True)
    examples = data.load_examples(cfg, tok, processor=processor)
    image = tok.convert_tokens_to_ids("<|image_pad|>")
    ex = examples[0]
    assert ex["prompt_ids"].count(image) == 4 and ex["engine_prompt_ids"].count(image) == 1
    assert len(ex["prompt_ids"]) == len(ex["engine_prompt_ids"]) + 3
    assert ex["prompt_text"] == ("<|user|><|vision_start|><|image_pad|><|vision_end|>colour?"
                                 "<eos><|assistant|>")
    m = vision.media(processor, ex, "images")
    assert m.engine_ids == ex["engine_prompt_ids"] and len(m.images) == 1
    assert m.vision.grid_thw.tolist() == [[1, 4, 4]]
    assert m.vision.pixel_values.shape == (16, 3 * 2 * 14 * 14)
    assert torch.equal(m.vision.positions, vision.positions(ex["prompt_ids"], image,
                                                           m.vision.grid_thw, 2))
    ex["prompt_text"] = ex["prompt_text"].replace("colour", "color")
    with pytest.raises(RuntimeError, match="differently from when the data loaded"):
        vision.media(processor, ex, "images")


def test_what_images_cannot_do_yet_is_refused_before_load(tiny_vision_task, tiny_task_dir):
    import config
    from train_grpo import load_config, resolve

    base = ["--data.tiny_task_dir=", f"--model.path={tiny_vision_task}/model",
            f"--data.path={tiny_vision_task}/train.jsonl", "--data.image_key=images",
            "--data.chat_template=true", "--reward.funcs=[tiny_colour]"]
    config.check_model(resolve(load_config("configs/vlm_cpu.yaml", base)))
    for extra, match in ((["--data.chat_template=false"], "data.chat_template=true"),
                         ([f"--model.path={tiny_task_dir}/model"], "not a vision-language"),
                         (["--model.sp_size=2"], "with model.sp_size"),
                         (["--model.lora.rank=8"], "model.lora.rank"),
                         (["--env.name=calculator"], "with env.name"),
                         ([f"--model.path={tiny_task_dir}/model", "--data.image_key=",
                           "--data.max_pixels=1568"],
                          r"^config: data.max_pixels=1568 bounds the images of data.image_key, "
                          r"which is empty. Fix: data.max_pixels=0")):
        with pytest.raises(config.BadInput, match=match):
            config.check_model(resolve(load_config("configs/vlm_cpu.yaml", base + extra)))
    config.check_model(resolve(load_config("configs/vlm_cpu.yaml",
                                           base + ["--data.max_pixels=1568"])))


@pytest.mark.usefixtures("world_of_one")
def test_the_export_of_the_whole_model_loads_with_its_processor(tiny_vision_task, tmp_path):
    """checkpoint.save_hf of an actor built with images: transformers loads the export as the
    vision-language model it was, changed weights and all, and its processor from the same
    directory (the files vLLM builds its image processor from)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    import checkpoint

    path = f"{tiny_vision_task}/model"
    actor = fsdp_utils.build_actor(fsdp_utils.ModelConfig(path=path, param_dtype="float32"),
                                   init_device_mesh("cpu", (1,)), images=True)
    with torch.no_grad():
        for p in actor.parameters():
            p.to_local().add_(0.01)
    checkpoint.save_hf(actor, AutoTokenizer.from_pretrained(path), str(tmp_path / "x"),
                       source=path)
    out = AutoModelForImageTextToText.from_pretrained(tmp_path / "x", dtype=torch.float32)
    mine = {n: p.full_tensor() for n, p in actor.named_parameters()}
    for name, value in out.named_parameters():
        assert torch.equal(value, mine[name]), name
    assert AutoProcessor.from_pretrained(tmp_path / "x").image_processor.merge_size == 2


def test_images_go_where_the_text_marks_them_else_first():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "<image>Find x."},
            {"role": "user", "content": "later"}]
    got = vision.with_images(msgs, 1)
    assert got[1]["content"] == [{"type": "image"}, {"type": "text", "text": "Find x."}]
    assert got[0] == msgs[0] and got[2] == msgs[2] and msgs[1]["content"] == "<image>Find x."
    two = vision.with_images([{"role": "user", "content": "a <image> b <image>"}], 2)[0]["content"]
    assert two == [{"type": "text", "text": "a "}, {"type": "image"}, {"type": "text", "text": " b "},
                   {"type": "image"}]
    first = vision.with_images([{"role": "user", "content": "q <image>"}], 2)[0]["content"]
    assert first == [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "q "}]


def test_the_geo3k_preset_reads_a_copy_of_geometry3k(tiny_vision_task, tmp_path):
    """data.preset=geo3k on an offline copy in Geometry3K's columns (images, problem with its
    "<image>" marker, a bare answer): the image where the marker was, the instruction after,
    the answer as given; the `math` reward scores a boxed answer against it."""
    import datasets
    from PIL import Image
    from transformers import AutoProcessor, AutoTokenizer

    import data
    import rewards

    rows = {"images": [[Image.new("RGB", (56, 56), (200, 10, 10))]] * 2,
            "problem": ["<image>Find x.", "<image>Find y."], "answer": ["3", "2\\sqrt{3}"]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}).save_to_disk(tmp_path / "g")
    cfg = data.DataConfig(preset="geo3k", path=str(tmp_path / "g"), eval_path=str(tmp_path / "g"))
    path = f"{tiny_vision_task}/model"
    examples = data.load_examples(cfg, AutoTokenizer.from_pretrained(path),
                                  processor=AutoProcessor.from_pretrained(path))
    assert [e["answer"] for e in examples] == ["3", "2\\sqrt{3}"]
    assert examples[0]["prompt_text"].startswith(
        "<|user|><|vision_start|><|image_pad|><|vision_end|>Find x. Please reason step by step")
    assert rewards.math("so \\boxed{2\\sqrt{3}}", examples[1]) == 1.0


def test_the_qwen2_5_vl_7b_configs_arithmetic(tmp_path, monkeypatch):
    """configs/qwen2.5-vl-7b-geo3k-npu8.yaml's numbers, on Qwen2.5-VL-7B built on the meta
    device from its published shape: 8.29B parameters, 0.68B of them the tower's, 11.8 GB a rank
    in host memory with the offload at 8 ranks and the tower frozen (offload.host_bytes_per_rank,
    what the run checks); the config passes the model-free checks on an NPU at 8 ranks."""
    import transformers

    import npu_ops
    import offload
    from config import validate
    from train_grpo import load_config

    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                         num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                         max_position_embeddings=128000, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                          "mrope_section": [16, 24, 24]}),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                           out_hidden_size=3584, patch_size=14, spatial_merge_size=2,
                           temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31], in_channels=3),
        image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
        vision_end_token_id=151653, tie_word_embeddings=False)
    cfg.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(cfg)
    total = sum(p.numel() for p in model.parameters())
    tower = sum(p.numel() for p in vision.tower(model).parameters())
    assert (round(total / 1e9, 2), round(tower / 1e9, 2)) == (8.29, 0.68)
    per_rank = offload.host_bytes_per_rank(str(tmp_path), 8, True, tower="frozen")
    assert per_rank == -(-(total - tower) // 8) * 12 + -(-tower // 8) * 4
    assert round(per_rank / 1e9, 1) == 11.8 and round(8 * per_rank / 1e9) == 94
    monkeypatch.setattr(npu_ops, "device_type", lambda: "npu")
    run = load_config("configs/qwen2.5-vl-7b-geo3k-npu8.yaml", [f"--model.path={tmp_path}"])
    validate(run, world_size=8)
    assert run.data.preset == "geo3k" and not run.model.train_vision
    merged = (cfg.vision_config.patch_size * cfg.vision_config.spatial_merge_size) ** 2
    assert run.data.max_prompt_len - run.data.max_pixels // merged == 384  # left for the text


def test_the_engine_is_told_the_most_images_a_prompt_has():
    """data.most_images: the engine's image limit (rollout.engine_media), the largest count of
    any prompt whatever form its cell takes, and 1 for rows with none."""
    import data
    import rollout

    cfg = data.DataConfig(image_key="images", chat_template=True)
    rows = [{"images": None}, {"images": "a.png"}, {"images": ["a.png", "b.png", "c.png"]},
            {"images": ("a.png", "b.png")}]
    assert data.most_images(cfg, rows) == 3 and data.most_images(cfg, rows[:2]) == 1
    assert data.most_images(cfg, []) == 1
    # data.max_pixels=0 leaves the engine's processor at the checkpoint's bound, as the trainer's
    assert "mm_processor_kwargs" not in rollout.engine_media(1, 0)
    assert rollout.engine_media(3, 1568)["limit_mm_per_prompt"] == {"image": 3, "video": 0}
