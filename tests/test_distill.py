"""On-policy distillation (distill.py) against a naive loop over sequences in fp64: the
teacher's logprob of each sampled token from a plain forward of the whole sequence, the
per-token advantage coef * (teacher - student) + reward_coef * A, and the student's gradient of
-(1/N) sum over written tokens of A_t log p_t (on-policy, the surrogate's ratio is 1); and the
checks the `distill:` section gets before any model loads.

The teacher is a Qwen3 twice the student's width and the student a Qwen2, of the tiny task's
tokenizer, both from config, the teacher built as the run builds it (FSDP2, parked in host
memory) in fp64.

Tolerance: both sides compute fp64 logprobs of the same weights (packed and chunked against
one plain forward: sums of at most a few hundred products of size < 10 in other orders, errors
~1e-14) and the loss's token weights are 1/32, exact in the fp32 the mask is kept in, so the
advantages and gradients agree to ~1e-13 relative; 1e-10 leaves room and would still catch a
wrong sign, token, temperature or weight."""

import json
import shutil

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM, AutoTokenizer

import batcher
import config
import fsdp_utils
import reference
import trainer
from workflows import distill
from records import Sample
from test_packing import world_of_one  # noqa: F401 (fixture)
from train_grpo import load_config, resolve

TEMPERATURE = 0.7


def naive_logp(model, sample: Sample) -> list[float]:
    """The model's logprob of each response token, from one forward of the whole sequence."""
    ids = torch.tensor([sample.prompt_ids + sample.response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double() / TEMPERATURE
    logp = torch.log_softmax(logits, -1)
    n = len(sample.prompt_ids)
    return [float(logp[n - 1 + t, tok]) for t, tok in enumerate(sample.response_ids)]


def teach(teacher, samples: list, group_adv: torch.Tensor, cfg):
    """distill.teach on a batch of `samples` whose group advantages are `group_adv` (fp64, per
    token); its per-token advantages, its teacher's top k (or None) and its metrics."""
    adv = [torch.full((len(s.response_ids),), a, dtype=torch.float64)
           for s, a in zip(samples, group_adv.tolist())]
    batch = distill.teach(batcher.Batch(samples, adv, 0), teacher, cfg.distill,
                          reference.settings(cfg.grpo, cfg.rollout.temperature).passes)
    return batch.adv, batch.teacher, batch.metrics


def make_samples(student, vocab: int) -> list:
    """Five samples whose model-written tokens number 32 (a power of two: the loss's weights 1/32
    are exact); one an episode whose environment wrote 3 of its tokens. The engine's logprobs are
    the student's own, as an fp64 engine would give."""
    g = torch.Generator().manual_seed(0)
    out = []
    for prompt, response in ((3, 5), (6, 9), (2, 4), (4, 7), (5, 10)):
        s = Sample(torch.randint(3, vocab, (prompt,), generator=g).tolist(),
                   torch.randint(3, vocab, (response,), generator=g).tolist(), [], False)
        out.append(s)
    out[4].mask = [1, 1, 0, 0, 0, 1, 1, 1, 1, 1]  # 7 written: 5 + 9 + 4 + 7 + 7 = 32
    for s in out:
        s.logp = naive_logp(student, s)
    return out


@pytest.fixture(scope="module")
def larger_teacher(tiny_models, tmp_path_factory):
    """A random Qwen3 twice the tiny student's width and one layer deeper, with its tokenizer."""
    from transformers import AutoConfig

    path = tmp_path_factory.mktemp("teacher")
    shutil.copytree(tiny_models["qwen3"], path, dirs_exist_ok=True)
    cfg = AutoConfig.from_pretrained(path)
    cfg.update(dict(hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                    num_attention_heads=8, layer_types=["full_attention"] * 3))
    with torch.random.fork_rng():
        torch.manual_seed(5)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def models(tiny_models, larger_teacher, world_of_one):
    """(student: plain fp64 Qwen2, teacher: a larger FSDP2 fp64 Qwen3 as distill.build_teacher
    makes it, the teacher's weights as a plain fp64 model for the naive loop)."""
    attn = fsdp_utils.register_attention("sdpa")  # each packed sample's attention apart
    student = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"], dtype=torch.float64,
                                                   attn_implementation=attn)
    spec = fsdp_utils.ModelConfig(path=larger_teacher, param_dtype="float64",
                                  reduce_dtype="float64", attn_implementation="sdpa")
    mesh = init_device_mesh("cpu", (1,))
    teacher = distill.build_teacher(distill.DistillConfig(teacher=larger_teacher), spec, mesh)
    plain = AutoModelForCausalLM.from_pretrained(larger_teacher, dtype=torch.float64)
    assert plain.config.hidden_size == 2 * student.config.hidden_size
    return student, teacher, plain


@pytest.mark.parametrize("coef, reward_coef", [(1.0, 0.0), (0.5, 2.0)])
def test_advantages_and_gradient_equal_a_naive_loop(models, coef, reward_coef):
    student, teacher, plain = models
    samples = make_samples(student, student.config.vocab_size)
    group_adv = torch.tensor([0.5, -1.0, 0.0, 1.5, -0.25], dtype=torch.float64)
    cfg = load_config(None, ["--rollout.temperature=0.7", f"--distill.coef={coef}",
                             f"--distill.reward_coef={reward_coef}", "--grpo.is_correction=none",
                             "--grpo.micro_batch_tokens=24", "--grpo.logprob_chunk=8"])
    adv, top, metrics = teach(teacher, samples, group_adv, cfg)
    assert top is None  # reverse_sampled: all of it in the advantages

    kl, n = 0.0, 0
    for s, a, got in zip(samples, group_adv.tolist(), adv):
        written = s.mask or [1] * len(s.response_ids)
        teacher_lp = naive_logp(plain, s)
        want = [coef * (lt - ls) + reward_coef * a for lt, ls in zip(teacher_lp, s.logp)]
        assert got.dtype == torch.float64 and len(got) == len(want)
        assert max(abs(x - y) for x, y in zip(got.tolist(), want)) < 1e-10
        kl += sum((ls - lt) * w for ls, lt, w in zip(s.logp, teacher_lp, written))
        n += sum(written)
    assert n == 32
    assert abs(metrics["distill_kl"].total / metrics["distill_kl"].count - kl / n) < 1e-10
    assert metrics["teacher_gb"] * 2**30 == 8 * sum(p.numel() for p in plain.parameters())

    # the student's gradient through the trainer's pass, against autograd on the naive loss
    student.zero_grad()
    trainer.accumulate_gradients(student, batcher.Batch(samples, adv, 0),
                                 reference.settings(cfg.grpo, TEMPERATURE))
    got = {name: p.grad.clone() for name, p in student.named_parameters()}
    student.zero_grad()
    loss = 0.0
    for s, a in zip(samples, adv):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logp = torch.log_softmax(student(input_ids=ids).logits[0] / TEMPERATURE, -1)
        k = len(s.prompt_ids)
        for t, (tok, w) in enumerate(zip(s.response_ids, s.mask or [1] * len(s.response_ids))):
            loss = loss - w * a[t] * logp[k - 1 + t, tok] / 32
    loss.backward()
    for name, p in student.named_parameters():
        scale = p.grad.abs().max()
        assert scale > 0, name
        assert (got[name] - p.grad).abs().max() <= 1e-10 * scale, name


def naive_forward_kl(teacher_logp, student_logp, k: int):
    """One position's forward KL from the teacher to the student over the teacher's k likeliest
    tokens and one bucket for all others, from the two full (V,) log-softmax vectors: the
    buckets' masses summed token by token, in fp64."""
    top = torch.topk(teacher_logp, k).indices.tolist()
    rest = [v for v in range(len(teacher_logp)) if v not in top]
    kl = sum(teacher_logp[v].exp() * (teacher_logp[v] - student_logp[v]) for v in top)
    if rest:
        t_rest = sum(teacher_logp[v].exp() for v in rest)
        s_rest = sum(student_logp[v].exp() for v in rest)
        kl = kl + t_rest * (t_rest.log() - s_rest.log())
    return kl, top


@pytest.mark.parametrize("k, coef, reward_coef", [(3, 1.0, 0.0), (50, 2.0, 0.5)])
def test_forward_top_k_equals_a_naive_loop(models, k, coef, reward_coef):
    """distill.loss=forward_top_k: the teacher pass's top k at each response token equal a plain
    forward's, the advantages carry the reward's share alone, and the student's gradient equals
    autograd on (1/32) sum over written tokens of coef * the k+1-bucket forward KL, plus the
    reward's policy-gradient term. k=50 covers the whole vocabulary: there the naive KL is
    also the plain full one, sum_v t_v (log t_v - log s_v)."""
    student, teacher, plain = models
    vocab = student.config.vocab_size
    samples = make_samples(student, vocab)
    group_adv = torch.tensor([0.5, -1.0, 0.0, 1.5, -0.25], dtype=torch.float64)
    cfg = load_config(None, ["--rollout.temperature=0.7", "--distill.loss=forward_top_k",
                             f"--distill.top_k={k}", f"--distill.coef={coef}",
                             f"--distill.reward_coef={reward_coef}", "--grpo.is_correction=none",
                             "--grpo.micro_batch_tokens=24", "--grpo.logprob_chunk=8"])
    adv, top, _ = teach(teacher, samples, group_adv, cfg)
    assert top.coef == coef and all(x.shape == (len(s.response_ids), min(k, vocab))
                                    for s, x in zip(samples, top.ids))
    for s, a, got in zip(samples, group_adv.tolist(), adv):
        assert torch.equal(got, torch.full((len(s.response_ids),), reward_coef * a,
                                           dtype=torch.float64))

    student.zero_grad()
    trainer.accumulate_gradients(student, batcher.Batch(samples, adv, 0, teacher=top),
                                 reference.settings(cfg.grpo, TEMPERATURE))
    got = {name: p.grad.clone() for name, p in student.named_parameters()}
    student.zero_grad()
    loss = 0.0
    for i, (s, a) in enumerate(zip(samples, adv)):
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logp = torch.log_softmax(student(input_ids=ids).logits[0] / TEMPERATURE, -1)
        with torch.no_grad():
            t_logp = torch.log_softmax(plain(input_ids=ids).logits[0].double() / TEMPERATURE, -1)
        n = len(s.prompt_ids)
        for t, (tok, w) in enumerate(zip(s.response_ids, s.mask or [1] * len(s.response_ids))):
            kl, ids_want = naive_forward_kl(t_logp[n - 1 + t], logp[n - 1 + t], min(k, vocab))
            assert sorted(top.ids[i][t].tolist()) == sorted(ids_want)
            assert (top.logp[i][t] - t_logp[n - 1 + t][top.ids[i][t]]).abs().max() < 1e-10
            if k >= vocab:
                full = (t_logp[n - 1 + t].exp() * (t_logp[n - 1 + t] - logp[n - 1 + t])).sum()
                assert abs(float((kl - full).detach())) < 1e-10
            loss = loss + w * (coef * kl - a[t] * logp[n - 1 + t, tok]) / 32
    loss.backward()
    for name, p in student.named_parameters():
        scale = p.grad.abs().max()
        assert scale > 0, name
        assert (got[name] - p.grad).abs().max() <= 1e-10 * scale, name


def test_environment_tokens_and_the_teacher_move_nothing_else(models):
    """Tokens the environment wrote get an advantage from the teacher too, but no loss: changing
    their advantages changes no gradient. And the teacher's pass leaves it in host memory."""
    student, teacher, _ = models
    samples = make_samples(student, student.config.vocab_size)
    cfg = load_config(None, ["--grpo.is_correction=none"])
    adv, _, _ = teach(teacher, samples, torch.zeros(5, dtype=torch.float64), cfg)
    grads = []
    for shift in (0.0, 3.0):
        changed = [a.clone() for a in adv]
        changed[4][2:5] += shift  # the environment's three tokens
        student.zero_grad()
        trainer.accumulate_gradients(student, batcher.Batch(samples, changed, 0),
                                     reference.settings(cfg.grpo))
        grads.append([p.grad.clone() for p in student.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    with pytest.raises(RuntimeError, match="host memory"):  # parked: offload.to_host's guard
        teacher(input_ids=torch.tensor([[3, 4]]))


def test_the_section_is_checked_before_any_model_loads(tiny_task_dir, tiny_models, tmp_path):
    def checked(*overrides):
        cfg = resolve(load_config("configs/tiny_cpu.yaml",
                                  [f"--data.tiny_task_dir={tiny_task_dir}", *overrides]))
        config.validate(cfg, 1)
        config.check_model(cfg)

    checked(f"--distill.teacher={tiny_models['qwen3']}")  # same tokenizer: fine
    refused = {
        "no/such/dir/x": "neither a directory nor a hub id",
        str(tmp_path): "has no config.json",
    }
    for teacher, says in refused.items():
        with pytest.raises(config.BadInput, match=says):
            checked(f"--distill.teacher={teacher}")
    with pytest.raises(config.BadInput, match="no token gets a signal"):
        checked(f"--distill.teacher={tiny_models['qwen3']}", "--distill.coef=0")
    with pytest.raises(config.BadInput, match="grpo.dynamic_sampling=true with distill"):
        checked(f"--distill.teacher={tiny_models['qwen3']}", "--grpo.dynamic_sampling=true")
    # a teacher whose tokenizer has one more token
    other = tmp_path / "other"
    shutil.copytree(tiny_models["qwen3"], other)
    tok = AutoTokenizer.from_pretrained(other)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(other)
    with pytest.raises(config.BadInput, match="vocabulary differs") as e:
        checked(f"--distill.teacher={other}")
    assert len(str(e.value).splitlines()) == 1


@pytest.mark.engine
@pytest.mark.main_only  # the npu-stack lane runs the fp64 checks above
def test_a_run_moves_the_student_toward_its_teacher(tiny_task_dir, larger_teacher, tmp_path):
    """2 ranks, pure distillation (distill.reward_coef 0) from an untrained teacher of another
    architecture and twice the width (a random Qwen3, same tokenizer), sharded over both ranks:
    the student's reverse KL to it, measured on each step's own samples, falls to under half
    within 20 steps; the teacher's pass is timed and its shards counted."""
    from conftest import launch

    launch(["train_grpo.py", "--config", "configs/tiny_cpu.yaml", "--train.steps=20",
            f"--data.tiny_task_dir={tiny_task_dir}", f"--log.out_dir={tmp_path}",
            "--log.eval_every=0", "--grpo.prompts_per_step=16",
            f"--distill.teacher={larger_teacher}"], timeout=900)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    kl = [r["distill_kl"] for r in rows]
    assert sum(kl[-5:]) / 5 < 0.5 * sum(kl[:5]) / 5, kl
    assert all(r["teacher_time_s"] > 0 and r["teacher_gb"] > 0 for r in rows)


@pytest.mark.engine
@pytest.mark.main_only
def test_with_episodes_tensor_parallel_partial_rollout_and_lora(tiny_task_dir, tiny_models,
                                                                 tmp_path):
    """The teacher beside everything else a step can hold: multi-turn episodes (environment
    tokens in the responses), one engine over 2 ranks, samples carried across steps, and
    adapters on the student (the teacher stays whole), with the forward KL to its top 4 and a
    reward: the run goes through, the engine's logprobs equal to the trainer's at the first
    step, and the KL to the teacher logged."""
    from conftest import launch

    launch(["train_grpo.py", "--config", "configs/multiturn_cpu.yaml", "--train.steps=3",
            f"--data.tiny_task_dir={tiny_task_dir}", f"--log.out_dir={tmp_path}",
            "--log.eval_every=0", "--rollout.tp_size=2", "--grpo.prompts_per_step=16",
            "--rollout.partial.enabled=true", "--rollout.partial.oversample=1.5",
            "--model.lora.rank=8",
            f"--distill.teacher={tiny_models['qwen3']}", "--distill.reward_coef=1.0",
            "--distill.loss=forward_top_k", "--distill.top_k=4"],
           timeout=900)
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert len(rows) == 3 and all(r["distill_kl"] > 0 and r["teacher_gb"] > 0 for r in rows)
    assert rows[0]["logp_gap"] < 1e-4  # then carried tokens come from older weights
