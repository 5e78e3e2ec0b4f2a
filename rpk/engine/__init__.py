"""The rollout fleet and the vLLM adapter behind `rpk.core.protocols.Engine`.

`rpk.engine.vllm_engine.VLLMEngine` drives vLLM's `AsyncLLM`; vLLM itself is imported
only when an engine starts, so rpk imports (and its unit tests run) without vLLM.
`rpk.engine.fleet` runs the replicas' layouts; how weights reach them is `rpk.sync`.
"""
