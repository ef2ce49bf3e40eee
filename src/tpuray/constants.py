"""The names tpuray shares with Ray, GKE/KubeRay and its own processes: one place for each.

Pure constants (no imports), so every layer, the topology model included, can use them. Ray's node label
keys and resource names are spelled as Ray 2.60 spells them (`ray._raylet.RAY_NODE_TPU_*_KEY`,
`ray/_private/accelerators/tpu.py`); they are not imported from Ray so that pure-Python modules stay
Ray-free. Environment knobs that tpuray reads are listed in docs/configuration.md.
"""

from __future__ import annotations

# -- Ray node labels of a TPU host (set by Ray from the host env; by the emulator on emulated hosts) -----
SLICE_NAME_LABEL = "ray.io/tpu-slice-name"
WORKER_ID_LABEL = "ray.io/tpu-worker-id"
TOPOLOGY_LABEL = "ray.io/tpu-topology"
POD_TYPE_LABEL = "ray.io/tpu-pod-type"
ACCELERATOR_LABEL = "ray.io/accelerator-type"
# tpuray's own labels: which nodes are emulated TPU hosts, and the emulated cluster's CPU head.
EMULATED_LABEL = "tpuray.io/emulated"
ROLE_LABEL = "tpuray.io/role"
# the cores an emulated host computes on where its slice has cores of its own (cores="per_slice"): "0,1"
EMULATED_CORES_LABEL = "tpuray.io/emulated-cores"

# -- Ray resources ---------------------------------------------------------------------------------------
TPU_RESOURCE = "TPU"


def head_resource(pod_type: str) -> str:
    """The resource Ray puts on worker 0 of a slice: "TPU-v6e-16-head"."""
    return f"TPU-{pod_type}-head"


def accelerator_resource(accelerator_type: str) -> str:
    """Ray's accelerator-type resource: "accelerator_type:TPU-V6E"."""
    return f"accelerator_type:{accelerator_type}"


# Ray placement group strategies.
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")

# -- TPU host environment (GKE/KubeRay's webhook or the TPU VM metadata; the emulator on emulated hosts) --
TPU_NAME_ENV = "TPU_NAME"
TPU_WORKER_ID_ENV = "TPU_WORKER_ID"
TPU_WORKER_HOSTNAMES_ENV = "TPU_WORKER_HOSTNAMES"
TPU_ACCELERATOR_TYPE_ENV = "TPU_ACCELERATOR_TYPE"
TPU_TOPOLOGY_ENV = "TPU_TOPOLOGY"
HOST_ENV = (
    TPU_NAME_ENV,
    TPU_WORKER_ID_ENV,
    TPU_WORKER_HOSTNAMES_ENV,
    TPU_ACCELERATOR_TYPE_ENV,
    TPU_TOPOLOGY_ENV,
)
# Set by Ray per worker process holding {"TPU": n}.
TPU_VISIBLE_CHIPS_ENV = "TPU_VISIBLE_CHIPS"
# A process's rank within its slice (libtpu / TorchTPU), set per process by `tpuray.isolation.process_env`.
CLOUD_TPU_TASK_ID_ENV = "CLOUD_TPU_TASK_ID"
# libtpu's multi-process layout, set per process by `tpuray.topology.worker_env` (torch_xla's names).
TPU_CHIPS_PER_PROCESS_BOUNDS_ENV = "TPU_CHIPS_PER_PROCESS_BOUNDS"
TPU_PROCESS_BOUNDS_ENV = "TPU_PROCESS_BOUNDS"
TPU_PROCESS_ADDRESSES_ENV = "TPU_PROCESS_ADDRESSES"
TPU_PROCESS_PORT_ENV = "TPU_PROCESS_PORT"
# TorchTPU's tpu_dist (torch_tpu 0.2.0), set per process by `tpuray.topology.worker_env`.
TORCH_TPU_TOPOLOGY_ENV = "TORCH_TPU_TOPOLOGY"
TORCH_TPU_SLICEBUILDER_ADDRESSES_ENV = "TORCH_TPU_SLICEBUILDER_ADDRESSES"
TORCH_TPU_DEVICES_PER_HOST_ENV = "TORCH_TPU_DEVICES_PER_HOST"  # tpu_dist: ranks per host (LOCAL_RANK < it)
# libtpu's premapped (pinned, DMA-mapped) host buffer, which torch_tpu hands libtpu once, at `import torch`:
# unset, it passes 0 bytes and every host-to-chip copy takes libtpu's staged slow path (measured:
# docs/configuration.md). Set on TPU hosts before torch loads (tpu-vm/env.sh repeats these values;
# tpuray.k8s's TPU pods, within their memory); tpuray warns where unset.
TPU_PREMAPPED_BUFFER_SIZE_ENV = "TPU_PREMAPPED_BUFFER_SIZE"
TPU_PREMAPPED_THRESHOLD_ENV = (
    "TPU_PREMAPPED_BUFFER_TRANSFER_THRESHOLD_BYTES"  # largest copy staged through it
)
TPU_HOST_TRANSFER_ENV = (
    (TPU_PREMAPPED_BUFFER_SIZE_ENV, str(4 << 30)),
    (TPU_PREMAPPED_THRESHOLD_ENV, str(4 << 30)),
)
TORCH_TRACE_ENV = "TORCH_TRACE"  # torch's structured trace; torch_tpu's lowering then keeps MLIR tracebacks
# Read by torch_tpu's launcher (`torch.tpu.distributed.set_tpu_launch_env`), never set by tpuray.
JOB_COMPLETION_INDEX_ENV = "JOB_COMPLETION_INDEX"
TORCH_TPU_BASE_PORT_ENV = "TORCH_TPU_BASE_PORT"
# torchrun's per-process variables (set by `tpuray.slices.distributed.torchrun_env`).
NODE_RANK_ENV = "NODE_RANK"
NNODES_ENV = "NNODES"
MASTER_ADDR_ENV = "MASTER_ADDR"
MASTER_PORT_ENV = "MASTER_PORT"
# Ray's single-process sub-host bounds (1-2 chip shares): they describe an isolated 1-host slice.
RAY_SUBHOST_BOUNDS_ENV = ("TPU_CHIPS_PER_HOST_BOUNDS", "TPU_HOST_BOUNDS")

# -- tpuray's own environment variables ------------------------------------------------------------------
EMULATION_ENV = "TPURAY_EMULATION"  # "1" on every emulated TPU host: the only switch that emulates
TORCH_TPU_PROBE_ENV = "TPURAY_TORCH_TPU_USABLE"  # the emulator's torch_tpu probe result, for its hosts
RESERVE_TIMEOUT_ENV = "TPURAY_TRAIN_RESERVE_TIMEOUT_S"
QUIET_ENV = "TPURAY_QUIET"
STORAGE_PATH_ENV = "TPURAY_STORAGE_PATH"
API_KEY_ENV = "TPURAY_SERVE_API_KEY"
STATE_DIR_ENV = "TPURAY_STATE_DIR"
COMPILE_CACHE_ENV = "TPURAY_COMPILE_CACHE"  # the engines' compiled programs on this host's disk ("off")
KUBERAY_CRDS_ENV = "TPURAY_KUBERAY_CRDS"
DEMO_PORT_ENV = "TPURAY_DEMO_PORT"
LOG_DIR_ENV = "TPURAY_LOG_DIR"  # where the commands' log files go (default ~/.tpuray/logs)
MODEL_CACHE_ENV = "TPURAY_MODEL_CACHE"  # where model_source URLs are downloaded (~/.cache/tpuray/models)
SLICE_DEMAND_ENV = "TPURAY_SLICE_DEMAND"  # how a reservation asks the autoscaler (tpuray.slices.demand)
VLLM_PLATFORM_ENV = "TPURAY_VLLM_PLATFORM"  # "emulated-tpu": vLLM in this process serves an emulated slice
# MLflow 3 refuses file stores unless this is "true": MLflowLoggerCallback sets it (when unset) for one.
MLFLOW_ALLOW_FILE_STORE_ENV = "MLFLOW_ALLOW_FILE_STORE"

# -- Bounds on the training driver's waits: a slice or host lost at any point never hangs fit() ----------
UPLOAD_TIMEOUT_ENV = "TPURAY_TRAIN_UPLOAD_TIMEOUT_S"  # one checkpoint upload (report() / end of the loop)
DEFAULT_UPLOAD_TIMEOUT_S = 1800.0
WORKER_CALL_TIMEOUT_S = 60.0  # a call a live training worker answers at once (its reports, a ping)
PREEMPTION_NOTIFY_TIMEOUT_S = 10.0  # the workers acknowledge a preemption notice (well within any notice)
DRAIN_REQUEST_TIMEOUT_S = 30.0  # a drain request to Ray's GCS (the emulator's preemptions; Ray's: none)
# A preempted training attempt (tpuray.train) or serving engine (tpuray.serve) stops this long before
# the preemption deadline at the latest.
DEADLINE_MARGIN_S = 1.0
