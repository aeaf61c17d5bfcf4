#!/usr/bin/env bash
# Check the trainer on a machine with an accelerator and vLLM, in about 10 minutes (an NVIDIA GPU;
# scripts/npu_check.sh runs the same on an Ascend NPU):
#   1. the `device` tests (tests/test_device.py: memory given back by the offload and by sleep,
#      the exact pinned host memory, engine == trainer after a bf16 sync, the device's kernels
#      against their plain-torch references, an update with no token to learn from, 20 steps
#      that exit cleanly, steps after a Ctrl-C caught in a reward);
#   2. the tiny task for 100 steps (configs/tiny_cpu.yaml, its model and engine in
#      $ENGINE_DTYPE: float32 by default, as the config; npu_check.sh gives bfloat16);
#   3. bench/step.py at Qwen2.5-0.5B's shapes (a random model, 512-token responses) on
#      $BENCH_CONFIG (default configs/qwen2.5-0.5b-gsm8k-cuda1.yaml);
#   4. a LoRA run (configs/lora_cpu.yaml in bf16, 30 steps, a KL term against the base): the
#      adapter pushed in place each step, the engine sleeping with LoRA on;
#   and, asked for by name only (PARTS="memory", about 3 minutes more): bench/memory.py, the
#   tiny task for 500 steps on one rank with the offload and a push every step, host and device
#   memory fitted per 100 steps after step 200 (one rank on CPU still rose until step 250).
# Prints one summary at the end, of every part whose log is in $OUT; exit code 0 when all the
# parts run passed with no runtime error line in their logs ($DEVICE_ERRORS, a regex: CUDA's by
# default). Logs stay in $OUT.
#   bash scripts/gpu_check.sh                      # PYTHON=python3.12 to choose the interpreter
#   OUT=/tmp/gc PARTS="tests tiny" bash scripts/gpu_check.sh; OUT=/tmp/gc PARTS="bench lora" ...
#                                                  # in two runs (one summary of all four)
# An offline GPU machine gets vLLM as ../shared/gpu/README.md says (then PYTHONPATH=/tmp/site).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$(mktemp -d /tmp/gpu_check.XXXX)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
PARTS=${PARTS-tests tiny bench lora}  # empty: only the summary
BENCH_CONFIG=${BENCH_CONFIG:-configs/qwen2.5-0.5b-gsm8k-cuda1.yaml}
export DEVICE_ERRORS=${DEVICE_ERRORS:-CUDA [Ee]rror}
ENGINE_DTYPE=${ENGINE_DTYPE:-float32}  # the tiny part's model.param_dtype and rollout.dtype
mkdir -p "$OUT"
start=$(date +%s)

echo "gpu_check: logs in $OUT, parts: $PARTS"
part() { [[ " $PARTS " == *" $1 "* ]]; }
if part tests; then
  timeout 600 "$PY" -m pytest -q -s -m device tests/test_device.py -p no:cacheprovider \
      >"$OUT/tests.log" 2>&1
  echo "$?" >"$OUT/tests.rc"
fi
if part tiny; then
  timeout 240 "$PY" train_grpo.py --config configs/tiny_cpu.yaml --train.steps=100 \
      --model.param_dtype="$ENGINE_DTYPE" --rollout.dtype="$ENGINE_DTYPE" \
      --log.out_dir="$OUT/tiny" --log.eval_every=100 --data.tiny_task_dir="$OUT/tiny_task" \
      >"$OUT/tiny.log" 2>&1
  echo "$?" >"$OUT/tiny.rc"
fi
if part bench; then
  timeout 300 "$PY" bench/step.py --config "$BENCH_CONFIG" \
      --shape qwen2.5-0.5b --prompt-len 128 --rollout.max_new_tokens=512 --steps 4 \
      >"$OUT/bench.log" 2>&1
  echo "$?" >"$OUT/bench.rc"
fi
if part lora; then
  timeout 300 "$PY" train_grpo.py --config configs/lora_cpu.yaml --train.steps=30 \
      --model.param_dtype=bfloat16 --rollout.dtype=bfloat16 --grpo.kl_coef=0.01 \
      --log.out_dir="$OUT/lora" --log.eval_every=30 --data.tiny_task_dir="$OUT/tiny_task" \
      >"$OUT/lora.log" 2>&1
  echo "$?" >"$OUT/lora.rc"
fi
if part memory; then
  timeout 420 "$PY" bench/memory.py --steps 500 --warmup 200 --nproc 1 --out "$OUT/memory" \
      --model.param_dtype="$ENGINE_DTYPE" --rollout.dtype="$ENGINE_DTYPE" \
      --data.tiny_task_dir="$OUT/tiny_task" >"$OUT/memory.log" 2>&1
  echo "$?" >"$OUT/memory.rc"
fi

"$PY" - "$OUT" "$(( $(date +%s) - start ))" <<'EOF'
import json, os, re, sys

out, wall = sys.argv[1], int(sys.argv[2])
def read(name):
    path = os.path.join(out, name)
    return open(path, errors="replace").read() if os.path.exists(path) else ""

rc = {part: int(read(f"{part}.rc").strip() or 1)
      for part in ("tests", "tiny", "bench", "lora", "memory")
      if os.path.exists(os.path.join(out, f"{part}.rc"))}  # the parts run, in this $OUT
errors = {part: len(re.findall(os.environ["DEVICE_ERRORS"], read(f"{part}.log"))) for part in rc}
lines, found = [], {}

def json_line(text):
    found = [line for line in text.splitlines() if line.startswith("{")]
    return json.loads(found[-1]) if found else {}

def metrics(part):
    path = os.path.join(out, part, "metrics.jsonl")
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []

mean = lambda key, rows: sum(r[key] for r in rows) / len(rows)
tests = read("tests.log")
counts = re.findall(r"(\d+) (passed|failed|skipped|error)", tests)
ran = {kind: sum(int(n) for n, k in counts if k == kind) for kind in ("passed", "skipped")}
found["tests"] = ran["passed"] >= 4  # fewer: no accelerator or no vLLM seen (skipped)
gpu = json_line(tests)
lines.append(f"device tests: {', '.join(f'{n} {k}' for n, k in counts) or 'no result'}")
if gpu:
    lines.append(f"  offload out freed {gpu['freed_by_offload_gb']:.2f} GiB of "
                 f"{gpu['state_gb']:.2f} GiB params + optimizer state (pinned host "
                 f"{gpu['host_gb']:.2f} GiB; allocator: "
                 f"{gpu['allocated_freed_by_offload_gb']:.2f}); sleep freed "
                 f"{gpu['freed_by_sleep_gb']:.2f} GiB (KV cache {gpu['kv_cache_gb']:.2f}); bf16 "
                 f"logp gap mean {gpu['logp_gap_mean']:.4f} max {gpu['logp_gap_max']:.4f} "
                 f"(bound {gpu['logp_gap_bound']:.4f})")
rows = metrics("tiny")
found["tiny"] = bool(rows)
if rows:
    evals = [r["eval_pass1"] for r in rows if "eval_pass1" in r]
    lines.append(f"tiny task: exit {rc.get('tiny')}, {len(rows)} steps, reward "
                 f"{mean('reward_mean', rows[:10]):.3f} -> {mean('reward_mean', rows[-10:]):.3f}, "
                 f"eval {evals[-1] if evals else float('nan'):.3f}, step "
                 f"{mean('step_time_s', rows[1:] or rows):.3f} s, logp gap "
                 f"{mean('logp_gap', rows):.1e}")
else:
    lines.append(f"tiny task: exit {rc.get('tiny', 'not run')}, no metrics")
bench = json_line(read("bench.log"))
found["bench"] = bool(bench)
if bench:
    sec = bench["seconds"]
    lines.append(f"bench 0.5B: step {sec['step']:.2f} s (" + ", ".join(
        f"{k} {v:.2f}" for k, v in sec.items() if k != "step") + f"); generate/floor "
        f"{bench['generate_over_floor']}, logp gap {bench['logp_gap']:.4f}, update "
        f"{bench['train_tflops']} TFLOP/s (mfu {bench.get('mfu', 'n/a')}), freed by sleep "
        f"{bench.get('mem_freed_by_sleep_gb', 'n/a')} GiB, by the offload "
        f"{bench.get('mem_freed_by_optimizer_out_gb', 'n/a')} (optimizer) + "
        f"{bench.get('mem_freed_by_actor_out_gb', 'n/a')} (actor) GiB of the "
        f"{bench.get('offload_host_gb', 'n/a')} GiB it moved to host memory")
else:
    lines.append(f"bench 0.5B: exit {rc.get('bench', 'not run')}, no result")
lora = metrics("lora")
found["lora"] = bool(lora)
if lora:
    last = lora[-1]
    slept = [r["mem_sleep_before_gb"] - r["mem_sleep_after_gb"] for r in lora
             if "mem_sleep_after_gb" in r]
    lines.append(f"lora: exit {rc['lora']}, {len(lora)} steps, {last['trainable_params']} "
                 f"trainable, push {last['sync_gb'] * 2**30 / 1e6:.2f} MB in "
                 f"{1e3 * mean('sync_time_s', lora[1:] or lora):.1f} ms, logp gap max "
                 f"{max(r['logp_gap'] for r in lora):.1e}, kl {last['kl']:.4f}, sleep freed "
                 f"{max(slept) if slept else float('nan'):.2f} GiB, peak "
                 f"{max(r['mem_peak_gb'] for r in lora):.2f} GiB, eval "
                 f"{last.get('eval_pass1', float('nan')):.3f}")
else:
    lines.append(f"lora: exit {rc.get('lora', 'not run')}, no metrics")
if "memory" in rc:
    mem = json_line(read("memory.log"))
    found["memory"] = bool(mem)
    fit = lambda g: "n/a" if not g else (f"{g['first_gb']:.3f} -> {g['last_gb']:.3f} GiB, "
                                         f"{g['mib_per_100_steps']:+.2f} MiB per 100 steps")
    lines.append(f"memory: {mem['steps']} steps, fitted after step {mem['warmup']}: host "
                 f"{fit(mem['host'])}; device {fit(mem['device'])}" if mem else
                 f"memory: exit {rc['memory']}, no result")
lines.append(f"runtime error lines: {errors}; wall {wall} s (this run)")
ok = (bool(rc) and all(v == 0 for v in rc.values()) and not any(errors.values())
      and all(found[part] for part in rc))
print("\n".join([f"gpu_check: {'PASS' if ok else 'FAIL'} {rc}"] + lines))
sys.exit(0 if ok else 1)
EOF
