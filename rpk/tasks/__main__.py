"""`python -m rpk.tasks`: the built-in task's reference response lengths, to show its
long tail. It lives apart from the task so that the task module stays a leaf (the tiny
model's tokenizer, which it counts with, is built from the task)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import fields

from transformers import AutoTokenizer

from rpk.tasks.arith import ArithSpec, length_stats, reference_lengths
from rpk.tasks.specs import TinySpec
from rpk.tasks.tiny import build_tokenizer


def main(argv: Sequence[str] | None = None) -> None:
    defaults = ArithSpec()
    parser = argparse.ArgumentParser(
        prog="python -m rpk.tasks",
        description="Print the reference response-length distribution (tokens) of the "
        "arithmetic task, to show its long tail.",
    )
    parser.add_argument("--n", type=int, default=2000, help="problems to draw (default 2000)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument(
        "--model",
        default=None,
        help="model directory whose tokenizer counts tokens (default: rpk's tiny-model "
        "tokenizer, trained on the fly)",
    )
    helps = {f.name: f.metadata["help"] for f in fields(ArithSpec)}
    parser.add_argument(
        "--max-digits", type=int, default=defaults.max_digits, help=helps["max_digits"]
    )
    parser.add_argument("--alpha", type=float, default=defaults.alpha, help=helps["alpha"])
    args = parser.parse_args(argv)
    spec = ArithSpec(max_digits=args.max_digits, alpha=args.alpha)

    if args.model is None:
        tokenizer = build_tokenizer(TinySpec(task=spec))
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    stats = length_stats(reference_lengths(tokenizer, args.n, args.seed, spec))
    print(f"reference response length in tokens (EOS included), {spec}:")
    for key, value in stats.items():
        shown = f"{value:.2f}" if key in ("mean", "max/median") else f"{value:.0f}"
        print(f"  {key:>10}: {shown}")


if __name__ == "__main__":
    main()
