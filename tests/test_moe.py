"""A mixture of experts in the trainer (moe.py): routing replay against the model's own routing
and against a naive loop over the chosen experts, the update routing by its samples' routing,
the routers' metrics, and the options' refusals before any model loads.

The models are the tiny Qwen3-MoE (8 experts, 2 a token, experts 2 x 192 by 128) in fp64.
Tolerance: the replayed block and the naive loop compute the same sums of a few hundred fp64
products in other orders (errors ~1e-15 relative), with the gates in fp32 on both sides (the
router's softmax is fp32 by design); 1e-12 leaves room and still catches a wrong expert, gate,
weight or normalisation, which change the output at 1e-2 and more. Where a test
says bit-exact, the two sides run the same operations on the same values."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import fsdp_utils
import logprobs
from modeling import moe
import reference
import rollout
from logprobs import micro_batch
from records import Sample
from test_packing import world_of_one  # noqa: F401 (fixture)
from train_grpo import load_config


@pytest.fixture(scope="module")
def model(tiny_models):
    attn = fsdp_utils.register_attention("sdpa")  # each packed sample's attention apart
    return AutoModelForCausalLM.from_pretrained(tiny_models["qwen3_moe"], dtype=torch.float64,
                                                experts_implementation="eager",  # fp64
                                                attn_implementation=attn)


def own_routing(model, ids: torch.Tensor) -> torch.Tensor:
    """(L, B*T, k) the experts each router picks in a plain forward of ids (B, T)."""
    seen, hooks = [], [r.register_forward_hook(lambda m, i, o: seen.append(o[2].clone()))
                       for r in moe.routers(model)]
    try:
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(seen)


def test_replaying_the_models_own_routing_changes_nothing(model):
    """Given the experts the routers pick themselves, the logits and every gradient are
    bit-exact those of the model as transformers runs it (with routing() and given None too),
    and leaving the block gives the routers back."""
    ids = torch.randint(2, 15, (2, 9), generator=torch.Generator().manual_seed(0))
    given = own_routing(model, ids)
    assert given.shape == (2, 18, 2)
    results = []
    for replay in (None, "own", "none-given"):
        model.zero_grad()
        ctx = (moe.routing(model, given) if replay == "own"
               else moe.routing(model) if replay == "none-given" else torch.enable_grad())
        with ctx:
            logits = model(input_ids=ids).logits
            (logits * torch.linspace(-1, 1, logits.shape[-1], dtype=logits.dtype)).sum().backward()
        results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    for logits, grads in results[1:]:
        assert torch.equal(logits, results[0][0])
        assert all(torch.equal(a, b) for a, b in zip(grads, results[0][1]))
    assert all("forward" not in vars(r) for r in moe.routers(model))


def naive_block(block, x: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """A sparse block's output, token by token: the router's softmax at the given experts,
    renormalised, times each expert's SwiGLU MLP from its own rows of the fused tensors. The
    softmax and the renormalisation in fp32, as the model's router computes its gates."""
    w_router = block.gate.weight
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    inter = down.shape[2]
    out = []
    for t in range(x.shape[0]):
        probs = torch.softmax(w_router @ x[t], dim=0, dtype=torch.float32)
        chosen = [int(e) for e in experts[t]]
        weights = torch.stack([probs[e] for e in chosen])
        weights = (weights / weights.sum()).to(x.dtype)
        y = 0
        for w, e in zip(weights, chosen):
            gate, up = gate_up[e][:inter] @ x[t], gate_up[e][inter:] @ x[t]
            y = y + w * (down[e] @ (torch.nn.functional.silu(gate) * up))
        out.append(y)
    return torch.stack(out)


def test_given_routing_equals_a_naive_loop_over_the_chosen_experts(model):
    """Layer 0's sparse block with random given experts (each token two different ones, most not
    its own top 2) against naive_block: the output, and the gradients of the input, the router
    (it still trains: its softmax at the given experts is the gate) and the experts."""
    block = model.model.layers[0].mlp
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, block.gate.hidden_dim, dtype=torch.float64, generator=g)
    experts = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(12)])
    given = torch.full((len(moe.routers(model)), 12, 2), -1, dtype=torch.long)
    given[0] = experts
    params = [x.requires_grad_(), block.gate.weight, block.experts.gate_up_proj,
              block.experts.down_proj]
    stats = moe.RouterStats()
    with moe.routing(model, given, stats):
        got = block(x[None])[0]
    own = torch.topk(torch.softmax(x @ block.gate.weight.T, -1), 2).indices
    want = naive_block(block, x, experts)
    assert (got - want).abs().max() <= 1e-12 * want.abs().max()
    weights = torch.linspace(-1, 1, got.numel(), dtype=got.dtype).view_as(got)
    grads_got = torch.autograd.grad((got * weights).sum(), params)
    grads_want = torch.autograd.grad((want * weights).sum(), params)
    for a, b in zip(grads_got, grads_want):
        assert b.abs().max() > 0 and (a - b).abs().max() <= 1e-12 * b.abs().max()
    done = stats.totals()  # the one router that ran saw 12 positions, 2 experts each
    differ = sum(set(a.tolist()) != set(b.tolist()) for a, b in zip(own, experts))
    assert done["positions"] == 12 and done["differs"] == differ > 0
    load = torch.bincount(experts.reshape(-1), minlength=8).double()
    assert abs(done["ratio"][0] - float(load.max() / load.mean())) < 1e-6  # counted in fp32


def make_samples(model, routing: str) -> list:
    """Four samples whose engine logprobs are the model's own, each with the routing of its
    positions but the last (as the engine returns it): the model's own, random experts, or
    none."""
    g, experts = torch.Generator().manual_seed(2), torch.Generator().manual_seed(3)
    out = []
    for prompt, response in ((3, 5), (6, 4), (2, 7), (4, 4)):
        ids = torch.randint(2, 15, (prompt + response,), generator=g).tolist()
        s = Sample(ids[:prompt], ids[prompt:], [], False)
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0], -1)
        s.logp = [float(logp[prompt - 1 + j, t]) for j, t in enumerate(s.response_ids)]
        n = prompt + response - 1
        if routing == "own":
            s.routing = own_routing(model, torch.tensor([ids]))[:, :n].permute(1, 0, 2).numpy()
        elif routing == "random":
            s.routing = np.stack([[torch.randperm(8, generator=experts)[:2].numpy()
                                   for _ in range(2)] for _ in range(n)]).astype(np.uint8)
        out.append(s)
    return out


@pytest.mark.parametrize("pack", [True, False])
def test_the_update_routes_by_its_samples_routing(model, world_of_one, pack):
    """trainer.update (one optimizer step: after it, the engine's routing and the model's own part,
    as replay means) on samples carrying their own routing leaves the model bit-exact as without
    any; random routing changes the step. The old policy's pass (logprobs.sample_logprobs, the
    actor's: replay=True) likewise, and a reference's pass (replay=False) ignores the routing.
    The routers' metrics: no position re-routed with the own routing; with random routing, most
    of the samples' positions (all but each one's last; a random pair is the own one by chance
    at times)."""
    cfg = load_config(None, [f"--grpo.pack={str(pack).lower()}",
                             "--grpo.micro_batch_tokens=16"]).grpo
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0])
    start = {k: v.clone() for k, v in model.state_dict().items()}
    after, metrics, old = {}, {}, {}
    for routing in ("none", "own", "random"):
        model.load_state_dict(start)
        samples = make_samples(model, routing)
        old[routing] = [logprobs.sample_logprobs(model, samples, reference.settings(cfg).passes,
                                                 replay=r) for r in (True, False)]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        metrics[routing] = reference.update(model, None, opt, reference.batch_of(samples, adv, 1),
                                       reference.settings(cfg, max_len=16, grad_clip=1.0))
        after[routing] = {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(start)
    assert all(torch.equal(after["none"][k], after["own"][k]) for k in start)
    assert any(not torch.equal(after["none"][k], after["random"][k]) for k in start)
    same = lambda a, b: all(torch.equal(x, y) for x, y in zip(a, b))  # noqa: E731
    assert same(old["own"][0], old["none"][0]) and not same(old["random"][0], old["none"][0])
    assert same(old["random"][1], old["none"][1])
    for routing in ("none", "own"):
        assert metrics[routing]["routing_differs"].total == 0
    m = metrics["random"]
    positions = m["routing_differs"].count  # every real position of the forward, every layer
    samples = make_samples(model, "none")
    assert positions == 2 * sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    assert 0.5 < m["routing_differs"].total / positions < 1.0
    assert 1.0 <= m["moe_load_max_mean"].value <= 8.0
    entropy = m["router_entropy"].total / m["router_entropy"].count
    assert 0 < entropy <= np.log(8)


def test_given_routing_is_laid_out_where_each_sample_sits():
    """moe.given_routing in a packed and a padded micro-batch: each sample's routing starts at
    its first position, -1 on padding and on each sample's last position."""
    samples = [Sample([3, 4], [5, 6, 7], [0.0] * 3, False), Sample([8], [9, 10], [0.0] * 2, False)]
    samples[0].routing = np.arange(4 * 2 * 2).reshape(4, 2, 2)  # 2 + 3 - 1 positions
    samples[1].routing = 100 + np.arange(2 * 2 * 2).reshape(2, 2, 2)
    for packed, starts in ((True, [0, 5]), (False, [0, 5])):
        mb = micro_batch(samples, 0, packed)
        got = mb.routing  # (L, B*T, k)
        for s, start in zip(samples, starts):
            r = torch.as_tensor(s.routing).permute(1, 0, 2)
            assert torch.equal(got[:, start:start + r.shape[1]], r)
            assert (got[:, start + r.shape[1]] == -1).all()  # its last token
        assert mb.real.sum() == 8 and got.shape[1] == mb.inputs["input_ids"].numel()
    assert micro_batch([Sample([3], [4], [0.0], False)], 0, True).routing is None


def test_the_engine_hands_its_routing_to_each_sample():
    """rollout._samples keeps each completion's routed experts (a stand-in of vLLM's
    RequestOutput: outputs[i].routed_experts, as CompletionOutput has it)."""
    class Completion:
        def __init__(self, ids, routing):
            self.token_ids, self.routed_experts, self.finish_reason = ids, routing, "stop"
            self.logprobs = type("L", (), {"logprobs": [-0.5] * len(ids)})()

    r = np.ones((4, 2, 2), dtype=np.uint8)
    outs = [type("O", (), {"outputs": [Completion([5, 1], r), Completion([6, 1], None)]})()]
    got = rollout._samples([[2, 3, 4]], outs)
    assert got[0].routing is r and got[1].routing is None and got[0].response_ids == [5, 1]


def test_the_options_are_refused_before_any_model_loads(tiny_task_dir, tiny_models):
    """--model.routing_replay=true on CPU ends the real entry point in one line naming the
    field, before the engine or the model start; and the other refusals, one line each."""
    import config
    from train_grpo import resolve

    out = subprocess.run([sys.executable, "train_grpo.py", "--config", "configs/moe_cpu.yaml",
                          "--model.routing_replay=true", "--train.steps=1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    text = (out.stdout + out.stderr).strip().splitlines()
    assert "model.routing_replay=true on CPU" in text[-1], text[-5:]
    assert not any("LLM engine" in line or "Loading weights" in line for line in text)

    def refused(path, *overrides):
        cfg = resolve(load_config(path, [f"--data.tiny_task_dir={tiny_task_dir}", *overrides]))
        with pytest.raises(config.BadInput) as e:
            config.validate(cfg, 2)
            config.check_model(cfg)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "tp_size=1" in refused("configs/moe_cpu.yaml", "--rollout.expert_parallel=true")
    assert "on CPU" in refused("configs/moe_cpu.yaml", "--rollout.expert_parallel=true",
                               "--rollout.tp_size=2")
    assert "episodes" in refused("configs/multiturn_cpu.yaml", "--model.routing_replay=true")
    import npu_ops

    with pytest.raises(ValueError, match="on an NPU"):  # vLLM-Ascend 0.23's token split
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(npu_ops, "device_type", lambda: "npu")
            npu_ops.check_experts(expert_parallel=True, routing_replay=True)
    cfg = resolve(load_config("configs/tiny_cpu.yaml", [f"--data.tiny_task_dir={tiny_task_dir}"]))
    cfg.model.routing_replay = True  # past the platform's check: the model has no experts
    with pytest.raises(config.BadInput, match="no experts"):
        config.check_model(cfg)
    assert moe.is_moe(json.load(open(f"{tiny_models['qwen3_moe']}/config.json")))
