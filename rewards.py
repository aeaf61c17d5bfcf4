"""Reward functions: pure `(completion: str, example: dict) -> float`, run on CPU.

Add yours to REWARDS and name it in the config (`data.reward`). `score` runs them so that a reward
that raises gives 0 for that sample and is counted, instead of ending a run hours in.
Rewards stay on a coarse grid (0 or 1 here): float sums such as 0.1 + 0.2 make a "constant" group's
std ~1e-8 instead of 0, which the advantage would blow up (train_grpo detects such groups anyway).
"""

import re

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _to_number(text: str):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def tiny_sum(completion: str, example: dict) -> float:
    """The built-in `a+b=` task: 1 if the completion starts with the right number and stops there.

    "7" and "7 ..." score 1; "77", "8" and "" score 0.
    """
    m = re.match(r"\s*(\d+)(?!\d)", completion)
    return float(m is not None and m.group(1) == str(example["answer"]).strip())


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


REWARDS = {"tiny_sum": tiny_sum, "gsm8k": gsm8k}


def score(reward_fn, completions: list[str], examples: list[dict]) -> tuple[list[float], int]:
    """Apply `reward_fn` to each (completion, example); returns (scores, number that raised)."""
    scores, errors = [], 0
    for completion, example in zip(completions, examples):
        try:
            scores.append(float(reward_fn(completion, example)))
        except Exception:  # a broken reward must not end the run: score 0, count it
            scores.append(0.0)
            errors += 1
    return scores, errors
