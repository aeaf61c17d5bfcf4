"""Reward functions: pure `(completion: str, example: dict) -> float`, run on CPU.

Name them in the `reward:` config section (RewardConfig): a built-in from REWARDS, an importable
`package.module:function`, or a `path/to/file.py:function`. `validate` resolves every one before
any model loads. `Scorer` runs them in worker processes (plugins.Worker) so that a
reward that raises, returns garbage or hangs gives 0 for that call and is counted, instead of
ending a run hours in.
Rewards stay on a coarse grid (0 or 1 here): float sums such as 0.1 + 0.2 make a "constant" group's
std ~1e-8 instead of 0, which the advantage would blow up (train_grpo detects such groups anyway).
"""

import functools
import logging
import numbers
import re
from dataclasses import dataclass, field
from typing import Annotated
from math import isfinite

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

import plugins
import records
from config import Anything, Items, Range

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _to_number(text: str):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def tiny_sum(completion: str, example: dict) -> float:
    """The built-in `a+b=` task: 1 for the right number alone (the model stopped right after it),
    0.5 for the right number with more after it, else 0.

    "7" scores 1; "7+3" and "7 ..." score 0.5; "77", "8" and "" score 0. Without the half (all
    that matched the number scoring 1) the model learnt to keep writing after the answer, and
    its greedy answers were cut at the length limit; the half keeps the early signal (the number
    comes first) and makes stopping worth the other half. The grid stays coarse (0, 0.5, 1).
    """
    answer = str(example["answer"]).strip()
    m = re.match(r"\s*(\d+)(?!\d)", completion)
    if m is None or m.group(1) != answer:
        return 0.0
    return 1.0 if completion.strip() == answer else 0.5


def gsm8k(completion: str, example: dict) -> float:
    """GSM8K-style exact final answer: 1 if the completion's final number equals the reference's.

    The completion's answer is the number after the last `####` if there is one, else after the
    last `\\boxed{`, else the last number in the text. The reference may be a full GSM8K solution
    (`... #### 72`) or the bare number. Numbers compare as values: "1,000" == "1000.0".
    """
    ref = str(example["answer"])
    ref = ref.rsplit("####", 1)[-1]
    ref_num = _to_number(ref.strip())
    if ref_num is None:
        raise ValueError(f"reference answer is not a number: {example['answer']!r}")
    for marker in ("####", "\\boxed{"):
        if marker in completion:
            completion = completion.rsplit(marker, 1)[-1]
            nums = _NUMBER.findall(completion)
            return float(bool(nums) and _to_number(nums[0]) == ref_num)
    nums = _NUMBER.findall(completion)
    return float(bool(nums) and _to_number(nums[-1]) == ref_num)


# \boxed first: it is the answer even when more numbers follow it. No math-verify timeouts: they
# use signal.alarm, which fails outside the main thread; Scorer enforces the time limit instead.
_parse = functools.partial(parse, extraction_config=[
    LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()], parsing_timeout=None)
for _log in ("math_verify.parser", "math_verify.grader"):  # drop its warning about exactly that
    logging.getLogger(_log).addFilter(lambda r: not r.getMessage().startswith("Timeout is disab"))


def math(completion: str, example: dict) -> float:
    """1.0 if math-verify finds the completion's final answer equal to `example["answer"]`, else 0.

    The completion's answer is its `\\boxed{}`, else the rest of the line after its last `####`,
    else what math-verify extracts (LaTeX or a number). The reference may be bare ("0.5",
    "\\frac{1}{2}"), a GSM8K solution ("... #### 72") or hold a `\\boxed{}`. Values compare
    mathematically ("\\frac{1}{2}" == "0.5", "1,000" == "1000"). Raises on an unparsable reference.
    """
    gold = str(example["answer"]).rsplit("####", 1)[-1].strip()
    # bare LaTeX such as \sqrt{2} is found only between $...$, and "2\sqrt{3}" outside them
    #   parses as 2 (Geometry3K's answers are such); "72 dollars" only outside them
    gold_parsed = ((_parse(f"${gold}$") if "\\" in gold else None) or _parse(gold)
                   or _parse(f"${gold}$"))
    if not gold_parsed:
        raise ValueError(f"reference answer cannot be parsed: {example['answer']!r}")
    if "\\boxed" not in completion and "####" in completion:
        completion = completion.rsplit("####", 1)[-1].split("\n", 1)[0]
    pred = _parse(completion)
    return float(bool(pred) and verify(gold_parsed, pred, timeout_seconds=None))


def answer_format(completion: str, example: dict) -> float:
    """1.0 if the completion states a final answer: a non-empty `\\boxed{...}` with balanced
    braces, or a line starting with `####` followed by something; else 0.0."""
    if re.search(r"^[ \t]*####[ \t]*\S", completion, re.MULTILINE):
        return 1.0
    for m in re.finditer(r"\\boxed\{", completion):
        depth, end = 1, m.end()
        while depth and end < len(completion):
            depth += {"{": 1, "}": -1}.get(completion[end], 0)
            end += 1
        if depth == 0 and completion[m.end():end - 1].strip():
            return 1.0
    return 0.0


def agent(completion: str, example: dict) -> float:
    """The reward an agent returned for its episode (env.kind agent, agents.py)."""
    return example["agent_reward"]


def tiny_colour(completion: str, example: dict) -> float:
    """The built-in tiny vision task (tiny_task.make_vision_prompts): 1 for the right colour
    alone, 0.5 for it with more after it, else 0, as tiny_sum scores a sum."""
    answer, text = str(example["answer"]).strip(), completion.strip()
    return 1.0 if text == answer else 0.5 if text.startswith(answer) else 0.0


REWARDS = {"tiny_sum": tiny_sum, "tiny_colour": tiny_colour, "gsm8k": gsm8k, "math": math,
           "format": answer_format, "agent": agent}
# built-ins that compare strings or read a field: microseconds, no way to hang. They run in the
#   trainer's process whatever reward.timeout_s (the tiny task on 2 ranks: 0.025 s a step
#   through a worker, 0.001 s here, docs/benchmarks.md); `math` (math-verify parses what the
#   model wrote) keeps its worker and time limit
PURE = ("tiny_sum", "tiny_colour", "gsm8k", "format", "agent")


@dataclass
class RewardConfig:
    """The `reward:` section: which functions score a sample, their weights, their time limit."""

    LIVE = ()  # between steps (train_grpo.configure): none, the scorer is built of them
    # REWARDS key, mod:fn or a.py:fn, each resolved by `validate` before any model loads
    funcs: Annotated[list[str], Anything("rewards.validate resolves each", refused=(
        ["nope"], [], ["tiny_sum", "tiny_sum"]))] = field(default_factory=lambda: ["tiny_sum"])
    # one per func (empty: 1.0 each); summed
    weights: Annotated[list[float], Items(Range())] = field(default_factory=list)
    # time limit of one reward call on one sample (a cut call scores 0); 0: call the functions
    #   in this process, no time limit (breakpoint() works in a reward). The built-ins of
    #   rewards.PURE run in this process either way
    timeout_s: Annotated[float, Range(0)] = 10.0
    # worker processes that call plain functions at once (a call each); ignored with timeout_s 0.
    #   0: 16 per CPU of this rank, 2 to 32 (plugins.default_workers; the start-up log says how
    #   many); 1: one call at a time, in order (to debug)
    workers: Annotated[int, Range(0)] = 0
    # calls of `async def` rewards in flight at once, in one worker's event loop
    concurrency: Annotated[int, Range(1)] = 64

    def check(self, cfg, world_size: int) -> None:
        """config.validate's call: the section alone (`validate`, every function resolved)."""
        validate(self)


SIGNATURE = "def fn(completion: str, example: dict) -> float"


def resolve(spec: str):
    """The reward function `spec` names: a REWARDS key, `package.module:function` (imported), or
    `path/to/file.py:function` (relative to the working directory). Raises a one-line ValueError."""
    return plugins.resolve(spec, "reward.funcs", REWARDS, SIGNATURE)


def as_reward(value) -> float:
    """A reward's value as a float; anything but a finite number is the reward's failure."""
    if not (isinstance(value, numbers.Real) and isfinite(value)):
        raise TypeError(f"returned {value!r}, not a finite number")
    return float(value)


def validate(cfg: RewardConfig) -> None:
    """Check the `reward:` section before any model loads, resolving every function (so a bad
    plugin fails now, not at the first step). Raises a one-line ValueError naming the field."""
    funcs, weights = cfg.funcs, cfg.weights
    if not funcs:
        raise ValueError("reward.funcs: empty. Fix: name at least one reward, e.g. [math, format].")
    for spec in funcs:
        if funcs.count(spec) > 1:  # by_name is keyed by spec
            raise ValueError(f"reward.funcs: {spec!r} is listed twice. Fix: use reward.weights.")
        resolve(spec)
    if weights and len(weights) != len(funcs):
        raise ValueError(f"reward.weights: {len(weights)} weights for {len(funcs)} funcs. "
                         "Fix: give one weight per function, or none (1.0 each).")
    if not cfg.timeout_s >= 0:
        raise ValueError(f"reward.timeout_s: {cfg.timeout_s} is negative. Fix: e.g. 10.0 "
                         "(seconds), or 0 to call the rewards in this process.")


class Scorer:
    """Scores samples with the `reward:` functions (plugins.Worker): in worker processes, where a
    call that hangs is cut at reward.timeout_s, or with timeout_s 0 in this process, where a
    breakpoint() in a reward stops. A call that raises, returns no finite number, hangs or kills
    the worker scores 0 and is counted. Use as a context manager, or call close()."""

    def __init__(self, cfg: RewardConfig, group=None):
        validate(cfg)
        self.group = group  # episodes.EngineGroup: only the first rank of an engine calls
        self.specs = list(cfg.funcs)
        self.weights = list(cfg.weights) or [1.0] * len(self.specs)
        self.worker = plugins.Worker(self.specs, resolve, as_reward, cfg.timeout_s, "reward",
                                     cfg.workers, cfg.concurrency, local=PURE)

    def score(self, texts: list[str], examples: list[dict],
              failed: list[bool] = ()) -> records.Rewards:
        """The reward functions' answer (records.Rewards): per sample their weighted sum and each
        one's unweighted value, whether one of its calls failed or was cut, and the calls that
        failed and were cut; those calls score 0, and so does every sample marked `failed` (an
        episode whose environment failed)."""
        if len(texts) != len(examples):
            raise ValueError(f"Scorer.score: {len(texts)} texts but {len(examples)} examples")
        if self.group is not None:
            return self.group.one_answer(lambda: self._score(texts, examples, failed))
        return self._score(texts, examples, failed)

    def _score(self, texts: list[str], examples: list[dict],
               failed: list[bool]) -> records.Rewards:
        n, nf = len(texts), len(self.specs)
        outcomes = self.worker.run([(j, (text, example)) for text, example in zip(texts, examples)
                                    for j in range(nf)])  # call k: sample k // nf, function k % nf
        values = [[0.0] * n for _ in range(nf)]
        for k, v in enumerate(outcomes):
            if isinstance(v, float) and not (failed and failed[k // nf]):
                values[k % nf][k // nf] = v
        reward = [sum(w * vals[i] for w, vals in zip(self.weights, values)) for i in range(n)]
        bad = [not isinstance(v, float) for v in outcomes]
        return records.Rewards(reward, dict(zip(self.specs, values)),
                               [any(bad[i * nf:(i + 1) * nf]) for i in range(n)],
                               sum(v is plugins.Failed for v in outcomes),
                               sum(v is TimeoutError for v in outcomes))

    def close(self) -> None:
        self.worker.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
