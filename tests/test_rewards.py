"""The reward tables, resolving and validating `reward.funcs`, and the Scorer: a reward that
raises, hangs or kills its worker scores 0, is counted, and does not end the run."""

import threading
import time

import pytest

import records
import rewards

pytestmark = pytest.mark.main_only  # plain Python and math-verify: no torch, no engine


@pytest.mark.parametrize("completion, answer, expected", [
    ("7", "7", 1.0), (" 7\n", "7", 1.0), ("7<eos>", "7", 0.5), (" 7 and more", "7", 0.5),
    ("7+++", "7", 0.5), ("77", "7", 0.0), ("8", "7", 0.0), ("", "7", 0.0), ("x7", "7", 0.0),
    ("12", "12", 1.0), ("12+", "12", 0.5), ("1", "12", 0.0),
])
def test_tiny_sum(completion, answer, expected):
    assert rewards.tiny_sum(completion, {"answer": answer}) == expected


@pytest.mark.parametrize("completion, answer, expected", [
    ("She pays 3 * 24 = 72 dollars. #### 72", "Natalia sold 48/2 = 24 ... #### 72", 1.0),
    ("#### 72.0", "72", 1.0),
    ("the total is 1,000", "1000", 1.0),
    ("so 5 apples, then 7", "7", 1.0),  # no marker: the last number counts
    ("so 7 apples, then 5", "7", 0.0),
    ("The answer is \\boxed{-3}.", "#### -3", 1.0),
    ("#### 72 but maybe 73", "73", 0.0),  # after the marker, the first number counts
    ("no number here", "4", 0.0),
])
def test_gsm8k(completion, answer, expected):
    assert rewards.gsm8k(completion, {"answer": answer}) == expected


def test_gsm8k_bad_reference_raises():
    with pytest.raises(ValueError):
        rewards.gsm8k("#### 3", {"answer": "three"})


@pytest.mark.parametrize("completion, answer, expected", [
    ("so the answer is \\boxed{72}.", "72", 1.0),
    ("She has 5, then \\boxed{72} and 9 more", "72", 1.0),  # \boxed wins over later numbers
    ("The final answer is $\\boxed{\\dfrac{1}{2}}$", "0.5", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", 1.0),
    ("\\boxed{2\\sqrt{3}}", "2\\sqrt{3}", 1.0),  # a bare LaTeX gold, as Geometry3K's
    ("\\boxed{2}", "2\\sqrt{3}", 0.0),  # (read outside $...$ the gold was 2)
    ("She pays 3 * 24 = 72 dollars.\n#### 72", "Natalia sold 48/2 = 24 ... #### 72", 1.0),
    ("#### 72\nI hope 5 is right", "72", 1.0),  # GSM8K: the line after #### is the answer
    ("the total is 1,000", "1000", 1.0),
    ("\\boxed{1000}", "1,000", 1.0),
    ("x = \\boxed{-3}", "#### -3", 1.0),
    ("The answer is $\\frac{1}{2}$.", "The answer is \\boxed{\\frac{1}{2}}.", 1.0),
    ("\\boxed{73}", "72", 0.0),
    ("#### 0.25", "\\frac{1}{2}", 0.0),
    ("no answer here", "4", 0.0),
    ("", "0", 0.0),
])
def test_math(completion, answer, expected):
    assert rewards.math(completion, {"answer": answer}) == expected


def test_math_works_outside_the_main_thread():
    out = []
    t = threading.Thread(target=lambda: out.append(rewards.math("\\boxed{2}", {"answer": "2"})))
    t.start()
    t.join()
    assert out == [1.0]


@pytest.mark.parametrize("completion, expected", [
    ("so \\boxed{72}.", 1.0), ("\\boxed{\\frac{1}{2}}", 1.0), ("work\n#### 72", 1.0),
    ("####72", 1.0), ("  #### x = 3", 1.0),
    ("\\boxed{72", 0.0),  # unbalanced
    ("\\boxed{\\frac{1}{2}", 0.0), ("\\boxed{}", 0.0), ("####", 0.0), ("#### \nthen 3", 0.0),
    ("the answer is #### 72", 0.0),  # #### must start a line
    ("the answer is 72", 0.0), ("", 0.0),
])
def test_format(completion, expected):
    assert rewards.answer_format(completion, {}) == expected
    assert rewards.REWARDS["format"] is rewards.answer_format


PLUGIN = """
import time

def good(completion, example):
    return float(completion == example["answer"])

def half(completion, example):
    return 0.5 if completion else 0.0

def flaky(completion, example):
    if completion == "boom":
        raise RuntimeError("reward server down")
    if completion == "nan":
        return float("nan")
    if completion == "str":
        return "1.0"
    return 1.0

def hang(completion, example):
    if completion == "hang":
        time.sleep(3600)
    return 1.0

def slow(completion, example):
    time.sleep(0.2)
    return float(completion == example["answer"])

def crash(completion, example):
    if completion == "crash":
        import os
        os._exit(3)
    return 1.0

def one_arg(x):
    return 1.0

SEEN = []  # what `recording` was called with, in the process that called it

def recording(completion, example):
    SEEN.append(completion)
    return float(completion == example["answer"])

not_a_function = 3
"""


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """PLUGIN as the importable `my_reward_mod` (tmp_path on sys.path) and as my_reward.py."""
    (tmp_path / "my_reward_mod.py").write_text(PLUGIN)
    (tmp_path / "my_reward.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_resolve(plugin):
    assert rewards.resolve("gsm8k") is rewards.gsm8k
    assert rewards.resolve("format") is rewards.answer_format
    fn = rewards.resolve("my_reward_mod:good")
    assert fn("7", {"answer": "7"}) == 1.0 and fn("8", {"answer": "7"}) == 0.0
    fn = rewards.resolve(f"{plugin / 'my_reward.py'}:good")
    assert fn("7", {"answer": "7"}) == 1.0
    assert rewards.resolve(f"{plugin / 'my_reward.py'}:good") is fn  # the file is loaded once


@pytest.mark.parametrize("spec, says", [
    ("nope", "not a built-in (tiny_sum, tiny_colour, gsm8k, math, format, agent)"),
    ("no_such_module_xyz:fn", "module 'no_such_module_xyz' not found"),
    ("no/such/file.py:fn", "file 'no/such/file.py' not found"),
    ("my_reward_mod:missing", "'my_reward_mod' has no 'missing'"),
    ("my_reward_mod:not_a_function", "is a int, not a function"),
    ("my_reward_mod:one_arg", "cannot be called with two arguments (signature (x))"),
])
def test_resolve_errors_are_one_line_and_name_the_field(plugin, spec, says):
    with pytest.raises(ValueError) as info:
        rewards.resolve(spec)
    msg = str(info.value)
    assert msg.startswith("reward.funcs: ") and "\n" not in msg and "Fix: " in msg and says in msg


@pytest.mark.parametrize("kwargs, field", [
    ({"weights": [1.0]}, "reward.weights"), ({"funcs": []}, "reward.funcs"),
    ({"funcs": ["nope"]}, "reward.funcs"), ({"funcs": ["math", "math"]}, "reward.funcs"),
    ({"timeout_s": -1.0}, "reward.timeout_s"),
])
def test_validate_errors(kwargs, field):
    cfg = rewards.RewardConfig(**{"funcs": ["math", "format"], **kwargs})
    with pytest.raises(ValueError, match=f"^{field}: ") as info:
        rewards.validate(cfg)
    assert "\n" not in str(info.value)


def test_validate_accepts_a_good_config():
    rewards.validate(rewards.RewardConfig())
    rewards.validate(rewards.RewardConfig(funcs=["math", "format"], weights=[1.0, 0.5]))


def test_scorer_weighted_sum_errors_and_file_plugin(plugin):
    texts = ["\\boxed{3}", "#### 4", "5", "boom", "nan", "str"]
    examples = [{"answer": "3"}, {"answer": "5"}, {"answer": "5"}, {"answer": "1"},
                {"answer": "1"}, {"answer": "1"}]
    # by hand: math 1,0,1,0,0,0; format 1,1,0,0,0,0; flaky 1,1,1,err,err,err
    funcs = ["math", "format", f"{plugin / 'my_reward.py'}:flaky"]
    cfg = rewards.RewardConfig(funcs=funcs, weights=[1.0, 0.5, 0.25], timeout_s=30.0)
    with rewards.Scorer(cfg) as scorer:
        out = scorer.score(texts, examples)
        assert out.by_name == {"math": [1, 0, 1, 0, 0, 0], "format": [1, 1, 0, 0, 0, 0],
                                  funcs[2]: [1, 1, 1, 0, 0, 0]}
        assert out.total == [1.75, 0.75, 1.25, 0.0, 0.0, 0.0]
        assert out.errors == 3 and out.timeouts == 0
        assert out.failed == [False, False, False, True, True, True]
        assert scorer.score([], []) == records.Rewards([], {f: [] for f in funcs}, [], 0, 0)


def test_in_process_scorer_runs_here_and_scores_the_same(plugin):
    """reward.timeout_s 0: the functions run in this process (a reward's side effects are seen
    here, as a breakpoint() would stop here), with the worker's results and error counts."""
    import my_reward_mod

    texts = ["\\boxed{3}", "7", "boom", "nan", "4"]
    examples = [{"answer": "3"}, {"answer": "7"}, {"answer": "1"}, {"answer": "1"},
                {"answer": "5"}]
    funcs = ["math", "my_reward_mod:recording", "my_reward_mod:flaky"]
    outs = []
    for timeout_s in (30.0, 0.0):  # a worker process, then this process
        my_reward_mod.SEEN.clear()
        with rewards.Scorer(rewards.RewardConfig(funcs=funcs, weights=[1.0, 0.5, 0.25],
                                                 timeout_s=timeout_s)) as scorer:
            outs.append(scorer.score(texts, examples))
            assert not scorer.worker._plain or timeout_s > 0  # no worker started in-process
        assert my_reward_mod.SEEN == ([] if timeout_s else texts)
    assert outs[0] == outs[1]
    assert outs[1].by_name["my_reward_mod:recording"] == [0, 1, 0, 0, 0]
    assert outs[1].errors == 2 and outs[1].timeouts == 0


def test_pure_built_ins_run_here_beside_pooled_plugins(plugin, monkeypatch):
    """With reward.timeout_s > 0, a built-in of rewards.PURE is called in this process (what it
    records is seen here), a plugin in a worker process (what it records is not), and each
    sample gets both outcomes in order. Every built-in of PURE exists."""
    import my_reward_mod

    assert set(rewards.PURE) <= set(rewards.REWARDS)
    seen = []

    def recording_sum(completion, example):
        seen.append(completion)
        return rewards.tiny_sum(completion, example)

    monkeypatch.setitem(rewards.REWARDS, "tiny_sum", recording_sum)  # (a worker has its own)
    texts, examples = ["7", "8", "3"], [{"answer": "7"}, {"answer": "7"}, {"answer": "3"}]
    my_reward_mod.SEEN.clear()
    cfg = rewards.RewardConfig(funcs=["tiny_sum", "my_reward_mod:recording"], timeout_s=30.0)
    with rewards.Scorer(cfg) as scorer:
        out = scorer.score(texts, examples)
        assert len(scorer.worker._plain) == 1 and "tiny_sum in this process" in scorer.worker.where()
    assert seen == texts and my_reward_mod.SEEN == []
    assert out.by_name == {"tiny_sum": [1, 0, 1], "my_reward_mod:recording": [1, 0, 1]}


def test_scorer_cuts_a_hanging_call_and_scores_the_rest(plugin):
    texts = ["7", "8", "hang", "7", "9", "7"]
    examples = [{"answer": "7"}] * 6
    cfg = rewards.RewardConfig(funcs=["tiny_sum", "my_reward_mod:hang"], timeout_s=1.0)
    with rewards.Scorer(cfg) as scorer:
        scorer.score(["7"], [{"answer": "7"}])  # start the worker: its start-up is not a call
        t0 = time.perf_counter()
        out = scorer.score(texts, examples)
        took = time.perf_counter() - t0
        # one cut call (1 s) and one worker restart (a fresh Python importing math_verify)
        assert took < 1.0 + 20.0, took
        assert out.by_name["tiny_sum"] == [1, 0, 0, 1, 0, 1]
        assert out.by_name["my_reward_mod:hang"] == [1, 1, 0, 1, 1, 1]
        assert out.total == [2, 1, 0, 2, 1, 2]
        assert out.timeouts == 1 and out.errors == 0
        assert out.failed == [False, False, True, False, False, False]
        print(f"batch with one hung call: {took:.2f} s")


def test_scorer_survives_the_worker_dying(plugin):
    cfg = rewards.RewardConfig(funcs=["my_reward_mod:crash"], timeout_s=30.0, workers=1)
    with rewards.Scorer(cfg) as scorer:
        out = scorer.score(["a", "crash", "b"], [{}] * 3)
        assert out.total == [1.0, 0.0, 1.0] and out.errors == 1 and out.timeouts == 0
        assert out.failed == [False, True, False]
        (w,) = scorer.worker._plain  # the replacement
        proc = w.proc
    assert not proc.is_alive()  # close() reaped it


def test_scorer_ipc_is_cheap():
    examples = [{"answer": str(i % 10)} for i in range(512)]
    texts = [str(i % 7) for i in range(512)]
    with rewards.Scorer(rewards.RewardConfig(funcs=["tiny_sum"])) as scorer:
        scorer.score(["1"], [{"answer": "1"}])  # start the worker
        t0 = time.perf_counter()
        out = scorer.score(texts, examples)
        took = time.perf_counter() - t0
    assert out.total == [float(i % 7 == i % 10) for i in range(512)]
    print(f"512 tiny_sum samples: {took * 1000:.1f} ms")


def test_a_job_cut_by_ctrl_c_leaves_no_answer_for_the_next_one(plugin):
    """Ctrl-C while the reward worker is busy: the job is abandoned, and its answers, still on
    their way, must not be taken for the next job's (before, the next score() read them)."""
    import signal

    def interrupt(*_):
        raise KeyboardInterrupt

    cfg = rewards.RewardConfig(funcs=["my_reward_mod:slow"], timeout_s=5.0)
    with rewards.Scorer(cfg) as scorer:
        scorer.score(["7"], [{"answer": "7"}])  # the worker is up
        old = signal.signal(signal.SIGALRM, interrupt)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.3)  # in the middle of the second call
            with pytest.raises(KeyboardInterrupt):
                scorer.score(["7"] * 5, [{"answer": "7"}] * 5)  # five 1s, 0.2 s each
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)
        out = scorer.score(["8", "8"], [{"answer": "7"}] * 2)
        assert out.by_name["my_reward_mod:slow"] == [0.0, 0.0], out


def test_tiny_colour_scores_as_tiny_sum_does():
    from rewards import tiny_colour

    ex = {"answer": "red"}
    assert [tiny_colour(c, ex) for c in ("red", " red ", "redd", "red blue", "blue", "", "re")] \
        == [1.0, 1.0, 0.5, 0.5, 0.0, 0.0, 0.0]
