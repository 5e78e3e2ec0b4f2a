"""The draft-length planner: speculate in the tail, not at full batch."""

from __future__ import annotations

import pytest

from rpk.sched.speculate import Acceptance, StepCost, acceptance_from_counts, best_k, plan_drafts

# rpk's CPU cost curve (bench/sim_policies.py): 4.7 ms a step + 0.133 ms a sequence.
CPU = StepCost(fixed_s=4.7e-3, per_token_s=0.133e-3)


def test_tokens_per_verify_is_the_geometric_sum() -> None:
    a = Acceptance.flat(0.6)
    assert a.tokens_per_verify(0) == 1.0
    assert a.tokens_per_verify(4) == pytest.approx((1 - 0.6**5) / (1 - 0.6))
    assert Acceptance((1.0, 0.5, 0.0)).tokens_per_verify(5) == pytest.approx(1 + 1 + 0.5)


def test_break_even_matches_the_cost_arithmetic() -> None:
    # At n = 4, k = 4 a verify costs 7.36 ms against 5.23 ms: it pays past 1.41 tokens.
    n, k = 4, 4
    ratio = CPU.seconds(n, k) / CPU.seconds(n, 0)
    assert ratio == pytest.approx(1.407, abs=0.002)
    assert best_k(CPU, Acceptance.flat(0.05), n, k, min_gain=1.0) == 0
    assert best_k(CPU, Acceptance.flat(0.6), n, k, min_gain=1.0) > 0


def test_the_plan_speculates_in_the_tail_and_not_at_full_batch() -> None:
    plan = plan_drafts(CPU, Acceptance.flat(0.6), max_batch=256, max_k=8)
    assert plan.bands[0][0] == 1 and plan.bands[-1][1] == 256
    assert plan.k_for(1) >= 3
    assert plan.k_for(256) == 0
    ks = [plan.k_for(n) for n in range(1, 257)]
    assert ks == sorted(ks, reverse=True), "draft length never grows with the batch"
    # contiguous, non-overlapping: vLLM's validator takes it
    from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule
    assert validate_and_normalize_dynamic_sd_schedule(plan.schedule()) == plan.schedule()


def test_no_acceptance_plans_no_speculation() -> None:
    plan = plan_drafts(CPU, Acceptance.flat(0.0), max_batch=64, max_k=8)
    assert not plan.speculates and plan.bands == ((1, 64, 0),)


def test_acceptance_from_counts_pulls_sparse_positions_to_the_prior() -> None:
    a = acceptance_from_counts([1000, 10], [800, 0], prior=0.5, prior_weight=4)
    assert a.at(1) == pytest.approx(802 / 1004)
    assert a.at(2) == pytest.approx(2 / 14)
    with pytest.raises(ValueError, match="accepted"):
        acceptance_from_counts([3], [4])


@pytest.mark.parametrize("bad", [dict(fixed_s=-1, per_token_s=0.1), dict(fixed_s=0, per_token_s=0)])
def test_bad_costs_are_refused_with_their_values(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        StepCost(**bad)


def test_a_verify_overhead_drafts_at_fewer_batch_sizes_or_none() -> None:
    # The CPU engine's verifying step costs a fixed extra beyond its tokens
    # (bench/spec_step_cost.py): 2.4 tokens per verify that pay on tokens alone lose.
    a = Acceptance.flat(0.6)  # tau(8) ~ 2.47
    assert best_k(CPU, a, 1, 8) > 0
    heavy = StepCost(fixed_s=CPU.fixed_s, per_token_s=CPU.per_token_s, verify_s=3 * CPU.fixed_s)
    assert heavy.seconds(4, 0) == CPU.seconds(4, 0)  # plain steps pay no verify
    assert heavy.seconds(4, 2) == pytest.approx(CPU.seconds(4, 2) + 3 * CPU.fixed_s)
    assert best_k(heavy, a, 1, 8) == 0
    assert not plan_drafts(heavy, a, max_batch=64, max_k=8).speculates
    light = StepCost(fixed_s=CPU.fixed_s, per_token_s=CPU.per_token_s, verify_s=0.5 * CPU.fixed_s)
    def last_drafting(plan):  # the largest batch size that drafts
        return max(hi for _, hi, k in plan.bands if k)

    some = plan_drafts(light, a, 64, 8)
    assert some.k_for(1) > 0 and last_drafting(some) < last_drafting(plan_drafts(CPU, a, 64, 8))
