"""Serving configs, mirroring `ray.serve.llm` (LLMConfig, ModelLoadingConfig, LLMServingArgs).

Everything is validated in `__post_init__` (pure Python: no torch, no ray), so a bad topology, an unknown
accelerator kind or a tensor_parallel_size that does not match the reserved chips fails *before* any
placement group is reserved. The seed's dicts are accepted as-is.

Nothing in engine_kwargs is dropped silently: a kwarg is one the embedded engine honours
(EMBEDDED_ENGINE_KWARGS), or accepted with a logged note saying why it does not apply (IGNORED_ENGINE_KWARGS,
or a generic note for other vLLM options); what vLLM makes of them: engine/vllm/args.py.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tpuray.constants import API_KEY_ENV
from tpuray.validation import ConfigError, check_choice, check_positive_int

if TYPE_CHECKING:
    from tpuray.topology import SliceTopology

logger = logging.getLogger(__name__)

ENGINES = ("auto", "embedded", "vLLM")
TASKS = ("generate", "embed")
DTYPES = ("auto", "float32", "bfloat16", "float16")

# engine_kwargs the embedded engine uses; anything else is passed to vLLM when vLLM runs the model.
EMBEDDED_ENGINE_KWARGS = {
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "max_model_len",
    "max_num_seqs",
    "dtype",
    "seed",
    "task",
    "async_scheduling",  # launch a greedy step before the previous one is read back (pipeline.py)
}
# vLLM options that are harmless to ignore in the embedded engine (a note is logged).
IGNORED_ENGINE_KWARGS = {
    "enable_expert_parallel": "the embedded engine serves dense models; there are no experts to shard",
    "gpu_memory_utilization": "the embedded engine sizes its KV cache from max_num_seqs x max_model_len",
    "enforce_eager": "the embedded engine always runs eagerly",
    "trust_remote_code": "only local Llama-style checkpoints are loaded",
    "enable_prefix_caching": "prefix caching is not implemented in the embedded engine",
    "enable_chunked_prefill": "prefill runs whole prompts per step",
    "max_num_batched_tokens": "batches are bounded by max_num_seqs",
    "distributed_executor_backend": "the embedded engine always uses Ray actors, one per chip",
    "tokenizer_mode": "the model directory's tokenizer is used",
}


@dataclass
class ModelLoadingConfig:
    """Which model to serve: `model_id` is the public name; `model_source` a local directory, a Hugging
    Face Hub id or a URL (gs://, s3://, file://; see tpuray.serve.llm.model_source); None: model_id is
    the Hub id."""

    model_id: str
    model_source: str | None = None
    tokenizer_source: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id.strip():
            raise ConfigError(f"model_id must be a non-empty string, got {self.model_id!r}")
        for name in ("model_source", "tokenizer_source"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ConfigError(f"{name} must be a path, Hub id or URL string, got {value!r}")
            if value is not None:
                setattr(self, name, str(value))


def _as_model_loading_config(value: Any) -> ModelLoadingConfig:
    if isinstance(value, ModelLoadingConfig):
        return value
    if isinstance(value, dict):
        return ModelLoadingConfig(**value)
    raise ConfigError(f"model_loading_config must be a ModelLoadingConfig or dict, got {value!r}")


@dataclass
class LLMConfig:
    """One served model. Same field names as `ray.serve.llm.LLMConfig`."""

    model_loading_config: ModelLoadingConfig  # a dict is converted
    llm_engine: str = "auto"
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    accelerator_type: str | None = None
    accelerator_config: dict[str, Any] | None = None
    placement_group_config: dict[str, Any] | None = None
    deployment_config: dict[str, Any] = field(default_factory=dict)
    runtime_env: dict[str, Any] | None = None
    log_engine_metrics: bool = True  # engine metrics on /metrics (as Ray Serve LLM's default)
    # Derived at construction (the user's dicts are copied, never rewritten):
    topology: SliceTopology | None = field(init=False, default=None, repr=False)  # None: no TPU slice
    chips_per_worker: int = field(init=False, default=1, repr=False)
    tensor_parallel_size: int = field(init=False, default=1, repr=False)
    engine: str = field(init=False, default="embedded", repr=False)  # "vLLM" | "embedded", resolved here

    def __post_init__(self) -> None:
        self.model_loading_config = _as_model_loading_config(self.model_loading_config)
        check_choice("llm_engine", self.llm_engine, ENGINES)
        if not isinstance(self.engine_kwargs, dict):
            raise ConfigError(f"engine_kwargs must be a dict, got {self.engine_kwargs!r}")
        self.engine_kwargs = dict(self.engine_kwargs)
        self.deployment_config = dict(self.deployment_config or {})
        if self.placement_group_config is not None:
            self.placement_group_config = dict(self.placement_group_config)
        if not isinstance(self.log_engine_metrics, bool):
            raise ConfigError(f"log_engine_metrics={self.log_engine_metrics!r} is invalid: use true or false")
        self._validate_accelerator()
        self._validate_engine_kwargs()
        self.engine = self._resolve_engine()
        if self.engine == "embedded":
            self._validate_embedded_kwargs()  # the embedded engine runs it: its own limits apply
        if self.engine == "vLLM" and self.chips_per_worker != 1:
            raise ConfigError(
                f"bundle_per_worker TPU={self.chips_per_worker} is not supported with vLLM: its Ray executor "
                "runs one worker per chip; valid: 1"
            )

    def _resolve_engine(self) -> str:
        """llm_engine "auto" is vLLM where it is installed, else the embedded engine; embedding models
        (task "embed") always run in tpuray's embedding model. A vLLM install that cannot load next to this
        torch (vllm_install_problem) is an error for "vLLM" and "auto" alike, naming the fix."""
        if self.task == "embed" or self.llm_engine == "embedded":
            return "embedded"
        from tpuray.serve.llm.engine.vllm import vllm_available, vllm_install_problem

        if self.llm_engine == "auto" and not vllm_available():
            return "embedded"
        problem = vllm_install_problem()
        if problem:
            raise ConfigError(f"llm_engine={self.llm_engine!r}: {problem}")
        return "vLLM"

    # -- validation ------------------------------------------------------------------------------------
    def _validate_accelerator(self) -> None:
        """accelerator_type, accelerator_config and placement_group_config: a TPU slice's topology and the
        chips of each worker, or None for CPU."""
        self._check_accelerator_type()
        acc = self.accelerator_config
        if acc is None:
            if self.accelerator_type is not None:
                raise ConfigError(
                    f"accelerator_type={self.accelerator_type!r} needs accelerator_config="
                    "{'kind': 'tpu', 'topology': '<shape, e.g. 2x2 or 4x4>'}"
                )
            return
        self.topology = self._slice_topology(acc)
        self.chips_per_worker = self._chips_per_worker(self.topology)

    def _check_accelerator_type(self) -> None:
        if self.accelerator_type is None:
            return
        from tpuray.topology import get_generation

        if not isinstance(self.accelerator_type, str) or not self.accelerator_type.upper().startswith("TPU"):
            raise ConfigError(
                f"accelerator_type={self.accelerator_type!r} is not supported by tpuray.serve.llm; "
                "valid: a TPU type such as 'TPU-V6E', 'TPU-V5LITEPOD', 'TPU-V5P', 'TPU-V4', 'TPU-V7X', "
                "or None for CPU"
            )
        get_generation(self.accelerator_type)  # ValueError names the bad value and the valid ones

    def _slice_topology(self, acc: Any) -> SliceTopology:
        """The slice accelerator_config names (on accelerator_type)."""
        from tpuray.topology import SliceTopology

        if not isinstance(acc, dict):
            raise ConfigError(
                f"accelerator_config must be a dict like {{'kind': 'tpu', 'topology': '4x4'}}, got {acc!r}"
            )
        kind = acc.get("kind")
        if kind != "tpu":
            raise ConfigError(f"accelerator_config kind={kind!r} is not supported; valid: 'tpu'")
        unknown = set(acc) - {"kind", "topology"}
        if unknown:
            raise ConfigError(f"unknown accelerator_config keys {sorted(unknown)}; valid: 'kind', 'topology'")
        if self.accelerator_type is None:
            raise ConfigError("accelerator_config kind='tpu' needs accelerator_type, e.g. 'TPU-V6E'")
        if "topology" not in acc:
            raise ConfigError("accelerator_config needs 'topology', e.g. '2x2' or '4x4'")
        return SliceTopology.parse(self.accelerator_type, acc["topology"])

    def _chips_per_worker(self, topology: SliceTopology) -> int:
        """placement_group_config's chips per worker: a share of a host of `topology`."""
        pgc = self.placement_group_config or {"bundle_per_worker": {"TPU": 1}}
        if not isinstance(pgc, dict) or not isinstance(pgc.get("bundle_per_worker", {}), dict):
            raise ConfigError(
                f"placement_group_config must look like {{'bundle_per_worker': {{'TPU': 1}}}}, got {pgc!r}"
            )
        unknown = set(pgc) - {"bundle_per_worker"}
        if unknown:
            raise ConfigError(
                f"unknown placement_group_config keys {sorted(unknown)}; valid: 'bundle_per_worker'"
            )
        chips = pgc.get("bundle_per_worker", {"TPU": 1}).get("TPU", 1)
        shares = topology.process_shares()
        if not isinstance(chips, int) or isinstance(chips, bool) or chips not in shares:
            raise ConfigError(
                f"bundle_per_worker TPU={chips!r} is not valid on a {topology.chips_per_host}-chip "
                f"{topology.generation.name} host; valid: {', '.join(map(str, shares))}"
            )
        return chips

    def _validate_engine_kwargs(self) -> None:
        kw = self.engine_kwargs
        chips = self.num_workers
        pp = check_positive_int("pipeline_parallel_size", kw.get("pipeline_parallel_size", 1))
        tp = check_positive_int("tensor_parallel_size", kw.get("tensor_parallel_size", chips // pp))
        if tp * pp != chips:
            where = (
                f"{self.topology.topology} {self.topology.generation.name} slice reserves "
                f"{self.topology.num_chips} chips / {self.chips_per_worker} per worker = {chips} workers"
                if self.topology
                else "no accelerator_config means one CPU worker"
            )
            pp_text = f" x pipeline_parallel_size={pp}" if pp != 1 else ""
            raise ConfigError(
                f"tensor_parallel_size={tp}{pp_text} must equal the workers per replica: {where}; valid: {chips}"
            )
        self.tensor_parallel_size = tp
        if kw.get("max_model_len") is not None:
            check_positive_int("max_model_len", kw["max_model_len"])
        check_positive_int("max_num_seqs", kw.get("max_num_seqs", 1))
        check_choice("task", kw.get("task", "generate"), TASKS)
        if kw.get("async_scheduling") is not None and not isinstance(kw["async_scheduling"], bool):
            raise ConfigError(
                f"async_scheduling={kw['async_scheduling']!r} is not valid; valid: True, False, None (on)"
            )

    def _validate_embedded_kwargs(self) -> None:
        kw = self.engine_kwargs
        pp = kw.get("pipeline_parallel_size", 1)
        if pp != 1:
            raise ConfigError(
                f"pipeline_parallel_size={pp!r} is not supported by the embedded engine; valid: 1 "
                "(use llm_engine='vLLM' for pipeline parallelism)"
            )
        check_choice("dtype", kw.get("dtype", "auto"), DTYPES)
        for key in sorted(set(kw) - EMBEDDED_ENGINE_KWARGS):
            reason = IGNORED_ENGINE_KWARGS.get(key, "not used by the embedded engine (vLLM would use it)")
            logger.info("engine_kwargs %s=%r accepted and ignored: %s", key, kw[key], reason)

    # -- derived ---------------------------------------------------------------------------------------
    @property
    def model_id(self) -> str:
        return self.model_loading_config.model_id

    @property
    def num_workers(self) -> int:
        """Engine workers per replica: one per `bundle_per_worker` share of the slice's chips."""
        if self.topology is None:
            return 1
        return self.topology.num_chips // self.chips_per_worker

    @property
    def task(self) -> str:
        return self.engine_kwargs.get("task", "generate")

    @property
    def min_replicas(self) -> int:
        """The fewest replicas Serve keeps for this model: `deployment_config`'s num_replicas (default 1),
        or, autoscaled (an autoscaling_config, or num_replicas "auto"), its min_replicas (default 1)."""
        dc = self.deployment_config
        auto = dc.get("autoscaling_config")
        if auto is None and dc.get("num_replicas") != "auto":
            return int(dc.get("num_replicas", 1))
        least = auto.get("min_replicas") if isinstance(auto, dict) else getattr(auto, "min_replicas", None)
        return int(1 if least is None else least)

    @property
    def model_source(self) -> str:
        """Where the weights come from: model_source, else model_id (a Hub id, as in Ray Serve LLM)."""
        return self.model_loading_config.model_source or self.model_id

    def check_model_source(self) -> None:
        """The model can be loaded (local directory, Hub id or URL: see model_source.py) and fits this
        config (tensor_parallel_size divides its heads, max_model_len within its positions); a
        tokenizer_source is checked the same way (for a tokenizer's files). Reads only config.json."""
        from tpuray.serve.llm import model_source

        model_source.check(self.model_source, f"model {self.model_id!r}: model_source")
        tokenizer = self.model_loading_config.tokenizer_source
        if tokenizer:
            what = f"model {self.model_id!r}: tokenizer_source"
            model_source.check(tokenizer, what, model_source.TOKENIZER_FILES)
        if self.task != "generate":
            return
        cfg = model_source.read_config(self.model_source)
        heads: int = cfg.get("num_attention_heads") or 0
        kv_heads: int = cfg.get("num_key_value_heads") or heads
        tp = self.tensor_parallel_size
        if heads and (heads % tp or kv_heads % tp):
            valid = [d for d in range(1, heads + 1) if heads % d == 0 and kv_heads % d == 0]
            raise ConfigError(
                f"tensor_parallel_size={tp} must divide num_attention_heads={heads} and "
                f"num_key_value_heads={kv_heads} of {self.model_id!r}; valid: {valid}"
            )
        limit = cfg.get("max_position_embeddings")
        mml = self.engine_kwargs.get("max_model_len")
        if mml and limit and mml > limit:
            raise ConfigError(
                f"max_model_len={mml} exceeds the model's max_position_embeddings={limit}; valid: 1..{limit}"
            )
        self.choose_engine_for_model(cfg)
        if self.engine == "vLLM":
            from tpuray.serve.llm.engine.vllm.args import split_engine_kwargs

            split_engine_kwargs(self)  # ConfigError names an engine_kwargs key vLLM does not know

    def choose_engine_for_model(self, model_config: dict[str, Any]) -> None:
        """vLLM serves the model only where its attention backend can run it (engine/vllm/support.py).
        Under llm_engine "auto" a model it cannot run goes to the embedded engine, with a warning saying
        why; with llm_engine "vLLM" that is a ConfigError naming the model's property and what vLLM
        supports. `model_config`: the model's config.json."""
        if self.engine != "vLLM" or self.task != "generate":
            return
        from tpuray.serve.llm.engine.vllm.support import model_problem

        problem = model_problem(model_config)
        if problem is None:
            return
        if self.llm_engine == "vLLM":
            raise ConfigError(
                f"llm_engine='vLLM' cannot serve model {self.model_id!r}: {problem}. Use a model with a "
                "supported head size, or llm_engine='embedded' (or 'auto')"
            )
        self.serve_with_embedded(problem)

    def prefer_embedded_on_this_host(self, switch: str = "llm_engine='vLLM'") -> None:
        """llm_engine "auto" where this process's vLLM is vLLM-TorchTPU (a real TPU): the embedded engine,
        with a warning saying why (engine/vllm/support.py `auto_prefers_embedded`; `switch` names the
        setting that selects vLLM anyway). Decided where the engine's host is known: the serving replica,
        or the process that builds a RolloutConfig."""
        if self.engine != "vLLM" or self.llm_engine != "auto":
            return
        from tpuray.serve.llm.engine.vllm.support import auto_prefers_embedded

        reason = auto_prefers_embedded(switch)
        if reason:
            self.serve_with_embedded(reason)

    def serve_with_embedded(self, problem: str) -> None:
        """llm_engine "auto" when vLLM cannot serve the model (`problem` says why): the embedded engine
        serves it, with a warning saying why, if it can take this config (else a ConfigError naming both)."""
        try:
            self._validate_embedded_kwargs()
        except ConfigError as e:
            raise ConfigError(
                f"llm_engine='auto': vLLM cannot serve model {self.model_id!r} ({problem}), and the embedded "
                f"engine cannot take this config: {e}"
            ) from None
        logger.warning(
            "model %r: llm_engine='auto' serves it with the embedded engine, not vLLM: %s",
            self.model_id,
            problem,
        )
        self.engine = "embedded"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LLMConfig:
        known = {f.name for f in fields(cls) if f.init}
        unknown = set(data) - known
        if unknown:
            raise ConfigError(f"unknown LLMConfig fields {sorted(unknown)}; valid: {sorted(known)}")
        return cls(**data)


def _as_llm_config(value: Any) -> LLMConfig:
    if isinstance(value, LLMConfig):
        return value
    if isinstance(value, dict):
        return LLMConfig.from_dict(value)
    if isinstance(value, (str, os.PathLike)):
        import yaml

        return LLMConfig.from_dict(yaml.safe_load(Path(value).read_text()))
    raise ConfigError(f"llm_configs entries must be LLMConfig, dict or a YAML path, got {value!r}")


@dataclass
class LLMServingArgs:
    """The OpenAI app: its models, the ingress deployment options and an optional API key.

    `api_key` (or env TPURAY_SERVE_API_KEY) makes every /v1 request, /tokenize and /detokenize need
    `Authorization: Bearer <key>` (/health and /metrics stay open).

    `single_deployment`: None (default) serves a one-model app as ONE deployment, the OpenAI routes and
    the engine in the same replica (one Serve hop fewer per request); several models, or an
    `ingress_deployment_config`, get an `LLMRouter` ingress in front of one `LLMServer` deployment per
    model (as Ray Serve LLM does). True or False forces the choice; None is resolved to one of them at
    construction.
    """

    llm_configs: list[LLMConfig]  # dicts and YAML paths are converted
    ingress_deployment_config: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    single_deployment: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.llm_configs, (list, tuple)) or not self.llm_configs:
            raise ConfigError(f"llm_configs must be a non-empty list of LLMConfig, got {self.llm_configs!r}")
        self.llm_configs = [_as_llm_config(c) for c in self.llm_configs]
        ids = [c.model_id for c in self.llm_configs]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ConfigError(f"model_id values must be unique; duplicated: {dupes}")
        if self.api_key is None:
            self.api_key = os.environ.get(API_KEY_ENV) or None
        if self.single_deployment not in (None, True, False):
            raise ConfigError(
                f"single_deployment must be true, false or null, got {self.single_deployment!r}"
            )
        if self.single_deployment and (len(self.llm_configs) != 1 or self.ingress_deployment_config):
            raise ConfigError(
                f"single_deployment=True needs exactly one model and no ingress_deployment_config; got "
                f"{len(self.llm_configs)} model(s) and ingress_deployment_config="
                f"{self.ingress_deployment_config!r}"
            )
        if self.single_deployment is None:  # ingress and engine in the same replica when nothing asks apart
            self.single_deployment = len(self.llm_configs) == 1 and not self.ingress_deployment_config
