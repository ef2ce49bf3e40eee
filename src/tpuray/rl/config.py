"""The configs of `tpuray.rl`, validated at construction: `RolloutConfig` (what a rollout engine runs and
where) and `RLConfig` (where an RL run's trainer and rollout engine run, how their phases interleave, how
weights travel and which failures restart a side: checked before anything is reserved)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from tpuray.serve.llm import model_source
from tpuray.serve.llm.config import LLMConfig, ModelLoadingConfig
from tpuray.validation import ConfigError

logger = logging.getLogger(__name__)

Transport = Literal["object_store", "tpu_dist"]  # RLConfig.weight_sync documents each
TRANSPORTS: tuple[str, ...] = get_args(Transport)
SleepLevel = Literal[1, 2]
"""How a rollout engine sleeps (vLLM's levels): 1, its weights copied to host memory first; 2, discarded
(the next update must replace them all before it generates again). Either way the KV cache is dropped."""
SLEEP_LEVELS: tuple[int, ...] = get_args(SleepLevel)

Placement = Literal["disaggregated", "colocated"]
PLACEMENTS: tuple[str, ...] = get_args(Placement)
ROLLOUT_ENGINES = ("auto", "vllm", "embedded")
_LLM_ENGINE = {"auto": "auto", "vllm": "vLLM", "embedded": "embedded"}  # serving's names
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class RolloutConfig:
    """A rollout engine over a local model directory (a Hugging Face checkpoint, e.g. one that
    `tpuray.models.build_tiny_causal_lm` wrote).

    Without `accelerator_type` the engine runs in this process on the CPU. With `accelerator_type` and
    `topology` (e.g. "TPU-V6E", "2x2") it reserves one slice atomically, like a serving replica, and runs
    one engine worker per `chips_per_worker` chips, tensor parallel over them (tensor_parallel_size =
    chips / chips_per_worker).

    `engine`: "vllm" (vLLM's engine, one worker per chip), "embedded" (tpuray's engine) or "auto": vLLM
    where it is installed and can run the model (serving's rule, `LLMConfig.choose_engine_for_model`)
    and is not vLLM-TorchTPU on a real TPU (there the embedded engine sleeps and decodes faster), else
    the embedded engine with a logged reason. `resolved_engine` says which runs."""

    model_source: str
    accelerator_type: str | None = None
    topology: str | None = None
    chips_per_worker: int = 1
    engine: Literal["auto", "vllm", "embedded"] = "auto"
    max_model_len: int = 512
    max_num_seqs: int = 16
    dtype: str = "auto"
    reservation_timeout_s: float = 120.0
    runtime_env: dict[str, Any] | None = None
    llm_config: LLMConfig = field(init=False, repr=False)
    resolved_engine: str = field(init=False, default="embedded")  # "vllm" | "embedded": what runs

    def __post_init__(self) -> None:
        self._check_values()
        # LLMConfig checks the slice (topology, chip share); the workers check that TP divides the heads
        self.llm_config = LLMConfig(
            model_loading_config=ModelLoadingConfig(model_id="rollout", model_source=self.model_source),
            llm_engine=_LLM_ENGINE[self._wanted_engine()],
            engine_kwargs={
                "max_model_len": self.max_model_len,
                "max_num_seqs": self.max_num_seqs,
                "dtype": self.dtype,
            },
            runtime_env=self.runtime_env,
            log_engine_metrics=False,
            **self._slice_kwargs(),
        )
        if self.llm_config.engine == "vLLM":  # "auto": vLLM only where it can run this model (logged)
            self.llm_config.choose_engine_for_model(self.model_config())
            self.llm_config.prefer_embedded_on_this_host(switch="engine='vllm'")
        self.resolved_engine = "vllm" if self.llm_config.engine == "vLLM" else "embedded"

    def _check_values(self) -> None:
        if self.engine not in ROLLOUT_ENGINES:
            raise ConfigError(f"engine={self.engine!r} is invalid; valid: {', '.join(ROLLOUT_ENGINES)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype={self.dtype!r} is invalid; valid: {', '.join(DTYPES)}")
        for name in ("max_model_len", "max_num_seqs", "chips_per_worker"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name}={value!r} is invalid; valid: an integer >= 1")
        if not isinstance(self.reservation_timeout_s, int | float) or self.reservation_timeout_s <= 0:
            raise ConfigError(f"reservation_timeout_s={self.reservation_timeout_s!r} is invalid; valid: > 0")
        if (self.accelerator_type is None) != (self.topology is None):
            raise ConfigError(
                f"accelerator_type={self.accelerator_type!r} and topology={self.topology!r}: give both "
                "(a TPU slice, e.g. 'TPU-V6E' and '2x2') or neither (in this process, on the CPU)"
            )
        if self.accelerator_type is None and self.chips_per_worker != 1:
            raise ConfigError(
                f"chips_per_worker={self.chips_per_worker} needs a slice (accelerator_type and topology); "
                "valid without one: 1"
            )

    def _slice_kwargs(self) -> dict[str, Any]:
        """LLMConfig's slice options: the slice and one worker per `chips_per_worker` chips (none: CPU)."""
        if self.accelerator_type is None:
            return {}
        return {
            "accelerator_type": self.accelerator_type,
            "accelerator_config": {"kind": "tpu", "topology": self.topology},
            "placement_group_config": {"bundle_per_worker": {"TPU": self.chips_per_worker}},
        }

    def _wanted_engine(self) -> str:
        """`engine`, except "auto" with chips_per_worker > 1: the embedded engine (logged)."""
        if self.engine == "auto" and self.chips_per_worker != 1:
            logger.warning(
                "RolloutConfig engine='auto': the embedded engine runs it, not vLLM (chips_per_worker=%d; "
                "vLLM runs one worker per chip)",
                self.chips_per_worker,
            )
            return "embedded"
        return self.engine

    def model_config(self) -> dict[str, Any]:
        """The model's config.json (Hugging Face), read from `model_source` resolved here."""
        path = Path(model_source.resolve(self.model_source))
        return json.loads((path / "config.json").read_text())

    @property
    def on_slice(self) -> bool:
        return self.llm_config.topology is not None

    @property
    def tensor_parallel_size(self) -> int:
        return self.llm_config.tensor_parallel_size


@dataclass
class RLConfig:
    """Where an RL run's trainer and rollout engine run, and how their phases interleave; validated at
    construction, before anything is reserved."""

    rollout: RolloutConfig
    """The rollout engine: model, slice (`accelerator_type`, `topology`) and tensor parallelism."""
    trainer: Any
    """The trainer's workers: a `tpuray.train.ScalingConfig` (TPU slices for `use_tpu=True`)."""
    placement: Placement = "disaggregated"
    """"disaggregated": trainer and rollout engine each on slices of their own (`trainer`'s and
    `rollout`'s), reserved for the whole run; the phases can overlap.
    "colocated": one slice, the trainer's, reserved once; the rollout engine (embedded or vLLM, tensor parallel
    over the trainer's ranks) runs inside the trainer's worker processes and the phases take turns on
    the same chips: generate, engine `sleep()` (its memory freed), train, weight sync into the sleeping
    engine, `wake_up()`. `rollout` then names no slice of its own (`tpuray.rl.rollout.hosted`, docs/rl.md)."""
    overlap: bool = False
    """Disaggregated only: generate batch k+1 (with the weights of step k-1) while the trainer trains on
    batch k, i.e. off-policy by one step; False is on-policy (generate, then train, then sync)."""
    weight_sync: Transport = "tpu_dist"
    """How the trainer's weights reach the rollout engine's workers; either way each rollout
    tensor-parallel rank gets only its part, no copy passes the driver, and a name or shape mismatch is
    refused before anything is overwritten.
    "tpu_dist" (the default: 1.6x-3.4x faster per sync than "object_store" in benchmarks/bench_rl.py,
    docs/rl.md): a torch.distributed process group. Disaggregated, it spans the trainer's and the
    engine's workers (TCPStore rendezvous on the driver) and moves host buffers, so it is a gloo group
    on every host (TorchTPU's "tpu_dist" takes only tensors on the chip; the emulated one is gloo
    underneath: `tpuray.rl.sync.collective`); only the pieces' metadata passes the driver, the trainer ranks
    send every rollout rank the rows of its part they hold, point to point at once, and each rollout
    rank checks what it received before staging it
    (`tpuray.rl.sync.collective`); with a vLLM rollout engine each vLLM worker joins the group and receives
    only its part, cut in vLLM's layout. Colocated, it is the trainer's own group: the ranks gather each
    tensor where it lives (on the chips) and each leaves its engine rank's part in its own process
    (`tpuray.rl.sync.handover`; nothing crosses the host link, no object is put): the embedded engine takes
    its fused shards without a copy, vLLM's worker joins its part as it joins received pieces. The update
    then lives only in its sender's process, so a restarted trainer must send its restored weights again
    (docs/rl.md "Colocated restarts").
    "object_store": every trainer rank `ray.put`s one object per rollout rank (colocated: the mailbox
    owns them, so an update outlives a lost trainer worker), only the ObjectRefs pass the driver, and
    each rollout rank pulls its objects and checks them (no process group between the two sides: use it
    where the slices cannot reach each other's TCP ports)."""
    sync_timeout_s: float = 600.0
    """How long a trainer rank waits for a batch or for the engine to take its weights."""
    rollout_max_failures: int = 0
    """How many times a failed rollout engine (a dead rollout worker or host: `RolloutEngineError`) is
    replaced before the run ends: 0 (the default) never, -1 without limit. The run then shuts the engine
    down (its slice released), reserves a new one from `rollout`, loads the last update the old one had
    and calls the failed `rollout_fn` (or loads the failed update) again; `RLResult.rollout_restarts`
    counts them. Over "object_store" the new engine loads the last update from the ObjectRefs the driver
    holds; over "tpu_dist" the new engine's workers form a new group with the trainer's ranks, and each
    rank sends its last update again into it (also one whose transfer the failure interrupted).
    Disaggregated only (colocated, a rollout worker is a trainer worker: the trainer's FailureConfig
    applies)."""
    sleep_level: SleepLevel = 1
    """Colocated with the embedded engine only: how the engine sleeps while the trainer trains (its
    `sleep(level)`). 1 (the default): its weights are copied to host memory first, so an update the engine
    refuses leaves it the old ones. 2: its weights are discarded, not copied (the trainer's next update,
    taken while it sleeps, replaces them all before it wakes up): on a TPU this saves the device-to-host
    copy of the whole model each iteration (seconds for a 1B model on a TPU v5e VM's host link:
    benchmarks/README.md), but after a refused update the engine has no weights, and its next wake-up
    raises."""
    trainer_world_size: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        from tpuray.train import ScalingConfig

        if not isinstance(self.rollout, RolloutConfig):
            raise ConfigError(f"RLConfig.rollout must be a tpuray.rl.RolloutConfig, got {self.rollout!r}")
        if not isinstance(self.trainer, ScalingConfig):
            raise ConfigError(f"RLConfig.trainer must be a tpuray.train.ScalingConfig, got {self.trainer!r}")
        if self.placement not in PLACEMENTS:
            raise ConfigError(
                f"RLConfig.placement={self.placement!r} is invalid; valid: {', '.join(PLACEMENTS)}"
            )
        if not isinstance(self.overlap, bool):
            raise ConfigError(f"RLConfig.overlap={self.overlap!r} is invalid; valid: True, False")
        if self.weight_sync not in TRANSPORTS:
            raise ConfigError(
                f"RLConfig.weight_sync={self.weight_sync!r} is invalid; valid: {', '.join(TRANSPORTS)}"
            )
        if not isinstance(self.sync_timeout_s, int | float) or self.sync_timeout_s <= 0:
            raise ConfigError(f"RLConfig.sync_timeout_s={self.sync_timeout_s!r} is invalid; valid: > 0")
        self._check_rollout_failures()
        self._check_sleep_level()
        self.trainer_world_size = self.trainer.num_workers
        if self.placement == "colocated":
            self._check_colocated()
        else:
            self._check_disaggregated()

    def _check_rollout_failures(self) -> None:
        n = self.rollout_max_failures
        if isinstance(n, bool) or not isinstance(n, int) or n < -1:
            raise ConfigError(f"RLConfig.rollout_max_failures={n!r} is invalid; valid: an integer >= -1")
        if n == 0:
            return
        if self.placement == "colocated":
            raise ConfigError(
                f"RLConfig.rollout_max_failures={n} is invalid with placement='colocated': the engine's "
                "workers are the trainer's (FailureConfig(max_failures) governs them); valid: 0"
            )

    def _check_sleep_level(self) -> None:
        level = self.sleep_level
        if isinstance(level, bool) or level not in SLEEP_LEVELS:
            raise ConfigError(f"RLConfig.sleep_level={level!r} is invalid; valid: 1, 2")
        if level == 2 and self.placement != "colocated":
            raise ConfigError(
                "RLConfig.sleep_level=2 is invalid with placement='disaggregated': the engine never sleeps "
                "there; valid: 1, or placement='colocated'"
            )
        if level == 2 and self.rollout.resolved_engine == "vllm":
            raise ConfigError(
                "RLConfig.sleep_level=2 is invalid with a vLLM rollout engine: colocated vLLM takes its "
                "updates while asleep at level 1 only (on vLLM's CPU backend its weights stay in host "
                "memory either way); valid: 1, or RolloutConfig(engine='embedded')"
            )

    def _check_disaggregated(self) -> None:
        if not self.rollout.on_slice or not self.trainer.use_tpu:
            raise ConfigError(
                f"RLConfig.placement='disaggregated' puts the trainer and the rollout engine on slices of "
                f"their own: RolloutConfig(accelerator_type={self.rollout.accelerator_type!r}, "
                f"topology={self.rollout.topology!r}) and ScalingConfig(use_tpu={self.trainer.use_tpu!r}) "
                "must both name a TPU slice"
            )

    def _check_colocated(self) -> None:
        rollout, trainer = self.rollout, self.trainer
        if self.overlap:
            raise ConfigError(
                "RLConfig.overlap=True is invalid with placement='colocated' (the engine and the trainer "
                "take turns on the same chips: nothing can overlap); valid: overlap=False, or "
                "placement='disaggregated'"
            )
        if rollout.on_slice:
            raise ConfigError(
                f"RLConfig.placement='colocated' runs the rollout engine on the trainer's slice: "
                f"RolloutConfig(accelerator_type={rollout.accelerator_type!r}, topology={rollout.topology!r}) "
                "must be None (the engine's tensor parallelism is the trainer's ranks)"
            )
        if not trainer.use_tpu or (trainer.num_slices or 1) != 1:
            raise ConfigError(
                f"RLConfig.placement='colocated' needs one TPU slice for the trainer: "
                f"ScalingConfig(use_tpu={trainer.use_tpu!r}, num_slices={trainer.num_slices!r}); "
                "valid: use_tpu=True on one slice"
            )

    @property
    def rollout_tensor_parallel_size(self) -> int:
        """The rollout engine's ranks: its own slice's (disaggregated) or the trainer's (colocated)."""
        if self.placement == "colocated":
            return self.trainer_world_size
        return self.rollout.tensor_parallel_size
