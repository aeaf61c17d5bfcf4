"""Checkpoints and the export: resumable sharded checkpoints that survive a crash mid-write, and
the trained actor in Hugging Face format for transformers and vLLM.

Resumable checkpoints: sharded with torch.distributed.checkpoint (every rank writes its own
shards, no gather), each rank's RNG states, and trainer_state.json (step, lr schedule, the loop's
state) from rank 0. Written to step_N.tmp and renamed to step_N once complete (a rename within a
filesystem is atomic), so whatever kills the run mid-write, the newest step_N is whole. Layout:
    out_dir/checkpoints/step_000120/{*.distcp, .metadata, rng_rank*.pt, trainer_state.json}
Every rank writes into the same directory: on several nodes it must be a shared filesystem.
With adapters (model.lora) a checkpoint holds what trains, the adapters and their optimizer
state (the frozen base is the model's own checkpoint), and the export writes both the merged
model and the adapter in peft's format (adapter/).
"""

import glob
import json
import os
import random
import re
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

import npu_ops

TRAINED = StateDictOptions(ignore_frozen_params=True)  # a checkpoint's: what trains


def trained_state(model: torch.nn.Module) -> dict:
    """The model's state dict of what trains: every weight, or on a frozen base (LoRA) the
    adapters alone (and the final norm, model.lora.train_final_norm). (torch's
    ignore_frozen_params keeps a tied output layer, which the state dict lists apart from the
    frozen embedding it shares: a vocabulary-sized matrix.)"""
    sd = get_model_state_dict(model, options=TRAINED)
    if all(p.requires_grad for p in model.parameters()):
        return sd
    names = {name for name, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in sd.items() if k in names}


def save_hf(model: torch.nn.Module, tokenizer, out_dir: str, source: str | None = None,
            lora=None) -> None:
    """Export a Hugging Face checkpoint that transformers and vLLM load: model.safetensors,
    config.json, generation_config.json (the `source` model's, when it has one: its eos and
    sampling defaults) and the tokenizer. With adapters (`lora`: fsdp_utils.LoraConfig), the
    weights are merged (W + alpha / rank x B A, in fp32, in W's dtype) and the adapter alone is
    written too, in peft's format, under adapter/. Every rank must call (the full state dict is
    gathered); rank 0 writes to out_dir.tmp and renames it, so out_dir is always a whole
    export."""
    from transformers import GenerationConfig

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                              cpu_offload=True))
    if dist.get_rank() == 0:
        tmp = out_dir.rstrip("/") + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        if source and os.path.isfile(os.path.join(source, "generation_config.json")):
            model.generation_config = GenerationConfig.from_pretrained(source)
        if lora is not None and lora.rank:
            sd, layers = merged(sd, lora.alpha / lora.rank)
            whole = {stored_name(model, k): sd[k] for k, _ in trained_in_full(model)}
            save_adapter(os.path.join(tmp, "adapter"),  # named as the base checkpoint names them
                         {stored_name(model, k): v for k, v in layers.items()}, lora, source,
                         whole)
        if getattr(model, "checkpoint_path", None):  # a vision-language checkpoint
            save_beside_source(model, sd, model.checkpoint_path, tmp)
        else:
            model.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
            if source and getattr(model.config, "vision_config", None) is not None:
                copy_files(source, tmp, PROCESSOR_FILES)  # the whole vision-language model
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.rename(tmp, out_dir)
    dist.barrier()


def save_beside_source(model: torch.nn.Module, sd: dict, source: str, out: str) -> None:
    """A vision-language checkpoint whose language model trained: the tensors `source` holds,
    by its names, the language model's from `sd` (under `stored_name`) and every other one (the
    vision tower, ...) as `source` has it; `source`'s config and processor files. Shards and
    index as transformers writes them."""
    from huggingface_hub import save_torch_state_dict
    from safetensors import safe_open

    trained = {stored_name(model, name): value for name, value in sd.items()}
    out_sd, storages = {}, set()
    for name, file in files(source).items():
        if name in trained:  # safetensors writes tensors that own their whole storage only:
            value = trained[name]  # a tied pair shares one, a gathered one may be a view
            whole = value.untyped_storage().nbytes() == value.numel() * value.element_size()
            out_sd[name] = value if whole and value.data_ptr() not in storages else value.clone()
            storages.add(value.data_ptr())
        else:
            with safe_open(file, "pt") as f:
                out_sd[name] = f.get_tensor(name)
    os.makedirs(out, exist_ok=True)
    save_torch_state_dict(out_sd, out)
    copy_files(source, out, ("config.json", *PROCESSOR_FILES))
    model.generation_config.save_pretrained(out)


# what a vision-language checkpoint's processor is built from, beside the tokenizer's files
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json",
                   "video_preprocessor_config.json", "chat_template.jinja", "chat_template.json")


def copy_files(source: str, out: str, names) -> None:
    """The files `names` of the checkpoint `source` (a directory or a hub id) that it has, into
    the directory `out`."""
    from transformers.utils import cached_file

    for name in names:
        path = cached_file(source, name, _raise_exceptions_for_missing_entries=False)
        if path is not None:
            shutil.copyfile(path, os.path.join(out, name))


def language_config(hf_cfg):
    """The config the trainer builds its model from: a vision-language checkpoint's language
    part, else the config itself. (transformers 5.19 takes either; 5.5.4's
    AutoModelForCausalLM.from_config of the whole Qwen3_5Config fails: it has no vocab_size.)"""
    return hf_cfg.get_text_config() if hasattr(hf_cfg, "vision_config") else hf_cfg


def language_prefix(path: str, hf_cfg) -> str:
    """Where a checkpoint holds its language model's `model.*` weights: "model." for a causal
    LM; for a vision-language checkpoint, the prefix its files use, read from their names
    (transformers 5 writes `model.language_model.*`; older Qwen-VL releases wrote `model.*`
    beside `visual.*`)."""
    if getattr(hf_cfg, "vision_config", None) is None:
        return "model."
    return "model.language_model." if any(n.startswith("model.language_model.")
                                          for n in files(path)) else "model."


def trained_in_full(model: torch.nn.Module) -> list:
    """[(name, parameter)] of what trains whole beside adapters (the final norm,
    model.lora.train_final_norm); [] without adapters, where everything does."""
    named = list(model.named_parameters())
    if not any(".lora_" in name for name, _ in named):
        return []
    return [(name, p) for name, p in named if p.requires_grad and ".lora_" not in name]


def stored_name(model: torch.nn.Module, name: str) -> str:
    """A parameter's Hugging Face name as the model's checkpoint stores it: a vision-language
    checkpoint's language model under its prefix (`language_prefix`, which
    fsdp_utils.build_actor keeps on the model as `checkpoint_prefix`)."""
    prefix = getattr(model, "checkpoint_prefix", "model.")
    return prefix + name[len("model."):] if name.startswith("model.") else name


def files(path: str) -> dict[str, str]:
    """{tensor name: the safetensors file holding it} of the checkpoint at `path` (a directory,
    or a hub id through the hub's cache), from model.safetensors.index.json or
    model.safetensors' header: no weight is read."""
    from safetensors import safe_open
    from transformers.utils import cached_file

    index = cached_file(path, "model.safetensors.index.json",
                        _raise_exceptions_for_missing_entries=False)
    if index is not None:
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return {name: cached_file(path, file) for name, file in weight_map.items()}
    file = cached_file(path, "model.safetensors")
    with safe_open(file, "pt") as f:
        return {name: file for name in f.keys()}


def tensors_beyond(path: str, held: set, dtype: torch.dtype, skip: tuple = ()):
    """(name, tensor in `dtype`) of each tensor of the checkpoint at `path` not named in
    `held` and not starting with one of `skip`, read from its files one at a time."""
    from safetensors import safe_open

    for name, file in files(path).items():
        if name not in held and not name.startswith(skip):
            with safe_open(file, "pt") as f:
                yield name, f.get_tensor(name).to(dtype)


def merged(sd: dict, scaling: float) -> tuple[dict, dict]:
    """A full state dict with adapters (peft's names: `X.base_layer.weight`, `X.lora_A.<name>.
    weight`, ...) as Hugging Face names with each adapted weight merged, W + scaling x B A;
    and the adapters, {X: (lora_A, lora_B)}."""
    out, layers = {}, {}
    for name, value in sd.items():
        if ".lora_" in name:
            layer, kind = name.split(".lora_")[0], name.split(".lora_")[1][0]  # "A" or "B"
            layers.setdefault(layer, {})[kind] = value
        else:
            out[name.replace(".base_layer.", ".")] = value
    for layer, ab in layers.items():
        w = out[f"{layer}.weight"]
        delta = scaling * ab["B"].float() @ ab["A"].float()
        out[f"{layer}.weight"] = (w.float() + delta).to(w.dtype)
    return out, {layer: (ab["A"], ab["B"]) for layer, ab in layers.items()}


def rng_state() -> dict:
    """This process's random generators: Python's, numpy's (where it is loaded), torch's and the
    device's."""
    import sys

    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if "numpy" in sys.modules:
        state["numpy"] = sys.modules["numpy"].random.get_state()
    if npu_ops.device_type() != "cpu":
        state["device"] = npu_ops.device_module().get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """The generators as `rng_state` returned them."""
    import sys

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state and "numpy" in sys.modules:
        sys.modules["numpy"].random.set_state(state["numpy"])
    if "device" in state and npu_ops.device_type() != "cpu":
        npu_ops.device_module().set_rng_state(state["device"])


def save_checkpoint(out_dir: str, step: int, model, optimizer, scheduler, keep: int = 2,
                    extra: dict | None = None, rank: dict | None = None) -> str:
    """Every rank must call. Keeps the newest `keep` complete checkpoints. `extra`: JSON-able
    loop state (e.g. the data position) stored in trainer_state.json; `rank`: this rank's own
    (e.g. partial rollout's carried groups), pickled into rank_state{rank}.pt."""
    root = os.path.join(out_dir, "checkpoints")
    path = os.path.join(root, f"step_{step:06d}")
    tmp, own, rank = path + ".tmp", rank, dist.get_rank()
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # what a crashed write of this step left
    dist.barrier()
    state = {"model": trained_state(model),
             "optim": get_optimizer_state_dict(model, optimizer, options=TRAINED)}
    dcp.save(state, checkpoint_id=tmp)
    torch.save(rng_state(), os.path.join(tmp, f"rng_rank{rank}.pt"))
    if own is not None:
        torch.save(own, os.path.join(tmp, f"rank_state{rank}.pt"))
    dist.barrier()  # every rank's files are in tmp
    if rank == 0:
        with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
            json.dump({**(extra or {}), "step": step, "scheduler": scheduler.state_dict()}, f)
        shutil.rmtree(path, ignore_errors=True)  # the same step saved by an earlier run
        os.rename(tmp, path)
        for old in complete_checkpoints(out_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
        for stale in glob.glob(os.path.join(root, "step_*.tmp")):  # other crashed writes
            shutil.rmtree(stale, ignore_errors=True)
    dist.barrier()
    return path


def complete_checkpoints(out_dir: str) -> list[str]:
    """Complete checkpoints under out_dir, oldest first (a step_N.tmp is an unfinished write)."""
    paths = glob.glob(os.path.join(out_dir, "checkpoints", "step_*"))
    return sorted(p for p in paths if re.fullmatch(r"step_\d+", os.path.basename(p))
                  and os.path.exists(os.path.join(p, "trainer_state.json")))


def latest_checkpoint(out_dir: str):
    """The newest complete checkpoint under out_dir, or None."""
    done = complete_checkpoints(out_dir)
    return done[-1] if done else None


def load_checkpoint(path: str, model, optimizer, scheduler) -> dict:
    """Restore model, optimizer, schedule and this rank's RNG states in place (every rank);
    returns trainer_state.json ("step" and what save_checkpoint got as `extra`) and, as "rank",
    this rank's own state (save_checkpoint's `rank`; None when it saved none)."""
    state = {"model": trained_state(model),
             "optim": get_optimizer_state_dict(model, optimizer, options=TRAINED)}
    dcp.load(state, checkpoint_id=path)
    frozen = not all(p.requires_grad for p in model.parameters())  # (the base is the model's)
    set_model_state_dict(model, state["model"], options=StateDictOptions(
        ignore_frozen_params=True, strict=not frozen))
    set_optimizer_state_dict(model, optimizer, state["optim"], options=TRAINED)
    rng = os.path.join(path, f"rng_rank{dist.get_rank()}.pt")
    if os.path.exists(rng):  # absent when resuming on more ranks than saved
        set_rng_state(torch.load(rng, weights_only=False))
    with open(os.path.join(path, "trainer_state.json")) as f:
        saved = json.load(f)
    scheduler.load_state_dict(saved["scheduler"])
    own = os.path.join(path, f"rank_state{dist.get_rank()}.pt")
    saved["rank"] = torch.load(own, weights_only=False) if os.path.exists(own) else None
    return saved


def save_adapter(path: str, layers: dict, lora, base: str | None = None,
                 whole: dict | None = None) -> None:
    """An adapter in peft's format (adapter_config.json, adapter_model.safetensors), which
    peft.PeftModel.from_pretrained and vLLM's LoRARequest read: `layers` {HF name of an adapted
    layer: (lora_A, lora_B)}, `lora` its rank, alpha and dropout (fsdp_utils.LoraConfig),
    `base` the base model's path or hub id, if known. `whole` {HF name of a weight: tensor}: what
    trained in full beside the adapters (the final norm, model.lora.train_final_norm), as peft
    keeps a module of its modules_to_save (peft 0.21: `base_model.model.<name>`): the export
    only, as vLLM 0.23 refuses an adapter with such modules and 0.32 takes one output layer."""
    from safetensors.torch import save_file

    whole = whole or {}
    os.makedirs(path, exist_ok=True)
    save_file({**{f"base_model.model.{name}.lora_{k}.weight": t.detach().cpu().contiguous()
                  for name, pair in layers.items() for k, t in zip("AB", pair)},
               **{f"base_model.model.{name}": t.detach().cpu().contiguous()
                  for name, t in whole.items()}},
              os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
                   "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "bias": "none",
                   "target_modules": sorted({n.rsplit(".", 1)[-1] for n in layers}),
                   "modules_to_save": sorted({n.rsplit(".", 1)[0] for n in whole}) or None,
                   "base_model_name_or_path": base}, f)
