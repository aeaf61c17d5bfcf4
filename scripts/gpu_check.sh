#!/usr/bin/env bash
# Check the trainer on a machine with an NVIDIA GPU and vLLM, in about 10 minutes:
#   1. the `gpu` tests (tests/test_gpu.py: memory given back by the switch and by sleep, the exact
#      pinned host memory, engine == trainer after a bf16 sync, an update with no token to learn
#      from, a few steps that exit cleanly, steps after a Ctrl-C caught in a reward);
#   2. the tiny task for 100 steps (configs/tiny_cpu.yaml);
#   3. bench/step.py at Qwen2.5-0.5B's shapes (a random model, 512-token responses).
# Prints one summary at the end; exit code 0 when every part passed. Logs stay in $OUT.
#   bash scripts/gpu_check.sh                      # PYTHON=python3.12 to choose the interpreter
# An offline GPU machine gets vLLM as ../shared/gpu/README.md says (then PYTHONPATH=/tmp/site).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d /tmp/gpu_check.XXXX)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
start=$(date +%s)

echo "gpu_check: logs in $OUT"
timeout 480 "$PY" -m pytest -q -s -m gpu tests/test_gpu.py -p no:cacheprovider >"$OUT/tests.log" 2>&1
echo "$?" >"$OUT/tests.rc"
timeout 240 "$PY" train_grpo.py --config configs/tiny_cpu.yaml --train.steps=100 \
    --log.out_dir="$OUT/tiny" --log.eval_every=100 --data.tiny_task_dir="$OUT/tiny_task" \
    >"$OUT/tiny.log" 2>&1
echo "$?" >"$OUT/tiny.rc"
timeout 300 "$PY" bench/step.py --config configs/qwen2.5-0.5b-gsm8k-cuda1.yaml \
    --shape qwen2.5-0.5b --prompt-len 128 --rollout.max_new_tokens=512 --steps 4 \
    >"$OUT/bench.log" 2>&1
echo "$?" >"$OUT/bench.rc"

"$PY" - "$OUT" "$(( $(date +%s) - start ))" <<'EOF'
import json, os, re, sys

out, wall = sys.argv[1], int(sys.argv[2])
read = lambda name: open(os.path.join(out, name), errors="replace").read()
rc = {part: int(read(f"{part}.rc").strip() or 1) for part in ("tests", "tiny", "bench")}
cuda_errors = {part: len(re.findall(r"CUDA [Ee]rror", read(f"{part}.log"))) for part in rc}
lines = []

def json_line(text):
    found = [line for line in text.splitlines() if line.startswith("{")]
    return json.loads(found[-1]) if found else {}

tests = read("tests.log")
counts = re.findall(r"(\d+) (passed|failed|skipped|error)", tests)
gpu = json_line(tests)
lines.append(f"gpu tests: {', '.join(f'{n} {k}' for n, k in counts) or 'no result'}")
if gpu:
    lines.append(f"  switch out freed {gpu['freed_by_switch_gb']:.2f} GiB of "
                 f"{gpu['state_gb']:.2f} GiB params + optimizer state (pinned host "
                 f"{gpu['host_gb']:.2f} GiB; allocator: "
                 f"{gpu['allocated_freed_by_switch_gb']:.2f}); sleep freed "
                 f"{gpu['freed_by_sleep_gb']:.2f} GiB (KV cache {gpu['kv_cache_gb']:.2f}); bf16 "
                 f"logp gap mean {gpu['logp_gap_mean']:.4f} max {gpu['logp_gap_max']:.4f} "
                 f"(bound {gpu['logp_gap_bound']:.4f})")
path = os.path.join(out, "tiny", "metrics.jsonl")
rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
if rows:
    mean = lambda key, part: sum(r[key] for r in part) / len(part)
    evals = [r["eval_pass1"] for r in rows if "eval_pass1" in r]
    lines.append(f"tiny task: exit {rc['tiny']}, {len(rows)} steps, reward "
                 f"{mean('reward_mean', rows[:10]):.3f} -> {mean('reward_mean', rows[-10:]):.3f}, "
                 f"eval {evals[-1] if evals else float('nan'):.3f}, step "
                 f"{mean('step_time_s', rows[1:] or rows):.3f} s, logp gap "
                 f"{mean('logp_gap', rows):.1e}")
else:
    lines.append(f"tiny task: exit {rc['tiny']}, no metrics")
bench = json_line(read("bench.log"))
if bench:
    sec = bench["seconds"]
    lines.append(f"bench 0.5B: step {sec['step']:.2f} s (" + ", ".join(
        f"{k} {v:.2f}" for k, v in sec.items() if k != "step") + f"); generate/floor "
        f"{bench['generate_over_floor']}, logp gap {bench['logp_gap']:.4f}, freed by sleep "
        f"{bench.get('mem_freed_by_sleep_gb', 'n/a')} GiB, by the switch "
        f"{bench.get('mem_freed_by_switch_out_gb', 'n/a')} GiB")
else:
    lines.append(f"bench 0.5B: exit {rc['bench']}, no result")
lines.append(f"CUDA error lines: {cuda_errors}; wall {wall} s")
ran = {kind: sum(int(n) for n, k in counts if k == kind) for kind in ("passed", "skipped")}
ok = (all(v == 0 for v in rc.values()) and not any(cuda_errors.values()) and bool(rows)
      and ran["passed"] > 0 and not ran["skipped"])  # skipped: no GPU or no vLLM seen
print("\n".join([f"gpu_check: {'PASS' if ok else 'FAIL'} {rc}"] + lines))
sys.exit(0 if ok else 1)
EOF
