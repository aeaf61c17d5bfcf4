"""The config tree's plumbing: the values each field takes, YAML file and `--section.key=value`
overrides into the dataclass tree, and the walk over its sections' checks.

The tree itself is train_grpo.Config (one dataclass per YAML section, each defined next to the
code that uses it). Each field states its domain in its type, next to its default:

    group_size: Annotated[int, config.Range(2)] = 8  # G: responses sampled per prompt

Precedence: command line > file > defaults. Values are coerced to the field's type (PyYAML reads
1e-6 as a string); an unknown section or key raises with the closest valid name. `validate`
checks every field against its domain (one line naming the field, the value, what it must be
and the default), then lets each section check itself against the rest of the tree (its
dataclass's `check`, raising `BadInput` through `need`) before anything loads; `check_model` and
`check_host_memory` do the same against the model's files and the host's memory.
tests/test_config.py walks the tree and tries values outside each domain (`Domain.outside`), so
a field without a domain, or a domain whose check is gone, fails there. The checks live with
their sections: this module imports none of the sections' modules.
"""

import dataclasses
import difflib
import functools
import json
import math
import numbers
import os
import typing


class BadInput(ValueError):
    """The user's config, data or reward plugin is wrong, found by our own checks before any model
    loads. main() prints it as one line and exits 2; elsewhere (a notebook) it is a ValueError
    like any. Only our checks raise it: an exception from inside another library surfaces as it
    is, with its traceback."""


def need(ok, msg: str) -> None:
    """A section's rule across fields: BadInput "config: msg" (the field, its value, the fix)
    where `ok` is false."""
    if not ok:
        raise BadInput(f"config: {msg}")


class Domain:
    def describe(self) -> str:
        """What the field takes, for `--help` ("must be >= 2", "one of a, b")."""
        raise NotImplementedError

    def problem(self, value) -> str | None:
        """None when `value` is in the domain, else what it must be ("must be >= 2")."""
        raise NotImplementedError

    def outside(self) -> list:
        """Values of the field's type that lie outside the domain (for the tree-walking test)."""
        raise NotImplementedError


class Range(Domain):
    """A finite number in [lo, hi] (None: unbounded; open=True: that end excluded); inf_ok:
    or inf (a limit that is off)."""

    def __init__(self, lo=None, hi=None, lo_open: bool = False, hi_open: bool = False,
                 inf_ok: bool = False):
        self.lo, self.hi, self.lo_open, self.hi_open = lo, hi, lo_open, hi_open
        self.inf_ok = inf_ok

    def describe(self) -> str:
        parts = []
        if self.lo is not None:
            parts.append(f"{'>' if self.lo_open else '>='} {self.lo}")
        if self.hi is not None:
            parts.append(f"{'<' if self.hi_open else '<='} {self.hi}")
        return "must be " + " and ".join(parts or ["a finite number"]) + (
            ", or inf (off)" if self.inf_ok else "")

    def problem(self, value):
        if self.inf_ok and not isinstance(value, bool) and value == math.inf:
            return None
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(
                value):
            return self.describe()
        low = self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo)
        high = self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi)
        return self.describe() if low or high else None

    def outside(self) -> list:
        """For an int field the caller keeps the integers of these."""
        out = []
        if self.lo is not None:
            out += [self.lo if self.lo_open else self.lo - 1, self.lo - 1000]
        if self.hi is not None:
            out += [self.hi if self.hi_open else self.hi + 1, self.hi * 1000 + 1000]
        return out + ([] if self.inf_ok else [math.inf]) + [-math.inf, math.nan]


class OneOf(Domain):
    """One of the options (names, or numbers)."""

    def __init__(self, *options):
        self.options = options

    def describe(self) -> str:
        return f"one of {', '.join(repr(o) if o == '' else str(o) for o in self.options)}"

    def problem(self, value):
        return None if value in self.options else f"use {self.describe()}"

    def outside(self) -> list:
        if all(isinstance(o, int) for o in self.options):
            return [min(self.options) - 1, max(self.options) + 1]
        return ["nope", str(self.options[0]).upper() + "x"]


class Items(Domain):
    """A list whose every item is in `item`."""

    def __init__(self, item: Domain):
        self.item = item

    def describe(self) -> str:
        return f"a list, each item {self.item.describe()}"

    def problem(self, value):
        for i, v in enumerate(value):
            if (p := self.item.problem(v)) is not None:
                return f"item {i} ({v!r}): {p}"
        return None

    def outside(self) -> list:
        return [[v] for v in self.item.outside()]


class Anything(Domain):
    """Every value of the field's type is taken here: `why` says where it is checked, if
    anywhere (a later check that names the field: give it values to refuse in `refused`)."""

    def __init__(self, why: str, refused: tuple = ()):
        self.why, self.refused = why, list(refused)

    def describe(self) -> str:
        return self.why

    def problem(self, value):
        return None

    def outside(self) -> list:
        return self.refused


FLAG = Anything("true or false")
DTYPE = OneOf("float32", "bfloat16", "float16")


def _closest(name: str, options) -> str:
    """" (did you mean 'x'?)" for the likeliest meant option: one whose name is the initials of
    the unknown one's words (learning_rate -> lr), else the closest spelling."""
    options = list(options)
    prefix, _, last = name.rpartition(".")
    initials = "".join(w[0] for w in last.split("_") if w)
    match = [o for o in options if len(initials) > 1 and o == f"{prefix}.{initials}".lstrip(".")]
    match = match or difflib.get_close_matches(name, options, n=1, cutoff=0.0)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _coerce(where: str, value, typ):
    """Convert a YAML or command-line value to the field's type, or fail naming the field."""
    try:
        if typ is bool:
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
                return value.lower() in ("true", "1", "yes")
            if isinstance(value, bool):
                return value
            raise ValueError
        if typ is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(float(value)) if isinstance(value, str) and "e" in value else int(value)
        if typ is float:
            if isinstance(value, bool):
                raise ValueError
            return float(value)  # PyYAML reads 1e-6 as a string
        if typ is str:
            if isinstance(value, (dict, list)):
                raise ValueError
            return str(value).lower() if isinstance(value, bool) else str(value)  # (YAML's true)
        if typing.get_origin(typ) is list:  # a YAML list, or "a,b" / "[a, b]" on the command line
            text = str(value).strip()
            if text.startswith("[") and text.endswith("]"):
                text = text[1:-1]
            items = value if isinstance(value, list) else [
                v.strip() for v in text.split(",") if v.strip()]
            return [_coerce(where, item, typing.get_args(typ)[0]) for item in items]
    except (TypeError, ValueError):
        pass
    raise BadInput(f"config {where}: expected {getattr(typ, '__name__', typ)}, got {value!r}")


def load(tree: type, path: str | None = None, overrides: list[str] = ()):
    """An instance of the dataclass `tree` (one field per section): defaults < YAML file <
    `--section.key=value` overrides. Unknown keys and bad types raise."""
    import yaml

    raw = {}
    if path is not None:
        if not os.path.isfile(path):
            raise BadInput(f"config file not found: {path}. Fix: give the path of a "
                                    "YAML file, e.g. --config configs/tiny_cpu.yaml")
        with open(path) as f:
            try:
                raw = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:  # one line: where and what, not the parser's traceback
                mark = getattr(e, "problem_mark", None)
                where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
                problem = getattr(e, "problem", None) or str(e).splitlines()[0]
                raise BadInput(f"config {path}:{where}: not valid YAML ({problem}). Fix the "
                                 "file there (indentation, a missing ':' or quote)") from None
        if not isinstance(raw, dict):
            raise BadInput(f"config {path}: expected sections (model:, optim:, ...) at top level")
    pairs = [(f"{sec}.{key}", val) for sec, body in raw.items()
             for key, val in (body.items() if isinstance(body, dict) else [(None, body)])]
    pairs = [p for dotted, val in pairs for p in _flatten(tree, dotted, val)]
    return _set(tree(), pairs + _override_pairs(overrides))


def override(cfg, overrides: list[str]):
    """A copy of the config tree `cfg` with `--section.key=value` overrides applied, checked as
    `load` checks them (a variant of a run's config: variants.py)."""
    import copy

    return _set(copy.deepcopy(cfg), _override_pairs(overrides))


def _override_pairs(overrides: list[str]) -> list[tuple[str, str]]:
    """("section.key", value) of each `--section.key=value` (or `--section.key value`)."""
    pairs, args = [], list(overrides)
    while args:
        arg = args.pop(0)
        if not arg.startswith("--") or "." not in arg:
            raise BadInput(f"bad override {arg!r}: use --section.key=value")
        key, eq, val = arg[2:].partition("=")
        if not eq:
            if not args:
                raise BadInput(f"override {arg} has no value")
            val = args.pop(0)
        pairs.append((key, val))
    return pairs


def _set(cfg, pairs: list):
    """`cfg` (a config tree) with each (dotted key, value) of `pairs` coerced and set in order.
    Unknown keys and bad types raise."""
    sections = {f.name: f for f in dataclasses.fields(type(cfg))}
    for dotted, val in pairs:
        sec, _, key = dotted.partition(".")
        if sec not in sections:
            raise BadInput(f"unknown config section '{sec}'{_closest(sec, sections)}")
        if not key or key == "None":
            raise BadInput(f"config section '{sec}' must be a mapping of keys to values")
        section, where = getattr(cfg, sec), sec
        *inner, key = key.split(".")  # a sub-section's key: rollout.partial.round_tokens
        for name in inner:
            if not dataclasses.is_dataclass(getattr(section, name, None)):
                break
            section, where = getattr(section, name), f"{where}.{name}"
        hints = typing.get_type_hints(type(section))
        if f"{where}.{key}" != dotted or key not in hints:
            valid = [name for name, *_ in fields(cfg) if name.startswith(f"{sec}.")]
            raise BadInput(f"unknown config key '{dotted}'{_closest(dotted, valid)}")
        if dataclasses.is_dataclass(getattr(section, key)):
            keys = ", ".join(f.name for f in dataclasses.fields(getattr(section, key)))
            raise BadInput(f"config {dotted}: a section of its own; set its keys ({keys}), e.g. "
                           f"--{dotted}.{dataclasses.fields(getattr(section, key))[0].name}=...")
        setattr(section, key, _coerce(dotted, val, hints[key]))
    return cfg


def _flatten(tree: type, dotted: str, val) -> list:
    """A YAML mapping under a sub-section's name (rollout: {partial: {round_tokens: 16}}) as
    its dotted keys; any other value as it is."""
    node = tree()
    for name in dotted.split("."):
        node = getattr(node, name, None)
    if not (dataclasses.is_dataclass(node) and isinstance(val, dict)):
        return [(dotted, val)]
    return [p for key, inner in val.items() for p in _flatten(tree, f"{dotted}.{key}", inner)]


def fields(cfg):
    """(section.key, value, domain, default) of every field of the config tree `cfg`, the domain
    read from the field's type (`Domain`); a field without one is a TypeError. A sub-section
    (a dataclass field of a section, as rollout.partial) yields its own fields, dotted."""
    for sec in dataclasses.fields(cfg):
        yield from _section_fields(getattr(cfg, sec.name), sec.name)


def _section_fields(section, name: str):
    hints = typing.get_type_hints(type(section), include_extras=True)
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            yield from _section_fields(value, f"{name}.{f.name}")
            continue
        found = [a for a in getattr(hints[f.name], "__metadata__", ())
                 if isinstance(a, Domain)]
        if not found:
            raise TypeError(f"config field {name}.{f.name} states no domain: annotate it "
                            "as Annotated[type, config.X(...)] (config.py)")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        yield f"{name}.{f.name}", value, found[0], default


def live_fields(cfg) -> set[str]:
    """The dotted names of the fields a built run takes a change of between steps: those its
    section's dataclass names in its LIVE (train_grpo.configure applies them to every part that
    uses them); the run built a part of its own with each other field at setup."""
    out = set()
    for f in dataclasses.fields(cfg):
        out |= _live(getattr(cfg, f.name), f.name)
    return out


def _live(section, name: str) -> set[str]:
    out = {f"{name}.{key}" for key in getattr(type(section), "LIVE", ())}
    for f in dataclasses.fields(section):
        if dataclasses.is_dataclass(value := getattr(section, f.name)):
            out |= _live(value, f"{name}.{f.name}")
    return out


def field_comments(section: type) -> dict[str, str]:
    """{field: its comment} of a section's dataclass, read from its source: the comment lines
    just above the field, the comment on its own line, and the `#   ` lines that continue it."""
    import ast
    import inspect
    import io
    import textwrap
    import tokenize

    source = textwrap.dedent(inspect.getsource(section))
    comments = {t.start[0]: t.string for t in tokenize.generate_tokens(io.StringIO(source).readline)
                if t.type == tokenize.COMMENT}
    lines = source.splitlines()  # lines[k - 1] is line k, as ast and tokenize count
    out, previous = {}, None
    for node in ast.parse(source).body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, k = [], node.lineno - 1  # the comment-only lines right above the field
        while k in comments and lines[k - 1].lstrip().startswith("#"):
            above.insert(0, k)
            k -= 1
        while above and comments[above[0]].startswith("#   ") and previous is not None:
            out[previous] += " " + comments[above.pop(0)][1:].strip()  # continues the last one
        own = [comments[i] for i in range(node.lineno, node.end_lineno + 1) if i in comments]
        text = [comments[i][1:].strip() for i in above] + [c[1:].strip() for c in own]
        out[node.target.id], previous = " ".join(text), node.target.id
    return out


def help_text(tree: type, section: str | None = None) -> str:
    """Every field of the config tree (one section's, with `section`), by section: its
    `--section.key=default`, what it takes (its domain) and its comment in the source."""
    cfg, rows = tree(), []
    names = {f.name for f in dataclasses.fields(tree)}
    if section is not None and section not in names:
        raise BadInput(f"--help {section}: no such section{_closest(section, names)}; the "
                       f"sections: {', '.join(sorted(names))}")
    import inspect

    comments, last = {}, None
    for name, value, domain, default in fields(cfg):
        *path, key = name.split(".")
        if section is not None and path[0] != section:
            continue
        owner = type(functools.reduce(getattr, path, cfg))
        if owner not in comments:
            comments[owner] = field_comments(owner)
        if ".".join(path) != last:
            last = ".".join(path)
            where = os.path.basename(inspect.getfile(owner))  # (train_grpo.py run as __main__)
            rows.append(f"\n{last}: ({owner.__name__}, {where})")
        rows.append(f"  --{name}={json.dumps(default)}  [{domain.describe()}]")
        if comments[owner].get(key):
            rows.append(f"      {comments[owner][key]}")
    return "\n".join(rows).lstrip("\n")


def _sections(cfg):
    """Every section of the config tree `cfg`, each before its sub-sections (model, model.lora,
    optim, rollout, rollout.partial, ...): the order in which their checks run."""
    for f in dataclasses.fields(cfg):
        if dataclasses.is_dataclass(section := getattr(cfg, f.name)):
            yield section
            yield from _sections(section)


def validate(cfg, world_size: int) -> None:
    """Checks that need no model: fail in a second, not after minutes of loading. `cfg` resolved
    (train_grpo.prepare: presets and the tiny task's paths filled in). Every field against its
    domain, then each section's `check(cfg, world_size)`, defined on its dataclass next to the
    code that uses it: its rules across its fields and the other sections', where a ValueError
    (the section's own module's, as rewards.validate's) becomes BadInput."""
    for name, value, domain, default in fields(cfg):
        if (problem := domain.problem(value)) is not None:
            raise BadInput(f"config: {name}={value!r}: {problem}. Fix: change {name}, or leave "
                           f"it out for its default {default!r}")
    for section in _sections(cfg):
        if hasattr(section, "check"):
            try:
                section.check(cfg, world_size)
            except ValueError as e:
                raise BadInput(str(e)) from None


def check_model(cfg) -> None:
    """The checks that need the model's own files, read without loading it (config.json and the
    tokenizer's files, never the weights): each section's `check_model(cfg, text)`, `text` the
    config.json's language part; as rollout.max_model_len within the model's positions, or a
    chat template where data.chat_template asks for one. Each raises BadInput itself, so an
    error inside another library (a file that does not parse) keeps its traceback. A
    model.path that is a hub id, not a directory, is left to the loaders."""
    path = os.path.join(cfg.model.path, "config.json")
    if not os.path.isfile(path):
        return
    with open(path) as f:
        text = json.load(f)
    text = text.get("text_config", text)  # a multimodal model's language part
    for section in _sections(cfg):
        if hasattr(section, "check_model"):
            section.check_model(cfg, text)


def check_host_memory(cfg, world_size: int) -> None:
    """BadInput if this node's ranks cannot hold in host memory what the run parks there (the
    actor and its Adam state with model.offload, a reference, a teacher): each section's
    `check_host_memory(cfg, world_size)` (fsdp_utils.ModelConfig's)."""
    for section in _sections(cfg):
        if hasattr(section, "check_host_memory"):
            section.check_host_memory(cfg, world_size)
