#!/usr/bin/env bash
# Build, where pip reaches PyPI, what a TPU VM without a package route needs beyond its own index:
# torch_tpu 0.2.0 (only its glue for torch 2.13), libtpu 0.0.52, vLLM-TorchTPU 0.29.0 (vllm-torchtpu: vLLM's
# fork, pure Python; vllm-torchtpu-core: the TPU platform plugin) and the wheels of wheels.txt, as parts of
# at most $PART_MB MiB (one per device call: each call carries at most 64 MiB with the working tree).
#
#   bash tpu-vm/build-payload.sh .tpu-payload        # DEST must be git-ignored; ~10 min on 2 cores (xz)
#
# On the VM: tpu-vm/install.sh (README.md beside this file).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
DEST=${1:?usage: build-payload.sh DEST}
PART_MB=${PART_MB:-60}
TORCH_TAG=2_13_0   # torch_tpu ships one glue library per torch release; the VM's torch is 2.13.0
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
dl() {
  python3 -m pip download -q --no-deps --only-binary=:all: --implementation cp --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 "$@" 2>&1 \
    | grep -v "is ignored: it is neither" || true
}
echo "downloading"
mkdir -p "$W/dl" "$W/p/wheels" "$W/site" "$W/libtpu"
dl --python-version 3.11 -d "$W/dl" torch-tpu==0.2.0 libtpu==0.0.52
dl --python-version 3.11 -d "$W/p/wheels" $(grep -v -E '^\s*(#|$)' "$HERE/wheels.txt")
# vLLM-TorchTPU declares Python 3.12; install.sh makes it run on 3.11 (py311.py)
dl --python-version 3.12 -d "$W/p/wheels" vllm-torchtpu==0.29.0 vllm-torchtpu-core==0.29.0
echo "staging torch_tpu (glue for torch ${TORCH_TAG//_/.} only) and libtpu"
python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$W"/dl/torch_tpu-*.whl "$W/site"
python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$W"/dl/libtpu-*.whl "$W/libtpu"
find "$W/site/torch_tpu" -name "*_2_1[0-9]_0*" ! -name "*_${TORCH_TAG}*" -exec rm -rf {} +
find "$W/site" -name __pycache__ -prune -exec rm -rf {} +
chmod -R u+rwX,go+rX "$W/site" "$W/libtpu"
echo "compressing (xz, a few minutes)"
tar -C "$W/site" -cf - . | xz -T0 -6 > "$W/p/torch_tpu.tar.xz"
tar -C "$W/libtpu" -cf - . | xz -T0 -6 > "$W/p/libtpu.tar.xz"
rm -rf "${DEST:?}"/part-*; mkdir -p "$DEST"
tar -C "$W/p" -cf - wheels torch_tpu.tar.xz libtpu.tar.xz | split -b "${PART_MB}m" -d -a 2 - "$W/payload.part."
n=$(ls "$W"/payload.part.* | wc -l); i=0
for f in "$W"/payload.part.*; do
  d="$DEST/part-$(printf %02d $i)"; mkdir -p "$d"; mv "$f" "$d/"; echo "$n" > "$d/NPARTS"; i=$((i + 1))
done
du -sh "$DEST"/part-*
echo "$n parts: carry one per device call; there: bash tpu-vm/install.sh part $DEST/part-NN (then payload)"
