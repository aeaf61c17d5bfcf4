"""Config plumbing: YAML file and `--section.key=value` overrides into a dataclass tree, and the
checks that need no model.

The tree itself is train_grpo.Config (one dataclass per YAML section, each defined next to the
code that uses it). Precedence: command line > file > defaults. Values are coerced to the field's
type (PyYAML reads 1e-6 as a string); an unknown section or key raises with the closest valid
name; `validate` checks the cross-section constraints before anything loads.
"""

import dataclasses
import difflib
import os
import typing

import torch

import episodes
import grpo
import npu_ops
import offload
import rewards


class BadInput(ValueError):
    """The user's config, data or reward plugin is wrong, found by our own checks before any model
    loads. main() prints it as one line and exits 2; elsewhere (a notebook) it is a ValueError
    like any. Only our checks raise it: an exception from inside another library surfaces as it
    is, with its traceback."""


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
            return str(value)
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
    args = list(overrides)
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

    cfg = tree()
    sections = {f.name: f for f in dataclasses.fields(tree)}
    for dotted, val in pairs:
        sec, _, key = dotted.partition(".")
        if sec not in sections:
            raise BadInput(f"unknown config section '{sec}'{_closest(sec, sections)}")
        if not key or key == "None":
            raise BadInput(f"config section '{sec}' must be a mapping of keys to values")
        section = getattr(cfg, sec)
        hints = typing.get_type_hints(type(section))
        if key not in hints:
            valid = [f"{sec}.{k}" for k in hints]
            raise BadInput(f"unknown config key '{dotted}'{_closest(dotted, valid)}")
        setattr(section, key, _coerce(dotted, val, hints[key]))
    return cfg


def validate(cfg, world_size: int) -> None:
    """Checks that need no model: fail in a second, not after minutes of loading."""
    r, g = cfg.rollout, cfg.grpo

    def need(ok, msg):
        if not ok:
            raise BadInput(f"config: {msg}")

    need(r.tp_size >= 1 and world_size % r.tp_size == 0,
         f"rollout.tp_size={r.tp_size} must divide the world size {world_size}")
    engines = world_size // r.tp_size
    need(g.group_size >= 2, f"grpo.group_size={g.group_size}: needs >= 2 to form an advantage")
    need(g.prompts_per_step % engines == 0,
         f"grpo.prompts_per_step={g.prompts_per_step} must be a multiple of the number of engine "
         f"groups (world {world_size} / rollout.tp_size {r.tp_size} = {engines})")
    need(g.prompts_per_step // engines * g.group_size % r.tp_size == 0,
         "the samples of one engine group (prompts_per_step / engines * group_size) must split "
         f"evenly over its {r.tp_size} tensor-parallel ranks")
    need(r.max_new_tokens < r.max_model_len,
         f"rollout.max_new_tokens={r.max_new_tokens} must be below rollout.max_model_len")
    need(cfg.data.max_prompt_len + r.max_new_tokens <= r.max_model_len,
         f"data.max_prompt_len + rollout.max_new_tokens must be <= rollout.max_model_len "
         f"({cfg.data.max_prompt_len} + {r.max_new_tokens} > {r.max_model_len})")
    per_rank = g.prompts_per_step // engines * g.group_size // r.tp_size
    for key, options in (("loss_agg", grpo.LOSS_AGGS), ("kl_estimator", ("k1", "k2", "k3")),
                         ("is_correction", ("none", "tis", "seq_mask")),
                         ("overlong", ("none", "mask", "penalty"))):
        need(getattr(g, key) in options, f"grpo.{key}='{getattr(g, key)}': use one of {options}")
    need(0 <= g.clip_low < 1 and g.clip_high >= 0,
         f"grpo.clip_low={g.clip_low} must be in [0, 1) and grpo.clip_high={g.clip_high} >= 0")
    need(g.ppo_epochs >= 1 and 1 <= g.mini_batches <= per_rank,
         f"grpo.ppo_epochs={g.ppo_epochs} must be >= 1 and grpo.mini_batches={g.mini_batches} "
         f"between 1 and the samples per rank ({per_rank})")
    need(g.kl_coef >= 0, f"grpo.kl_coef={g.kl_coef} must be >= 0 (0 turns the KL term off)")
    need(g.is_cap > 1, f"grpo.is_cap={g.is_cap} must be > 1")
    need(g.max_gen_rounds == 1 or (g.dynamic_sampling and g.max_gen_rounds > 1),
         f"grpo.max_gen_rounds={g.max_gen_rounds}: more than 1 needs grpo.dynamic_sampling=true")
    need(g.overlong != "penalty" or 0 < g.overlong_buffer <= r.max_new_tokens,
         f"grpo.overlong=penalty needs 0 < grpo.overlong_buffer <= rollout.max_new_tokens "
         f"({r.max_new_tokens}); got {g.overlong_buffer}")
    need(r.sleep_level in (1, 2), f"rollout.sleep_level={r.sleep_level}: use 1 or 2")
    need(r.sync_by in ("tensor", "unit"), f"rollout.sync_by='{r.sync_by}': use unit or tensor")
    need(cfg.model.offload in ("auto", "on", "off"),
         f"model.offload='{cfg.model.offload}': use auto, on or off")
    need(cfg.optim.schedule in ("constant", "cosine"),
         f"optim.schedule='{cfg.optim.schedule}': use constant or cosine")
    need(cfg.optim.lr > 0 and cfg.train.steps >= 1, "optim.lr and train.steps must be positive")
    for name in ("model.param_dtype", "model.reduce_dtype", "rollout.dtype"):
        sec, key = name.split(".")
        need(isinstance(getattr(torch, getattr(getattr(cfg, sec), key), None), torch.dtype),
             f"{name}='{getattr(getattr(cfg, sec), key)}' is not a torch dtype (e.g. bfloat16)")
    compute, engine = (getattr(torch, d).itemsize for d in (cfg.model.param_dtype, r.dtype))
    need(r.sync_by == "tensor" or compute >= engine,
         f"rollout.sync_by=unit gathers in model.param_dtype={cfg.model.param_dtype}, which would "
         f"round the {r.dtype} engine's weights. Fix: rollout.sync_by=tensor, or the same dtypes")
    try:  # the other modules' own checks of their sections, each a one-line ValueError
        npu_ops.kernel_path(cfg.model.fused_kernels)  # a bad mode, or a missing kernel library
        npu_ops.check_platform(not r.enforce_eager, r.temperature, r.top_p)  # graph mode, sampling
        rewards.validate(cfg.reward)  # every reward function resolves, in this process
        episodes.validate(cfg.env, cfg.data.max_prompt_len, r.max_model_len)  # and the env
    except ValueError as e:
        raise BadInput(str(e)) from None
    if not cfg.data.tiny_task_dir:  # data sources are checked when they load (data.py)
        need(cfg.model.path and (os.path.isdir(cfg.model.path) or cfg.model.path.count("/") == 1),
             f"model.path='{cfg.model.path}' is neither a directory nor a hub id (org/name)")
        need(not os.path.isdir(cfg.model.path)
             or os.path.isfile(os.path.join(cfg.model.path, "config.json")),
             f"model.path='{cfg.model.path}' has no config.json: not a Hugging Face model "
             "directory. Fix: point model.path at the directory with config.json and the weights")
    out = os.path.abspath(cfg.log.out_dir)
    need(not os.path.exists(out) or os.path.isdir(out),
         f"log.out_dir='{cfg.log.out_dir}' is a file. Fix: give a directory path")
    existing = out
    while not os.path.exists(existing):  # the nearest ancestor that exists must take new files
        existing = os.path.dirname(existing)
    need(os.path.isdir(existing) and os.access(existing, os.W_OK | os.X_OK),
         f"log.out_dir='{cfg.log.out_dir}' cannot be written ({existing} is not a writable "
         "directory). Fix: choose a directory you can write")


def check_host_memory(cfg, world_size: int) -> None:
    """BadInput if this node's ranks cannot park the actor and its Adam state (with
    model.offload) and the reference (with grpo.kl_coef > 0) in host memory; the bytes come from
    the model's config.json (offload.host_bytes_per_rank), not its weights."""
    ref_dtype = getattr(torch, cfg.model.param_dtype) if cfg.grpo.kl_coef > 0 else None
    on = offload.enabled(cfg.model.offload)
    if not (on or ref_dtype):
        return
    need = offload.host_bytes_per_rank(cfg.model.path, world_size, on, ref_dtype)
    try:
        offload.check_host_memory(need, int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                                  offload.host_memory_available())
    except ValueError as e:
        raise BadInput(str(e)) from None
