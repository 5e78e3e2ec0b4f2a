"""The engine's decode cost curve: seconds per decode step against the number of
sequences decoding at once, on the real vLLM engine with the tiny model.

    .venv/bin/python -m bench.engine_cost --out bench/results/engine_cost.json

Whether tail batching pays depends on this curve. A flat curve (a GPU decoding a real
model: memory bound) makes every step with few sequences left a waste, which tail
batching removes; a curve that grows in proportion to the batch (throughput bound) makes
idle slots nearly free and the aborted speculative tokens expensive. The fit
`step_s = base_s + per_seq_s * batch` is what bench/sim_policies.py uses as its CPU model.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

from bench import common
from bench.common import Col, table_header, table_line, write_json

COLUMNS = (Col("batch", "batch", 6), Col("step ms", "step_ms", 10, ".1f"),
           Col("us/seq-step", "per_seq_token_us", 14, ".1f"))


async def _generate(llm, batch: int, tokens: int, tag: str) -> float:
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    async def one(i: int) -> None:
        # What rpk sends (rpk.engine.vllm_engine): own seed, the sampled token's
        # log-prob, one output at the end; ignore_eos so that every response is `tokens`.
        params = SamplingParams(
            n=1, max_tokens=tokens, ignore_eos=True, temperature=1.0, seed=i, logprobs=0,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        prompt = TokensPrompt(prompt_token_ids=list(range(5, 37)))
        async for _ in llm.generate(prompt, params, request_id=f"{tag}-{i}"):
            pass

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(batch)))
    return time.perf_counter() - started


async def _measure(args: argparse.Namespace) -> list[dict]:
    from rpk.config import ModelConfig
    from rpk.engine.vllm_engine import _async_llm, _engine_env
    from rpk.engine.vllm_settings import VLLMSettings
    from rpk.tasks.tiny import build_tiny_model

    cfg = ModelConfig()
    model = build_tiny_model(cfg.tiny, Path(cfg.cache_dir), print)
    settings = VLLMSettings(model=model, max_num_seqs=max(args.batches), kv_cache_memory_bytes=1024 * 2**20)
    with _engine_env():
        llm = _async_llm(Path(model), settings)
    rows = []
    try:
        await _generate(llm, 4, 8, "warm-up")
        for batch in args.batches:
            times = [
                await _generate(llm, batch, args.tokens, f"b{batch}-{rep}")
                for rep in range(args.repeats)
            ]
            step_s = statistics.median(times) / args.tokens
            rows.append({"batch": batch, "step_ms": step_s * 1e3, "per_seq_token_us": step_s / batch * 1e6})
            print(table_line(rows[-1], COLUMNS), flush=True)
    finally:
        llm.shutdown()
    return rows


def fit(rows: list[dict]) -> tuple[float, float]:
    """Least-squares base_s + per_seq_s * batch."""
    xs = [r["batch"] for r in rows]
    ys = [r["step_ms"] / 1e3 for r in rows]
    slope, intercept = statistics.linear_regression(xs, ys)
    return intercept, slope


def main() -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 256, 400])
    ap.add_argument("--tokens", type=int, default=100, help="tokens per response")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(table_header(COLUMNS))
    rows = asyncio.run(_measure(args))
    base, per_seq = fit(rows)
    print(f"step_s ~ {base * 1e3:.2f} ms + {per_seq * 1e6:.0f} us x batch")
    write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
