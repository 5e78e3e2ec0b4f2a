"""What a judge LLM costs on a GPU: one forward pass per verdict, its weights resident or
streamed layer by layer over PCIe (RollPacker's Figure 13b), and a step's reward stage
with the judge colocated on the rollout GPUs or on a GPU of its own (Figure 13a). Pure
arithmetic on the model's shape, the GPU's FLOPs and the host link's bandwidth.

Assumptions, each a parameter:

- A verdict is one forward pass over the judge's whole input (question, reference and
  response): a logprob verdict reads the first output token's log-probs, which the
  prefill itself yields. A prefill is compute-bound: per layer, 2 FLOPs per weight per
  token, plus causal attention's 2 x hidden x L^2 per sequence of L tokens (QK^T and AV,
  half the square each). Embeddings, final norm and head stay resident and cost
  nothing here (the head runs on one token per sequence).
- The GPU delivers `flops x mfu x sm_share` FLOP/s to the judge: `sm_share` is the part
  of the SMs it gets beside the rollout under MPS (1 on a GPU of its own).
- An offloaded layer's weights cross the host link at `pcie_bytes_s` (pinned memory),
  once per forward pass whatever the batch. Offloaded layers are spread evenly over the
  depth, as vLLM's prefetch groups spread them (the last of each group).
- Unpipelined offload copies a layer, then runs it. Pipelined offload (vLLM's
  `offload_backend="prefetch"`) copies on a side stream up to `prefetch` offloaded
  layers ahead of the compute: a copy starts once the offloaded layer `prefetch` before
  it has started computing (prefetch + 1 buffers).
- Figure 13a: responses finish as they would in a synchronous round, at
  `rollout_s x length / max(length)` (decode steps cost about the same, every response
  starts at once). Each judge serves its own queue in order, batching every request
  waiting when it frees up into one forward pass. A colocated judge on each rollout GPU
  (requests round robin) slows the rollout on its GPU by `interference` of its busy
  time; a dedicated judge takes one GPU from rollout and training, whose times grow by
  gpus / (gpus - 1). The reward stage's exposed time is the last verdict after the
  last response.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class JudgeShape:
    """A decoder's shape, as far as its forward's cost goes."""

    name: str
    layers: int
    hidden: int
    layer_params: int  # weights of one decoder layer
    bytes_per_param: int = 2  # bf16

    def __post_init__(self) -> None:
        if min(self.layers, self.hidden, self.layer_params, self.bytes_per_param) < 1:
            raise ValueError(f"JudgeShape {self.name}: every size must be >= 1, got {self}")

    @property
    def layer_bytes(self) -> int:
        return self.layer_params * self.bytes_per_param


def qwen2_layer_params(hidden: int, intermediate: int, heads: int, kv_heads: int) -> int:
    """Weights of one Qwen2 decoder layer: q/k/v/o projections (with q/k/v biases), the
    gated MLP, two RMSNorms."""
    kv = hidden // heads * kv_heads
    attention = hidden * hidden * 2 + hidden * kv * 2 + hidden + 2 * kv
    return attention + 3 * hidden * intermediate + 2 * hidden


# The paper's judge in every Figure 13 setting: Qwen2.5-7B-Instruct (28 layers).
QWEN25_7B = JudgeShape("Qwen2.5-7B", 28, 3584, qwen2_layer_params(3584, 18944, 28, 4))


@dataclass(frozen=True, slots=True)
class GpuCost:
    """What the judge gets of a GPU and its host link."""

    flops: float = 989e12  # dense bf16 peak (H800 / H100 SXM)
    mfu: float = 0.4  # of the peak, reached by a long prefill
    pcie_bytes_s: float = 50e9  # pinned host-to-device copies (PCIe 5 x16 reaches ~50 GB/s)
    sm_share: float = 1.0  # of the SMs, beside the rollout under MPS

    def __post_init__(self) -> None:
        if not (self.flops > 0 and self.pcie_bytes_s > 0 and 0 < self.mfu <= 1 and 0 < self.sm_share <= 1):
            raise ValueError(f"GpuCost: flops and pcie_bytes_s > 0, mfu and sm_share in (0, 1], got {self}")

    @property
    def judge_flops(self) -> float:
        return self.flops * self.mfu * self.sm_share


def layer_compute_s(shape: JudgeShape, gpu: GpuCost, lengths: Sequence[int]) -> float:
    """One decoder layer's prefill over sequences of `lengths` tokens."""
    flops = sum(2 * shape.layer_params * n + 2 * shape.hidden * n * n for n in lengths)
    return flops / gpu.judge_flops


def offloaded_layers(layers: int, offloaded: int) -> tuple[int, ...]:
    """Which of `layers` layers are offloaded: `offloaded` of them, evenly spread, each
    the last of its stretch (the resident ones before it hide its copy)."""
    if not 0 <= offloaded <= layers:
        raise ValueError(f"offloaded layers must be in [0, {layers}], got {offloaded}")
    return tuple((i + 1) * layers // offloaded - 1 for i in range(offloaded)) if offloaded else ()


def forward_s(shape: JudgeShape, gpu: GpuCost, lengths: Sequence[int], offloaded: int, *,
              pipelined: bool, prefetch: int = 1) -> float:
    """One forward pass over `lengths` with `offloaded` layers streamed from the host."""
    if prefetch < 1:
        raise ValueError(f"prefetch must be >= 1 (layers copied ahead), got {prefetch}")
    compute = layer_compute_s(shape, gpu, lengths)
    copy = shape.layer_bytes / gpu.pcie_bytes_s
    streamed = set(offloaded_layers(shape.layers, offloaded))
    if not pipelined:
        return shape.layers * compute + len(streamed) * copy
    copy_end = 0.0
    compute_end = 0.0
    started: list[float] = []  # compute start of each offloaded layer, in order
    for layer in range(shape.layers):
        if layer in streamed:
            k = len(started)
            # prefetch + 1 buffers: one being computed on, `prefetch` being filled.
            buffer_free = started[k - prefetch] if k >= prefetch else 0.0
            copy_end = max(copy_end, buffer_free) + copy
            start = max(compute_end, copy_end)
            started.append(start)
        else:
            start = compute_end
        compute_end = start + compute
    return compute_end


@dataclass(frozen=True, slots=True)
class OffloadTimes:
    """Mean seconds per verdict (batch 1) over the lengths asked."""

    resident: float
    unpipelined: float
    pipelined: float

    @property
    def pipeline_speedup(self) -> float:
        return self.unpipelined / self.pipelined

    @property
    def pipelined_over_resident(self) -> float:
        return self.pipelined / self.resident


def offload_times(shape: JudgeShape, gpu: GpuCost, lengths: Sequence[int], offloaded: int,
                  prefetch: int = 1) -> OffloadTimes:
    """Figure 13b: the mean judge time per request at batch 1, resident, offloaded
    unpipelined, offloaded pipelined."""
    if not lengths:
        raise ValueError("offload_times needs at least one request length")

    def mean(fn: Callable[[int], float]) -> float:
        return sum(fn(n) for n in lengths) / len(lengths)

    return OffloadTimes(
        mean(lambda n: forward_s(shape, gpu, [n], 0, pipelined=False)),
        mean(lambda n: forward_s(shape, gpu, [n], offloaded, pipelined=False)),
        mean(lambda n: forward_s(shape, gpu, [n], offloaded, pipelined=True, prefetch=prefetch)),
    )


Service = Callable[[Sequence[int]], float]


def queue_end(arrivals: Sequence[tuple[float, int]], servers: int, service: Service) -> tuple[float, list[float]]:
    """(when the last verdict is out, each server's busy seconds): `arrivals` (time,
    tokens) dealt round robin to `servers` judges, each batching what waits for it."""
    if servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers}")
    queues: list[list[tuple[float, int]]] = [[] for _ in range(servers)]
    for i, item in enumerate(sorted(arrivals)):
        queues[i % servers].append(item)
    end, busy = 0.0, []
    for queue in queues:
        free, spent, i = 0.0, 0.0, 0
        while i < len(queue):
            start = max(free, queue[i][0])
            batch = [n for t, n in queue[i:] if t <= start]
            took = service(batch)
            free, spent, i = start + took, spent + took, i + len(batch)
        end, busy = max(end, free), [*busy, spent]
    return end, busy


@dataclass(frozen=True, slots=True)
class StepShape:
    """One node's step: `gpus`, its rollout and training seconds on all of them, and its
    responses' judge input lengths (question and reference included)."""

    gpus: int
    rollout_s: float
    train_s: float
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.gpus < 2 or not self.lengths or self.rollout_s <= 0 or self.train_s < 0:
            raise ValueError(f"StepShape needs gpus >= 2, lengths, rollout_s > 0, train_s >= 0: got {self}")

    def arrivals(self, rollout_s: float) -> list[tuple[float, int]]:
        top = max(self.lengths)
        return [(rollout_s * n / top, n) for n in self.lengths]


@dataclass(frozen=True, slots=True)
class StepTimes:
    rollout_s: float
    reward_exposed_s: float
    train_s: float

    @property
    def step_s(self) -> float:
        return self.rollout_s + self.reward_exposed_s + self.train_s


def dedicated_step(step: StepShape, shape: JudgeShape, gpu: GpuCost) -> StepTimes:
    """Figure 13a's baseline: the judge resident on one GPU of the node, rollout and
    training on the others."""
    scale = step.gpus / (step.gpus - 1)
    rollout = step.rollout_s * scale
    end, _ = queue_end(step.arrivals(rollout), 1, lambda b: forward_s(shape, gpu, b, 0, pipelined=False))
    return StepTimes(rollout, max(0.0, end - rollout), step.train_s * scale)


def colocated_step(step: StepShape, shape: JudgeShape, gpu: GpuCost, offloaded: int,
                   interference: float, prefetch: int = 1) -> StepTimes:
    """RollPacker's: a judge on every rollout GPU under MPS, `offloaded` layers streamed
    (pipelined), the rollout slowed by `interference` of the busiest judge's time."""
    if not 0 <= interference <= 1:
        raise ValueError(f"interference must be in [0, 1], got {interference}")

    def service(batch: Sequence[int]) -> float:
        return forward_s(shape, gpu, batch, offloaded, pipelined=True, prefetch=prefetch)

    _, busy = queue_end(step.arrivals(step.rollout_s), step.gpus, service)
    rollout = step.rollout_s + interference * max(busy)
    end, _ = queue_end(step.arrivals(rollout), step.gpus, service)
    return StepTimes(rollout, max(0.0, end - rollout), step.train_s)
