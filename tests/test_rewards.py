"""The reward table, and a raising reward that must not end the run."""

import pytest

import rewards


@pytest.mark.parametrize("completion, answer, expected", [
    ("7", "7", 1.0), ("7<eos>", "7", 1.0), (" 7 and more", "7", 1.0), ("7+++", "7", 1.0),
    ("77", "7", 0.0), ("8", "7", 0.0), ("", "7", 0.0), ("x7", "7", 0.0), ("12", "12", 1.0),
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


def test_raising_reward_scores_zero_and_is_counted():
    def flaky(completion, example):
        if completion == "boom":
            raise RuntimeError("reward server down")
        return 1.0

    scores, errors = rewards.score(flaky, ["a", "boom", "b", "boom"], [{}] * 4)
    assert scores == [1.0, 0.0, 1.0, 0.0] and errors == 2
    scores, errors = rewards.score(rewards.gsm8k, ["#### 3", "#### 3"],
                                   [{"answer": "3"}, {"answer": "three"}])
    assert scores == [1.0, 0.0] and errors == 1
