"""Config: defaults, YAML, dotted overrides, help, and errors that name field and value."""

from __future__ import annotations

from dataclasses import fields

import pytest

from rpk.config import Config, ConfigError, build, dump_yaml, from_argv
from rpk.config.cli import iter_fields
from rpk.run import main as run_main
from rpk.tasks.specs import JudgeTinySpec, TinySpec


def test_defaults_serve():
    cfg = from_argv([])
    assert cfg == Config()
    assert cfg.rollout.policy == "tail"
    assert cfg.model.path is None


def test_dotted_overrides_and_types():
    cfg = from_argv(["--train.lr", "1e-5", "--rollout.responses_per_prompt=4",
                     "--data.shuffle", "false", "--model.tiny.num_layers", "2",
                     "--data.train_files", "a.jsonl,b.parquet", "--reward.function", "m:f"])
    assert cfg.train.lr == 1e-5
    assert cfg.rollout.responses_per_prompt == 4
    assert cfg.data.shuffle is False
    assert cfg.model.tiny.num_layers == 2
    assert cfg.data.train_files == ("a.jsonl", "b.parquet")
    assert cfg.reward.function == "m:f"


def test_yaml_file_then_cli_wins(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("train:\n  lr: 0.001\n  grad_clip: 0.5\nrun:\n  steps: 3\n")
    cfg = from_argv(["--config", str(f), "--train.lr", "0.002"])
    assert cfg.train.lr == 0.002 and cfg.train.grad_clip == 0.5 and cfg.run.steps == 3


def test_resolved_config_round_trips_through_yaml(tmp_path):
    import yaml

    cfg = from_argv(["--train.lr", "3e-4", "--data.train_files", "x.jsonl"])
    assert build(Config, yaml.safe_load(dump_yaml(cfg))) == cfg


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--train.lr", "fast"], "train.lr: expected a number, got 'fast'"),
        (["--train.lr", "-1"], "lr must be > 0, got -1.0"),
        (["--rollout.responses_per_prompt", "1"], "responses_per_prompt must be >= 2"),
        (["--rollout.responses_per_prompt", "2.5"], "expected an integer, got '2.5'"),
        (["--rollout.policy", "magic"], "rollout.policy 'magic' is not one of tail, sync, oversample, partial"),
        (["--train.lrr", "1"], "unknown config key 'train.lrr'"),
        (["--nope.x", "1"], "unknown config key 'nope'"),
        (["--data.shuffle", "maybe"], "data.shuffle: expected true/false, got 'maybe'"),
        (["--rollout.top_p", "0"], "top_p must be in (0, 1], got 0.0"),
        (["--reward.function", "nocolon"], "module:function, got 'nocolon'"),
        (["--train.lr"], "--train.lr needs a value"),
        (["stray"], "unexpected argument 'stray'"),
        (["--run.trackers", "neptune"], "run.trackers 'neptune' is not one of tensorboard, wandb, mlflow"),
        (["--run.trackers", "wandb,wandb"], "run.trackers lists a tracker twice"),
        (["--run.project", ""], "run.project must not be empty"),
        (["--run.eval_k", "-1"], "run.eval_k must be >= 0, got -1"),
        (["--run.eval_every", "-5"], "run.eval_every must be >= 0, got -5"),
        (["--run.eval_before_train", "perhaps"], "run.eval_before_train: expected true/false"),
        (["--data.val_size", "-1"], "data.val_size must be >= 0, got -1"),
    ],
)
def test_bad_values_name_the_field_and_value(argv, needle):
    with pytest.raises(ConfigError) as info:
        from_argv(argv)
    assert needle in str(info.value)


def test_bad_yaml_is_a_config_error(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        from_argv(["--config", str(f)])
    with pytest.raises(ConfigError, match="no such file|No such file"):
        from_argv(["--config", str(tmp_path / "missing.yaml")])


def test_help_lists_every_field_with_default(capsys):
    with pytest.raises(SystemExit) as stop:
        run_main(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    for name, _tp, _default, _help in iter_fields(Config):
        assert f"--{name} " in out, name
    assert "--train.lr float  (default: 5e-05)" in out
    assert "AdamW learning rate" in out


def test_cli_exits_2_with_one_clear_line(capsys):
    assert run_main(["--train.lr", "x"]) == 2
    assert "config error: train.lr: expected a number, got 'x'" in capsys.readouterr().err


def test_the_old_streaming_switch_names_its_replacement():
    with pytest.raises(ConfigError, match=r"'train.streaming' is gone: use train.stream_mode"):
        from_argv(["--train.streaming", "false"])
    with pytest.raises(ConfigError, match="stream_mode must be none, thread or borrow, got 'x'"):
        from_argv(["--train.stream_mode", "x"])
    assert from_argv(["--train.stream_mode", "borrow"]).train.stream_mode == "borrow"


def test_an_unknown_task_is_refused_by_name_with_the_known_ones():
    from rpk.tasks import TASKS, task

    with pytest.raises(ConfigError, match=r"data.task 'nope' is not one of arith, arith_judged, tool_add"):
        from_argv(["--data.task", "nope"])
    # The registry itself refuses too, so no caller can fall back to a default task.
    with pytest.raises(ConfigError, match=r"data.task 'nope' is not one of arith, arith_judged, tool_add"):
        task("nope")
    assert task("tool_add") is TASKS["tool_add"]
    assert task("tool_add").module().DATA_SOURCE == "rpk/tool_add"
    cfg = from_argv(["--data.task", "tool_add"])
    assert task(cfg.data.task).tiny_spec(cfg.model) is cfg.model.tiny_tool_add


def test_a_task_sets_its_own_defaults_which_the_file_and_the_command_line_override(tmp_path):
    from rpk.tasks import TASKS

    preset = TASKS["tool_add"].defaults
    assert preset and not TASKS["arith"].defaults
    cfg = from_argv(["--data.task", "tool_add"])
    plain = Config()
    for section, values in preset.items():
        for name, value in values.items():
            assert getattr(getattr(cfg, section), name) == value, (section, name)
            assert getattr(getattr(plain, section), name) != value, (section, name)
    # The trajectory budget the task needs, above arith's.
    assert cfg.rollout.max_tokens > plain.rollout.max_tokens
    assert from_argv(["--data.task", "arith"]) == from_argv([]) == plain
    # The command line wins over the task's defaults, and so does a file.
    over = from_argv(["--data.task", "tool_add", "--rollout.max_tokens", "400"])
    assert over.rollout.max_tokens == 400
    assert over.run.steps == preset["run"]["steps"]
    f = tmp_path / "run.yaml"
    f.write_text("data:\n  task: tool_add\nrun:\n  steps: 5\n")
    from_file = from_argv(["--config", str(f)])
    assert from_file.run.steps == 5
    assert from_file.rollout.max_tokens == preset["rollout"]["max_tokens"]


def test_the_task_registry_holds_the_names_config_checks_against():
    from rpk.core import names
    from rpk.tasks import TASKS

    assert tuple(TASKS) == names.TASKS
    assert all(t.name == n for n, t in TASKS.items())
    assert names.JUDGED_TASKS == tuple(n for n, t in TASKS.items() if t.judged)


def test_each_task_record_is_what_its_module_serves():
    from rpk.reward.functions import builtin
    from rpk.tasks import TASKS, by_source

    for t in TASKS.values():
        assert t.module().DATA_SOURCE == t.data_source
        assert by_source(t.data_source) is t
        assert builtin(t.data_source) is t.checker() is t.module().compute_score
        assert t.multi_turn == hasattr(t.module(), "TOOLS")
    assert [n for n, t in TASKS.items() if t.judged] == ["arith_judged"]
    assert [n for n, t in TASKS.items() if t.multi_turn] == ["tool_add"]
    assert by_source("rpk/none") is None


def test_a_run_of_one_task_imports_no_other_task_module():
    """The registry is light: the config, a run's modules, the reward functions and the
    assembly's builders of an arith run leave tool_add's and arith_judged's modules
    unimported (and a tool_add run arith_judged's)."""
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "import rpk.run\n"
        "from rpk import assembly, config\n"
        "from rpk.assembly.settings import run_settings\n"
        "from rpk.reward.functions import resolve_rewards\n"
        "cfg = config.from_argv(sys.argv[1:])\n"
        "rows = assembly.builtin_rows(assembly.prompt_source(cfg))\n"
        "resolve_rewards(None, {r['data_source'] for r in rows})\n"
        "run_settings(cfg); assembly.agent_tools(cfg.agent, assembly.prompt_source(cfg).task)\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('rpk.tasks.'))))\n"
    )
    def loaded(*argv: str) -> set[str]:
        out = subprocess.run([sys.executable, "-c", probe, "--data.builtin_size", "64", *argv],
                             capture_output=True, text=True, check=True)
        return set(out.stdout.split())

    arith = loaded()
    assert "rpk.tasks.arith" in arith
    assert not arith & {"rpk.tasks.tool_add", "rpk.tasks.arith_judged", "rpk.tasks.tiny_multi"}
    tool_add = loaded("--data.task", "tool_add")
    assert "rpk.tasks.tool_add" in tool_add and "rpk.tasks.arith_judged" not in tool_add


def test_a_literal_field_is_checked_against_its_type_alone():
    from dataclasses import replace

    from rpk.config import RolloutConfig
    from rpk.config.inputs import JudgeConfig

    # Built in code, not parsed: the section's own check reads the choices off the type.
    with pytest.raises(ConfigError, match="weight_transfer must be one of shm, gloo, cpu_ipc, "
                                          "auto, ipc, nccl, m2n, got 'smoke'"):
        RolloutConfig(weight_transfer="smoke")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="tp_switch must be one of sleep, restart, got 'nap'"):
        replace(RolloutConfig(), tp_switch="nap")
    with pytest.raises(ConfigError, match="verdict must be one of logprob, reason, score, classify, got 'vote'"):
        JudgeConfig(verdict="vote")  # type: ignore[arg-type]


def test_a_tiny_variant_takes_the_base_help_for_a_field_whose_default_alone_differs():
    base = {f.name: f for f in fields(TinySpec)}
    judge = {f.name: f for f in fields(JudgeTinySpec)}
    assert judge["hidden_size"].default == 64 != base["hidden_size"].default
    assert judge["hidden_size"].metadata["help"] == base["hidden_size"].metadata["help"] == "model width"
    # A field the variant means otherwise keeps its own help.
    assert judge["sft_problems"].metadata["help"] == "distinct cases in the warm-up set"
