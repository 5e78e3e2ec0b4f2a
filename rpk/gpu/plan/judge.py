"""A judge colocated on the rollout GPUs (RollPacker's LLM-as-a-judge): a judge replica
at TP 1 on every GPU, beside the rollout's, as the paper runs 8 judge workers on 8 GPUs
under CUDA MPS. The actor's KV cache leaves it little room, so the judge keeps part of
its decoder layers resident and streams the rest from pinned host memory with vLLM's
prefetch offload (`offload_backend="prefetch"`, `vllm/config/offload.py`): layers are
grouped every `offload_group_size`, the last `offload_num_in_group` of each group live
on host, and a static GPU pool of `offload_prefetch_step` layer buffers
(`vllm/model_executor/offloader/prefetch.py`, `StaticBufferPool`) takes each one just
before its forward.

Per GPU the judge holds its context, its resident weights (the root and the resident
layers, bf16), the prefetch buffers, its reserve (CUDA graphs, a prefill, the sampler)
and a KV cache for `max_num_seqs` sequences of its longest input (the question, the
tail of the longest response it judges, the template and the verdict). While the
trainer has the GPUs it sleeps at level 1 (its weights never change: they wait on host)
and keeps only its context. On host: its processes, the offloaded layers pinned, and
while it sleeps its resident weights.

The plan offloads the fewest layers that leave the rollout at least
`ROLLOUT_KV_SHARE` of the KV cache it has with the judge fully streamed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rpk.gpu.plan.pricing import (
    VLLM_ENGINE_HOST_BYTES,
    VLLM_WORKER_HOST_BYTES,
    JudgeKnobs,
    Knobs,
    Resident,
    vllm_fixed,
)

# The rollout's KV cache with the judge beside it is kept at least this share of the one
# it has with every judge layer streamed: the actor's cache is what a round runs on.
ROLLOUT_KV_SHARE = 0.9
# Layers prefetched ahead (vLLM's default): one buffer, each copy hidden behind a layer.
PREFETCH_STEP = 1
# The judge's template, system message and reference around the question and response.
TEMPLATE_TOKENS = 512


@dataclass(frozen=True, slots=True)
class JudgeLayout:
    """How the judge's layers are split between the GPU and pinned host memory."""

    group_size: int  # 0: nothing offloaded
    num_in_group: int

    def offloaded(self, layers: int) -> int:
        """Layers on host: the last `num_in_group` of every group of `group_size`."""
        if not self.group_size:
            return 0
        return sum(1 for i in range(layers) if i % self.group_size >= self.group_size - self.num_in_group)

    def engine_args(self) -> dict[str, object]:
        """vLLM 0.32's `AsyncEngineArgs` for it (`offload_*`, arg_utils.py)."""
        if not self.group_size:
            return {}
        return {"offload_backend": "prefetch", "offload_group_size": self.group_size,
                "offload_num_in_group": self.num_in_group, "offload_prefetch_step": PREFETCH_STEP}


def layouts(layers: int) -> list[JudgeLayout]:
    """Every split from none offloaded to all, fewest offloaded first (ties: the smaller
    group, whose offloaded layers spread more evenly)."""
    options = {JudgeLayout(0, 1)} | {JudgeLayout(g, n) for g in range(2, 9) for n in range(1, g + 1)}
    return sorted(options, key=lambda o: (o.offloaded(layers), o.group_size))


def streamed_all(layers: int) -> JudgeLayout:
    return layouts(layers)[-1]


def _knobs(j: JudgeKnobs) -> Knobs:
    return Knobs(max_model_len=j.max_model_len, max_num_seqs=j.max_num_seqs)


def _layer_bytes(j: JudgeKnobs) -> int:
    return j.shape.layer_params * _knobs(j).engine_bytes


def kv_bytes(j: JudgeKnobs) -> int:
    return j.max_num_seqs * j.max_model_len * j.shape.kv_bytes_per_token(_knobs(j).kv_bytes)


def resident_bytes(j: JudgeKnobs, layout: JudgeLayout) -> int:
    kept = j.shape.num_layers - layout.offloaded(j.shape.num_layers)
    return (j.shape.root_params + kept * j.shape.layer_params) * _knobs(j).engine_bytes


def awake(j: JudgeKnobs, layout: JudgeLayout) -> list[Resident]:
    """The judge on a GPU while it judges (beside rollout), its context aside."""
    reserve = next(r.bytes for r in vllm_fixed(j.shape, _knobs(j), 1) if r.name == "reserve")
    buffers = PREFETCH_STEP * _layer_bytes(j) if layout.offloaded(j.shape.num_layers) else 0
    return [
        Resident("judge", "weights", resident_bytes(j, layout)),
        *([Resident("judge", "prefetch_buffers", buffers)] if buffers else []),
        Resident("judge", "reserve", reserve),
        Resident("judge", "kv_cache", kv_bytes(j)),
    ]


def gpu_memory_utilization(j: JudgeKnobs, layout: JudgeLayout, gpu_bytes: int) -> float:
    """The judge engine's share of a GPU (three decimals, rounded up: its KV cache is
    what that share leaves once its weights, buffers and reserve are in). Its context is
    not in it: vLLM's budget starts after it (`vllm/v1/worker/gpu_worker.py`, the memory
    snapshot taken once the context and NCCL are up)."""
    need = sum(r.bytes for r in awake(j, layout))
    return math.ceil(need / gpu_bytes * 1000) / 1000


def host(j: JudgeKnobs, layout: JudgeLayout, gpus: int) -> tuple[list[Resident], list[Resident]]:
    """A node's RAM for its `gpus` judges: (whatever the moment: their processes and the
    offloaded layers, pinned; asleep at level 1, also: the resident weights backed up)."""
    pinned = layout.offloaded(j.shape.num_layers) * _layer_bytes(j)
    always = [
        Resident("judge", "processes", gpus * (VLLM_ENGINE_HOST_BYTES + VLLM_WORKER_HOST_BYTES)),
        *([Resident("judge", "offloaded_layers", gpus * pinned)] if pinned else []),
    ]
    return always, [Resident("judge", "weights_backup", gpus * resident_bytes(j, layout))]
