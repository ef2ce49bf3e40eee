"""`ScalingConfig`: how many workers to start and on what hardware (re-exported by `tpuray.train.config`;
kept apart so that `tpuray.train.callbacks`, whose `RunInfo` names it, does not import the config module,
which validates callbacks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tpuray.constants import PLACEMENT_STRATEGIES, TPU_RESOURCE
from tpuray.validation import ConfigError, check_choice, check_positive_int, is_number

if TYPE_CHECKING:
    from tpuray.topology import SliceTopology


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
    # Derived at construction (TPU only): the parsed slice shape.
    slice_topology: SliceTopology | None = field(init=False, default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_positive_int("ScalingConfig.num_workers", self.num_workers)
        if self.use_tpu and self.use_gpu:
            raise ConfigError(
                "ScalingConfig(use_tpu=True, use_gpu=True) is invalid: a worker uses either TPUs or GPUs; "
                "set only one of them."
            )
        check_choice("ScalingConfig.placement_strategy", self.placement_strategy, PLACEMENT_STRATEGIES)
        self._validate_resources()
        if self.use_tpu:
            self._validate_tpu()
        else:
            if self.topology is not None or self.num_slices not in (None, 1):
                raise ConfigError(
                    f"ScalingConfig(topology={self.topology!r}, num_slices={self.num_slices!r}) needs "
                    "use_tpu=True: topology and num_slices only describe TPU slices."
                )
            if self.accelerator_type is not None and self.accelerator_type.upper().startswith("TPU"):
                raise ConfigError(
                    f"ScalingConfig(accelerator_type={self.accelerator_type!r}) names a TPU but use_tpu=False; "
                    "set use_tpu=True and a topology."
                )

    def _validate_resources(self) -> None:
        res = self.resources_per_worker
        if res is None:
            return
        if not isinstance(res, dict):
            raise ConfigError(
                f"ScalingConfig.resources_per_worker={res!r} is invalid: use a dict such as {{'TPU': 1}}."
            )
        for key, value in res.items():
            if not isinstance(key, str) or not is_number(value) or value < 0:
                raise ConfigError(
                    f"ScalingConfig.resources_per_worker[{key!r}]={value!r} is invalid: "
                    "keys are resource names, values are numbers >= 0."
                )
        if not self.use_tpu and res.get("TPU", 0) > 0:
            raise ConfigError(
                f"ScalingConfig.resources_per_worker={res!r} requests TPU but use_tpu=False; "
                "set use_tpu=True (with topology and accelerator_type) or remove 'TPU'."
            )
        if not self.use_gpu and res.get("GPU", 0) > 0:
            raise ConfigError(
                f"ScalingConfig.resources_per_worker={res!r} requests GPU but use_gpu=False; "
                "set use_gpu=True or remove 'GPU'."
            )

    def _validate_tpu(self) -> None:
        if not self.topology or not self.accelerator_type:
            raise ConfigError(
                f"ScalingConfig(use_tpu=True) needs both topology and accelerator_type "
                f"(got topology={self.topology!r}, accelerator_type={self.accelerator_type!r}); "
                "for example topology='4x4', accelerator_type='TPU-V6E'."
            )
        from tpuray.topology import SliceTopology

        try:
            topo = SliceTopology.parse(self.accelerator_type, self.topology)
        except ValueError as exc:
            raise ConfigError(
                f"ScalingConfig(accelerator_type={self.accelerator_type!r}, topology={self.topology!r}) "
                f"is not a valid TPU slice: {exc}"
            ) from exc

        tpus = self.tpus_per_worker
        if tpus != int(tpus) or int(tpus) not in topo.process_shares():
            valid = ", ".join(map(str, topo.process_shares()))
            raise ConfigError(
                f"ScalingConfig.resources_per_worker['TPU']={tpus!r} is invalid: a worker on a "
                f"{topo.generation.name} {topo.topology} host of {topo.chips_per_host} chips takes a chip "
                f"share that tiles the host; valid: {valid}."
            )
        tpus = int(tpus)
        per_slice = topo.num_chips // tpus
        if self.num_slices is not None:
            check_positive_int("ScalingConfig.num_slices", self.num_slices)
            expected = per_slice * self.num_slices
            if self.num_workers != expected:
                raise ConfigError(
                    f"ScalingConfig.num_workers={self.num_workers} does not fill {self.num_slices} "
                    f"{topo.generation.name} {topo.topology} slice(s): {topo.num_chips} chips / "
                    f"{tpus} TPU per worker = {per_slice} workers per slice, so use num_workers={expected}."
                )
        elif self.num_workers % per_slice != 0:
            raise ConfigError(
                f"ScalingConfig.num_workers={self.num_workers} is not a multiple of the {per_slice} workers "
                f"a {topo.generation.name} {topo.topology} slice holds ({topo.num_chips} chips / {tpus} TPU "
                f"per worker); valid: {per_slice}, {2 * per_slice}, ..."
            )
        else:
            self.num_slices = self.num_workers // per_slice
        self.slice_topology = topo

    @property
    def tpus_per_worker(self) -> float:
        if not self.use_tpu:
            return 0
        return (self.resources_per_worker or {}).get(TPU_RESOURCE, 1)

    @property
    def workers_per_host(self) -> int:
        if self.slice_topology is None:
            raise ValueError("workers_per_host is defined for TPU slices only (use_tpu=True)")
        return self.slice_topology.chips_per_host // int(self.tpus_per_worker)

    def worker_resources(self) -> dict[str, float]:
        """Ray resources each worker actor requests (TPU workers take no CPU unless asked)."""
        res = dict(self.resources_per_worker or {})
        if self.use_tpu:
            res[TPU_RESOURCE] = int(self.tpus_per_worker)
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
