"""Images in prompts: what a sample keeps of them, and their places in a packed row.

A vision-language model of the Qwen-VL kind (Qwen2.5-VL, Qwen3-VL, Qwen3.5) reads an image as a
run of placeholder tokens (`image_token_id`) in the prompt, one per merged patch, whose embeddings
its vision tower writes, and places every token with three rotary positions (multimodal RoPE:
time, height, width). A text token has the same position on all three; an image's tokens sit on
its grid of merged patches (time 0 for an image, its row, its column), all offset by the position
where the image starts; the text after an image resumes one past the largest position in it.

A sample with images carries a `Vision` record (records.Sample.vision): the processor's patches
(`pixel_values`), each image's grid of patches (`grid_thw`) and its prompt's three rows of
positions (`positions`, from `positions`). The response is text: its tokens continue the prompt's
positions one by one. A packed row (logprobs.micro_batch) gives the model four rows of positions,
the transformers convention for packed multimodal rows: the text positions, restarting at 0 with
each sample (which keep attention inside a sample), then the three multimodal rows, each sample's
own, also from 0. A text-only sample has its text positions on all four rows. Without the first
row transformers passes no position ids to the attention, and a packed row would attend across
its samples.

Only images: no video (whose time positions depend on its frame rate).
"""

from dataclasses import dataclass

import torch

# what logprobs.micro_batch gives a packed row's text layers and the vision tower must not see:
# the tower has boundaries of its own (one image each), which the first two would replace, and
# attends within each image, not by a shared row's layout (logprobs.shared_row)
ROW_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "packed_ends",
            "shared_segments")


@dataclass
class Vision:
    pixel_values: torch.Tensor  # (patches, channels x temporal patch x patch x patch), as the
    #   model's processor gives them, all of the sample's images in prompt order
    grid_thw: torch.Tensor  # (images, 3) long: each image's patches in time, height and width
    positions: torch.Tensor  # (3, prompt tokens) long: the prompt's multimodal positions


def is_vision_language(config) -> bool:
    """Whether a (Hugging Face) model config is a vision-language model's."""
    return getattr(config, "vision_config", None) is not None


def positions(ids: list[int], image_token: int, grid_thw, merge: int) -> torch.Tensor:
    """(3, len(ids)) long: the multimodal rotary positions of a prompt `ids` whose images
    (grid_thw: (images, 3), in order) each fill t x (h / merge) x (w / merge) consecutive
    `image_token`s; merge: the vision config's spatial_merge_size."""
    out, start, i, image = [], 0, 0, 0
    while i < len(ids):
        if ids[i] != image_token:
            out.append(torch.full((3, 1), start, dtype=torch.long))
            start, i = start + 1, i + 1
            continue
        t, h, w = (int(x) for x in grid_thw[image])
        h, w = h // merge, w // merge
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w),
                                          indexing="ij")).reshape(3, -1)
        if ids[i:i + grid.shape[1]] != [image_token] * grid.shape[1]:
            raise ValueError(f"image {image}: {grid.shape[1]} placeholder tokens expected at "
                             f"{i} for its grid {t}x{h}x{w} (merged), found fewer")
        out.append(grid * torch.tensor([0, 1, 1])[:, None] + start)  # an image's time: 0
        start, i, image = int(out[-1].max()) + 1, i + grid.shape[1], image + 1
    if image != len(grid_thw):
        raise ValueError(f"{len(grid_thw)} images given, {image} found in the prompt")
    return torch.cat(out, 1) if out else torch.zeros(3, 0, dtype=torch.long)


def sample_positions(sample) -> torch.Tensor:
    """(3, prompt + response) long: a sample's multimodal positions, its response continuing its
    prompt's; a text-only sample's text positions on all three rows."""
    n, v = len(sample.prompt_ids) + len(sample.response_ids), getattr(sample, "vision", None)
    if v is None:
        return torch.arange(n).expand(3, n)
    p = v.positions.shape[1]
    after = int(v.positions.max()) + 1 if p else 0
    return torch.cat([v.positions, (after + torch.arange(n - p)).expand(3, n - p)], 1)


def row_inputs(samples: list, text_positions: torch.Tensor, source=None,
               holders: list | None = None) -> dict:
    """A packed row's model inputs beyond its token ids, for a vision-language model:
    position_ids (4, 1, R): the row's text positions (text_positions, (R,)) above the samples'
    multimodal ones end to end; and where any sample has images, their pixel_values and
    image_grid_thw in row order. A row whose groups hold their prompt once (logprobs.shared_row)
    gives `source`, (R,) where each of its positions sits in the samples end to end, and
    `holders`, the samples whose prompts (and images) it holds, in row order."""
    mrope = torch.cat([sample_positions(s) for s in samples], 1)
    prompt = torch.cat([torch.arange(len(s.prompt_ids) + len(s.response_ids))
                        < len(s.prompt_ids) for s in samples])
    if source is not None:
        mrope, prompt = mrope[:, source], prompt[source]
    positions = torch.cat([text_positions[None], mrope])[:, None]
    return _with_images(samples if holders is None else holders, {"position_ids": positions},
                        lambda: prompt[None])


def batch_inputs(samples: list, width: int) -> dict:
    """A padded batch's (B, width) inputs beyond its token ids: position_ids (3, B, width), each
    sample's multimodal positions (the padding after it continues them), and the images."""
    rows = []
    for s in samples:
        pos = sample_positions(s)
        pad = width - pos.shape[1]
        rows.append(torch.cat([pos, pos[:, -1:] + 1 + torch.arange(pad).expand(3, pad)], 1))
    return _with_images(samples, {"position_ids": torch.stack(rows, 1)},
                        lambda: torch.arange(width)[None] < torch.tensor(
                            [len(s.prompt_ids) for s in samples])[:, None])


def _with_images(samples: list, out: dict, prompt_mask) -> dict:
    """`out` with the samples' images where any has some: their patches and grids in order, and
    prompt_mask() (which positions are prompts': patch's hook reads it)."""
    seen = images(samples)
    if seen:
        out.update(pixel_values=torch.cat([v.pixel_values for v in seen]),
                   image_grid_thw=torch.cat([v.grid_thw for v in seen]), prompt_mask=prompt_mask())
    return out


def images(samples: list) -> list:
    """The Vision records of the samples that have images, in order."""
    return [v for s in samples if (v := getattr(s, "vision", None)) is not None
            and len(v.grid_thw)]


def tower(model) -> torch.nn.Module:
    """The vision tower of a transformers vision-language model (`model.visual`, 5.x)."""
    return model.get_submodule("model.visual")


def frozen_tower(model) -> set[str]:
    """The names of a whole vision-language model's tower parameters where none of them trains
    (what a push may leave out); empty where the model has no tower or it trains."""
    try:
        params = dict(tower(model).named_parameters(prefix="model.visual"))
    except AttributeError:
        return set()
    return set() if any(p.requires_grad for p in params.values()) else set(params)


def patch(model) -> None:
    """Forward hooks on a vision-language model, and its tower's attention:
    - Keep the packed row's boundaries (ROW_KEYS) away from the vision tower: transformers'
      vision-language forward hands its keyword arguments on to the tower, whose attention
      takes its own boundaries (one per image) under the same names, so flash attention would
      be given both and sdpa-style attention the text row's.
    - Image placeholders only in prompts (`prompt_mask`, from row_inputs and batch_inputs): a
      response may hold an image or video placeholder token (the model samples any token),
      which the engine embeds as text. transformers would count it as an image's and fail
      ("Image features and image tokens do not match"). The hook hands the model ids with such
      tokens replaced (by id 0), and a hook on the input embedding puts their own embeddings
      back (no host read: a torch.where over the row)."""
    embedding = model.get_input_embeddings()

    def drop(module, args, kwargs):
        return args, {k: v for k, v in kwargs.items() if k not in ROW_KEYS}

    def prompts_only(module, args, kwargs):
        mask = kwargs.pop("prompt_mask", None)
        if mask is None or kwargs.get("input_ids") is None:
            return args, kwargs
        ids, config = kwargs["input_ids"], module.config
        stray = ~mask & ((ids == config.image_token_id) | (ids == config.video_token_id))
        embedding.stray = (stray, ids)
        return args, {**kwargs, "input_ids": ids.masked_fill(stray, 0)}

    def put_back(module, args, out):
        saved, module.stray = getattr(module, "stray", None), None
        return out if saved is None else torch.where(saved[0][..., None], module(saved[1]), out)

    tower(model).register_forward_pre_hook(drop, with_kwargs=True)
    model.get_submodule("model").register_forward_pre_hook(prompts_only, with_kwargs=True)
    embedding.register_forward_hook(put_back)
    # the tower's attention is bidirectional, one image at a time: transformers' sdpa, not the
    #   language model's functions (fsdp_utils.packed_sdpa, npu_ops.fusion_attention: causal)
    tower(model).config._attn_implementation = "sdpa"


def load_image(x):
    """An image as a dataset gives it: a PIL image, a path, raw bytes, or `datasets`' undecoded
    {"bytes": ..., "path": ...}; returned as an RGB PIL image."""
    import io

    from PIL import Image

    if isinstance(x, dict):
        x = x.get("bytes") or x.get("path")
    if isinstance(x, (bytes, bytearray)):
        x = Image.open(io.BytesIO(x))
    elif isinstance(x, str):
        x = Image.open(x)
    if not isinstance(x, Image.Image):
        raise ValueError(f"an image must be a PIL image, a path, bytes or {{'bytes', 'path'}}, "
                         f"not {type(x).__name__}")
    return x.convert("RGB")


def encode(processor, text: str, images: list) -> tuple[list[int], Vision]:
    """A prompt's token ids, each image's placeholder expanded to its merged patches, and its
    Vision record, from the model's own processor (transformers' AutoProcessor of the
    checkpoint). text: the prompt as the chat template writes it, one image placeholder per
    image; images: as `load_image` takes them, in the prompt's order."""
    out = processor(text=[text], images=[load_image(x) for x in images], return_tensors="pt")
    ids, grid = out["input_ids"][0].tolist(), out["image_grid_thw"]
    image_token = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    merge = processor.image_processor.merge_size
    return ids, Vision(out["pixel_values"], grid, positions(ids, image_token, grid, merge))


def as_list(x) -> list:
    """A dataset cell of images as a list: one image, a list of them, or none."""
    return [] if x is None else list(x) if isinstance(x, (list, tuple)) else [x]


MARKER = "<image>"  # where a dataset's text puts an image (LLaVA's form; Geometry3K's)


def with_images(messages: list[dict], count: int) -> list[dict]:
    """The conversation with its `count` images in its first user turn, as chat templates of
    vision-language models take them: that turn's content a list of parts, {"type": "image"}
    for each image and {"type": "text", "text": ...}. Where the turn's text marks each image
    with MARKER, the images go there (the markers removed); else all of them before the text."""
    out, placed = [dict(m) for m in messages], False
    for m in out:
        if m["role"] != "user" or placed:
            continue
        pieces = m["content"].split(MARKER)
        if len(pieces) != count + 1:  # no markers (or not one per image): images first
            pieces = [""] * count + [m["content"].replace(MARKER, "")]
        parts = []
        for i, text in enumerate(pieces):
            parts += [{"type": "image"}] if i else []
            parts += [{"type": "text", "text": text}] if text else []
        m["content"], placed = parts, True
    return out


@dataclass
class Media:
    """What the engine needs of a prompt with images, beside what the sample keeps."""
    engine_ids: list[int]  # the prompt with one placeholder per image: the engine expands them
    images: list  # RGB PIL images, in prompt order (the request's multi_modal_data)
    vision: Vision  # the sample's record (its patches, grids and positions)


def media(processor, example: dict, image_key: str) -> Media:
    """A loaded example's images made ready for a rollout (data.load_examples kept their
    expanded prompt ids, their text and the engine's ids, not their patches: a dataset's patches
    would not fit in memory). The patches come from the same processor call as at load, so the
    ids must come out the same."""
    images = [load_image(x) for x in as_list(example[image_key])]
    ids, v = encode(processor, example["prompt_text"], images)
    if ids != example["prompt_ids"]:
        raise RuntimeError("the processor expanded a prompt's images differently from when the "
                           "data loaded (a processor setting changed during the run?)")
    return Media(example["engine_prompt_ids"], images, v)
