"""The asyncio heart of rpk: scheduling policy, rollout driver, reward and trainer hand-offs.

Nothing here imports vLLM or touches a device: engines, reward functions and the trainer
sit behind the Protocols in `rpk.loop.protocols`, so the same code runs against vLLM,
scripted fakes and the simulator.
"""
