"""Prometheus metrics of the OpenAI app: `GET /metrics` in Prometheus' text format.

- HTTP requests by handler, method and status (`http_requests_total`, the name vLLM's server exports);
- the embedded engine's metrics under vLLM's names, so existing vLLM dashboards work:
  `vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` (KV slots in use),
  `vllm:prompt_tokens_total`, `vllm:generation_tokens_total`, `vllm:request_success_total{finished_reason}`,
  `vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`,
  `vllm:e2e_request_latency_seconds` (histograms), each labelled `model_name`;
- a vLLM engine's own metrics (vLLM registers them in prometheus_client's default registry).

Engine metrics are recorded when `LLMConfig.log_engine_metrics` is true (the default, as in Ray Serve
LLM). Each replica process exposes its own metrics; the router merges its process's exposition with
that of each model deployment it forwards to (one replica per deployment answers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import cache
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

TPURAY_REGISTRY = CollectorRegistry()  # ours, apart from vLLM's (same metric names, other processes)
LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
)


@cache
def _metrics() -> dict[str, Any]:
    r, m = TPURAY_REGISTRY, ["model_name"]
    return {
        "http": Counter(
            "http_requests",
            "HTTP requests by handler, method and status",
            ["handler", "method", "status"],
            registry=r,
        ),
        "running": Gauge("vllm:num_requests_running", "Requests in the running batch", m, registry=r),
        "waiting": Gauge("vllm:num_requests_waiting", "Requests waiting for a KV slot", m, registry=r),
        "kv": Gauge("vllm:kv_cache_usage_perc", "KV cache usage (fraction of slots in use)", m, registry=r),
        "prompt": Counter("vllm:prompt_tokens", "Prompt tokens processed", m, registry=r),
        "generation": Counter("vllm:generation_tokens", "Generation tokens produced", m, registry=r),
        "success": Counter("vllm:request_success", "Finished requests", [*m, "finished_reason"], registry=r),
        "ttft": Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token", m, buckets=LATENCY_BUCKETS, registry=r
        ),
        "itl": Histogram(
            "vllm:inter_token_latency_seconds", "Time between tokens", m, buckets=LATENCY_BUCKETS, registry=r
        ),
        "e2e": Histogram(
            "vllm:e2e_request_latency_seconds", "Request latency", m, buckets=LATENCY_BUCKETS, registry=r
        ),
    }


def count_http(handler: str, method: str, status: int) -> None:
    _metrics()["http"].labels(handler, method, str(status)).inc()


class EngineMetrics:
    """The metrics of one model's embedded engine (labels bound)."""

    def __init__(self, model_name: str) -> None:
        m = _metrics()
        self.prompt = m["prompt"].labels(model_name)
        self.generation = m["generation"].labels(model_name)
        self.ttft = m["ttft"].labels(model_name)
        self.itl = m["itl"].labels(model_name)
        self.e2e = m["e2e"].labels(model_name)
        self._success = m["success"]
        self._gauges = {k: m[k].labels(model_name) for k in ("running", "waiting", "kv")}
        self.model_name = model_name

    def bind(
        self, running: Callable[[], float], waiting: Callable[[], float], kv_usage: Callable[[], float]
    ) -> None:
        """Gauges read the scheduler's state when scraped."""
        for key, fn in (("running", running), ("waiting", waiting), ("kv", kv_usage)):
            self._gauges[key].set_function(fn)

    def finished(self, reason: str | None, seconds: float) -> None:
        self._success.labels(self.model_name, reason or "abort").inc()
        self.e2e.observe(seconds)


def process_exposition() -> str:
    """This process's metrics: tpuray's and (where vLLM runs here) vLLM's."""
    return generate_latest(TPURAY_REGISTRY).decode() + generate_latest(REGISTRY).decode()


def merge_expositions(texts: Iterable[str]) -> str:
    """Several processes' expositions as one (each metric family once, samples of all)."""
    families: dict[str, Any] = {}
    samples: dict[str, list] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            families.setdefault(family.name, family)
            samples.setdefault(family.name, []).extend(family.samples)
    lines = []
    for name, family in families.items():
        kind = "unknown" if family.type == "unknown" else family.type
        lines += [f"# HELP {name} {family.documentation}", f"# TYPE {name} {kind}"]
        seen = set()
        for s in samples[name]:
            labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(s.labels.items()))
            line = f"{s.name}{{{labels}}} {_value(s.value)}" if labels else f"{s.name} {_value(s.value)}"
            if line not in seen:
                seen.add(line)
                lines.append(line)
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _value(v: float) -> str:
    if v != v:
        return "NaN"
    if v in (float("inf"), float("-inf")):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))
