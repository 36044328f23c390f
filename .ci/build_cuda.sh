#!/usr/bin/env bash
# Compiles and links the CUDA kernels (csrc/cuda/*.cu) against a CUDA build of
# torch, on a machine without a GPU, and imports the result. A CUDA compile or
# link error fails CI.
#
# - Second venv .venv-cuda with torch 2.14.1+cu130 (installs from local disk).
# - Builds in a COPY of the tree (default /tmp/slimcomm-cuda-build), so the
#   in-place build never overwrites the CPU build's slimcomm/_C*.so in the
#   checkout; the copy keeps its build/ folder and only changed files are
#   re-copied, so reruns recompile exactly what changed.
# - Checks that the module loads, reports cuda: true, and that every op has a
#   CUDA kernel from csrc/cuda (not the "built without CUDA" stub).
#
# Environment: SLIMCOMM_CUDA_VENV (default .venv-cuda), SLIMCOMM_CUDA_BUILD_DIR,
# TORCH_CUDA_ARCH_LIST (default "8.0;9.0+PTX"), MAX_JOBS (default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VENV=${SLIMCOMM_CUDA_VENV:-$ROOT/.venv-cuda}
BUILD_DIR=${SLIMCOMM_CUDA_BUILD_DIR:-/tmp/slimcomm-cuda-build}
start=$(date +%s)

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.14.1') and torch.version.cuda else 1)" 2>/dev/null; then
  echo "build_cuda: installing torch 2.14.1 (CUDA 13.0 build) into $VENV"
  "$VENV/bin/python" -m pip install -q torch==2.14.1
fi
"$VENV/bin/python" -m pip install -q numpy ninja setuptools wheel

SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export CPATH="$SITE/nvidia/cu13/include${CPATH:+:$CPATH}"
export PATH="$CUDA_HOME/bin:$PATH"
export SLIMCOMM_FORCE_CUDA=1
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-8.0;9.0+PTX}
export MAX_JOBS=${MAX_JOBS:-2}

# Sync the tracked (and untracked, not ignored) files into $BUILD_DIR: a file
# is copied (with a fresh mtime) only when its content changed, so ninja
# recompiles exactly what changed since the last build there; sources that no
# longer exist are removed.
mkdir -p "$BUILD_DIR"
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
git ls-files -z --cached --others --exclude-standard \
  | xargs -0 -I{} sh -c 'test -f "{}" && printf "%s\0" "{}"' \
  | tar --null -cf - -T - | tar -xf - -C "$STAGE"
(cd "$STAGE" && find . -type f -print0) | while IFS= read -r -d '' f; do
  if ! cmp -s "$STAGE/$f" "$BUILD_DIR/$f"; then
    mkdir -p "$(dirname "$BUILD_DIR/$f")"
    cp "$STAGE/$f" "$BUILD_DIR/$f"
  fi
done
for d in csrc slimcomm tests bench; do
  [ -d "$BUILD_DIR/$d" ] || continue
  (cd "$BUILD_DIR" && find "$d" -type f ! -name '*.so' ! -path '*/__pycache__/*' -print0) \
    | while IFS= read -r -d '' f; do [ -e "$STAGE/$f" ] || rm -f "$BUILD_DIR/$f"; done
done

cd "$BUILD_DIR"
echo "build_cuda: building in $BUILD_DIR (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS)"
build_start=$(date +%s)
log="$BUILD_DIR/build_cuda.log"
if ! "$VENV/bin/python" setup.py -q build_ext --inplace >"$log" 2>&1; then
  grep -v -E "^(copying|running) " "$log" | tail -150 >&2
  if grep -q "C++20 or later compatible compiler is required" "$log"; then
    echo "build_cuda: torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)') needs C++20;" \
      "a '-std=c++17' in setup.py's compile flags overrides torch's default" >&2
  fi
  echo "build_cuda: CUDA build FAILED (full log: $log)" >&2
  exit 1
fi
grep -E "error|warning" "$log" | grep -v -E "Py_LIMITED_API|SetuptoolsDeprecationWarning" | head -20 || true
test -n "$(ls slimcomm/_C*.so 2>/dev/null)" || { echo "build_cuda: no slimcomm/_C*.so produced" >&2; exit 1; }
build_s=$(( $(date +%s) - build_start ))

"$VENV/bin/python" - <<'EOF'
import json

import torch

import slimcomm.ops  # noqa: F401  (loads the library)

info = json.loads(torch.ops.slimcomm._build_info())
print("build_cuda: build info", info)
assert info["cuda"] is True, "the extension was built without CUDA kernels"
# every public op the library registers (a new op without a CUDA kernel fails here)
ops = sorted(n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names()
             if n.startswith("slimcomm::") and not n.split("::", 1)[1].startswith("_"))
assert "sgd_apply_indexed" in ops and "step_commit" in ops, ops
for name in ops:
    table = torch._C._dispatch_dump(f"slimcomm::{name}")
    cuda_lines = [l for l in table.splitlines() if l.startswith("CUDA")]
    assert cuda_lines and "csrc/cuda/" in cuda_lines[0], f"{name}: no CUDA kernel from csrc/cuda: {cuda_lines}"
print(f"build_cuda: all {len(ops)} ops have CUDA kernels")
EOF
echo "build_cuda: OK (compile+link ${build_s} s, total $(( $(date +%s) - start )) s)"
