"""The async drivers: one rollout round (`rollout`) and one RL step (`step`: the round,
the streaming trainer feed, the optimizer step, the weight sync).

Nothing here imports torch or vLLM: policies live in `rpk.sched`, and engines, scorers
and the trainer sit behind the Protocols of `rpk.core.protocols`, so the same code runs
against vLLM, scripted fakes and the simulator.
"""
