"""Rollout engines behind `rpk.core.protocols.Engine`.

`rpk.engine.vllm_engine.VLLMEngine` drives vLLM's `AsyncLLM`; vLLM itself is imported
only when an engine starts, so rpk imports (and its unit tests run) without vLLM.
`rpk.engine.worker_ext` runs inside vLLM's worker and reloads weights in place.
"""
