"""TorchTrainer on a tiny random Qwen2: gradient bookkeeping, one optimizer step per
`finish_step`, and checkpoint round trips. No network: the model is built locally."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Iterator, Sequence

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config

from rpk.loop.records import TrainSample
from rpk.train.losses import ppo_clip_token_loss, token_logprobs
from rpk.train.trainer import STATE_FILE, TorchTrainer, pack_micro_batches

VOCAB = 64


@pytest.fixture(scope="module", autouse=True)
def _restore_torch_threads() -> Iterator[None]:
    # The trainers below run with torch_threads=1 (tiny shapes: two threads on a shared
    # 2-core box spend more time contending than computing); the setting is
    # process-wide, so put it back for whatever runs next.
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    path = tmp_path_factory.mktemp("tiny-qwen2")
    torch.manual_seed(1234)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(path)
    # Sampling hints without do_sample: HF loads this but refuses to *save* it, as
    # real model repos often have; save() must still work.
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "top_p": 0.9}))
    return path


def make_samples(n: int, seed: int) -> list[TrainSample]:
    """Random prompts/responses of mixed lengths; old log-probs scattered around the
    random model's (~ln 1/64) so that some ratios fall outside the clip range."""
    rng = random.Random(seed)
    samples = []
    for _ in range(n):
        p, r = rng.randint(1, 12), rng.randint(0, 10) if rng.random() < 0.1 else rng.randint(1, 10)
        samples.append(
            TrainSample(
                prompt_ids=tuple(rng.randrange(VOCAB) for _ in range(p)),
                response_ids=tuple(rng.randrange(VOCAB) for _ in range(r)),
                old_logprobs=tuple(-4.16 + rng.uniform(-0.6, 0.6) for _ in range(r)),
                advantage=rng.choice([-1.5, -0.3, 0.0, 0.4, 1.2]),
            )
        )
    return samples


def trainer(model_dir: Path, **overrides: object) -> TorchTrainer:
    settings_: dict[str, object] = dict(
        lr=1e-3, clip_low=0.2, clip_high=0.28, micro_batch_tokens=10_000, temperature=0.7, seed=0,
        torch_threads=1,
    )
    settings_.update(overrides)
    return TorchTrainer(model_dir, **settings_)  # type: ignore[arg-type]


def grads(t: TorchTrainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}


def weights(t: TorchTrainer) -> dict[str, torch.Tensor]:
    return {n: w.clone() for n, w in t.named_weights().items()}


# -- packing ----------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 40), max_size=30), st.integers(1, 120))
def test_pack_micro_batches_respects_budget(lengths: list[int], budget: int) -> None:
    batches = pack_micro_batches(lengths, budget)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        padded = len(b) * max(lengths[i] for i in b)
        assert padded <= budget or len(b) == 1  # an oversize sequence rides alone


def test_pack_micro_batches_is_greedy() -> None:
    # longest first: 10 opens a batch (10 <= 25, 20 <= 25, 30 > 25) -> [10, 8], then [7, 5, 3]
    assert pack_micro_batches([3, 10, 7, 8, 5], 25) == [[1, 3], [2, 4, 0]]


# -- gradients --------------------------------------------------------------------------


def test_gradient_matches_direct_per_sample_reference(model_dir: Path) -> None:
    """The packed, padded, logits_to_keep-trimmed path gives the same summed gradient as
    scoring every sample on its own with a plain forward pass."""
    samples = make_samples(7, seed=1)
    t = trainer(model_dir, dtype=torch.float64, micro_batch_tokens=40)
    t.begin_step()
    got = t.accumulate(samples)
    trainer_grads = grads(t)

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    total, tokens, mismatch = 0.0, 0, 0.0
    for s in samples:
        if not s.response_ids:
            continue
        p = len(s.prompt_ids)
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logits = ref(input_ids=ids).logits[0, p - 1 : p - 1 + len(s.response_ids)]
        logp = token_logprobs(logits, torch.tensor(s.response_ids), 0.7)
        old = torch.tensor(s.old_logprobs, dtype=torch.float64)
        loss, stats = ppo_clip_token_loss(
            logp, old, torch.tensor(s.advantage, dtype=torch.float64), torch.ones_like(logp),
            clip_low=0.2, clip_high=0.28,
        )
        loss.backward()
        total += loss.item()
        tokens += len(s.response_ids)
        mismatch += stats["abs_logp_diff"].item()
    ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}

    assert trainer_grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(trainer_grads[name], g, rtol=1e-9, atol=1e-12, msg=name)
    assert got["train_tokens"] == tokens
    assert got["loss"] == pytest.approx(total / tokens, rel=1e-9)
    assert got["logprob_mismatch"] == pytest.approx(mismatch / tokens, rel=1e-9)
    assert got["micro_batches"] > 1


@settings(max_examples=10, deadline=None)
@given(
    order_seed=st.integers(0, 10_000),
    budget=st.sampled_from([1, 16, 24, 48, 100]),
    n_calls=st.integers(1, 4),
)
def test_gradient_independent_of_split_and_order(
    model_dir: Path,
    reference_grads: dict[str, torch.Tensor],
    order_seed: int,
    budget: int,
    n_calls: int,
) -> None:
    samples = make_samples(9, seed=2)
    random.Random(order_seed).shuffle(samples)
    cuts = sorted(random.Random(order_seed + 1).sample(range(1, len(samples)), n_calls - 1))
    t = trainer(model_dir, dtype=torch.float64, micro_batch_tokens=budget)
    t.begin_step()
    for lo, hi in zip([0, *cuts], [*cuts, len(samples)]):
        t.accumulate(samples[lo:hi])
    for name, g in grads(t).items():
        torch.testing.assert_close(g, reference_grads[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.fixture(scope="module")
def reference_grads(model_dir: Path) -> dict[str, torch.Tensor]:
    """All samples in one accumulate call and one micro-batch."""
    t = trainer(model_dir, dtype=torch.float64, micro_batch_tokens=100_000)
    t.begin_step()
    metrics = t.accumulate(make_samples(9, seed=2))
    assert metrics["micro_batches"] == 1
    return grads(t)


def test_finish_step_takes_exactly_one_optimizer_step(model_dir: Path) -> None:
    t = trainer(model_dir, grad_clip=None)
    samples = make_samples(6, seed=3)
    before = weights(t)
    t.begin_step()
    t.accumulate(samples[:2])
    t.accumulate(samples[2:])
    assert t.version == 0
    assert weights(t).keys() == before.keys()
    assert all(torch.equal(before[n], w) for n, w in weights(t).items())  # not yet
    summed = grads(t)
    metrics = t.finish_step()

    assert t.version == 1 and metrics["version"] == 1.0 and metrics["stepped"] == 1.0
    assert {int(s["step"]) for s in t.optimizer.state.values()} == {1}
    assert all(p.grad is None for p in t.model.parameters())
    after = weights(t)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    # grad_norm is that of the token-mean gradient, i.e. the sum over train_tokens
    tokens = sum(len(s.response_ids) for s in samples)
    assert metrics["train_tokens"] == tokens and metrics["train_samples"] == 6
    norm = torch.cat([(g / tokens).flatten() for g in summed.values()]).norm()
    assert metrics["grad_norm"] == pytest.approx(norm.item(), rel=1e-5)
    for key in ("loss", "clip_frac", "logprob_mismatch", "ratio_mean", "entropy", "lr"):
        assert key in metrics
    assert 0.0 < metrics["clip_frac"] < 1.0
    assert metrics["entropy"] == pytest.approx(4.15, abs=0.1)  # ~ln 64 for a random model


def test_grad_clip_bounds_the_update_direction(model_dir: Path) -> None:
    t = trainer(model_dir, grad_clip=1e-3)
    t.begin_step()
    t.accumulate(make_samples(4, seed=4))
    metrics = t.finish_step()
    assert metrics["grad_norm"] > 1e-3  # reported before clipping


def test_empty_step_does_not_touch_the_optimizer(model_dir: Path) -> None:
    t = trainer(model_dir)
    before = weights(t)
    t.begin_step()
    empty = TrainSample(prompt_ids=(1, 2), response_ids=(), old_logprobs=(), advantage=1.0)
    t.accumulate([empty])
    metrics = t.finish_step()
    assert metrics["stepped"] == 0.0 and metrics["train_tokens"] == 0.0
    assert t.version == 0 and not t.optimizer.state
    assert all(torch.equal(before[n], w) for n, w in weights(t).items())
    t.begin_step()  # the trainer stays usable
    assert t.finish_step()["stepped"] == 0.0


def test_nonfinite_gradient_raises_without_stepping(model_dir: Path) -> None:
    t = trainer(model_dir)
    before = weights(t)
    t.begin_step()
    t.accumulate(make_samples(3, seed=8))
    next(t.model.parameters()).grad[0, 0] = float("inf")  # as an overflow would
    with pytest.raises(FloatingPointError):
        t.finish_step()
    assert t.version == 0 and not t.optimizer.state
    assert all(torch.equal(before[n], w) for n, w in weights(t).items())
    _step(t, make_samples(3, seed=8))  # the trainer stays usable
    assert t.version == 1


def test_step_protocol_misuse_raises(model_dir: Path) -> None:
    t = trainer(model_dir)
    with pytest.raises(RuntimeError):
        t.accumulate(make_samples(1, seed=5))
    with pytest.raises(RuntimeError):
        t.finish_step()
    t.begin_step()
    with pytest.raises(RuntimeError):
        t.begin_step()
    nan, inf = float("nan"), float("inf")
    for prompt, response, old, adv in (
        ((1,), (2, 3), (-1.0,), 1.0),  # one old log-prob per response token
        ((), (2,), (-1.0,), 1.0),  # nothing to predict the first response token from
        ((1,), (2,), (nan,), 1.0),
        ((1,), (2,), (-1.0,), inf),
    ):
        with pytest.raises(ValueError):
            t.accumulate([TrainSample(prompt, response, old, adv)])


def test_named_weights_are_the_hf_state_dict(model_dir: Path) -> None:
    t = trainer(model_dir)
    named = t.named_weights()
    assert named.keys() == AutoModelForCausalLM.from_pretrained(model_dir).state_dict().keys()
    assert "model.embed_tokens.weight" in named and "lm_head.weight" in named
    assert not any(w.requires_grad for w in named.values())


# -- checkpoints ------------------------------------------------------------------------


def _step(t: TorchTrainer, samples: Sequence[TrainSample]) -> None:
    t.begin_step()
    t.accumulate(samples)
    t.finish_step()


def test_checkpoint_round_trip_resumes_identically(model_dir: Path, tmp_path: Path) -> None:
    first, second = make_samples(5, seed=6), make_samples(5, seed=7)
    a = trainer(model_dir, weight_decay=0.1)
    _step(a, first)
    ckpt = a.save(tmp_path / "step-1")
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # temp dir renamed

    # A complete HF model directory: weights, config, tokenizer, generation config.
    expected_files = ("model.safetensors", "config.json", "tokenizer.json", STATE_FILE)
    for name in (*expected_files, "generation_config.json"):
        assert (ckpt / name).is_file(), name
    assert json.loads((ckpt / "generation_config.json").read_text())["temperature"] == 0.7
    assert AutoTokenizer.from_pretrained(ckpt).convert_tokens_to_ids("t5") == 5
    hf = AutoModelForCausalLM.from_pretrained(ckpt)
    for name, w in a.named_weights().items():
        assert torch.equal(hf.state_dict()[name], w), name

    b = trainer(ckpt, weight_decay=0.1)
    b.load_state(ckpt)
    assert b.version == a.version == 1
    for name, w in a.named_weights().items():
        assert torch.equal(b.named_weights()[name], w), name
    state_a, state_b = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert state_a["param_groups"] == state_b["param_groups"]
    for idx, sa in state_a["state"].items():
        for key, value in sa.items():
            assert torch.equal(value, state_b["state"][idx][key]), (idx, key)

    _step(a, second)
    _step(b, second)
    assert a.version == b.version == 2
    for name, w in a.named_weights().items():
        assert torch.equal(b.named_weights()[name], w), name

    # Saving over an existing checkpoint replaces it.
    b.save(ckpt)
    assert torch.load(ckpt / STATE_FILE, weights_only=True)["version"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1"]
