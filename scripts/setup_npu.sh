#!/usr/bin/env bash
# Install the Ascend NPU stack into the current Python environment (a venv or conda env you made
# with Python 3.10-3.12), in the order vLLM-Ascend 0.23.0's installation guide gives
# (docs/source/installation.md). Not run by this project: no NPU is reachable from its machines.
#
#   source /usr/local/Ascend/ascend-toolkit/set_env.sh   # CANN 9.1.0, from Huawei
#   source /usr/local/Ascend/nnal/atb/set_env.sh         # NNAL 9.1.0 (libatb.so), likewise
#   bash scripts/setup_npu.sh
#
# Where each part comes from:
#   CANN, NNAL        Huawei's installer or a CANN image: not pip; this script only checks for it
#   torch, torch-npu  PyPI (torch 2.10.0 is what torch-npu 2.10.0.post4 is built against)
#   vllm 0.23.0       its git tag, built with VLLM_TARGET_DEVICE=empty (vLLM-Ascend's source
#                     route): PyPI's vllm 0.23.0 wheel requires torch==2.11.0, which torch-npu 2.10
#                     cannot run with; the "empty" build pins no torch and reports 0.23.0+empty
#   vllm-ascend       PyPI (0.23.0 has cp310-cp312 wheels; the extra indexes are the ones its
#                     guide adds, for packages such as triton-ascend)
#   the rest          requirements-npu.txt (-> requirements.txt)
# In vLLM-Ascend's container image (quay.io/ascend/vllm-ascend:v0.23.0, -a3 for A3) all of this
# but requirements.txt is installed already: the script sees that and installs only the rest.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VLLM_TAG=v0.23.0           # rollout.TESTED_VLLM and ascend_checks.TESTED_NPU_STACKS name this release
VLLM_ASCEND=0.23.0
TORCH=2.10.0
TORCH_NPU=2.10.0.post4
TRITON_ASCEND=3.2.2        # vllm-ascend 0.23.0's requirements.txt pin
SRC=${SRC:-$HOME/.cache/grpo-npu-src}

"$PY" -c 'import sys; assert (3, 10) <= sys.version_info[:2] <= (3, 12), sys.version' || {
  echo "setup_npu.sh: vLLM-Ascend 0.23.0 supports Python 3.10-3.12; set PYTHON=python3.x" >&2; exit 1; }
if [ -z "${ASCEND_TOOLKIT_HOME:-}" ] && [ -z "${ASCEND_HOME_PATH:-}" ]; then
  echo "setup_npu.sh: CANN is not set up in this shell. Install CANN 9.1.0 and NNAL 9.1.0, then" >&2
  echo "  source /usr/local/Ascend/ascend-toolkit/set_env.sh" >&2
  echo "  source /usr/local/Ascend/nnal/atb/set_env.sh   (or use vLLM-Ascend's image)" >&2
  exit 1
fi
installed() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))" 2>/dev/null || true; }
# x86: torch's CPU builds instead of PyPI's CUDA ones, for every install (vLLM-Ascend's guide
# sets this index globally): vllm-ascend 0.23.0 pins torchvision==0.25.0 and torchaudio==2.10.0,
# which PyPI would otherwise serve as CUDA builds beside torch 2.10.0+cpu
INDEX=()
[ "$(uname -m)" = x86_64 ] && INDEX=(--extra-index-url https://download.pytorch.org/whl/cpu/)
pip_install() { "$PY" -m pip install ${INDEX[@]+"${INDEX[@]}"} "$@"; }

if [ "$(installed vllm-ascend)" != "$VLLM_ASCEND" ]; then
  pip_install "torch==$TORCH" "torch-npu==$TORCH_NPU"
  # PyPI's vllm-ascend wheels are built for A2 (their _build_info.py): refuse them on another chip
  "$PY" -c 'import sys, torch_npu, ascend_checks as a
try: a.check_device_type("A2", torch_npu.npu.get_soc_version())
except ValueError as e: sys.exit(f"setup_npu.sh: PyPI wheel of vllm-ascend: {e}")'
  if [ ! -d "$SRC/vllm" ]; then
    git clone --depth 1 --branch "$VLLM_TAG" https://github.com/vllm-project/vllm "$SRC/vllm"
  fi
  tag=$(git -C "$SRC/vllm" describe --tags --exact-match 2>/dev/null || echo "no tag")
  if [ "$tag" != "$VLLM_TAG" ]; then
    echo "setup_npu.sh: $SRC/vllm is at $tag, not $VLLM_TAG. Fix: remove it (rm -rf $SRC/vllm)" >&2
    echo "  and run again, or point SRC at another folder" >&2
    exit 1
  fi
  # the build's own requirements (vLLM 0.23.0 pyproject.toml, [build-system]) but its
  # torch == 2.11.0, which build isolation would fetch (and fail to, on a node whose package
  # index has none): built without isolation against the torch 2.10 installed above (the
  # "empty" target compiles nothing; its setup.py only imports torch)
  pip_install "cmake>=3.26.1" ninja "packaging>=24.2" "setuptools>=77.0.3,<81.0.0" \
    "setuptools-scm>=8.0" "setuptools-rust>=1.9.0" wheel jinja2
  VLLM_TARGET_DEVICE=empty pip_install --no-build-isolation "$SRC/vllm"
  pip_install \
    --extra-index-url https://mirrors.huaweicloud.com/ascend/repos/pypi/variant \
    --extra-index-url https://mirrors.huaweicloud.com/ascend/repos/pypi \
    "vllm-ascend==$VLLM_ASCEND"
fi
pip_install -r requirements-npu.txt
# Exactly one `triton` package, triton-ascend's: on x86 vllm-ascend's xgrammar pulls upstream
# triton (its pyproject.toml: triton on Linux x86_64), which installs the same `triton` package
# as triton-ascend. vLLM-Ascend 0.23.0's Dockerfile (lines 51-53, 70-71) uninstalls both and
# installs triton-ascend last; so does this, where another distribution ships triton/
triton_owners() { "$PY" -c 'import importlib.metadata as m, re
owners = {re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower() for d in m.distributions()
          if any(str(f) == "triton/__init__.py" for f in d.files or ())}
print(" ".join(sorted(owners)))'; }
if [ "$(triton_owners)" != triton-ascend ]; then
  "$PY" -m pip uninstall -y triton triton-ascend
  pip_install --extra-index-url https://mirrors.huaweicloud.com/ascend/repos/pypi \
    "triton-ascend==$TRITON_ASCEND"
fi
owners=$(triton_owners)
if [ "$owners" != triton-ascend ]; then
  echo "setup_npu.sh: the triton package comes from '$owners', not triton-ascend alone. Fix:" >&2
  echo "  $PY -m pip uninstall -y triton triton-ascend, then run this script again" >&2
  exit 1
fi
# the start-up checks of the trainer, on the installed versions (no model, no device needed)
"$PY" -c 'import os, ascend_checks as a; v = a.installed_versions(); print(v); a.check_ascend({**os.environ, "VLLM_ASCEND_ENABLE_NZ": "0"}, v)'
