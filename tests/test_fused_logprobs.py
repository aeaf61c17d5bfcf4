"""The fused output layer (logprobs.py) computes what the plain, unfused statement computes.

On tiny Qwen2 and Qwen3 models in fp32, under every loss aggregation, mismatch correction and KL
estimator, on- and off-policy, at temperatures 0.7 and 1: trainer.accumulate_gradients (packed
micro-batches, 5 output rows per chunk, gradients produced in the forward) against transformers'
own logits of a padded batch fed to the plain statements of tests/reference.py (token_logprobs,
padded_loss, masked_entropy_sum), differentiated by autograd: in fp64 the loss, every logprob, the entropy and the gradient of
every weight within 1e-6 relative (the same arithmetic); in fp32 within 1e-5 (rounding alone);
the clip count exactly. The tolerances are derived next to the assertions. Multi-turn samples
(environment replies inside the response) against the same statement with their masks applied
by hand; and the environment's tokens at the end of an episode, and the logprobs the engine
reports for them, move no gradient.

And no host synchronisation inside a micro-batch: between the start of a micro-batch's forward
and the end of its backward, our code (and what it calls) reads no tensor back to Python and
calls no operation whose output size depends on tensor values (on an accelerator, each would
wait for the device). Checked on the plain model and under FSDP2 at one rank.
"""

import collections
import copy
import traceback

import pytest
import torch
from transformers import AutoModelForCausalLM

import grpo
import logprobs
import reference
import trainer
from test_packing import model_for, varied_samples, world_of_one  # noqa: F401 (fixture)

# (loss_agg, clip_low, clip_high, kl_coef, kl_estimator, is_correction, on_policy, temperature)
VARIANTS = [
    ("token_mean", 0.2, 0.2, 0.0, "k3", "tis", True, 0.7),
    ("seq_mean", 0.1, 0.3, 0.05, "k1", "seq_mask", True, 0.7),  # weights need whole sequences
    ("constant", 0.2, 0.28, 0.2, "k2", "none", False, 0.7),
    ("token_mean", 0.2, 0.28, 0.1, "k3", "seq_mask", False, 1.0),
    ("seq_mean", 0.2, 0.2, 0.0, "k3", "tis", False, 1.0),
    ("seq_mean", 0.2, 0.2, 0.0, "k3", "seq_geo_mask", True, 0.7),  # on-policy: the first pass
    ("token_mean", 0.2, 0.28, 0.0, "k3", "token_mask", False, 1.0),
    ("constant", 0.2, 0.2, 0.0, "k3", "seq_truncate", False, 1.0),
]


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def hf_logits(model, samples):
    """transformers' own (sdpa, padded batch) logits on the same weights: (n, T-1, V), targets,
    mask, and the engine logp, padded."""
    twin = AutoModelForCausalLM.from_config(copy.deepcopy(model.config),
                                            attn_implementation="sdpa")
    twin.to(next(model.parameters()).dtype).load_state_dict(model.state_dict())
    ids, attn, targets, mask, pt = reference.pad_batch(samples, 0)
    return twin, twin(input_ids=ids, attention_mask=attn).logits[:, :-1], targets, mask, pt


def with_turns(samples):
    """Every response of 6 tokens or more becomes an episode, as episodes.py writes one: the
    model's first turn, an environment's reply (mask 0), the model's second turn, and in every
    other sample a trailing reply (an episode that stopped at its token limit)."""
    for i, s in enumerate(samples):
        n = len(s.response_ids)
        if n >= 6:
            first, reply = n // 3, max(1, n // 4)
            s.mask = [1] * first + [0] * reply + [1] * (n - first - reply)
            if i % 2:
                s.mask[-2:] = [0, 0]
    return samples


def by_hand(mask, samples):
    """(n, T-1) response mask -> the same with each sample's environment tokens set to 0."""
    hand = mask.clone()
    for i, s in enumerate(samples):
        p = len(s.prompt_ids)
        for j, written in enumerate(s.mask or []):
            if not written:
                hand[i, p - 1 + j] = 0  # position p - 1 + j predicts response token j
    return hand


def assert_agree(fused, unfused, tol: float, scale, every_weight: bool = False):
    """fused_and_unfused's two results agree: the loss within tol x scale (the size of its
    terms), the logprobs and the entropy within tol relative, every gradient within tol of the
    largest, the clip count exactly; every_weight: each weight has a gradient."""
    assert abs(fused["loss"] - unfused["loss"]) < tol * scale
    for name in ("entropy", "logp"):
        assert rel(torch.as_tensor(fused[name]).double(),
                   torch.as_tensor(unfused[name]).double()) < tol, name
    grads = [k for k in unfused if k not in ("loss", "entropy", "clipped", "logp")]
    top = max(unfused[k].abs().max() for k in grads)
    for name in grads:
        assert not every_weight or unfused[name].abs().max() > 0, name
        assert (fused[name] - unfused[name]).abs().max() < tol * top, name
    assert fused["clipped"] == unfused["clipped"]


def fused_and_unfused(arch, variant, dtype, turns=False, extra=None):
    """The update's loss, logprobs, entropy, clip count and gradients, fused and unfused, with
    the model in `dtype`; the mismatch weights too, to check that they took part. turns: the
    samples are multi-turn episodes, and the unfused statement applies their masks by hand.
    extra: more grpo fields, and "forking": True for a random half of the model's tokens as the
    ones that keep their policy gradient (batcher.Batch.forking)."""
    extra = dict(extra or {})
    forks = extra.pop("forking", False)
    agg, low, high, kl, est, mode, on_policy, temp = variant[:8]
    policy = variant[8] if len(variant) > 8 else "ppo"  # POLICY_VARIANTS
    unbiased = len(variant) > 9 and variant[9]  # and the KL term's ratio
    delta = variant[10] if len(variant) > 10 else 0.0  # and the off-policy mask
    dual = variant[11] if len(variant) > 11 else 0.0  # and dual-clip's lower bound
    torch.manual_seed(0)  # model_for perturbs the norms with the global generator
    model, samples = model_for(arch).to(dtype), varied_samples(2)
    if turns:
        with_turns(samples)
    g = grpo.GRPOConfig(loss_agg=agg, clip_low=low, clip_high=high, kl_coef=kl, kl_estimator=est,
                        is_correction=mode, micro_batch_tokens=64, logprob_chunk=5,
                        # a geometric mean moves less than a product: a tighter band for it,
                        # so that some sequences leave it
                        is_cap=1.1 if mode == "seq_geo_mask" else 1.5,
                        policy_loss=policy, kl_unbiased=unbiased, off_policy_delta=delta,
                        dual_clip=dual, **extra)
    gen = torch.Generator().manual_seed(3)
    adv = torch.randn(len(samples), generator=gen)
    twin, logits, targets, mask, _ = hf_logits(model, samples)
    lp = reference.token_logprobs(logits, targets, temp)  # (n, T-1)
    m = mask.bool()

    def near(scale):  # per-sample lists near the true logp: ratios on both sides of the clip
        return [(lp[i][m[i]].detach().float() + scale * torch.randn(int(m[i].sum()),
                                                                    generator=gen))
                for i in range(len(samples))]

    drift = 0.1 if len(variant) > 10 else 0.0  # the off-policy mask's cases: the engine's
    #   logprobs 0.1 above the trainer's on average, so that negative-advantage rows exceed delta
    for s, e in zip(samples, near(0.3)):  # the engine sampled from nearly the same policy
        e += drift
        s.logp = [x if w else 0.0 for x, w in zip(e.tolist(), s.mask or [1] * len(e))]  # 0: not sampled
    hand = by_hand(mask, samples)  # the response tokens the model wrote
    old, ref = (None if on_policy else near(0.3)), (near(0.5) if kl else None)
    forking = [(torch.rand(len(s.response_ids), generator=gen) < 0.5).float()
               * torch.tensor(s.mask or [1] * len(s.response_ids), dtype=torch.float32)
               for s in samples] if forks else None
    model.zero_grad()
    logps, stats = trainer.accumulate_gradients(
        model, reference.batch_of(samples, adv, forking=forking, old_logp=old, ref_logp=ref),
        reference.settings(g, temp))
    fused = {"loss": stats["loss"], "entropy": stats["entropy"], "clipped": stats["clipped"],
             "logp": torch.cat(logps), **{n: p.grad for n, p in model.named_parameters()}}

    pad = lambda lists: reference.pad_batch(  # noqa: E731
        samples, 0, {"x": lists})[4]["x"].to(dtype)
    old_pad = lp.detach() if on_policy else pad(old)
    w = grpo.mismatch_weights(old_pad, pad([s.logp for s in samples]), hand, mode, g.is_cap)
    engine = pad([s.logp for s in samples])
    fork = pad(forking) if forks else None
    loss, clipped = reference.padded_loss(lp, old_pad, adv.to(dtype), hand.to(dtype), g,
                                          float(hand.sum()), float(len(samples)), 64, w,
                                          pad(ref) if kl else None, engine, fork)
    if g.entropy_coef:  # the bonus: minus coef x the mean entropy over the tokens kept
        logq = (logits / temp).to(dtype).log_softmax(-1)
        h = -(logq.exp() * logq).sum(-1)  # (n, T-1), differentiable
        on = hand.to(dtype) * (fork if forks else 1)
        loss = loss - g.entropy_coef * (h * on).sum() / on.sum()
    loss.backward()
    terms = reference.padded_terms(lp.detach(), old_pad, adv.to(dtype), g, w,
                                   pad(ref) if kl else None, hand.to(dtype), engine, fork)[0]
    scale = (terms * grpo.loss_weights(hand.to(dtype), g, float(hand.sum()), float(len(samples)),
                                       64)).abs().sum()  # the size of the loss's terms
    unfused = {"loss": loss.detach(), "clipped": clipped.sum(), "logp": lp[m].detach(),
               "entropy": reference.masked_entropy_sum(logits.detach() / temp, hand),
               **{n: p.grad for n, p in twin.named_parameters()}}
    return fused, unfused, w[hand.bool()], scale


@pytest.mark.parametrize("arch, turns", [("qwen2", False), ("qwen3", False), ("qwen2", True)],
                         ids=["qwen2", "qwen3", "qwen2-multi-turn"])
@pytest.mark.parametrize("variant", VARIANTS, ids=["-".join(map(str, v)) for v in VARIANTS])
def test_fused_equals_unfused(arch, turns, variant, world_of_one):
    """turns: multi-turn samples against the plain statement with their masks applied by hand
    (every response token still gets a logprob; only the model's count anywhere else)."""
    on_policy, mode = variant[6], variant[5]
    # fp64: the same arithmetic. What differs: the per-token inputs (advantages, aggregation and
    # mismatch weights) enter the fused path in fp32, relative rounding 2^-24 = 6e-8 each, and
    # the loss and each gradient element sum a few hundred tokens' terms of either sign: 1e-6 of
    # the size of those terms (the loss's terms; the model's largest gradient), 1e-6 of the
    # logprobs and of the entropy (the masked_entropy_sum reference sums in fp32)
    # fp32, as the trainer runs on CPU: the two differ by fp32 rounding alone, in different orders
    # (chunks, micro-batches, packed attention): at most a few hundred terms per sum, 2^-24 each,
    # walking to ~1e-6 of their size; 1e-5 leaves a factor ten. (Relative to its own largest
    # element, the gradient of an attention weight can be 1e-5 off in either computation: its
    # terms cancel.)
    for dtype, tol in ((torch.float64, 1e-6), (torch.float32, 1e-5)):
        fused, unfused, w, scale = fused_and_unfused(arch, variant, dtype, turns)
        assert_agree(fused, unfused, tol, scale, every_weight=True)
    if not on_policy:
        assert 0 < unfused["clipped"] < len(unfused["logp"])  # the clip took part
    if mode != "none":
        assert (w != 1).any()  # so did the mismatch weights


# grpo.policy_loss: (the fields above, then the surrogate). gspo off-policy takes the first pass
# (its sequence ratios), on-policy none (each ratio is 1); multi-turn gspo averages each
# sequence over the model's tokens only
POLICY_VARIANTS = [
    ("seq_mean", 3e-4, 4e-4, 0.0, "k3", "seq_mask", False, 1.0, "gspo"),
    ("seq_mean", 0.2, 0.2, 0.05, "k1", "none", True, 0.7, "gspo"),
    ("token_mean", 0.2, 0.5, 0.1, "k3", "tis", False, 1.0, "cispo"),
    ("token_mean", 0.2, 0.2, 0.0, "k3", "tis", False, 0.7, "sapo"),
    ("token_mean", 0.2, 0.28, 0.1, "k3", "tis", False, 1.0, "ppo", True),  # grpo.kl_unbiased
    # grpo.off_policy_delta, on- and off-policy (the engine's logprobs drift 0.1 up, see
    # fused_and_unfused: the negative-advantage rows exceed a delta of 0.02)
    ("token_mean", 0.2, 0.2, 0.1, "k3", "tis", True, 1.0, "ppo", False, 0.02),
    ("seq_mean", 0.2, 0.2, 0.0, "k3", "none", False, 0.7, "cispo", False, 0.02),
    # DPPO's trust regions, off-policy: bounds the near(0.3) old policy's tokens cross
    ("token_mean", 0.02, 0.02, 0.0, "k3", "tis", False, 1.0, "dppo_tv"),
    ("seq_mean", 0.002, 0.002, 0.05, "k1", "tis", False, 0.7, "dppo_kl"),
    # grpo.dual_clip: off-policy ratios above c = 1.3 (> 1 + clip_high) with a negative advantage
    #   meet the bound
    ("token_mean", 0.2, 0.2, 0.0, "k3", "tis", False, 1.0, "ppo", False, 0.0, 1.3),
]


@pytest.mark.parametrize("arch, turns", [("qwen2", False), ("qwen3", False), ("qwen2", True)],
                         ids=["qwen2", "qwen3", "qwen2-multi-turn"])
@pytest.mark.parametrize("variant", POLICY_VARIANTS,
                         ids=["-".join(map(str, v)) for v in POLICY_VARIANTS])
def test_fused_equals_unfused_for_each_surrogate(arch, turns, variant, world_of_one):
    """The same comparison for grpo.policy_loss's surrogates, with the same tolerances (their
    inputs enter the fused path in fp32 as PPO's do): the fused pass computes what each
    paper's formula, written apart in tests/reference.py and differentiated by autograd,
    computes."""
    for dtype, tol in ((torch.float64, 1e-6), (torch.float32, 1e-5)):
        fused, unfused, _, scale = fused_and_unfused(arch, variant, dtype, turns)
        assert_agree(fused, unfused, tol, scale)
        if len(variant) > 10 and variant[10]:  # the mask dropped rows: without it the loss
            unmasked = fused_and_unfused(arch, variant[:10] + (0.0,), dtype, turns)[0]  # differs
            assert abs(unmasked["loss"] - fused["loss"]) > 100 * tol * scale
        if len(variant) > 11:  # dual-clip's bound took part: without it the loss differs
            unbounded = fused_and_unfused(arch, variant[:11], dtype, turns)[0]
            assert abs(unbounded["loss"] - fused["loss"]) > 100 * tol * scale
    if variant[8] in ("gspo", "cispo", "ppo", "dppo_tv", "dppo_kl") and not variant[6]:
        assert 0 < unfused["clipped"] < len(unfused["logp"])  # the cut took part


# the objectives of 2026: (the fields above, then more grpo fields). VESPO on-policy takes the
# first pass for its sequences' mismatch weights, off-policy for their ratios; LUSPO as GSPO;
# the entropy bonus and the forking tokens, each alone and together, on- and off-policy
NEW_OBJECTIVES = [
    (("token_mean", 0.2, 0.2, 0.0, "k3", "tis", True, 1.0, "vespo"), {}),
    (("token_mean", 0.2, 0.2, 0.05, "k3", "token_mask", False, 0.7, "vespo"), {}),
    (("seq_mean", 0.2, 0.2, 0.0, "k3", "none", False, 1.0, "vespo"), {"vespo_k_pos": 1.0}),
    (("seq_sum", 3e-4, 4e-4, 0.0, "k3", "seq_mask", False, 1.0, "luspo"), {}),
    (("seq_sum", 0.2, 0.2, 0.05, "k1", "none", True, 0.7, "luspo"), {}),
    (("token_mean", 0.2, 0.2, 0.0, "k3", "tis", True, 0.7, "ppo"), {"entropy_coef": 0.05}),
    (("seq_mean", 0.2, 0.2, 0.05, "k3", "tis", False, 1.0, "cispo"),
     {"entropy_coef": 0.05, "forking": True}),
    (("token_mean", 0.2, 0.2, 0.0, "k3", "seq_mask", True, 1.0, "ppo"), {"forking": True}),
]


@pytest.mark.parametrize("arch, turns", [("qwen2", False), ("qwen2", True)],
                         ids=["qwen2", "qwen2-multi-turn"])
@pytest.mark.parametrize("variant, extra", NEW_OBJECTIVES,
                         ids=["-".join(map(str, v + tuple(e))) for v, e in NEW_OBJECTIVES])
def test_fused_equals_unfused_for_the_new_objectives(arch, turns, variant, extra, world_of_one):
    """VESPO, LUSPO, the entropy bonus (its gradient, dense over the vocabulary, computed in the
    fused pass) and the forking tokens against their statements in tests/reference.py and an
    autograd entropy of transformers' logits, with test_fused_equals_unfused's tolerances; and
    each of them takes part: the loss differs from PPO's with the token mean."""
    for dtype, tol in ((torch.float64, 1e-6), (torch.float32, 1e-5)):
        fused, unfused, _, scale = fused_and_unfused(arch, variant, dtype, turns, extra)
        assert_agree(fused, unfused, tol, scale)
        plain = fused_and_unfused(arch, ("token_mean",) + variant[1:8] + ("ppo",), dtype,
                                  turns)[0]  # PPO's loss and aggregation, nothing more
        assert abs(plain["loss"] - fused["loss"]) > 100 * tol * scale


@pytest.mark.parametrize("variant", VARIANTS[:2] + VARIANTS[3:4],
                         ids=["-".join(map(str, v)) for v in VARIANTS[:2] + VARIANTS[3:4]])
def test_environment_tokens_move_no_gradient(variant, world_of_one):
    """An environment's reply at the end of an episode (as when it stopped at its token limit)
    is context for nothing the model wrote: replacing its tokens, and the logprobs the engine
    reports for them, leaves the loss, the clip count and every gradient as they were. (Replies
    between turns change the context of the next turn, so they do change the gradient.)"""
    agg, low, high, kl, est, mode, on_policy, temp = variant
    torch.manual_seed(0)
    model, samples = model_for("qwen2"), with_turns(varied_samples(2))
    g = grpo.GRPOConfig(loss_agg=agg, clip_low=low, clip_high=high, kl_coef=kl, kl_estimator=est,
                        is_correction=mode, is_cap=1.5, micro_batch_tokens=64, logprob_chunk=5)
    gen = torch.Generator().manual_seed(3)
    adv = torch.randn(len(samples), generator=gen)
    near = [torch.tensor(s.logp) * 0.1 for s in samples]
    old, ref = (None if on_policy else near), (near if kl else None)
    trailing = [i for i, s in enumerate(samples) if s.mask and not s.mask[-1]]
    assert trailing

    def update():
        model.zero_grad()
        _, stats = trainer.accumulate_gradients(
            model, reference.batch_of(samples, adv, old_logp=old, ref_logp=ref),
            reference.settings(g, temp))
        return stats, {n: p.grad.clone() for n, p in model.named_parameters()}

    before, grads = update()
    for i in trailing:  # new reply tokens, and an engine that reports anything for them
        s = samples[i]
        s.response_ids[-2:] = [(t + 5) % 13 + 2 for t in s.response_ids[-2:]]
        s.logp[-2:] = [-9.0, 3.0]
    after, grads_after = update()
    # the same arithmetic on the same values, up to the order of fp32 sums: 1e-6 of the size
    top = max(x.abs().max() for x in grads.values())
    assert abs(after["loss"] - before["loss"]) <= 1e-6 * abs(before["loss"])
    assert after["clipped"] == before["clipped"]
    for name, x in grads.items():
        assert (grads_after[name] - x).abs().max() <= 1e-6 * top, name
    # the check can fail: the same change on a token the model wrote moves the gradient
    s = samples[trailing[0]]
    s.mask[-1] = 1
    moved = update()[1]
    assert max((moved[n] - x).abs().max() for n, x in grads.items()) > 1e-3 * top


# ----------------------------------------------------------------------------------------------
# host synchronisations

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__",
         "nonzero", "masked_select", "unique")  # a value back to Python, or a value-sized output
FUNCTIONS = ("nonzero", "masked_select", "unique", "repeat_interleave")


class SyncCounter:
    """While `on`, counts the calls above (and bool-mask indexing, and repeat_interleave without
    output_size), by call site. Indexing is seen through a torch function mode (`indexing`), not
    by patching torch.Tensor's __getitem__: setting and then deleting that on the class leaves
    CPython's sequence slot filled, and torch.tensor([a 0-d tensor, ...]) then fails for the rest
    of the session ("len() of a 0-d tensor", inside transformers' get_rope_index)."""

    def __init__(self, monkeypatch):
        self.on, self.sites, self.windows = False, collections.Counter(), 0
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self.wrap(getattr(torch.Tensor, name), name))
        for name in FUNCTIONS:
            monkeypatch.setattr(torch, name, self.wrap(getattr(torch, name), "torch." + name))

    def indexing(self):
        """A torch function mode, entered around the counted work, that counts bool-mask
        indexing (Tensor.__getitem__, __setitem__) like the calls above."""
        counter = self

        class Indexing(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = getattr(func, "__name__", "")
                if name in ("__getitem__", "__setitem__"):
                    return counter.wrap(func, name, depth=3)(*args, **kwargs)
                return func(*args, **kwargs)

        return Indexing()

    def counts(self, name, args, kwargs) -> bool:
        if name in ("__getitem__", "__setitem__"):
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            return any(torch.is_tensor(i) and i.dtype == torch.bool for i in index)
        if name == "torch.repeat_interleave":
            return torch.is_tensor(args[1] if len(args) > 1 else kwargs.get("repeats")) and (
                kwargs.get("output_size") is None)
        return True

    def wrap(self, fn, name, depth: int = 2):
        def counted(*args, **kwargs):
            if self.on and self.counts(name, args, kwargs):
                self.on = False  # not inside our own bookkeeping
                site = traceback.extract_stack(limit=depth)[0]  # the caller's line
                self.sites[f"{name} at {site.filename}:{site.lineno}"] += 1
                self.on = True
            return fn(*args, **kwargs)
        return counted

    def around(self, model, monkeypatch):
        """On from the start of the model's forward to the end of each backward."""
        def start(*_):
            self.on, self.windows = True, self.windows + 1
        model.register_forward_pre_hook(start, prepend=True)
        backward = torch.Tensor.backward

        def counted_backward(t, *args, **kwargs):
            backward(t, *args, **kwargs)
            self.on = False
        monkeypatch.setattr(torch.Tensor, "backward", counted_backward)


def fsdp_model(arch, path):
    """The tiny model as the trainer builds it (FSDP2, one rank)."""
    import fsdp_utils
    from torch.distributed.device_mesh import init_device_mesh

    model_for(arch).save_pretrained(path)
    return fsdp_utils.build_actor(fsdp_utils.ModelConfig(path=str(path), param_dtype="float32"),
                                  init_device_mesh("cpu", (1,)))


@pytest.mark.parametrize("arch, sharded", [("qwen2", False), ("qwen3", False), ("qwen2", True)],
                         ids=["qwen2", "qwen3", "qwen2-fsdp2"])
@pytest.mark.parametrize("mode", ["tis", "seq_mask"])
def test_no_host_sync_in_a_micro_batch(arch, sharded, mode, world_of_one, monkeypatch, tmp_path):
    model = fsdp_model(arch, tmp_path) if sharded else model_for(arch)
    samples = with_turns(varied_samples())  # masks included
    counter = SyncCounter(monkeypatch)
    counter.around(model, monkeypatch)
    g = grpo.GRPOConfig(is_correction=mode, kl_coef=0.1, micro_batch_tokens=4096)  # one
    ref = [[-1.0] * len(s.response_ids) for s in samples]
    with counter.indexing():
        for old in (None, ref):  # on-policy, and off-policy with a reference
            trainer.accumulate_gradients(model, reference.batch_of(
                samples, torch.randn(len(samples)), old_logp=old, ref_logp=ref),
                reference.settings(g, 0.7))
    assert counter.windows == 2 and not counter.on  # each forward opened it, backward closed it
    assert not counter.sites, dict(counter.sites)
    # the check can fail: a read in the window is counted
    counter.on = True
    torch.ones(2).sum().item()
    counter.on = False
    assert sum(counter.sites.values()) == 1


def test_no_host_sync_in_the_logprob_pass(world_of_one, monkeypatch):
    import logprobs

    model, samples = model_for("qwen3"), varied_samples()
    counter = SyncCounter(monkeypatch)
    model.register_forward_pre_hook(lambda *_: setattr(counter, "on", True), prepend=True)
    model.register_forward_hook(lambda *_: setattr(counter, "windows", counter.windows + 1))
    model.register_forward_hook(lambda *_: setattr(counter, "on", False))
    g = grpo.GRPOConfig(micro_batch_tokens=64)  # several micro-batches
    with counter.indexing():
        logprobs.sample_logprobs(model, samples, reference.settings(g, 0.7).passes)
    assert counter.windows == 4
    assert not counter.sites, dict(counter.sites)


def test_fsdp_param_groups_reads_both_torch_layouts():
    """torch 2.13 keeps a unit's groups in a list (`_fsdp_param_groups`); torch 2.10 and 2.11,
    the versions the Ascend and GPU stacks run, hold one `_fsdp_param_group` and no list. A unit
    of each layout (stand-ins: this machine has torch 2.13 only) gives its groups as a list."""
    import types

    group = types.SimpleNamespace(post_forward_mesh_info=None)
    new = types.SimpleNamespace(_fsdp_param_groups=[group, group])
    old, old_empty = (types.SimpleNamespace(_fsdp_param_group=g) for g in (group, None))
    unit = lambda state: types.SimpleNamespace(_get_fsdp_state=lambda: state)  # noqa: E731
    assert logprobs.fsdp_param_groups(unit(new)) == [group, group]
    assert logprobs.fsdp_param_groups(unit(old)) == [group]
    assert logprobs.fsdp_param_groups(unit(old_empty)) == []


def test_the_loss_the_docs_name_is_the_loss_that_trains(world_of_one, monkeypatch):
    """grpo.py's docstring and the README say: to try a new loss, edit grpo.grpo_loss. Wrapped
    so that its loss is multiplied by a factor, the update that train_step runs (trainer.update)
    follows: times 0, a zero gradient and every weight as it was; times 2, twice the gradient
    norm. It is called on every response token once, chunk by chunk."""
    samples, real, calls = varied_samples(4), grpo.grpo_loss, []
    adv = torch.tensor([1.0, -0.5, 2.0, -1.5, 0.3, 0.8])

    def update(factor):
        def wrapped(logp, t, cfg):
            calls.append(logp.numel())
            loss, clipped = real(logp, t, cfg)
            return factor * loss, clipped

        monkeypatch.setattr(grpo, "grpo_loss", wrapped)
        torch.manual_seed(0)  # model_for perturbs the norms with the global generator
        model, calls[:] = model_for("qwen2"), []
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
        m = reference.update(model, None, opt, reference.batch_of(samples, adv),
                             reference.settings(grpo.GRPOConfig(logprob_chunk=5)))
        moved = max((p - before[n]).abs().max().item() for n, p in model.named_parameters())
        return m["grad_norm"], moved, list(calls)

    norm, moved, chunks = update(1.0)
    assert sum(chunks) == sum(len(s.response_ids) for s in samples) and max(chunks) <= 5
    assert norm > 0 and moved > 0
    assert update(0.0)[:2] == (0.0, 0.0)
    # a factor of 2 scales every gradient exactly (a power of two commutes with rounding); the
    # norm's sum of squares may add in another order: 1e-6 of it is left for that
    assert abs(update(2.0)[0] - 2 * norm) <= 1e-6 * norm
