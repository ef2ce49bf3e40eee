"""Tiny local models for tests, demos and benchmarks: no hub download, ever.

`build_tiny_causal_lm(path)` writes a small Llama-style Hugging Face causal LM (random weights unless a
trainer later fits it) plus a byte-level BPE tokenizer trained with the `tokenizers` library on a small
corpus, wrapped in `PreTrainedTokenizerFast` with a chat template. Both are saved with `save_pretrained`, so
`AutoModelForCausalLM.from_pretrained(path)` / `AutoTokenizer.from_pretrained(path)` load them offline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from tpuray.validation import ConfigError

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

DEFAULT_CORPUS = """\
Ray schedules tasks and actors across a cluster. A TPU slice is a group of chips joined by a fast
interconnect. Each worker owns one chip and runs plain PyTorch code on the tpu device. The tpu_dist backend
reduces tensors across all chips of the slice. Tensor parallelism splits attention heads and feed forward
columns across chips, then sums partial results with an all reduce. Continuous batching lets new requests
join a running batch at every decoding step, and the key value cache keeps past attention keys and values so
that each new token costs one small forward pass. The quick brown fox jumps over the lazy dog. Hello world!
How are you today? I am fine, thank you. What is the capital of France? Paris is the capital of France.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Punctuation: , . ; : ! ? ( ) [ ] { } " ' - _ / \\ @ # $ % & * + =
"""


def build_tokenizer(corpus: str | None = None, vocab_size: int = 512, model_max_length: int = 1024):
    """A byte-level BPE tokenizer trained on `corpus` (any text encodes: unseen bytes fall back to bytes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ConfigError(f"vocab_size={vocab_size} is too small: byte-level BPE needs at least 261")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = corpus if corpus else DEFAULT_CORPUS
    tok.train_from_iterator([line for line in text.splitlines() if line.strip()] or [text], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
    )


def build_tiny_causal_lm(
    path: str | Path,
    corpus: str | None = None,
    *,
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_attention_heads: int = 16,
    num_key_value_heads: int | None = None,
    intermediate_size: int = 256,
    num_hidden_layers: int = 2,
    max_position_embeddings: int = 1024,
    seed: int = 0,
) -> Path:
    """Write a tiny Llama-style causal LM + tokenizer to `path` and return it.

    The default has 16 attention heads (and 16 KV heads), so tensor_parallel_size 1, 2, 4, 8 and 16 all
    divide it. Weights are random (seeded) unless you train the model afterwards.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden_size % num_attention_heads:
        raise ConfigError(
            f"hidden_size={hidden_size} must be a multiple of num_attention_heads={num_attention_heads}"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(corpus, vocab_size=vocab_size, model_max_length=max_position_embeddings)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads or num_attention_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = [
        tokenizer.eos_token_id,
        tokenizer.convert_tokens_to_ids("<|im_end|>"),
    ]
    _save(model, path)
    tokenizer.save_pretrained(path)
    return path


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' progress bars off: a tiny model is one shard, loaded or written in milliseconds; a
    bar would only put carriage returns into the caller's logs."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def _save(model, path: str | Path) -> None:
    with _no_progress_bars():
        model.save_pretrained(path)


def train_tiny_causal_lm(
    path: str | Path, corpus: str | None = None, *, steps: int = 150, seed: int = 0, **model_kwargs
) -> Path:
    """`build_tiny_causal_lm(path, corpus, **model_kwargs)`, then fit it to the corpus on this process's
    CPU (AdamW, `steps` steps of 128-token windows) and save it over the random weights: a model whose
    greedy choices are confident, so the same tokens come out of any correct engine and device."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    path = build_tiny_causal_lm(path, corpus, seed=seed, **model_kwargs)
    ids = AutoTokenizer.from_pretrained(path)(corpus or DEFAULT_CORPUS)["input_ids"]
    with _no_progress_bars():
        model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    window = min(128, len(ids) - 1)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - window, (8,), generator=g).tolist()
        batch = torch.tensor([ids[s : s + window] for s in starts])
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    _save(model.eval(), path)
    return path
