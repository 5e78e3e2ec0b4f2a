"""The tiny model's accuracy by digit count: what RL starts from on each part of the task.

    .venv/bin/python -m bench.tiny_accuracy --cache-dir /tmp/tiny-a --set sft_steps=1500 \
        --out bench/results/tiny_accuracy.json

Builds (or reuses) the tiny model of the default `TinySpec` with the `--set` overrides
(`name=value`, `task.alpha=...` for the task), then decodes `--per-digit` held-out problems
of each digit count with transformers: one greedy response and `--samples` sampled at
temperature 1 (what a rollout draws). The long rounds of tail batching hold the prompts
with the longest responses, about the top fifth by digit count, so the table ends with the
sampled accuracy expected over the task's draw (all prompts, and those of `--long-from`
digits and more), weighting each digit count as the task draws it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import random
import time
from pathlib import Path
from typing import Any, Iterator

from bench.common import write_json


def _spec(overrides: list[str]) -> Any:
    from rpk.config import TinySpec

    spec = TinySpec()
    for item in overrides:
        key, _, raw = item.partition("=")
        if key.startswith("task."):
            name = key.removeprefix("task.")
            value = type(getattr(spec.task, name))(raw)
            spec = dataclasses.replace(spec, task=dataclasses.replace(spec.task, **{name: value}))
        else:
            current = getattr(spec, key)
            value = raw if current is None else type(current)(raw)
            if current is None:
                value = float(raw)
            spec = dataclasses.replace(spec, **{key: value})
    return spec


def _problems(digits: int, n: int, seed: int) -> list[Any]:
    from rpk.tasks.arith import ArithSpec, make_problem

    rng = random.Random(f"acc-{seed}-{digits}")
    # A flat draw over exactly `digits` columns: the task's own sampler with one digit
    # count allowed, so that operands are drawn exactly as in training.
    spec = ArithSpec(max_digits=digits, alpha=0.0)
    out: list[Any] = []
    while len(out) < n:
        p = make_problem(rng, spec)
        if p.digits == digits:
            out.append(p)
    return out


def _decode(model: Any, tok: Any, problems: list[Any], samples: int, max_new: int) -> list[list[str]]:
    """Per problem: the greedy response, then `samples` sampled ones."""
    import torch

    from rpk.tasks.arith import extract_answer

    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": p.question}], tokenize=False, add_generation_prompt=True
        )
        for p in problems
    ]
    ids = tok(prompts, add_special_tokens=False)["input_ids"]
    by_len: dict[int, list[int]] = {}
    for i, row in enumerate(ids):
        by_len.setdefault(len(row), []).append(i)
    answers: list[list[str]] = [[] for _ in problems]
    for width, members in by_len.items():
        batch = torch.tensor([ids[i] for i in members])
        for sample in range(samples + 1):
            kwargs = dict(do_sample=False) if sample == 0 else dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0)
            with torch.no_grad():
                out = model.generate(
                    batch, attention_mask=torch.ones_like(batch), max_new_tokens=max_new, **kwargs
                )
            texts = tok.batch_decode(out[:, width:], skip_special_tokens=True)
            for i, text in zip(members, texts):
                answers[i].append(extract_answer(text) or "")
    return answers


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    # The build pins itself to 2 threads; the experiments run on one core.
    yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache-dir", required=True, help="where the candidate is built")
    parser.add_argument("--set", action="append", default=[], help="TinySpec override name=value")
    parser.add_argument("--per-digit", type=int, default=40)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--digits", default="1-20", help="a-b range of digit counts")
    parser.add_argument("--long-from", type=int, default=7)
    parser.add_argument("--max-new", type=int, default=320)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import rpk.tiny as tiny

    torch.set_num_threads(args.threads)
    tiny._build_threads = lambda n: _one_thread()  # noqa: SLF001 - bench-only
    spec = _spec(args.set)
    started = time.monotonic()
    path = tiny.build_tiny_model(spec, Path(args.cache_dir))
    build_s = time.monotonic() - started
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    lo, hi = (int(x) for x in args.digits.split("-"))
    rows = []
    started = time.monotonic()
    for d in range(lo, hi + 1):
        problems = _problems(d, args.per_digit, 0)
        answers = _decode(model, tok, problems, args.samples, args.max_new)
        greedy = sum(a[0] == p.answer for p, a in zip(problems, answers)) / len(problems)
        sampled = sum(x == p.answer for p, a in zip(problems, answers) for x in a[1:]) / (
            len(problems) * args.samples
        )
        rows.append({"digits": d, "greedy": greedy, "sampled": sampled})
        print(f"{d:>3} digits  greedy {greedy:.3f}  sampled {sampled:.3f}", flush=True)
    eval_s = time.monotonic() - started

    alpha = spec.task.alpha
    def weighted(pred) -> float:
        sel = [r for r in rows if pred(r["digits"])]
        w = [r["digits"] ** -alpha for r in sel]
        return sum(wi * r["sampled"] for wi, r in zip(w, sel)) / sum(w) if sel else float("nan")

    summary = {
        "spec": dataclasses.asdict(spec),
        "build_s": round(build_s, 1),
        "eval_s": round(eval_s, 1),
        "sampled_all": weighted(lambda d: True),
        f"sampled_{args.long_from}plus": weighted(lambda d: d >= args.long_from),
        "rows": rows,
    }
    print(
        f"build {build_s:.0f}s  eval {eval_s:.0f}s  sampled, task draw: all {summary['sampled_all']:.3f}"
        f"  {args.long_from}+ digits {summary[f'sampled_{args.long_from}plus']:.3f}"
    )
    if args.out:
        write_json(Path(args.out), summary)


if __name__ == "__main__":
    main()
