"""Shared-prefix rows (grpo.shared_prefix): each group's prompt once in a packed row, its responses
after it, each attending to the prompt's keys and values and its own earlier tokens
(logprobs.shared_row, fsdp_utils.shared_sdpa). Against the same samples laid out one after the
other (the prompt repeated), in fp64 on tiny Qwen2, Qwen3, Qwen3-MoE, Qwen2.5-VL and Qwen3-VL
models: every response token's logprob and every parameter's gradient within 1e-10 relative,
for several groups in a row and a group split over rows; a response that does not see its
prompt, or one whose multimodal positions resume at the prompt's length, fails the check. The
planner, the auto rule and the refusals (Qwen3.5's linear-attention layers among them).

transformers casts an RMSNorm's input, a router's logits and a vision tower's rotary queries and
keys to fp32 even in an fp64 model; a shared prompt's gradient, summed over its responses before
those casts, would round there differently from the repeated prompts' (about 1e-7).
`fp64_throughout` lifts the casts, so that fp64 compares the two layouts and not fp32's rounding
of sums taken in another order."""

import json
import sys
import types

import pytest
import torch

import config
import fsdp_utils
import grpo
import logprobs
from modeling import vision
import reference
import train_grpo
import trainer
from records import Sample
from test_packing import model_for, world_of_one  # noqa: F401 (fixture)


def fp64_throughout(model, monkeypatch):
    """The model's RMSNorms and softmaxes in its own dtype (fp64), not cast to fp32."""
    def norm(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                              + self.variance_epsilon))

    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = types.MethodType(norm, m)
    def rotary(q, k, cos, sin):  # a vision tower's, its q and k not cast to fp32
        cos, sin = cos.unsqueeze(-2).to(q.dtype), sin.unsqueeze(-2).to(q.dtype)
        turn = (lambda x: torch.cat([-x[..., x.shape[-1] // 2:], x[..., :x.shape[-1] // 2]], -1))
        return q * cos + turn(q) * sin, k * cos + turn(k) * sin

    for name in {type(m).__module__ for m in model.modules()}:
        if hasattr(sys.modules[name], "apply_rotary_pos_emb_vision"):
            monkeypatch.setattr(sys.modules[name], "apply_rotary_pos_emb_vision", rotary)
    real = torch.nn.functional.softmax
    monkeypatch.setattr(torch.nn.functional, "softmax", lambda x, *a, dtype=None, **k: real(
        x, *a, dtype=None if x.dtype == torch.float64 else dtype, **k))
    return model


def groups_of(sizes, prompt_lens, seed=0):
    """Groups of samples, each group one random prompt and its own random responses: group g has
    sizes[g] responses of varied lengths after a prompt of prompt_lens[g] tokens."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, p in zip(sizes, prompt_lens):
        prompt = torch.randint(2, 15, (p,), generator=g).tolist()
        for _ in range(n):
            length = int(torch.randint(1, 12, (1,), generator=g))
            r = torch.randint(2, 15, (length,), generator=g).tolist()
            out.append(Sample(list(prompt), r, (-torch.rand(length, generator=g)).tolist(),
                              False))
    return out


def run_row(model, samples, shared, weights, segments=None):
    """One forward and backward of the samples in one packed row, shared or not, under the loss
    sum w x logp: the logprobs (K,) and every parameter's gradient. `segments`: the shared
    row's attention layout replaced (the mutation check)."""
    model.zero_grad()
    mb = logprobs.micro_batch(samples, 0, True, model.config, shared=shared)
    if segments is not None:
        mb.inputs["shared_segments"] = segments
    out = logprobs.run(model, mb, logprobs.Passes(0.7, chunk=5), reference.weighted(weights))
    out["loss"].backward()
    return out["logp"].detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                  if p.grad is not None}


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "qwen3_moe"])
def test_a_shared_row_computes_what_the_repeated_prompts_compute(arch, world_of_one,
                                                                 monkeypatch):
    torch.manual_seed(0)
    experts = {"experts_implementation": "eager"} if arch == "qwen3_moe" else {}  # fp64
    model = fp64_throughout(model_for(arch, **experts).double(), monkeypatch)
    samples = groups_of([3, 1, 4], [7, 3, 12])  # a group of one shares with no one
    K = sum(len(s.response_ids) for s in samples)
    weights = torch.randn(K, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    lp, grads = run_row(model, samples, False, weights)
    lp_shared, grads_shared = run_row(model, samples, True, weights)
    assert rel(lp_shared, lp) < 1e-10
    assert grads.keys() == grads_shared.keys()
    for name in grads:
        assert rel(grads_shared[name], grads[name]) < 1e-10, name
    row = logprobs.micro_batch(samples, 0, True, model.config, shared=True)
    plain = logprobs.micro_batch(samples, 0, True, model.config)
    assert row.inputs["input_ids"].shape[1] == plain.inputs["input_ids"].shape[1] - 2 * 7 - 3 * 12
    # the check can fail: responses that see only themselves, not their prompt
    blind = dict(row.inputs["shared_segments"])
    blind["keep"] = blind["keep"] & (torch.arange(blind["kv"].shape[1]) >= torch.tensor(
        [7] * 3 + [3] + [12] * 4)[:, None])[:, None, None, :]
    lp_blind, _ = run_row(model, samples, True, weights, blind)
    assert rel(lp_blind, lp) > 1e-3


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_image_prompts_once_a_group_compute_what_they_compute_repeated(arch, monkeypatch):
    """Groups of image prompts (two images in one, none in another), the prompt and its images
    once a group: each response's multimodal positions continue one past its prompt's largest
    (as transformers' own get_rope_index: tests/test_vision.py), the tower sees each image once;
    logprobs and every gradient (the tower's included) as the repeated layout's. A group whose
    prompt ids equal another's but whose images differ is not merged with it."""
    from test_vision import samples_of, vl_model

    model = fp64_throughout(vl_model(arch, fsdp_utils.register_attention("sdpa")), monkeypatch)
    heads = samples_of([([(1, 4, 6)], 1), ([], 1), ([(1, 4, 4), (1, 6, 4)], 1)])
    g, samples = torch.Generator().manual_seed(4), []
    for head, n in zip(heads, (3, 2, 4)):
        for _ in range(n):
            length = int(torch.randint(1, 9, (1,), generator=g))
            samples.append(Sample(head.prompt_ids, torch.randint(2, 100, (length,),
                                                                  generator=g).tolist(),
                                  [0.0] * length, False, vision=head.vision))
    twin = samples[0].vision  # the first prompt again, other patches of the same grid
    twin = vision.Vision(twin.pixel_values.flip(0), twin.grid_thw, twin.positions)
    samples.append(Sample(samples[0].prompt_ids, [5, 6, 7], [0.0] * 3, False, vision=twin))
    assert len(logprobs.shared_groups(samples)) == 4
    K = sum(len(s.response_ids) for s in samples)
    weights = torch.randn(K, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    lp, grads = run_row(model, samples, False, weights)
    lp_shared, grads_shared = run_row(model, samples, True, weights)
    assert rel(lp_shared, lp) < 1e-10
    assert any("visual" in name for name in grads)
    for name in grads:
        assert rel(grads_shared[name], grads[name]) < 1e-10, name
    row = logprobs.micro_batch(samples, 0, True, model.config, shared=True)
    assert len(row.inputs["image_grid_thw"]) == 1 + 2 + 1  # each group's images once
    # the check can fail: responses resuming at their prompt's length (their text position),
    #   not one past its largest multimodal position
    slipped, responses = row.inputs["position_ids"].clone(), ~row.inputs["prompt_mask"][0]
    slipped[1:, 0, responses] = slipped[0, 0, responses]
    mb = logprobs.micro_batch(samples, 0, True, model.config, shared=True)
    mb.inputs["position_ids"] = slipped
    out = logprobs.run(model, mb, logprobs.Passes(0.7, chunk=5))
    assert (out["logp"] - lp).abs().max() > 1e-3  # as in tests/test_vision.py


def test_a_group_split_over_rows_trains_as_one_row_of_repeats(world_of_one, monkeypatch):
    """The update (trainer.accumulate_gradients) with rows too small for a whole group: the
    planner gives its responses two units, each with the prompt; logprobs and gradients as
    without sharing, to 1e-10."""
    torch.manual_seed(0)
    model = fp64_throughout(model_for("qwen3").double(), monkeypatch)
    samples = groups_of([6, 2], [20, 9], seed=2)
    adv = torch.randn(len(samples), generator=torch.Generator().manual_seed(3))
    found = {}
    for shared in ("off", "on"):
        model.zero_grad()
        s = reference.settings(grpo.GRPOConfig(micro_batch_tokens=48, logprob_chunk=5), 0.7,
                               shared_prefix=shared)
        logp, stats = trainer.accumulate_gradients(model, reference.batch_of(samples, adv), s)
        found[shared] = (torch.cat(logp), {n: p.grad.clone() for n, p in
                                           model.named_parameters()}, stats["seen"])
    plan = logprobs.plan_shared(samples, 48)
    first = set(range(6))
    split = sum(1 for row in plan if set(row) & first)
    assert split >= 2  # the group of six is split
    # the tokens the rows held (trained_tokens): each prompt once a row that has its group's
    responses = sum(len(s.response_ids) for s in samples)
    assert found["off"][2] == responses + 6 * 20 + 2 * 9
    assert found["on"][2] == responses + split * 20 + 9
    assert rel(found["on"][0], found["off"][0]) < 1e-10
    for name, g in found["off"][1].items():
        assert rel(found["on"][1][name], g) < 1e-10, name


def test_the_planner_keeps_groups_together_and_within_budget():
    samples = groups_of([4, 3, 2], [10, 30, 5])
    for budget in (200, 60, 45):
        plan = logprobs.plan_shared(samples, budget)
        assert sorted(i for row in plan for i in row) == list(range(len(samples)))
        for row in plan:
            part = [samples[i] for i in row]
            used = sum(len(s.response_ids) for s in part) + sum(
                len(part[g[0]].prompt_ids) for g in logprobs.shared_groups(part))
            assert used <= budget or len(row) == 1, (budget, row, used)
    assert len(logprobs.plan_shared(samples, 1000)) == 1  # all in one row
    capped = logprobs.plan_shared(samples, 1000, max_segments=5)  # a segment a prompt too
    assert all(len(row) + len(logprobs.shared_groups([samples[i] for i in row])) <= 5
               for row in capped)


def test_auto_shares_where_the_repeats_are_a_tenth_of_the_tokens():
    def group(size, prompt, response):
        return [Sample(list(range(2, 2 + prompt)), [5] * response, [-1.0] * response, False)
                for _ in range(size)]

    how = logprobs.Passes(shared_prefix="auto")
    # 7 repeats of 5 tokens in 8 x (5 + 3): the tiny task's shapes
    assert logprobs.sharing(group(8, 5, 3), how)
    # 3 repeats of 4 tokens in 4 x (4 + 26) = 120 tokens: exactly a tenth, and just below
    assert logprobs.sharing(group(4, 4, 26), how)
    assert not logprobs.sharing(group(4, 4, 27), how)
    assert not logprobs.sharing(group(1, 200, 3) + group(1, 201, 3), how)  # nothing repeated
    assert logprobs.sharing(group(4, 4, 27), logprobs.Passes(shared_prefix="on"))
    assert not logprobs.sharing(group(8, 5, 3), logprobs.Passes())  # off


@pytest.mark.parametrize("overrides, says", [
    (["--grpo.pack=false"], "needs packed rows"),
    (["--model.sp_size=2"], "model.sp_size"),
    (["--model.routing_replay=true"], "model.routing_replay"),
])
def test_on_is_refused_where_the_rows_cannot_share(overrides, says):
    cfg = train_grpo.load_config(None, ["--grpo.shared_prefix=on", *overrides])
    with pytest.raises(config.BadInput, match=says) as e:
        cfg.grpo.check(cfg, 2)
    assert "\n" not in str(e.value) and "Fix:" in str(e.value)
    cfg.grpo.shared_prefix = "auto"  # auto: off there, no error
    cfg.grpo.check(cfg, 2)


def test_on_is_refused_for_linear_attention_and_other_attentions(world_of_one, tmp_path):
    """Qwen3.5's Gated DeltaNet layers would start each response from a state the prompt never
    wrote: refused before load (hybrid.check on its config.json, as config.check_model hands it
    over) and at build (the actor's config), auto off; so is an attention without shared
    rows."""
    from tasks import tiny_task

    hybrid = tiny_task.build_tiny_model(15, 1, 0, arch="qwen3_5")
    hybrid.save_pretrained(tmp_path)
    text = json.loads((tmp_path / "config.json").read_text())
    text = text.get("text_config", text)  # as config.check_model reads it
    cfg = train_grpo.load_config(None, ["--grpo.shared_prefix=on", f"--model.path={tmp_path}",
                                        "--rollout.dtype=bfloat16"])
    with pytest.raises(config.BadInput, match="linear-attention") as e:
        cfg.model.check_model(cfg, text)  # hybrid.check, before the engine's and torchvision's
    assert "grpo.shared_prefix=on" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(config.BadInput, match="linear-attention"):
        trainer.shared_prefix(hybrid, cfg)
    cfg.grpo.shared_prefix = "auto"
    try:
        cfg.model.check_model(cfg, text)
    except config.BadInput as e:  # without torchvision (the npu-stack lane): that refusal only
        assert "torchvision" in str(e) and "shared_prefix" not in str(e)
    assert trainer.shared_prefix(hybrid, cfg) == "off"
    cfg.grpo.shared_prefix = "on"
    model = model_for("qwen2")
    assert trainer.shared_prefix(model, cfg) == "on"
    model.config._attn_implementation = "eager"
    with pytest.raises(config.BadInput, match="eager"):
        trainer.shared_prefix(model, cfg)
    cfg.grpo.shared_prefix = "auto"
    assert trainer.shared_prefix(model, cfg) == "off"
