"""Which of the paper's settings fit, from the memory plan (`rpk.gpu.plan`): Qwen2.5
7B/14B/32B at 8k/16k/32k responses on 8 x 80 GB, and on more nodes. Pure arithmetic:
runs anywhere in a second.

    python -m bench.memory_plan [--gpu-gb 80] [--nodes 1 4] [--markdown]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rpk.gpu.plan import Knobs, ModelShape, Phase, PlanRefused, Target, plan_memory

MODELS = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "models"
PROMPT_TOKENS = 1024


def rows(gpu_gb: float, nodes: list[int]) -> list[list[str]]:
    out = []
    for name in ("7b", "14b", "32b"):
        shape = ModelShape.from_hf(json.loads((MODELS / f"qwen2.5-{name}" / "config.json").read_text()))
        for n in nodes:
            for response in (8192, 16384, 32768):
                target = Target(n, 8, int(gpu_gb * 1e9))
                label = [f"Qwen2.5-{name.upper()}", f"{response // 1024}k", f"{n}x8"]
                try:
                    p = plan_memory(shape, target, Knobs(max_model_len=response + PROMPT_TOKENS))
                except PlanRefused as e:
                    out.append([*label, "no", "-", "-", "-", "-", str(e).rsplit("); ", 1)[-1]])
                    continue
                train = next(x for x in p.phases if x.phase is Phase.TRAIN)
                out.append([*label, "yes", str(p.tp), p.offload.value, f"{p.kv_tokens_per_replica:,}",
                            f"{train.total / 1e9:.0f}", "defer" if p.defer_reduction else "reduce each micro-batch"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu-gb", type=float, default=80.0)
    ap.add_argument("--nodes", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args(argv)
    head = ["model", "response", "GPUs", "fits", "TP", "offload", "KV tokens/replica", "train GB/GPU", "note"]
    body = rows(args.gpu_gb, args.nodes)
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
        for r in body:
            print("| " + " | ".join(r) + " |")
    else:
        widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
        for r in [head, *body]:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
