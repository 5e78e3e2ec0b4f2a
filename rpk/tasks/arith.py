"""Long-tailed multi-digit addition: rpk's built-in verifiable task.

The response needs one scratchpad line per column, so its length is set by the prompt,
and the column count is drawn from a power law, P(d) ~ d**-alpha on 1..max_digits: most
prompts need ~30 tokens, a few need ~250. That spread is the rollout long tail rpk exists
to absorb, on a task a tiny model learns in a minute of CPU time.

The layout is chosen for a tiny transformer rather than for humans:
- the question lists the columns, left to right as the digits are written, each digit
  behind a label of its own (`D4d0`: column D, digit 4 of the first operand, digit 0 of
  the second); a scratchpad line fetches its digits by repeating the labels (`D4+d0`),
  which a small model learns quickly by matching labels (an induction head) where it
  would have to learn one position offset per column otherwise;
- lines go units first and all have the same width (`B2+b9+0=11`): the carry in is the
  last line's tens digit, a fixed distance back;
- the sum has as many digits as the first operand (problems whose sum would carry out
  are redrawn), so answer digit j always comes from line d-1-j;
- the last line is `Answer: ` and the sum, most significant digit first, each digit behind
  its column's label (`D5C2B1A8` for 5218): a digit is fetched from the line that starts
  with its label, by matching labels again. A bare sum would have to be copied from the
  lines in reverse, at an offset that grows with each digit: the tiny model never
  learns that counting and gets every sum of more than two digits wrong although its
  lines are right;
- only the answer's digits are scored: the labels may be left out (`Answer: 5218`).

Example, 4821 + 397 (question, then the reference solution):

    What is 4821 + 397?
    Columns:
    D4d0;C8c3;B2b9;A1a7

    A1+a7+0=08
    B2+b9+0=11
    C8+c3+1=12
    D4+d0+1=05
    Answer: D5C2B1A8
"""

from __future__ import annotations

import random
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rpk.tasks import TASKS
from rpk.tasks.specs import ArithSpec

DATA_SOURCE = TASKS["arith"].data_source

# One label per column (upper case for the first operand, lower for the second); the
# alphabet is the hard cap on max_digits (`rpk.config.ARITH_MAX_DIGITS`).
_LABELS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

# Special tokens a decoder may leave in the text when it does not skip them; they are
# not part of the answer.
_TRAILING_SPECIALS = ("<|im_end|>", "<|endoftext|>")

_ANSWER_RE = re.compile(r"Answer:[ \t]*([^\n]*)")
# An answer written the way the reference writes it: label, digit, label, digit, ...
_LABELLED_RE = re.compile(f"(?:[{_LABELS}][0-9])+")


@dataclass(frozen=True, slots=True)
class Problem:
    """One addition problem: `a + b`, both padded to `digits` columns."""

    a: int
    b: int
    digits: int
    question: str
    answer: str


def columns(a: int, b: int, digits: int) -> list[tuple[str, int, int]]:
    """(label, digit of a, digit of b) per column, units first."""
    da = str(a).zfill(digits)[::-1]
    db = str(b).zfill(digits)[::-1]
    return [(_LABELS[k], int(da[k]), int(db[k])) for k in range(digits)]


def _question(a: int, b: int, digits: int) -> str:
    cols = ";".join(f"{lab}{x}{lab.lower()}{y}" for lab, x, y in reversed(columns(a, b, digits)))
    return f"What is {a} + {b}?\nColumns:\n{cols}"


def sample_digits(rng: random.Random, spec: ArithSpec) -> int:
    weights = [d**-spec.alpha for d in range(1, spec.max_digits + 1)]
    return rng.choices(range(1, spec.max_digits + 1), weights=weights)[0]


def make_problem(rng: random.Random, spec: ArithSpec = ArithSpec()) -> Problem:
    return problem_of(sample_digits(rng, spec), rng)


def problem_of(digits: int, rng: random.Random) -> Problem:
    """A problem of exactly `digits` columns."""
    # `a` has exactly `digits` digits, so the column count is visible in the question;
    # `b` may be shorter and is zero-padded in the column list. Redrawing sums that
    # carry out keeps the answer as long as the scratchpad (see the module docstring).
    low = 0 if digits == 1 else 10 ** (digits - 1)
    while True:
        a = rng.randrange(low, 10**digits)
        b = rng.randrange(0, 10**digits)
        if a + b < 10**digits:
            break
    return Problem(a=a, b=b, digits=digits, question=_question(a, b, digits), answer=str(a + b))


def solution_text(problem: Problem) -> str:
    """The reference response: one fixed-width line per column, then the labelled answer."""
    lines = []
    answer = []
    carry = 0
    for label, x, y in columns(problem.a, problem.b, problem.digits):
        total = x + y + carry
        lines.append(f"{label}{x}+{label.lower()}{y}+{carry}={total:02d}")
        answer.append(f"{label}{total % 10}")
        carry = total // 10
    lines.append(f"Answer: {''.join(reversed(answer))}")
    return "\n".join(lines)


def judge_reference(problem: Problem) -> str:
    """The judged task's reference (`rpk.tasks.arith_judged`): the answer as the reference
    solution writes it, its labels in lower case (`d5c2b1a8` for `D5C2B1A8`), so that the
    tiny judge (`rpk.judge.tiny`) tells the reference's labels from the response's."""
    return solution_text(problem).rpartition("Answer: ")[2].lower()


def extract_answer(text: str) -> str | None:
    """The value of the last `Answer:` line, its column labels dropped (`D5C2B1A8` is
    5218), or None when there is none."""
    found = _ANSWER_RE.findall(text)
    if not found:
        return None
    value = found[-1]
    for special in _TRAILING_SPECIALS:
        value = value.split(special, 1)[0]
    value = value.strip()
    if _LABELLED_RE.fullmatch(value):
        return value[1::2]
    return value


def exact_score(solution_str: Any, ground_truth: Any, extract: Callable[[str], str | None]) -> float:
    """1.0 iff `extract(solution_str)` is the ground truth exactly (no partial credit),
    else 0.0. Never raises: a reward function that throws on a model's garbage would fail
    the whole step."""
    try:
        if not isinstance(solution_str, str):
            return 0.0
        value = extract(solution_str)
        return 1.0 if value is not None and value == str(ground_truth).strip() else 0.0
    except Exception:  # noqa: BLE001 - garbage in, zero out, by contract
        return 0.0


# veRL's reward signature, a module-level function so that reward workers can import it.
def compute_score(data_source: Any, solution_str: Any, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 iff the last `Answer:` value (labels dropped) is the ground truth, else 0.0."""
    return exact_score(solution_str, ground_truth, extract_answer)


def make_rows(n: int, seed: int, spec: ArithSpec = ArithSpec()) -> list[dict[str, Any]]:
    """`n` prompts in veRL's parquet row layout; the same seed gives the same rows."""
    rng = random.Random(seed)
    return [make_row(make_problem(rng, spec), i) for i in range(n)]


def make_row(p: Problem, index: int) -> dict[str, Any]:
    return {
        "prompt": [{"role": "user", "content": p.question}],
        "data_source": DATA_SOURCE,
        "reward_model": {"style": "rule", "ground_truth": p.answer},
        "extra_info": {"index": index, "digits": p.digits},
    }


def held_out_rows(
    n: int, seed: int, exclude: Sequence[dict[str, Any]], spec: ArithSpec = ArithSpec()
) -> list[dict[str, Any]]:
    """`n` distinct rows like `make_rows`'s, none with the question of a row of `exclude`
    (the training rows). Short problems are few (55 with one digit) and a training set of
    thousands holds them all, so a held-out set has fewer of them than the distribution:
    it measures what training did not show. ValueError when `n` such rows cannot be
    drawn (a task too small to hold them out)."""
    return draw_held_out(n, seed, exclude, spec, lambda p, index, rng: make_row(p, index))


def draw_held_out(
    n: int, seed: int, exclude: Sequence[dict[str, Any]], spec: ArithSpec,
    row: Callable[[Problem, int, random.Random], dict[str, Any]],
) -> list[dict[str, Any]]:
    """`held_out_rows` for any row layout: `row(problem, index, rng)` makes a row."""
    seen = {r["prompt"][0]["content"] for r in exclude}
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for _ in range(100 * n):
        if len(rows) == n:
            break
        p = make_problem(rng, spec)
        if p.question in seen:
            continue
        seen.add(p.question)
        rows.append(row(p, len(rows), rng))
    if len(rows) < n:
        raise ValueError(f"only {len(rows)} problems outside the training rows after {100 * n} draws")
    return rows


def reference_lengths(
    tokenizer: Any, n: int, seed: int, spec: ArithSpec = ArithSpec()
) -> list[int]:
    """Token count of each reference response, EOS included (what a rollout must emit)."""
    rng = random.Random(seed)
    texts = [solution_text(make_problem(rng, spec)) for _ in range(n)]
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [len(ids) + 1 for ids in encoded]


def length_stats(lengths: Sequence[int]) -> dict[str, float]:
    ordered = sorted(lengths)

    def pct(q: float) -> float:
        return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])

    median = float(statistics.median(ordered))
    return {
        "count": float(len(ordered)),
        "mean": statistics.fmean(ordered),
        "median": median,
        "p90": pct(0.90),
        "p99": pct(0.99),
        "max": float(ordered[-1]),
        "max/median": ordered[-1] / median,
    }
