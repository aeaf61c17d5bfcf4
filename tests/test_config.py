"""Config loading: precedence, coercion and the errors a user sees before any model loads."""

import re

import pytest

import config
from config import validate
from conftest import run_python
from train_grpo import Config, load_config, resolve


@pytest.fixture
def tiny(tiny_task_dir):
    """load_config of configs/tiny_cpu.yaml with `overrides`, resolved as setup() resolves it
    (the built-in task's paths): what config.validate checks."""
    def load(*overrides):
        return resolve(load_config("configs/tiny_cpu.yaml",
                                   [f"--data.tiny_task_dir={tiny_task_dir}", *overrides]))
    return load


def write(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return str(p)


def test_precedence_and_coercion(tmp_path):
    path = write(tmp_path, "optim:\n  lr: 1e-6\n  warmup_steps: 3\ngrpo:\n  group_size: 4\n")
    cfg = load_config(path, ["--optim.lr=2e-5", "--model.gradient_checkpointing", "true",
                             "--rollout.temperature=1"])
    assert cfg.optim.lr == 2e-5 and isinstance(cfg.optim.lr, float)  # CLI over file
    assert cfg.optim.warmup_steps == 3 and cfg.grpo.group_size == 4  # file over defaults
    assert cfg.model.gradient_checkpointing is True
    assert cfg.rollout.temperature == 1.0 and isinstance(cfg.rollout.temperature, float)
    assert cfg.train.steps == Config().train.steps  # untouched default
    # PyYAML reads 1e-6 (no dot) as a string: it must still become a float
    assert load_config(path).optim.lr == 1e-6


def test_unknown_key_names_closest(tmp_path):
    with pytest.raises(ValueError, match=r"unknown config key 'optim.lrr'.*'optim.lr'"):
        load_config(write(tmp_path, "optim:\n  lrr: 1e-6\n"))
    with pytest.raises(ValueError, match=r"'grpo.group_size'"):
        load_config(None, ["--grpo.groupsize=4"])
    with pytest.raises(ValueError, match=r"unknown config section 'optm'.*'optim'"):
        load_config(None, ["--optm.lr=1"])


def test_wrong_type_names_field(tmp_path):
    with pytest.raises(ValueError, match=r"grpo.group_size: expected int, got 'eight'"):
        load_config(write(tmp_path, "grpo:\n  group_size: eight\n"))
    with pytest.raises(ValueError, match=r"grpo.group_size: expected int, got '2.5'"):
        load_config(None, ["--grpo.group_size", "2.5"])
    with pytest.raises(ValueError, match=r"model.reshard_after_forward: expected bool"):
        load_config(None, ["--model.reshard_after_forward=maybe"])
    with pytest.raises(ValueError, match=r"optim.lr: expected float"):
        load_config(write(tmp_path, "optim:\n  lr: [1, 2]\n"))


def test_a_sub_section_from_yaml_and_the_command_line(tmp_path):
    """rollout.partial is a section inside a section: a YAML mapping or dotted keys; a typo in
    it, or a value given for the whole sub-section, is one line naming it."""
    path = write(tmp_path, "rollout:\n  max_new_tokens: 8\n  partial:\n    enabled: true\n"
                           "    round_tokens: 4\n")
    cfg = load_config(path, ["--rollout.partial.oversample=1.5"])
    assert (cfg.rollout.max_new_tokens, cfg.rollout.partial.enabled) == (8, True)
    assert (cfg.rollout.partial.round_tokens, cfg.rollout.partial.oversample) == (4, 1.5)
    assert Config().rollout.partial.round_tokens == 0  # the defaults are each tree's own
    with pytest.raises(config.BadInput, match=r"unknown config key 'rollout.partial.round_tokns'"
                                              r".*'rollout.partial.round_tokens'"):
        load_config(None, ["--rollout.partial.round_tokns=4"])
    with pytest.raises(config.BadInput, match=r"rollout.partial: a section of its own"):
        load_config(None, ["--rollout.partial=true"])
    with pytest.raises(config.BadInput, match=r"rollout.partial.oversample: expected float"):
        load_config(write(tmp_path, "rollout:\n  partial:\n    oversample: [1]\n"))
    with pytest.raises(config.BadInput, match=r"unknown config key 'rollout.max_new_tokens.x'"):
        load_config(None, ["--rollout.max_new_tokens.x=1"])


def test_missing_file():
    with pytest.raises(config.BadInput, match="config file not found: nope.yaml"):
        load_config("nope.yaml")


def test_shipped_config_loads(tiny):
    cfg = tiny()
    validate(cfg, world_size=2)
    assert cfg.rollout.dtype == "float32" and cfg.rollout.kv_cache_memory_bytes > 0


@pytest.mark.parametrize("override, world, message", [
    ("--rollout.tp_size=3", 2, "rollout.tp_size=3 must divide the world size 2"),
    ("--grpo.prompts_per_step=3", 2, "grpo.prompts_per_step=3 must be a multiple"),
    ("--grpo.group_size=1", 1, "grpo.group_size=1"),
    ("--reward.funcs=nope", 1, "reward.funcs: 'nope'"),
    ("--reward.funcs=math,format --reward.weights=1.0", 1, "reward.weights"),
    ("--rollout.max_new_tokens=100", 1, "rollout.max_new_tokens=100 must be below"),
    ("--rollout.dtype=float33", 1, "rollout.dtype='float33': use one of float32, bfloat16"),
    ("--optim.schedule=linear", 1, "optim.schedule='linear'"),
    ("--model.offload=yes", 1, "model.offload='yes'"),
    ("--model.fused_kernels=fast", 1, "model.fused_kernels='fast'"),
    ("--model.fused_kernels=fused", 1, "model.fused_kernels=fused needs Ascend's kernel library"),
    ("--model.attn_implementation=npu_fusion", 1, "model.attn_implementation=npu_fusion needs"),
    ("--rollout.sleep_level=3", 1, "rollout.sleep_level=3"),
    ("--rollout.sync_by=layer", 1, "rollout.sync_by='layer': use one of unit, tensor"),
    ("--model.param_dtype=bfloat16", 1, "rollout.sync_by=unit gathers in model.param_dtype=bf"),
    ("--grpo.loss_agg=seq_total", 1, "grpo.loss_agg='seq_total': use one of"),
    ("--grpo.kl_estimator=k4", 1, "grpo.kl_estimator='k4'"),
    ("--grpo.is_correction=clip", 1, "grpo.is_correction='clip'"),
    ("--grpo.overlong=cut", 1, "grpo.overlong='cut'"),
    ("--grpo.clip_low=1.5", 1, "grpo.clip_low=1.5: must be >= 0 and < 1"),
    ("--grpo.mini_batches=1000", 2, "mini_batches=1000 must be between 1 and the samples per rank"),
    ("--grpo.ppo_epochs=0", 1, "grpo.ppo_epochs=0: must be >= 1"),
    ("--grpo.kl_coef=-1", 1, "grpo.kl_coef=-1.0: must be >= 0"),
    ("--grpo.is_cap=1", 1, "grpo.is_cap=1.0: must be > 1"),
    ("--grpo.max_gen_rounds=3", 1, "max_gen_rounds=3: more than 1 needs grpo.dynamic_sampling"),
    ("--grpo.overlong=penalty", 1, "grpo.overlong=penalty needs 0 < grpo.overlong_buffer"),
    ("--env.name=nope", 1, "env.name: 'nope' is not a built-in (retry, python)"),
    ("--env.name=os:getcwd", 1, "env.name: 'os:getcwd' cannot be called with two arguments"),
    ("--env.name=retry --env.max_tokens=100", 1, "data.max_prompt_len + env.max_tokens must be"),
    ("--env.name=retry --env.max_turns=0", 1, "env.max_turns=0"),
    ("--rollout.partial.enabled=true", 1, "rollout.partial.enabled needs"),
    ("--rollout.partial.enabled=true --rollout.partial.round_tokens=4", 1,
     "rollout.partial.round_tokens=4 never cuts a turn of rollout.max_new_tokens=4"),
    ("--rollout.partial.stale=drop", 1, "rollout.partial.stale='drop'"),
    ("--rollout.partial.oversample=0.5", 1, "rollout.partial.oversample=0.5: must be >= 1"),
    ("--data.tiny_task_format_steps=5 --data.tiny_task_chat=true", 1,
     "data.tiny_task_format_steps=5 teaches the plain sum task's form"),
    ("--data.tiny_task_format_steps=5 --data.tiny_task_arch=qwen2_5_vl", 1,
     "data.tiny_task_format_steps=5 teaches the plain sum task's form"),
])
def test_derived_constraints(override, world, message, tiny):
    cfg = tiny(*override.split())
    with pytest.raises(ValueError, match=re.escape(message)):
        validate(cfg, world)


def test_model_path_and_out_dir_are_checked_before_loading(tmp_path, tiny):
    (tmp_path / "not_a_model").mkdir()
    (tmp_path / "a_file").write_text("x")
    cfg = load_config(None, [f"--model.path={tmp_path / 'not_a_model'}"])
    with pytest.raises(ValueError, match="has no config.json: not a Hugging Face model directory"):
        validate(cfg, 1)
    cfg = tiny(f"--log.out_dir={tmp_path / 'a_file'}")
    with pytest.raises(ValueError, match="log.out_dir=.* is a file"):
        validate(cfg, 1)
    cfg = tiny(f"--log.out_dir={tmp_path / 'a_file' / 'run'}")
    with pytest.raises(ValueError, match="log.out_dir=.* cannot be written"):
        validate(cfg, 1)


def test_yaml_errors_and_close_keys(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  path: x\n optim:\n  lr: 1\n")
    with pytest.raises(ValueError, match=r"bad.yaml: line 3, column 2: not valid YAML"):
        load_config(str(bad))
    with pytest.raises(ValueError, match=r"did you mean 'optim.lr'"):
        load_config(None, ["--optim.learning_rate=1e-6"])
    cfg = load_config(None, ["--reward.funcs=math,format", "--reward.weights=1,0.1"])
    assert cfg.reward.funcs == ["math", "format"] and cfg.reward.weights == [1.0, 0.1]
    # the list syntax most command lines accept, with or without spaces
    cfg = load_config(None, ["--reward.funcs=[math, format]", "--reward.weights", "[1, 0.1]"])
    assert cfg.reward.funcs == ["math", "format"] and cfg.reward.weights == [1.0, 0.1]
    assert load_config(None, ["--reward.funcs=[tiny_sum]"]).reward.funcs == ["tiny_sum"]
    assert load_config(None, ["--log.wandb_tags=[]"]).log.wandb_tags == []


@pytest.mark.parametrize("path, world", [
    ("configs/qwen2.5-7b-gsm8k-npu8.yaml", 8), ("configs/qwen3-8b-gsm8k-npu8.yaml", 8),
    ("configs/qwen2.5-7b-math-npu8.yaml", 8), ("configs/qwen2.5-0.5b-gsm8k-npu1.yaml", 1),
    ("configs/qwen2.5-0.5b-gsm8k-cuda1.yaml", 1),
    ("configs/qwen2.5-0.5b-gsm8k-tool-cuda1.yaml", 1),
    ("configs/qwen3-30b-a3b-gsm8k-npu16.yaml", 16),
    ("configs/qwen2.5-vl-7b-geo3k-npu8.yaml", 8)])
def test_shipped_accelerator_configs_are_consistent(path, world, tmp_path, monkeypatch):
    """The shipped configs load and pass the model-free checks at their world size (the NPU ones
    as on an NPU: the engine's options checked for the platform they are for); their data
    section is a preset, their rewards resolve; the NPU ones hold what vLLM-Ascend needs."""
    import data
    import npu_ops

    if "npu" in path:
        monkeypatch.setattr(npu_ops, "device_type", lambda: "npu")

    cfg = load_config(path, ["--model.fused_kernels=reference", f"--log.out_dir={tmp_path}"])
    validate(cfg, world_size=world)
    assert cfg.data.preset in data.PRESETS and cfg.reward.funcs
    assert cfg.rollout.sleep_level == 2 and cfg.rollout.temperature == 1.0
    if "npu" in path:
        assert cfg.rollout.enforce_eager  # graph mode with live weight sync is unsafe on vLLM-Ascend
        assert cfg.rollout.top_p == 1.0  # see test below
    if world >= 8:
        assert cfg.model.reshard_after_forward  # ZeRO-3 at 7B and up


def test_ascend_checks_run_before_any_model_loads(monkeypatch, tmp_path, tiny):
    """validate() consults npu_ops on an Ascend install: a bad env stops the run at once."""
    import npu_ops

    monkeypatch.setattr(npu_ops, "npu_installed", lambda: True)
    monkeypatch.setattr(npu_ops, "device_type", lambda: "cpu")
    monkeypatch.setattr(npu_ops.ascend_checks, "installed_versions",  # NZ from the variable only
                        lambda: {"vllm": "0.18.0", "vllm-ascend": "0.18.0", "torch-npu": "2.9.0"})
    monkeypatch.setenv("TASK_QUEUE_ENABLE", "2")
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "0")
    monkeypatch.setenv("ATB_HOME_PATH", "/usr/local/Ascend/nnal/atb/latest/atb/cxx_abi_0")
    cfg = tiny("--rollout.enforce_eager=false")
    with pytest.raises(ValueError, match="TASK_QUEUE_ENABLE=2 with rollout.enforce_eager=false"):
        validate(cfg, 2)
    validate(tiny(), 2)  # eager mode: level 2 is fine
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "1")
    with pytest.raises(ValueError, match="VLLM_ASCEND_ENABLE_NZ=1: .*wake_up raises"):
        validate(tiny(), 2)


@pytest.mark.parametrize("override", ["--rollout.temperature=0.7", "--rollout.top_p=0.9"])
def test_ascend_refuses_sampling_its_logprobs_do_not_match(monkeypatch, override, tiny):
    """vLLM-Ascend returns raw-logit logprobs: temperature != 1 or top_p < 1 would make the
    mismatch correction compare the wrong distributions, so validate() stops the run. Elsewhere
    (vLLM's processed_logprobs) the same config is fine."""
    import npu_ops

    cfg = tiny(override)
    validate(cfg, 2)  # CPU: vLLM honours logprobs_mode
    monkeypatch.setattr(npu_ops, "npu_installed", lambda: True)
    monkeypatch.setattr(npu_ops.ascend_checks, "installed_versions",
                        lambda: {"vllm": "0.23.0", "vllm-ascend": "0.23.0", "torch-npu": "2.10.0.post4"})
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "0")
    with pytest.raises(ValueError, match=r"rollout.temperature=.*rollout.top_p=.*Fix: rollout."
                                         r"temperature=1.0 and rollout.top_p=1.0"):
        validate(cfg, 2)


@pytest.mark.parametrize("case", [  # the npu-stack lane: the cases transformers' files answer
    *(pytest.param(c, marks=pytest.mark.main_only) for c in (
        "yaml", "jsonl", "column", "out_dir", "reward", "env", "empty", "temperature",
        "max_new_tokens")),
    "positions", "kv_cache", "chat_template"])
def test_bad_input_is_one_line_not_a_traceback(case, tiny_task_dir, tmp_path):
    """As a user runs it (plain python, world size 1): exit code 2, one `error:` line naming the
    field, no Python traceback, before any model loads."""
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("data:\n  path: x\n max_prompt_len: 3\n")
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": 4,}\n')
    good = tmp_path / "good.jsonl"
    good.write_text('{"question": "1+1=", "answer": "2"}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    (tmp_path / "file").write_text("x")
    base = ["--config", "configs/tiny_cpu.yaml", f"--model.path={tiny_task_dir}/model",
            "--data.tiny_task_dir=", f"--log.out_dir={tmp_path / 'run'}", "--log.eval_every=0"]
    args, says = {
        # values the model's own files rule out, found before the engine starts
        "positions": (base + [f"--data.path={good}", "--rollout.max_model_len=96",
                              "--data.prompt_key=question"], "rollout.max_model_len=96"),
        "kv_cache": (base + [f"--data.path={good}", "--rollout.kv_cache_memory_bytes=1000",
                             "--data.prompt_key=question"], "rollout.kv_cache_memory_bytes=1000"),
        "chat_template": (base + [f"--data.path={good}", "--data.chat_template=true",
                                  "--data.prompt_key=question"], "data.chat_template=true"),
        "temperature": (base + ["--rollout.temperature=0"], "rollout.temperature=0.0: must be > 0"),
        "max_new_tokens": (base + ["--rollout.max_new_tokens=-1"],
                           "rollout.max_new_tokens=-1: must be >= 1"),
        "yaml": (["--config", str(bad_yaml)], "bad.yaml: line 3, column 2: not valid YAML"),
        "jsonl": (base + [f"--data.path={rows}"], "line 2 is not JSON"),
        "column": (base + [f"--data.path={good}"], "data.prompt_key='prompt' is not a column"),
        "out_dir": (base + [f"--data.path={good}", f"--log.out_dir={tmp_path / 'file'}"],
                    "is a file"),
        "reward": (base + [f"--data.path={good}", "--reward.funcs=nope:fn"], "reward.funcs"),
        "env": (base + [f"--data.path={good}", "--env.name=no_such_env_module:fn"], "env.name"),
        "empty": (base + [f"--data.path={empty}"], "no rows (an empty file or dataset)"),
    }[case]
    out = run_python(["train_grpo.py", *args], timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and says in errors[0], out.stderr[-3000:]
    assert "Initializing a V1 LLM engine" not in out.stderr + out.stdout  # no model was loaded


def test_an_error_inside_another_library_keeps_its_traceback(tiny_task_dir, tmp_path):
    """A model directory that passes our checks but whose tokenizer transformers fails to load
    (its tokenizer.json cut short: a ValueError raised inside AutoTokenizer, which the one-line
    path used to swallow): the run stops with transformers' own traceback, not as a one-line
    `error:` about the user's input."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(f"{tiny_task_dir}/model", model)
    (model / "tokenizer.json").write_text((model / "tokenizer.json").read_text()[:100])
    args = ["--config", "configs/tiny_cpu.yaml", f"--model.path={model}", "--data.tiny_task_dir=",
            f"--data.path={tiny_task_dir}/train.jsonl", f"--log.out_dir={tmp_path / 'run'}",
            "--log.eval_every=0"]
    out = run_python(["train_grpo.py", *args], timeout=300)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" in out.stderr and "JSONDecodeError" in out.stderr
    assert "from_pretrained" in out.stderr  # raised inside transformers' loading
    assert not any(line.startswith("error: ") for line in out.stderr.splitlines())


def test_every_field_has_a_domain_and_refuses_values_outside_it(tiny_task_dir):
    """Walks the config tree: every field states its domain (config.fields raises for one that
    does not), and each value outside it (zero, negative, non-finite, an unknown name, absurdly
    large where a bound exists: config.Domain.outside) ends in config.BadInput, one line naming
    that field, before anything loads; a wrong type fails at load time, naming the field too."""
    import copy
    import dataclasses
    import functools
    import typing

    base = resolve(load_config("configs/tiny_cpu.yaml", [f"--data.tiny_task_dir={tiny_task_dir}"]))
    validate(base, 1)  # the shipped values lie inside every domain
    tried, walked = 0, 0
    def section(cfg, path):  # rollout.partial -> cfg.rollout.partial
        return functools.reduce(getattr, path, cfg)

    for name, value, domain, default in config.fields(base):
        walked += 1
        *path, key = name.split(".")
        typ = typing.get_type_hints(type(section(base, path)))[key]
        assert domain.problem(default) is None, f"{name}: its default is outside its domain"
        for bad in domain.outside():
            if typ is int and not (isinstance(bad, int) and not isinstance(bad, bool)):
                continue  # an int field: the type check refuses the rest
            cfg = copy.deepcopy(base)
            setattr(section(cfg, path), key, float(bad) if typ is float else bad)
            with pytest.raises(config.BadInput) as e:
                validate(cfg, 1)
            message = str(e.value)
            assert name in message and len(message.splitlines()) == 1, (name, bad, message)
            tried += 1
        wrong = {int: "abc", float: "abc", bool: "maybe", str: None}.get(typ)
        if typing.get_origin(typ) is list and typing.get_args(typ)[0] is float:
            wrong = "1,abc"
        if wrong is not None:
            with pytest.raises(config.BadInput, match=re.escape(name)):
                load_config(None, [f"--{name}={wrong}"])
    def leaves(node):  # the fields of a section, a sub-section's counted as its own
        return sum(leaves(getattr(node, f.name)) if dataclasses.is_dataclass(getattr(node, f.name))
                   else 1 for f in dataclasses.fields(node))

    assert walked == leaves(base) and tried > 100, tried
    assert "rollout.partial.round_tokens" in [name for name, *_ in config.fields(base)]


def test_a_field_without_a_domain_is_refused():
    import dataclasses

    @dataclasses.dataclass
    class Section:
        steps: int = 1  # no domain stated

    @dataclasses.dataclass
    class Tree:
        train: Section = dataclasses.field(default_factory=Section)

    with pytest.raises(TypeError, match="train.steps states no domain"):
        list(config.fields(Tree()))


def test_help_lists_every_field_with_its_default_domain_and_comment():
    """`python train_grpo.py --help` prints the whole config tree from the dataclasses (no list
    of its own): every field as --section.key=default with what it takes and its comment in the
    source; `--help SECTION` one section; an unknown section is one line and exit 2."""
    import functools
    import json
    def run(*args):
        return run_python(["train_grpo.py", *args], timeout=300)

    out, cfg = run("--help").stdout, Config()
    names = [name for name, *_ in config.fields(cfg)]
    for name, value, domain, default in config.fields(cfg):
        *path, key = name.split(".")
        comment = config.field_comments(type(functools.reduce(getattr, path, cfg)))[key]
        assert comment, f"{name} has no comment in its section's source"
        line = f"  --{name}={json.dumps(default)}  [{domain.describe()}]\n      {comment}\n"
        assert line in out, name
    assert len(names) > 100 and len(re.findall(r"^  --\w+\.", out, re.M)) == len(names)
    assert "G: responses sampled per prompt" in out  # a comment beside its field
    env = run("--help", "env").stdout
    assert "--env.workers=0" in env and "--grpo." not in env and "--model." not in env
    bad = run("--help", "evn")
    assert bad.returncode == 2 and "did you mean 'env'" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1
