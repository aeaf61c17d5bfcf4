"""Agents that speak OpenAI (agents.py): the endpoint on the real engine with the real `openai`
client (tests/workers/agent_endpoint.py), what it refuses, how between-turn messages become
tokens, the agent's and the tool parser's contracts, the config's checks, and a short run of
configs/agent_cpu.yaml."""

import json
import math

import pytest
import torch

from collect import agents, envs, openai_api
import episodes
from tasks import tiny_task
from conftest import launch, run_python
from test_templates import chat_tokenizer

# the successor model's chain: what it writes after each token (greedy), everything else <eos>
CHAIN = ["<|assistant|>", "<tool_call>", "1", "+", "2", "</tool_call>", "<eos>"]


@pytest.fixture(scope="module")
def successor_model(tmp_path_factory):
    """The tiny chat tokenizer (tiny_task.chat_tokenizer) and a Qwen2 that writes
    `<tool_call>1+2</tool_call><eos>` after every `<|assistant|>`: its layers add nothing (zero
    output projections), so each position's logits are its own token's row of a table: the next
    token of CHAIN 3 nats above the rest, plus noise, so that its logprobs are far from 0."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    rows = tiny_task.make_prompts()
    tok = tiny_task.chat_tokenizer(tiny_task.train_tokenizer([r["prompt"] + r["answer"]
                                                              for r in rows]))
    v, hidden = len(tok), 128
    cfg = Qwen2Config(vocab_size=v, hidden_size=hidden, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, max_position_embeddings=64, tie_word_embeddings=False,
                      bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, torch_dtype="float32")
    model = Qwen2ForCausalLM(cfg)
    ids = tok.convert_tokens_to_ids(CHAIN)
    nxt = {t: tok.eos_token_id for t in range(v)} | dict(zip(ids, ids[1:]))
    table = torch.randn(v, v, generator=torch.Generator().manual_seed(0)) * 0.5
    for t, u in nxt.items():
        table[t, u] += 3.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :v] = torch.eye(v)
        model.lm_head.weight.zero_()  # the final norm scales a one-hot row by sqrt(hidden)
        model.lm_head.weight[:, :v] = table.T / math.sqrt(hidden)
    model.generation_config.eos_token_id = tok.eos_token_id
    path = str(tmp_path_factory.mktemp("successor"))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.mark.engine
@pytest.mark.parametrize("ranks, tp", [(1, 1), (2, 2)], ids=["tp1", "tp2"])
def test_the_openai_client_against_the_endpoint(successor_model, ranks, tp):
    out = launch(["tests/workers/agent_endpoint.py", successor_model, str(tp)], nproc=ranks)
    assert out.count("AGENT_ENDPOINT_OK") == ranks, out[-3000:]


def test_tool_results_between_turns_render_as_the_template_joins_them():
    """Two tool results after a model turn: Qwen2.5's template puts consecutive tool outputs in
    one user turn, so they are rendered together, not one after the other."""
    tok = chat_tokenizer("qwen2.5_style")
    replies = episodes.Replies(tok, True, "user")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = replies.tokens([{"role": "tool", "content": "3"}, {"role": "tool", "content": "<|im_end|>"}],
                         last_token=end)
    assert tok.decode(ids) == ("\n<|im_start|>user\n<tool_response>\n3\n</tool_response>\n"
                               "<tool_response>\n<|im_end|>\n</tool_response><|im_end|>\n"
                               "<|im_start|>assistant\n")
    assert ids.count(end) == 1  # the tool's printed marker stayed text


@pytest.mark.parametrize("body, says", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": True}, "stream"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n=0"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": [""]}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "not text"),
])
def test_what_the_endpoint_refuses(body, says):
    with pytest.raises(openai_api.BadCall, match=says) as e:
        openai_api.parse_request(body)
    assert e.value.status == 400 and "\n" not in str(e.value)


def test_a_request_as_the_chat_template_takes_it():
    body = {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "1+"}, {"type": "text", "text": "2"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "a", "type": "function",
         "function": {"name": "calc", "arguments": "{\"b\": 1, \"a\": 2}"}}]}],
        "max_completion_tokens": 5, "stop": "x", "temperature": 0.3, "n": 2}
    req = openai_api.parse_request(body)
    assert req.messages[0] == {"role": "user", "content": "1+2"}
    assert req.messages[1]["tool_calls"][0]["function"]["arguments"] == {"a": 2, "b": 1}
    assert (req.n, req.max_tokens, req.stop, req.asked) == (2, 5, ["x"], {"temperature": 0.3})
    # the same call as the client sends it back: its arguments' key order does not matter
    again = json.loads(json.dumps(body))
    again["messages"][1]["tool_calls"][0]["function"]["arguments"] = "{\"a\": 2, \"b\": 1}"
    again["messages"][1]["content"] = ""
    assert openai_api.parse_request(again).history == req.history


def test_hermes_tool_calls():
    text = ('I will add.<tool_call>\n{"name": "calc", "arguments": {"x": "1+2"}}\n</tool_call>'
            '<tool_call>not json</tool_call>')
    content, calls = envs.hermes(text, [])
    assert calls == [{"name": "calc", "arguments": '{"x": "1+2"}'}]
    assert content == "I will add.<tool_call>not json</tool_call>"
    assert envs.hermes("no call", []) == ("no call", [])


@pytest.mark.parametrize("value, ok", [(1, (1.0, None)), (0.5, (0.5, None)),
                                       ((1.0, {"k": 1}), (1.0, {"k": 1})), (True, None),
                                       (float("nan"), None), ("1", None), ((1.0, 2), None)])
def test_what_an_agent_may_return(value, ok):
    if ok is None:
        with pytest.raises(TypeError):
            envs.as_outcome(value)
    else:
        assert envs.as_outcome(value) == ok


def test_an_agent_must_be_async(tmp_path):
    f = tmp_path / "a.py"
    f.write_text("def agent(base_url, example):\n    return 1.0\n")
    with pytest.raises(ValueError, match="not an `async def`"):
        envs.resolve_agent(f"{f}:agent")


@pytest.mark.parametrize("extra, says", [
    (["--reward.funcs=[tiny_sum]"], "reward.funcs"),
    (["--rollout.partial.enabled=true", "--rollout.partial.round_tokens=2"], "round_tokens"),
    (["--env.name=", "--env.tool_parser=hermes"], "env.name"),  # (hermes: no openai import)
    (["--env.tool_parser=nope"], "env.tool_parser"),
])
def test_the_config_refuses_before_any_model_loads(tiny_task_dir, extra, says):
    proc = run_python(["train_grpo.py", "--config", "configs/agent_cpu.yaml",
                       f"--data.tiny_task_dir={tiny_task_dir}-chat", *extra])
    assert proc.returncode != 0 and says in proc.stderr, proc.stderr[-2000:]
    assert "Loading" not in proc.stderr and "vllm" not in proc.stderr.lower()


@pytest.mark.engine
@pytest.mark.main_only
@pytest.mark.parametrize("carry, form", [(False, "solve_from_url"), (True, "solve")],
                         ids=["rounds", "partial"])
def test_agent_cpu_runs(tiny_task_dir, tmp_path, carry, form):
    """configs/agent_cpu.yaml, two ranks, a few steps: the agents call, and the update trains on
    their samples. With partial rollout (twice the groups in flight), the groups a step does not
    take run on into the next: carried, and trained with tokens of an older version; those in
    flight as the run ends print nothing. Without, the agent's other form
    (examples/calculator_agent.py: solve_from_url, an AsyncOpenAI made per episode from its
    base URL and dropped unclosed, as the openai package's docs show) trains without a
    traceback (bench/agent_forms.py times the two forms)."""
    out, n = tmp_path / "run", 16 if carry else 8  # prompts a step (a client an episode: fewer)
    more = ["--rollout.partial.enabled=true", "--rollout.partial.oversample=2"] if carry else []
    said = launch(["train_grpo.py", "--config", "configs/agent_cpu.yaml",
                   f"--data.tiny_task_dir={tiny_task_dir}-chat", "--train.steps=3",
                   f"--env.name=examples/calculator_agent.py:{form}",
                   f"--grpo.prompts_per_step={n}", "--log.eval_every=0", f"--log.out_dir={out}",
                   *more], timeout=900)
    # (with partial rollout, the agents in flight at the end fail on "the rollout is over":
    #   counted nowhere, printed nowhere)
    assert "Traceback" not in said and "Event loop is closed" not in said, said[-3000:]
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["agent_calls"] >= n * 8 * (not carry) and r["samples_trained"] == n * 8
               for r in rows), rows
    assert all(r["env_errors"] == 0 and r["env_timeouts"] == 0 for r in rows), rows
    if carry:
        assert all(r["partial_carried"] == n * 8 for r in rows), rows
        assert max(r["stale_max"] for r in rows) >= 1, rows


@pytest.mark.engine
@pytest.mark.main_only
def test_lookup_cpu_runs_and_counts_the_episodes_that_called_the_tool(tiny_task_dir, tmp_path):
    """configs/lookup_cpu.yaml, two ranks, 2 steps: an episode whose first reply called the tool
    makes a second call, the others none (examples/lookup_agent.py), so the endpoint's calls
    are the episodes plus those that used the tool: agent_calls against agent_tool_frac, which
    the tool parser's counts give; and only such episodes can score."""
    out = tmp_path / "run"
    launch(["train_grpo.py", "--config", "configs/lookup_cpu.yaml",
            f"--data.tiny_task_dir={tiny_task_dir}-chat", "--train.steps=2",
            "--grpo.prompts_per_step=16", "--log.eval_every=0", f"--log.out_dir={out}"],
           timeout=900)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    episodes = 16 * 8
    for r in rows:
        assert r["agent_calls"] == round(episodes * (1 + r["agent_tool_frac"])), r
        assert r["agent_tool_calls"] >= r["agent_tool_frac"], r
        assert r["reward_mean"] <= r["agent_tool_frac"] and r["env_errors"] == 0, r
    assert any(r["agent_tool_frac"] > 0 for r in rows), rows  # (about 5% at first, measured)


@pytest.mark.parametrize("template, differs", [(None, False), ("qwen3_style", True)])
def test_a_sample_against_the_template_s_whole_conversation(tmp_path, caplog, template, differs):
    """AgentRunner.check, once a run: an episode's sample made call by call (the first prompt
    rendered, the completions as written, the user turn between them as Replies.tokens puts it)
    is what the template renders for the whole conversation, unless the template renders earlier
    turns otherwise (Qwen3's drops their reasoning): then it is logged, once."""
    f = tmp_path / "a.py"
    f.write_text("async def agent(base_url, example):\n    return 1.0\n")
    tok = chat_tokenizer(template)
    env = episodes.EnvConfig(kind="agent", name=f"{f}:agent", timeout_s=0)
    runner = agents.AgentRunner(env, tok, 8, 64, "m")
    end = tok.convert_tokens_to_ids("<|im_end|>")
    first = [{"role": "user", "content": "Q"}]
    prompt = tok(tok.apply_chat_template(first, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    turn1 = tok("<think>\nguess\n</think>\n\n41", add_special_tokens=False)["input_ids"] + [end]
    between = runner.replies.tokens([{"role": "user", "content": "once more"}], end)
    turn2 = tok("42", add_special_tokens=False)["input_ids"] + [end]
    e = agents.Episode({}, 0)
    e.open = [agents.Segment(prompt, turn1 + between + turn2,
                             [1] * len(turn1) + [0] * len(between) + [1] * len(turn2),
                             [0.0] * (len(turn1) + len(between) + len(turn2)),
                             [0] * (len(turn1) + len(between) + len(turn2)))]
    e.conversation = first + [{"role": "assistant", "content": "<think>\nguess\n</think>\n\n41"},
                              {"role": "user", "content": "once more"},
                              {"role": "assistant", "content": "42"}]
    with caplog.at_level("WARNING", logger="grpo"):
        runner.check([e])
        runner.check([e])  # once a run
    runner.close()
    warned = [r.getMessage() for r in caplog.records if "differs" in r.getMessage()]
    assert len(warned) == int(differs), warned


def test_a_call_after_the_endpoint_closed_is_refused_not_lost():
    """A client keeps its connection alive between calls, so a call can reach the endpoint's
    thread for that connection after the endpoint closed, when nobody takes calls any more: it
    is answered 503 at once (it waited for the client's own timeout before)."""
    import http.client
    import queue
    import time

    calls = queue.Queue()
    endpoint = openai_api.Endpoint(calls, "m")
    conn = http.client.HTTPConnection("127.0.0.1", endpoint.server.server_address[1], timeout=30)
    conn.request("GET", "/e/k/v1/models")
    assert json.loads(conn.getresponse().read())["data"][0]["id"] == "m"  # (kept alive)
    endpoint.close()
    t = time.perf_counter()
    conn.request("POST", "/e/k/v1/chat/completions", body=json.dumps({"messages": []}),
                 headers={"Content-Type": "application/json"})
    reply = conn.getresponse()
    assert reply.status == 503 and "over" in json.loads(reply.read())["error"]["message"]
    assert time.perf_counter() - t < 5 and calls.qsize() == 1  # it reached the queue, unread


def test_an_episode_s_samples_train_with_its_advantage():
    """records.with_earlier: each sample's earlier ones go before it in the update's list, each
    with the episode's advantage; samples without any are left as they are."""
    import records

    a, b, c, d = (records.Sample([1], [2 + i], [0.0], False) for i in range(4))
    b.earlier = [c, d]
    samples, adv = records.with_earlier([a, b], torch.tensor([0.5, -1.0]))
    assert [id(s) for s in samples] == [id(a), id(c), id(d), id(b)]
    assert adv.tolist() == [0.5, -1.0, -1.0, -1.0]
    same, adv = records.with_earlier([a], torch.tensor([0.5]))
    assert same == [a] and adv.tolist() == [0.5]


def test_a_call_after_return_and_a_failing_tool_parser_are_refused_and_counted(tmp_path, caplog):
    """Serving: a call whose episode's agent already returned is answered 410 and counted
    after_return (it is no part of the sample); a completion that env.tool_parser raises on is
    answered 500 and counted tool_parser, its tokens kept out of the episode; each kind's first
    refusal is logged, not the next."""
    f = tmp_path / "a.py"
    f.write_text("async def agent(base_url, example):\n    return 1.0\n\n"
                 "def parser(text, tools):\n    raise ValueError('no JSON in ' + text)\n")
    tok = chat_tokenizer()
    env = episodes.EnvConfig(kind="agent", name=f"{f}:agent", tool_parser=f"{f}:parser",
                             timeout_s=0)
    runner = agents.AgentRunner(env, tok, 8, 64, "m")
    serving = agents.Serving(runner, None, {})
    done, going = agents.Episode({}, 0), agents.Episode({}, 1)
    done.done = True
    serving.by_key.update({done.key: done, going.key: going})
    body = {"messages": [{"role": "user", "content": "Q"}], "tools": [{"type": "function",
            "function": {"name": "f", "parameters": {"type": "object"}}}]}
    with caplog.at_level("WARNING", logger="grpo"):
        late = [openai_api.Call(done.key, body) for _ in range(2)]
        assert [serving.accept(c) for c in late] == [[], []]
        (rid, prompt, *_), = serving.accept(parsed := openai_api.Call(going.key, body))
        serving.ended([(rid, tok("41", add_special_tokens=False)["input_ids"], [-0.5] * 2,
                        "stop")])
    serving.endpoint.close()
    runner.close()
    assert [c.status for c in late] == [410, 410] and done.calls == 0
    assert parsed.status == 500 and "no JSON in 41" in parsed.response["error"]["message"]
    assert going.open == [] and going.tool_calls == 0  # nothing of the refused completion kept
    assert serving.refused == {"after_return": 2, "tool_parser": 1}, serving.refused
    shown = [r.getMessage() for r in caplog.records if "was refused" in r.getMessage()]
    assert len(shown) == 2 and "after_return" in shown[0] and "tool_parser" in shown[1], shown
