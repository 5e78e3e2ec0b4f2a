"""The weight path: how the trainer's weights reach the rollout replicas.

- `backends`: every backend and its record (where it applies, its trainer end, its
  worker engine, whether it can be verified); the one place a backend is chosen.
- `protocols`: the seams (`WeightTransport`, `Receiving`).
- `transport` (`CollectiveTransport`, `make_transport`) over `lanes` (group, CUDA IPC,
  shared-memory IPC) and `m2n_lane`; `spool` (safetensors files); `adapter` (a LoRA
  run's adapter versions); `verify` (`run.verify_sync`).
- The trainer's side (what `rpk.train` and the builder import): `m2n_send` and
  `m2n_plan` (every rank's shards), `gloo` (the groups), `cpu_ipc` (parameters in
  /dev/shm, staging files).
- `worker`: what runs inside vLLM's workers (rpk's engines, the worker extension).
"""
