#!/usr/bin/env bash
# Download, where pip reaches PyPI, the pure-Python packages tpuray's engine and tests need on a TPU VM that
# has no package index (transformers, tokenizers, safetensors, huggingface_hub at this checkout's .venv
# versions, and absl-py, which torch_tpu imports and some VM images lack): one folder of wheels (~32 MiB),
# carried to the VM as one piece; benchmarks/tpu_vm_env.sh unpacks it there. DEST should be git-ignored.
set -euo pipefail
DEST=${1:?usage: tpu_vm_extra.sh DEST   (e.g. .tpu-payload/extra)}
read -r TF TOK ST HUB < <(.venv/bin/python -c "import transformers as a, tokenizers as b, safetensors as c, \
huggingface_hub as d; print(a.__version__, b.__version__, c.__version__, d.__version__)")
mkdir -p "$DEST"
python3 -m pip download -q --only-binary=:all: --python-version 3.11 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DEST" "transformers==$TF" "tokenizers==$TOK" "safetensors==$ST" "huggingface_hub==$HUB" absl-py
rm -f "$DEST"/numpy-*.whl    # the VM's JAX brings its own numpy
du -sh "$DEST"
