"""Config plumbing: YAML file and `--section.key=value` overrides into a dataclass tree, and the
checks that need no model.

The tree itself is train_grpo.Config (one dataclass per YAML section, each defined next to the
code that uses it). Precedence: command line > file > defaults. Values are coerced to the field's
type (PyYAML reads 1e-6 as a string); an unknown section or key raises with the closest valid
name; `validate` checks the cross-section constraints before anything loads.
"""

import dataclasses
import difflib
import functools
import json
import os
import typing

import torch

import distill
import domains
import episodes
import fsdp_utils
import grpo
import kernels
import moe
import npu_ops
import offload
import partial
import rewards
import seq_parallel
from domains import BadInput  # raised here, and caught as config.BadInput (train_grpo.main)


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
    pairs = [p for dotted, val in pairs for p in _flatten(tree, dotted, val)]
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
    read from the field's type (domains.py); a field without one is a TypeError. A sub-section
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
                 if isinstance(a, domains.Domain)]
        if not found:
            raise TypeError(f"config field {name}.{f.name} states no domain: annotate it "
                            "as Annotated[type, domains.X(...)] (domains.py)")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        yield f"{name}.{f.name}", value, found[0], default


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


def validate(cfg, world_size: int) -> None:
    """Checks that need no model: fail in a second, not after minutes of loading. `cfg` resolved
    (train_grpo.prepare: presets and the tiny task's paths filled in). Every field against its
    domain, then what spans fields (`_check_sizes`), the other modules' checks of their
    sections, and the paths."""
    for name, value, domain, default in fields(cfg):
        if (problem := domain.problem(value)) is not None:
            raise BadInput(f"config: {name}={value!r}: {problem}. Fix: change {name}, or leave "
                           f"it out for its default {default!r}")
    _check_sizes(cfg, world_size)
    _check_experts(cfg)
    _check_sequence_parallel(cfg, world_size)
    _check_agent(cfg)
    r = cfg.rollout
    try:  # the other modules' own checks of their sections, each a one-line ValueError
        kernels.kernel_path(cfg.model.fused_kernels)  # a bad mode, or a missing kernel library
        npu_ops.attention_implementation(cfg.model.attn_implementation)  # likewise
        npu_ops.check_platform(not r.enforce_eager, r.temperature, r.top_p,  # graph mode,
                               cfg.model.lora.rank > 0, r.matmul_allreduce,  # sampling, LoRA,
                               r.tp_size)  # the fused matmul + all-reduce
        rewards.validate(cfg.reward)  # every reward function resolves, in this process
        episodes.validate(cfg.env, cfg.data.max_prompt_len, r.max_model_len)  # and the env
        partial.validate(r.partial, r.max_new_tokens)  # partial rollout's rules
        grpo.validate(cfg.grpo)  # the surrogates' rules
        npu_ops.check_experts(r.expert_parallel, cfg.model.routing_replay)  # the engine's
        distill.validate(cfg.distill, cfg.grpo.dynamic_sampling)  # the teacher's path
    except ValueError as e:
        raise BadInput(str(e)) from None
    _check_paths(cfg)


def _check_experts(cfg) -> None:
    """A mixture of experts' options where they can work (the platform's part: npu_ops.
    check_experts; whether the model has experts: check_model)."""
    r = cfg.rollout
    _need(not r.expert_parallel or r.tp_size > 1, "rollout.expert_parallel=true with "
          "rollout.tp_size=1: one rank holds every expert anyway. Fix: rollout.tp_size > 1")
    _need(not cfg.model.routing_replay or not (cfg.env.name or r.partial.enabled),
          "model.routing_replay=true with episodes (env.name) or partial rollout: a sample "
          "written over several engine calls carries no routing yet. Fix: "
          "model.routing_replay=false, or one-turn samples")


def _check_agent(cfg) -> None:
    """env.kind agent with the rest of the run (its own fields: episodes.validate)."""
    if cfg.env.kind != "agent":
        return
    _need("agent" in cfg.reward.funcs, f"env.kind=agent with reward.funcs={cfg.reward.funcs}: "
          "the agent's returned reward is the reward named `agent`. Fix: add agent to "
          "reward.funcs, e.g. reward.funcs=[agent]")
    p = cfg.rollout.partial
    _need(not p.enabled or p.round_tokens == 0, "env.kind=agent with rollout.partial."
          f"round_tokens={p.round_tokens}: an agent's step ends when enough of its groups have "
          "returned, not at a token budget. Fix: rollout.partial.round_tokens=0 and "
          "rollout.partial.oversample > 1")


def _check_sequence_parallel(cfg, world_size: int) -> None:
    """model.sp_size > 1 where it is built: packed rows, and an attention that takes a row's
    boundaries."""
    sp, g = cfg.model.sp_size, cfg.grpo
    if sp == 1:
        return
    _need(world_size % sp == 0, f"model.sp_size={sp} must divide the world size {world_size}")
    _need(g.pack, f"model.sp_size={sp} with grpo.pack=false: sequence parallel splits packed "
          "rows. Fix: grpo.pack=true")
    attn = npu_ops.attention_implementation(cfg.model.attn_implementation)
    _need(attn in ("sdpa", "packed_sdpa", npu_ops.FUSION_ATTENTION),
          f"model.sp_size={sp} with attention {attn!r}: Ulysses wraps packed_sdpa or the "
          "platform's fused attention. Fix: model.attn_implementation=auto")


def _need(ok, msg: str) -> None:
    if not ok:
        raise BadInput(f"config: {msg}")


def _check_sizes(cfg, world_size: int) -> None:
    """The batch's arithmetic over ranks and engine groups, lengths, and dtypes."""
    r, g = cfg.rollout, cfg.grpo
    _need(world_size % r.tp_size == 0,
          f"rollout.tp_size={r.tp_size} must divide the world size {world_size}")
    engines = world_size // r.tp_size
    _need(g.prompts_per_step % engines == 0,
          f"grpo.prompts_per_step={g.prompts_per_step} must be a multiple of the number of "
          f"engine groups (world {world_size} / rollout.tp_size {r.tp_size} = {engines})")
    _need(g.prompts_per_step // engines * g.group_size % r.tp_size == 0,
          "the samples of one engine group (prompts_per_step / engines * group_size) must split "
          f"evenly over its {r.tp_size} tensor-parallel ranks")
    _need(r.max_new_tokens < r.max_model_len,
          f"rollout.max_new_tokens={r.max_new_tokens} must be below rollout.max_model_len")
    _need(cfg.data.max_prompt_len + r.max_new_tokens <= r.max_model_len,
          f"data.max_prompt_len + rollout.max_new_tokens must be <= rollout.max_model_len "
          f"({cfg.data.max_prompt_len} + {r.max_new_tokens} > {r.max_model_len})")
    per_rank = g.prompts_per_step // engines * g.group_size // r.tp_size
    _need(g.mini_batches <= per_rank, f"grpo.mini_batches={g.mini_batches} must be between 1 "
          f"and the samples per rank ({per_rank})")
    _need(not cfg.model.lora.rank or cfg.model.lora.target_modules,
          "model.lora.target_modules is empty with model.lora.rank > 0. Fix: name the layers "
          f"that get adapters, e.g. [{', '.join(fsdp_utils.LORA_MODULES)}]")
    _need(g.max_gen_rounds == 1 or (g.dynamic_sampling and g.max_gen_rounds > 1),
          f"grpo.max_gen_rounds={g.max_gen_rounds}: more than 1 needs "
          "grpo.dynamic_sampling=true")
    _need(g.overlong != "penalty" or 0 < g.overlong_buffer <= r.max_new_tokens,
          f"grpo.overlong=penalty needs 0 < grpo.overlong_buffer <= rollout.max_new_tokens "
          f"({r.max_new_tokens}); got {g.overlong_buffer}")
    compute, engine = (getattr(torch, d).itemsize for d in (cfg.model.param_dtype, r.dtype))
    _need(r.sync_by == "tensor" or compute >= engine,
          f"rollout.sync_by=unit gathers in model.param_dtype={cfg.model.param_dtype}, which "
          f"would round the {r.dtype} engine's weights. Fix: rollout.sync_by=tensor, or the "
          "same dtypes")


def _check_paths(cfg) -> None:
    """model.path a model directory or a hub id (data sources are checked when they load,
    data.py), and log.out_dir a directory that can be written."""
    path = cfg.model.path
    _need(path and (os.path.isdir(path) or path.count("/") == 1),
          f"model.path='{path}' is neither a directory nor a hub id (org/name)")
    _need(not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")),
          f"model.path='{path}' has no config.json: not a Hugging Face model directory. Fix: "
          "point model.path at the directory with config.json and the weights")
    out = os.path.abspath(cfg.log.out_dir)
    _need(not os.path.exists(out) or os.path.isdir(out),
          f"log.out_dir='{cfg.log.out_dir}' is a file. Fix: give a directory path")
    existing = out
    while not os.path.exists(existing):  # the nearest ancestor that exists must take new files
        existing = os.path.dirname(existing)
    _need(os.path.isdir(existing) and os.access(existing, os.W_OK | os.X_OK),
          f"log.out_dir='{cfg.log.out_dir}' cannot be written ({existing} is not a writable "
          "directory). Fix: choose a directory you can write")


def check_host_memory(cfg, world_size: int) -> None:
    """BadInput if this node's ranks cannot hold in host memory the actor and its Adam state
    (with model.offload), the reference (with grpo.kl_coef > 0) and the teacher (with
    distill.teacher); the bytes come from the models' config.json
    (offload.host_bytes_per_rank), not their weights."""
    compute, lora = getattr(torch, cfg.model.param_dtype), cfg.model.lora.rank > 0
    ref_dtype = compute if cfg.grpo.kl_coef > 0 and not lora else None  # LoRA: the actor's base
    on, teacher = offload.enabled(cfg.model.offload), cfg.distill.teacher
    if not (on or ref_dtype or teacher):
        return
    need = offload.host_bytes_per_rank(cfg.model.path, world_size, on, ref_dtype,
                                       compute if lora else None)
    if os.path.isdir(teacher):  # parked like a reference, in its own dtype
        need += offload.host_bytes_per_rank(teacher, world_size, False, getattr(
            torch, cfg.distill.dtype or cfg.model.param_dtype))
    try:
        offload.check_host_memory(need, int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                                  offload.host_memory_available())
    except ValueError as e:
        raise BadInput(str(e)) from None


def _check_heads_and_experts(cfg, text: dict) -> None:
    """model.sp_size against the model's attention heads, and the options of a mixture of
    experts against a model that has experts (text: its config.json's language part)."""
    heads = text.get("num_attention_heads")
    if cfg.model.sp_size > 1 and heads:
        try:
            seq_parallel.kv_copies(heads, text.get("num_key_value_heads") or heads,
                                   cfg.model.sp_size)
        except ValueError as e:
            raise BadInput(f"config: {e}") from None
    for field_name, on in (("model.routing_replay", cfg.model.routing_replay),
                           ("rollout.expert_parallel", cfg.rollout.expert_parallel)):
        if on and not moe.is_moe(text):
            raise BadInput(f"config: {field_name}=true on a {text.get('model_type')!r} model, "
                           f"which has no experts. Fix: {field_name}=false")


def check_model(cfg) -> None:
    """The checks that need the model's own files, read without loading it (config.json and the
    tokenizer's files, never the weights): rollout.max_model_len within the model's positions,
    a KV cache (rollout.kv_cache_memory_bytes) that holds one request of max_model_len tokens,
    a chat template where data.chat_template asks for one, and a teacher (distill.teacher) of
    the same tokenizer. BadInput naming the field. A model.path that is a hub id, not a
    directory, is left to the loaders."""
    path, r = cfg.model.path, cfg.rollout
    try:
        distill.check_files(cfg.distill, path)  # the teacher's tokenizer is the student's
    except ValueError as e:
        raise BadInput(str(e)) from None
    if not os.path.isfile(os.path.join(path, "config.json")):
        return
    with open(os.path.join(path, "config.json")) as f:
        text = json.load(f)
    text = text.get("text_config", text)  # a multimodal model's language part
    kind = text.get("model_type")
    _check_heads_and_experts(cfg, text)
    if cfg.model.lora.rank and kind not in fsdp_utils.FAMILIES:
        raise BadInput(f"config: model.lora.rank={cfg.model.lora.rank} on a {kind!r} model: "
                       "adapters go on the linear layers fsdp_utils.LORA_MODULES names, in the "
                       f"families of fsdp_utils.FAMILIES ({', '.join(fsdp_utils.FAMILIES)}). Fix: "
                       "add the family's row (and its layers' names), or model.lora.rank=0")
    positions = text.get("max_position_embeddings")
    if positions and r.max_model_len > positions:
        raise BadInput(f"config: rollout.max_model_len={r.max_model_len} is more than the "
                       f"model's {positions} positions (max_position_embeddings in {path}/"
                       f"config.json). Fix: rollout.max_model_len <= {positions}")
    if r.kv_cache_memory_bytes:
        heads = text["num_attention_heads"]
        kv_heads = max(1, text.get("num_key_value_heads", heads) // r.tp_size)  # per rank
        head_dim = text.get("head_dim") or text["hidden_size"] // heads
        per_token = 2 * text["num_hidden_layers"] * kv_heads * head_dim * getattr(
            torch, r.dtype).itemsize  # a key and a value per layer and KV head
        block = r.block_size or 128  # the largest platform default (vLLM on CPU: 128 tokens)
        need = -(-r.max_model_len // block) * block * per_token
        if r.kv_cache_memory_bytes < need:
            raise BadInput(
                f"config: rollout.kv_cache_memory_bytes={r.kv_cache_memory_bytes} cannot hold "
                f"one request of rollout.max_model_len={r.max_model_len} tokens ({per_token} "
                f"bytes a token for this model in {r.dtype}, in blocks of {block} tokens). Fix: "
                f"at least {need}, or 0 to size the cache by rollout.gpu_memory_utilization")
    if cfg.data.chat_template:
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
