"""A judge colocated on the rollout GPUs in the memory plan (rpk.gpu.plan.judge): its
rows in every phase, the number of layers it streams from host, the one-line refusal,
and the dry run's engine arguments for vLLM's prefetch offload."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from rpk.assembly.dry_run import dry_run
from rpk.gpu.plan import Knobs, ModelShape, Phase, PlanRefused, Target, judge, plan_memory
from rpk.gpu.plan.pricing import PROCESS_BYTES, JudgeKnobs

MODELS = Path(__file__).parent / "fixtures" / "models"
GB80 = Target(nodes=1, gpus_per_node=8, gpu_bytes=80 * 10**9, host_bytes=2 * 10**12)


def shape(name: str) -> ModelShape:
    return ModelShape.from_hf(json.loads((MODELS / f"qwen2.5-{name}" / "config.json").read_text()))


def judged(name: str = "7b", seqs: int = 4, length: int = 8769) -> Knobs:
    return Knobs(max_model_len=17408, judge=JudgeKnobs(shape(name), length, seqs))


def test_offloaded_layers_are_the_last_of_each_group_as_vllm_counts_them() -> None:
    # vLLM's example: group 8, 2 in a group offloads layers 6, 7, 14, 15, 22, 23, ...
    assert judge.JudgeLayout(8, 2).offloaded(28) == len([6, 7, 14, 15, 22, 23, 30][:6])
    assert judge.JudgeLayout(2, 1).offloaded(28) == 14
    assert judge.JudgeLayout(0, 1).offloaded(28) == 0
    options = judge.layouts(28)
    counts = [o.offloaded(28) for o in options]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 28
    assert judge.JudgeLayout(4, 3).engine_args() == {
        "offload_backend": "prefetch", "offload_group_size": 4, "offload_num_in_group": 3,
        "offload_prefetch_step": 1}


def test_the_judge_has_rows_in_every_phase_awake_beside_rollout_asleep_otherwise() -> None:
    plan = plan_memory(shape("14b"), GB80, judged())
    assert plan.judge is not None
    j = plan.knobs.judge
    assert j is not None
    for p in plan.phases:
        names = {r.name for r in p.residents if r.owner == "judge"}
        assert "context" in names
        if p.phase is Phase.ROLLOUT:
            assert {"weights", "prefetch_buffers", "reserve", "kv_cache"} <= names
            assert p.bytes_of("judge", "kv_cache") == 4 * 8769 * shape("7b").kv_bytes_per_token()
            assert p.bytes_of("judge", "weights") == judge.resident_bytes(j, plan.judge)
        else:
            assert names == {"context"}
    train = next(p for p in plan.phases if p.phase is Phase.TRAIN)
    assert "judge.weights (sleep level 1: to host)" in train.moved_out
    host = {r.name: r.bytes for r in plan.host[0].residents if r.owner == "judge"}
    layer = shape("7b").layer_params * 2
    assert host["offloaded_layers"] == 8 * plan.judge.offloaded(28) * layer  # pinned, every GPU's judge


def test_the_plan_streams_the_fewest_layers_that_keep_the_rollouts_kv_cache() -> None:
    s = shape("14b")
    plan = plan_memory(s, GB80, judged())
    assert plan.judge is not None
    n = plan.judge.offloaded(28)
    assert 14 <= n < 28  # the paper: at least half at maximum length, not all
    alone = plan_memory(s, GB80, Knobs(max_model_len=17408))
    assert plan.kv_cache_bytes < alone.kv_cache_bytes
    # The rollout's KV beside a judge streaming every layer, and what each layout costs it.
    j = plan.knobs.judge
    assert j is not None

    def extra(layout: judge.JudgeLayout) -> int:
        return judge.resident_bytes(j, layout) - judge.resident_bytes(j, judge.streamed_all(28))

    streamed = plan.kv_cache_bytes + extra(plan.judge)  # within vLLM's 80 MB utilisation step
    assert plan.kv_cache_bytes >= judge.ROLLOUT_KV_SHARE * streamed - 80 * 10**6
    fewer = max((o for o in judge.layouts(28) if o.offloaded(28) < n), key=lambda o: o.offloaded(28))
    assert streamed - extra(fewer) < judge.ROLLOUT_KV_SHARE * streamed
    # A small judge on a big GPU stays resident.
    roomy = plan_memory(s, replace(GB80, gpu_bytes=141 * 10**9), judged("0.5b"))
    assert roomy.judge is not None and roomy.judge.offloaded(24) == 0


def test_more_judge_kv_takes_more_layers_off_the_gpu() -> None:
    s = shape("14b")
    few = plan_memory(s, GB80, judged(seqs=2)).judge
    many = plan_memory(s, GB80, judged(seqs=16)).judge
    assert few is not None and many is not None
    assert many.offloaded(28) >= few.offloaded(28)


def test_a_judge_that_fits_nowhere_is_refused_in_one_line_naming_its_knobs() -> None:
    with pytest.raises(PlanRefused) as e:
        plan_memory(shape("14b"), GB80, judged("32b", seqs=64, length=17153))
    line = str(e.value)
    assert "\n" not in line and "beside a judge holding" in line
    assert "reward.judge.max_concurrency" in line and "smaller model" in line


def test_the_judges_gpu_share_covers_what_it_holds_awake() -> None:
    plan = plan_memory(shape("14b"), GB80, judged())
    j, layout = plan.knobs.judge, plan.judge
    assert j is not None and layout is not None
    held = sum(r.bytes for r in judge.awake(j, layout))  # its context is outside vLLM's budget
    util = judge.gpu_memory_utilization(j, layout, GB80.gpu_bytes)
    assert held <= util * GB80.gpu_bytes < held + GB80.gpu_bytes / 1000
    rollout = plan.phases[0]
    assert rollout.fits and rollout.total <= (plan.gpu_memory_utilization + util) * GB80.gpu_bytes + 4 * PROCESS_BYTES


def test_the_dry_run_prints_the_judges_rows_and_engine_arguments() -> None:
    from rpk.config import from_argv

    cfg = from_argv(["--model.path", str(MODELS / "qwen2.5-14b"), "--dist.gpus", "8", "--dist.gpu_mem_gb", "80",
                     "--rollout.max_tokens", "16384", "--reward.judge.model", str(MODELS / "qwen2.5-7b")])
    d = dry_run(cfg, MODELS / "qwen2.5-14b", cuda=(0, 0))
    j = d["plan"]["judge"]
    assert j["layers"] == 28 and 0 < j["offloaded_layers"] < 28
    args = j["engine_args"]
    assert args["offload_backend"] == "prefetch" and args["offload_num_in_group"] <= args["offload_group_size"]
    # The longest input it judges: the prompt, the response's tail it sees, the template, one verdict token.
    assert args["max_model_len"] == 256 + 8000 + judge.TEMPLATE_TOKENS + 1 and args["max_num_seqs"] == 4
    assert "judge.kv_cache" in d["plan"]["phases"][0]["residents_gb"]


def test_the_split_layout_refuses_a_judge_by_name() -> None:
    from rpk.gpu.plan import plan_split

    with pytest.raises(PlanRefused, match="reward.judge with dist.trainer_gpus=4"):
        plan_split(shape("7b"), GB80, judged(), 4)
