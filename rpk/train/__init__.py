"""The trainer side of the GRPO family: advantages, the losses (GRPO, Dr. GRPO, DAPO,
GSPO, with optional KL and entropy terms), and the torch trainer that implements
`rpk.core.protocols.Trainer`.

`losses` is pure torch (no model) and is the numerical reference the trainer's fused
path is tested against; `trainer.TorchTrainer` owns the HF model and the optimizer, and
writes its half of a checkpoint; `dist.DistTrainer` drives every rank's shard in a
multi-process run. Every trainer method blocks: the loop runs them on one dedicated
thread (`rpk.loop.trainer.AsyncTrainer`).
"""
