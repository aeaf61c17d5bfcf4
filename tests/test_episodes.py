"""Episodes (episodes.EpisodeRunner) with a scripted engine: what each turn is prompted with, which tokens
are the model's, the limits, and environments that hang or raise; the built-in environments.
(Chat templates: test_templates.py.)"""

import pytest

from collect import envs
import episodes
from records import Sample

EOS = 0


class CharTokenizer:
    """One id per character (its code), EOS 0; what episodes.py asks of a tokenizer."""

    def __call__(self, text, add_special_tokens=False, split_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}  # it has no special token to split

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i != EOS or not skip_special_tokens)

    def batch_decode(self, rows, skip_special_tokens=True):
        return [self.decode(r, skip_special_tokens) for r in rows]


class ScriptedEngine:
    """Answers a prompt with script(prompt text, turn) followed by EOS (cut at max_tokens, as
    vLLM cuts), logprob -0.5 per token; records every prompt it was given."""

    def __init__(self, script):
        self.script, self.prompts, self.cfg = script, [], None

    def generate(self, prompt_ids, n, greedy=False, seed=None, max_tokens=None):
        out = []
        for i, p in enumerate(prompt_ids):
            self.prompts.append(list(p))
            text = "".join(map(chr, p))
            for j in range(n):
                ids = [ord(c) for c in self.script(text, j)] + [EOS]
                limit = None if max_tokens is None else max_tokens[i]
                cut = limit is not None and len(ids) > limit
                ids = ids[:limit] if cut else ids
                out.append(Sample(list(p), ids, [-0.5] * len(ids), cut))
        return out


def example(prompt, **row):
    return {"prompt": prompt, "prompt_ids": [ord(c) for c in prompt], "answer": "7", **row}


ENV = """
import time

def again(messages, example):
    if example.get("mode") == "hang":
        time.sleep(3600)
    if example.get("mode") == "boom":
        raise RuntimeError("environment down")
    if messages[-1]["content"].startswith("7"):
        return None
    return "again?"
"""


@pytest.fixture
def env_file(tmp_path):
    (tmp_path / "my_env.py").write_text(ENV)
    return f"{tmp_path / 'my_env.py'}:again"


def run(env_spec, engine, batch, n=1, **cfg):
    runner = episodes.EpisodeRunner(episodes.EnvConfig(name=env_spec, **cfg), CharTokenizer(),
                                    False, "prompt", 8)
    try:
        return runner.run(engine, batch, n)
    finally:
        runner.close()


def test_turns_see_their_history_and_the_mask_marks_the_model(env_file):
    # the model answers "5" first, "7" after it was asked again
    engine = ScriptedEngine(lambda text, j: "7" if "again?" in text else "5")
    ro = run(env_file, engine, [example("3+4=")], max_turns=3, max_tokens=64)
    s = ro.samples[0]
    turn1, reply, turn2 = [ord("5"), EOS], [ord(c) for c in "again?"], [ord("7"), EOS]
    assert s.prompt_ids == [ord(c) for c in "3+4="]
    assert s.response_ids == turn1 + reply + turn2
    assert s.mask == [1, 1] + [0] * len(reply) + [1, 1]
    assert s.logp == [-0.5, -0.5] + [0.0] * len(reply) + [-0.5, -0.5]
    # turn 2 was prompted with the whole history; nothing was generated after the "7"
    assert engine.prompts == [s.prompt_ids, s.prompt_ids + turn1 + reply]
    assert ro.turns == [2] and ro.failed == [False] and ro.limited == [False]
    assert ro.texts == ["7"]
    assert ro.examples[0]["conversation"] == [
        {"role": "user", "content": "3+4="}, {"role": "assistant", "content": "5"},
        {"role": "user", "content": "again?"}, {"role": "assistant", "content": "7"}]


def test_limits_end_episodes_after_a_whole_turn(env_file):
    wrong = ScriptedEngine(lambda text, j: "5")
    ro = run(env_file, wrong, [example("3+4=")], n=2, max_turns=2, max_tokens=64)
    assert ro.turns == [2, 2] and ro.limited == [True, True]  # the turn limit
    # 2 + 6 + 2 = 10 tokens fit in 11, a second reply does not: two turns and no more
    ro = run(env_file, wrong, [example("3+4=")], max_turns=5, max_tokens=11)
    assert ro.turns == [2] and ro.limited == [True] and len(ro.samples[0].response_ids) == 10
    # a reply that leaves room for 1 token: the turn is cut there, at the episode's limit
    ro = run(env_file, wrong, [example("3+4=")], max_turns=2, max_tokens=9)
    assert ro.samples[0].response_ids[-1] == ord("5") and ro.samples[0].truncated
    assert len(ro.samples[0].response_ids) == 9


def test_an_environment_that_hangs_or_raises_ends_its_episode_only(env_file):
    """One episode's environment hangs (cut at its limit, the worker restarted), one raises;
    both score 0 (failed) and are counted; the others go on to their next turn."""
    engine = ScriptedEngine(lambda text, j: "7" if "again?" in text else "5")
    batch = [example("1+6="), example("2+5=", mode="hang"), example("3+4=", mode="boom"),
             example("0+7=")]
    ro = run(env_file, engine, batch, max_turns=2, timeout_s=1.0)
    assert ro.failed == [False, True, True, False]
    assert ro.env.timeouts == 1 and ro.env.errors == 1
    assert ro.turns == [2, 1, 1, 2] and ro.texts == ["7", "5", "5", "7"]


def test_one_turn_without_an_environment():
    engine = ScriptedEngine(lambda text, j: "4" + "2" * j)
    ro = run("", engine, [example("1+3=")], n=2)
    assert ro.texts == ["4", "42"] and [s.mask for s in ro.samples] == [None, None]
    assert ro.turns == [1, 1] and "conversation" not in ro.examples[0]


def test_built_in_environments():
    assert envs.retry([{"role": "assistant", "content": "7"}], {"answer": "7"}) is None
    assert envs.retry([{"role": "assistant", "content": "7+"}],
                      {"answer": "7", "prompt": "3+4="}) == "3+4="  # not alone: again
    assert envs.retry([{"role": "assistant", "content": "8"}],
                      {"answer": "7", "prompt": "3+4="}) == "3+4="
    code = "Let me compute.\n```python\nprint(6 * 7)\n```"
    assert envs.python_tool([{"role": "assistant", "content": code}], {}) == {
        "role": "tool", "content": "42\n"}
    assert envs.python_tool([{"role": "assistant", "content": "#### 42"}], {}) is None
    assert envs.as_reply("x") == {"role": None, "content": "x"} and envs.as_reply(None) is None
    with pytest.raises(TypeError):
        envs.as_reply(3)
