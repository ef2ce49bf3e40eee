"""The Ray Serve deployments of an LLM app: the OpenAI ingress (`router.LLMRouter`), one model's replica
(`server.LLMServer`) and what moves its engine off a preempted slice (`failover.EngineSlot`).
"""
