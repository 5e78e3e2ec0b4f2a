"""Math answer checking with HuggingFace's `math-verify`: `rpk.reward.math:compute_score`.

The response's final answer (preferably `\\boxed{...}`, else the last LaTeX or plain
expression) is compared with the ground truth symbolically, so `\\frac{1}{2}`, `0.5`
and `1/2` all match. Registered as the built-in checker of the common veRL math
data sources (`DATA_SOURCES`).

math-verify bounds its own parsing and comparison with `signal.alarm`, which only works
in a process's main thread. The process-pool scorer calls reward functions in its
workers' main thread, so those timeouts stay on there; anywhere else (the thread
backend) they are switched off and the scorer's own timeout is the only bound.
"""

from __future__ import annotations

import threading
from typing import Any

DATA_SOURCES = (
    "lighteval/MATH",
    "DigitalLearningGmbH/MATH-lighteval",
    "HuggingFaceH4/MATH-500",
    "openai/gsm8k",
    "math_dapo",
    "math",
    "aime24",
    "aime25",
    "AIME",
    "numina_amc_aime",
    "numina_synthetic_math",
    "numina_olympiads",
    "numina_cn_k12",
    "numina_aops_forum",
)

_SIGNAL_TIMEOUT_S = 5  # math-verify's own bound per parse / comparison, main thread only


def _signal_timeout() -> int | None:
    return _SIGNAL_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _gold_text(ground_truth: Any) -> str:
    text = str(ground_truth).strip()
    # gsm8k keeps the worked solution with the answer after '####'
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip()
    return text if "\\boxed" in text or "$" in text else f"\\boxed{{{text}}}"


def compute_score(
    data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any = None
) -> dict[str, Any]:
    """veRL's signature: score 1.0 when the response's final answer equals the ground
    truth mathematically, else 0.0. A ground truth math-verify cannot parse raises (a
    data problem worth counting); an unparseable response scores 0."""
    # Imported on first use: sympy and the LaTeX parser cost about a second, paid only
    # by the processes that check math.
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    timeout = _signal_timeout()
    gold = parse(
        _gold_text(ground_truth),
        [LatexExtractionConfig(), ExprExtractionConfig()],
        parsing_timeout=timeout,  # type: ignore[arg-type]
    )
    if not gold:
        raise ValueError(f"math-verify cannot parse the ground truth {ground_truth!r}")
    if not isinstance(solution_str, str) or not solution_str.strip():
        return {"score": 0.0, "acc": False}
    answer = parse(
        solution_str,
        [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()],
        parsing_timeout=timeout,  # type: ignore[arg-type]
    )
    ok = bool(answer) and verify(gold, answer, timeout_seconds=timeout)
    return {"score": 1.0 if ok else 0.0, "acc": bool(ok)}
