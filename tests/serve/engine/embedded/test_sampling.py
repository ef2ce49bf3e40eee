"""The embedded engine's logits processing against transformers' logits processors on the same input,
and its sampling controls end to end in this process (no Ray): logprobs equal transformers'
log_softmax, json_schema output validates, penalties and logit_bias steer the output."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from _schemas import PERSON

from tpuray.serve.llm.engine.embedded.logits import (
    apply_bitmask,
    apply_logit_bias,
    apply_penalties,
    token_logprobs,
)
from tpuray.serve.llm.engine.embedded.sampling import _min_p, _top_k
from tpuray.serve.llm.openai.logprobs import string_bytes

V = 50


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(3, V, generator=torch.Generator().manual_seed(0)) * 3


def test_repetition_penalty_equals_transformers(logits):
    from transformers import RepetitionPenaltyLogitsProcessor

    prompt, output = [1, 2, 3, 7], [7, 9, 9]
    ours = logits.clone()
    apply_penalties(ours, [1], [prompt], [output], [0.0], [0.0], [1.3])
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]), logits[1:2].clone())
    assert torch.allclose(ours[1], ref[0]) and torch.equal(
        ours[[0, 2]], logits[[0, 2]]
    )  # other rows untouched


def test_presence_and_frequency_penalties_follow_openai(logits):
    output = [4, 4, 4, 8]
    ours = logits.clone()
    apply_penalties(ours, [0], [[1, 2]], [output], [0.5], [0.25], [1.0])
    expected = logits[0].clone()
    for token in set(output):  # OpenAI: logit -= count * frequency + presence (generated tokens only)
        expected[token] -= output.count(token) * 0.25 + 0.5
    assert torch.allclose(ours[0], expected)


def test_logit_bias_equals_transformers(logits):
    from transformers import SequenceBiasLogitsProcessor

    bias = {3: 5.0, 11: -100.0}
    ours = logits.clone()
    apply_logit_bias(ours, {2: bias})
    ref = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(
        torch.tensor([[0]]), logits[2:3].clone()
    )
    assert torch.allclose(ours[2], ref[0])


@pytest.mark.parametrize(
    ("warper", "ours", "value"),
    [("TopKLogitsWarper", _top_k, k) for k in (1, 5, 49)]
    + [("MinPLogitsWarper", _min_p, p) for p in (0.05, 0.3, 0.9)],
)
def test_top_k_and_min_p_keep_what_transformers_keeps(logits, warper, ours, value):
    import transformers

    probs = torch.softmax(logits, -1)
    kept = ours(probs, torch.tensor([[value]] * 3)) > 0
    ref = getattr(transformers, warper)(value)(torch.zeros(3, 1, dtype=torch.long), logits.clone()) > float(
        "-inf"
    )
    assert torch.equal(kept, ref)


def test_bitmask_and_logprob_records(logits):
    mask = torch.zeros(1, (V + 31) // 32, dtype=torch.int32)
    mask[0, 0] = (1 << 3) | (1 << 7)  # tokens 3 and 7 allowed
    out = logits.clone()
    apply_bitmask(out, mask, [1])
    assert torch.isfinite(out[1]).nonzero().flatten().tolist() == [3, 7] and torch.equal(out[0], logits[0])
    lp = torch.log_softmax(logits, -1)
    (tok, value, top), *_ = token_logprobs(lp[:1], [4], [2])
    assert tok == 4 and value == pytest.approx(lp[0, 4].item())
    assert [t for t, _ in top] == lp[0].topk(2).indices.tolist()


# -- end to end, the embedded engine in this process ------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


def _run(coro):
    return asyncio.run(coro)


def hf_logprobs(model_dir: str, ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every position of `ids` ([len, vocab])."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def test_completion_logprobs_and_echo_equal_transformers(server, tiny_model_dir):
    body = {
        "model": "tiny",
        "prompt": "Hello world",
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 3,
        "echo": True,
    }
    choice = _run(server.handle("completions", body))["choices"][0]
    prompt = server.engine.encode_prompt("Hello world")
    lp = choice["logprobs"]
    n_prompt = len(prompt)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # first prompt token
    ref = hf_logprobs(tiny_model_dir, prompt)
    for pos in range(1, n_prompt):  # prompt logprobs (echo)
        assert abs(lp["token_logprobs"][pos] - ref[pos - 1, prompt[pos]].item()) < 1e-4
    generated = lp["token_logprobs"][n_prompt:]
    assert len(generated) == 6 and len(lp["tokens"]) == n_prompt + 6 == len(lp["text_offset"])
    text = b"".join(string_bytes(t) for t in lp["tokens"]).decode("utf-8", errors="replace")  # bytes:\xNN too
    assert text == choice["text"] and lp["text_offset"][n_prompt] == len("Hello world")
    assert all(len(top) <= 3 for top in lp["top_logprobs"][1:])


def test_chat_logprobs_equal_transformers_log_softmax(server, tiny_model_dir):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 5,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "ignore_me": 1,
    }
    content = _run(server.handle("chat", body))["choices"][0]["logprobs"]["content"]
    prompt = server.engine.apply_chat_template([{"role": "user", "content": "hi"}])
    # replay the greedy tokens through transformers: every step's logprob must match
    from tpuray.serve.llm.generation import SamplingParams

    async def tokens() -> list[int]:
        ids: list[int] = []
        async for out in server.engine.generate(prompt, SamplingParams(max_tokens=5, temperature=0)):
            ids += out.token_ids
        return ids

    ids = _run(tokens())
    ref = hf_logprobs(tiny_model_dir, prompt + ids)
    assert len(content) == len(ids) == 5
    for step, (entry, token) in enumerate(zip(content, ids, strict=True)):
        assert abs(entry["logprob"] - ref[len(prompt) - 1 + step, token].item()) < 1e-4
        assert len(entry["top_logprobs"]) == 2 and entry["bytes"] == list(entry["token"].encode())


def test_json_schema_output_validates_for_20_seeds(server):
    import jsonschema

    async def run() -> list[dict]:
        return await asyncio.gather(
            *[
                server.handle(
                    "chat",
                    {
                        "model": "tiny",
                        "messages": [{"role": "user", "content": "a person"}],
                        "max_tokens": 200,
                        "temperature": 1.0,
                        "seed": seed,
                        "response_format": {
                            "type": "json_schema",
                            "json_schema": {"name": "person", "schema": PERSON},
                        },
                    },
                )
                for seed in range(20)
            ]
        )

    for response in _run(run()):
        choice = response["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


def test_json_object_and_text_formats(server):
    text = _run(
        server.handle(
            "completions",
            {
                "model": "tiny",
                "prompt": "x",
                "max_tokens": 8,
                "temperature": 0,
                "response_format": {"type": "text"},
            },
        )
    )["choices"][0]["text"]
    assert isinstance(text, str)
    obj = _run(
        server.handle(
            "chat",
            {
                "model": "tiny",
                "messages": [{"role": "user", "content": "{}"}],
                "max_tokens": 64,
                "temperature": 0,
                "logit_bias": {str(server.engine.tokenizer.convert_tokens_to_ids("}")): 30},
                "response_format": {"type": "json_object"},
            },
        )
    )["choices"][0]
    assert obj["finish_reason"] == "stop" and isinstance(json.loads(obj["message"]["content"]), dict)


def test_logit_bias_stop_token_ids_and_penalties_steer_the_output(server):
    tok = server.engine.tokenizer
    a = tok.convert_tokens_to_ids("a")

    def complete(**fields) -> dict:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 5, "temperature": 0, **fields}
        return _run(server.handle("completions", body))["choices"][0]

    forced = complete(logit_bias={str(a): 100})
    assert forced["text"] == "aaaaa"
    stopped = complete(logit_bias={str(a): 100}, stop_token_ids=[a])
    assert stopped["text"] == "" and stopped["finish_reason"] == "stop"
    varied = complete(logit_bias={str(a): 5}, frequency_penalty=2.0, presence_penalty=2.0)["text"]
    assert varied.count("a") < 5  # the penalties push the biased token back down after it appears


def test_tokenize_and_detokenize_have_vllms_shapes(server):
    tok = server.engine.tokenizer
    r = _run(server.handle("tokenize", {"prompt": "hello world", "return_token_strs": True}))
    assert r["tokens"] == tok.encode("hello world") and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 256 and r["token_strs"] == tok.convert_ids_to_tokens(r["tokens"])
    chat = _run(server.handle("tokenize", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}))
    assert chat["tokens"] == server.engine.apply_chat_template([{"role": "user", "content": "hi"}])
    assert _run(server.handle("detokenize", {"tokens": r["tokens"]})) == {"prompt": "hello world"}
    from tpuray.serve.llm.openai.errors import OpenAIError

    with pytest.raises(OpenAIError) as e:
        _run(server.handle("detokenize", {"tokens": [10**7]}))
    assert e.value.param == "tokens"
