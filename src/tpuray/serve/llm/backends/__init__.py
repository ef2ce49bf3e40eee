"""One model's OpenAI semantics on each engine: the interface (`base.Backend`), the backends (`vllm`,
`embedded`, `embedding`) and the factory that picks one from a config (`factory.create_backend`).
"""
