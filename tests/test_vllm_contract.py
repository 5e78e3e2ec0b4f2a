"""The contract: vLLM 0.32 itself validates every engine rpk would start on a GPU box.

For each cell of the matrix (Qwen2.5 7B, 14B, 32B shapes; 8k, 16k, 32k responses; fixed
and elastic TP; no judge, the tiny judge of the judged task, a 7B judge; with and without
LoRA; colocated, split (`dist.trainer_gpus`) and two nodes) the dry run lists every
engine the run would start, each layout's replicas (awake and asleep) and each judge
engine, with the exact `AsyncEngineArgs` keywords and environment. Each goes through
vLLM's own `create_engine_config` under a CUDA platform stand-in (`tests/vllm_contract.py`
says why a stand-in and what it fills in): every cell either starts by vLLM's rules or is
refused by rpk, in one line, before anything starts. One vLLM import for the module; the
cells' many identical engines are checked once.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rpk.assembly.box import judge_config
from rpk.assembly.dry_run import dry_run
from rpk.assembly.settings import run_judge_settings
from rpk.config import JudgeTinySpec, from_argv
from rpk.core.errors import UserError
from tests.vllm_contract import Contract

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

MODELS = Path(__file__).parent / "fixtures" / "models"
TARGET = ["--dist.gpus", "8", "--dist.gpu_mem_gb", "80"]

SHAPES = ("qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b")
LENGTHS = (8192, 16384, 32768)
TP = {"fixed": [], "elastic": ["--rollout.tp", "elastic"]}
JUDGES = {"none": [], "tiny": ["--data.task", "arith_judged"],
          "7b": ["--reward.judge.model", str(MODELS / "qwen2.5-7b")]}
LORA = {"full": [], "lora": ["--model.lora_rank", "8"]}
LAYOUTS = {"colocated": [], "split": ["--dist.trainer_gpus", "4"], "two_nodes": ["--dist.nodes", "2"]}


@pytest.fixture(scope="module")
def contract() -> Iterator[Contract]:
    c = Contract(gpu_bytes=80 * 10**9, gpus=8)
    try:
        yield c
    finally:
        c.close()


def _engines(d: dict[str, Any]) -> list[dict[str, Any]]:
    return [*d["replicas"], *d.get("judges", [])]


def _visible(env: dict[str, Any]) -> dict[str, Any]:
    """The engine's environment as vLLM's validation sees it: how many GPUs it is shown
    (which ids does not matter to it, and keying on the count checks each engine once)."""
    mask = env.get("CUDA_VISIBLE_DEVICES")
    return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(len(mask.split(","))))) if mask else None}


def _check_cell(contract: Contract, argv: list[str], model: str) -> dict[str, Any] | str:
    """The dry run's engines of one cell, each validated by vLLM; or rpk's refusal."""
    try:
        cfg = from_argv(["--run.dry_run", "true", "--model.path", str(MODELS / model), *TARGET, *argv])
        d = dry_run(cfg, MODELS / model, cuda=(0, 0))
    except UserError as e:
        return str(e)
    judge_hf = judge_config(cfg)
    for e in _engines(d):
        hf = judge_hf if "gpu" in e else None  # a judge's model may be built at start (the tiny one)
        verdict = contract.check(e["engine_args"], _visible(e["env"]), hf)
        assert verdict.ok, f"{model} {argv}: {e.get('name', 'judge')} refused by vLLM: {verdict.error}"
        args, config = e["engine_args"], verdict.config
        # What the plan prices is what vLLM runs with.
        assert config["max_num_batched_tokens"] == args["max_num_batched_tokens"] >= config["max_num_seqs"]
        assert config["gpu_memory_utilization"] == args["gpu_memory_utilization"]
        assert config["enable_sleep_mode"] is True and config["kv_cache_memory_bytes"] is None
        assert config["max_lora_rank"] == (args.get("max_lora_rank") if args.get("enable_lora") else None)
        if "offload_backend" in args:
            assert config["offload_backend"] == "prefetch"
    return d


def test_every_engine_of_every_cell_passes_vllms_validation_or_is_refused_in_one_line(contract: Contract) -> None:
    started, refused = 0, []
    cells = itertools.product(SHAPES, LENGTHS, TP, JUDGES, LORA, LAYOUTS)
    for model, length, tp, judge, lora, layout in cells:
        argv = ["--rollout.max_tokens", str(length), *TP[tp], *JUDGES[judge], *LORA[lora], *LAYOUTS[layout]]
        d = _check_cell(contract, argv, model)
        if isinstance(d, str):
            assert "\n" not in d, d
            refused.append((model, length, tp, judge, lora, layout))
            continue
        started += 1
        nodes = 2 if layout == "two_nodes" else 1
        if judge != "none":
            # Every judge the run starts is listed, one on each rollout GPU of every node,
            # pinned to it, and passed vLLM's validation above.
            judges = d["judges"]
            assert [(j["node"], j["gpu"]) for j in judges] == [(n, g) for n in range(nodes) for g in range(8)]
            assert all(len(j["env"]["CUDA_VISIBLE_DEVICES"].split(",")) == 1 for j in judges)
        if tp == "elastic":
            # Every layout, the asleep ones included, and the plan counts them asleep.
            assert len({r["engine_args"]["tensor_parallel_size"] for r in d["replicas"]}) >= 2
            rollout = d["plan"]["phases"][0]["residents_gb"]
            assert rollout.get("vllm.asleep_layouts", 0) > 0, rollout
    # Not a matrix of refusals: every 7B and 14B cell without LoRA's elastic sleep or a
    # split judge starts.
    assert started >= 140, (started, refused[:5])
    assert not [c for c in refused if c[0] != "qwen2.5-32b" and c[2:] == ("fixed", "none", "full", "colocated")]


def test_the_14b_16k_elastic_judged_run_lists_every_engine_pinned_and_vllm_takes_each(
        contract: Contract, monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's run: 14B at 16k, elastic TP, the judged task (the tiny judge), 8 x 80 GB."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    d = _check_cell(contract, ["--rollout.max_tokens", "16384", "--rollout.tp", "elastic",
                               "--data.task", "arith_judged"], "qwen2.5-14b")
    assert not isinstance(d, str), d
    by_tp: dict[int, list[dict[str, Any]]] = {}
    for r in d["replicas"]:
        by_tp.setdefault(r["engine_args"]["tensor_parallel_size"], []).append(r)
    assert sorted(by_tp) == [1, 2, 4, 8] and [len(by_tp[t]) for t in (1, 2, 4, 8)] == [8, 4, 2, 1]
    tp8, = by_tp[8]
    # The TP-8 replica: 4096 sequences, so vLLM must be told more than its 2048 tokens a step.
    assert tp8["engine_args"]["max_num_seqs"] == 4096 and tp8["engine_args"]["max_num_batched_tokens"] == 8192
    assert tp8["env"] == {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"} and not tp8["awake"]
    judges = d["judges"]
    assert [j["gpu"] for j in judges] == list(range(8))
    assert [j["env"] for j in judges] == [{"CUDA_VISIBLE_DEVICES": str(g)} for g in range(8)]
    for j in judges:
        args = j["engine_args"]
        assert args["enable_sleep_mode"] is True and args["gpu_memory_utilization"] < 0.1
        assert args["model"] == run_judge_settings(from_argv(["--data.task", "arith_judged"])).model  # rpk's tiny judge
    assert d["plan"]["judge"]["layers"] == JudgeTinySpec().num_layers  # its shape, from its spec: it is in the plan


def test_a_replica_without_rpks_batch_budget_is_refused_by_vllm(contract: Contract) -> None:
    """The contract is not vacuous: the TP-8 replica's arguments as rpk passed them before
    (no `max_num_batched_tokens`) are refused by vLLM's scheduler config."""
    d = _check_cell(contract, ["--rollout.max_tokens", "16384", "--rollout.tp", "elastic"], "qwen2.5-14b")
    assert not isinstance(d, str)
    tp8 = next(r for r in d["replicas"] if r["engine_args"]["tensor_parallel_size"] == 8)
    before = {k: v for k, v in tp8["engine_args"].items() if k != "max_num_batched_tokens"}
    verdict = contract.check(before, _visible(tp8["env"]))
    assert not verdict.ok and "max_num_batched_tokens (2048) must be greater than or equal to max_num_seqs (4096)" in (
        verdict.error or "")


def test_a_reward_model_and_a_score_judge_pass_vllms_validation(contract: Contract, tmp_path: Path) -> None:
    """The other judge engines: a discriminative reward model (pooling runner) and a
    judge that decodes a graded verdict, each on every rollout GPU."""
    rm = tmp_path / "rm"
    rm.mkdir()
    hf = json.loads((MODELS / "qwen2.5-7b" / "config.json").read_text())
    hf.update(architectures=["Qwen2ForSequenceClassification"], num_labels=1)
    (rm / "config.json").write_text(json.dumps(hf))
    for verdict in (["--reward.judge.verdict", "classify"], ["--reward.judge.verdict", "score"]):
        argv = ["--rollout.max_tokens", "16384", "--reward.judge.model", str(rm), *verdict]
        d = _check_cell(contract, argv, "qwen2.5-14b")
        assert not isinstance(d, str), d
        runner = {j["engine_args"].get("runner") for j in d["judges"]}
        assert runner == ({"pooling"} if "classify" in verdict else {None})
