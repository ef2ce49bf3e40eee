"""vLLM's request fields the embedded engine refuses, each with a value other than vLLM's default:
(endpoint path, field, value). Shared by the in-process tests and the HTTP bad-request list. And
BAD_VLLM_REQUESTS: requests vLLM's own validation refuses (test_vllm.py), (endpoint, fields, the param
the 400 must name)."""

from __future__ import annotations

C, CH = "/v1/completions", "/v1/chat/completions"

_BOTH = [
    ("use_beam_search", True),
    ("length_penalty", 0.5),
    ("spaces_between_special_tokens", False),
    ("truncate_prompt_tokens", 5),
    ("truncation_side", "left"),
    ("prompt_logprobs", 1),
    ("logprob_token_ids", [1]),
    ("bad_words", ["x"]),
    ("structured_outputs", {"json": {}}),
    ("priority", 1),
    ("session_id", "s"),
    ("return_tokens_as_token_ids", True),
    ("return_token_ids", True),
    ("return_token_offsets", True),
    ("routed_experts_prompt_start", 1),
    ("cache_salt", "salt"),
    ("kv_transfer_params", {"do_remote_decode": True}),
    ("ec_transfer_params", {}),
    ("vllm_xargs", {"a": 1}),
    ("repetition_detection", {}),
    ("thinking_token_budget", 10),
    ("stream_interval", 2),
]
_COMPLETION_ONLY = [("prompt_embeds", "AAAA")]
_CHAT_ONLY = [
    ("include_reasoning", False),
    ("documents", [{"title": "t", "text": "x"}]),
    ("chat_template", "{{ messages }}"),
    ("media_io_kwargs", {}),
    ("mm_processor_kwargs", {}),
    ("return_prompt_text", True),
    ("return_assistant_tokens_mask", True),
]

VLLM_REFUSED = [(C, f, v) for f, v in _BOTH + _COMPLETION_ONLY] + [(CH, f, v) for f, v in _BOTH + _CHAT_ONLY]

BAD_VLLM_REQUESTS = [
    ("completions", {"echo": "yes"}, "echo"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("completions", {"n": "2"}, "n"),
    ("completions", {"n": 2.0}, "n"),
    ("completions", {"max_tokens": 0.5}, "max_tokens"),
    ("completions", {"temperature": "hot"}, "temperature"),
    (
        "completions",
        {"stream": True, "stream_options": {"include_usage": "maybe"}},
        "stream_options.include_usage",
    ),
    ("completions", {"suffix": "!"}, "suffix"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"logprobs": -3}, "logprobs"),
    ("completions", {"temperature": -1.0}, "temperature"),
    ("completions", {"top_p": 0.0}, "top_p"),
    ("completions", {"presence_penalty": 3.0}, "presence_penalty"),
    ("completions", {"seed": "one"}, "seed"),
    ("completions", {"stop_token_ids": ["a"]}, "stop_token_ids.0"),
    ("chat", {"logprobs": "true"}, "logprobs"),
    ("chat", {"store": True}, "store"),
    ("chat", {"metadata": {"k": "v"}}, "metadata"),
    ("chat", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("chat", {"web_search_options": {}}, "web_search_options"),  # {} turns search on
    ("chat", {"metadata": {}, "store": True}, "store"),
    ("chat", {"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ("chat", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("chat", {"modalities": ["text", "audio"]}, "modalities"),
    ("chat", {"service_tier": "flex"}, "service_tier"),
    ("chat", {"verbosity": "low"}, "verbosity"),
    ("chat", {"max_completion_tokens": "4"}, "max_completion_tokens"),
]
