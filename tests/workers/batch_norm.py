"""2 ranks: the batch's statistics of grpo.advantages (grpo.adv_std=batch, adv_mean=batch,
grpo.reward_agg=gdpo) over the engine groups, through rollout.EngineGroup.sum_over_engines on
gloo. Each engine group holds its own rewards (the JSON file's "engines"[index]: each reward
function's values and which samples are valid); rank r writes its advantages to
OUT_DIR/adv_r.json, {"TP MODE": [...]} for tp 1 and 2, mode batch, gdpo and mean.
Usage: torchrun --nproc_per_node 2 tests/workers/batch_norm.py CASE.json OUT_DIR
"""

import json
import sys

import torch
import torch.distributed as dist

import grpo
import rollout

case = json.load(open(sys.argv[1]))
dist.init_process_group("gloo")
got = {}
for tp in (1, 2):  # two engine groups of one rank; one engine group of two ranks
    group = rollout.EngineGroup(tp)
    mine = case["engines"][group.index]
    funcs = torch.tensor(mine["by_name"], dtype=torch.float64).T  # (N, K)
    total = (funcs * torch.tensor(case["weights"], dtype=torch.float64)).sum(1, keepdim=True)
    for mode, fields in (("batch", {"adv_std": "batch"}), ("gdpo", {"reward_agg": "gdpo"}),
                         ("mean", {"adv_std": "batch", "adv_mean": "batch"})):
        cfg = grpo.GRPOConfig(group_size=case["G"], **fields)
        adv, _ = grpo.advantages(funcs if mode == "gdpo" else total, case["weights"],
                                 torch.tensor(mine["valid"]), cfg, group.sum_over_engines)
        got[f"{tp} {mode}"] = adv.tolist()
with open(f"{sys.argv[2]}/adv_{dist.get_rank()}.json", "w") as f:
    json.dump(got, f)
dist.destroy_process_group()
