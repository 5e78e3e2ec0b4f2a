"""The built-in arithmetic task: problems, reference solutions, reward, rows, long tail."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rpk.tasks import arith
from rpk.tasks.arith import (
    DATA_SOURCE,
    ArithSpec,
    Problem,
    compute_score,
    length_stats,
    make_problem,
    make_rows,
    reference_lengths,
    solution_text,
)


def test_reference_solutions_score_one_and_add_up() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        p = make_problem(rng)
        text = solution_text(p)
        assert compute_score(DATA_SOURCE, text, p.answer) == 1.0
        assert p.answer == str(p.a + p.b)
        assert len(str(p.a)) == p.digits  # the column count is visible in the question
        assert len(text.splitlines()) == p.digits + 1  # one line per column, then the answer
        assert f"What is {p.a} + {p.b}?" in p.question


def test_worked_example_layout() -> None:
    p = Problem(a=4821, b=397, digits=4, question="", answer="5218")
    assert solution_text(p) == (
        "A1+a7+0=08\nB2+b9+0=11\nC8+c3+1=12\nD4+d0+1=05\nAnswer: D5C2B1A8"
    )
    q = make_problem(random.Random(3), ArithSpec(max_digits=1))
    assert q.question.endswith(f"A{q.a}a{q.b}")


@pytest.mark.parametrize(
    ("text", "truth", "expected"),
    [
        ("A1+a2+0=03\nAnswer: 3", "3", 1.0),
        ("Answer: 3", "3", 1.0),
        ("Answer:3", "3", 1.0),
        ("Answer: 3  ", "3", 1.0),
        ("Answer: 3<|im_end|>", "3", 1.0),
        ("Answer: 4", "3", 0.0),
        ("Answer: 03", "3", 0.0),  # exact match, no numeric leniency
        ("Answer: 3.", "3", 0.0),
        ("Answer: 3 apples", "3", 0.0),
        ("the answer is 3", "3", 0.0),
        ("", "3", 0.0),
        ("Answer: 3\nAnswer: 4", "3", 0.0),  # the last Answer line counts
        ("Answer: 4\nAnswer: 3", "3", 1.0),
        ("Answer: \nAnswer:", "3", 0.0),
        ("Answer: 12", 12, 1.0),  # a ground truth that arrives as an int
        ("Answer: B1A2", "12", 1.0),  # the reference's labelled answer: its digits count
        ("Answer: B1A3", "12", 0.0),
        ("Answer: B1A", "1", 0.0),  # labels and digits must alternate
        ("Answer: B1 A2", "12", 0.0),
        ("Answer: b1a2", "12", 0.0),
    ],
)
def test_compute_score_cases(text: str, truth: object, expected: float) -> None:
    assert compute_score(DATA_SOURCE, text, truth) == expected


@pytest.mark.parametrize("garbage", [None, 3, b"Answer: 3", ["Answer: 3"], object()])
def test_compute_score_garbage_inputs_score_zero(garbage: object) -> None:
    assert compute_score(DATA_SOURCE, garbage, "3") == 0.0


@settings(max_examples=300, deadline=None)
@given(text=st.text(), truth=st.text(max_size=5))
def test_compute_score_never_raises(text: str, truth: str) -> None:
    assert compute_score(DATA_SOURCE, text, truth) in (0.0, 1.0)


def test_make_rows_is_verl_shaped_and_deterministic() -> None:
    rows = make_rows(50, seed=7)
    assert rows == make_rows(50, seed=7)
    assert rows != make_rows(50, seed=8)
    for i, row in enumerate(rows):
        assert set(row) == {"prompt", "data_source", "reward_model", "extra_info"}
        assert row["data_source"] == DATA_SOURCE == "rpk/arith"
        (message,) = row["prompt"]
        assert message["role"] == "user" and message["content"].startswith("What is ")
        assert row["reward_model"]["style"] == "rule"
        truth = row["reward_model"]["ground_truth"]
        assert isinstance(truth, str) and truth.isdigit()
        assert row["extra_info"]["index"] == i
        assert 1 <= row["extra_info"]["digits"] <= ArithSpec().max_digits


def test_digit_counts_are_heavy_tailed() -> None:
    rng = random.Random(1)
    counts = [arith.sample_digits(rng, ArithSpec()) for _ in range(20000)]
    share = {d: counts.count(d) / len(counts) for d in (1, 2, 10, 20)}
    # P(d) ~ d**-1.3: a falling power law that still reaches the top.
    assert share[1] > share[2] > share[10] > share[20] > 0.003


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [({"max_digits": 0}, "max_digits"), ({"max_digits": 27}, "max_digits"),
     ({"alpha": -1.0}, "alpha"), ({"alpha": float("nan")}, "alpha")],
)
def test_arith_spec_validation_names_the_field(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        ArithSpec(**kwargs)


def test_reference_lengths_have_a_long_tail() -> None:
    from rpk.config import TinySpec
    from rpk.tasks.tiny import build_tokenizer

    tokenizer = build_tokenizer(TinySpec())
    stats = length_stats(reference_lengths(tokenizer, 2000, seed=0))
    assert stats["max"] >= 5 * stats["median"]
    assert stats["p99"] > 3 * stats["median"]  # a real tail, not one outlier


def test_the_configs_digit_cap_is_the_label_alphabet() -> None:
    from rpk.config import ARITH_MAX_DIGITS

    assert len(arith._LABELS) == ARITH_MAX_DIGITS
