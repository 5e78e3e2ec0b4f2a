"""Validation: the driver against a scripted engine with known answers, the pure
aggregation by hand, and the schedule between steps in the controller."""

from __future__ import annotations

import asyncio
import io
import json
import math

import pytest
from rich.console import Console

from rpk import assembly, controller
from rpk.assembly.settings import run_settings
from rpk.config import ConfigError, from_argv
from rpk.core.outcomes import EvalRun, PromptEval, RoundPlan
from rpk.core.records import FinishReason, GenDelta, Prompt, Response, RoundKind, Scored
from rpk.loop.evaluate import GREEDY, EvalSpec, eval_requests, evaluate
from rpk.loop.feed import Streaming
from rpk.loop.rollout import EngineError
from rpk.loop.trainer import AsyncTrainer
from rpk.obs import plot, recorder
from rpk.obs.metrics import read_records
from rpk.obs.progress import LiveProgress
from rpk.obs.validation import sample_rows, summarize_val, val_record
from rpk.reward import FunctionScorer
from rpk.sched.policy import Sampling, SyncPolicy
from rpk.sched.round import RoundBook
from rpk.sim.trainer import NullTrainer
from rpk.tasks import arith
from tests.fakes import LengthScorer, ScriptedEngine, build_settings

# Per prompt: is the greedy answer right, and which of the 3 sampled answers are.
SCRIPT = {0: (True, (True, True, True)), 1: (False, (False, True, False)),
          2: (True, (False, False, False)), 3: (False, (False, False, False))}


def arith_prompts(n: int) -> list[Prompt]:
    return [Prompt(f"v{i}", (7, i), arith.DATA_SOURCE, str(100 + i), text=f"what is {100 + i}?")
            for i in range(n)]


def answers(request) -> str:
    """The scripted model: prompt i's answer is 100 + i when SCRIPT says it is right."""
    pos = request.prompt_token_ids[1]
    suffix = request.request_id.rsplit("-", 1)[1]
    greedy, sampled = SCRIPT[pos]
    right = greedy if suffix == "greedy" else sampled[int(suffix[1:])]
    return f"A+a=..\nAnswer: {100 + pos if right else 999}"


def arith_scorer() -> FunctionScorer:
    return FunctionScorer({arith.DATA_SOURCE: arith.compute_score, "other": arith.compute_score},
                          timeout_s=5, max_concurrency=4)


async def test_accuracy_of_a_scripted_engine_with_known_answers():
    engine = ScriptedEngine(lambda r: 0, text_of=answers, max_concurrency=3)
    run = await evaluate(arith_prompts(4), engine, arith_scorer(), EvalSpec(k=3, max_tokens=64),
                         step=20, version=20)
    rec = val_record(run)
    assert rec["step"] == 20 and rec["phase"] == "eval" and rec["version"] == 20
    assert rec["val/prompts"] == 4
    assert rec["val/acc_greedy"] == 0.5
    assert rec["val/acc_greedy_se"] == pytest.approx(math.sqrt(1 / 3) / 2)  # stdev(1,0,1,0)/sqrt 4
    assert rec["val/mean@3"] == pytest.approx((1 + 1 / 3 + 0 + 0) / 4)
    assert rec["val/pass@3"] == 0.5
    assert rec["val/len_greedy"] == len("A+a=..\nAnswer: 100")
    assert rec["val/truncated_frac"] == 0.0 and rec["val/score_errors"] == 0.0
    assert rec["val/per_prompt/greedy"] == [1, 0, 1, 0]
    assert rec["val/per_prompt/sampled"] == [3, 1, 0, 0]
    assert not any(k.startswith("val/rpk/") for k in rec)  # one data source: no breakdown
    # 4 greedy + 12 sampled responses in one batch (the engine queues past its
    # concurrency), none left running
    assert len(engine.seen) == 16 and engine.running == set()


async def test_greedy_is_temperature_zero_and_sampled_seeds_repeat_across_passes():
    spec = EvalSpec(k=2, max_tokens=32, temperature=0.9, top_p=0.8, seed=3)
    first = eval_requests(arith_prompts(3), spec, step=0)
    later = eval_requests(arith_prompts(3), spec, step=20)
    greedy = [r for _, j, r in first if j == GREEDY]
    sampled = [r for _, j, r in first if j != GREEDY]
    assert len(greedy) == 3 and len(sampled) == 6
    assert all(r.temperature == 0.0 for r in greedy)
    assert all(r.temperature == 0.9 and r.top_p == 0.8 for r in sampled)
    assert len({r.seed for r in sampled}) == 6
    assert [r.seed for _, _, r in first] == [r.seed for _, _, r in later]
    assert len({r.request_id for _, _, r in first + later}) == 18


def test_validation_ids_never_meet_rollout_ids():
    prompts = arith_prompts(4)
    plan = RoundPlan(step=0, kind=RoundKind.SHORT, prompts=tuple(prompts), responses_per_prompt=5,
                     group_size=4, groups_needed=3, max_tokens=32)
    rollout = set(RoundBook(plan, lambda r: list(r)).requests)
    val = {r.request_id for _, _, r in eval_requests(prompts, EvalSpec(k=5, max_tokens=32), 0)}
    assert rollout and val and not rollout & val


async def test_per_source_breakdown_and_score_errors():
    prompts = arith_prompts(2) + [Prompt(f"o{i}", (7, i), "other", str(100 + i)) for i in (2, 3)]

    async def bad_fn(*args):
        raise RuntimeError("no")

    scorer = FunctionScorer({arith.DATA_SOURCE: arith.compute_score, "other": bad_fn}, 5, 4)
    run = await evaluate(prompts, ScriptedEngine(lambda r: 0, text_of=answers), scorer,
                         EvalSpec(k=3, max_tokens=64), step=0, version=0)
    rec = val_record(run)
    assert rec["val/rpk/arith/acc_greedy"] == 0.5 and rec["val/rpk/arith/mean@3"] == pytest.approx(2 / 3)
    # every response of `other` fails to score: counted, and wrong
    assert rec["val/other/acc_greedy"] == 0.0 and rec["val/other/score_errors"] == 8.0
    assert rec["val/acc_greedy"] == 0.25 and rec["val/score_errors"] == 8.0


async def test_truncated_responses_count_and_the_engine_failing_stops_the_pass():
    engine = ScriptedEngine(lambda r: 0, text_of=answers)
    run = await evaluate(arith_prompts(4), engine, arith_scorer(), EvalSpec(k=1, max_tokens=8),
                         step=0, version=0)
    rec = val_record(run)
    assert rec["val/truncated_frac"] == 1.0 and rec["val/acc_greedy"] == 0.0

    failing = ScriptedEngine(lambda r: 40, fail_on=lambda r: r.request_id.endswith("p2-greedy"))
    with pytest.raises(ExceptionGroup) as info:
        await evaluate(arith_prompts(4), failing, arith_scorer(), EvalSpec(k=2, max_tokens=64),
                       step=0, version=0)
    assert info.group_contains(RuntimeError, match="engine failed on val0-p2-greedy")
    assert failing.running == set()
    assert failing.aborted  # the siblings cut short were aborted in the engine


async def test_a_stream_that_ends_unfinished_is_an_engine_error():
    class Unfinished(ScriptedEngine):
        async def generate(self, request):
            await asyncio.sleep(0)
            yield GenDelta(request.request_id, (1,), (-0.1,), text="x", finished=True,
                           finish_reason=FinishReason.ABORT)

    with pytest.raises(ExceptionGroup) as info:
        await evaluate(arith_prompts(1), Unfinished(lambda r: 1), arith_scorer(),
                       EvalSpec(k=0, max_tokens=8), step=0, version=0)
    assert info.group_contains(EngineError)


def scored(prompt: Prompt, correct: bool, tokens: int = 5) -> Scored:
    response = Response(prompt, 0, tuple(range(tokens)), (0.0,) * tokens, FinishReason.STOP, 0,
                        text="t" * tokens)
    return Scored(response, float(correct), correct)


def test_greedy_only_record_and_the_summary_of_a_run():
    p = arith_prompts(2)

    def run_at(step: int, greedy: tuple[bool, bool]) -> EvalRun:
        results = tuple(PromptEval(q, scored(q, g), ()) for q, g in zip(p, greedy))
        return EvalRun(step, step, 0, results, 10.0, 12.5)

    recs = [val_record(run_at(0, (False, False))), val_record(run_at(20, (True, False))),
            val_record(run_at(40, (True, True)))]
    assert recs[0]["time_eval_s"] == 2.5
    assert not any("@" in k for k in recs[0])
    summary = summarize_val(recs)
    assert summary["val_acc_greedy_start"] == 0.0 and summary["val_acc_greedy_end"] == 1.0
    assert summary["val_step_start"] == 0 and summary["val_step_end"] == 40
    assert summary["time_eval_s_total"] == 7.5 and summary["val_prompts"] == 2
    assert summarize_val([]) == {}
    rows = sample_rows(run_at(0, (True, False)), n=1)
    assert rows == [{"data_source": arith.DATA_SOURCE, "prompt": "what is 100?",
                     "response": "ttttt", "ground_truth": "100", "correct": True, "tokens": 5}]


def test_validation_by_digit_band_when_the_prompts_say_their_digits():
    def prompt(i: int, digits: int) -> Prompt:
        return Prompt(f"v{i}", (7, i), arith.DATA_SOURCE, "1", extra_info={"digits": digits})

    # 1 digit: right, right; 2-3 digits: wrong; 11-20: right greedy, half the samples
    cases = [(prompt(0, 1), True, (True, True)), (prompt(1, 1), True, (True, False)),
             (prompt(2, 3), False, (False, False)), (prompt(3, 17), True, (True, False))]
    results = tuple(PromptEval(p, scored(p, g), tuple(scored(p, s) for s in ss))
                    for p, g, ss in cases)
    rec = val_record(EvalRun(0, 0, 2, results, 0.0, 1.0))
    assert rec["val/digits_1-1/prompts"] == 2 and rec["val/digits_1-1/acc_greedy"] == 1.0
    assert rec["val/digits_1-1/mean@2"] == 0.75
    assert rec["val/digits_2-3/acc_greedy"] == 0.0 and rec["val/digits_2-3/mean@2"] == 0.0
    assert rec["val/digits_11-20/acc_greedy"] == 1.0 and rec["val/digits_11-20/mean@2"] == 0.5
    assert not any(k.startswith(("val/digits_4-6/", "val/digits_7-10/")) for k in rec)
    # prompts without a digit count (a file's rows) get no bands
    assert not any("digits" in k for k in val_record(EvalRun(
        0, 0, 0, (PromptEval(arith_prompts(1)[0], scored(arith_prompts(1)[0], True), ()),),
        0.0, 1.0)))


def test_summary_with_sampled_metrics_keeps_mean_at_k():
    p = arith_prompts(1)[0]
    run = EvalRun(0, 0, 2, (PromptEval(p, scored(p, True), (scored(p, True), scored(p, False))),),
                  0.0, 1.0)
    summary = summarize_val([val_record(run)])
    assert summary["val_mean@2_start"] == 0.5 == summary["val_mean@2_end"]


class FakeTracker:
    name = "fake"

    def __init__(self) -> None:
        self.scalars: list[tuple[int, dict]] = []
        self.texts: list[tuple[int, str, list]] = []
        self.config: dict | None = None
        self.closed = False

    def log_scalars(self, step, scalars):
        self.scalars.append((step, dict(scalars)))

    def log_config(self, config):
        self.config = dict(config)

    def log_texts(self, step, rows, tag):
        self.texts.append((step, tag, list(rows)))

    def close(self):
        self.closed = True


async def test_the_run_validates_before_training_every_n_steps_and_at_the_end(
    tmp_path, monkeypatch
):
    cfg = from_argv(["--run.steps", "5", "--run.eval_every", "2", "--run.eval_k", "2",
                     "--run.samples_per_step", "0",
                     "--rollout.policy", "sync", "--rollout.prompts_per_step", "2",
                     "--rollout.responses_per_prompt", "2", "--rollout.max_tokens", "64",
                     "--run.checkpoint_every", "0"])
    train = [Prompt(f"t{i}", (9, i), "test", str(i)) for i in range(8)]
    sampling = Sampling(prompts_per_step=2, responses_per_prompt=2, max_tokens=64)

    def length_or_answer(request):
        return answers(request) if request.request_id.startswith("val") else "x" * 6

    engine = ScriptedEngine(lambda r: 0, text_of=length_or_answer)
    scorer = arith_scorer()
    trainer = AsyncTrainer(NullTrainer())

    class BothScorer:  # training prompts by length, validation ones by their answer
        failure_kinds = ()
        judge = router = None  # as a RewardStack with nothing judged

        async def score(self, response):
            if response.prompt.data_source == "test":
                return await LengthScorer().score(response)
            return await scorer.score(response)

        async def aclose(self):
            return None

        def metrics(self):
            return {}

    parts = assembly.Components(tmp_path, train, SyncPolicy(train, sampling), BothScorer(), engine,
                             trainer, Streaming(), arith_prompts(4), **build_settings(cfg))
    out = io.StringIO()
    progress = LiveProgress(5, console=Console(file=out, width=200), live=False)
    tracker = FakeTracker()
    monkeypatch.setattr(recorder, "open_trackers", lambda *args: [tracker])
    try:
        await controller._steps(run_settings(cfg), tmp_path, parts, progress, controller.RunStatus(), None)
    finally:
        await trainer.aclose()
    evals = read_records(tmp_path / "metrics.jsonl", "eval")
    steps = read_records(tmp_path / "metrics.jsonl")
    assert [e["step"] for e in evals] == [0, 2, 4, 5]
    assert [e["version"] for e in evals] == [0, 2, 4, 5]  # the weights synced after the step
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5]
    # SCRIPT's first two samples: mean@2 = (1 + 1/2 + 0 + 0) / 4, pass@2 = 2 / 4
    assert all(e["val/acc_greedy"] == 0.5 and e["val/mean@2"] == 0.375 for e in evals)
    assert all(e["val/pass@2"] == 0.5 for e in evals)
    assert not any(k.startswith("val/") or k == "time_eval_s" for s in steps for k in s)
    # validation requests are its own: no step record counts them
    assert sum(s["requests_launched"] for s in steps) == 5 * 4
    # the trackers got every scalar, the config and the validation texts
    logged = {(step, k) for step, scalars in tracker.scalars for k in scalars}
    assert (0, "val/acc_greedy") in logged and (5, "val/pass@2") in logged
    assert (3, "reward_mean") in logged and (3, "time_step_s") in logged
    assert tracker.config["run"]["eval_every"] == 2
    assert [(s, tag) for s, tag, _ in tracker.texts] == [(0, "val_samples"), (2, "val_samples"),
                                                         (4, "val_samples"), (5, "val_samples")]
    assert tracker.closed
    text = out.getvalue()
    assert "val  after step    0  greedy 0.500 ± 0.289  mean@2 0.375  pass@2 0.500  len 18" in text
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["phase"] == "eval"


def test_the_held_out_split_never_repeats_a_training_prompt():
    train = arith.make_rows(4096, seed=10_000)
    held_out = arith.held_out_rows(512, seed=20_000, exclude=train)
    questions = [r["prompt"][0]["content"] for r in held_out]
    assert len(questions) == len(set(questions)) == 512
    assert not set(questions) & {r["prompt"][0]["content"] for r in train}
    assert held_out == arith.held_out_rows(512, seed=20_000, exclude=train)
    # all 55 one-digit problems are training prompts, so the held-out split has none
    assert min(r["extra_info"]["digits"] for r in held_out) == 2
    assert [r["extra_info"]["index"] for r in held_out] == list(range(512))


def test_a_task_too_small_to_hold_out_prompts_is_a_config_error(tmp_path):
    cfg = from_argv(["--model.tiny.task.max_digits", "1", "--data.builtin_size", "500"])
    with pytest.raises(ConfigError, match=r"data.val_size=512: only 0 problems outside"):
        assembly.load_val_prompts(assembly.prompt_source(cfg), tmp_path)
    assert assembly.load_val_prompts(assembly.prompt_source(from_argv(["--data.val_size", "0"])), tmp_path) == []
    files = assembly.prompt_source(from_argv(["--data.train_files", "t.jsonl"]))
    assert assembly.load_val_prompts(files, tmp_path) == []


def test_val_plot_and_the_step_plots_ignore_each_other(tmp_path):
    lines = [{"step": 0, "phase": "eval", "val/prompts": 4, "val/acc_greedy": 0.2,
              "val/acc_greedy_se": 0.05, "val/mean@4": 0.25, "val/mean@4_se": 0.04,
              "val/pass@4": 0.5, "time_eval_s": 1.0}]
    for step in (1, 2, 3, 4):
        lines.append({"step": step, "round_kind": "sync", "reward_mean": 0.3, "accuracy": 0.3,
                      "time_rollout_s": 2.0, "time_train_s": 1.0, "time_sync_s": 0.1,
                      "time_step_s": 3.2, "bubble_ratio": 0.3})
        if step % 2 == 0:
            lines.append({**lines[0], "step": step, "val/acc_greedy": 0.2 + 0.05 * step})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    data = plot.load_run(tmp_path, note=lambda m: None)
    assert [r["step"] for r in data.records] == [1, 2, 3, 4]
    assert [e["step"] for e in data.evals] == [0, 2, 4]
    written = {p.name for p in plot.write_plots(tmp_path, note=lambda m: None)}
    assert {"val.png", "reward.png", "step_time.png"} <= written
    assert (tmp_path / "plots" / "val.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
