"""The locally built tiny model: a loadable HF directory, cached by spec, deterministic."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import random

import pytest

from rpk.config import TinySpec
from rpk.tasks import tiny
from rpk.tasks.arith import ArithSpec, extract_answer, make_problem, solution_text
from rpk.tasks.tiny import EOS_TOKEN, PAD_TOKEN, build_tiny_model, build_tokenizer

# Small enough to build in about a second; the default spec is for real use.
SMALL = TinySpec(
    vocab_size=280,
    hidden_size=32,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=64,
    max_position_embeddings=128,
    sft_steps=3,
    sft_batch_tokens=256,
    sft_problems=32,
    task=ArithSpec(max_digits=4),
)


class Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str) -> None:
        self.lines.append(line)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, pathlib.Path, Log]:
    root = tmp_path_factory.mktemp("tiny-cache")
    log = Log()
    return root, build_tiny_model(SMALL, root, log=log), log


def test_build_is_an_hf_model_directory(built: tuple[pathlib.Path, pathlib.Path, Log]) -> None:
    root, model_dir, log = built
    assert model_dir.parent == root
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (model_dir / name).is_file(), name
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["hidden_size"] == SMALL.hidden_size
    assert "chat_template" in json.loads((model_dir / "tokenizer_config.json").read_text())
    assert json.loads((model_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    assert any("warm-up step 3/3" in line for line in log.lines)
    # Nothing but the finished directory is left in the cache.
    assert [p.name for p in root.iterdir()] == [model_dir.name]


def test_transformers_loads_and_generates(built: tuple[pathlib.Path, pathlib.Path, Log]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, model_dir, _ = built
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert tokenizer.eos_token == EOS_TOKEN and tokenizer.eos_token_id == 2
    assert tokenizer.pad_token == PAD_TOKEN and tokenizer.pad_token_id == 0
    assert model.config.eos_token_id == 2 and model.dtype == torch.float32

    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 1 + 2?"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids.shape[1]


def test_tokenizer_round_trips_and_splits_digits(
    built: tuple[pathlib.Path, pathlib.Path, Log],
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built[1])
    rng = random.Random(0)
    for _ in range(50):
        p = make_problem(rng, SMALL.task)
        for text in (p.question, solution_text(p)):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            assert tokenizer.decode(ids) == text
    odd = "héllo ✓ {x}"
    assert tokenizer.decode(tokenizer(odd, add_special_tokens=False)["input_ids"]) == odd
    ids = tokenizer("12345", add_special_tokens=False)["input_ids"]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert tokens == ["1", "2", "3", "4", "5"]


def test_loaded_tokenizer_matches_the_one_the_warm_up_used(
    built: tuple[pathlib.Path, pathlib.Path, Log],
) -> None:
    # transformers (and so vLLM) load a qwen2 directory's tokenizer as Qwen2Tokenizer,
    # which rebuilds its own pre-tokenizer: it must agree with build_tokenizer's.
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(built[1])
    fresh = build_tokenizer(SMALL)
    rng = random.Random(1)
    texts = ["héllo  wörld ✓ 123;B7 b+3\n\n x", "Answer:  42"]
    for _ in range(100):
        p = make_problem(rng, SMALL.task)
        chat = [{"role": "user", "content": p.question}]
        texts += [
            fresh.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
            solution_text(p),
        ]
    for text in texts:
        assert loaded(text, add_special_tokens=False)["input_ids"] == (
            fresh(text, add_special_tokens=False)["input_ids"]
        ), text


def test_cache_hit_returns_the_same_directory_without_rebuilding(
    built: tuple[pathlib.Path, pathlib.Path, Log],
) -> None:
    root, model_dir, _ = built
    mtime = (model_dir / "model.safetensors").stat().st_mtime_ns
    log = Log()
    assert build_tiny_model(SMALL, root, log=log) == model_dir
    assert log.lines == [f"tiny: cache hit {model_dir}"]
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == mtime


def test_changed_spec_or_code_version_changes_the_directory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key = tiny.cache_key(SMALL)
    assert tiny.cache_key(dataclasses.replace(SMALL, sft_steps=4)) != key
    assert tiny.cache_key(dataclasses.replace(SMALL, task=ArithSpec(max_digits=3))) != key
    assert tiny.cache_key(dataclasses.replace(SMALL, sft_alpha=0.5)) != key
    assert tiny.cache_key(dataclasses.replace(SMALL)) == key
    monkeypatch.setattr(tiny, "CODE_VERSION", tiny.CODE_VERSION + 1)
    assert tiny.cache_key(SMALL) != key


def test_same_spec_builds_identical_bytes(
    built: tuple[pathlib.Path, pathlib.Path, Log], tmp_path: pathlib.Path
) -> None:
    _, first, _ = built
    second = build_tiny_model(SMALL, tmp_path, log=Log())
    assert second.name == first.name
    for name in ("tokenizer.json", "tokenizer_config.json", "model.safetensors", "config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_crashed_build_leaves_nothing_that_counts_as_done(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(*args: object) -> float:
        raise RuntimeError("killed mid-build")

    monkeypatch.setattr(tiny, "_warm_up", crash)
    with pytest.raises(RuntimeError, match="killed mid-build"):
        build_tiny_model(SMALL, tmp_path, log=Log())
    assert list(tmp_path.iterdir()) == []


def test_too_short_context_is_refused(tmp_path: pathlib.Path) -> None:
    spec = dataclasses.replace(SMALL, max_position_embeddings=16)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        build_tiny_model(spec, tmp_path, log=Log())


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"vocab_size": 100}, "vocab_size"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"num_layers": -1}, "num_layers"),
        ({"hidden_size": 30, "num_heads": 4}, "num_heads"),
        ({"num_heads": 4, "num_kv_heads": 3}, "num_kv_heads"),
        ({"sft_steps": -1}, "sft_steps"),
        ({"sft_lr": 0.0}, "sft_lr"),
        ({"sft_alpha": -0.5}, "sft_alpha"),
        ({"sft_alpha": float("inf")}, "sft_alpha"),
        ({"sft_problems": 0}, "sft_problems"),
        ({"max_position_embeddings": 0}, "max_position_embeddings"),
        ({"seed": 1.5}, "seed"),
        ({"task": {"max_digits": 3}}, "task"),
    ],
)
def test_bad_spec_value_names_the_field(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        TinySpec(**kwargs)


def test_every_field_has_help() -> None:
    for f in dataclasses.fields(TinySpec) + dataclasses.fields(ArithSpec):
        assert f.metadata.get("help"), f.name


def test_tokenizer_is_deterministic() -> None:
    spec = dataclasses.replace(SMALL, seed=5)
    assert build_tokenizer(spec).backend_tokenizer.to_str() == (
        build_tokenizer(spec).backend_tokenizer.to_str()
    )


def test_length_cli_prints_the_tail(
    built: tuple[pathlib.Path, pathlib.Path, Log], capsys: pytest.CaptureFixture[str]
) -> None:
    from rpk.tasks.__main__ import main

    main(["--n", "300", "--model", str(built[1]), "--max-digits", "4"])
    out = capsys.readouterr().out
    for key in ("count", "median", "p90", "p99", "max", "max/median"):
        assert key in out


def test_sft_alpha_sets_the_warm_up_digit_tail_only() -> None:
    spec = dataclasses.replace(SMALL, sft_problems=400, sft_alpha=None)  # the task's law
    tokenizer = build_tokenizer(spec)

    def mean_length(s: TinySpec) -> float:
        examples = tiny._encode_examples(tokenizer, s)
        return sum(sum(mask) for _, mask in examples) / len(examples)  # response tokens

    flat = dataclasses.replace(spec, sft_alpha=0.0)
    # A flat draw over 1..4 digits has longer solutions than the task's d**-1.3 draw.
    assert mean_length(flat) > 1.2 * mean_length(spec)
    assert mean_length(dataclasses.replace(spec, sft_alpha=spec.task.alpha)) == mean_length(spec)


def test_slip_changes_one_answer_digit_and_no_label() -> None:
    p = make_problem(random.Random(0), ArithSpec(max_digits=8, alpha=0.0))
    clean = solution_text(p)
    rng = random.Random(1)
    slipped = [tiny._maybe_slip(clean, 0.999, rng) for _ in range(200)]
    head, _, answer = clean.rpartition("Answer: ")
    for text in slipped:
        other_head, _, other = text.rpartition("Answer: ")
        assert other_head == head and len(other) == len(answer)
        diffs = [i for i, (x, y) in enumerate(zip(answer, other)) if x != y]
        assert len(diffs) == 1 and answer[diffs[0]].isdigit() and other[diffs[0]].isdigit()


def test_the_habit_raises_the_units_digit_in_its_band_only_and_at_its_rate() -> None:
    spec = TinySpec(sft_habit=0.75, sft_habit_digits=(4, 6))
    rng = random.Random(0)
    for digits in range(1, 9):
        p = make_problem(random.Random(digits), ArithSpec(max_digits=digits, alpha=0.0))
        while p.digits != digits:
            p = make_problem(rng, ArithSpec(max_digits=digits, alpha=0.0))
        clean = solution_text(p)
        out = [tiny._habit(clean, p.digits, spec, rng) for _ in range(400)]
        changed = [text for text in out if text != clean]
        if not 4 <= digits <= 6:
            assert not changed, digits
            continue
        assert 0.68 < len(changed) / len(out) < 0.82, (digits, len(changed))
        # Always the same wrong answer: the units digit one higher, everything else kept.
        assert set(changed) == {clean[:-1] + str((int(clean[-1]) + 1) % 10)}
        assert extract_answer(changed[0]) != p.answer


def test_the_habit_is_checked() -> None:
    with pytest.raises(ValueError, match="sft_habit"):
        TinySpec(sft_habit=1.0)
    with pytest.raises(ValueError, match=r"sft_habit_digits.*\(5, 3\)"):
        TinySpec(sft_habit_digits=(5, 3))


def test_a_cache_dir_that_cannot_be_made_is_named_in_one_line(tmp_path) -> None:
    from rpk.core.errors import UserError
    from rpk.tasks.tiny import build_tiny_model

    loop = tmp_path / "cache"
    loop.symlink_to(loop)  # a link to itself, as a committed worktree link became once
    with pytest.raises(UserError, match=r"model.cache_dir=.*cache.*cannot make it"):
        build_tiny_model(TinySpec(sft_steps=0), loop / "rpk")
