"""The shape of the codebase: the import DAG, which file may touch vllm, torch_npu, FSDP, how long
a unit may grow, and that the product modules hold no code that only tests call."""

import ast
import glob
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.main_only  # the code's shape: no library version enters it

# file -> project modules it may import (the README's file map; tiny_task is the built-in task)
ALLOWED = {
    "ascend_checks": set(), "npu_ops": {"ascend_checks"}, "plugins": set(), "domains": set(),
    "tiny_task": set(), "sandbox": set(), "sandbox_child": set(),  # the Python tool's child
    "rewards": {"plugins", "records", "domains"}, "data": {"domains", "plugins", "vision"},
    "tracking": {"domains"},
    "offload": {"npu_ops", "checkpoint"},  # device memory handed to host memory and back
    "kernels": {"npu_ops"},  # plain-torch references of the fused kernels, the model patch
    "hybrid": {"domains", "npu_ops"},  # Gated DeltaNet layers on packed rows (Qwen3.5)
    "fsdp_utils": {"npu_ops", "offload", "domains", "kernels", "moe", "seq_parallel", "hybrid",
                   "vision", "checkpoint"},
    "checkpoint": {"npu_ops"},
    "records": {"tracking"},  # what a rollout produced: Sample, Generated, Rollout
    "rollout": {"npu_ops", "records", "domains"},  # the engine, engine groups
    "partial": {"grpo", "records", "rollout", "tracking"},  # carried groups across steps
    "weight_sync": {"npu_ops", "fsdp_utils", "offload", "checkpoint", "vision"},  # the push
    "moe": set(),  # mixture-of-experts routers: what they did, routing replay
    "seq_parallel": set(),  # Ulysses attention: all-to-alls around another attention function
    "vision": set(),  # images in prompts: their records, their positions in a packed row
    "logprobs": {"moe", "seq_parallel", "vision"},  # the model's logprobs: packing, output layer
    # the algorithm's formulas: nothing of engines, files or sharding
    "grpo": {"tracking", "domains"},
    # the update's machinery: the loop over a batch, micro-batches, the fused pass's objective
    "trainer": {"batcher", "fsdp_utils", "grpo", "logprobs", "moe", "tracking"},
    # on-policy distillation: the teacher, its pass, per-token advantages
    "distill": {"batcher", "fsdp_utils", "logprobs", "tracking", "domains"},
    "envs": {"plugins", "sandbox"},
    "episodes": {"envs", "plugins", "records", "rollout", "sandbox", "domains", "vision"},
    "openai_api": set(),  # the chat-completions wire format, the HTTP endpoint that serves it
    # agents that speak OpenAI: an endpoint over the engine, their calls as samples
    "agents": {"envs", "episodes", "openai_api", "partial", "plugins", "records",
               "rollout"},
    "sampler": {"agents", "grpo", "partial", "records", "rollout"},  # a step's rollout, one call
    # a scored rollout -> this rank's Batch, its transforms and the passes without gradient
    "batcher": {"fsdp_utils", "logprobs", "records", "rollout", "tracking"},
    "evaluation": {"records", "tracking"},  # held-out pass@1 and mean@k
    "snapshot": {"checkpoint", "npu_ops", "offload"},  # a run's state held aside, put back
    "faults": set(),  # a stop signal, non-finite steps: what the loop does about them
    # variants of the update on the same rollouts from one snapshot
    "variants": {"config", "domains", "evaluation", "snapshot", "tracking", "train_grpo"},
    "config": {"domains"},  # walks the sections' own checks: imports none of their modules
    "train_grpo": {"agents", "npu_ops", "rewards", "tiny_task", "fsdp_utils", "checkpoint", "rollout",
                   "weight_sync", "grpo", "config", "data", "tracking", "episodes", "offload",
                   "domains", "partial", "evaluation", "sampler", "distill", "seq_parallel",
                   "batcher", "snapshot", "faults", "trainer"},
}

# A unit holds one thing: a function past about 60 lines, or a class past about 200, holds two.
# Size follows concern for files: a file may grow where that is its one concern.
MAX_FUNCTION_LINES, MAX_CLASS_LINES = 60, 200


def top_level_files():
    return sorted(glob.glob(os.path.join(ROOT, "*.py")))


def imports(path):
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_every_top_level_file_is_known():
    assert {os.path.basename(p)[:-3] for p in top_level_files()} == set(ALLOWED)


def test_import_dag():
    for path in top_level_files():
        mod = os.path.basename(path)[:-3]
        project = imports(path) & set(ALLOWED)
        assert project <= ALLOWED[mod], f"{mod} imports {project - ALLOWED[mod]}"


def test_only_rollout_imports_vllm():
    users = [os.path.basename(p) for p in top_level_files() if "vllm" in imports(p)]
    assert users == ["rollout.py"]


def test_only_fsdp_utils_shards():
    users = [os.path.basename(p) for p in top_level_files()  # FSDP2's fully_shard, the word
             if re.search(r"\bfully_shard\b", open(p).read())]  # (not vLLM's fully_sharded_loras)
    assert users == ["fsdp_utils.py"]


def test_device_names_only_in_npu_ops():
    """Every Python file of the project outside tests/, at any depth."""
    word = re.compile(r"\b(torch_npu|npu|cuda)\b", re.IGNORECASE)
    files = [p for p in glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True)
             if not os.path.relpath(p, ROOT).startswith(("tests", ".", "runs"))]
    users = sorted(os.path.relpath(p, ROOT) for p in files if word.search(open(p).read()))
    assert users == ["ascend_checks.py", "npu_ops.py"]  # the device layer, its start-up checks


def test_nothing_runs_at_import():
    code = ("import sys, torch.distributed as dist\n"
            "import train_grpo, rollout, weight_sync, fsdp_utils, rewards, npu_ops, tiny_task\n"
            "import grpo, config, tracking, checkpoint, data, plugins, envs, episodes, logprobs\n"
            "import offload, domains, sandbox\n"
            "assert 'vllm' not in sys.modules, 'vllm imported at import time'\n"
            "assert not dist.is_initialized()\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""


def test_units_stay_short():
    """Every function (method included) of a product module at most MAX_FUNCTION_LINES lines,
    every class at most MAX_CLASS_LINES, docstrings and comments counted."""
    long = []
    for path in top_level_files():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                cap = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
                if (n := node.end_lineno - node.lineno + 1) > cap:
                    long.append(f"{os.path.basename(path)}:{node.lineno} {node.name} ({n})")
    assert not long, long


def test_no_product_function_only_tests_call():
    """Every function a product module defines is named somewhere in the product modules
    outside its own definition (called, passed, or registered): a function only tests or
    benches call belongs in tests/ (tests/reference.py) or the bench. Names are matched alone,
    whatever their module: a collision can hide one, never invent one."""
    defined, named = {}, set()
    for path in top_level_files():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                defined.setdefault(node.name, os.path.basename(path))
            elif isinstance(node, ast.Name):
                named.add(node.id)
            elif isinstance(node, ast.Attribute):
                named.add(node.attr)
    hooks = {"do_GET", "do_POST", "log_message"}  # http.server calls them by name (openai_api.py)
    unused = {name: path for name, path in defined.items()
              if name not in named and not name.startswith("__") and name not in hooks}
    assert not unused, unused


def test_every_python_file_is_lint_clean():
    """pyflakes' checks (ruff F: unused or undefined names, imports; E9: syntax) on every Python
    file of the repository, the sandbox's child program included. F811 is left out: a test
    module imports pytest fixtures that its tests then take as arguments, which it counts as
    redefinitions."""
    ruff = os.path.join(os.path.dirname(sys.executable), "ruff")
    out = subprocess.run([ruff, "check", "--select", "F,E9", "--ignore", "F811", "--no-cache",
                          "--output-format", "concise", "."], cwd=ROOT, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr

