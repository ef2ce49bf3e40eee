"""What generation takes and gives, whatever the engine: `SamplingParams` in, `SeqOutput` out, and
`PromptEncoder`, which turns prompts and chat messages into token ids with the model's tokenizer.

The embedded engine (`engine/embedded/`), the vLLM rollout of `tpuray.rl` and the backends share these
types; nothing here imports an engine (torch and transformers load when a method needs them).
"""

from __future__ import annotations

import inspect
import random
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

TokenLogprobs = tuple[int, float, list[tuple[int, float]]]  # (token, logprob, [(top token, logprob)...])


@dataclass
class SamplingParams:
    """What one sequence samples with. Requests are checked before they get here (openai/checks.py);
    this only guards ranges."""

    max_tokens: int = 16  # 0: prefill only (completions' echo with max_tokens 0)
    temperature: float = 1.0
    top_p: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False  # EOS is an ordinary token: generate until max_tokens or a stop
    min_tokens: int = 0  # EOS and stop_token_ids are masked (and stop strings unchecked) until this many
    include_stop_str_in_output: bool = False  # the stop string / stop token ends the output text
    skip_special_tokens: bool = True  # decode without the tokenizer's special tokens
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    logprobs: int | None = None  # top-n logprobs per generated token (0: only the chosen token's)
    prompt_logprobs: int | None = None  # the same for every prompt token (echo)
    grammar: Any = None  # a llguidance grammar (engine/embedded/grammar.py) the output must follow

    def __post_init__(self) -> None:
        if self.max_tokens < 0:  # 0: the prompt alone (its logprobs), nothing generated
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def generator(self, index: int = 0) -> torch.Generator:
        """A generator per sequence: choice `index` of a seeded request is reproducible on its own."""
        import torch

        seed = random.getrandbits(63) if self.seed is None else (self.seed * 1_000_003 + index) % (2**63)
        return torch.Generator().manual_seed(seed)


@dataclass
class SeqOutput:
    """What a sequence produced since its last output."""

    text: str
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # of token_ids, when asked for
    prompt_logprobs: list[TokenLogprobs] | None = None  # first output only, when asked for (echo)


class TemplateError(ValueError):
    """The chat template cannot render these messages with these options (a client error); `param` is the
    request field to blame."""

    def __init__(self, message: str, param: str = "messages") -> None:
        super().__init__(message)
        self.param = param


class PromptEncoder:
    """Mixin for engines that hold a Hugging Face tokenizer in `self.tokenizer`."""

    tokenizer: Any

    def encode_prompt(self, prompt: str | list[int], add_special_tokens: bool = False) -> list[int]:
        """A text prompt is tokenized (with the tokenizer's special tokens, e.g. BOS, only when asked);
        a token-id prompt is used as given."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return list(prompt)

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        """The messages rendered by the model's chat template and tokenized. `template_kwargs` are extra
        template variables (vLLM's chat_template_kwargs), `tools` the request's tool definitions (the
        template's `tools`); TemplateError names what cannot be rendered."""
        kwargs = dict(template_kwargs or {})
        reserved = sorted(set(kwargs) & _template_params())
        if reserved:
            raise TemplateError(
                f"chat_template_kwargs may not set {reserved}: they are not template variables",
                "chat_template_kwargs",
            )
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tools=tools,
                **kwargs,
            )
        except Exception as e:
            if isinstance(e, (ValueError, TypeError)) or type(e).__module__.startswith("jinja2"):
                param = (
                    "continue_final_message" if continue_final_message and "final" in str(e) else "messages"
                )
                raise TemplateError(f"the chat template cannot render the messages: {e}", param) from e
            raise
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)


@cache
def _template_params() -> frozenset[str]:
    """apply_chat_template's own parameters: chat_template_kwargs may not set them."""
    from transformers import PreTrainedTokenizerBase

    params = inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
    return frozenset(n for n, p in params.items() if p.kind is not p.VAR_KEYWORD) | {"messages"}
