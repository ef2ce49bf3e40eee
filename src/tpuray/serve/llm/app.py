"""Ray Serve applications of tpuray's LLM serving: `build_openai_app` (the OpenAI ingress, `LLMRouter`, in
front of the models' `LLMServer`s) and `build_llm_deployment` (one model).

Each LLMServer builds its engine in its constructor; for a TPU model the engine reserves the replica's
own slice. Serve calls `__del__` when it stops a replica, which stops the engine and releases the slice.
Every config is checked (model source, and on a cluster with a slice autoscaler, that its slice can come)
before anything is deployed.
"""

from __future__ import annotations

import re
from typing import Any, cast

from ray import serve
from ray.serve import Deployment

from tpuray.serve.llm.config import LLMConfig, LLMServingArgs
from tpuray.serve.llm.deployments.router import LLMRouter
from tpuray.serve.llm.deployments.server import LLMServer


def _deployment(cls: type) -> Deployment:
    """`serve.deployment(cls)` (typed: Serve's overloads read a bare class as decorator arguments)."""
    return cast(Deployment, serve.deployment(cls))


def _deployment_name(model_id: str) -> str:
    return "LLMServer:" + re.sub(r"[^A-Za-z0-9_.:-]", "-", model_id)


# Serve runs user code and handle routing on extra threads/loops by default; on small hosts each thread
# hop adds latency. These replicas keep everything on the replica's own event loop (the engine's model
# steps still run off-loop, in a worker thread, the engine worker actors or vLLM's engine core).
FAST_PATH_ENV = {
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
}


def _with_fast_path(actor_options: dict[str, Any]) -> dict[str, Any]:
    actor = dict(actor_options)
    runtime_env = dict(actor.get("runtime_env") or {})
    runtime_env["env_vars"] = {**FAST_PATH_ENV, **(runtime_env.get("env_vars") or {})}
    actor["runtime_env"] = runtime_env
    return actor


def _server_options(config: LLMConfig) -> dict[str, Any]:
    opts: dict[str, Any] = {
        "max_ongoing_requests": 1024,
        # Ray Serve LLM's period: the check pings each engine worker (after a step); one that finds the
        # engine dead starts a new one, or fails, and Serve replaces the replica after 3 failures in a row
        # (docs/serve.md, "When an engine dies")
        "health_check_period_s": 10,
        "health_check_timeout_s": 30,
    }
    opts.update(config.deployment_config)
    actor = dict(opts.get("ray_actor_options") or {})
    actor.setdefault("num_cpus", 0)  # the replica mostly waits on its engine workers
    if config.runtime_env:
        actor.setdefault("runtime_env", config.runtime_env)
    opts["ray_actor_options"] = _with_fast_path(actor)
    opts.setdefault("name", _deployment_name(config.model_id))
    return opts


def _check_slice_can_come(config: LLMConfig) -> None:
    """A replica on a slice no node type of the cluster's slice autoscaler can bring fails here, naming
    the shape and the node types, before anything is deployed (elsewhere, or with no Ray connection
    yet, nothing is checked: the replica's reservation waits for its slice)."""
    import ray

    if config.topology is None or not ray.is_initialized():
        return
    from tpuray.slices.autoscaler import published_node_types
    from tpuray.slices.demand import check_slices_can_be_reserved

    if published_node_types() is not None:  # one KV read; lists the slices only on such a cluster
        check_slices_can_be_reserved(config.topology)


def build_llm_deployment(llm_config: LLMConfig | dict, *, name_prefix: str | None = None):
    """One model as a Serve application (its handle serves `handle(endpoint, body)`, `handle_stream`...)."""
    config = llm_config if isinstance(llm_config, LLMConfig) else LLMConfig.from_dict(llm_config)
    config.check_model_source()
    _check_slice_can_come(config)
    opts = _server_options(config)
    if name_prefix:
        opts["name"] = name_prefix + opts["name"]
    return _deployment(LLMServer).options(**opts).bind(config)


def build_openai_app(llm_serving_args: LLMServingArgs | dict):
    """The OpenAI-compatible application: `serve.run(build_openai_app(args))`.

    A one-model app is a single deployment named `LLMServer:<model_id>` (routes and engine in each
    replica); otherwise an `LLMRouter` ingress forwards to one `LLMServer:<model_id>` deployment per model
    (see `LLMServingArgs.single_deployment`).

    Every config is validated (topology, tensor_parallel_size, model source, engine_kwargs) before
    anything starts.
    """
    args = (
        llm_serving_args
        if isinstance(llm_serving_args, LLMServingArgs)
        else LLMServingArgs(**llm_serving_args)
    )
    for config in args.llm_configs:
        config.check_model_source()
        _check_slice_can_come(config)
    model_ids = [c.model_id for c in args.llm_configs]
    if args.single_deployment:  # one deployment, named like the model's LLMServer, with the model's options
        (config,) = args.llm_configs
        ingress = _deployment(LLMRouter).options(**_server_options(config))
        return ingress.bind([config], model_ids, args.api_key)
    servers = [build_llm_deployment(c) for c in args.llm_configs]
    ingress_opts: dict[str, Any] = {"max_ongoing_requests": 2048, "ray_actor_options": {"num_cpus": 0}}
    ingress_opts.update(args.ingress_deployment_config)
    ingress_opts["ray_actor_options"] = _with_fast_path(ingress_opts.get("ray_actor_options") or {})
    ingress = _deployment(LLMRouter).options(name="LLMRouter", **ingress_opts)
    return ingress.bind(servers, model_ids, args.api_key)
