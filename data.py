"""The prompt data of a GRPO run: the `data:` config section, dataset presets, and loading.

`load_examples` reads rows with Hugging Face `datasets` (a hub id, a .parquet / .jsonl / .json
file, or a directory written by `save_to_disk`), turns each prompt into token ids (plain text or
chat messages, optionally through the tokenizer's chat template), extracts the gold answer, and
drops prompts longer than `data.max_prompt_len`. Every bad input fails with a one-line
config.BadInput that names the config field and the fix, before any model is built; an error
from inside datasets or the tokenizer surfaces as it is.
"""

import dataclasses
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Annotated

from modeling import vision
import plugins
from config import FLAG, Anything, BadInput, OneOf, Range, need

log = logging.getLogger("grpo")

# data.load_examples checks these against what the data holds, with one line naming the field
LOADS = "checked when the data loads (load_examples), against the files, hub and columns"


@dataclass
class DataConfig:
    LIVE = ()  # between steps (train_grpo.configure): none, all loaded at setup
    # hub dataset id "org/name", a .parquet/.jsonl/.json file, or a save_to_disk dir
    path: Annotated[str, Anything(LOADS)] = ""
    # split of a hub dataset or a saved DatasetDict (files have one: ignored)
    split: Annotated[str, Anything(LOADS)] = "train"
    # hub dataset config, e.g. "main" for openai/gsm8k (empty: the default)
    config_name: Annotated[str, Anything(LOADS)] = ""
    # held-out set for log.eval_every, same kinds as path (empty: train)
    eval_path: Annotated[str, Anything(LOADS)] = ""
    eval_split: Annotated[str, Anything(LOADS)] = "test"  # split of eval_path
    # "gsm8k" | "math" | "geo3k" (images) | "": fills the fields left at their defaults (PRESETS)
    preset: Annotated[str, OneOf("", "gsm8k", "math", "geo3k")] = ""
    # column holding the prompt: text, or a list of {role, content}
    prompt_key: Annotated[str, Anything(LOADS)] = "prompt"
    # column holding the gold answer ("": none, example["answer"] None)
    answer_key: Annotated[str, Anything(LOADS)] = "answer"
    # appended to every prompt (the last user turn), e.g. an instruction
    prompt_suffix: Annotated[str, Anything("free text")] = ""
    # a system turn with chat_template, else text before a blank line
    system_prompt: Annotated[str, Anything("free text")] = ""
    # render the prompt with the tokenizer's chat template (check_model looks for one)
    chat_template: Annotated[bool, FLAG] = False
    # column holding each prompt's images (one or a list: paths, bytes, PIL images, datasets'
    #   {bytes, path}), placed before its first user turn's text by the chat template; needs a
    #   vision-language model (model.path) and data.chat_template ("": text prompts)
    image_key: Annotated[str, Anything(LOADS)] = ""
    # with image_key: each image resized to at most this many pixels, by the trainer's processor
    #   and the engine's alike (load_processor, rollout.engine_media); 0: the checkpoint's
    #   preprocessor_config.json bound (Qwen2.5-VL's: 12845056, up to 16384 tokens an image)
    max_pixels: Annotated[int, Range(0)] = 0
    max_prompt_len: Annotated[int, Range(1)] = 512  # longer prompts are dropped at load time
    # if set: create the built-in tiny model + prompts here if missing
    tiny_task_dir: Annotated[str, Anything("any directory path: created if missing")] = ""
    # the tiny model's family when tiny_task_dir is created (tiny_task.build_tiny_model)
    #   (qwen2_5_vl: the tiny vision task instead, images of coloured cells: configs/vlm_cpu.yaml)
    tiny_task_arch: Annotated[str, OneOf("qwen2", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_moe",
                                         "qwen2_5_vl")] = "qwen2"
    # the tiny tokenizer with chat roles, a chat template and tool-call tokens
    #   (tiny_task.CHAT_TEMPLATE) when tiny_task_dir is created: what an agent's calls need
    tiny_task_chat: Annotated[bool, FLAG] = False
    # supervised steps when tiny_task_dir is created that teach the tiny model the answer's form,
    #   not the sums (tiny_task.teach_format: a base for LoRA, configs/qwen35_lora_cpu.yaml);
    #   0: the random init
    tiny_task_format_steps: Annotated[int, Range(0)] = 0

    def check(self, cfg, world_size: int) -> None:
        """The tiny task's settings against each other (config.validate calls it)."""
        need(not self.tiny_task_format_steps or (
            self.tiny_task_dir and not self.tiny_task_chat and self.tiny_task_arch != "qwen2_5_vl"),
             f"data.tiny_task_format_steps={self.tiny_task_format_steps} teaches the plain sum "
             "task's form: it needs data.tiny_task_dir, without data.tiny_task_chat or "
             "data.tiny_task_arch=qwen2_5_vl")

    def check_model(self, cfg, text: dict) -> None:
        """A chat template in model.path's tokenizer files where chat_template asks for one, and
        images only for a vision-language model, through its chat template (config.check_model
        calls it)."""
        path = cfg.model.path
        if self.max_pixels and not self.image_key:
            raise BadInput(f"config: data.max_pixels={self.max_pixels} bounds the images of "
                           "data.image_key, which is empty. Fix: data.max_pixels=0, or name the "
                           "images' column in data.image_key")
        if self.image_key:
            with open(os.path.join(path, "config.json")) as f:
                kind = json.load(f)
            if kind.get("vision_config") is None:
                raise BadInput(f"config: data.image_key={self.image_key!r} gives prompts images, "
                               f"but model.path={path} is not a vision-language model "
                               f"({kind.get('model_type')}: no vision_config). Fix: a "
                               "vision-language checkpoint, or data.image_key=''")
            if not self.chat_template:
                raise BadInput("config: data.image_key needs data.chat_template=true: the chat "
                               "template places each image in the prompt. Fix: "
                               "data.chat_template=true")
            for name, on in (("env.name", cfg.env.name), ("model.sp_size", cfg.model.sp_size > 1),
                             ("rollout.partial.enabled", cfg.rollout.partial.enabled),
                             ("model.lora.rank", cfg.model.lora.rank),
                             ("model.routing_replay", cfg.model.routing_replay),
                             ("distill.teacher", cfg.distill.teacher)):
                if on:
                    raise BadInput(f"config: data.image_key with {name}: not written for prompts "
                                   f"with images yet (docs/platforms.md, \"Vision-language "
                                   f"models\"). Fix: {name} off, or data.image_key=''")
        if not self.chat_template:
            return
        found = [name for name in ("chat_template.jinja", "chat_template.json")
                 if os.path.isfile(os.path.join(path, name))]
        settings = os.path.join(path, "tokenizer_config.json")
        if not found and os.path.isfile(settings):
            with open(settings) as f:
                found = ["tokenizer_config.json"] if json.load(f).get("chat_template") else []
        if not found:
            raise BadInput(f"config: data.chat_template=true, but the tokenizer in {path} has "
                           "no chat template (no chat_template.jinja, nor one in "
                           "tokenizer_config.json). Fix: data.chat_template=false (plain text "
                           "prompts), or a model with a chat template")


def gsm8k_answer(text: str) -> str | None:
    """GSM8K's gold: the text after the last "####", stripped, thousands commas removed."""
    if "####" not in text:
        return None
    return text.rsplit("####", 1)[1].strip().replace(",", "")


def boxed_answer(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (braces balanced), or None if there is none."""
    matches = list(re.finditer(r"\\boxed\s*\{", text))
    if not matches:
        return None
    start, depth = matches[-1].end(), 1
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i].strip()
    return None  # unbalanced: no usable gold


# Each preset: config values (applied by apply_preset) and "extract", the gold-answer extraction.
PRESETS = {
    "gsm8k": dict(path="openai/gsm8k", config_name="main", eval_path="openai/gsm8k",
                  prompt_key="question", answer_key="answer",
                  prompt_suffix=' Let\'s think step by step and output the final answer after "####".',
                  extract=gsm8k_answer),
    # MATH (Hendrycks) with the problem/solution columns and train/test splits; this id was not
    # reachable from where this was written (no hub access), so it is untested here.
    "math": dict(path="DigitalLearningGmbH/MATH-lighteval", config_name="",
                 eval_path="DigitalLearningGmbH/MATH-lighteval",
                 prompt_key="problem", answer_key="solution",
                 prompt_suffix=" Please reason step by step, and put your final answer within \\boxed{}.",
                 extract=boxed_answer),
    # Geometry3K with its diagrams (the set verl's and EasyR1's vision recipes train on): columns
    #   images (one diagram), problem ("<image>" where it goes), answer (bare: "3", "2\\sqrt{3}"),
    #   splits train / validation / test; reward.funcs=[math]. Not reachable from where this
    #   was written (no hub access): untested here.
    "geo3k": dict(path="hiyouga/geometry3k", config_name="", eval_path="hiyouga/geometry3k",
                  prompt_key="problem", answer_key="answer", image_key="images",
                  chat_template=True,
                  prompt_suffix=" Please reason step by step, and put your final answer within \\boxed{}.",
                  extract=str.strip),
}
_SOURCE = ("path", "config_name", "eval_path")  # where the rows come from: all from one place


def apply_preset(cfg: DataConfig) -> DataConfig:
    """A copy of `cfg` where each field left at its dataclass default takes the preset's value.

    The source fields (path, config_name, eval_path) are filled only if `path` is left empty too:
    a user's own path with the preset's hub config or eval set would mix two datasets.
    """
    if not cfg.preset:
        return dataclasses.replace(cfg)
    if cfg.preset not in PRESETS:
        raise BadInput(f"data.preset={cfg.preset!r} is unknown. Fix: use one of "
                       f"{sorted(PRESETS)} or leave it empty")
    defaults = DataConfig()
    own_source = cfg.path != defaults.path
    values = {k: v for k, v in PRESETS[cfg.preset].items() if k != "extract"
              and getattr(cfg, k) == getattr(defaults, k) and not (own_source and k in _SOURCE)}
    return dataclasses.replace(cfg, **values)


_FILE_KINDS = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def _count_json_rows(path: str, ext: str, field: str) -> int:
    """The rows of a .jsonl or .json file, each line (or the file) checked to be JSON first:
    datasets' reader fails on a bad line without saying which, and on an empty file."""
    with open(path) as f:
        if ext == ".json":
            try:
                return len(json.load(f) or ())
            except json.JSONDecodeError as e:
                raise BadInput(f"{field}={path}: not JSON ({e}). Fix: make it a list of "
                               "objects, one per row") from None
        rows = 0
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    json.loads(line)
                except json.JSONDecodeError as e:
                    raise BadInput(f"{field}={path}: line {n} is not JSON ({e}). Fix: make "
                                   "each line one JSON object, or remove the line") from None
                rows += 1
        return rows


def _count_rows(path: str, ext: str, field: str) -> int:
    """The rows of a local source, read without datasets."""
    if os.path.isdir(path):  # a saved Dataset: state.json lists its arrow files (none if empty)
        with open(os.path.join(path, "state.json")) as f:
            return 1 if json.load(f).get("_data_files") else 0  # some rows, or none
    if ext == ".parquet":
        import pyarrow.parquet

        return pyarrow.parquet.ParquetFile(path).metadata.num_rows
    return _count_json_rows(path, ext, field)


def read_rows(path: str, split: str, config_name: str = "", field: str = "data.path",
              split_field: str = "data.split"):
    """The rows of `path` as a `datasets.Dataset`: a local file or save_to_disk directory if it
    exists, else a hub id ("org/name"); anything else is a missing file. What the user gave is
    checked here first (kind, split, JSON, rows), so that an error from datasets itself is a
    problem of datasets, and surfaces as it is."""
    import datasets

    ext = os.path.splitext(path)[1].lower()
    if os.path.isfile(path) and ext not in _FILE_KINDS:
        raise BadInput(f"{field}={path}: unsupported file type {ext!r}. Fix: use a "
                       ".parquet, .jsonl or .json file, a save_to_disk directory or a "
                       "hub id")
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in
                                       ("dataset_info.json", "dataset_dict.json")):
        raise BadInput(f"{field}={path} is a directory but not one written by datasets' "
                       "save_to_disk. Fix: point it at a saved dataset or at a "
                       ".parquet/.jsonl/.json file")
    if os.path.exists(path):
        source = path
        if os.path.isfile(os.path.join(path, "dataset_dict.json")):  # a saved DatasetDict
            with open(os.path.join(path, "dataset_dict.json")) as f:
                splits = json.load(f)["splits"]
            if split not in splits:
                raise BadInput(f"{split_field}={split!r}: {field}={path} has splits "
                               f"{sorted(splits)}. Fix: set {split_field} to one of them")
            source = os.path.join(path, split)
        if _count_rows(source, ext, field) == 0:
            raise BadInput(f"{field}={path}: no rows (an empty file or dataset). Fix: point "
                           f"{field} at a dataset with rows")
        if os.path.isdir(source):
            return datasets.load_from_disk(source)
        return datasets.load_dataset(_FILE_KINDS[ext], data_files=path, split="train")
    if ext in _FILE_KINDS or not _HUB_ID.fullmatch(path):
        raise BadInput(f"{field}={path!r}: no such file or directory. Fix: point {field} "
                       "at an existing file or directory, or at a hub dataset id 'org/name'")
    try:
        return datasets.load_dataset(path, name=config_name or None, split=split)
    except ValueError as e:  # datasets' answer about the user's names: an unknown config or split
        raise BadInput(f"{field}={path} (data.config_name={config_name!r}, {split_field}="
                       f"{split!r}): {plugins.one_line(e)}. Fix: set data.config_name and "
                       f"{split_field} to ones the dataset has") from None
    except (ConnectionError, FileNotFoundError) as e:  # offline, or no such dataset on the hub
        raise BadInput(f"{field}={path} is not a local path, and the Hugging Face hub is "
                       f"unreachable (offline?) or has no dataset {path} "
                       f"({plugins.one_line(e)}). Fix: download it where the hub is reachable "
                       f"and point {field} at the saved directory or file") from None


def _is_messages(prompt) -> bool:
    return (isinstance(prompt, list) and len(prompt) > 0 and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in prompt))


def prompt_messages(cfg: DataConfig, prompt, where: str) -> list[dict]:
    """The conversation the model sees for one prompt (text, or chat messages with
    data.chat_template): data.prompt_suffix at the end of its last user turn, data.system_prompt
    as a first system turn unless the row has its own. `where` names the row in errors."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif _is_messages(prompt):
        if not cfg.chat_template:
            raise BadInput(f"{where}: data.prompt_key={cfg.prompt_key!r} holds chat "
                           "messages, which need a chat template. Fix: set "
                           "data.chat_template=true")
        messages = [dict(m) for m in prompt]  # copies: the suffix must not edit the row
    else:
        raise BadInput(f"{where}: data.prompt_key={cfg.prompt_key!r} holds a "
                       f"{type(prompt).__name__}, neither text nor a list of {{'role', "
                       f"'content'}} dicts. Fix: point data.prompt_key at a prompt column")
    users = [m for m in messages if m["role"] == "user"]
    if cfg.prompt_suffix and not users:
        raise BadInput(f"{where}: the messages have no user turn for data.prompt_suffix. "
                       f"Fix: add one to the data or set data.prompt_suffix=''")
    if users:
        users[-1]["content"] += cfg.prompt_suffix
    if cfg.system_prompt and messages[0]["role"] != "system":  # the row's own system turn wins
        messages.insert(0, {"role": "system", "content": cfg.system_prompt})
    return messages


def prompt_ids(cfg: DataConfig, tokenizer, prompt, where: str) -> list[int]:
    """Token ids of one prompt's conversation (prompt_messages): through the chat template if
    data.chat_template, else its texts joined by a blank line (the system prompt, the prompt)."""
    return _ids(cfg, tokenizer, prompt_messages(cfg, prompt, where))


def _ids(cfg: DataConfig, tokenizer, messages: list[dict]) -> list[int]:
    if not cfg.chat_template:
        text = "\n\n".join(m["content"] for m in messages)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    # transformers 5 returns a BatchEncoding unless return_dict=False; older ones a list
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def _image_prompt(processor, messages: list[dict], images) -> tuple[list[int], dict]:
    """A prompt with images (data.image_key): its ids, each image's placeholder expanded to its
    patches (what the trainer runs and counts against data.max_prompt_len), and what a rollout
    needs again (vision.media): the prompt's text and the engine's ids, one placeholder per
    image, which the engine expands itself (docs/engine.md, "Images in prompts")."""
    images = vision.as_list(images)
    text = processor.apply_chat_template(vision.with_images(messages, len(images)),
                                         add_generation_prompt=True, tokenize=False)
    ids, _ = vision.encode(processor, text, images)
    engine = list(processor.tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids, {"prompt_text": text, "engine_prompt_ids": engine}


def load_processor(cfg: DataConfig, model_path: str):
    """The model's AutoProcessor for prompts with images (data.image_key; None without), its
    images resized to at most data.max_pixels (0: the checkpoint's own bound). transformers 5.5
    and 5.19 take max_pixels as the image processor's size["longest_edge"] (smart_resize shrinks
    a larger image to fit, whatever its shortest_edge), as vLLM does with the same argument
    (rollout.engine_media)."""
    from transformers import AutoProcessor

    if not cfg.image_key:
        return None
    return AutoProcessor.from_pretrained(
        model_path, **({"max_pixels": cfg.max_pixels} if cfg.max_pixels else {}))


def most_images(cfg: DataConfig, examples: list[dict]) -> int:
    """The most images a prompt of `examples` has (at least 1): the engine's limit."""
    return max([1] + [len(vision.as_list(ex[cfg.image_key])) for ex in examples])


def load_examples(cfg: DataConfig, tokenizer, split: str | None = None,
                  path: str | None = None, processor=None) -> list[dict]:
    """The examples of `path` (default data.path) / `split` (default data.split), in the dataset's
    order: each row as a dict plus "prompt_ids" (list[int]), "prompt_messages" (the conversation
    those ids render, prompt_messages) and "answer" (the preset's gold
    extraction of data.answer_key's value, else that value as a string; None if answer_key is "").
    With data.image_key, through `processor` (the model's AutoProcessor): also "prompt_text" and
    "engine_prompt_ids" (_image_prompt).
    Rows with a prompt over data.max_prompt_len tokens, or no gold the preset can extract, are
    dropped and counted in the log. data.preset is applied here too (apply_preset)."""
    cfg = apply_preset(cfg)
    path, split = (cfg.path if path is None else path), (cfg.split if split is None else split)
    # for the error messages: a path or split other than data.path / data.split is the eval set's
    field = "data.path" if path == cfg.path else "data.eval_path"
    split_field = "data.split" if split == cfg.split else "data.eval_split"
    if not path:
        raise BadInput(f"{field} is empty. Fix: set it to a hub id, a file or a directory, "
                       f"or set data.preset")
    extract = PRESETS[cfg.preset]["extract"] if cfg.preset else None
    ds = read_rows(path, split, cfg.config_name, field, split_field)
    # both columns are checked up front (even on an empty set); answer_key="" opts out of answers
    for key, name in ((cfg.prompt_key, "prompt_key"), (cfg.answer_key, "answer_key"),
                      (cfg.image_key, "image_key")):
        if key and key not in ds.column_names:
            raise BadInput(f"data.{name}={key!r} is not a column of {field}={path} "
                           f"(columns: {ds.column_names}). Fix: set data.{name} to one of "
                           "them")
    examples, too_long, no_gold = [], 0, 0
    for i, row in enumerate(ds):
        messages = prompt_messages(cfg, row[cfg.prompt_key], f"{field}={path} row {i}")
        ids, more = ((_image_prompt(processor, messages, row[cfg.image_key])) if cfg.image_key
                     else (_ids(cfg, tokenizer, messages), {}))
        answer = None
        if cfg.answer_key:
            raw = row[cfg.answer_key]
            answer = extract(str(raw)) if extract else (None if raw is None else str(raw))
            if answer is None:
                no_gold += 1
                continue
        if len(ids) > cfg.max_prompt_len:
            too_long += 1
            continue
        examples.append({**row, "prompt_ids": ids, "answer": answer, "prompt_messages": messages,
                         **more})
    log.info("data: %d examples from %s (split %s), %d dropped as longer than "
             "data.max_prompt_len=%d, %d without a gold answer", len(examples), path, split,
             too_long, cfg.max_prompt_len, no_gold)
    if not examples:
        raise BadInput(f"{field}={path} (split {split!r}): no example left of {len(ds)} "
                       f"rows ({too_long} longer than data.max_prompt_len="
                       f"{cfg.max_prompt_len} "
                       f"tokens, {no_gold} without a gold answer). Fix: raise "
                       f"data.max_prompt_len or check the data")
    return examples


class Shuffled:
    """The examples in one fixed random order (`seed`): shuffled[i] is the i-th drawn, the order
    starting over after the last. Step N draws the same prompts in every run, resumed or not."""

    def __init__(self, examples: list[dict], seed: int):
        import torch

        self.examples = examples
        self.order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed))

    def __getitem__(self, i: int) -> dict:
        return self.examples[self.order[i % len(self.examples)]]

    def __len__(self) -> int:
        return len(self.examples)

