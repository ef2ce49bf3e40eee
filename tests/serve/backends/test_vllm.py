"""Real vLLM (the CPU build) behind tpuray's OpenAI app on the emulated cluster, driven by the real
`openai` client: the app serves vLLM TP=4 over a v6e 2x2 slice (one vLLM worker per emulated chip, through
vLLM's Ray executor); the `full` test tier adds a second app with the same weights on vLLM TP=1 on the CPU
(its engine core killed under load, the OpenAPI fuzz). Transformers is the reference. Skipped where vLLM is
not installed (`make test` installs it)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest
from _engine_death import check_the_deadline_ends_a_running_stream, engine_core_killed_under_load
from _openapi_fuzz import VLLM_EXAMPLES, fuzz_app
from _schemas import PERSON
from _vllm_fields import BAD_VLLM_REQUESTS

from _util import live_placement_groups, new_placement_groups
from tpuray.serve.llm.engine.vllm import vllm_available

pytestmark = pytest.mark.skipif(
    not vllm_available(), reason="vLLM is not installed (pip install 'tpuray[vllm]')"
)

MODULE_START = time.time()
API_KEY = "vllm-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
TP4, TP1 = "tiny-tp4", "tiny-tp1"
CPU_APP = "tpuray-vllm-cpu"
FULL = "CI: vLLM TP=4 on the slice, the same tests (this module), the fuzz and a dead engine's 503s on the embedded engine (serve/openai/test_http_fuzz.py, serve/deployments/test_engine_death.py)"
PROMPTS = ["Hello world", "Tensor parallelism splits attention heads"]
ENGINE_KWARGS = {
    "max_model_len": 256,
    "dtype": "float32",
    "enforce_eager": True,
    "enable_auto_tool_choice": True,  # vLLM's OpenAI layer: tools with the hermes parser
    "tool_call_parser": "hermes",
}


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory) -> str:
    from tpuray.models import build_tiny_causal_lm

    # head_dim 64: what vLLM's CPU attention kernels take; 4 heads split over 4 chips
    path = tmp_path_factory.mktemp("tiny-vllm") / "model"
    return str(
        build_tiny_causal_lm(path, hidden_size=256, num_attention_heads=4, max_position_embeddings=512)
    )


@pytest.fixture(scope="module")
def hf(vllm_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(vllm_model_dir).eval(), AutoTokenizer.from_pretrained(
        vllm_model_dir
    )


def tp4_config(model_dir: str):
    from tpuray.serve.llm import LLMConfig

    return LLMConfig(
        model_loading_config={"model_id": TP4, "model_source": model_dir},
        llm_engine="vLLM",
        accelerator_type="TPU-V6E",
        accelerator_config={"kind": "tpu", "topology": "2x2"},
        placement_group_config={"bundle_per_worker": {"TPU": 1}},
        engine_kwargs={"tensor_parallel_size": 4, **ENGINE_KWARGS},
    )


def tp1_config(model_dir: str):
    from tpuray.serve.llm import LLMConfig

    return LLMConfig(
        model_loading_config={"model_id": TP1, "model_source": model_dir},
        llm_engine="vLLM",
        engine_kwargs=ENGINE_KWARGS,
        # Serve replaces a replica after 3 failed checks in a row (test_a_dead_engine_core_...)
        deployment_config={"health_check_period_s": 2},
    )


@pytest.fixture(scope="module")
def app(serve_url, vllm_model_dir):
    from ray import serve

    from tpuray.serve.llm import LLMServingArgs, build_openai_app

    before = set(live_placement_groups())
    try:
        args = LLMServingArgs(llm_configs=[tp4_config(vllm_model_dir)], api_key=API_KEY)
        serve.run(build_openai_app(args), name="tpuray-vllm", route_prefix="/")
        yield serve_url, before
    finally:
        serve.delete("tpuray-vllm")


@pytest.fixture(scope="module")
def cpu_app(app, vllm_model_dir):
    """The `full` tier's second app: the same weights on vLLM TP=1 on the CPU (no slice), at /cpu."""
    from ray import serve

    from tpuray.serve.llm import LLMServingArgs, build_openai_app

    try:
        args = LLMServingArgs(llm_configs=[tp1_config(vllm_model_dir)], api_key=API_KEY)
        serve.run(build_openai_app(args), name=CPU_APP, route_prefix="/cpu")
        yield app[0] + "/cpu"
    finally:
        serve.delete(CPU_APP)


@pytest.fixture(scope="module")
def client(app):
    return openai.OpenAI(base_url=app[0] + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


def _hf_greedy(hf, prompt: str, n: int) -> tuple[list[int], list[float]]:
    """Greedy continuation token ids and their log-probabilities under the raw model (one forward pass
    over prompt + continuation: generate's scores are post-processing, e.g. min_new_tokens masks EOS)."""
    import torch

    model, tok = hf
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n)
        new = out[0, ids.shape[1] :].tolist()
        logits = model(out).logits[0, ids.shape[1] - 1 : -1].float()
    logprobs = torch.log_softmax(logits, -1)[torch.arange(n), torch.tensor(new)].tolist()
    return new, logprobs


def test_vllm_runs_on_the_emulated_slice(app):
    from ray import serve

    info = serve.get_deployment_handle(f"LLMServer:{TP4}", app_name="tpuray-vllm").describe.remote().result()
    assert info["engine"] == "vLLM" and info["vllm_version"] == "0.29.0"
    assert info["platform"] == "EmulatedTpuPlatform" and info["emulated"] is True
    assert info["tensor_parallel_size"] == 4 and "v6e-4" in info["slice"]
    assert len(info["bundle_nodes"]) == 4 and len(set(info["bundle_nodes"])) == 1  # one host, 4 chips
    assert "EMULATED TPU chips" in info["where"]


@pytest.mark.full(FULL)
def test_vllm_on_the_cpu_is_not_emulated(cpu_app):
    """The TP=1 replica (vLLM on the CPU, no slice): no slice in describe(), and its own log (its worker's
    stderr) does not say the chips are emulated."""
    from ray import serve

    cpu = serve.get_deployment_handle(f"LLMServer:{TP1}", app_name=CPU_APP).describe.remote().result()
    assert cpu["slice"] is None and cpu["tensor_parallel_size"] == 1
    assert not _replica_log_lines(CPU_APP, TP1)


def _alive_actors() -> list:
    """The GCS actor table itself (the emulated cluster runs no dashboard for ray.util.state)."""
    from ray._private.state import state
    from ray.core.generated import gcs_pb2

    table = state._connect_and_get_accessor().get_actor_table(None, "ALIVE")
    return [gcs_pb2.ActorTableData.FromString(raw) for raw in table]


def test_vllm_workers_hold_the_slices_chips(app):
    """vLLM's Ray executor starts its workers inside the slice's placement group, one chip each, on the
    slice's host: not in a placement group of its own elsewhere."""
    from ray import serve

    info = serve.get_deployment_handle(f"LLMServer:{TP4}", app_name="tpuray-vllm").describe.remote().result()
    rows = _alive_actors()
    workers = [r for r in rows if r.class_name.startswith("RayWorker")]  # vLLM 0.29: RayWorkerProc
    assert len(workers) == 4, [r.class_name for r in rows]  # TP=4; TP=1 runs in its replica's process
    for w in workers:
        assert w.placement_group_id.hex() == info["placement_group_id"]
        group = f"TPU_group_{info['placement_group_id']}"  # one TPU of the slice's placement group
        assert dict(w.required_resources).get(group) == 1, dict(w.required_resources)
        assert w.address.node_id.hex() in info["bundle_nodes"]
    # vLLM's CPU all-reduce segments: their names removed once the 4 workers joined them (cpu_shm.py)
    assert not [p for p in Path("/dev/shm").glob("*-[[]0-1-2-3]-cpushm_*") if _mtime(p) >= MODULE_START]


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:  # removed meanwhile
        return 0.0


def _replica_log_lines(app_name: str, model: str) -> list[str]:
    """The lines of a replica's own log (its worker's stderr, where a warning lands) that say the chips
    are emulated."""
    import ray

    logs = Path(ray._private.worker.global_worker.node.get_logs_dir_path())
    name = f"ServeReplica:{app_name}:LLMServer:{model}"
    (replica,) = [r for r in _alive_actors() if r.class_name == name]
    (log,) = logs.glob(f"worker-{replica.address.worker_id.hex()}-*-{replica.pid}.err")
    return [line for line in log.read_text(errors="replace").splitlines() if "EMULATED TPU chips" in line]


def test_the_replica_log_says_the_slice_is_emulated(app):
    said = _replica_log_lines("tpuray-vllm", TP4)
    assert said and said[0].startswith(f"{TP4}: vLLM engine up: "), said


def test_openai_sampling_fields_pass_through_to_vllm(client, hf):
    _, tok = hf
    r = client.completions.create(
        model=TP4,
        prompt=PROMPTS[0],
        max_tokens=6,
        n=2,
        echo=True,
        logprobs=2,
        temperature=0.8,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        stop=["\n\n\n"],
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2},
    )
    assert len(r.choices) == 2
    for choice in r.choices:
        assert choice.text.startswith(PROMPTS[0])  # echo
        assert len(choice.logprobs.tokens) > len(tok.encode(PROMPTS[0], add_special_tokens=False))
    again = client.completions.create(
        model=TP4, prompt=PROMPTS[0], max_tokens=6, temperature=0.8, seed=7, extra_body={"top_k": 1}
    )
    greedy = client.completions.create(model=TP4, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    assert again.choices[0].text == greedy.choices[0].text  # top_k=1 is greedy whatever the temperature
    chat = client.chat.completions.create(
        model=TP4,
        messages=[{"role": "user", "content": "hi"}],
        max_completion_tokens=4,
        logprobs=True,
        top_logprobs=3,
        temperature=0,
    )
    assert all(len(t.top_logprobs) == 3 for t in chat.choices[0].logprobs.content)


@pytest.mark.parametrize(("endpoint", "fields", "param"), BAD_VLLM_REQUESTS, ids=lambda x: str(x)[:30])
def test_bad_requests_to_vllm_are_400s_naming_the_param(app, endpoint, fields, param):
    base, headers = app[0], {"Authorization": f"Bearer {API_KEY}"}
    route, body = (
        ("/v1/completions", {"model": TP4, "prompt": "x", "max_tokens": 2})
        if endpoint == "completions"
        else ("/v1/chat/completions", {"model": TP4, "messages": [{"role": "user", "content": "x"}]})
    )
    r = httpx.post(base + route, json=body | fields, headers=headers, timeout=60)
    assert r.status_code == 400, (fields, r.text)
    assert r.json()["error"]["param"] == param, (fields, r.json())
    ok = httpx.post(base + route, json=body | {"max_tokens": 2}, headers=headers, timeout=60)
    assert ok.status_code == 200, ok.text  # the server keeps serving


def test_vllm_answers_like_the_embedded_engine(app):
    """openai/checks.py's rules (the list test_bad_input.py sends to the embedded engine): 400s naming
    the param (streamed too), the same fields honoured, malformed bodies 400, a huge one 413."""
    from _bad_requests import check_answers_alike

    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    with httpx.Client(base_url=app[0], headers=headers, timeout=120) as http:
        check_answers_alike(http, TP4)
        for raw in (b'{"model": "tiny-tp4", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", b"[" * 100_000):
            r = http.post("/v1/completions", content=raw)
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
        r = http.post("/v1/completions", json={"model": TP4, "prompt": "x" * 10_000_000})
        assert r.status_code == 413, r.text
        # echo with max_tokens 0: the prompt and its logprobs, no completion token (as the embedded engine)
        echo = {"model": TP4, "prompt": "Hello world", "echo": True, "max_tokens": 0, "logprobs": 1}
        r = http.post("/v1/completions", json=echo).json()
        assert (
            r["choices"][0]["text"] == "Hello world"
            and r["choices"][0]["logprobs"]["token_logprobs"][0] is None
        )
        n_prompt = len(r["choices"][0]["logprobs"]["tokens"])
        usage = r["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
            n_prompt,
            0,
            n_prompt,
        )
        stream = echo | {"stream": True, "stream_options": {"include_usage": True}}
        events = [
            line[6:] for line in http.post("/v1/completions", json=stream).text.splitlines() if line[6:]
        ]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 0


def _greedy_equals_transformers(client, hf, model: str) -> None:
    """Token for token (text can differ at the end: vLLM holds back an incomplete UTF-8 sequence)."""
    _, tok = hf
    for prompt in PROMPTS:
        ref, _ = _hf_greedy(hf, prompt, 12)
        r = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        choice = r.choices[0]
        assert choice.model_extra["token_ids"] == ref, (model, prompt)
        assert tok.decode(ref).startswith(choice.text)


def test_greedy_tokens_equal_transformers_on_tp4(client, hf):
    _greedy_equals_transformers(client, hf, TP4)


@pytest.mark.full(FULL)
def test_greedy_tokens_equal_transformers_on_tp1(cpu_app, hf):
    cpu = openai.OpenAI(base_url=cpu_app + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    _greedy_equals_transformers(cpu, hf, TP1)


def test_completion_logprobs_equal_transformers(client, hf):
    _, ref_lp = _hf_greedy(hf, PROMPTS[0], 8)
    r = client.completions.create(
        model=TP4, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=2, extra_body={"ignore_eos": True}
    )
    got = r.choices[0].logprobs.token_logprobs
    assert len(got) == 8 and all(abs(a - b) < 1e-3 for a, b in zip(got, ref_lp, strict=True)), (got, ref_lp)
    # top_logprobs is keyed by token text: byte tokens that decode alike ("\ufffd") share one key
    assert all(1 <= len(top) <= 2 for top in r.choices[0].logprobs.top_logprobs)


def test_streamed_text_equals_non_streamed(client):
    kw = dict(model=TP4, messages=[{"role": "user", "content": "stream me"}], max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_json_schema_output_validates(client):
    import jsonschema

    for seed in range(3):
        r = client.chat.completions.create(
            model=TP4,
            messages=[{"role": "user", "content": "a person as JSON"}],
            max_tokens=120,
            temperature=1.0,
            seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        )
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_tool_call_round_trip(client, hf):
    _, tok = hf
    # a random model would pad the JSON with whitespace forever (the grammar allows it): ban those tokens
    no_whitespace = {str(i): -100 for i in range(len(tok)) if not tok.decode([i]).strip()}
    tools = [
        {
            "type": "function",
            "function": {"name": "lookup", "description": "find a person", "parameters": PERSON},
        }
    ]
    messages = [{"role": "user", "content": "who is it?"}]
    r = client.chat.completions.create(
        model=TP4,
        messages=messages,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "lookup"}},
        max_tokens=200,  # the tiny tokenizer spells the hermes call envelope nearly byte by byte
        temperature=0,
        logit_bias=no_whitespace,
    )
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "lookup"
    import jsonschema

    jsonschema.validate(json.loads(call.function.arguments), PERSON)
    messages += [
        {"role": "assistant", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"found": true}'},
    ]
    follow = client.chat.completions.create(
        model=TP4, messages=messages, tools=tools, max_tokens=8, temperature=0
    )
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tokenize_detokenize_and_errors(app, hf):
    _, tok = hf
    base, headers = app[0], {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"{base}/tokenize", json={"model": TP4, "prompt": "hello"}, headers=headers, timeout=60)
    assert r.status_code == 200 and r.json()["tokens"] == tok.encode("hello")
    back = httpx.post(
        f"{base}/detokenize", json={"model": TP4, "tokens": r.json()["tokens"]}, headers=headers
    )
    assert back.json()["prompt"] == "hello"
    bad = httpx.post(
        f"{base}/v1/completions",
        json={"model": TP4, "prompt": "x", "logprobs": -3},
        headers=headers,
        timeout=60,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprobs"
    assert httpx.post(f"{base}/v1/completions", json={"model": TP4, "prompt": "x"}).status_code == 401


def test_vllm_metrics_reach_the_apps_metrics_endpoint(app, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model=TP4, prompt="x", max_tokens=3, temperature=0)
    text = httpx.get(app[0] + "/metrics", timeout=60).text
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    assert "vllm:generation_tokens_total" in samples and "http_requests_total" in samples


def test_unknown_engine_kwargs_fail_before_reserving(vllm_model_dir):
    from tpuray.serve.llm import LLMConfig, LLMServingArgs, build_openai_app

    for key, match in (
        ("tensor_parallel_sized", "not an argument of vLLM"),
        ("port", "vLLM's own HTTP server"),
    ):
        cfg = LLMConfig(
            model_loading_config={"model_id": "m", "model_source": vllm_model_dir},
            llm_engine="vLLM",
            engine_kwargs={key: 1},
        )
        with pytest.raises(ValueError, match=match):
            build_openai_app(LLMServingArgs(llm_configs=[cfg]))


@pytest.mark.full(FULL)
def test_fuzz_from_the_openapi_document_on_vllm(cpu_app):
    """test_http_fuzz.py's fuzz (issue 22, item 6), on vLLM TP=1: no 5xx, no hang, every answer as its
    document says."""
    document = httpx.get(cpu_app + "/openapi.json", timeout=60).json()
    fuzz_app(cpu_app, document, TP1, VLLM_EXAMPLES, headers={"Authorization": f"Bearer {API_KEY}"})


@pytest.mark.full(FULL)
def test_a_dead_engine_core_gets_503s_then_a_new_engine_core(cpu_app):
    """vLLM's engine core process killed under load (issue 22, item 2): its requests, in flight and after,
    get a 503 (never vLLM's 500, never a hang), and the replica starts a new engine core in place of the
    dead one, whose client's shutdown does not hang. The one-chip model's replica (a new engine starts in
    seconds, not the TP=4 slice's minute); a new engine's slice reservation is released and retaken in
    test_engine_death.py (the embedded engine) and below (vLLM TP=4)."""
    engine_core_killed_under_load(cpu_app, TP1, CPU_APP, HEADERS)


@pytest.mark.full(
    "CI: a dead engine at tensor_parallel_size 2 (serve/deployments/test_engine_death.py::"
    "test_a_dead_engine_worker_gets_503s_then_a_new_engine[tp2])"
)
def test_a_dead_tp4_engine_core_gets_503s_then_a_new_engine_core(app):
    """Issue 45: vLLM's engine core killed under load at TP=4 (its Ray executor's 4 workers on the
    slice): requests in flight and after get a 503, never a hang; the replica starts a new engine, which
    reserves a slice again; the dead engine's workers and placement group are gone."""
    old, new = engine_core_killed_under_load(app[0], TP4, "tpuray-vllm", HEADERS)
    others = set(live_placement_groups()) - {old["placement_group_id"]}
    assert not new_placement_groups(others), "the dead engine's slice placement group was not released"
    workers = [r for r in _alive_actors() if r.class_name.startswith("RayWorker")]
    assert len(workers) == 4, [r.class_name for r in workers]  # the new engine's; the dead one's are gone
    assert {w.placement_group_id.hex() for w in workers} == {new["placement_group_id"]}


def test_deleting_the_app_releases_the_slice(app):
    from ray import serve

    before = app[1]
    assert set(live_placement_groups()) - before  # the TP=4 replica holds its slice while it runs
    serve.delete("tpuray-vllm")
    assert not new_placement_groups(before, timeout_s=60), (
        "the replica's slice placement group was not released"
    )


@pytest.mark.full(
    "CI: the same on the embedded engine (serve/deployments/test_failover.py::"
    "test_request_running_at_the_preemption_deadline_fails_with_a_503_not_a_hang)"
)
def test_vllm_request_running_at_the_preemption_deadline_fails_with_a_503(vllm_model_dir):
    """vLLM's `end()`: the engine of a preempted slice is ended at the deadline; a stream still on it ends
    with the replica's 503 (engine_dead, naming the preemption) instead of waiting forever. In this
    process, vLLM TP=1 on the CPU: the failover slot's retirement of an engine whose deadline has passed
    while a 100-token stream runs on it."""
    from tpuray.serve.llm import LLMConfig

    config = LLMConfig(
        model_loading_config={"model_id": TP1, "model_source": vllm_model_dir},
        llm_engine="vLLM",
        engine_kwargs=ENGINE_KWARGS,
    )
    check_the_deadline_ends_a_running_stream(config, TP1, timeout_s=300)
