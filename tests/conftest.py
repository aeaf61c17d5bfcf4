import json
import os
import socket
import subprocess
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_path(*extra) -> str:
    """PYTHONPATH for a child process: the project, `extra`, then this process's own PYTHONPATH
    (packages can come that way, as on a machine without a package index)."""
    inherited = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    return os.pathsep.join([ROOT, *map(str, extra), *inherited])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ForkServer:
    """tests/forkserver.py, started as the session starts (its imports, ~6 s, run while pytest
    collects) and kept for the session: jobs forked from a process that has already imported
    torch, transformers and vLLM."""

    def __init__(self):
        self.proc, self.used = None, False

    def start(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, "tests/forkserver.py"], cwd=ROOT,
                                         env=base_env(), stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True)

    def run(self, argv: list[str], nproc: int, ranks: bool, env: dict, timeout: float,
            stdout: str, stderr: str) -> int:
        """Run a job to its end: its exit code."""
        self.submit(argv, nproc, ranks, env, timeout, stdout, stderr)
        return self.answer()

    def submit(self, argv: list[str], nproc: int, ranks: bool, env: dict, timeout: float,
               stdout: str, stderr: str) -> None:
        """Start a job (one at a time: answer() before the next)."""
        self.start()
        self.used = True
        self.job = dict(argv=argv, nproc=nproc, ranks=ranks, env=env, timeout=timeout,
                        stdout=stdout, stderr=stderr)
        self.proc.stdin.write(json.dumps(self.job) + "\n")
        self.proc.stdin.flush()

    def answered(self) -> bool:
        """Whether the submitted job has ended (its answer is waiting)."""
        import select

        return bool(select.select([self.proc.stdout], [], [], 0)[0])

    def answer(self) -> int:
        """The submitted job's exit code, once it has ended."""
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"tests/forkserver.py exited {self.proc.wait()} (its stderr is above)")
        result = json.loads(answer)
        if result["timed_out"]:
            raise subprocess.TimeoutExpired(self.job["argv"], self.job["timeout"])
        return result["rc"]

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            if not self.used:  # a session that forked nothing: not kept waiting for its imports
                self.proc.kill()
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


FORKS = ForkServer()


def pytest_configure(config):
    if not config.option.collectonly:
        FORKS.start()


def pytest_unconfigure(config):
    FORKS.close()


def base_env(**extra) -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path(), **extra}


def launch(args: list[str], nproc: int = 2, timeout: int = 600, env: dict | None = None,
           torchrun: bool = False) -> str:
    """Run `args` (a script and its arguments) on `nproc` CPU ranks and return their output;
    fail the test with it on error. The ranks are forked from tests/forkserver.py with the
    environment torchrun gives its ranks; `torchrun=True` starts torchrun itself (the product's
    own launch, ~8 s slower)."""
    full_env = base_env(**(env or {}))
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", *args]
        proc = subprocess.run(cmd, cwd=ROOT, env=full_env, capture_output=True, text=True,
                              timeout=timeout)
        code, out = proc.returncode, proc.stdout + proc.stderr
    else:
        with tempfile.TemporaryDirectory() as d:
            log = os.path.join(d, "out")
            code = FORKS.run(args, nproc, True, full_env, timeout, log, log)
            out = read(log)
    if code != 0:
        pytest.fail(f"{' '.join(args)} exited {code}:\n{out[-6000:]}")
    return out


def run_python(args: list[str], env: dict | None = None,
               timeout: int = 600) -> subprocess.CompletedProcess:
    """`python ARGS` in ROOT, as a user runs it (one process, no torchrun), forked from
    tests/forkserver.py: its exit code, stdout and stderr."""
    full_env = {k: v for k, v in base_env(**(env or {})).items()
                if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    with tempfile.TemporaryDirectory() as d:
        out, err = os.path.join(d, "stdout"), os.path.join(d, "stderr")
        code = FORKS.run(args, 1, False, full_env, timeout, out, err)
        return subprocess.CompletedProcess(args, code, read(out), read(err))


def read(path: str) -> str:
    """A job's output file ("" if the job ended before it opened it)."""
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        return f.read()


@pytest.fixture(scope="session")
def tiny_task_dir(tmp_path_factory):
    from tasks import tiny_task

    return tiny_task.ensure_tiny_task(str(tmp_path_factory.mktemp("tiny") / "task"))


@pytest.fixture(scope="session")
def tiny_vision_task(tmp_path_factory):
    """The built-in tiny vision task (tiny_task arch qwen2_5_vl): a tiny Qwen2.5-VL, its
    processor, and rows of coloured cells. Its processor needs torchvision (not in the npu-torch
    lane: skipped there)."""
    import importlib.util

    from tasks import tiny_task

    if importlib.util.find_spec("torchvision") is None:
        pytest.skip("the tiny vision task's processor needs torchvision")
    return tiny_task.ensure_tiny_task(str(tmp_path_factory.mktemp("tinyvl") / "task"),
                                      arch="qwen2_5_vl")


@pytest.fixture(scope="session")
def tiny_models(tiny_task_dir, tmp_path_factory):
    """{"qwen2": model dir, "qwen3": model dir, "qwen3_moe": model dir}, same tokenizer."""
    from tasks import tiny_task

    qwen3 = tiny_task.ensure_tiny_task(str(tmp_path_factory.mktemp("tiny3") / "task"), arch="qwen3")
    moe = tiny_task.ensure_tiny_task(str(tmp_path_factory.mktemp("tinymoe") / "task"),
                                     arch="qwen3_moe")
    return {"qwen2": f"{tiny_task_dir}/model", "qwen3": f"{qwen3}/model",
            "qwen3_moe": f"{moe}/model"}


@pytest.fixture(scope="session")
def tiny_hybrid(tmp_path_factory):
    """The tiny task's Qwen3.5 hybrid (tiny_task arch qwen3_5) with every weight a bf16 value,
    stored in fp32: a bf16 engine then holds exactly the trainer's weights, the adapters' base
    included."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks import tiny_task

    root = tiny_task.ensure_tiny_task(str(tmp_path_factory.mktemp("tiny35") / "task"),
                                      arch="qwen3_5")
    out = str(tmp_path_factory.mktemp("tiny35bf16") / "model")
    model = AutoModelForCausalLM.from_pretrained(f"{root}/model", dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(f"{root}/model").save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_vl_hybrid(tmp_path_factory):
    """A vision-language Qwen3.5 checkpoint as the releases are (Qwen3_5ForConditionalGeneration,
    `model.language_model.*` beside `model.visual.*`), tiny: the tiny hybrid's language model, a
    one-block vision tower, the tokenizer with the vision tokens, and the processor files vLLM
    builds its multimodal processor from (patches of 16, as the tower's)."""
    import importlib.util

    import torch
    from safetensors.torch import save_file
    from transformers import (Qwen2VLImageProcessor, Qwen3_5Config,
                              Qwen3_5ForConditionalGeneration, Qwen3VLProcessor,
                              Qwen3VLVideoProcessor)

    from tasks import tiny_task

    vision = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok = tiny_task.train_tokenizer([r["prompt"] + r["answer"] for r in tiny_task.make_prompts()])
    tok.add_special_tokens({"additional_special_tokens": vision})
    start, end, image, video = tok.convert_tokens_to_ids(vision)
    text = tiny_task.build_tiny_model(len(tok), tok.eos_token_id, tok.pad_token_id,
                                      arch="qwen3_5").config.to_dict()
    cfg = Qwen3_5Config(text_config=text, vision_config=dict(
        depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=128),
        image_token_id=image, video_token_id=video, vision_start_token_id=start,
        vision_end_token_id=end, tie_word_embeddings=True)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Qwen3_5ForConditionalGeneration(cfg)
    out = str(tmp_path_factory.mktemp("tiny35vl") / "model")
    # the module's own names, as transformers 5.19 writes them (5.5.4's save_pretrained puts the
    # tower under model.language_model.visual), the tied output layer left out
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    cfg.save_pretrained(out)
    save_file({k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"},
              os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    tok.image_token = "<|image_pad|>"
    if importlib.util.find_spec("torchvision") is None:  # no engine here (the npu-torch lane):
        tok.save_pretrained(out)  # its video processor needs torchvision
        return out
    Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(patch_size=16), tokenizer=tok,
                     video_processor=Qwen3VLVideoProcessor(),
                     chat_template=tiny_task.CHAT_TEMPLATE).save_pretrained(out)
    return out


def crashed_copy(run_dir, crashed_dir, step: int) -> None:
    """What a run that crashed after its step-`step` checkpoint leaves, made from a finished run
    of the same config and seeds (the steps are exact: rollout.seed_per_step): that checkpoint,
    and the logs with the finished run's later rows in them, which resume must drop."""
    import shutil

    name = f"step_{step:06d}"
    shutil.copytree(os.path.join(run_dir, "checkpoints", name),
                    os.path.join(crashed_dir, "checkpoints", name))
    for log in ("metrics.jsonl", "samples.jsonl"):
        if os.path.exists(os.path.join(run_dir, log)):
            shutil.copy(os.path.join(run_dir, log), os.path.join(crashed_dir, log))
