"""What a decode step costs with and without speculative decoding, on the real CPU vLLM
engine with the tiny model, and where the time goes.

One engine per arm, its core and model worker inside this process (offline `LLM`,
`VLLM_ENABLE_V1_MULTIPROCESSING=0`, rpk's engine arguments), so the runner's parts can be
timed in place. `batch` requests of `--tokens` tokens each (distinct prompts, own seeds,
temperature 1, the sampled token's log-prob: what rpk sends) run together; a step's
seconds are the run's wall time over the engine steps it took. Arms:

- `plain`: no speculation, vLLM's default (async scheduling on);
- `plain-sync`: no speculation, async scheduling off (what any `custom_class` proposer
  imposes: vLLM turns async scheduling off for it);
- `spec k=K wrong`: a `custom_class` proposer drafting K tokens that are (nearly) never
  accepted: the cost of a verify of K drafts per row, at 1 token per verify;
- `spec k=K right` (greedy): the proposer drafts the row's own greedy continuation,
  all accepted: K + 1 tokens per verify, and the seconds per token that buys.

Per arm: ms per engine step, its parts (the model forward, sampling with the rejection
sampler, the proposer, the rest: scheduling, input preparation, output processing), and
tokens per second. `--index` also times rpk's `DraftIndex.propose` alone on rows like a
round's.

    .venv/bin/python -m bench.spec_step_cost --out bench/results/spec_step_cost.json
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from bench import common
from bench.common import Col, table_header, table_line, write_json

PROMPT_TOKENS = 32
COLUMNS = (
    Col("arm", "arm", 18, "<"), Col("batch", "batch", 6), Col("tok/verify", "tokens_per_step", 11, ".2f"),
    Col("step ms", "step_ms", 8, ".2f"), Col("forward", "forward_ms", 8, ".2f"),
    Col("sample", "sample_ms", 8, ".2f"), Col("propose", "propose_ms", 8, ".2f"),
    Col("other", "other_ms", 8, ".2f"), Col("ms/token", "ms_per_token", 9, ".3f"),
    Col("vs plain", "vs_plain", 9, ".2f", "x"),
)


class BenchDrafts:
    """A `custom_class` proposer whose drafts the benchmark sets: `k` tokens a row,
    either a token the tiny model (nearly) never samples (`mode` "wrong") or the row's
    recorded greedy continuation (`mode` "right", from `oracle`: prompt bytes -> its
    whole greedy output)."""

    k = 0
    mode = "wrong"
    oracle: dict[bytes, list[int]] = {}
    seconds = 0.0

    def __init__(self, vllm_config: Any) -> None:
        pass

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        pass

    def propose(self, sampled: Any, num_tokens: np.ndarray, token_ids: np.ndarray,
                slot_mappings: Any = None) -> list[list[int]]:
        started = time.perf_counter()
        out: list[list[int]] = []
        cls = type(self)
        for i, got in enumerate(sampled):
            if not got or cls.k == 0:
                out.append([])
                continue
            n = int(num_tokens[i])
            room = min(cls.k, token_ids.shape[1] - n - 1)
            if cls.mode == "wrong":
                out.append([3] * room)
            else:
                full = cls.oracle.get(token_ids[i, :PROMPT_TOKENS].tobytes(), [])
                out.append(full[n - PROMPT_TOKENS:n - PROMPT_TOKENS + room])
        cls.seconds += time.perf_counter() - started
        return out


class _Timer:
    """Wraps methods of live objects, summing their seconds and calls."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, obj: Any, name: str, label: str) -> None:
        inner = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - started
                self.calls[label] += 1

        setattr(obj, name, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def _engine(model: Path, spec_k: int, async_scheduling: bool | None, batch: int) -> Any:
    from vllm import LLM

    from rpk.engine.vllm_settings import VLLMSettings, engine_kwargs

    kwargs = engine_kwargs(VLLMSettings(model=model, max_num_seqs=max(8, batch)), False)
    if spec_k:
        kwargs["speculative_config"] = {
            "method": "custom_class", "model": f"{__name__}.BenchDrafts", "num_speculative_tokens": spec_k,
        }
    if async_scheduling is not None:
        kwargs["async_scheduling"] = async_scheduling
    return LLM(**kwargs)


def _runner(llm: Any) -> Any:
    core = llm.llm_engine.engine_core.engine_core
    return core, core.model_executor.driver_worker.worker.model_runner


def _prompts(batch: int) -> list[Any]:
    from vllm.inputs import TokensPrompt

    rng = np.random.default_rng(7)
    return [TokensPrompt(prompt_token_ids=rng.integers(10, 200, PROMPT_TOKENS).tolist()) for _ in range(batch)]


def _params(batch: int, tokens: int, greedy: bool) -> list[Any]:
    from vllm.sampling_params import SamplingParams

    return [SamplingParams(n=1, max_tokens=tokens, ignore_eos=True, temperature=0.0 if greedy else 1.0,
                           seed=i, logprobs=0) for i in range(batch)]


def _measure(llm: Any, timer: _Timer, batch: int, tokens: int, greedy: bool, repeats: int) -> dict[str, Any]:
    """Median over `repeats` of one run's per-step figures."""
    prompts = _prompts(batch)
    runs = []
    for _ in range(repeats):
        timer.reset()
        BenchDrafts.seconds = 0.0
        started = time.perf_counter()
        outs = llm.generate(prompts, _params(batch, tokens, greedy), use_tqdm=False)
        wall = time.perf_counter() - started
        steps = max(1, timer.calls["forward"])  # one model forward per engine step
        made = sum(len(o.outputs[0].token_ids) for o in outs)
        forward = timer.seconds["forward"] / steps
        sample = timer.seconds["sample"] / steps
        propose = BenchDrafts.seconds / steps
        runs.append({
            "step_ms": wall / steps * 1e3, "forward_ms": forward * 1e3, "sample_ms": sample * 1e3,
            "propose_ms": propose * 1e3, "other_ms": (wall / steps - forward - sample - propose) * 1e3,
            "tokens_per_step": made / batch / steps, "ms_per_token": wall / made * 1e3 * batch,
        })
    return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


def _instrument(llm: Any, timer: _Timer) -> None:
    _, runner = _runner(llm)
    timer.wrap(runner.model, "forward", "forward")
    timer.wrap(runner, "_sample", "sample")


def _oracle(llm: Any, batch: int, tokens: int) -> dict[bytes, list[int]]:
    """Each prompt's greedy continuation (run without drafts)."""
    BenchDrafts.k = 0
    outs = llm.generate(_prompts(batch), _params(batch, tokens + 16, True), use_tqdm=False)
    return {np.asarray(o.prompt_token_ids, dtype=np.int32).tobytes(): list(o.outputs[0].token_ids) for o in outs}


def measure_engines(model: Path, batches: list[int], ks: list[int], tokens: int, repeats: int) -> list[dict]:
    rows: list[dict[str, Any]] = []
    top = max(batches)

    def emit(row: dict[str, Any]) -> None:
        base = next((r for r in rows if r["arm"] == "plain" and r["batch"] == row["batch"]), None)
        row["vs_plain"] = base["ms_per_token"] / row["ms_per_token"] if base else 1.0
        rows.append(row)
        print(table_line(row, COLUMNS), flush=True)

    for arm, spec_k, async_scheduling in (("plain", 0, None), ("plain-sync", 0, False), ("spec", max(ks), None)):
        llm = _engine(model, spec_k, async_scheduling, top)
        timer = _Timer()
        _instrument(llm, timer)
        core, _ = _runner(llm)
        asynchronous = bool(core.async_scheduling)
        try:
            _measure(llm, timer, 2, 8, False, 1)  # warm-up
            for batch in batches:
                if arm != "spec":
                    emit({"arm": arm, "batch": batch, "k": 0, "async_scheduling": asynchronous,
                          **_measure(llm, timer, batch, tokens, False, repeats)})
                    continue
                for k in [0, *ks]:
                    BenchDrafts.k, BenchDrafts.mode = k, "wrong"
                    emit({"arm": f"spec k={k} wrong" if k else "spec k=0", "batch": batch, "k": k,
                          "async_scheduling": asynchronous, **_measure(llm, timer, batch, tokens, False, repeats)})
                BenchDrafts.oracle = _oracle(llm, batch, tokens)
                for k in ks:
                    BenchDrafts.k, BenchDrafts.mode = k, "right"
                    emit({"arm": f"spec k={k} right", "batch": batch, "k": k, "async_scheduling": asynchronous,
                          **_measure(llm, timer, batch, tokens, True, repeats)})
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
    return rows


def measure_index(batches: list[int], k: int = 4, steps: int = 200) -> list[dict]:
    """rpk's `DraftIndex.propose` alone: ms per call on `batch` rows of a prompt with 8
    sibling texts of 200 tokens (vLLM's token array is max_num_seqs x max_model_len)."""
    from rpk.core.drafts import Draft, DraftSource, PromptDrafts
    from rpk.sync.worker.spec_index import DraftIndex

    rng = np.random.default_rng(0)
    out = []
    for batch in batches:
        prompt = rng.integers(10, 200, PROMPT_TOKENS).tolist()
        siblings = [rng.integers(10, 30, 200).tolist() for _ in range(8)]
        index = DraftIndex(8)
        index.reset([(1, 1 << 30, k)], list(DraftSource),
                    [PromptDrafts(tuple(prompt), tuple(Draft(DraftSource.SIBLING, tuple(s)) for s in siblings))])
        token_ids = np.zeros((64, 1024), dtype=np.int32)
        num = np.zeros(64, dtype=np.int64)
        for i in range(batch):
            row = prompt + siblings[i % 8][:100]
            token_ids[i, :len(row)] = row
            num[i] = len(row)
        sampled = [[int(token_ids[i, num[i] - 1])] for i in range(batch)]
        started = time.perf_counter()
        for s in range(steps):
            for i in range(batch):
                token_ids[i, num[i]] = siblings[i % 8][100 + s % 90]
                num[i] += 1
                sampled[i] = [int(token_ids[i, num[i] - 1])]
            index.propose(sampled, num, token_ids)
        out.append({"batch": batch, "k": k, "index_propose_ms": (time.perf_counter() - started) / steps * 1e3})
        print(f"DraftIndex.propose, batch {batch}, k {k}: {out[-1]['index_propose_ms']:.3f} ms", flush=True)
    return out


def main() -> int:
    ap = common.parser(__doc__)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--tokens", type=int, default=96, help="tokens per response")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache-dir", default=".cache/rpk")
    ap.add_argument("--no-engine", dest="engine", action="store_false", help="time DraftIndex alone")
    args = ap.parse_args()
    # rpk's engine environment (`rpk.engine.vllm_engine`), before torch loads: the
    # engine's core and worker in this process, one OpenMP thread.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result: dict[str, Any] = {"args": common.args_json(args)}
    result["index"] = measure_index(args.batches)
    if args.engine:
        from rpk.config import ModelConfig
        from rpk.tasks.tiny import build_tiny_model

        model = build_tiny_model(ModelConfig().tiny, Path(args.cache_dir), print)
        print(table_header(COLUMNS))
        result["steps"] = measure_engines(model, args.batches, args.ks, args.tokens, args.repeats)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
