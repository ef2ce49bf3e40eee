"""vLLM's request fields the embedded engine refuses, each with a value other than vLLM's default:
(endpoint path, field, value). Shared by the in-process tests and the HTTP bad-request list."""

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
