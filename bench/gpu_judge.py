"""The colocated judge on a GPU: its layer pipeline measured against the cost model
behind Figure 13b, and whether CUDA MPS is on.

`rpk.sim.judge` prices a verdict as one prefill whose offloaded layers cross the host
link, copied either before each such layer runs (unpipelined) or on a side stream up to
`prefetch` offloaded layers ahead (pipelined, vLLM's `offload_backend="prefetch"`).
`bench/judge.py`'s Figure 13b rests on that arithmetic; vLLM is not installed on the lent
GPU, so this runs the same schedule by hand: decoder layers of the paper's judge shape
(Qwen2.5-7B: q/k/v/o with grouped-query causal attention, the gated MLP), half of them
offloaded to pinned host memory, at batch 1 over a few prompt lengths, each way timed
with CUDA events. It measures the host link (one layer's pinned copy) and a resident
layer's compute, puts both into the cost model, and sets the model's pipelined and
unpipelined times beside the measured ones. The three ways must give the same output (to
the GPU's own run-to-run noise).

    python -m bench.gpu_judge --out bench/results/gpu_judge.json   # CUDA
    python -m bench.gpu_judge --dry                            # CPU, toy shape

`bench.gpu_check` runs it as its `judge_offload` row: it fails when the outputs differ,
when pipelining is slower than copying in line, or when the model misses a measured time
by more than `TOLERANCE`.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from bench import common
from bench.common import Col, write_json
from rpk.sim.judge import GpuCost, JudgeShape, forward_s, offloaded_layers, qwen2_layer_params

TOLERANCE = 0.20
OUTPUT_TOLERANCE = 1e-2


@dataclass(frozen=True, slots=True)
class Decoder:
    """A decoder layer's shape, as the forward needs it."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int

    @property
    def kv(self) -> int:
        return self.hidden // self.heads * self.kv_heads

    def splits(self) -> list[int]:
        """A layer's flat weight buffer cut into q, k, v, o, gate, up, down."""
        h, kv, i = self.hidden, self.kv, self.intermediate
        return [h * h, h * kv, h * kv, h * h, h * i, h * i, i * h]

    def sim_shape(self) -> JudgeShape:
        return JudgeShape(self.name, self.layers, self.hidden,
                          qwen2_layer_params(self.hidden, self.intermediate, self.heads, self.kv_heads))


QWEN25_7B = Decoder("Qwen2.5-7B", 28, 3584, 18944, 28, 4)
TOY = Decoder("toy", 4, 64, 128, 4, 2)


def layer_forward(d: Decoder, x: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    h, kv, i = d.hidden, d.kv, d.intermediate
    q, k, v, o, gate, up, down = flat.split(d.splits())
    n = x.shape[0]
    hd = h // d.heads
    # Pre-norms as Qwen2 has them (unit weights): without them 28 layers of random
    # weights overflow bf16 and every comparison is against NaN.
    a = F.rms_norm(x, (h,), eps=1e-6)
    # (1, heads, n, head_dim): the layout whose causal attention runs as a fused (flash)
    # kernel, as a serving engine's prefill does, rather than materialising n x n scores.
    qs = (a @ q.view(h, h)).view(1, n, d.heads, hd).transpose(1, 2)
    ks = (a @ k.view(h, kv)).view(1, n, d.kv_heads, hd).transpose(1, 2)
    vs = (a @ v.view(h, kv)).view(1, n, d.kv_heads, hd).transpose(1, 2)
    rep = d.heads // d.kv_heads
    attn = F.scaled_dot_product_attention(qs, ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1),
                                          is_causal=True)
    x = x + attn.transpose(1, 2).reshape(n, h) @ o.view(h, h)
    m = F.rms_norm(x, (h,), eps=1e-6)
    return x + (F.silu(m @ gate.view(h, i)) * (m @ up.view(h, i))) @ down.view(i, h)


class Stack:
    """The layers' weights, the offloaded ones in pinned host memory, and `prefetch + 1`
    device buffers they are copied into."""

    def __init__(self, d: Decoder, offloaded: int, prefetch: int, device: torch.device) -> None:
        self.d, self.prefetch, self.device = d, prefetch, device
        size = sum(d.splits())
        self.streamed = set(offloaded_layers(d.layers, offloaded))
        g = torch.Generator(device=device).manual_seed(0)
        # Scaled so activations stay finite through every layer in bf16.
        self.weights = [torch.randn(size, generator=g, device=device, dtype=torch.bfloat16) * (0.5 / d.hidden ** 0.5)
                        for _ in range(d.layers)]
        cuda = device.type == "cuda"
        self.host = {i: self.weights[i].cpu().pin_memory() if cuda else self.weights[i].clone()
                     for i in self.streamed}
        self.buffers = [torch.empty(size, device=device, dtype=torch.bfloat16) for _ in range(prefetch + 1)]
        self.copies = torch.cuda.Stream(device) if cuda else None

    def resident(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.weights:
            x = layer_forward(self.d, x, w)
        return x

    def unpipelined(self, x: torch.Tensor) -> torch.Tensor:
        for i, w in enumerate(self.weights):
            if i in self.streamed:
                w = self.buffers[0].copy_(self.host[i], non_blocking=True)
            x = layer_forward(self.d, x, w)
        return x

    def pipelined(self, x: torch.Tensor) -> torch.Tensor:
        if self.copies is None:  # one CPU stream: the schedule, nothing overlapped
            return self.unpipelined(x)
        order = sorted(self.streamed)
        main = torch.cuda.current_stream(self.device)
        filled: list[torch.cuda.Event] = []
        freed: list[torch.cuda.Event] = []  # a buffer's last reader finished

        def copy(k: int) -> None:
            with torch.cuda.stream(self.copies):
                if k > self.prefetch:
                    self.copies.wait_event(freed[k - self.prefetch - 1])
                self.buffers[k % len(self.buffers)].copy_(self.host[order[k]], non_blocking=True)
                filled.append(self.copies.record_event())

        for k in range(min(self.prefetch, len(order))):
            copy(k)
        k = 0
        for i, w in enumerate(self.weights):
            if i in self.streamed:
                if k + self.prefetch < len(order):
                    copy(k + self.prefetch)
                main.wait_event(filled[k])
                w = self.buffers[k % len(self.buffers)]
            x = layer_forward(self.d, x, w)
            if i in self.streamed:
                freed.append(main.record_event())
                k += 1
        return x


def timed(fn: Callable[[], torch.Tensor], reps: int, cuda: bool) -> tuple[float, torch.Tensor]:
    """Median seconds of `reps` calls after one warm-up, and the last output."""
    out = fn()
    times = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times), out


def link_bytes_s(stack: Stack, reps: int) -> float:
    """Pinned host-to-device bytes per second, one layer's copy at a time."""
    i = min(stack.streamed)
    seconds, _ = timed(lambda: stack.buffers[0].copy_(stack.host[i], non_blocking=True), reps,
                       stack.device.type == "cuda")
    return stack.host[i].numel() * stack.host[i].element_size() / seconds


def measure(d: Decoder, lengths: Sequence[int], offloaded: int, prefetch: int, device: torch.device,
            reps: int = 5) -> dict[str, Any]:
    cuda = device.type == "cuda"
    stack = Stack(d, offloaded, prefetch, device)
    link = link_bytes_s(stack, reps)
    shape = d.sim_shape()
    rows = []
    for n in lengths:
        x = torch.randn(n, d.hidden, device=device, dtype=torch.bfloat16,
                        generator=torch.Generator(device=device).manual_seed(n))
        with torch.inference_mode():
            resident, ref = timed(functools.partial(stack.resident, x), reps, cuda)
            unpipelined, out_u = timed(functools.partial(stack.unpipelined, x), reps, cuda)
            pipelined, out_p = timed(functools.partial(stack.pipelined, x), reps, cuda)
            _, again = timed(functools.partial(stack.resident, x), 1, cuda)
        # A GPU's GEMMs need not repeat bit for bit; a layer read from the wrong buffer
        # or before its copy landed would move the output by its own size.
        scale = float(ref.float().abs().max())
        repeat_diff = float((again.float() - ref.float()).abs().max()) / scale
        streamed_diff = max(float((o.float() - ref.float()).abs().max()) for o in (out_u, out_p)) / scale
        # The model's FLOP rate is the one this resident forward reached: what is left to
        # predict is the copies and their overlap.
        flops = (2 * shape.layer_params * n + 2 * shape.hidden * n * n) * d.layers / resident
        gpu = GpuCost(flops=flops, mfu=1.0, pcie_bytes_s=link)
        model_u = forward_s(shape, gpu, [n], offloaded, pipelined=False)
        model_p = forward_s(shape, gpu, [n], offloaded, pipelined=True, prefetch=prefetch)
        rows.append(dict(
            tokens=n, resident_ms=1e3 * resident, unpipelined_ms=1e3 * unpipelined, pipelined_ms=1e3 * pipelined,
            speedup=unpipelined / pipelined, model_speedup=model_u / model_p,
            model_err_unpipelined=model_u / unpipelined - 1, model_err_pipelined=model_p / pipelined - 1,
            tflops=flops / 1e12, repeat_diff=repeat_diff, streamed_diff=streamed_diff,
        ))
    return dict(shape=d.name, layers=d.layers, offloaded=offloaded, prefetch=prefetch,
                layer_mb=shape.layer_bytes / 1e6, link_gb_s=link / 1e9, rows=rows)


def verdict(result: dict[str, Any], timed_for_real: bool) -> str | None:
    """Why the measurement fails the check, or None."""
    for r in result["rows"]:
        if not r["streamed_diff"] <= OUTPUT_TOLERANCE:  # NaN fails too
            return (f"{r['tokens']} tokens: streamed layers moved the output by {r['streamed_diff']:.1e} of its "
                    f"scale (resident run twice: {r['repeat_diff']:.1e})")
        if not timed_for_real:
            continue
        if r["speedup"] < 1.0:
            return (f"{r['tokens']} tokens: pipelined {r['pipelined_ms']:.1f} ms slower than "
                    f"unpipelined {r['unpipelined_ms']:.1f}")
        worst = max(r["model_err_unpipelined"], r["model_err_pipelined"], key=abs)
        if abs(worst) > TOLERANCE:
            return (f"{r['tokens']} tokens: the cost model misses by {worst:+.0%} (unpipelined "
                    f"{r['model_err_unpipelined']:+.0%}, pipelined {r['model_err_pipelined']:+.0%})")
    return None


def summary(result: dict[str, Any]) -> str:
    top = result["rows"][-1]
    return (f"{result['shape']} {result['offloaded']}/{result['layers']} layers streamed, link "
            f"{result['link_gb_s']:.1f} GB/s, {top['tokens']} tokens: resident {top['resident_ms']:.1f} ms, "
            f"unpipelined {top['unpipelined_ms']:.1f}, pipelined {top['pipelined_ms']:.1f} "
            f"({top['speedup']:.2f}x, model {top['model_speedup']:.2f}x)")


def run(dry: bool, lengths: Sequence[int], offloaded: int, prefetch: int) -> tuple[bool, dict[str, Any]]:
    """(on CUDA, the measurement): the 7B shape at `lengths` with `offloaded` layers
    streamed on a GPU; on CPU (or `dry`) the toy shape, two short lengths, half streamed."""
    if torch.cuda.is_available() and not dry:
        return True, measure(QWEN25_7B, lengths, offloaded, prefetch, torch.device("cuda"))
    return False, measure(TOY, (16, 48), TOY.layers // 2, prefetch, torch.device("cpu"), reps=1)


def check(dry: bool) -> str:
    """`bench.gpu_check`'s row: the 7B shape on CUDA, the toy one on CPU (outputs only)."""
    cuda, result = run(dry, (2048, 8192), QWEN25_7B.layers // 2, 1)
    failed = verdict(result, cuda)
    if failed:
        raise AssertionError(failed)
    return summary(result) + ("" if cuda else " (CPU: outputs checked, times not)")


COLS = [Col("tokens", "tokens", 7, "d"), Col("resident ms", "resident_ms", 12, ".1f"),
        Col("unpipelined", "unpipelined_ms", 12, ".1f"), Col("pipelined", "pipelined_ms", 10, ".1f"),
        Col("speedup", "speedup", 8, ".2f"), Col("model", "model_speedup", 6, ".2f"),
        Col("err unp", "model_err_unpipelined", 8, "+.0%"), Col("err pip", "model_err_pipelined", 8, "+.0%"),
        Col("TFLOP/s", "tflops", 8, ".0f"), Col("diff", "streamed_diff", 9, ".1e"),
        Col("repeat", "repeat_diff", 9, ".1e")]


def main(argv: list[str] | None = None) -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--dry", action="store_true", help="the toy shape on CPU (outputs checked, times not)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--offloaded", type=int, default=QWEN25_7B.layers // 2)
    ap.add_argument("--prefetch", type=int, default=1)
    args = ap.parse_args(argv)
    cuda, result = run(args.dry, args.lengths, args.offloaded, args.prefetch)
    print(f"judge offload on {torch.cuda.get_device_name(0) if cuda else 'CPU (toy shape)'}: "
          f"{result['shape']}, {result['offloaded']} of {result['layers']} layers ({result['layer_mb']:.0f} MB each) "
          f"streamed, prefetch {result['prefetch']}, host link {result['link_gb_s']:.1f} GB/s")
    common.print_table(result["rows"], COLS)
    write_json(args.out, result)
    failed = verdict(result, cuda)
    if failed:
        print(f"FAIL: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
