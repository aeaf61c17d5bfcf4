"""Checkpoints and the export: resumable sharded checkpoints that survive a crash mid-write, and
the trained actor in Hugging Face format for transformers and vLLM.

Resumable checkpoints: sharded with torch.distributed.checkpoint (every rank writes its own
shards, no gather), each rank's RNG states, and trainer_state.json (step, lr schedule, the loop's
state) from rank 0. Written to step_N.tmp and renamed to step_N once complete (a rename within a
filesystem is atomic), so whatever kills the run mid-write, the newest step_N is whole. Layout:
    out_dir/checkpoints/step_000120/{*.distcp, .metadata, rng_rank*.pt, trainer_state.json}
Every rank writes into the same directory: on several nodes it must be a shared filesystem.
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


def save_hf(model: torch.nn.Module, tokenizer, out_dir: str, source: str | None = None) -> None:
    """Export a Hugging Face checkpoint that transformers and vLLM load: model.safetensors,
    config.json, generation_config.json (the `source` model's, when it has one: its eos and
    sampling defaults) and the tokenizer. Every rank must call (the full state dict is gathered);
    rank 0 writes to out_dir.tmp and renames it, so out_dir is always a whole export."""
    from transformers import GenerationConfig

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                              cpu_offload=True))
    if dist.get_rank() == 0:
        tmp = out_dir.rstrip("/") + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        if source and os.path.isfile(os.path.join(source, "generation_config.json")):
            model.generation_config = GenerationConfig.from_pretrained(source)
        model.save_pretrained(tmp, state_dict=sd, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.rename(tmp, out_dir)
    dist.barrier()


def _rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if npu_ops.device_type() != "cpu":
        state["device"] = npu_ops.device_module().get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
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
    state = {"model": get_model_state_dict(model),
             "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.save(state, checkpoint_id=tmp)
    torch.save(_rng_state(), os.path.join(tmp, f"rng_rank{rank}.pt"))
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
    state = {"model": get_model_state_dict(model),
             "optim": get_optimizer_state_dict(model, optimizer)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizer, state["optim"])
    rng = os.path.join(path, f"rng_rank{dist.get_rank()}.pt")
    if os.path.exists(rng):  # absent when resuming on more ranks than saved
        _set_rng_state(torch.load(rng, weights_only=False))
    with open(os.path.join(path, "trainer_state.json")) as f:
        saved = json.load(f)
    scheduler.load_state_dict(saved["scheduler"])
    own = os.path.join(path, f"rank_state{dist.get_rank()}.pt")
    saved["rank"] = torch.load(own, weights_only=False) if os.path.exists(own) else None
    return saved
