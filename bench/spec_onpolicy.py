"""On-policy, shown: with and without speculative decoding the rollout samples the same
distribution, and the engine's log-probs are the policy's.

Two arms on the real CPU engine, the same model and prompts, independent seeds: `off`
(no speculative config) and a speculating one (rpk's proposer with every draft source,
drafting `--k` tokens at every batch size so that as many tokens as possible are
drafted ones; or vLLM's ngram). Each arm runs `--steps` sync steps of P prompts x R
responses at temperature 1 through the real step loop (`run_step`, with a trainer that
trains nothing, so the weights never change): the finished siblings feed drafts, and
from the second step on each prompt's earlier responses do too. Then, over the arms'
samples:
- response lengths: two-sample Kolmogorov-Smirnov;
- rewards (the task's 0/1): a two-proportion z-test;
- first tokens: a chi-square test of homogeneity;
and the log-prob mismatch: each arm's engine log-probs against the policy's own
(transformers, float32, temperature 1) over `--recompute` responses: mean, p99 and max
|difference| per token. Speculation must not change any of them.

    flock /tmp/rpk-heavy.lock .venv/bin/python -m bench.spec_onpolicy --out bench/results/spec_onpolicy.json
"""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import args_json, parser, write_json
from bench.two_sample import chi2_test, ks_test, proportions_test
from rpk.core.drafts import SPECULATIVE, Speculative
from rpk.core.records import Prompt, Response, Scored
from rpk.sched.speculate import SpecRule
from rpk.sim.trainer import NullTrainer

P, R, STEPS = 64, 16, 2


class FrozenTrainer(NullTrainer):
    """Trains nothing and keeps its version: the engine serves one policy throughout."""

    def finish_step(self) -> dict[str, float]:
        out = dict(super().finish_step())
        self.version -= 1
        return out


class TaskScorer:
    """The built-in arithmetic task's reward, in-process."""

    async def score(self, response: Response) -> Scored:
        from rpk.tasks.arith import compute_score

        p = response.prompt
        r = compute_score(p.data_source, response.text, p.ground_truth)
        return Scored(response, r, r == 1.0)

    async def aclose(self) -> None:
        return None


def _centred(rewards: Sequence[float]) -> list[float]:
    m = sum(rewards) / len(rewards)
    return [r - m for r in rewards]


async def run_arm(model_dir: Path, prompts: Sequence[Prompt], choice: Speculative, seed: int, *,
                  p: int, r: int, steps: int, max_tokens: int, k: int) -> dict[str, Any]:
    """One arm's samples (tokens, log-probs, reward) and its speculation's records."""
    from rpk.engine.placement import fleet_plan
    from rpk.engine.vllm_fleet import launch_fleet
    from rpk.engine.vllm_settings import SpecSettings, VLLMSettings
    from rpk.loop.speculate import SpecTail
    from rpk.loop.step import run_step
    from rpk.loop.trainer import AsyncTrainer
    from rpk.sched.policies import PolicyOptions, make_policy
    from rpk.sched.policy import Sampling

    row = SPECULATIVE[choice]
    rule = SpecRule(max_k=k, adaptive=False) if row.method is not None else None
    spec = SpecSettings(row.method, k) if row.method is not None else None
    settings = VLLMSettings(model=model_dir, max_num_seqs=p * r, seed=seed, speculative=spec)
    fleet = await launch_fleet(settings, fleet_plan((), (), 1, False), platform="cpu")
    trainer = AsyncTrainer(FrozenTrainer())
    samples: list[dict[str, Any]] = []
    records: list[dict[str, float]] = []
    try:
        policy = make_policy("sync", prompts[:p], Sampling(p, r, max_tokens, seed=seed),
                             PolicyOptions(shuffle=False, concurrency=p * r,
                                           spec_sources=row.sources, spec_rule=rule))
        tail = SpecTail(policy.speculation, fleet) if policy.speculation is not None else None
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            outcome = await run_step(step, policy, fleet, TaskScorer(), trainer, _centred, version=0, spec=tail)
            records.append({"step": step, "rollout_s": outcome.time_rollout_s, "wall_s": time.perf_counter() - t0,
                            **(tail.record() if tail is not None else {})})
            for g in outcome.round.groups:
                for m in g.members:
                    resp = m.response
                    samples.append({"prompt": list(resp.prompt.token_ids), "tokens": list(resp.token_ids),
                                    "logprobs": list(resp.logprobs), "reward": m.reward})
    finally:
        await trainer.aclose()
        await fleet.shutdown()
    return {"speculative": choice.value, "seed": seed, "samples": samples, "steps": records}


def recompute(model_dir: Path, samples: Sequence[dict[str, Any]]) -> list[float]:
    """|engine log-prob - the policy's| per token over `samples` (transformers, fp32, T=1)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    diffs: list[float] = []
    with torch.no_grad():
        for s in samples:
            prompt, tokens = s["prompt"], s["tokens"]
            if not tokens:
                continue
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1]
            logp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
            diffs += (logp - torch.tensor(s["logprobs"])).abs().tolist()
    return diffs


def _mismatch(diffs: Sequence[float]) -> dict[str, float]:
    ordered = sorted(diffs)
    return {"tokens": len(ordered), "mean_abs": statistics.fmean(ordered),
            "p99_abs": ordered[int(0.99 * (len(ordered) - 1))], "max_abs": ordered[-1]}


def _at_random(samples: Sequence[dict[str, Any]], seed: int) -> tuple[list[int], list[float]]:
    """One token per response, at a position drawn uniformly (seeded), and its log-prob:
    independent draws across responses, unlike every token of them."""
    rng = random.Random(seed)
    picks = [(s, rng.randrange(len(s["tokens"]))) for s in samples if s["tokens"]]
    return [s["tokens"][i] for s, i in picks], [s["logprobs"][i] for s, i in picks]


def compare(off: dict[str, Any], on: dict[str, Any]) -> dict[str, Any]:
    """The two-sample tests: the issue's three (lengths, rewards, first tokens), and two
    that see the whole response (a token drawn at a random position of each, and its
    log-prob: a wrong temperature or a biased acceptance shifts both)."""
    a, b = off["samples"], on["samples"]
    tokens_a, logprobs_a = _at_random(a, 1)
    tokens_b, logprobs_b = _at_random(b, 2)
    return {
        "lengths_ks": ks_test([len(s["tokens"]) for s in a], [len(s["tokens"]) for s in b]).to_json(),
        "rewards_z": proportions_test([s["reward"] for s in a], [s["reward"] for s in b]).to_json(),
        "first_token_chi2": chi2_test([s["tokens"][0] for s in a if s["tokens"]],
                                      [s["tokens"][0] for s in b if s["tokens"]]).to_json(),
        "random_token_chi2": chi2_test(tokens_a, tokens_b).to_json(),
        "random_logprob_ks": ks_test(logprobs_a, logprobs_b).to_json(),
    }


def summary(arm: dict[str, Any]) -> dict[str, Any]:
    s = arm["samples"]
    steps = arm["steps"]
    out = {
        "speculative": arm["speculative"], "seed": arm["seed"], "samples": len(s),
        "length_mean": statistics.fmean(len(x["tokens"]) for x in s),
        "reward_mean": statistics.fmean(x["reward"] for x in s),
        "rollout_s": sum(r["rollout_s"] for r in steps),
    }
    if any("spec_accepted" in r for r in steps):
        accepted = sum(r.get("spec_accepted", 0.0) for r in steps)
        drafts = sum(r.get("spec_drafts", 0.0) for r in steps)
        out["tokens_per_verify"] = 1 + accepted / drafts if drafts else 1.0
        out["accepted_token_frac"] = accepted / sum(len(x["tokens"]) for x in s)
    return out


async def main_async(args: Any) -> dict[str, Any]:
    from rpk.assembly.inputs import load_prompts, run_model
    from rpk.assembly.settings import parts_settings
    from rpk.config import from_argv

    cfg = from_argv(["--model.cache_dir", str(args.cache_dir), "--rollout.max_tokens", str(args.max_tokens)])
    made = parts_settings(cfg)
    model_dir = await run_model(cfg.model, made.prompts.task, print)
    prompts = await asyncio.to_thread(load_prompts, made.prompts, model_dir)
    kw = dict(p=args.p, r=args.r, steps=args.steps, max_tokens=args.max_tokens, k=args.k)
    off = await run_arm(model_dir, prompts, Speculative.OFF, args.seed, **kw)
    arms = [off]
    for name in args.speculative:
        arms.append(await run_arm(model_dir, prompts, Speculative(name), args.seed + 1000, **kw))
    rng = random.Random(0)
    result: dict[str, Any] = {"args": args_json(args), "arms": [summary(a) for a in arms], "tests": {}, "mismatch": {}}
    for arm in arms:
        picked = rng.sample(arm["samples"], min(args.recompute, len(arm["samples"])))
        result["mismatch"][arm["speculative"]] = _mismatch(await asyncio.to_thread(recompute, model_dir, picked))
    for arm in arms[1:]:
        result["tests"][arm["speculative"]] = compare(off, arm)
    return result


def print_table(result: dict[str, Any]) -> None:
    print(f"{'arm':<10} {'samples':>8} {'len':>7} {'reward':>7} {'tok/verify':>10} {'drafted':>8} "
          f"{'|dlogp| mean':>13} {'p99':>9} {'max':>9}")
    for a in result["arms"]:
        m = result["mismatch"][a["speculative"]]
        print(f"{a['speculative']:<10} {a['samples']:>8} {a['length_mean']:>7.1f} {a['reward_mean']:>7.3f} "
              f"{a.get('tokens_per_verify', 1.0):>10.2f} {a.get('accepted_token_frac', 0.0):>8.1%} "
              f"{m['mean_abs']:>13.2e} {m['p99_abs']:>9.2e} {m['max_abs']:>9.2e}")
    for name, tests in result["tests"].items():
        print(f"off vs {name}: " + ", ".join(f"{t} p={v['p_value']:.3f} (dof {v['dof']})" if v["dof"]
                                              else f"{t} p={v['p_value']:.3f}" for t, v in tests.items()))


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--p", type=int, default=P, help="prompts a step")
    ap.add_argument("--r", type=int, default=R, help="responses a prompt")
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--max-tokens", type=int, default=320)
    ap.add_argument("--k", type=int, default=4, help="drafted tokens, at every batch size")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--recompute", type=int, default=256, help="responses per arm whose log-probs are recomputed")
    ap.add_argument("--speculative", nargs="+", default=["all"],
                    choices=[s.value for s in Speculative if s.value != "off"])
    ap.add_argument("--cache-dir", type=Path, default=Path(".cache/rpk"))
    args = ap.parse_args(argv)
    result = asyncio.run(main_async(args))
    print_table(result)
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
