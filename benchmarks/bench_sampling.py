"""What sampling controls cost in the embedded engine: tokens/s of 16 concurrent requests with
logprobs, with a json_schema response_format (llguidance masks every step) and with penalties, against
plain sampling on the same engine, in one process (no HTTP, no Ray).

Goals (issue #13): json_schema costs <= 1.3x plain, logprobs <= 1.1x (cost = plain tokens/s / tokens/s).

    .venv/bin/python benchmarks/bench_sampling.py [--rounds 3] [--hidden 256]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
VARIANTS = {
    "plain": {},
    "logprobs (top 5)": {"logprobs": True, "top_logprobs": 5},
    "json_schema": {
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    },
    "penalties + logit_bias": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {"5": 1.0}},
}


async def tokens_per_s(server, extra: dict, clients: int, max_tokens: int) -> float:
    async def one(seed: int) -> int:
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "go"}],
            "max_tokens": max_tokens,
            "temperature": 1.0,
            "seed": seed,
            **extra,
        }
        return (await server.handle("chat", body))["usage"]["completion_tokens"]

    await one(0)  # warm (grammar compile, first allocations)
    t = time.perf_counter()
    n = sum(await asyncio.gather(*(one(s) for s in range(clients))))
    return n / (time.perf_counter() - t)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--hidden", type=int, default=256)
    args = ap.parse_args()

    from tpuray.models import build_tiny_causal_lm
    from tpuray.serve.llm import LLMConfig
    from tpuray.serve.llm.backends.embedded import EmbeddedBackend

    with tempfile.TemporaryDirectory() as tmp:
        path = str(
            build_tiny_causal_lm(os.path.join(tmp, "m"), hidden_size=args.hidden, num_attention_heads=4)
        )
        server = EmbeddedBackend(
            LLMConfig(
                model_loading_config={"model_id": "m", "model_source": path},
                llm_engine="embedded",
                engine_kwargs={"max_model_len": 256, "dtype": "float32"},
            )
        )
        results: dict[str, list[float]] = {k: [] for k in VARIANTS}
        try:
            for _ in range(args.rounds):  # interleaved, so drift hits every variant alike
                for name, extra in VARIANTS.items():
                    results[name].append(
                        asyncio.run(tokens_per_s(server, extra, args.clients, args.max_tokens))
                    )
        finally:
            server.shutdown()
    print(
        f"embedded engine, hidden {args.hidden}, {args.clients} concurrent chats, os.cpu_count()={os.cpu_count()}"
    )
    plain = statistics.median(results["plain"])
    print(f"{'variant':<24}{'tokens/s (median)':>18}{'range':>20}{'cost vs plain':>15}")
    for name, xs in results.items():
        med = statistics.median(xs)
        print(f"{name:<24}{med:>18.0f}{f'{min(xs):.0f}-{max(xs):.0f}':>20}{plain / med:>14.2f}x")
    js, lp = (
        plain / statistics.median(results["json_schema"]),
        plain / statistics.median(results["logprobs (top 5)"]),
    )
    print(f"\ngoal json_schema <= 1.3x plain: {js:.2f}x {'MET' if js <= 1.3 else 'NOT MET'}")
    print(f"goal logprobs <= 1.1x plain: {lp:.2f}x {'MET' if lp <= 1.1 else 'NOT MET'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
