"""The arithmetic task with half its rows scored by a judge model: the paper's mixture of
rule-checked and LLM-judged data on one task (`--data.task arith_judged`).

The rows are arith's (`rpk.tasks.arith`), the same prompts drawn the same way; every
other row (odd index) is a judged one:

- `data_source` is `rpk/arith_judged` and `reward_model.style` is `"model"` (veRL's
  marker for a model reward), so it goes to the judge (`rpk.reward.judge`);
- `extra_info.question` is the user's question without the column list (the policy's
  layout, which the judge does not need), and `extra_info.reference` is the answer as
  the reference solution writes it (`D5C2B1A8`): the tiny judge compares label by label;
- `ground_truth` stays the sum, so the rule checker (this module's `compute_score`,
  arith's) checks the same row beside the judge, for the judge/rule agreement.

The held-out rows are plain arith rows: validation is scored by the rule checker alone.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from rpk.tasks import TASKS, arith
from rpk.tasks.specs import ArithSpec

DATA_SOURCE = TASKS["arith_judged"].data_source
# The rule checker of the judged rows, beside the judge: arith's (their `ground_truth`
# is the sum).
compute_score = arith.compute_score


def is_judged_index(index: int) -> bool:
    return index % 2 == 1


def judged_row(row: dict[str, Any], problem: arith.Problem) -> dict[str, Any]:
    """`row` (an arith row of `problem`) made a judged one."""
    answer = arith.solution_text(problem).rpartition("Answer: ")[2]
    return {
        **row,
        "data_source": DATA_SOURCE,
        "reward_model": {**row["reward_model"], "style": "model"},
        "extra_info": {
            **row["extra_info"],
            "question": problem.question.split("\n", 1)[0],
            "reference": answer,
        },
    }


def make_rows(n: int, seed: int, spec: ArithSpec = ArithSpec()) -> list[dict[str, Any]]:
    """arith's `n` rows for `seed`, every odd one judged."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        problem = arith.make_problem(rng, spec)
        row = arith.make_row(problem, i)
        rows.append(judged_row(row, problem) if is_judged_index(i) else row)
    return rows


def held_out_rows(
    n: int, seed: int, exclude: Sequence[dict[str, Any]], spec: ArithSpec = ArithSpec()
) -> list[dict[str, Any]]:
    """arith's held-out rows: rule-checked, none a training question."""
    return arith.held_out_rows(n, seed, exclude, spec)
