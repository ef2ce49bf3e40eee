# Source from the checkout's root on a TPU VM set up by tpu-vm/install.sh:   . tpu-vm/env.sh
# The import path (libtpu 0.0.52 before the VM's own older libtpu, which torch_tpu refuses; the installed
# packages after the VM's JAX and numpy; this checkout's src/) and the settings tpuray's engines run with
# on a VM that has one chip and no TCP sockets.
TPURAY_VM_ROOT=${TPURAY_VM_ROOT:-/tmp/tpuray-tpu}
export PYTHONPATH=$TPURAY_VM_ROOT/libtpu${PYTHONPATH:+:$PYTHONPATH}:$TPURAY_VM_ROOT/site:$PWD/src
export PYTHONWARNINGS='ignore:<TorchTpu/Performance/TcMalloc/'
export TPURAY_TORCH_TPU_USABLE=${TPURAY_TORCH_TPU_USABLE:-1}   # a TPU VM: skip tpuray's probe subprocess
# vLLM: its engine core in the serving process (one process may hold the chip; no TCP for another), no
# usage reports or hub lookups; the two settings vLLM-TorchTPU's sitecustomize.py makes before torch_tpu
# loads (install.sh leaves that file out: it would run in every process). AOTAutograd's cache on, unlike
# that file: vLLM-TorchTPU's second start takes 77 s, not 111 s, with the same tokens (docs/real-tpu.md)
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1
export TORCH_TPU_INTERNAL_MATERIALIZE_COLLECTIVE_TENSORS=false
export TORCHINDUCTOR_AUTOGRAD_CACHE=${TORCHINDUCTOR_AUTOGRAD_CACHE:-1}
# compiled programs of both engines, kept for the next start (tpuray.serve.llm.engine.compile_cache)
export TPURAY_COMPILE_CACHE=${TPURAY_COMPILE_CACHE:-$TPURAY_VM_ROOT/compile-cache}
# libtpu's premapped host buffer (tpuray.constants.TPU_HOST_TRANSFER_ENV): torch_tpu hands it to libtpu as
# torch loads; unset, every host-to-chip copy takes libtpu's slow staged path (docs/configuration.md)
export TPU_PREMAPPED_BUFFER_SIZE=${TPU_PREMAPPED_BUFFER_SIZE:-4294967296}
export TPU_PREMAPPED_BUFFER_TRANSFER_THRESHOLD_BYTES=${TPU_PREMAPPED_BUFFER_TRANSFER_THRESHOLD_BYTES:-4294967296}
