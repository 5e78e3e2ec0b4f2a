"""The trainer side of the GRPO family: advantages, the losses (GRPO, Dr. GRPO, DAPO,
GSPO, with optional KL and entropy terms), and the torch trainer that implements
`rpk.loop.protocols.Trainer`.

`losses` is pure torch (no model) and is the numerical reference that fused kernels are
tested against; `trainer.TorchTrainer` owns the HF model, the optimizer and checkpoints.
Every trainer method blocks: the asyncio loop calls them through `asyncio.to_thread`.
"""
