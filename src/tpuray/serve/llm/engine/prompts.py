"""Prompt -> token ids with the model's Hugging Face tokenizer; shared by every engine."""

from __future__ import annotations

from typing import Any


class PromptEncoder:
    """Mixin for engines that hold a Hugging Face tokenizer in `self.tokenizer`."""

    tokenizer: Any

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """A text prompt is tokenized (no special tokens added); a token-id prompt is used as given."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return self.tokenizer.encode(text, add_special_tokens=False)
