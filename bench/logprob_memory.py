"""Peak memory and time of one forward+backward of per-token log-prob + entropy from
hidden states and the LM head: the naive full-logits reference against the chunked
kernel (rpk.kernels), at Qwen2.5-0.5B's sizes by default (vocab 152,064, hidden 896).

    .venv/bin/python -m bench.logprob_memory --out bench/results/logprob_memory.json
    .venv/bin/python -m bench.logprob_memory --seq-lens 512 1024 --vocab 32000

Each (variant, sequence length) runs in a fresh subprocess, so that one run's freed but
still-mapped memory cannot hide in another's peak. The peak is measured above what the
process holds once the inputs exist (hidden, weight, targets), so it counts the logits,
the saved activations and the gradients (d weight alone is vocab x hidden):
- CUDA: torch.cuda.max_memory_allocated minus the allocated bytes before the run;
- CPU: the kernel's resident-set high-water mark (VmHWM, reset through
  /proc/self/clear_refs right before the run) minus VmRSS at that moment. The torch CPU
  allocator has no peak statistics and tracemalloc does not see torch's allocations.
The time is the fastest of --repeats runs, after one small warm-up run.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench import common
from bench.common import Col, table_header, table_line, write_json
from rpk.kernels import reference_token_logprobs_entropy, token_logprobs_entropy
from rpk.kernels.chunked import DEFAULT_CHUNK_TOKENS, DEFAULT_CHUNK_VOCAB

VARIANTS = ("naive", "chunked")
ROOT = Path(__file__).resolve().parents[1]
MB = 1024 * 1024


def _proc_status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_cpu_peak() -> int:
    """Resets the high-water mark and returns the current RSS in bytes."""
    Path("/proc/self/clear_refs").write_text("5")
    return _proc_status_kb("VmRSS") * 1024


def _step(variant: str, hidden, weight, targets, args) -> None:
    if variant == "naive":
        logp, entropy = reference_token_logprobs_entropy(hidden, weight, targets, args.temperature)
    else:
        logp, entropy = token_logprobs_entropy(
            hidden, weight, targets, args.temperature, args.chunk_tokens, args.chunk_vocab
        )
    # Both outputs feed the loss, as with an entropy bonus, so both backward paths run.
    (logp.sum() + 0.01 * entropy.sum()).backward()
    hidden.grad = weight.grad = None


def _worker(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    n, v, h = args.worker_seq_len, args.vocab, args.hidden
    hidden = torch.randn(n, h, device=device, dtype=dtype, generator=gen).requires_grad_()
    weight = (torch.randn(v, h, device=device, dtype=dtype, generator=gen) * 0.02).requires_grad_()
    targets = torch.randint(0, v, (n,), device=device, generator=gen)
    _step(args.worker, hidden[:8].detach().requires_grad_(), weight, targets[:8], args)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _reset_cpu_peak()
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        _step(args.worker, hidden, weight, targets, args)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if cuda else _proc_status_kb("VmHWM") * 1024
    return {"peak_mb": (peak - base) / MB, "time_s": min(times)}


def _measure(variant: str, seq_len: int, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable, "-m", "bench.logprob_memory", "--worker", variant,
        "--worker-seq-len", str(seq_len), "--vocab", str(args.vocab), "--hidden", str(args.hidden),
        "--dtype", args.dtype, "--device", args.device, "--temperature", str(args.temperature),
        "--chunk-tokens", str(args.chunk_tokens), "--chunk-vocab", str(args.chunk_vocab),
        "--repeats", str(args.repeats),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{variant} at seq_len={seq_len} failed (exit {proc.returncode}): {proc.stderr[-2000:]}"
        )
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--vocab", type=int, default=152_064)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"),
                    help="default: bfloat16 on CUDA, float32 on CPU (what the trainer uses there)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS)
    ap.add_argument("--chunk-vocab", type=int, default=DEFAULT_CHUNK_VOCAB)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    ap.add_argument("--worker-seq-len", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    if args.worker:
        print(json.dumps(_worker(args)))
        return 0

    print(f"log-prob + entropy fwd+bwd: vocab {args.vocab}, hidden {args.hidden}, {args.dtype} "
          f"on {args.device}, chunks {args.chunk_tokens} x {args.chunk_vocab}")
    cols = (Col("seq_len", "seq_len", 8), Col("naive MB", "naive_peak_mb", 11, ".0f"),
            Col("chunked MB", "chunked_peak_mb", 12, ".0f"), Col("ratio", "peak_ratio", 8, ".3f"),
            Col("naive s", "naive_time_s", 10, ".2f"), Col("chunked s", "chunked_time_s", 11, ".2f"))
    print(table_header(cols))
    entries = []
    for seq_len in args.seq_lens:
        naive, chunked = (_measure(variant, seq_len, args) for variant in VARIANTS)
        ratio = chunked["peak_mb"] / naive["peak_mb"]
        entries.append({
            "vocab": args.vocab, "hidden": args.hidden, "seq_len": seq_len, "dtype": args.dtype,
            "device": args.device, "chunk_tokens": args.chunk_tokens, "chunk_vocab": args.chunk_vocab,
            "naive_peak_mb": naive["peak_mb"], "chunked_peak_mb": chunked["peak_mb"],
            "peak_ratio": ratio, "naive_time_s": naive["time_s"], "chunked_time_s": chunked["time_s"],
        })
        print(table_line(entries[-1], cols), flush=True)
    write_json(args.out, entries)
    return 0


if __name__ == "__main__":
    sys.exit(main())
