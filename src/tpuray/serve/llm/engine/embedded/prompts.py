"""Prompt -> token ids with the model's Hugging Face tokenizer; shared by every engine."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tpuray.serve.llm.openai_schema import ChatMessage


def template_messages(messages: Iterable[ChatMessage]) -> list[dict[str, str]]:
    """Chat messages as the chat template sees them: role (developer -> system), text content, and `name`
    when the message has one (as vLLM hands it to `apply_chat_template`)."""
    out = []
    for m in messages:
        message = {"role": m.role if m.role != "developer" else "system", "content": m.text()}
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


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
