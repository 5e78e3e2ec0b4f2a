"""`rollout.speculative` from the config to vLLM's keyword arguments: the choices' table,
the speculative config every replica starts with (and the dry run shows), the engine
host's copy of the settings, and rpk's proposer where vLLM will import it."""

from __future__ import annotations

import dataclasses
import importlib
import json

import pytest

from rpk.assembly.box import spec_settings
from rpk.assembly.dry_run import dry_run
from rpk.config import ConfigError, from_argv
from rpk.core.drafts import SPECULATIVE, DraftSource, SpecMethod, Speculative
from rpk.engine.vllm_settings import DRAFT_PROPOSER, SpecSettings, VLLMSettings, engine_kwargs, settings_from_json


def test_every_choice_has_a_row_and_only_off_runs_without_a_proposer() -> None:
    assert set(SPECULATIVE) == set(Speculative)
    assert [c for c, row in SPECULATIVE.items() if row.method is None] == [Speculative.OFF]
    assert SPECULATIVE[Speculative.ALL].sources == frozenset(DraftSource)
    assert SPECULATIVE[Speculative.PARTIALS].sources == {DraftSource.PARTIAL}


def test_off_by_default_and_a_bad_choice_is_refused() -> None:
    cfg = from_argv([])
    assert cfg.rollout.speculative == "off" and spec_settings(cfg.rollout) is None
    assert "speculative_config" not in engine_kwargs(VLLMSettings(model="m"), cuda=False)
    with pytest.raises(ConfigError, match="rollout.speculative"):
        from_argv(["--rollout.speculative", "eagle"])
    with pytest.raises(ConfigError, match="spec_max_k"):
        from_argv(["--rollout.speculative", "all", "--rollout.spec_max_k", "0"])


def test_rpks_proposer_is_vllms_custom_class_with_the_start_schedule() -> None:
    cfg = from_argv(["--rollout.speculative", "all", "--rollout.spec_max_k", "6"])
    spec = spec_settings(cfg.rollout)
    assert spec.method is SpecMethod.RPK and spec.max_k == 6
    kwargs = engine_kwargs(VLLMSettings(model="m", max_num_seqs=64, speculative=spec), cuda=False)
    sc = kwargs["speculative_config"]
    assert sc["method"] == "custom_class" and sc["model"] == DRAFT_PROPOSER
    assert sc["num_speculative_tokens"] == 6
    assert kwargs["per_request_spec_decode_metrics"] == "summary"
    # The schedule vLLM validates: from batch size 1, drafting in the tail only.
    from vllm.v1.spec_decode.dynamic.utils import validate_and_normalize_dynamic_sd_schedule

    schedule = validate_and_normalize_dynamic_sd_schedule(sc["num_speculative_tokens_per_batch_size"])
    assert schedule[0][0] == 1 and schedule[0][2] > 0 and schedule[-1][2] == 0
    module, name = DRAFT_PROPOSER.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    assert callable(cls.propose) and callable(cls.load_model)


def test_ngram_is_vllms_prompt_lookup() -> None:
    spec = spec_settings(from_argv(["--rollout.speculative", "ngram"]).rollout)
    sc = engine_kwargs(VLLMSettings(model="m", speculative=spec), cuda=True)["speculative_config"]
    assert sc["method"] == "ngram" and (sc["prompt_lookup_min"], sc["prompt_lookup_max"]) == (2, 4)
    assert "model" not in sc


def test_the_dry_run_carries_the_speculative_config_and_on_cpu_the_plain_twin() -> None:
    out = dry_run(from_argv(["--rollout.speculative", "partials"]), None)
    plain, twin = out["replicas"]
    assert (plain["name"], twin["name"]) == (plain["name"], plain["name"] + "+spec")
    assert "speculative_config" not in plain["engine_args"]
    assert twin["engine_args"]["speculative_config"]["method"] == "custom_class"
    json.dumps(out)  # what the dry run prints
    alone = dry_run(from_argv(["--rollout.speculative", "partials", "--rollout.spec_twin", "false"]), None)
    assert [r["engine_args"]["speculative_config"]["method"] for r in alone["replicas"]] == ["custom_class"]
    assert spec_settings(from_argv(["--rollout.speculative", "all"]).rollout, cuda=True).twin is False


def test_the_engine_host_rebuilds_the_settings_it_is_sent() -> None:
    settings = VLLMSettings(model="m", max_num_seqs=32, devices=(1,),
                            speculative=SpecSettings(SpecMethod.RPK, 4, ((1, 2, 4), (3, 32, 0))))
    wire = json.loads(json.dumps({k: v for k, v in dataclasses.asdict(settings).items() if k != "model"}))
    assert settings_from_json("m", wire) == settings
