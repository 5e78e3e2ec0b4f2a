"""Validation metrics: a pass of `rpk.loop.evaluate` -> one flat record, pure.

The record's keys (all validation keys start with `val/`):

- `val/acc_greedy`: the share of prompts whose greedy response is correct (pass@1),
  `val/acc_greedy_se` its standard error over the prompts;
- `val/mean@k`: correct sampled responses, averaged per prompt then over prompts,
  `val/mean@k_se` its standard error; `val/pass@k`: prompts with any correct sample;
- `val/len_greedy`, `val/len_sampled`: mean response length in tokens;
- `val/truncated_frac`: responses that hit the length budget; `val/score_errors`:
  responses whose scoring failed (counted wrong);
- with more than one data source, the same per source under `val/<data_source>/`;
- `val/per_prompt/greedy` (0 or 1) and `val/per_prompt/sampled` (correct samples of
  k), lists in the validation set's order: two passes see the same prompts, so their
  difference has a paired standard error far below the unpaired one (`bench.learning`);
- when the prompts say their digit count (the built-in task's `extra_info["digits"]`),
  the same per band of digit counts under `val/digits_<lo>-<hi>/` (`DIGIT_BANDS`): RL
  may gain on some lengths and lose on others while the overall figure stands still.

"Correct" is the task's own verdict (`Scored.correct`), not the shaped reward.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rpk.core.outcomes import EvalRun, PromptEval
from rpk.core.records import FinishReason, Scored

PHASE = "eval"  # the `phase` of validation records in metrics.jsonl
# Bands of the built-in task's digit counts (1..20, P(d) ~ d^-1.3): wide enough at the
# long end that 512 prompts put a dozen or more in each.
DIGIT_BANDS = ((1, 1), (2, 3), (4, 6), (7, 10), (11, 20))


def _mean_se(values: Sequence[float]) -> tuple[float, float]:
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return mean, se


def _group_metrics(prefix: str, results: Sequence[PromptEval], k: int) -> dict[str, float]:
    every: list[Scored] = [s for r in results for s in (r.greedy, *r.sampled)]
    acc, se = _mean_se([float(r.greedy.correct) for r in results])
    out = {
        f"{prefix}prompts": float(len(results)),
        f"{prefix}acc_greedy": acc,
        f"{prefix}acc_greedy_se": se,
        f"{prefix}len_greedy": statistics.fmean(len(r.greedy.response.token_ids) for r in results),
    }
    if k:
        per_prompt = [statistics.fmean(float(s.correct) for s in r.sampled) for r in results]
        mean, mean_se = _mean_se(per_prompt)
        out[f"{prefix}mean@{k}"] = mean
        out[f"{prefix}mean@{k}_se"] = mean_se
        out[f"{prefix}pass@{k}"] = statistics.fmean(
            float(any(s.correct for s in r.sampled)) for r in results
        )
        out[f"{prefix}len_sampled"] = statistics.fmean(
            len(s.response.token_ids) for r in results for s in r.sampled
        )
    out[f"{prefix}truncated_frac"] = statistics.fmean(
        float(s.response.finish_reason is FinishReason.LENGTH) for s in every
    )
    out[f"{prefix}score_errors"] = float(sum(1 for s in every if s.error))
    return out


def val_record(run: EvalRun) -> dict[str, Any]:
    """The `metrics.jsonl` line of one validation pass."""
    record: dict[str, Any] = {
        "step": run.step,
        "phase": PHASE,
        "version": run.version,
        "time_eval_s": run.ended_at - run.started_at,
    }
    if not run.results:
        return record
    record.update(_group_metrics("val/", run.results, run.k))
    # lists, not scalars: metrics.jsonl keeps them, the trackers skip them
    record["val/per_prompt/greedy"] = [int(r.greedy.correct) for r in run.results]
    if run.k:
        record["val/per_prompt/sampled"] = [sum(s.correct for s in r.sampled) for r in run.results]
    sources = sorted({r.prompt.data_source for r in run.results})
    if len(sources) > 1:
        for source in sources:
            subset = [r for r in run.results if r.prompt.data_source == source]
            record.update(_group_metrics(f"val/{source}/", subset, run.k))
    digits = [r.prompt.extra_info.get("digits") for r in run.results]
    if all(isinstance(d, int) for d in digits):
        for lo, hi in DIGIT_BANDS:
            band = [r for r, d in zip(run.results, digits) if lo <= d <= hi]
            if band:
                record.update(_group_metrics(f"val/digits_{lo}-{hi}/", band, run.k))
    return record


def sample_rows(run: EvalRun, n: int = 8) -> list[dict[str, Any]]:
    """The greedy responses of the first `n` prompts, as text rows for the trackers."""
    return [
        {
            "data_source": r.prompt.data_source,
            "prompt": r.prompt.text,
            "response": r.greedy.response.text,
            "ground_truth": str(r.prompt.ground_truth),
            "correct": r.greedy.correct,
            "tokens": len(r.greedy.response.token_ids),
        }
        for r in run.results[:n]
    ]


def summarize_val(records: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """The first and last validation of a run, for the end-of-run table: greedy
    accuracy, and mean@k when it was measured."""
    recs = [r for r in records if "val/acc_greedy" in r]
    if not recs:
        return {}
    first, last = recs[0], recs[-1]
    keys = ["acc_greedy"] + [k[4:] for k in first if k.startswith("val/mean@") and "_" not in k]
    out = {"val_prompts": float(first["val/prompts"])}
    for key in keys:
        out[f"val_{key}_start"] = float(first[f"val/{key}"])
        out[f"val_{key}_end"] = float(last[f"val/{key}"])
    out["val_step_start"], out["val_step_end"] = float(first["step"]), float(last["step"])
    out["time_eval_s_total"] = sum(float(r["time_eval_s"]) for r in recs)
    return out
