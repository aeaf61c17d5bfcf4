"""The start every engine worker shares: its arguments (MODEL_DIR TP), the platform's
environment, the process group, the tokenizer, and an fp32 engine config for the tiny model.
With V1_WEIGHT_LOADERS=1 in the environment, vLLM's unquantized linear layers load through
its v1 weight loaders, as vLLM-Ascend's NPU worker makes them (v0.23.0 worker/worker.py: it
removes UnquantizedLinearMethod from WEIGHT_LOADER_V2_SUPPORTED), so that every push on an NPU
goes through them; vLLM on CPU uses the v2 loaders otherwise."""

import os
import sys

import npu_ops
import rollout
from train_grpo import init_distributed


def start(**engine) -> tuple:
    """(model_dir, tp, rank, world, tokenizer, rollout.RolloutConfig) of this worker; `engine`:
    RolloutConfig fields beyond (or instead of) tp_size, fp32, 64 positions and a 16 MiB KV cache."""
    from transformers import AutoTokenizer

    model_dir, tp = sys.argv[1], int(sys.argv[2])
    npu_ops.setup_env()
    rank, world = init_distributed()
    if os.environ.get("V1_WEIGHT_LOADERS") == "1":
        from vllm.model_executor.layers import linear

        if "UnquantizedLinearMethod" in linear.WEIGHT_LOADER_V2_SUPPORTED:
            linear.WEIGHT_LOADER_V2_SUPPORTED.remove("UnquantizedLinearMethod")
        _count_loaders(linear)
    cfg = rollout.RolloutConfig(**{"tp_size": tp, "dtype": "float32", "max_model_len": 64,
                                   "kv_cache_memory_bytes": 16 << 20, **engine})
    return model_dir, tp, rank, world, AutoTokenizer.from_pretrained(model_dir), cfg


def prompt_logprobs(engine, token_ids: list[list[int]]) -> list[list[float]]:
    """The engine's logprob of every token after the first of each sequence: a probe of the
    weights it holds (its prompt logprobs, at temperature 1, under the actor's adapter if any)."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
    outs = engine.llm.generate([{"prompt_token_ids": t} for t in token_ids], params,
                               use_tqdm=False, lora_request=engine.adapter)
    return [[lp[tok].logprob for tok, lp in zip(t[1:], o.prompt_logprobs[1:])]
            for t, o in zip(token_ids, outs)]


def bf16_bounds(config) -> tuple[float, float]:
    """(mean, max) |engine - trainer| logprob bounds for a bf16 engine holding the trainer's
    weights exactly (bf16 values on both sides), as tests/workers/device_checks.py derives them:
    each place where the two round a normalised activation differently moves a logit by about
    one bf16 unit (2^-8 relative) and a logprob by about twice that. The places: the embedding,
    the final norm, a full-attention layer's attention and MLP outputs (2), a Gated DeltaNet
    layer's convolution output, gated-norm output and MLP output (3). The mean over a probe's
    tokens must stay below 2 x places x 2^-8, the largest below 4 times that."""
    kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    places = 2 + sum(3 if kind == "linear_attention" else 2 for kind in kinds)
    mean = 2 * places * 2.0**-8
    return mean, 4 * mean


def change_actor(actor, opt, tok, rank: int, round_: int) -> None:
    """A different model each round: noise on each rank's own shard of every weight, then (after
    round 0) a real optimizer step on rank-specific targets."""
    import torch

    from tests.reference import token_logprobs

    with torch.no_grad():
        for p in actor.parameters():
            p.to_local().add_(torch.randn_like(p.to_local()) * 0.2)
    if round_:
        target = torch.tensor([tok(f"{rank}+{round_}={rank + round_}")["input_ids"]])
        (-token_logprobs(actor(input_ids=target).logits[:, :-1], target[:, 1:]).mean()).backward()
        opt.step()
        opt.zero_grad()


def swap(x: str, y: str):
    """A change of the pushed (name, tensor) list: each layer's tensor named ...x sent under ...y
    and the other way (a layout a push could get wrong)."""
    def change(weights):
        named = dict(weights)
        other = lambda n: n[:-len(x)] + y if n.endswith(x) else n[:-len(y)] + x  # noqa: E731
        return [(n, named[other(n)] if n.endswith((x, y)) else w) for n, w in weights]
    return change


LOADER_CALLS = {"v1": 0, "v2": 0}  # with V1_WEIGHT_LOADERS: calls of each kind of loader


def _count_loaders(linear) -> None:
    """Count every call of the linear layers' weight loaders (v1: weight_loader, v2:
    weight_loader_v2), which a layer binds when it is built; at exit the totals are printed
    ("loader calls {...}"), and loader_calls() gives them now."""
    import atexit
    import functools

    for cls in vars(linear).values():
        if isinstance(cls, type) and issubclass(cls, linear.LinearBase):
            for attr, kind in (("weight_loader", "v1"), ("weight_loader_v2", "v2")):
                if attr in vars(cls):
                    real = vars(cls)[attr]

                    @functools.wraps(real)  # the loader's signature: the reload rebinds `param`
                    def counted(self, *a, _real=real, _kind=kind, **k):
                        LOADER_CALLS[_kind] += 1
                        return _real(self, *a, **k)
                    setattr(cls, attr, counted)
    atexit.register(lambda: print(f"loader calls {LOADER_CALLS}", flush=True))


def loader_calls() -> dict:
    return dict(LOADER_CALLS)
