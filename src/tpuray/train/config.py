"""Typed, validated configs: ScalingConfig, RunConfig, FailureConfig, CheckpointConfig, TorchConfig.

Everything is checked in `__post_init__` so a bad config fails at construction, before anything is
reserved on the cluster. Field names mirror `ray.train` so scripts only need `ray.train` -> `tpuray.train`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

# Ray's per-task TPU counts that tile a host (ray/_private/accelerators/tpu.py).
VALID_TPUS_PER_WORKER = (1, 2, 4, 8)
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
DEFAULT_STORAGE_PATH = "~/tpuray_results"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class ScalingConfig:
    """How many workers to start and on what hardware.

    With `use_tpu=True`, `topology` + `accelerator_type` name the slice shape (e.g. "4x4", "TPU-V6E");
    one worker runs per chip by default (`resources_per_worker={"TPU": 1}`), and `num_workers` must fill
    whole slices. `num_slices` defaults to `num_workers / workers_per_slice` (as in Ray Train).
    """

    num_workers: int = 1
    use_tpu: bool = False
    use_gpu: bool = False
    topology: str | None = None
    accelerator_type: str | None = None
    resources_per_worker: dict[str, float] | None = None
    num_slices: int | None = None
    placement_strategy: str = "PACK"

    def __post_init__(self) -> None:
        if (
            not isinstance(self.num_workers, int)
            or isinstance(self.num_workers, bool)
            or self.num_workers < 1
        ):
            raise ValueError(
                f"ScalingConfig.num_workers={self.num_workers!r} is invalid: use an integer >= 1."
            )
        if self.use_tpu and self.use_gpu:
            raise ValueError(
                "ScalingConfig(use_tpu=True, use_gpu=True) is invalid: a worker uses either TPUs or GPUs; "
                "set only one of them."
            )
        if self.placement_strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(
                f"ScalingConfig.placement_strategy={self.placement_strategy!r} is invalid; "
                f"valid: {', '.join(PLACEMENT_STRATEGIES)}."
            )
        self._validate_resources()
        if self.use_tpu:
            self._validate_tpu()
        else:
            if self.topology is not None or self.num_slices not in (None, 1):
                raise ValueError(
                    f"ScalingConfig(topology={self.topology!r}, num_slices={self.num_slices!r}) needs "
                    "use_tpu=True: topology and num_slices only describe TPU slices."
                )
            if self.accelerator_type is not None and self.accelerator_type.upper().startswith("TPU"):
                raise ValueError(
                    f"ScalingConfig(accelerator_type={self.accelerator_type!r}) names a TPU but use_tpu=False; "
                    "set use_tpu=True and a topology."
                )

    def _validate_resources(self) -> None:
        res = self.resources_per_worker
        if res is None:
            return
        if not isinstance(res, dict):
            raise ValueError(
                f"ScalingConfig.resources_per_worker={res!r} is invalid: use a dict such as {{'TPU': 1}}."
            )
        for key, value in res.items():
            if not isinstance(key, str) or not _is_number(value) or value < 0:
                raise ValueError(
                    f"ScalingConfig.resources_per_worker[{key!r}]={value!r} is invalid: "
                    "keys are resource names, values are numbers >= 0."
                )
        if not self.use_tpu and res.get("TPU", 0) > 0:
            raise ValueError(
                f"ScalingConfig.resources_per_worker={res!r} requests TPU but use_tpu=False; "
                "set use_tpu=True (with topology and accelerator_type) or remove 'TPU'."
            )
        if not self.use_gpu and res.get("GPU", 0) > 0:
            raise ValueError(
                f"ScalingConfig.resources_per_worker={res!r} requests GPU but use_gpu=False; "
                "set use_gpu=True or remove 'GPU'."
            )

    def _validate_tpu(self) -> None:
        if not self.topology or not self.accelerator_type:
            raise ValueError(
                f"ScalingConfig(use_tpu=True) needs both topology and accelerator_type "
                f"(got topology={self.topology!r}, accelerator_type={self.accelerator_type!r}); "
                "for example topology='4x4', accelerator_type='TPU-V6E'."
            )
        from tpuray.topology import SliceTopology

        try:
            topo = SliceTopology.parse(self.accelerator_type, self.topology)
        except ValueError as exc:
            raise ValueError(
                f"ScalingConfig(accelerator_type={self.accelerator_type!r}, topology={self.topology!r}) "
                f"is not a valid TPU slice: {exc}"
            ) from exc

        tpus = self.tpus_per_worker
        if tpus != int(tpus) or int(tpus) not in VALID_TPUS_PER_WORKER:
            raise ValueError(
                f"ScalingConfig.resources_per_worker['TPU']={tpus!r} is invalid: a worker takes "
                f"{', '.join(map(str, VALID_TPUS_PER_WORKER))} TPU chips (dividing the host's "
                f"{topo.chips_per_host} chips)."
            )
        tpus = int(tpus)
        if topo.chips_per_host % tpus != 0:
            valid = [n for n in VALID_TPUS_PER_WORKER if topo.chips_per_host % n == 0]
            raise ValueError(
                f"ScalingConfig.resources_per_worker['TPU']={tpus} does not tile a {topo.generation.name} "
                f"{topo.topology} host of {topo.chips_per_host} chips; valid: {valid}."
            )
        per_slice = topo.num_chips // tpus
        if self.num_slices is not None:
            if (
                not isinstance(self.num_slices, int)
                or isinstance(self.num_slices, bool)
                or self.num_slices < 1
            ):
                raise ValueError(
                    f"ScalingConfig.num_slices={self.num_slices!r} is invalid: use an integer >= 1."
                )
            expected = per_slice * self.num_slices
            if self.num_workers != expected:
                raise ValueError(
                    f"ScalingConfig.num_workers={self.num_workers} does not fill {self.num_slices} "
                    f"{topo.generation.name} {topo.topology} slice(s): {topo.num_chips} chips / "
                    f"{tpus} TPU per worker = {per_slice} workers per slice, so use num_workers={expected}."
                )
        elif self.num_workers % per_slice != 0:
            raise ValueError(
                f"ScalingConfig.num_workers={self.num_workers} is not a multiple of the {per_slice} workers "
                f"a {topo.generation.name} {topo.topology} slice holds ({topo.num_chips} chips / {tpus} TPU "
                f"per worker); valid: {per_slice}, {2 * per_slice}, ..."
            )
        else:
            self.num_slices = self.num_workers // per_slice
        self._topology = topo

    @property
    def tpus_per_worker(self) -> float:
        if not self.use_tpu:
            return 0
        return (self.resources_per_worker or {}).get("TPU", 1)

    @property
    def slice_topology(self):
        """The parsed `tpuray.topology.SliceTopology` (TPU only)."""
        return getattr(self, "_topology", None)

    @property
    def workers_per_host(self) -> int:
        return self.slice_topology.chips_per_host // int(self.tpus_per_worker)

    def worker_resources(self) -> dict[str, float]:
        """Ray resources each worker actor requests (TPU workers take no CPU unless asked)."""
        res = dict(self.resources_per_worker or {})
        if self.use_tpu:
            res["TPU"] = int(self.tpus_per_worker)
            res.setdefault("CPU", 0)
        elif self.use_gpu:
            res.setdefault("GPU", 1)
            res.setdefault("CPU", 1)
        else:
            res.setdefault("CPU", 1)
        return {k: v for k, v in res.items() if v > 0 or k in ("CPU",)}

    @property
    def backend(self) -> str:
        return "tpu_dist" if self.use_tpu else "nccl" if self.use_gpu else "gloo"


@dataclass
class FailureConfig:
    """`max_failures`: how many times a worker/host death restarts the whole run (-1 = unlimited)."""

    max_failures: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.max_failures, int) or self.max_failures < -1:
            raise ValueError(
                f"FailureConfig.max_failures={self.max_failures!r} is invalid: use -1 (unlimited) or >= 0."
            )


@dataclass
class CheckpointConfig:
    """`num_to_keep`: keep only the latest N committed checkpoints (None keeps all)."""

    num_to_keep: int | None = None

    def __post_init__(self) -> None:
        if self.num_to_keep is not None and (not isinstance(self.num_to_keep, int) or self.num_to_keep < 1):
            raise ValueError(
                f"CheckpointConfig.num_to_keep={self.num_to_keep!r} is invalid: use None or >= 1."
            )


@dataclass
class RunConfig:
    """Where results go and how failures/progress are handled.

    storage_path: local directory (default ~/tpuray_results) or any fsspec URL (file://, s3://, gs://...)
    that every worker can write to. verbose: 0 = quiet, 1 = progress line (TPURAY_QUIET=1 forces 0).
    """

    name: str | None = None
    storage_path: str | None = None
    failure_config: FailureConfig | None = None
    checkpoint_config: CheckpointConfig | None = None
    verbose: int = 1

    def __post_init__(self) -> None:
        if self.name is not None and (not isinstance(self.name, str) or not self.name or "/" in self.name):
            raise ValueError(f"RunConfig.name={self.name!r} is invalid: use a non-empty name without '/'.")
        if self.storage_path is not None and not isinstance(self.storage_path, (str, os.PathLike)):
            raise ValueError(f"RunConfig.storage_path={self.storage_path!r} is invalid: use a path or URL.")
        if self.storage_path is not None:
            self.storage_path = os.fspath(self.storage_path)
            if self.storage_path.startswith("memory://"):
                raise ValueError(
                    f"RunConfig.storage_path={self.storage_path!r} is invalid: fsspec's memory:// lives in "
                    "one process and workers run in other processes; use a directory, file://, or a "
                    "shared object store URL (s3://, gs://)."
                )
        if self.verbose not in (0, 1, 2):
            raise ValueError(f"RunConfig.verbose={self.verbose!r} is invalid; valid: 0, 1, 2.")
        self.failure_config = self.failure_config or FailureConfig()
        self.checkpoint_config = self.checkpoint_config or CheckpointConfig()
        if self.name is None:
            self.name = f"TorchTrainer_{time.strftime('%Y-%m-%d_%H-%M-%S')}"
        if self.storage_path is None:
            self.storage_path = os.environ.get("TPURAY_STORAGE_PATH", DEFAULT_STORAGE_PATH)
        if "://" not in self.storage_path:
            self.storage_path = os.path.abspath(os.path.expanduser(self.storage_path))

    @property
    def quiet(self) -> bool:
        return self.verbose == 0 or os.environ.get("TPURAY_QUIET", "") not in ("", "0")


@dataclass
class TorchConfig:
    """torch.distributed setup: backend None picks tpu_dist / nccl / gloo from the ScalingConfig."""

    backend: str | None = None
    timeout_s: int = 1800
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.backend is not None and not isinstance(self.backend, str):
            raise ValueError(f"TorchConfig.backend={self.backend!r} is invalid: use a backend name or None.")
        if not isinstance(self.timeout_s, (int, float)) or self.timeout_s <= 0:
            raise ValueError(f"TorchConfig.timeout_s={self.timeout_s!r} is invalid: use seconds > 0.")
