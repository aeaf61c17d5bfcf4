#!/usr/bin/env bash
# Check the trainer on an Ascend NPU, the twin of scripts/gpu_check.sh (the same parts, summary
# and exit code): the `device` tests (tests/test_device.py, the NPU's fused kernels and fused
# attention against their plain-torch references among them), the tiny task for 100 steps in
# bf16 (vLLM-Ascend's attention takes fp16/bf16 queries only: npu_ops.NPU_ENGINE_DTYPES),
# bench/step.py at Qwen2.5-0.5B's shapes on configs/qwen2.5-0.5b-gsm8k-npu1.yaml, and a LoRA run.
# Not run by this project: no NPU is reachable from its machines.
#   source /usr/local/Ascend/ascend-toolkit/set_env.sh; source /usr/local/Ascend/nnal/atb/set_env.sh
#   bash scripts/npu_check.sh                      # OUT=..., PARTS="tests tiny" as gpu_check.sh
# A runtime error line in a log: CANN's error codes (EZ9999, EE1001, ...) or torch_npu's
# (ERR00100, ...).
set -uo pipefail
cd "$(dirname "$0")/.."
export BENCH_CONFIG=${BENCH_CONFIG:-configs/qwen2.5-0.5b-gsm8k-npu1.yaml}
cann_errors='\bE[A-Z][0-9]{4}\b|\bERR[0-9]{5}\b'
export DEVICE_ERRORS=${DEVICE_ERRORS:-$cann_errors}
export ENGINE_DTYPE=${ENGINE_DTYPE:-bfloat16}
exec bash scripts/gpu_check.sh "$@"
