#!/usr/bin/env bash
# On a TPU VM without a route to PyPI (Python 3.11, its own index /opt/pypi + /opt/pypi-more and torch
# 2.13.0+cpu in /opt/wheels): install tpuray's TPU stack (torch_tpu 0.2.0, libtpu 0.0.52) and vLLM-TorchTPU
# 0.29.0 under $TPURAY_VM_ROOT (default /tmp/tpuray-tpu), no root needed. Steps, each idempotent:
#
#   bash tpu-vm/install.sh deps          # torch + the packages of pins.txt the VM's index holds (~1 min)
#   bash tpu-vm/install.sh part DIR      # keep one carried part (DIR = .tpu-payload/part-NN)
#   bash tpu-vm/install.sh payload       # all parts kept: torch_tpu, libtpu, vLLM-TorchTPU, the carried wheels
#   bash tpu-vm/install.sh all DIR...    # all three
#
# Then `. tpu-vm/env.sh`. The parts come from tpu-vm/build-payload.sh (run where pip reaches PyPI).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=${TPURAY_VM_ROOT:-/tmp/tpuray-tpu}
PY=${PYTHON:-python3}
mkdir -p "$ROOT/site" "$ROOT/parts"

pip_target() {  # pip install --no-deps into $ROOT/site from the VM's index, /opt/wheels and carried wheels
  PIP_CONFIG_FILE=/dev/null "$PY" -m pip install --isolated -q --no-deps --no-compile --only-binary=:all: \
    --disable-pip-version-check --upgrade --target "$ROOT/site" --index-url file:///opt/pypi/simple \
    --extra-index-url file:///opt/pypi-more/simple --find-links /opt/wheels "$@" 2>&1 \
    | grep -v -E "is ignored: it is neither|Target directory .* already exists" || true
}

deps() {
  [ -f "$ROOT/.deps" ] && { echo "deps: already installed"; return; }
  local t0=$SECONDS
  # pins.txt without the carried wheels (they come with the payload): names compared normalized
  awk 'function n(s) { sub(/==.*/, "", s); s = tolower(s); gsub(/[-_.]+/, "-", s); return s }
       /^[ \t]*(#|$)/ { next } FNR == NR { carried[n($0)] = 1; next } !(n($0) in carried)' \
    "$HERE/wheels.txt" "$HERE/pins.txt" > "$ROOT/index-pins.txt"
  pip_target -r "$ROOT/index-pins.txt"
  for pkg in torch transformers tokenizers; do [ -d "$ROOT/site/$pkg" ] || { echo "deps: $pkg missing"; exit 1; }; done
  rm -rf "$ROOT/site/bin"; touch "$ROOT/.deps"
  echo "deps: $(wc -l < "$ROOT/index-pins.txt") packages in $((SECONDS - t0)) s"
}

part() {
  local dir=${1:?usage: install.sh part DIR}
  cp "$dir"/payload.part.* "$ROOT/parts/"
  cp "$dir/NPARTS" "$ROOT/parts/NPARTS"
  echo "part: $(ls "$ROOT/parts" | grep -c payload.part) of $(cat "$ROOT/parts/NPARTS") kept"
}

payload() {
  [ -f "$ROOT/.payload" ] && { echo "payload: already installed"; return; }
  local t0=$SECONDS have want
  have=$(ls "$ROOT/parts" | grep -c payload.part || true); want=$(cat "$ROOT/parts/NPARTS" 2>/dev/null || echo "?")
  [ "$have" = "$want" ] || { echo "payload: $have of $want parts here; carry the rest first"; exit 1; }
  rm -rf "$ROOT/unpack" && mkdir -p "$ROOT/unpack" "$ROOT/libtpu"
  cat "$ROOT"/parts/payload.part.* | tar -C "$ROOT/unpack" -xf -
  xz -d -T0 < "$ROOT/unpack/libtpu.tar.xz" | tar -C "$ROOT/libtpu" -xf - &
  xz -d -T0 < "$ROOT/unpack/torch_tpu.tar.xz" | tar -C "$ROOT/site" -xf -
  wait
  # the carried wheels; the plugin declares Python >= 3.12 (rewritten below); the fork is tagged cp312 but
  # holds no compiled module, so it is unpacked as it is (its dist-info included: vLLM reads its version)
  pip_target --find-links "$ROOT/unpack/wheels" --ignore-requires-python \
    $(grep -v -E '^\s*(#|$)' "$HERE/wheels.txt") "vllm-torchtpu-core==0.29.0"
  "$PY" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
    "$(ls "$ROOT"/unpack/wheels/vllm_torchtpu-*.whl)" "$ROOT/site"
  rm -f "$ROOT/site/sitecustomize.py"   # its two settings are in env.sh (it would run in every process)
  "$PY" "$HERE/py311.py" "$ROOT/site"
  # bytecode for every module, once: the VM sets PYTHONDONTWRITEBYTECODE and pip ran with --no-compile,
  # so each process would otherwise compile torch's, vLLM's ... sources again at every import (here
  # `import torch, torch._dynamo, sympy`: 2.1 s with bytecode, 5.8 s without, on 2 cores)
  local t1=$SECONDS failed
  "$PY" -m compileall -q -j 0 "$ROOT/site" > "$ROOT/compileall.log" 2>&1 || true
  failed=$(grep -c -E '^\*\*\* ' "$ROOT/compileall.log" || true)
  rm -rf "$ROOT/unpack" "$ROOT/site/bin"; touch "$ROOT/.payload"
  echo "payload: installed in $((SECONDS - t0)) s (bytecode: $((SECONDS - t1)) s, $failed file(s) not compiled:" \
    "$ROOT/compileall.log)"
}

case "${1:-}" in
  deps) deps ;;
  part) part "${2:-}" ;;
  payload) payload ;;
  all) shift; for d in "$@"; do part "$d"; done; deps; payload ;;
  *) echo "usage: install.sh deps | part DIR | payload | all DIR..."; exit 2 ;;
esac
