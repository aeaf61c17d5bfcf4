"""The shape of the codebase: the core at the top and the optional capabilities in role folders,
the import DAG, which file may touch vllm, torch_npu, FSDP, how long a unit may grow, and that
the product modules hold no code that only tests call."""

import ast
import glob
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.main_only  # the code's shape: no library version enters it

# the role folders (the README's file map): what a plain GRPO step needs is at the top
FOLDERS = ("collect", "modeling", "workflows", "devices", "tasks")
MAX_TOP_LEVEL = 20

# module -> project modules it may import, by module name (the README's file map)
ALLOWED = {
    "ascend_checks": set(), "npu_ops": {"ascend_checks"}, "plugins": set(), "config": set(),
    "tiny_task": set(), "sandbox": set(), "sandbox_child": set(),  # the Python tool's child
    "rewards": {"plugins", "records", "config"}, "data": {"config", "plugins", "vision"},
    "tracking": {"config"},
    "offload": {"npu_ops", "checkpoint"},  # device memory handed to host memory and back
    "kernels": {"npu_ops"},  # plain-torch references of the fused kernels, the model patch
    "hybrid": {"config", "npu_ops", "seq_parallel"},  # Gated DeltaNet layers on packed rows (Qwen3.5)
    "fsdp_utils": {"npu_ops", "offload", "config", "kernels", "moe", "seq_parallel", "hybrid",
                   "vision", "checkpoint"},
    "checkpoint": {"npu_ops"},
    "records": {"tracking"},  # what a rollout produced: Sample, Generated, Rollout
    "rollout": {"npu_ops", "records", "config"},  # the engine, engine groups
    "partial": {"grpo", "records", "rollout", "tracking"},  # carried groups across steps
    "weight_sync": {"npu_ops", "fsdp_utils", "offload", "checkpoint", "vision"},  # the push
    "moe": set(),  # mixture-of-experts routers: what they did, routing replay
    "seq_parallel": set(),  # Ulysses attention: all-to-alls around another attention function
    "vision": set(),  # images in prompts: their records, their positions in a packed row
    "logprobs": {"hybrid", "moe", "seq_parallel", "vision"},  # the model's logprobs: packing, output layer
    # the algorithm's formulas: nothing of engines, files or sharding
    "grpo": {"tracking", "config"},
    # the update's machinery: the loop over a batch, micro-batches, the fused pass's objective
    "trainer": {"batcher", "config", "fsdp_utils", "grpo", "logprobs", "moe", "tracking"},
    # on-policy distillation: the teacher, its pass, per-token advantages
    "distill": {"batcher", "fsdp_utils", "logprobs", "tracking", "config"},
    "envs": {"plugins", "sandbox"},
    "episodes": {"envs", "plugins", "records", "rollout", "sandbox", "config", "vision"},
    "openai_api": set(),  # the chat-completions wire format, the HTTP endpoint that serves it
    # agents that speak OpenAI: an endpoint over the engine, their calls as samples
    "agents": {"envs", "episodes", "openai_api", "partial", "plugins", "records",
               "rollout"},
    # a step's rollout, in one call; held-out prompts
    "sampler": {"agents", "grpo", "partial", "records", "rollout", "tracking"},
    # a scored rollout -> this rank's Batch, its transforms and the passes without gradient
    "batcher": {"fsdp_utils", "logprobs", "records", "rollout", "tracking"},
    "snapshot": {"checkpoint", "npu_ops", "offload"},  # a run's state held aside, put back
    "faults": set(),  # a stop signal, non-finite steps: what the loop does about them
    # variants of the update on the same rollouts from one snapshot
    "variants": {"config", "snapshot", "tracking", "train_grpo"},
    "train_grpo": {"agents", "npu_ops", "rewards", "tiny_task", "fsdp_utils", "checkpoint", "rollout",
                   "weight_sync", "grpo", "config", "data", "tracking", "episodes", "offload",
                   "partial", "sampler", "distill", "seq_parallel", "hybrid",
                   "batcher", "snapshot", "faults", "trainer"},
}

# A unit holds one thing: a function past about 60 lines, or a class past about 200, holds two.
# Size follows concern for files: a file may grow where that is its one concern.
MAX_FUNCTION_LINES, MAX_CLASS_LINES = 60, 200


def top_level_files():
    return sorted(glob.glob(os.path.join(ROOT, "*.py")))


def product_files():
    """The product's modules: the top level's and the role folders' (their __init__ aside)."""
    return top_level_files() + sorted(
        p for f in FOLDERS for p in glob.glob(os.path.join(ROOT, f, "*.py"))
        if not p.endswith("__init__.py"))


def imports(path):
    """The names of what a file imports: a module of a role folder by its own name
    (`from collect import partial`, `from workflows.distill import DistillConfig`: partial,
    distill), anything else by its first dotted part."""
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] if a.name.split(".")[0] not in FOLDERS
                      else a.name.split(".")[1] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            first, *rest = node.module.split(".")
            if first not in FOLDERS:
                names.add(first)
            else:
                names |= {rest[0]} if rest else {a.name for a in node.names}
    return names


def test_every_product_file_is_known():
    assert {os.path.basename(p)[:-3] for p in product_files()} == set(ALLOWED)


def test_the_core_is_at_the_top_and_the_rest_in_role_folders():
    """At most MAX_TOP_LEVEL modules at the top, every other one in a role folder (a package
    whose __init__ says its role); no other folder holds product code."""
    assert len(top_level_files()) <= MAX_TOP_LEVEL, [os.path.basename(p) for p in
                                                      top_level_files()]
    for folder in FOLDERS:
        with open(os.path.join(ROOT, folder, "__init__.py")) as f:
            assert ast.get_docstring(ast.parse(f.read())), f"{folder}/__init__.py: its role?"
    others = {os.path.relpath(p, ROOT).split(os.sep)[0] for p in
              glob.glob(os.path.join(ROOT, "*", "**", "*.py"), recursive=True)}
    assert others - set(FOLDERS) <= {"tests", "bench", "scripts", "examples", ".venv",
                                     ".venv-npu-torch", ".venv-npu-engine", "runs"}, others


def test_import_dag():
    for path in product_files():
        mod = os.path.basename(path)[:-3]
        project = imports(path) & set(ALLOWED)
        assert project <= ALLOWED[mod], f"{mod} imports {project - ALLOWED[mod]}"
    for mod in ALLOWED:  # and no module imports itself, however far round
        assert mod not in closure(mod), f"{mod} imports itself through {closure(mod)}"


def closure(module: str) -> set:
    """The project modules `module` imports, directly or through others."""
    paths = {os.path.basename(p)[:-3]: p for p in product_files()}
    seen, todo = set(), [module]
    while todo:
        for name in imports(paths[todo.pop()]) & set(paths):
            if name not in seen:
                seen.add(name)
                todo.append(name)
    return seen


def test_the_sampler_needs_none_of_the_actors_machinery():
    """Collecting a rollout imports nothing that trains: the sampler's closure holds the engine,
    the episodes, the algorithm's formulas, never the actor's modules."""
    found = closure("sampler")
    assert {"grpo", "rollout", "episodes"} <= found  # the check sees through imports
    assert not found & {"fsdp_utils", "logprobs", "checkpoint", "offload", "kernels", "hybrid",
                        "trainer", "batcher"}, found


def test_only_rollout_imports_vllm():
    users = [os.path.relpath(p, ROOT) for p in product_files() if "vllm" in imports(p)]
    assert users == ["rollout.py"]


def test_only_fsdp_utils_shards():
    users = [os.path.relpath(p, ROOT) for p in product_files()  # FSDP2's fully_shard, the word
             if re.search(r"\bfully_shard\b", open(p).read())]  # (not vLLM's fully_sharded_loras)
    assert users == ["fsdp_utils.py"]


def test_device_names_only_in_npu_ops():
    """Every Python file of the project outside tests/, at any depth."""
    word = re.compile(r"\b(torch_npu|npu|cuda)\b", re.IGNORECASE)
    files = [p for p in glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True)
             if not os.path.relpath(p, ROOT).startswith(("tests", ".", "runs"))]
    users = sorted(os.path.relpath(p, ROOT) for p in files if word.search(open(p).read()))
    assert users == ["devices/ascend_checks.py", "npu_ops.py"]  # the device layer, its checks


def test_nothing_runs_at_import():
    code = ("import sys, torch.distributed as dist\n"
            "import train_grpo, rollout, weight_sync, fsdp_utils, rewards, npu_ops, trainer\n"
            "import grpo, config, tracking, checkpoint, data, plugins, episodes, logprobs\n"
            "import offload, batcher, sampler, records, faults\n"
            "from collect import agents, envs, openai_api, partial, sandbox\n"
            "from modeling import hybrid, kernels, moe, seq_parallel, vision\n"
            "from workflows import distill, snapshot, variants\n"
            "from tasks import tiny_task\n"
            "assert 'vllm' not in sys.modules, 'vllm imported at import time'\n"
            "assert not dist.is_initialized()\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout == ""


def test_units_stay_short():
    """Every function (method included) of a product module at most MAX_FUNCTION_LINES lines,
    every class at most MAX_CLASS_LINES, docstrings and comments counted."""
    long = []
    for path in product_files():
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
    for path in product_files():
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

