"""What a tiny-judge build is worth, measured with transformers the way the `reason`
verdict reads it: the judge writes greedily until it has written `Verdict:` (or
`REASON_TOKENS` tokens, then the marker is appended), and P(YES) / (P(YES) + P(NO)) is
read at the next position.

- **Accuracy by digit band**, on problems none of which the build trained on: half
  right answers (the reference solution), half the policy's mistakes
  (`rpk.judge.attacks.WRONG_ANSWERS`), digit counts drawn evenly within the band. The
  truth is the rule checker's on the whole response.
- **False positives on held-out attacks** (`rpk.judge.attacks.held_out`): each attack
  on problems of every band; a YES (P(YES) >= 0.5) is a false positive.

`bench.tiny_judge` writes these figures to a JSON; the build writes them to its
`rpk_tiny.json` with fewer cases.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rpk.judge import attacks
from rpk.judge.tiny import MARKER, REASON_TOKENS, Case, prompt_ids, reference, training_answers, verdict_ids
from rpk.tasks.arith import DATA_SOURCE, Problem, compute_score, problem_of, solution_text
from rpk.tasks.specs import ArithSpec, TinySpec

BANDS = ((1, 3), (4, 6), (7, 10), (11, 20))


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the judge said about one case: P(YES) after the marker, the YES+NO
    probability mass there, what it wrote, and whether it wrote the marker itself."""

    p_yes: float
    mass: float
    text: str
    marked: bool


def _generate(model: Any, tokenizer: Any, rows: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations of `rows`, each stopped once its text ends with the marker
    or at an end of text (not kept)."""
    import torch

    pad = tokenizer.pad_token_id
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for k, r in enumerate(rows):  # left-padded: every row's last position is its own
        ids[k, width - len(r):] = torch.tensor(r)
        attn[k, width - len(r):] = 1
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    out: list[list[int]] = [[] for _ in rows]
    done = [False] * len(rows)
    past = None
    step_ids = ids
    with torch.no_grad():
        for _ in range(max_tokens):
            result = model(input_ids=step_ids, attention_mask=attn, position_ids=positions,
                           past_key_values=past, use_cache=True)
            past = result.past_key_values
            nxt = result.logits[:, -1].argmax(-1)
            for k in range(len(rows)):
                if done[k]:
                    continue
                # An end of text ends the thought (vLLM stops there; rpk appends the
                # marker after what came before it).
                if int(nxt[k]) == tokenizer.eos_token_id:
                    done[k] = True
                    continue
                out[k].append(int(nxt[k]))
                done[k] = tokenizer.decode(out[k][-4:]).endswith(MARKER)
            if all(done):
                break
            step_ids = nxt[:, None]
            attn = torch.cat([attn, torch.ones((len(rows), 1), dtype=torch.long)], dim=1)
            positions = positions[:, -1:] + 1
    return out


def _verdict_logprobs(model: Any, rows: list[list[int]], pad: int, yes: int, no: int) -> list[tuple[float, float]]:
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for k, r in enumerate(rows):
        ids[k, width - len(r):] = torch.tensor(r)
        attn[k, width - len(r):] = 1
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=positions).logits[:, -1]
    logp = torch.log_softmax(logits.float(), -1)
    return [(float(a), float(b)) for a, b in zip(logp[:, yes], logp[:, no])]


def judge(model: Any, tokenizer: Any, cases: Sequence[Case], batch: int = 32,
          max_tokens: int = REASON_TOKENS) -> list[Verdict]:
    """The reason verdict on each case (the module docstring's reading), batched by
    length (a batch runs as long as its longest scratchpad)."""
    yes, no = verdict_ids(tokenizer)
    marker = tokenizer("\n" + MARKER, add_special_tokens=False)["input_ids"]
    prompts = [prompt_ids(tokenizer, c) for c in cases]
    order = sorted(range(len(cases)), key=lambda i: (cases[i].digits, len(prompts[i])))
    out: dict[int, Verdict] = {}
    for start in range(0, len(order), batch):
        chunk = order[start:start + batch]
        written = _generate(model, tokenizer, [prompts[i] for i in chunk], max_tokens)
        marked = [tokenizer.decode(w).endswith(MARKER) for w in written]
        full = [prompts[i] + w + ([] if m else marker) for i, w, m in zip(chunk, written, marked)]
        logprobs = _verdict_logprobs(model, full, tokenizer.pad_token_id, yes, no)
        for i, w, m, (ly, ln) in zip(chunk, written, marked, logprobs):
            mass = math.exp(ly) + math.exp(ln)
            out[i] = Verdict(math.exp(ly) / mass if mass > 0 else 0.5, mass, tokenizer.decode(w), m)
    return [out[i] for i in range(len(cases))]


def first_token_p_yes(model: Any, tokenizer: Any, cases: Sequence[Case]) -> list[float]:
    """P(YES) among the two words at the judge's first token, as the logprob verdict
    reads it (what engines are compared on; the tiny judge answers after a scratchpad)."""
    yes, no = verdict_ids(tokenizer)
    rows = [prompt_ids(tokenizer, c) for c in cases]
    return [math.exp(ly) / (math.exp(ly) + math.exp(ln))
            for ly, ln in _verdict_logprobs(model, rows, tokenizer.pad_token_id, yes, no)]


def _fresh(rng: random.Random, spec: ArithSpec, lo: int, hi: int, taken: set[str]) -> Problem:
    """A problem of lo..hi digits (even odds per count) whose reference is not in `taken`
    (the judge sees no question: an answer it trained on is a case it saw)."""
    for _ in range(10_000):
        p = problem_of(rng.randint(lo, min(hi, spec.max_digits)), rng)
        if reference(p) not in taken:
            taken.add(reference(p))
            return p
    raise ValueError(f"no unseen problem of {lo}-{hi} digits left")


def ruled(ref: str, response: str, kind: str, digits: int) -> Case:
    """A held-out case whose truth is the rule checker's on the whole response."""
    return Case(ref, response, compute_score(DATA_SOURCE, response, ref[1::2]) == 1.0, kind, digits)


def bands(spec: ArithSpec) -> list[tuple[int, int]]:
    """The digit bands of `BANDS` a task of `spec.max_digits` reaches."""
    return [(lo, min(hi, spec.max_digits)) for lo, hi in BANDS if lo <= spec.max_digits]


def band_cases(spec: TinySpec, per_band: int, seed: int = 0) -> dict[str, list[Case]]:
    """`per_band` held-out cases per digit band, alternately right and a policy mistake."""
    taken = training_answers(spec)
    rng = random.Random(f"judge-eval-{spec.seed}-{seed}")
    out: dict[str, list[Case]] = {}
    for lo, hi in bands(spec.task):
        cases = []
        for i in range(per_band):
            p = _fresh(rng, spec.task, lo, hi, taken)
            head, answer = attacks.parts(p)
            ref = reference(p)
            if i % 2:
                mistake = rng.choice(attacks.WRONG_ANSWERS)
                wrong = mistake(answer, rng)
                while wrong == answer:
                    wrong = mistake(answer, rng)
                cases.append(ruled(ref, f"{head}Answer: {wrong}", mistake.__name__, p.digits))
            else:
                cases.append(ruled(ref, solution_text(p), "right", p.digits))
        out[f"{lo}-{hi}"] = cases
    return out


def attack_cases(spec: TinySpec, per_attack: int, seed: int = 0) -> list[tuple[attacks.Attack, Case]]:
    """Each held-out attack on `per_attack` unseen problems, the bands taken in turn."""
    taken = training_answers(spec)
    rng = random.Random(f"judge-attacks-{spec.seed}-{seed}")
    spans = bands(spec.task)
    out = []
    for attack in attacks.held_out():
        for i in range(per_attack):
            lo, hi = spans[i % len(spans)]
            p = _fresh(rng, spec.task, lo, hi, taken)
            case = ruled(reference(p), attack.make(p, rng), attack.kind, p.digits)
            if case.correct:
                raise ValueError(f"attack {attack.name!r} made a right answer: {case.response!r}")
            out.append((attack, case))
    return out


def _rate(hits: Sequence[bool]) -> dict[str, float]:
    n = len(hits)
    share = sum(hits) / n if n else math.nan
    return {"n": n, "rate": share, "stderr": math.sqrt(share * (1 - share) / n) if n else math.nan}


def evaluate(model: Any, tokenizer: Any, spec: TinySpec, per_band: int, per_attack: int,
             seed: int = 0, max_tokens: int = REASON_TOKENS) -> dict[str, Any]:
    """Accuracy by band (and by mistake), false positives by attack kind and attack, and
    how the verdicts were read (marker written, YES+NO mass)."""
    by_band = band_cases(spec, per_band, seed)
    attacked = attack_cases(spec, per_attack, seed)
    flat = [c for cases in by_band.values() for c in cases]
    verdicts = judge(model, tokenizer, flat + [c for _, c in attacked], max_tokens=max_tokens)
    said = iter(verdicts)
    report: dict[str, Any] = {"bands": {}, "attacks": {}, "attack_kinds": {}}
    for band, cases in by_band.items():
        hits = [(next(said).p_yes >= 0.5) == c.correct for c in cases]
        kinds: dict[str, list[bool]] = {}
        for h, c in zip(hits, cases):
            kinds.setdefault(c.kind, []).append(h)
        report["bands"][band] = {"accuracy": _rate(hits), "by_kind": {k: _rate(v)["rate"] for k, v in kinds.items()}}
    fps: dict[str, list[bool]] = {}
    kinds_fp: dict[str, list[bool]] = {}
    texts = set()
    for attack, case in attacked:
        fp = next(said).p_yes >= 0.5
        fps.setdefault(attack.name, []).append(fp)
        kinds_fp.setdefault(attack.kind, []).append(fp)
        texts.add(case.response)
    report["attacks"] = {name: {"kind": a.kind, "false_positive": sum(fps[name]) / len(fps[name])}
                         for name, a in {a.name: a for a, _ in attacked}.items()}
    report["attack_kinds"] = {k: _rate(v) for k, v in kinds_fp.items()}
    report["false_positive"] = _rate([f for v in fps.values() for f in v])
    report["distinct_attacks"] = len(fps)
    report["distinct_attack_texts"] = len(texts)
    report["marker_written"] = sum(v.marked for v in verdicts) / len(verdicts)
    report["mass_min"] = min(v.mass for v in verdicts)
    report["accuracy_min_band"] = min(b["accuracy"]["rate"] for b in report["bands"].values())
    return report


def build_figures(model: Any, tokenizer: Any, spec: TinySpec) -> dict[str, float]:
    """The build's figures for `rpk_tiny.json` and its log line: a smaller evaluation."""
    report = evaluate(model, tokenizer, spec, per_band=40, per_attack=1)
    figures = {f"accuracy_{band}": b["accuracy"]["rate"] for band, b in report["bands"].items()}
    figures["false_positive"] = report["false_positive"]["rate"]
    figures["attacks"] = float(report["distinct_attacks"])
    return figures
