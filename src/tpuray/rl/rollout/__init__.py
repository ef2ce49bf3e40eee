"""Rollout engines: the API every one has (`engine.RolloutEngine`, over a `protocol.GenerationEngine`),
made by `factory.rollout_engine`. Twins by engine: tpuray's embedded engine (`embedded`, its per-rank
worker `embedded_worker`, colocated in a trainer's workers `embedded_colocated`) and vLLM (`vllm`,
`vllm_worker`, `vllm_colocated`); `hosted` is what both colocated engines share."""
