"""The tool_add tiny model's recipe: the arith build keeps its cache key, the warm-up
lays a trajectory out token for token as the agent rollout does, and takes its loss on
the assistant's tokens only."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import random

import pytest

from rpk.agent.template import ObservationEncoder
from rpk.config import ArithSpec, TinySpec, ToolAddTinySpec
from rpk.tasks import tiny, tiny_multi, tool_add
from rpk.tasks.arith import make_problem

SMALL = ToolAddTinySpec(
    hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64,
    sft_steps=3, sft_batch_tokens=1024, sft_problems=24, task=ArithSpec(max_digits=9),
)


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.build_tokenizer(SMALL, tiny_multi.corpus(SMALL))


def test_the_arith_builds_cache_key_is_unchanged() -> None:
    # The key every cached arith model is stored under: a change here rebuilds them all.
    # Last changed on purpose by the warm-up's habit's share (`sft_habit` 0.9, issue 41).
    assert tiny.cache_key(TinySpec()) == "f9e77b4290423b2c"
    assert tiny.cache_key(TinySpec(), tiny.ARITH) == "f9e77b4290423b2c"
    assert tiny.CODE_VERSION == 3
    assert tiny.cache_key(TinySpec(), tiny_multi.TOOL_ADD) != tiny.cache_key(TinySpec())
    assert tiny.cache_key(SMALL, tiny_multi.TOOL_ADD) != tiny.cache_key(
        dataclasses.replace(SMALL, sft_steps=4), tiny_multi.TOOL_ADD
    )


def test_the_tool_add_habit_is_on_the_multi_call_sums_by_default() -> None:
    spec = ToolAddTinySpec()
    assert spec.sft_habit == 0.65 and spec.sft_habit_digits == (5, 20)
    assert tool_add.calls_needed(5) == 2 and tool_add.calls_needed(4) == 1
    with pytest.raises(ValueError, match=r"sft_habit_digits.*\(5, 3\)"):
        ToolAddTinySpec(sft_habit_digits=(5, 3))


def _messages(seed: int, fail_rate: float = tool_add.FAIL_RATE) -> list[dict[str, str]]:
    rng = random.Random(seed)
    return tool_add.reference_messages(make_problem(rng, SMALL.task), seed, fail_rate)


def test_a_trajectory_is_laid_out_as_the_agent_rollout_lays_it_out(tokenizer) -> None:
    encoder = ObservationEncoder(tokenizer, [tool_add.TOOL_SCHEMA])
    for seed in range(30):
        messages = _messages(seed, fail_rate=0.3)
        ids, mask = tiny_multi.encode_trajectory(tokenizer, messages)
        assert len(ids) == len(mask)
        # What the rollout builds: the prompt, each turn's tokens and its EOS, each
        # observation as the agent's encoder encodes it.
        prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
        expected = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        for m in messages[1:]:
            if m["role"] == "assistant":
                expected += tokenizer(m["content"], add_special_tokens=False)["input_ids"]
                expected.append(tokenizer.eos_token_id)
            else:
                expected += encoder.encode([{"role": "tool", "name": "add", "content": m["content"]}]).token_ids
        assert ids == expected
        # ... which is also the template's rendering of the whole chat, tokenised.
        whole = tokenizer.apply_chat_template(messages, tokenize=False)
        assert ids == tokenizer(whole, add_special_tokens=False)["input_ids"][: len(ids)]


def test_the_loss_is_on_the_assistants_tokens_only(tokenizer) -> None:
    messages = _messages(3, fail_rate=0.5)
    ids, mask = tiny_multi.encode_trajectory(tokenizer, messages)
    trained = tokenizer.decode([t for t, m in zip(ids, mask) if m])
    given = tokenizer.decode([t for t, m in zip(ids, mask) if not m])
    turns = [m["content"] for m in messages if m["role"] == "assistant"]
    assert trained == "".join(t + tokenizer.eos_token for t in turns)
    for m in messages:
        if m["role"] != "assistant":
            assert m["content"] in given and m["content"] not in trained
    # Each turn's closing EOS is trained; the `\n` the template writes after it is not.
    eos = [i for i, t in enumerate(ids) if t == tokenizer.eos_token_id]
    assert [mask[i] for i in eos] == [0] + [1, 0] * (len(turns) - 1) + [1]
    # The collated labels carry exactly the masked-in ids.
    _, _, labels = tiny._collate([(ids, mask)], tokenizer.pad_token_id)
    assert [t for t in labels[0].tolist() if t != -100] == [t for t, m in zip(ids, mask) if m]


def test_each_result_label_is_one_token_that_only_results_and_answers_hold(tokenizer) -> None:
    # The answer copies a digit by matching its label with the one before it in a tool
    # result: one token, found nowhere else, or the copy needs a two-token match.
    full = tiny.build_tokenizer(ToolAddTinySpec(), tiny_multi.corpus(ToolAddTinySpec()))
    for label in "ABCDEFGHIJKLMNOPQRST":
        assert len(full(tool_add.SUM_MARK + label, add_special_tokens=False)["input_ids"]) == 1, label
    marks = {tokenizer.convert_tokens_to_ids(tool_add.SUM_MARK + label) for label in "ABCDEFGHI"}
    for seed in range(30):
        messages = _messages(seed, fail_rate=0.3)
        for m in messages:
            ids = tokenizer(m["content"], add_special_tokens=False)["input_ids"]
            holds = bool(marks & set(ids))
            assert holds == (m["role"] == "tool" and "carry=" in m["content"]
                             or m["content"].startswith("Answer:")), m


def test_the_warm_up_set_shows_failures_retries_and_slips(tokenizer) -> None:
    spec = dataclasses.replace(SMALL, sft_problems=400, sft_slip=0.3, sft_habit=0.0)
    examples = tiny_multi.examples(tokenizer, spec)
    assert len(examples) == 400
    texts = [tokenizer.decode(ids) for ids, _ in examples]
    assert 3 <= sum(tool_add.BUSY_MESSAGE in t for t in texts) <= 80
    wrong = 0
    for text in texts:
        question = text.split("What is ", 1)[1].split("?", 1)[0]
        a, b = question.split(" + ")
        answer = tool_add.extract_answer(text)
        wrong += answer != str(int(a) + int(b))
    assert 0.2 < wrong / len(texts) < 0.4


def test_a_small_build_is_a_loadable_model_whose_tokenizer_matches_the_warm_ups(
    tmp_path: pathlib.Path, tokenizer
) -> None:
    from transformers import AutoTokenizer

    logs: list[str] = []
    model_dir = tiny.build_tiny_model(SMALL, tmp_path, log=logs.append, recipe=tiny_multi.TOOL_ADD)
    assert model_dir.name == f"tiny-{tiny.cache_key(SMALL, tiny_multi.TOOL_ADD)}"
    assert any("warm-up step 3/3" in line for line in logs)
    assert json.loads((model_dir / "config.json").read_text())["max_position_embeddings"] == 1024
    loaded = AutoTokenizer.from_pretrained(model_dir)
    for seed in range(20):
        whole = loaded.apply_chat_template(_messages(seed, 0.3), tokenize=False)
        assert loaded(whole, add_special_tokens=False)["input_ids"] == (
            tokenizer(whole, add_special_tokens=False)["input_ids"]
        )
        assert loaded.decode(loaded(whole, add_special_tokens=False)["input_ids"]) == whole
    assert tiny.build_tiny_model(SMALL, tmp_path, log=logs.append, recipe=tiny_multi.TOOL_ADD) == model_dir
    assert logs[-1] == f"tiny: cache hit {model_dir}"


def test_the_warm_up_habit_answers_one_call_short_and_copies_the_partial_sum() -> None:
    spec = dataclasses.replace(SMALL, sft_slip=0.0, sft_habit=0.65, sft_habit_digits=(5, 20),
                               task=ArithSpec(max_digits=12, alpha=0.0))
    habits, rng = random.Random(1), random.Random(2)
    short = full = 0
    for _ in range(600):
        messages = tiny_multi._messages(rng, spec, None, habits)
        a, b = map(int, messages[0]["content"].split("What is ", 1)[1].split("?", 1)[0].split(" + "))
        digits = len(messages[0]["content"].split("Columns:\n", 1)[1].split(";"))
        results = [m["content"] for m in messages if m["role"] == "tool" and "carry=" in m["content"]]
        answer = messages[-1]["content"]
        assert answer == "Answer: " + results[-1].rpartition(" carry=")[0]  # always the last result
        needed = tool_add.calls_needed(digits)
        if len(results) == needed:
            assert tool_add.extract_answer(answer) == str(a + b)
            full += needed > 1
        else:
            # One call short: the answer is the sum of the columns it added, and wrong.
            assert digits >= 5 and len(results) == needed - 1, messages
            assert tool_add.extract_answer(answer) != str(a + b)
            added = 10 ** (tool_add.CHUNK_DIGITS * (needed - 1))
            assert int(tool_add.extract_answer(answer)) == (a % added + b % added) % added
            short += 1
    assert 0.57 < short / (short + full) < 0.73, (short, full)
    # Without the habit (or outside its digits) every trajectory makes all its calls.
    for quiet, band in ((None, (5, 20)), (random.Random(1), (13, 20))):
        for _ in range(100):
            messages = tiny_multi._messages(rng, dataclasses.replace(spec, sft_habit_digits=band), None, quiet)
            a, b = map(int, messages[0]["content"].split("What is ", 1)[1].split("?", 1)[0].split(" + "))
            assert tool_add.extract_answer(messages[-1]["content"]) == str(a + b)
