"""The announcement's Ray Serve LLM sample with `ray.serve.llm` -> `tpuray.serve.llm`, on an EMULATED slice.

The seed block below is the announcement's code unchanged except for the import and the model: there is
no hub download here, so the model is a tiny local Llama-style model with 16 attention heads of 64 dims
(so that tensor_parallel_size=16 divides them and vLLM's CPU kernels take them), built with
`tpuray.models.build_tiny_causal_lm`. Its weights are random, so its text is gibberish: this shows the
serving path, not a language model. With vLLM installed it serves on vLLM (one vLLM worker per emulated
chip: 16 processes on a 4x4, so use --topology 2x2 on a small machine); otherwise on the embedded engine.

    .venv/bin/python examples/serve_seed.py              # the seed's 4x4 slice: 16 emulated chips, TP=16
    .venv/bin/python examples/serve_seed.py --topology 2x2   # a 4-chip slice for small machines (TP=4)
"""

from __future__ import annotations

import argparse
import socket
import tempfile

from tpuray.emulator import EmulatedCluster, SliceRequest
from tpuray.models import build_tiny_causal_lm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--topology", default="4x4", help="v6e slice topology to emulate (default: the seed's 4x4)"
    )
    args = ap.parse_args()
    chips = {"4x4": 16, "2x2": 4, "2x4": 8}[args.topology]

    with (
        tempfile.TemporaryDirectory() as tmp,
        EmulatedCluster([SliceRequest("TPU-V6E", args.topology)]) as cluster,
    ):
        cluster.connect()
        model_path = str(
            build_tiny_causal_lm(
                f"{tmp}/tiny-llama-16h",
                hidden_size=1024,
                num_attention_heads=16,
                max_position_embeddings=8192,
            )
        )

        # --- the seed sample (ray.serve.llm -> tpuray.serve.llm) ---------------------------------------
        from tpuray.serve.llm import (
            LLMConfig,
            LLMServingArgs,
            ModelLoadingConfig,
            build_openai_app,
        )

        llm_config = LLMConfig(
            model_loading_config=ModelLoadingConfig(
                model_id="tiny-llama-16h",
                model_source=model_path,  # a local directory: no hub download
            ),
            # On GPU: accelerator_type="H100"
            accelerator_type="TPU-V6E",
            accelerator_config={
                "kind": "tpu",
                "topology": args.topology,
            },
            placement_group_config={
                "bundle_per_worker": {"TPU": 1},
            },
            engine_kwargs={
                "tensor_parallel_size": chips,
                "enable_expert_parallel": True,  # accepted; the tiny dense model has no experts
                "max_model_len": 8192,
            },
        )
        app = build_openai_app(LLMServingArgs(llm_configs=[llm_config]))
        # -------------------------------------------------------------------------------------------------

        from openai import OpenAI
        from ray import serve

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        try:
            serve.run(app)
            client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
            info = (
                serve.get_deployment_handle("LLMServer:tiny-llama-16h", app_name="default")
                .describe.remote()
                .result()
            )
            print(
                f"replica: {info['engine']} engine, tensor_parallel_size={info['tensor_parallel_size']} on "
                f"{info['slice']}, emulated={info['emulated']}"
            )
            reply = client.chat.completions.create(
                model="tiny-llama-16h",
                messages=[{"role": "user", "content": "Hello TPU!"}],
                max_tokens=16,
                seed=0,
            )
            print("chat reply (random weights):", repr(reply.choices[0].message.content), reply.usage)
            print("streamed:", end=" ", flush=True)
            for chunk in client.completions.create(
                model="tiny-llama-16h", prompt="Ray", max_tokens=8, stream=True
            ):
                print(repr(chunk.choices[0].text), end=" ", flush=True)
            print()
        finally:
            serve.shutdown()


if __name__ == "__main__":
    main()
