"""The arithmetic task with rows scored by a judge model: the paper's mixture of
rule-checked and LLM-judged data on one task (`--data.task arith_judged`).

The rows are arith's (`rpk.tasks.arith`), the same prompts drawn the same way; a share
`judged_frac` of them (`--data.judged_frac`, spread evenly: at 0.5 every odd row, at 1
all) are judged ones:

- `data_source` is `rpk/arith_judged` and `reward_model.style` is `"model"` (veRL's
  marker for a model reward), so it goes to the judge (`rpk.reward.judge`);
- `extra_info.question` is the user's question without the column list (the policy's
  layout, which the judge does not need), and `extra_info.reference` is the answer as
  the reference solution writes it, its labels in lower case (`d5c2b1a8` for
  `D5C2B1A8`): the tiny judge (`rpk.judge.tiny`) looks each label up once on each side;
- `ground_truth` stays the sum, so the rule checker (this module's `compute_score`,
  arith's) checks the same row beside the judge, for the judge/rule agreement.

At `judged_frac` 1 no rule reward reaches training: what the policy learns, it learns
from the judge. The held-out rows are plain arith rows: validation is scored by the rule
checker alone.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

from rpk.tasks import TASKS, arith
from rpk.tasks.specs import ArithSpec

DATA_SOURCE = TASKS["arith_judged"].data_source
# The rule checker of the judged rows, beside the judge: arith's (their `ground_truth`
# is the sum).
compute_score = arith.compute_score


def is_judged_index(index: int, judged_frac: float = 0.5) -> bool:
    """Row `index` is judged: `judged_frac` of the rows, spread evenly (at 0.5 the odd
    ones)."""
    return math.floor((index + 1) * judged_frac) > math.floor(index * judged_frac)


# The judge's reference (arith's, so that the tiny judge, which learns it, imports no
# module of this task).
reference = arith.judge_reference


def judged_row(row: dict[str, Any], problem: arith.Problem) -> dict[str, Any]:
    """`row` (an arith row of `problem`) made a judged one."""
    return {
        **row,
        "data_source": DATA_SOURCE,
        "reward_model": {**row["reward_model"], "style": "model"},
        "extra_info": {
            **row["extra_info"],
            "question": problem.question.split("\n", 1)[0],
            "reference": reference(problem),
        },
    }


def make_rows(n: int, seed: int, spec: ArithSpec = ArithSpec(), judged_frac: float = 0.5) -> list[dict[str, Any]]:
    """arith's `n` rows for `seed`, the share `judged_frac` of them judged."""
    if isinstance(judged_frac, bool) or not isinstance(judged_frac, int | float) or not 0 <= judged_frac <= 1:
        raise ValueError(f"judged_frac must be a number in [0, 1], got {judged_frac!r}")
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        problem = arith.make_problem(rng, spec)
        row = arith.make_row(problem, i)
        rows.append(judged_row(row, problem) if is_judged_index(i, judged_frac) else row)
    return rows


def held_out_rows(
    n: int, seed: int, exclude: Sequence[dict[str, Any]], spec: ArithSpec = ArithSpec()
) -> list[dict[str, Any]]:
    """arith's held-out rows: rule-checked, none a training question."""
    return arith.held_out_rows(n, seed, exclude, spec)
