"""The embedded engine honours or refuses every request field: chat message `name` reaches the chat
template; vLLM's ignore_eos, min_tokens, include_stop_str_in_output, skip_special_tokens,
allowed_token_ids, add_special_tokens, request_id and chat echo / add_generation_prompt /
continue_final_message / chat_template_kwargs are honoured (in this process, real engine and tokenizer);
every other vLLM field is a 400 naming it; unknown fields are accepted and logged; with
log_engine_metrics=False the app's /metrics has no engine samples (real Serve app over HTTP)."""

from __future__ import annotations

import asyncio
import logging
import shutil

import pytest
from _configs import in_process_server
from _vllm_fields import CH, VLLM_REFUSED, C

from tpuray.serve.llm.openai.checks import parse_for_embedded, vllm_only
from tpuray.serve.llm.openai.errors import OpenAIError
from tpuray.serve.llm.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_request

# the tiny model's template, plus the message's name and a template variable (chat_template_kwargs)
NAMED_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}"
    "{% if message['name'] is defined %} name={{ message['name'] }}{% endif %}{{ '\\n' }}"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if note is defined %}note={{ note }}\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model with a name-aware chat template and a tokenizer that adds BOS to text prompts."""
    from tokenizers import processors
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("named") / "model"
    shutil.copytree(tiny_model_dir, path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = NAMED_TEMPLATE
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", tok.bos_token_id)]
    )
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def server(model_dir):
    s = in_process_server("named", model_dir, max_model_len=128)
    yield s
    s.shutdown()


def _run(coro):
    return asyncio.run(coro)


def complete(server, **fields) -> dict:
    body = {"model": "named", "prompt": "x", "max_tokens": 6, "temperature": 0, **fields}
    return _run(server.handle("completions", body))


def streamed_text(server, endpoint: str, body: dict) -> str:
    async def go() -> str:
        text = ""
        async for chunk in server.handle_stream(endpoint, {**body, "stream": True}):
            for c in chunk["choices"]:
                text += c["text"] if endpoint == "completions" else c["delta"].get("content", "")
        return text

    return _run(go())


def refused(server, endpoint: str, body: dict) -> OpenAIError:
    with pytest.raises(OpenAIError) as e:
        _run(server.handle(endpoint, {"model": "named", "max_tokens": 2, **body}))
    assert e.value.status == 400
    return e.value


def test_message_name_reaches_the_chat_template(server):
    from tpuray.serve.llm.openai.protocol import template_messages

    tok = server.engine.tokenizer
    messages = [{"role": "user", "content": "hi", "name": "alice"}, {"role": "user", "content": "yo"}]
    expected = "<|im_start|>user name=alice\nhi<|im_end|>\n<|im_start|>user\nyo<|im_end|>\n"
    expected += "<|im_start|>assistant\n"
    req = parse_request(ChatCompletionRequest, {"model": "named", "messages": messages})
    # the engine's prompt encoder, the chat path (its jobs' prompt), /tokenize and a real chat request
    assert tok.decode(server.engine.apply_chat_template(template_messages(req.messages))) == expected
    (job,) = _run(server._chat_jobs(req))
    assert tok.decode(job.prompt_ids) == expected
    tokens = _run(server.handle("tokenize", {"messages": messages}))["tokens"]
    assert tokens == job.prompt_ids
    chat = _run(server.handle("chat", {"model": "named", "messages": messages, "max_tokens": 2}))
    assert chat["usage"]["prompt_tokens"] == len(job.prompt_ids)


def test_ignore_eos_gives_exactly_max_tokens_and_skip_special_tokens(server):
    eos = server.engine.tokenizer.eos_token_id
    forced = {"max_tokens": 8, "logit_bias": {str(eos): 100}}  # EOS is the most likely token every step
    stopped = complete(server, **forced)["choices"][0]
    assert stopped["text"] == "" and stopped["finish_reason"] == "stop"
    r = complete(server, **forced, ignore_eos=True)
    assert r["usage"]["completion_tokens"] == 8 and r["choices"][0]["finish_reason"] == "length"
    assert r["choices"][0]["text"] == ""  # skip_special_tokens (default): EOS has no text
    raw = complete(server, **forced, ignore_eos=True, skip_special_tokens=False)["choices"][0]
    assert raw["text"] == "<|eos|>" * 8
    assert streamed_text(server, "completions", {"model": "named", "prompt": "x", "temperature": 0,
                                                 **forced, "ignore_eos": True,
                                                 "skip_special_tokens": False}) == raw["text"]  # fmt: skip


def test_min_tokens_masks_eos_stop_token_ids_and_stop_strings(server):
    tok = server.engine.tokenizer
    eos, a = tok.eos_token_id, tok.convert_tokens_to_ids("a")
    r = complete(server, max_tokens=10, logit_bias={str(eos): 100}, min_tokens=5)
    assert r["usage"]["completion_tokens"] == 5 and r["choices"][0]["finish_reason"] == "stop"
    r = complete(server, max_tokens=10, logit_bias={str(a): 100}, stop_token_ids=[a], min_tokens=3)
    assert r["usage"]["completion_tokens"] == 3 and r["choices"][0]["finish_reason"] == "stop"
    r = complete(server, max_tokens=10, logit_bias={str(a): 100}, stop=["a"], min_tokens=3)
    assert r["choices"][0]["text"] == "aaa" and r["usage"]["completion_tokens"] == 4
    assert refused(server, "completions", {"prompt": "x", "min_tokens": 3}).param == "min_tokens"


def test_include_stop_str_in_output(server):
    a = server.engine.tokenizer.convert_tokens_to_ids("a")
    forced = {"logit_bias": {str(a): 100}}  # the output is "aaaaaa"
    assert complete(server, **forced, stop=["aa"])["choices"][0]["text"] == ""
    r = complete(server, **forced, stop=["aa"], include_stop_str_in_output=True)["choices"][0]
    assert r["text"] == "aa" and r["finish_reason"] == "stop"
    body = {"model": "named", "prompt": "x", "max_tokens": 6, "temperature": 0, **forced}
    assert (
        streamed_text(server, "completions", {**body, "stop": ["aa"], "include_stop_str_in_output": True})
        == "aa"
    )
    r = complete(server, **forced, stop_token_ids=[a], include_stop_str_in_output=True)
    assert r["choices"][0]["text"] == "a" and r["usage"]["completion_tokens"] == 1


def test_allowed_token_ids_and_add_special_tokens(server):
    tok = server.engine.tokenizer
    allowed = [tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("b")]
    for seed in range(3):
        text = complete(server, max_tokens=12, temperature=1.0, seed=seed, allowed_token_ids=allowed)
        assert set(text["choices"][0]["text"]) <= {"a", "b"}
    assert refused(server, "completions", {"prompt": "x", "allowed_token_ids": [10**7]}).param == (
        "allowed_token_ids"
    )
    assert (
        refused(server, "completions", {"prompt": "x", "allowed_token_ids": []}).param == "allowed_token_ids"
    )
    plain = len(tok.encode("hello", add_special_tokens=False))
    # vLLM's default for completions: the tokenizer's special tokens (this one adds BOS), like /tokenize
    assert complete(server, prompt="hello")["usage"]["prompt_tokens"] == plain + 1
    assert _run(server.handle("tokenize", {"prompt": "hello"}))["count"] == plain + 1
    assert complete(server, prompt="hello", add_special_tokens=False)["usage"]["prompt_tokens"] == plain


def test_chat_generation_prompt_continue_final_message_echo_and_template_kwargs(server):
    tok = server.engine.tokenizer

    def prompt(**fields) -> str:
        req = parse_request(ChatCompletionRequest, {"model": "named", **fields})
        return tok.decode(_run(server._chat_jobs(req))[0].prompt_ids)

    turn = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "ab"}]
    assert prompt(messages=turn).endswith("ab<|im_end|>\n<|im_start|>assistant\n")
    assert prompt(messages=turn, continue_final_message=True).endswith("<|im_start|>assistant\nab")
    assert prompt(messages=turn[:1], add_generation_prompt=False).endswith("x<|im_end|>\n")
    assert "note=NOTE\n" in prompt(messages=turn[:1], chat_template_kwargs={"note": "NOTE"})
    err = refused(server, "chat", {"messages": turn[:1], "chat_template_kwargs": {"tokenize": True}})
    assert err.param == "chat_template_kwargs"
    err = refused(
        server, "chat", {"messages": turn, "continue_final_message": True, "add_generation_prompt": True}
    )
    assert err.param == "continue_final_message"
    # vLLM: without a generation prompt the reply has the last message's role; echo starts it with that
    # message's content
    body = {"model": "named", "messages": turn, "max_tokens": 4, "temperature": 0}
    echoed = _run(server.handle("chat", {**body, "continue_final_message": True, "echo": True}))
    message = echoed["choices"][0]["message"]
    assert message["role"] == "assistant" and message["content"].startswith("ab")
    assert (
        streamed_text(server, "chat", {**body, "continue_final_message": True, "echo": True})
        == message["content"]
    )
    user = _run(server.handle("chat", {**body, "messages": turn[:1], "add_generation_prompt": False}))
    assert user["choices"][0]["message"]["role"] == "user"


def test_request_id_names_the_response(server):
    assert complete(server, request_id="abc")["id"] == "cmpl-abc"
    body = {"model": "named", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    assert _run(server.handle("chat", {**body, "request_id": "abc"}))["id"] == "chatcmpl-abc"


@pytest.mark.parametrize(
    ("path", "field", "value"), VLLM_REFUSED, ids=[f"{p[4:]}-{f}" for p, f, _ in VLLM_REFUSED]
)
def test_vllm_only_fields_are_refused_naming_them(server, path, field, value):
    prompt = {"prompt": "x"} if path == C else {"messages": [{"role": "user", "content": "x"}]}
    err = refused(server, "completions" if path == C else "chat", {**prompt, field: value})
    assert err.param == field and "llm_engine='vLLM'" in err.message


def test_every_vllm_only_field_is_in_the_refused_table():
    for endpoint, path in (("completions", C), ("chat", CH)):
        assert set(vllm_only(endpoint)) == {f for p, f, _ in VLLM_REFUSED if p == path}


def test_vllm_fields_at_their_defaults_are_accepted_and_unknown_fields_logged(caplog):
    body = {"model": "m", "prompt": "x", "use_beam_search": False, "priority": 0, "bad_words": []}
    with caplog.at_level(logging.WARNING, logger="tpuray.serve.llm.openai.checks"):
        parse_for_embedded("completions", body)
        assert not caplog.records  # vLLM's defaults are what this engine does: nothing ignored
        parse_for_embedded("completions", {**body, "frobnicate": 1, "zz_unknown": "x"})
    (record,) = caplog.records
    assert record.levelno == logging.WARNING and "['frobnicate', 'zz_unknown']" in record.getMessage()


def test_vllms_request_fields_are_all_honoured_or_refused():
    """Against vLLM's own request classes (where vLLM is installed): no vLLM field falls through to
    "unknown, ignored" on the embedded engine."""
    pytest.importorskip("vllm")
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VChat
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest as VCompletion

    for endpoint, ours, theirs in (
        ("completions", CompletionRequest, VCompletion),
        ("chat", ChatCompletionRequest, VChat),
    ):
        missing = set(theirs.model_fields) - set(ours.model_fields) - set(vllm_only(endpoint))
        assert not missing, f"{theirs.__name__}: {sorted(missing)}"


# log_engine_metrics=False through a real Serve app: serve/test_serve_openai.py (its one-model app)
