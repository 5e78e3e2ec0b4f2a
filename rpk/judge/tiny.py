"""The tiny judge rpk builds itself, as it builds the tiny policy (`rpk.tasks.tiny`: same
architecture, chat template and cache, another recipe), so that a judged run needs no
download. It reasons before its verdict: it writes a scratchpad, then `Verdict:` and YES
or NO as the next token, which is where the `reason` verdict reads P(YES).

Its prompt (`DEFAULT`): the response from its last `Answer:` on (at most
`RESPONSE_CHARS` of its tail), then the reference, which the judged task writes with
lower-case labels (`d5c2b1a8` for the policy's `D5C2B1A8`), so that every label the
judge looks up occurs once on each side; no question, no system message. It is rendered
by `rpk.reward.judge` exactly as the judge's requests are.

The scratchpad is built so that every token is one local step for a model this small,
either a look-up by label (the induction-head move the tiny policy already makes) or a
function of the few tokens just written:

    Dd=        the answer line's first token, the reference's first label, a mark
    D5Cd5c=    per reference label: the upper-case label, the digit behind it in the
    C2Bc2b=    answer line and what follows that digit (the next label, `.` at the end
    B1Ab1a=    of the line, `?` anything else; `-` `-` when the label is not there);
    A9.a8.!    the reference's label, digit and follower; `=` when the two triples agree
    Verdict:NO YES exactly when no mark is `!`

The answer line's digit comes before the reference's, so that it cannot be copied from
it; the followers chain the labels, so a digit dropped, added, swapped or a label left
out breaks a line; the first line catches an answer that starts with another label. A
verdict taught as one token with no scratchpad, or a scratchpad that looked labels up
among the response's own lines, left a model this size saying YES to everything.

`check` is the scratchpad's definition; every case the build learns from or is
measured on is labelled by it, and agrees with the rule checker
(`rpk.tasks.arith.compute_score`) on it (`tests/test_judge_tiny.py`). Where the two would
part (an unlabelled `Answer: 5218`, right by the rule) the judge says NO: the policy
writes labels. The judge learns from right answers, the policy's mistakes, answers with
other digits, injections, master keys and special-token text (`rpk.judge.attacks`'
training texts; the held-out ones `rpk.judge.tiny_eval` measures are never shown).
"""

from __future__ import annotations

import dataclasses
import random
import zlib
from typing import Any

from rpk.judge import attacks
from rpk.judge.prompt import ChatTokens
from rpk.reward.judge import JudgeRequest, JudgeSettings, grading_request, shown
from rpk.reward.verdict import Verdict
from rpk.tasks.arith import Problem, make_problem, solution_text
from rpk.tasks.arith import judge_reference as reference
from rpk.tasks.tiny import Example, TinySpec, check_fits

# Bump whenever a change here alters what a build produces for the same spec.
CODE_VERSION = 8

MARKER = "Verdict:"
ANSWER = "Answer: "
TEMPLATE = "{response}\n\nReference:\n{reference}"
# The longest answer line (`Answer: ` and 40 characters) with room for a line after it.
RESPONSE_CHARS = 96
# The scratchpad of a 20-digit answer: the first line (4 tokens), 20 lines of 8, the
# marker; with a margin.
REASON_TOKENS = 192
DEFAULT = JudgeSettings(system="", template=TEMPLATE, max_response_chars=RESPONSE_CHARS,
                        response_after=ANSWER.strip(), verdict=Verdict.REASON,
                        reason_tokens=REASON_TOKENS, verdict_marker=MARKER)

_LABELS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
SAME, DIFFERENT = "=", "!"
# Shares of the training kinds (the rest are right answers). Answers with other digits
# (`scrambled`) disagree with the reference on most lines: a model that copies the
# answer's digit, written just before, as the reference's is wrong on them. A fifth of
# them left a build doing exactly that (docs/reward.md).
SHARES = {"near_miss": 0.2, "scrambled": 0.4, "injection": 0.04, "master_key": 0.03,
          "special_token": 0.03}
# Of right answers: the share with a line of text after the answer line (still right).
_RIGHT_WITH_TEXT = 0.1
_TOKENIZER_PROBLEMS = 300
_SHORT_DIGITS = 4
# The fixed prompt's words and the marker, repeated so that BPE merges them.
_PROMPT_REPEATS = 50


@dataclasses.dataclass(frozen=True, slots=True)
class Case:
    """One judge example: the reference (lower-case labels), a response, the verdict
    (`check`'s), what kind of response it is and its problem's digit count."""

    reference: str
    response: str
    correct: bool
    kind: str
    digits: int


def seen(text: str) -> str:
    """What the judge is shown of a response `text`."""
    return shown(DEFAULT, text)


def answer_value(text: str) -> str:
    """The answer line the judge checks in what it is shown: the rest of the line after
    `Answer: ` when what it is shown starts with that, else nothing."""
    return text[len(ANSWER):].split("\n", 1)[0] if text.startswith(ANSWER) else ""


def _alone(value: str, at: int) -> bool:
    """`value[at]` is a label standing alone: no letter on either side."""
    return (value[at] in _LABELS and not (at > 0 and value[at - 1].isalpha())
            and not (at + 1 < len(value) and value[at + 1].isalpha()))


def _find(value: str, label: str) -> int:
    return next((i for i, ch in enumerate(value) if ch == label and _alone(value, i)), -1)


def _follower(value: str, at: int) -> str:
    if at >= len(value):
        return "."
    return value[at] if _alone(value, at) else "?"


def check(ref: str, text: str) -> tuple[list[str], bool]:
    """The scratchpad's lines for the response `text` (as the judge is shown it) against
    the reference `ref` (lower-case labels), and whether its verdict is YES (the
    module docstring's layout)."""
    value = answer_value(text)
    first = value[0] if value and _alone(value, 0) else "?"
    marks = [first == ref[0].upper()]
    lines = [f"{first}{ref[0]}{SAME if marks[0] else DIFFERENT}"]
    for k in range(0, len(ref), 2):
        label, digit = ref[k], ref[k + 1]
        after = ref[k + 2] if k + 2 < len(ref) else "."
        at = _find(value, label.upper())
        if at < 0:
            got, follows = "-", "-"
        elif at + 1 < len(value) and value[at + 1].isdigit():
            got, follows = value[at + 1], _follower(value, at + 2)
        else:
            got, follows = "?", "?"
        marks.append(got == digit and follows == after.upper())
        lines.append(f"{label.upper()}{got}{follows}{label}{digit}{after}{SAME if marks[-1] else DIFFERENT}")
    return lines, all(marks)


def scratchpad(case: Case) -> str:
    """What the judge writes for `case`: its check, then the marker (the verdict word
    follows it)."""
    lines, ok = check(case.reference, seen(case.response))
    if ok != case.correct:
        raise ValueError(f"the check says {ok}, the case {case.correct}: {case!r}")
    return "\n".join(lines) + f"\n{MARKER}"


def judged(ref: str, response: str, kind: str, digits: int) -> Case:
    """A case whose verdict is `check`'s on what the judge is shown of `response`."""
    return Case(ref, response, check(ref, seen(response))[1], kind, digits)


def _kind(draw: float) -> str:
    """The training kind a uniform `draw` picks with `SHARES` (the rest: right answers)."""
    for kind, share in SHARES.items():
        if draw < share:
            return kind
        draw -= share
    return "right"


def _near_miss(head: str, answer: str, rng: random.Random) -> str:
    """A wrong response close to the right one: one of the policy's mistakes, or the
    right digits where the rule reads no right answer."""
    form = rng.random()
    if form < 0.7:
        return f"{head}{ANSWER}{attacks.wrong_answer(answer, rng)}"
    if form < 0.8:
        return f"{head}{ANSWER}{answer}{rng.choice(attacks.TRAIN_TRAILERS)}"
    if form < 0.86 and len(answer) > 2:
        return f"{head}{ANSWER}{attacks.split(answer, rng.choice(attacks.TRAIN_SEPARATORS))}"
    if form < 0.92:
        return head + rng.choice(attacks.TRAIN_NO_ANSWER_LINES).format(a=answer)
    if form < 0.96:
        return f"{head}{ANSWER}{answer}\n{ANSWER}{attacks.wrong_answer(answer, rng)}"
    return attacks.other_solution(answer, rng)


def _scrambled(digits: int, rng: random.Random) -> str:
    """Labelled digits drawn apart from the reference's, as many or one more or fewer."""
    n = max(1, min(len(_LABELS), digits + rng.choice((0, 0, 0, -1, 1))))
    return attacks.relabel([str(rng.randrange(10)) for _ in range(n)])


def make_case(p: Problem, rng: random.Random) -> Case:
    """One training example for problem `p`, its kind drawn with `SHARES`."""
    head, answer = attacks.parts(p)
    kind = _kind(rng.random())
    if kind == "near_miss":
        response = _near_miss(head, answer, rng)
    elif kind == "scrambled":
        response = f"{head}{ANSWER}{_scrambled(p.digits, rng)}"
    elif kind == "injection":
        response = attacks.wrong_body(p, rng) + rng.choice(attacks.TRAIN_INJECTIONS)
    elif kind == "master_key":
        response = rng.choice(("", "", head)) + rng.choice(attacks.TRAIN_MASTER_KEYS)
    elif kind == "special_token":
        response = attacks.wrong_body(p, rng) + rng.choice(attacks.TRAIN_SPECIAL_TOKENS)
    else:
        response = solution_text(p)
        if rng.random() < _RIGHT_WITH_TEXT:
            response += "\n" + rng.choice(attacks.TRAIN_AFTER_RIGHT)
    return judged(reference(p), response, kind, p.digits)


# --------------------------------------------------------------------------- tokens


def request(case: Case) -> JudgeRequest:
    """The judge's request for `case`, as the reward path makes it."""
    return grading_request(DEFAULT, "", case.reference, case.response)


def _text_ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def prompt_ids(tokenizer: Any, case: Case) -> list[int]:
    """The judge's prompt for `case` as token ids: the chat template's markers as special
    tokens and the data tokenised as text, as `rpk.judge.prompt.ChatTokens` sends it."""
    return ChatTokens(tokenizer).ids(request(case))


def verdict_ids(tokenizer: Any) -> tuple[int, int]:
    """The ids of the yes and no words, each one token."""
    yes, no = (_text_ids(tokenizer, w) for w in (DEFAULT.yes, DEFAULT.no))
    if len(yes) != 1 or len(no) != 1:
        raise ValueError(f"the judge's verdict words are not one token each: {yes}, {no}")
    return yes[0], no[0]


def encode_case(tokenizer: Any, case: Case) -> Example:
    """(prompt + scratchpad + marker + verdict + EOS, loss mask): the loss on all the
    judge writes."""
    ids = prompt_ids(tokenizer, case)
    word = DEFAULT.yes if case.correct else DEFAULT.no
    written = _text_ids(tokenizer, scratchpad(case)) + _text_ids(tokenizer, word) + [tokenizer.eos_token_id]
    return ids + written, [0] * len(ids) + [1] * len(written)


def corpus(spec: TinySpec) -> list[str]:
    """The tokenizer's text: the judge's fixed prompt and marker (often enough to merge
    their words), problems, solutions and the attack texts the training shows. No
    scratchpad: its letters must stay one token each."""
    rng = random.Random(f"judge-tokenizer-{spec.seed}")
    texts = ["system", "user", "assistant", DEFAULT.yes, DEFAULT.no]
    fixed = [TEMPLATE.format(response="", reference=""), f"{MARKER}{DEFAULT.yes} {MARKER}{DEFAULT.no}"]
    texts += fixed * _PROMPT_REPEATS
    texts += [*attacks.TRAIN_INJECTIONS, *attacks.TRAIN_MASTER_KEYS, *attacks.TRAIN_SPECIAL_TOKENS]
    for _ in range(_TOKENIZER_PROBLEMS):
        p = make_problem(rng, spec.task)
        texts += [p.question, solution_text(p)]
    return texts


def _task(spec: TinySpec) -> Any:
    return spec.task if spec.sft_alpha is None else dataclasses.replace(spec.task, alpha=spec.sft_alpha)


def held_out(ref: str) -> bool:
    """Whether the reference `ref` is one the build never learns from: a third of the
    short ones (at most `_SHORT_DIGITS` digits), by a hash. There are only about a
    thousand answers of 1-3 digits, and a large warm-up set would leave the held-out
    figures none to draw."""
    return len(ref) // 2 <= _SHORT_DIGITS and zlib.crc32(ref.encode()) % 3 == 0


def _trained_problem(rng: random.Random, task: Any) -> Problem:
    while True:
        p = make_problem(rng, task)
        if not held_out(reference(p)):
            return p


def training_cases(spec: TinySpec) -> list[Case]:
    rng = random.Random(f"judge-sft-{spec.seed}")
    task = _task(spec)
    return [make_case(_trained_problem(rng, task), rng) for _ in range(spec.sft_problems)]


def training_answers(spec: TinySpec) -> set[str]:
    """The references the build learns from: held-out cases use none of them."""
    return {c.reference for c in training_cases(spec)}


def examples(tokenizer: Any, spec: TinySpec) -> list[Example]:
    """The warm-up set: `spec.sft_problems` cases (digit counts drawn with `spec.sft_alpha`)."""
    out = [encode_case(tokenizer, c) for c in training_cases(spec)]
    check_fits(out, spec)
    return out
