"""The docs against the code: README.md and every page of docs/.

- Names: every name in inline backticks whose first part is a top-level module of the repo
  (`grpo.grpo_loss`, `rollout.Engine.stream`) resolves in the code, or is a field of the config
  tree (`grpo.kl_coef`, `rollout.partial.round_tokens`); every `--section.key=value` names a
  field. Names in fenced blocks are left alone.
- Paths: every path of this repo named in backticks (`bench/step.py`, `configs/tiny_cpu.yaml`,
  `sandbox_child.py`) exists. Another project's file is named from its own directory
  (`v1/worker/gpu_worker.py`, `torch/distributed/...`), which is no directory of this repo.
- Links: every relative link reaches its file and heading; every docs page is linked from the
  README.
- Commands: every command line of a ```sh block (the commands that run as written on a CPU-only
  Linux machine from a fresh clone) has a shape in `check_command`, and its parts check out: the
  config loads and passes config.validate, a bench's flags are in its --help, a script parses, a
  test file is there. The commands are checked, not run: a training run takes minutes, and
  tests/test_e2e.py and tests/test_bench.py run the same configs and benches; only `--help` runs.
  Commands that need a GPU, an NPU, a second node, the network or a file the reader writes first
  go in ```text blocks, which no test reads.
"""

import ast
import dataclasses
import functools
import glob
import importlib
import inspect
import os
import re
import shlex
import subprocess

import pytest

from conftest import ROOT, run_python

pytestmark = pytest.mark.main_only  # the docs against the code: no library version enters it

PAGES = ["README.md", *sorted(os.path.relpath(p, ROOT) for p in glob.glob(f"{ROOT}/docs/*.md"))]
# the product's modules by the name call sites use (`partial.PartialRollout`), and where each is
MODULES = {os.path.relpath(p, ROOT)[:-3].split(os.sep)[-1]: os.path.relpath(p, ROOT)[:-3].replace(
    os.sep, ".") for p in glob.glob(f"{ROOT}/*.py") + glob.glob(f"{ROOT}/*/*.py")
    if os.path.relpath(p, ROOT).split(os.sep)[0] in ("collect", "modeling", "workflows", "devices",
                                                     "tasks") or os.sep not in os.path.relpath(p, ROOT)}
MODULES.pop("__init__", None)
ROOT_ENTRIES = set(os.listdir(ROOT)) - {".git", ".venv", "__pycache__", "runs"}
CHECKED_EXT = (".py", ".yaml", ".sh", ".md", ".txt")  # a bare name with these must be a file here
FILE_EXT = CHECKED_EXT + (".json", ".jsonl", ".safetensors", ".pt", ".png", ".cpp", ".parquet")
PYTHON = re.compile(r"^(python3?(\.\d+)?|\.venv[\w-]*/bin/python3?)$")
TORCHRUN = re.compile(r"^(\.venv[\w-]*/bin/)?torchrun$")

# Dotted names that start like a config section but name something else, with where they are used
NOT_CONFIG = {
    "model.layers", "model.embed_tokens.weight",  # a Hugging Face model's modules (platforms.md)
}


# ----------------------------------------------------------------------------------------------
# reading the pages


def read(page: str) -> str:
    with open(os.path.join(ROOT, page)) as f:
        return f.read()


def blocks(text: str) -> list[tuple[str | None, str]]:
    """(info, text) of a Markdown page in order: the prose between fences (info None) and each
    fenced block with its info string ("sh", "text", "python", ...)."""
    out, prose, fence, info, body = [], [], None, None, []
    for line in text.splitlines():
        opening = re.match(r"^ {0,3}(`{3,}|~{3,})\s*([\w+-]*)", line)
        if fence is None and opening:
            out.append((None, "\n".join(prose)))
            prose, fence, info, body = [], opening.group(1), opening.group(2), []
        elif fence is not None and re.match(rf"^ {{0,3}}{fence[0]}{{{len(fence)},}}\s*$", line):
            out.append((info, "\n".join(body)))
            fence = None
        elif fence is not None:
            body.append(line)
        else:
            prose.append(line)
    out.append((None, "\n".join(prose)))
    return out


def prose(page: str) -> str:
    return "\n".join(text for info, text in blocks(read(page)) if info is None)


def inline_code(page: str) -> list[str]:
    """The inline code spans of a page's prose and tables (`x`, or ``` ``x`` ``` around a
    backtick), not those of its fenced blocks."""
    return [m.group(2).strip() for m in
            re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", prose(page), re.DOTALL)]


# ----------------------------------------------------------------------------------------------
# names and paths


def config_field(parts: list[str]) -> bool:
    """`parts` is a field (or a sub-section) of train_grpo.Config: ["grpo", "kl_coef"]."""
    import train_grpo

    node = train_grpo.Config()
    for p in parts:
        if not dataclasses.is_dataclass(node) or p not in {f.name for f in
                                                           dataclasses.fields(node)}:
            return False
        node = getattr(node, p)
    return True


@functools.cache
def instance_attributes(cls: type) -> set[str]:
    """The attributes a class's methods assign on self (self.x = ..., self.x, self.y = ...)."""
    try:
        tree = ast.parse(inspect.getsource(cls).lstrip())
    except (OSError, TypeError):
        return set()
    return {node.attr for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
            and node.value.id == "self" and isinstance(node.ctx, ast.Store)}


def attribute_path(obj, parts: list[str]) -> bool:
    """getattr down `parts`; as the last part, a class's dataclass fields and the attributes its
    methods set on self count too (they exist on instances only)."""
    for i, p in enumerate(parts):
        if hasattr(obj, p):
            obj = getattr(obj, p)
            continue
        fields = getattr(obj, "__dataclass_fields__", {})
        return (i == len(parts) - 1 and isinstance(obj, type)
                and (p in fields or p in instance_attributes(obj)))
    return True


def resolves(name: str) -> bool:
    parts = name.split(".")
    if parts[0] in MODULES and attribute_path(importlib.import_module(MODULES[parts[0]]),
                                              parts[1:]):
        return True
    return config_field(parts) or name in NOT_CONFIG


def classify(span: str) -> tuple[str | None, str]:
    """("flag", section.key) | ("path", path) | ("name", dotted) | (None, span) for an inline code
    span. A call's name counts: `sandbox.missing()`, `grpo.grpo_loss(logp, t, cfg)`."""
    if m := re.fullmatch(r"--([a-z_]+(?:\.[a-z_]+)+)(?:[= ].*)?", span, re.DOTALL):
        return "flag", m.group(1)
    if re.fullmatch(r"[\w./{}-]+", span) and ("/" in span or span.endswith(FILE_EXT)):
        return "path", span
    if m := re.fullmatch(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(\(.*\))?", span, re.DOTALL):
        return "name", m.group(1)
    return None, span


@functools.cache
def repo_files() -> tuple[str, ...]:
    """The repo's files, tracked or new (not ignored)."""
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return tuple(out.split())


@functools.cache
def code_strings() -> set[str]:
    """The string constants of the root modules: the files a run writes ("config.yaml")."""
    out = set()
    for path in {os.path.join(ROOT, *m.split(".")) + ".py" for m in MODULES.values()}:
        with open(path) as f:
            out |= {n.value for n in ast.walk(ast.parse(f.read()))
                    if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return out


def path_problem(path: str) -> str | None:
    """What is wrong with a path named in a page, or None. A path is this repo's when it starts
    with one of the repo's root entries (tests/, bench/, .ci/, ...): it must exist. A bare file
    name with one of CHECKED_EXT must be a file somewhere in the repo, or one the code names (the
    run directory's "config.yaml"). Any other path (`v1/worker/gpu_worker.py`) is another
    project's."""
    path = path.split(":")[0].rstrip("/")  # path/to/file.py:function
    if path.startswith(("/", "../", "~")) or "{" in path:
        return None
    if "/" in path:
        if path.split("/")[0] in ROOT_ENTRIES and not os.path.exists(os.path.join(ROOT, path)):
            return "no such file or directory in the repo"
        return None
    in_repo = any(f == path or f.endswith("/" + path) for f in repo_files())
    if path.endswith(CHECKED_EXT) and not in_repo and path not in code_strings():
        return "no such file in the repo (name another project's file with its directory)"
    return None


def unresolved(page: str, checked: dict) -> list[str]:
    """The problems of a page's inline code spans; what was checked goes into `checked`."""
    bad = []
    for span in inline_code(page):
        kind, what = classify(span)
        first = what.split(".")[:1]
        if kind == "name" and (first[0] in MODULES or config_field(first)):
            checked["names"].add(what)
            if not resolves(what):
                bad.append(f"{page}: `{span}`: {what} is no attribute of the code nor a "
                           "config field")
        elif kind == "flag" and config_field(first):
            checked["flags"].add(what)
            if not config_field(what.split(".")):
                bad.append(f"{page}: `{span}`: {what} is no field of train_grpo.Config")
        elif kind == "path":
            checked["paths"].add(what)
            if problem := path_problem(what):
                bad.append(f"{page}: `{span}`: {problem}")
    return bad


def test_names_in_backticks_exist():
    checked = {"names": set(), "flags": set(), "paths": set()}
    bad = [b for page in PAGES for b in unresolved(page, checked)]
    print(f"pages: {', '.join(PAGES)}")
    for kind, names in checked.items():
        print(f"{kind} checked ({len(names)}): {', '.join(sorted(names))}")
    assert checked["names"] and checked["paths"]  # the parsing found what it looks for
    assert not bad, f"{len(bad)} unresolved:\n" + "\n".join(bad)


def test_the_name_check_catches_a_stale_name():
    """The checks themselves: what a page could get wrong is reported, what is right is not."""
    assert resolves("grpo.grpo_loss") and resolves("grpo.kl_coef")
    assert resolves("records.Sample.versions") and resolves("weight_sync.EngineTurn.metrics")
    assert resolves("rollout.partial.round_tokens")
    assert not resolves("grpo.no_such_loss") and not resolves("rollout.partial.no_such_field")
    assert path_problem("bench/no_such_bench.py") and path_problem("no_such_module.py")
    assert not path_problem("bench/step.py") and not path_problem("v1/worker/gpu_worker.py")
    assert classify("sandbox.missing()") == ("name", "sandbox.missing")
    assert classify("config.json")[0] == "path"
    assert classify("--optim.lr=1e-6") == ("flag", "optim.lr")


def function_body(fn) -> str:
    """A function's statements after its docstring, dedented, as its source file has them."""
    import textwrap

    source = textwrap.dedent(inspect.getsource(fn))
    node = ast.parse(source).body[0]
    first = node.body[1] if ast.get_docstring(node) is not None else node.body[0]
    return textwrap.dedent("\n".join(source.splitlines()[first.lineno - 1:node.end_lineno]))


def readme_step() -> str:
    """The python block of the README's "One step" section."""
    section = read("README.md").split("\n## One step\n")[1].split("\n## ")[0]
    return next(code for info, code in blocks(section) if info == "python")


def test_the_readme_step_is_train_step():
    """The README's "One step" block is train_step's body, line for line: the step a reader
    sees on the front page is the one that runs."""
    import train_grpo

    body = function_body(train_grpo.train_step)
    assert body.count("\n") >= 10  # the parsing found the function's statements
    assert readme_step().strip() == body.strip()
    assert function_body(train_grpo.log_step).strip() != body.strip()  # the check tells apart


# ----------------------------------------------------------------------------------------------
# links


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: str) -> set[str]:
    seen, out = {}, set()
    for heading in re.findall(r"^#{1,6} +(.+?) *#*$", prose(page), re.MULTILINE):
        base = slug(heading)
        out.add(f"{base}-{seen[base]}" if base in seen else base)  # a repeat gets -1, -2, ...
        seen[base] = seen.get(base, 0) + 1
    return out


def test_relative_links_resolve():
    """Every relative link of the README and docs/ reaches a file, and its #anchor a heading."""
    bad, count = [], 0
    for page in PAGES:
        for target in re.findall(r"\]\(\s*<?([^)\s>]+)", prose(page)):
            if re.match(r"[a-z]+:", target):  # https:, mailto:
                continue
            count += 1
            path, _, anchor = target.partition("#")
            file = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(os.path.join(ROOT, file)):
                bad.append(f"{page}: ({target}): no file {file}")
            elif anchor and file.endswith(".md") and anchor not in anchors(file):
                bad.append(f"{page}: ({target}): no heading #{anchor} in {file}")
    print(f"{count} relative links checked")
    assert not bad, f"{len(bad)} broken links:\n" + "\n".join(bad)


def test_every_page_is_linked_from_the_readme():
    targets = {os.path.normpath(t) for t in re.findall(r"\]\(\s*<?([^)#\s>]+)", prose("README.md"))}
    missing = [p for p in PAGES[1:] if os.path.normpath(p) not in targets]
    assert not missing, f"docs pages the README does not link to: {missing}"


# ----------------------------------------------------------------------------------------------
# commands


def command_lines(text: str) -> list[list[str]]:
    """A ```sh block's commands as words: lines ending in a backslash joined, comments and blank
    lines skipped, `a && b`, `a || b`, `a; b` and `a | b` split."""
    out = []
    for line in re.sub(r"\\\n", " ", text).splitlines():
        cmd = []
        for word in shlex.split(line, comments=True) + ["&&"]:
            if word in ("&&", "||", ";", "|"):
                out += [cmd] if cmd else []
                cmd = []
            else:
                cmd.append(word)
    return out


def sh_commands() -> list[tuple[str, list[str]]]:
    return [(page, cmd) for page in PAGES for info, text in blocks(read(page))
            if info == "sh" for cmd in command_lines(text)]


@functools.cache
def run_help(*args: str) -> tuple[int, str]:
    """`python ARGS` in the repo (a --help): its exit code and output."""
    proc = run_python(list(args), timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def option(args: list[str], name: str, default=None):
    """The value of `--name V` or `--name=V` in args."""
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return default


def flags(args: list[str]) -> list[str]:
    """The flags of a command's arguments, without their values: --steps, -o."""
    return [a.split("=")[0] for a in args if a.startswith("-")]


def check_training(args: list[str], nproc: int, tiny_task_dir: str) -> str:
    """train_grpo.py ARGS: --help [SECTION] runs; else the --config file exists, loads with the
    overrides (unknown keys and bad types raise) and, resolved as setup() resolves it (the tiny
    task fixture standing in for data.tiny_task_dir), passes config.validate at the world size."""
    import config
    import train_grpo

    if args[:1] in (["--help"], ["-h"]):
        rc, out = run_help("train_grpo.py", *args)
        assert rc == 0, out[-2000:]
        return "train_grpo.py --help"
    path = option(args, "--config")
    assert path and os.path.isfile(os.path.join(ROOT, path)), f"--config {path}: no such file"
    at = args.index("--config") if "--config" in args else None
    overrides = [a for i, a in enumerate(args)
                 if not a.startswith("--config") and (at is None or i != at + 1)]
    cwd = os.getcwd()
    os.chdir(ROOT)  # the paths of a command are the repo's
    try:
        cfg = train_grpo.load_config(path, overrides)
        if cfg.data.tiny_task_dir:
            cfg.data.tiny_task_dir = tiny_task_dir
        config.validate(train_grpo.resolve(cfg), nproc)
    finally:
        os.chdir(cwd)
    return "train_grpo.py"


def check_bench(script: str, args: list[str]) -> str:
    """bench/X.py ARGS: the file exists and has argparse, and every flag is in its --help; the
    --section.key=value ones (bench/step.py hands the flags it does not know to the config) load
    in train_grpo's config."""
    import train_grpo

    assert os.path.isfile(os.path.join(ROOT, script)), f"{script}: no such file"
    with open(os.path.join(ROOT, script)) as f:
        source = f.read()
    assert "argparse" in source, f"{script} has no argparse: its flags cannot be checked"
    rc, out = run_help(script, "--help")
    assert rc == 0, out[-2000:]
    dotted = [a for a in args if re.match(r"--[a-z_]+\.", a)]
    for flag in flags([a for a in args if a not in dotted]):
        assert re.search(rf"(^|[\s,\[]){re.escape(flag)}\b", out), f"{script}: no {flag} in --help"
    if dotted:
        assert "parse_known_args" in source, f"{script} takes no config overrides"
        path = option(args, "--config", "configs/tiny_cpu.yaml")  # bench/step.py's default
        train_grpo.load_config(os.path.join(ROOT, path), dotted)
    return "bench"


def check_python_script(script: str, args: list[str]) -> str:
    """scripts/X.py ARGS: the file exists, --help exits 0, every flag is in it."""
    assert os.path.isfile(os.path.join(ROOT, script)), f"{script}: no such file"
    rc, out = run_help(script, "--help")
    assert rc == 0, out[-2000:]
    for flag in flags(args):
        assert flag in out, f"{script}: no {flag} in --help"
    return "script"


def check_shell_script(script: str, args: list[str]) -> str:
    """bash scripts/X.sh ARGS: the script exists, `bash -n` parses it, it names every flag."""
    assert os.path.isfile(os.path.join(ROOT, script)), f"{script}: no such file"
    proc = subprocess.run(["bash", "-n", script], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, f"bash -n {script}: {proc.stderr}"
    with open(os.path.join(ROOT, script)) as f:
        source = f.read()
    for flag in flags(args):
        assert flag in source, f"{script} takes no {flag}"
    return "bash script"


def check_pytest(args: list[str]) -> str:
    """python -m pytest ARGS: the test files named exist, a -m expression's markers are in
    pytest.ini."""
    for a in args:
        if a.startswith("tests") or a.endswith(".py"):
            assert os.path.exists(os.path.join(ROOT, a.split("::")[0])), f"{a}: no such test"
    if (marks := option(args, "-m")) is not None:
        with open(os.path.join(ROOT, "pytest.ini")) as f:
            known = re.findall(r"^\s{4}(\w+):", f.read(), re.MULTILINE)
        for word in set(re.findall(r"\w+", marks)) - {"and", "or", "not"}:
            assert word in known, f"-m {marks!r}: no marker {word} in pytest.ini"
    return "pytest"


def check_variants(args: list[str], nproc: int, tiny_task_dir: str) -> str:
    """python -m workflows.variants ARGS: --help runs; the run's --config and overrides check out as
    check_training's do, and each --variant's overrides load on that config."""
    import config
    import train_grpo
    from workflows import variants

    rc, out = run_help("-m", "workflows.variants", "--help")
    assert rc == 0, out[-2000:]
    known, overrides = variants.parser().parse_known_args(args)
    check_training(["--config", known.config, *overrides], nproc, tiny_task_dir)
    cfg = train_grpo.load_config(os.path.join(ROOT, known.config), overrides)
    for text in known.variant:
        config.override(cfg, variants.parse_variant(text)[1])
    return "workflows.variants"


def check_script(script: str, args: list[str], nproc: int, tiny_task_dir: str) -> str:
    """`python SCRIPT ARGS` or `torchrun ... SCRIPT ARGS`, by script."""
    if script == "train_grpo.py":
        return check_training(args, nproc, tiny_task_dir)
    if script.startswith("bench/"):
        return check_bench(script, args)
    if script.startswith("scripts/") and script.endswith(".py"):
        return check_python_script(script, args)
    raise AssertionError(f"no rule for running {script}: add one to tests/test_docs.py")


def check_command(cmd: list[str], tiny_task_dir: str) -> str:
    """Check one command against the rule for its shape; returns the shape. AssertionError (or
    the config's BadInput) when it is wrong, or of a shape with no rule."""
    while cmd and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", cmd[0]):  # VAR=value before a command
        cmd = cmd[1:]
    head, args = cmd[0], cmd[1:]
    python = bool(PYTHON.match(head))
    if head in ("cd", "export", "source", ".") or cmd[:2] == ["git", "clone"]:
        return head
    if head == "pip" or (python and args[:2] == ["-m", "pip"]):
        if (req := option(cmd, "-r")) is not None:
            assert os.path.isfile(os.path.join(ROOT, req)), f"pip install -r {req}: no such file"
        return "pip"
    if head == "bash":
        return check_shell_script(args[0], args[1:])
    if TORCHRUN.match(head) or (python and args[:2] == ["-m", "torch.distributed.run"]):
        args = args if TORCHRUN.match(head) else args[2:]
        at = next(i for i, a in enumerate(args) if a.endswith(".py"))
        launcher = args[:at]
        nproc = int(option(launcher, "--nproc_per_node", 1)) * int(option(launcher, "--nnodes", 1))
        return check_script(args[at], args[at + 1:], nproc, tiny_task_dir)
    if python and args[:2] == ["-m", "pytest"]:
        return check_pytest(args[2:])
    if python and args[:2] == ["-m", "workflows.variants"]:
        return check_variants(args[2:], 1, tiny_task_dir)
    if python and args[:1] == ["-c"]:
        compile(args[1], "<python -c>", "exec")
        return "python -c"
    if python and args and args[0].endswith(".py"):
        return check_script(args[0], args[1:], 1, tiny_task_dir)
    raise AssertionError("no rule for this kind of command: add one to tests/test_docs.py")


def test_cpu_commands_are_checked(tiny_task_dir):
    """Every ```sh command of the README and docs/ has a shape this test knows, and checks out
    (checked, not run: see the module's docstring)."""
    commands, bad = sh_commands(), []
    for page, cmd in commands:
        line = shlex.join(cmd)
        try:
            kind = check_command(cmd, tiny_task_dir)
            print(f"ok  {kind:15} {page}: {line}")
        except Exception as e:  # noqa: BLE001  (every bad line is listed, not only the first)
            bad.append(f"{page}: {line}\n    {type(e).__name__}: {str(e).splitlines()[0]}")
    assert commands, "no ```sh block found"
    assert not bad, f"{len(bad)} of {len(commands)} commands fail:\n" + "\n".join(bad)
