# Source on a TPU VM set up with ../shared/tpu-vm (torch + torch_tpu + libtpu under /tmp/tpuray-tpu):
# the import path for them and this checkout's src/, plus the few pure-Python packages tpuray's engine
# and tests need (safetensors, tokenizers, transformers, absl-py) from the VM's own package index when
# present, else from wheels carried in ${TPURAY_EXTRA_WHEELS:-.tpu-payload/extra} (benchmarks/tpu_vm_extra.sh).
ROOT=/tmp/tpuray-tpu
EXTRA_WHEELS=${TPURAY_EXTRA_WHEELS:-.tpu-payload/extra}
if [ ! -d /tmp/tpuray-extra/absl ] && ls "$EXTRA_WHEELS"/*.whl >/dev/null 2>&1; then
  for w in "$EXTRA_WHEELS"/*.whl; do
    python3 -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall('/tmp/tpuray-extra')" "$w"
  done
elif [ -d /opt/pypi/simple ] && [ ! -d /tmp/tpuray-extra/absl ]; then
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: \
    --index-url file:///opt/pypi/simple --target /tmp/tpuray-extra \
    safetensors tokenizers transformers absl-py 2>&1 | tail -2
fi
export PYTHONPATH=$ROOT/libtpu:${PYTHONPATH:-}:$ROOT/site:$ROOT/deps:/tmp/tpuray-extra:$PWD/src
export PYTHONWARNINGS='ignore:<TorchTpu/Performance/TcMalloc/'
export TPURAY_TORCH_TPU_USABLE=${TPURAY_TORCH_TPU_USABLE:-1}
