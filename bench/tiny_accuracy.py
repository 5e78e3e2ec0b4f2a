"""The tiny model's accuracy by digit count: what RL starts from on each part of the task.

    .venv/bin/python -m bench.tiny_accuracy --cache-dir /tmp/tiny-a --set sft_steps=1500 \
        --out bench/results/tiny_accuracy.json

Builds (or reuses) the tiny model of the default `TinySpec` with the `--set` overrides
(`name=value`, `task.alpha=...` for the task), then decodes `--per-digit` held-out problems
of each digit count with transformers: one greedy response and `--samples` sampled at
temperature 1 (what a rollout draws). Per digit count it prints the greedy and sampled
accuracy and the share of greedy responses whose column lines are all right (a wrong
answer behind right lines is a failure to read the answer off them). The long rounds of
tail batching hold the prompts with the longest responses, about the top fifth by digit
count, so it ends with the sampled accuracy expected over the task's draw, over all
prompts and over those of `--long-from` digits and more (each measured digit count
weighted as the task draws it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from collections.abc import Iterator
from typing import Any

from bench import common
from bench.common import Col, table_header, table_line, write_json


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
            value = float(raw) if current is None else type(current)(raw)
            spec = dataclasses.replace(spec, **{key: value})
    return spec


def _problems(digits: int, n: int, seed: int) -> list[Any]:
    from rpk.tasks.arith import ArithSpec, make_problem

    rng = random.Random(f"acc-{seed}-{digits}")
    # The task's own sampler, kept to one digit count, so operands are drawn as in training.
    spec = ArithSpec(max_digits=digits, alpha=0.0)
    out: list[Any] = []
    while len(out) < n:
        p = make_problem(rng, spec)
        if p.digits == digits:
            out.append(p)
    return out


def _decode(model: Any, tok: Any, problems: list[Any], samples: int, max_new: int) -> list[list[str]]:
    """Per problem: the greedy response's text, then `samples` sampled ones'."""
    import torch

    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": p.question}], tokenize=False, add_generation_prompt=True
        )
        for p in problems
    ]
    ids = tok(prompts, add_special_tokens=False)["input_ids"]
    # Batches of one prompt length: no padding, so no position bookkeeping.
    by_len: dict[int, list[int]] = {}
    for i, row in enumerate(ids):
        by_len.setdefault(len(row), []).append(i)
    texts: list[list[str]] = [[] for _ in problems]
    for width, members in by_len.items():
        batch = torch.tensor([ids[i] for i in members])
        for sample in range(samples + 1):
            how = (
                {"do_sample": False}
                if sample == 0
                else {"do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": 0}
            )
            with torch.no_grad():
                out = model.generate(
                    batch, attention_mask=torch.ones_like(batch), max_new_tokens=max_new, **how
                )
            for i, text in zip(members, tok.batch_decode(out[:, width:], skip_special_tokens=True)):
                texts[i].append(text)
    return texts


def _right(text: str, problem: Any) -> bool:
    from rpk.tasks.arith import DATA_SOURCE, compute_score

    return compute_score(DATA_SOURCE, text, problem.answer) == 1.0


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "=" in line]


@contextlib.contextmanager
def _threads_as_set() -> Iterator[None]:
    yield


def main() -> None:
    parser = common.parser(__doc__)
    parser.add_argument("--cache-dir", required=True, help="where the candidate is built")
    parser.add_argument("--set", action="append", default=[], help="TinySpec override name=value")
    parser.add_argument("--per-digit", type=int, default=30, help="problems per digit count")
    parser.add_argument("--samples", type=int, default=4, help="sampled responses per problem")
    parser.add_argument(
        "--digits", default="1,2,3,4,5,6,7,8,10,12,14,16,18,20", help="digit counts measured"
    )
    parser.add_argument("--long-from", type=int, default=7, help="digit count of a long prompt")
    parser.add_argument("--max-new", type=int, default=320, help="response budget in tokens")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, build included")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import rpk.tasks.tiny as tiny
    from rpk.tasks.arith import solution_text

    torch.set_num_threads(args.threads)
    # The build sets its own thread count; here it keeps --threads.
    tiny._build_threads = lambda n: _threads_as_set()  # noqa: SLF001
    spec = _spec(args.set)
    started = time.monotonic()
    path = tiny.build_tiny_model(spec, args.cache_dir)
    build_s = time.monotonic() - started
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    rows = []
    started = time.monotonic()
    cols = (Col("digits", "digits", 6), Col("greedy", "greedy", 8, ".3f"),
            Col("sampled", "sampled", 9, ".3f"), Col("lines right", "greedy_lines", 13, ".3f"))
    print(table_header(cols))
    for d in (int(x) for x in args.digits.split(",")):
        problems = _problems(d, args.per_digit, 0)
        texts = _decode(model, tok, problems, args.samples, args.max_new)
        n = len(problems)
        greedy = sum(_right(t[0], p) for p, t in zip(problems, texts)) / n
        sampled = sum(_right(x, p) for p, t in zip(problems, texts) for x in t[1:]) / (
            n * args.samples
        )
        lines = sum(_lines(t[0]) == _lines(solution_text(p)) for p, t in zip(problems, texts)) / n
        rows.append({"digits": d, "greedy": greedy, "sampled": sampled, "greedy_lines": lines})
        print(table_line(rows[-1], cols), flush=True)
    eval_s = time.monotonic() - started

    def expected(keep: Any) -> float:
        # Sampled accuracy over the task's draw, P(d) ~ d**-alpha, on the measured d.
        chosen = [r for r in rows if keep(r["digits"])]
        weights = [r["digits"] ** -spec.task.alpha for r in chosen]
        if not chosen:
            return float("nan")
        return sum(w * r["sampled"] for w, r in zip(weights, chosen)) / sum(weights)

    summary = {
        "spec": dataclasses.asdict(spec),
        "build_s": round(build_s, 1),
        "eval_s": round(eval_s, 1),
        "sampled_all": expected(lambda d: True),
        "sampled_long": expected(lambda d: d >= args.long_from),
        "long_from": args.long_from,
        "rows": rows,
    }
    print(
        f"build {build_s:.0f}s, eval {eval_s:.0f}s; sampled accuracy over the task's draw: "
        f"all {summary['sampled_all']:.3f}, {args.long_from}+ digits {summary['sampled_long']:.3f}"
    )
    write_json(args.out, summary)


if __name__ == "__main__":
    main()
