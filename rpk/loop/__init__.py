"""The async drivers: one rollout round (`rollout`), one RL step (`step`: the round, the
optimizer step, the weight sync), the streaming trainer feed (`feed`), the trainer driver
(`trainer`), elastic TP between rounds (`elastic`) and a validation pass (`evaluate`).

Nothing here imports torch or vLLM: policies live in `rpk.sched`, and engines, scorers
and the trainer sit behind the Protocols of `rpk.core.protocols`, so the same code runs
against vLLM, scripted fakes and the simulator.
"""
