"""The length predictor, the cost curve and the eta chooser on their own: pure classes
over explicit state, no engine."""

from __future__ import annotations

import json
import math
import random
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rpk.core.outcomes import PromptLengths, RoundPlan
from rpk.core.records import Prompt, RoundKind
from rpk.loop.rollout import run_round
from rpk.sched.predictor import LengthGuess, LengthPredictor, spearman
from rpk.sched.provision import CostCurve, EtaBounds, EtaChooser
from rpk.sim import CostModel, SimEngine
from tests.fakes import LengthScorer, mean_centred


def prompt(i: int, tokens: int, source: str = "s", **extra) -> Prompt:
    return Prompt(f"p{i}", (7, i) + (0,) * (tokens - 2), source, extra.pop("truth", ""), **extra)


def observed(p: Prompt, lengths, trained: bool = True, cut=()) -> PromptLengths:
    return PromptLengths(p, tuple(lengths), tuple(cut), trained)


def test_it_learns_lengths_from_prompt_token_counts():
    # length ~ 6 x prompt tokens, with per-response noise: nothing else to go on
    rng = random.Random(0)
    pred = LengthPredictor(max_tokens=2048)
    errors, corrs = [], []
    for rnd in range(12):
        batch = [prompt(rnd * 100 + k, rng.randint(4, 60)) for k in range(32)]
        truth = {p.uid: 6 * len(p.token_ids) for p in batch}
        pred.observe([
            observed(p, [max(1, round(truth[p.uid] * math.exp(rng.gauss(0, 0.2)))) for _ in range(8)])
            for p in batch
        ])
        cal = pred.calibration()
        errors.append(cal["pred_mae_tokens"])
        corrs.append(spearman([(pred.predict(p).mu, math.log(truth[p.uid])) for p in batch]))
    assert errors[-1] < errors[0] / 3  # the first round had only the prior to go on
    assert min(corrs[2:]) > 0.9
    assert pred.calibration()["pred_rank_corr"] > 0.9
    assert pred.calibration()["pred_spread"] == pytest.approx(0.2, abs=0.05)


def test_it_remembers_prompts_across_epochs_and_trusts_history_as_far_as_it_held():
    # same token count, different lengths: only identity tells them apart
    prompts = [prompt(i, 10) for i in range(40)]
    truth = {p.uid: 20 * (1 + i % 5) for i, p in enumerate(prompts)}
    pred = LengthPredictor(max_tokens=1024)
    for _ in range(3):  # three epochs of the same prompts
        pred.observe([observed(p, [truth[p.uid]] * 8) for p in prompts])
    for p in prompts:
        g = pred.predict(p)
        assert math.exp(g.mu) == pytest.approx(truth[p.uid], rel=0.1)
        assert g.seen == 3 and g.sigma < 0.3
    cal = pred.calibration()
    assert cal["pred_rank_corr_round"] > 0.95
    # the window still holds the first epoch, when identity was all there was to learn
    assert cal["pred_rank_corr"] < cal["pred_rank_corr_round"]


def test_a_prompt_given_up_mid_round_is_guessed_longer_next_time():
    pred = LengthPredictor(max_tokens=1024)
    ps = [prompt(i, 10) for i in range(20)]
    pred.observe([observed(p, [30] * 8) for p in ps])
    long = prompt(99, 10)
    before = pred.predict(long)
    # two siblings finished at 80 and 90 tokens, the rest were cut at 120
    pred.observe([observed(long, [80, 90], trained=False, cut=[120] * 6)])
    after = pred.predict(long)
    assert math.exp(before.mu) < 40 < 100 < math.exp(after.mu)
    assert pred.calibration()["pred_prompts"] == 0  # nothing trained: nothing to score


def test_it_reads_nothing_of_a_prompt_but_identity_token_count_and_source():
    pred = LengthPredictor(max_tokens=512)
    pred.observe([observed(prompt(i, 5 + i % 7), [10 + i] * 4) for i in range(30)])
    a = prompt(3, 8, truth="123", text="what is 1+2?", extra_info={"digits": 20})
    b = prompt(3, 8, truth="x", text="something else", extra_info={})
    assert pred.predict(a) == pred.predict(b)
    assert pred.predict(prompt(3, 8, source="other")) != pred.predict(a)


def test_predictor_state_round_trips_through_a_checkpoint():
    rng = random.Random(1)
    pred = LengthPredictor(max_tokens=1024)
    ps = [prompt(i, rng.randint(3, 40), source=f"s{i % 2}") for i in range(64)]
    pred.observe([observed(p, [rng.randint(5, 200) for _ in range(4)]) for p in ps[:48]])
    pred.observe([observed(p, [50], trained=False, cut=[70, 80]) for p in ps[48:]])
    state = json.loads(json.dumps(pred.state_dict()))
    again = LengthPredictor(max_tokens=1024)
    again.load_state_dict(state)
    assert [again.predict(p) for p in ps] == [pred.predict(p) for p in ps]
    assert again.calibration() == pred.calibration()


def test_spearman_by_hand():
    assert spearman([(1, 10), (2, 20), (3, 30)]) == pytest.approx(1.0)
    assert spearman([(1, 3), (2, 2), (3, 1)]) == pytest.approx(-1.0)
    assert spearman([(1, 1), (2, 1), (3, 1)]) == 0.0  # no spread: undefined
    assert spearman([(1, 1), (1, 2), (2, 3), (3, 3)]) == pytest.approx(8 / 9)


@pytest.mark.parametrize("cost", [CostModel(0.0047, 1.33e-4), CostModel(0.015, 5e-5)])
@pytest.mark.parametrize("chunk", [1, 8])
async def test_cost_curve_recovers_the_simulators_cost_model_from_round_timelines(cost, chunk):
    prompts = tuple(Prompt(f"p{i}", (7, i), "t", "") for i in range(40))
    plan = RoundPlan(step=1, kind=RoundKind.SYNC, prompts=prompts, responses_per_prompt=8,
                     group_size=8, groups_needed=40, max_tokens=1024)
    engine = SimEngine(lambda r: 10 + zlib.crc32(r.request_id.encode()) % 300, cost=cost,
                       max_concurrency=512, chunk=chunk)
    try:
        result = await run_round(plan, engine, LengthScorer(), mean_centred, version=0, clock=engine.clock)
    finally:
        await engine.shutdown()
    curve = CostCurve()
    assert curve.fit() is None
    curve.observe(result.finishes, result.timeline, engine.max_concurrency, result.launched)
    base, per_seq = curve.fit()
    assert base == pytest.approx(cost.base_s, rel=0.2)
    assert per_seq == pytest.approx(cost.per_seq_s, rel=0.2)
    again = CostCurve()
    again.load_state_dict(json.loads(json.dumps(curve.state_dict())))
    assert again.fit() == curve.fit()


def guesses(n: int, sigma: float, seed: int = 0) -> list[LengthGuess]:
    rng = random.Random(seed)
    return sorted((LengthGuess(math.log(40) + rng.gauss(0, 0.3), sigma, 0.3, 1) for _ in range(n)),
                  key=lambda g: g.key)


def test_without_a_cost_curve_the_chooser_speculates_as_little_as_its_bounds_allow():
    prov = EtaChooser(EtaBounds((1.0, 1.5), (1.0, 1.5))).choose(
        guesses(48, 1.0), p0=32, r0=8, max_tokens=512, cost=None, concurrency=512, seed=0)
    assert (prov.prompts, set(prov.launch), prov.defer_after) == (32, {8}, 0)
    prov = EtaChooser(EtaBounds((1.25, 1.5), (1.25, 1.5))).choose(
        guesses(48, 1.0), p0=32, r0=8, max_tokens=512, cost=None, concurrency=512, seed=0)
    assert (prov.prompts, set(prov.launch)) == (40, {10})
    assert "cost curve" in prov.reason


def test_a_flat_cost_buys_speculation_where_guesses_are_unsure_and_a_throughput_bound_one_does_not():
    chooser = EtaChooser(EtaBounds((1.0, 1.5), (1.0, 1.5)))
    kw = dict(p0=32, r0=8, max_tokens=1024, concurrency=512, seed=3)
    gpu = chooser.choose(guesses(48, 0.8), cost=(0.015, 0.0), **kw)
    assert gpu.eta_prompts > 1 and gpu.eta_responses > 1 and gpu.expected_s < gpu.baseline_s
    assert max(gpu.launch) > 8
    sure = chooser.choose(guesses(48, 0.05), cost=(0.015, 0.0), **kw)
    assert set(sure.launch) == {8} and sure.eta_responses == 1.0  # sure guesses: no extra responses
    cpu = chooser.choose(guesses(48, 0.05), cost=(0.0, 1.3e-4), **kw)
    assert (cpu.prompts, set(cpu.launch), cpu.defer_after) == (32, {8}, 0)
    assert cpu.reason.startswith("least speculation")
    # the same inputs make the same choice (seeded), so a resumed run plans the same rounds
    assert chooser.choose(guesses(48, 0.8), cost=(0.015, 0.0), **kw) == gpu


@settings(max_examples=40, deadline=None)
@given(
    st.tuples(st.floats(1.0, 2.0), st.floats(0.0, 1.0)),
    st.tuples(st.floats(1.0, 2.0), st.floats(0.0, 1.0)),
    st.floats(0.0, 0.05), st.floats(0.0, 1e-3), st.floats(0.01, 1.5),
    st.integers(20, 64), st.integers(2, 8),
)
def test_the_chosen_eta_stays_within_its_bounds(ep, er, base_s, per_seq_s, sigma, n, r0):
    bounds = EtaBounds((ep[0], ep[0] + ep[1]), (er[0], er[0] + er[1]))
    p0 = 16
    prov = EtaChooser(bounds, samples=4).choose(
        guesses(n, sigma, seed=n), p0=p0, r0=r0, max_tokens=400,
        cost=(base_s, per_seq_s) if base_s + per_seq_s > 0 else None, concurrency=256, seed=1)
    lo_n = min(n, math.ceil(ep[0] * p0 - 1e-9))
    hi_n = min(n, math.ceil((ep[0] + ep[1]) * p0 - 1e-9))
    assert p0 <= prov.prompts and lo_n <= prov.prompts <= hi_n
    assert len(prov.launch) == prov.prompts
    assert all(math.ceil(er[0] * r0 - 1e-9) <= k <= math.ceil((er[0] + er[1]) * r0 - 1e-9)
               for k in prov.launch)
    assert 0 <= prov.defer_after < 400
    assert prov.expected_s <= prov.baseline_s or prov.expected_s == 0.0
