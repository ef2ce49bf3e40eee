"""`RolloutConfig`: what a `RolloutEngine` runs and where, validated at construction."""

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
    where it is installed and can run the model (serving's rule, `LLMConfig.choose_engine_for_model`),
    else the embedded engine with a logged reason. `resolved_engine` says which runs."""

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
        slice_kwargs: dict[str, Any] = {}
        if self.accelerator_type is not None:
            slice_kwargs = {
                "accelerator_type": self.accelerator_type,
                "accelerator_config": {"kind": "tpu", "topology": self.topology},
                "placement_group_config": {"bundle_per_worker": {"TPU": self.chips_per_worker}},
            }
        elif self.chips_per_worker != 1:
            raise ConfigError(
                f"chips_per_worker={self.chips_per_worker} needs a slice (accelerator_type and topology); "
                "valid without one: 1"
            )
        # LLMConfig checks the slice (topology, chip share); the workers check that TP divides the heads
        engine = self.engine
        if engine == "auto" and self.chips_per_worker != 1:
            logger.warning(
                "RolloutConfig engine='auto': the embedded engine runs it, not vLLM (chips_per_worker=%d; "
                "vLLM runs one worker per chip)",
                self.chips_per_worker,
            )
            engine = "embedded"
        self.llm_config = LLMConfig(
            model_loading_config=ModelLoadingConfig(model_id="rollout", model_source=self.model_source),
            llm_engine=_LLM_ENGINE[engine],
            engine_kwargs={
                "max_model_len": self.max_model_len,
                "max_num_seqs": self.max_num_seqs,
                "dtype": self.dtype,
            },
            runtime_env=self.runtime_env,
            log_engine_metrics=False,
            **slice_kwargs,
        )
        if self.llm_config.engine == "vLLM":  # "auto": vLLM only where it can run this model (logged)
            self.llm_config.choose_engine_for_model(self.model_config())
        self.resolved_engine = "vllm" if self.llm_config.engine == "vLLM" else "embedded"

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
