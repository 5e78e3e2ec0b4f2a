"""The trainer side of GRPO: group advantages, the PPO-clip token loss, and the torch
trainer that implements `rpk.loop.protocols.Trainer`.

`losses` is pure torch (no model) and is the numerical reference that fused kernels are
tested against; `trainer.TorchTrainer` owns the HF model, the optimizer and checkpoints.
Every trainer method blocks: the asyncio loop calls them through `asyncio.to_thread`.
"""
