"""Eval numbers against a hand count: pass@1 over greedy answers, mean@k over sampled ones."""

import torch.distributed as dist

import episodes
import rewards
import rollout
import sampler
from tasks import tiny_task
import weight_sync
from records import Sample
from rollout import RolloutConfig
from train_grpo import Config


class ScriptedEngine:
    """Answers prompt i greedily with greedy[i] and, sampled, with sampled[i] (k answers); records
    the weight push and the sleep that sampler.Sampler.evaluate owes the engine."""

    def __init__(self, greedy, sampled):
        self.cfg, self.greedy, self.sampled = RolloutConfig(dtype="float32"), greedy, sampled
        self.calls, self.awake, self.lora = [], False, None

    def wake(self, tags):
        self.calls.append(("wake", tuple(tags)))
        self.awake = True

    def load_weights(self, pairs):
        self.calls.append(("load_weights", sum(1 for _ in pairs)))

    def sleep(self):
        self.calls.append(("sleep",))
        self.awake = False

    def generate(self, prompt_ids, n, greedy=False, seed=None):
        answers = [[a] for a in self.greedy] if greedy else self.sampled
        return [Sample(p, list(text.encode()), [0.0] * len(text), False)
                for p, texts in zip(prompt_ids, answers) for text in texts[:n]]


class BytesTokenizer:
    def batch_decode(self, ids, skip_special_tokens=True):
        return [bytes(x).decode() for x in ids]


def test_pass1_and_mean_at_k_against_a_hand_count(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    try:
        examples = [{"prompt": f"{a}+{b}=", "prompt_ids": [a, b], "answer": str(a + b)}
                    for a, b in ((1, 2), (3, 4), (0, 0), (2, 2), (5, 4))]
        greedy = ["3", "7", "1", "4", "8"]  # right, right, wrong, right, wrong: pass@1 = 3/5
        sampled = [["3", "3", "4"], ["0", "7", "7"], ["0", "0", "0"], ["5", "5", "5"],
                   ["9", "1", "2"]]  # right: 2, 2, 3, 0, 1 of 3 each: mean@3 = 8/15
        engine = ScriptedEngine(greedy, sampled)
        actor = tiny_task.build_tiny_model(vocab_size=15, eos_id=1, pad_id=0)
        one_turn = episodes.EpisodeRunner(episodes.EnvConfig(), BytesTokenizer(), False,
                                          "prompt", 4)
        with rewards.Scorer(rewards.RewardConfig(funcs=["tiny_sum"])) as scorer:
            turn = weight_sync.EngineTurn(actor, None, engine, offload_on=False)
            plays = sampler.Sampler(Config(), engine, one_turn, scorer, [], rollout.EngineGroup(1),
                                    None)
            scores, (part, texts, per_example) = plays.evaluate(turn, examples, k=3)
        assert scores == {"eval_pass1": 3 / 5, "eval_mean_at_k": 8 / 15}
        assert texts == greedy and per_example == [1.0, 1.0, 0.0, 1.0, 0.0]
        # the update since the rollout is pushed first, and the engine sleeps again after
        assert [c[0] for c in engine.calls] == ["wake", "load_weights", "wake", "sleep"]
    finally:
        dist.destroy_process_group()
