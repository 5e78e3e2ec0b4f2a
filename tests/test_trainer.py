"""TorchTrainer on a tiny random Qwen2: gradient bookkeeping for every loss (independent
of how a step is split and ordered), one optimizer step per `finish_step`, the KL
reference, threads, and checkpoint round trips. No network: the model is built locally."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, AutoTokenizer

import rpk.train.head as head_module
from rpk.core.records import TrainSample
from rpk.train.losses import LOSSES, LossSettings, PolicyBatch, grpo_loss, token_logprobs
from rpk.train.packing import pack_micro_batches, split_across
from rpk.train.state import INDEX_FILE, META_FILE, STATE_DIR
from rpk.train.trainer import TorchTrainer
from rpk.train.weights import bucketed
from tests.trainers import MAX_TOKENS, grads, make_samples, saved_after_a_step, step, stepped_gradient, trainer

pytestmark = pytest.mark.usefixtures("restore_torch_threads")


def weights(t: TorchTrainer) -> dict[str, torch.Tensor]:
    return {n: w.detach().clone() for n, w in t.model.state_dict().items()}


# -- packing ----------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(1, 40), max_size=30), st.integers(1, 120))
def test_pack_micro_batches_respects_budget(lengths: list[int], budget: int) -> None:
    batches = pack_micro_batches(lengths, budget)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for b in batches:
        padded = len(b) * max(lengths[i] for i in b)
        assert padded <= budget or len(b) == 1  # an oversize sequence rides alone


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(min_value=1, max_value=300), max_size=40),
    ranks=st.integers(min_value=1, max_value=4),
    budget=st.integers(min_value=50, max_value=1000),
)
def test_split_across_ranks_covers_every_sample_once_with_equal_pass_counts(
    lengths: list[int], ranks: int, budget: int
) -> None:
    per_rank = split_across(lengths, ranks, budget)
    assert len(per_rank) == ranks
    assert len({len(batches) for batches in per_rank}) == 1  # the same passes on every rank
    seen = sorted(i for batches in per_rank for batch in batches for i in batch)
    assert seen == list(range(len(lengths)))
    for batches in per_rank:
        for batch in batches:
            assert not batch or len(batch) * max(lengths[i] for i in batch) <= budget or len(batch) == 1
    if lengths and ranks > 1:  # balanced: no rank exceeds the fair share by more than one sample
        loads = [sum(lengths[i] for b in batches for i in b) for batches in per_rank]
        assert max(loads) <= sum(lengths) / ranks + max(lengths)


def test_pack_micro_batches_is_greedy() -> None:
    # longest first: 10 opens a batch (10 <= 25, 20 <= 25, 30 > 25) -> [10, 8], then [7, 5, 3]
    assert pack_micro_batches([3, 10, 7, 8, 5], 25) == [[1, 3], [2, 4, 0]]


# -- gradients --------------------------------------------------------------------------


def float64_step(
    model_dir: Path, samples: Sequence[TrainSample]
) -> tuple[dict[str, torch.Tensor], Mapping[str, float], Mapping[str, float]]:
    """One trainer step in float64, packed into micro-batches of 40 tokens: its gradients,
    `accumulate`'s counts and `finish_step`'s metrics."""
    t = trainer(model_dir, dtype=torch.float64, micro_batch_tokens=40)
    t.begin_step()
    counts = t.accumulate(samples)
    trainer_grads = grads(t)
    return trainer_grads, counts, t.finish_step()


def reference_step(
    model_dir: Path, samples: Sequence[TrainSample]
) -> tuple[dict[str, torch.Tensor], float, int]:
    """GRPO's summed gradient, loss sum and token count, scoring every sample on its own
    with a plain float64 forward pass and full logits."""
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    total, tokens = 0.0, 0
    for s in samples:
        keep = s.trained_positions()  # a multi-turn sample's observation tokens are context only
        if not keep:
            continue
        p, n = len(s.prompt_ids), len(keep)
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        logits = ref(input_ids=ids).logits[0, [p - 1 + j for j in keep]]
        logp = token_logprobs(logits, torch.tensor([s.response_ids[j] for j in keep]), 0.7).unsqueeze(0)
        batch = PolicyBatch(
            logp, torch.tensor([[s.old_logprobs[j] for j in keep]], dtype=torch.float64),
            torch.tensor([s.advantage], dtype=torch.float64), torch.ones(1, n, dtype=torch.bool),
        )
        loss, _ = grpo_loss(batch, LossSettings(clip_low=0.2, clip_high=0.28))
        loss.backward()
        total += loss.item()
        tokens += n
    return {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}, total, tokens


def test_gradient_matches_direct_per_sample_reference(model_dir: Path) -> None:
    """The packed, padded, hidden-state path gives the same summed gradient as scoring
    every sample on its own with a plain forward pass (float64: tight)."""
    samples = make_samples(7, seed=1)
    trainer_grads, counts, metrics = float64_step(model_dir, samples)
    ref_grads, total, tokens = reference_step(model_dir, samples)

    assert trainer_grads.keys() == ref_grads.keys()
    for name, g in ref_grads.items():
        torch.testing.assert_close(trainer_grads[name], g, rtol=1e-9, atol=1e-12, msg=name)
    assert counts["train_tokens"] == metrics["train_tokens"] == tokens
    assert counts["micro_batches"] > 1
    assert metrics["loss"] == pytest.approx(total / tokens, rel=1e-9)


def test_masked_tokens_are_context_and_never_loss(model_dir: Path) -> None:
    """Multi-turn samples: observation tokens (mask 0) condition the model's later tokens
    but add nothing to the loss, the gradient or the token count, whatever their
    placeholder log-probs; a sample of observations only is no loss at all."""
    rng = random.Random(5)
    samples = []
    for s in make_samples(8, seed=4):
        mask = tuple(rng.choice((0, 1, 1)) for _ in s.response_ids)
        # Garbage where masked: it must not matter.
        old = tuple(lp if m else -50.0 for lp, m in zip(s.old_logprobs, mask))
        samples.append(dataclasses.replace(s, old_logprobs=old, loss_mask=mask))
    samples.append(dataclasses.replace(samples[0], loss_mask=(0,) * len(samples[0].response_ids)))
    trainer_grads, counts, metrics = float64_step(model_dir, samples)
    ref_grads, total, tokens = reference_step(model_dir, samples)
    assert tokens == sum(sum(s.loss_mask) for s in samples) < sum(len(s.response_ids) for s in samples)
    for name, g in ref_grads.items():
        torch.testing.assert_close(trainer_grads[name], g, rtol=1e-9, atol=1e-12, msg=name)
    assert counts["train_tokens"] == metrics["train_tokens"] == tokens
    assert metrics["loss"] == pytest.approx(total / tokens, rel=1e-9)
    t = trainer(model_dir, dtype=torch.float64, micro_batch_tokens=40)
    with pytest.raises(ValueError, match="loss mask"):
        t.begin_step()
        t.accumulate([dataclasses.replace(samples[0], loss_mask=(1,))])


def test_float32_goes_through_the_fused_kernel(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A float32 model takes its log-probs from rpk.kernels (no [tokens, V] logits) and
    still matches the float64 full-logits reference to float32 accuracy."""
    calls: list[tuple[int, ...]] = []
    fused = head_module.token_logprobs_entropy

    def spy(hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(tuple(hidden.shape))
        return fused(hidden, *args, **kwargs)

    monkeypatch.setattr(head_module, "token_logprobs_entropy", spy)
    samples = make_samples(7, seed=1)
    t = trainer(model_dir, micro_batch_tokens=40)
    t.begin_step()
    t.accumulate(samples)
    got = grads(t)
    ref_grads, _, tokens = reference_step(model_dir, samples)
    assert sum(n for n, _ in calls) == tokens and all(h == 32 for _, h in calls)
    for name, g in ref_grads.items():
        torch.testing.assert_close(got[name].double(), g, rtol=1e-4, atol=1e-6, msg=name)


@pytest.fixture(scope="session")
def other_model_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another random init of the same architecture: a KL reference that differs from
    the policy, so the KL term has a gradient."""
    path = tmp_path_factory.mktemp("tiny-qwen2-ref")
    torch.manual_seed(99)
    config = AutoModelForCausalLM.from_pretrained(model_dir).config
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


# Each loss, and GRPO with both extra terms (KL to a reference that differs from the
# policy, so that term has a gradient). Clip ranges are the losses' own defaults.
CASES: dict[str, dict[str, object]] = {
    "grpo": {},
    "dr_grpo": {},
    "dapo": {},  # overlong filtering on: the truncated samples drop out
    "gspo": {},
    "grpo+kl+entropy": {"loss": "grpo", "kl_coef": 0.05, "entropy_coef": 0.01},
}


def case_trainer(model_dir: Path, ref_dir: Path, case: str, budget: int) -> TorchTrainer:
    overrides = {"loss": case, **CASES[case]}
    if "kl_coef" in overrides:
        overrides["reference_dir"] = ref_dir
    return trainer(
        model_dir, dtype=torch.float64, micro_batch_tokens=budget, clip_low=None,
        clip_high=None, grad_clip=0.0, **overrides,
    )


@pytest.fixture(scope="module")
def case_references(
    model_dir: Path, other_model_dir: Path
) -> dict[str, tuple[dict[str, torch.Tensor], dict[str, float]]]:
    """Per case: all samples in one accumulate call and one micro-batch."""
    refs = {}
    for case in CASES:
        t = case_trainer(model_dir, other_model_dir, case, budget=100_000)
        refs[case] = stepped_gradient(t, [make_samples(9, seed=2)])
        assert refs[case][1]["micro_batches"] == 1
    return refs


@pytest.mark.parametrize("case", list(CASES))
@settings(max_examples=6, deadline=None)
@given(
    order_seed=st.integers(0, 10_000),
    budget=st.sampled_from([1, 16, 24, 48, 100]),
    n_calls=st.integers(1, 4),
)
def test_step_gradient_independent_of_split_and_order(
    model_dir: Path,
    other_model_dir: Path,
    case_references: dict[str, tuple[dict[str, torch.Tensor], dict[str, float]]],
    case: str,
    order_seed: int,
    budget: int,
    n_calls: int,
) -> None:
    """What the loop relies on to stream groups into the trainer: the gradient the
    optimizer steps with, and the step's metrics, are those of the whole step at once
    whatever the arrival order, the accumulate calls and the micro-batch budget."""
    samples = make_samples(9, seed=2)
    random.Random(order_seed).shuffle(samples)
    cuts = sorted(random.Random(order_seed + 1).sample(range(1, len(samples)), n_calls - 1))
    calls = [samples[lo:hi] for lo, hi in zip([0, *cuts], [*cuts, len(samples)])]
    t = case_trainer(model_dir, other_model_dir, case, budget)
    got, metrics = stepped_gradient(t, calls)
    ref_grads, ref_metrics = case_references[case]
    for name, g in ref_grads.items():
        torch.testing.assert_close(got[name], g, rtol=1e-10, atol=1e-13, msg=name)
    for key in ("loss", "grad_norm", "clip_frac", "entropy", "kl", "train_tokens"):
        if key in ref_metrics:
            assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-10, abs=1e-13), key


@pytest.mark.parametrize(
    ("loss", "divisor"),
    [
        ("grpo", lambda tokens, seqs: tokens),
        ("dapo", lambda tokens, seqs: tokens),
        ("dr_grpo", lambda tokens, seqs: seqs * MAX_TOKENS),
        ("gspo", lambda tokens, seqs: seqs),
    ],
)
def test_finish_step_divides_by_the_losses_normaliser(
    model_dir: Path, loss: str, divisor: Any
) -> None:
    samples = make_samples(8, seed=11)
    kept = [s for s in samples if s.response_ids and not (loss == "dapo" and s.truncated)]
    tokens, seqs = sum(len(s.response_ids) for s in kept), len(kept)
    assert any(s.truncated and s.response_ids for s in samples)
    t = trainer(model_dir, loss=loss, dtype=torch.float64, grad_clip=0.0)
    t.begin_step()
    t.accumulate(samples)
    summed = grads(t)
    stepped: dict[str, torch.Tensor] = {}
    handle = t.optimizer.register_step_pre_hook(lambda *_: stepped.update(grads(t)))
    metrics = t.finish_step()
    handle.remove()
    for name, g in summed.items():
        torch.testing.assert_close(stepped[name], g / divisor(tokens, seqs), rtol=1e-12, atol=0)
    assert metrics["train_tokens"] == tokens and metrics["train_sequences"] == seqs
    assert metrics["train_samples"] == len(samples)
    expected_filtered = sum(s.truncated for s in samples) if loss == "dapo" else 0
    assert metrics["overlong_filtered"] == expected_filtered


def test_dapo_overlong_filter_drops_truncated_samples(model_dir: Path) -> None:
    samples = make_samples(8, seed=11)
    truncated = [s for s in samples if s.truncated and s.response_ids]
    assert truncated
    with_them, _ = stepped_gradient(trainer(model_dir, loss="dapo", dtype=torch.float64), [samples])
    without, _ = stepped_gradient(
        trainer(model_dir, loss="dapo", dtype=torch.float64),
        [[s for s in samples if not s.truncated]],
    )
    unfiltered, metrics = stepped_gradient(
        trainer(model_dir, loss="dapo", dtype=torch.float64, overlong_filter=False), [samples]
    )
    assert metrics["overlong_filtered"] == 0
    for name, g in without.items():
        torch.testing.assert_close(with_them[name], g, rtol=1e-12, atol=1e-15, msg=name)
    assert any(not torch.allclose(unfiltered[n], g) for n, g in without.items())


def test_loss_defaults_and_overrides(model_dir: Path) -> None:
    def clips(**kw: object) -> tuple[float, float]:
        s = trainer(model_dir, clip_low=None, clip_high=None, **kw).loss_settings
        return s.clip_low, s.clip_high

    assert clips(loss="grpo") == (0.2, 0.2)
    assert clips(loss="dapo") == (0.2, 0.28)
    assert clips(loss="gspo") == (3e-4, 4e-4)
    assert trainer(model_dir, loss="dapo", clip_high=0.3).loss_settings.clip_high == 0.3
    assert trainer(model_dir, loss="dapo").overlong_filter
    assert not trainer(model_dir, loss="grpo").overlong_filter
    with pytest.raises(ValueError, match="max_response_tokens.*None"):
        trainer(model_dir, loss="dr_grpo", max_response_tokens=None)
    with pytest.raises(ValueError, match="'ppo'"):
        trainer(model_dir, loss="ppo")
    assert set(LOSSES) == {"grpo", "dr_grpo", "dapo", "gspo"}


def test_finish_step_takes_exactly_one_optimizer_step(model_dir: Path) -> None:
    t = trainer(model_dir, grad_clip=0.0)
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
    for key in ("loss", "logprob_mismatch", "ratio_mean", "entropy", "lr", "torch_threads"):
        assert key in metrics
    assert "kl" not in metrics  # no reference model without kl_coef
    assert 0.0 < metrics["clip_frac_low"] and 0.0 < metrics["clip_frac_high"]
    assert metrics["clip_frac"] == metrics["clip_frac_low"] + metrics["clip_frac_high"] < 1.0
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
    step(t, make_samples(3, seed=8))  # the trainer stays usable
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


def test_weight_buckets_carry_the_hf_state_dict_once_and_bounded(model_dir: Path) -> None:
    t = trainer(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    limit = 20_000
    buckets = list(t.weight_buckets(limit))
    sent = {name: w for bucket in buckets for name, w in bucket}
    assert sent.keys() == hf.keys()  # HF names: no wrapper prefix
    assert len(buckets) > 1
    for bucket in buckets:
        size = sum(w.numel() * w.element_size() for _, w in bucket)
        assert size <= limit or len(bucket) == 1
    live = dict(t.model.named_parameters())
    assert all(not w.requires_grad for w in sent.values())
    assert sent["model.norm.weight"].data_ptr() == live["model.norm.weight"].data_ptr()  # no copy


def test_tied_weights_travel_once_under_the_first_name() -> None:
    embed = torch.nn.Parameter(torch.randn(10, 4))
    named = [("model.embed_tokens.weight", embed), ("model.norm.weight", torch.ones(4)),
             ("lm_head.weight", embed)]
    sent = [name for bucket in bucketed(named, 1000) for name, _ in bucket]
    assert sent == ["model.embed_tokens.weight", "model.norm.weight"]


def test_kl_reference_is_the_initial_model_and_survives_resume(
    model_dir: Path, tmp_path: Path
) -> None:
    samples = make_samples(5, seed=9)
    a = trainer(model_dir, kl_coef=0.1, lr=1e-2)
    step(a, samples)
    assert step(a, samples)["kl"] > 0.0  # the policy moved away from it
    ckpt = tmp_path / "ckpt"
    a.save(ckpt)

    # Resumed from the checkpoint, the reference is still the run's initial model, not
    # the checkpoint's weights (against which the KL would start at 0).
    b = trainer(ckpt, kl_coef=0.1, lr=1e-2)
    b.load(ckpt)
    kl_a, kl_b = step(a, samples)["kl"], step(b, samples)["kl"]
    assert kl_b == pytest.approx(kl_a, rel=1e-6)


def test_kl_is_zero_against_an_identical_reference(model_dir: Path) -> None:
    t = trainer(model_dir, kl_coef=0.1)
    metrics = step(t, make_samples(4, seed=10))
    assert metrics["kl"] == 0.0  # k3 of identical distributions, exactly


def test_torch_threads_apply_on_the_thread_that_runs_the_step(model_dir: Path) -> None:
    """torch stores the count process-wide but OpenMP keeps one per thread, read on a
    thread's first parallel op: a thread that already ran torch at another count keeps
    it unless the trainer sets its own on that thread."""
    def run_torch_at(n: int) -> int:
        torch.set_num_threads(n)
        return torch.get_num_threads()  # the thread's first torch query fixes its count

    t = trainer(model_dir, torch_threads=1)
    with ThreadPoolExecutor(max_workers=1) as pool:
        assert pool.submit(run_torch_at, 2).result() == 2
        torch.set_num_threads(1)  # set from another thread: does not reach the pool's
        assert pool.submit(torch.get_num_threads).result() == 2
        metrics = pool.submit(step, t, make_samples(3, seed=12)).result()
        assert pool.submit(torch.get_num_threads).result() == 1
    assert metrics["torch_threads"] == 1.0


# -- checkpoints ------------------------------------------------------------------------


def test_checkpoint_round_trip_resumes_identically(model_dir: Path, tmp_path: Path) -> None:
    first, second = make_samples(5, seed=6), make_samples(5, seed=7)
    a = trainer(model_dir, weight_decay=0.1)
    ckpt = saved_after_a_step(a, first, tmp_path)

    # A complete HF model directory: weights, config, tokenizer, generation config.
    expected_files = (
        "model.safetensors", "config.json", "tokenizer.json", f"{STATE_DIR}/{META_FILE}"
    )
    for name in (*expected_files, "generation_config.json"):
        assert (ckpt / name).is_file(), name
    assert json.loads((ckpt / "generation_config.json").read_text())["temperature"] == 0.7
    assert AutoTokenizer.from_pretrained(ckpt).convert_tokens_to_ids("t5") == 5
    hf = AutoModelForCausalLM.from_pretrained(ckpt)
    for name, w in weights(a).items():
        assert torch.equal(hf.state_dict()[name], w), name

    b = trainer(ckpt, weight_decay=0.1)
    b.load(ckpt)
    assert b.version == a.version == 1
    for name, w in weights(a).items():
        assert torch.equal(weights(b)[name], w), name
    state_a, state_b = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert state_a["param_groups"] == state_b["param_groups"]
    for idx, sa in state_a["state"].items():
        for key, value in sa.items():
            assert torch.equal(value, state_b["state"][idx][key]), (idx, key)

    step(a, second)
    step(b, second)
    assert a.version == b.version == 2
    for name, w in weights(a).items():
        assert torch.equal(weights(b)[name], w), name

    # The config names the dtype the weights were saved in.
    assert json.loads((ckpt / "config.json").read_text())["dtype"] == "float32"


def test_large_models_are_saved_in_several_files_with_an_index(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from rpk.train import state

    monkeypatch.setattr(state, "HF_SHARD_BYTES", 4096)
    a = trainer(model_dir)
    a.save(tmp_path / "ckpt")
    index = json.loads((tmp_path / "ckpt" / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and not (tmp_path / "ckpt" / "model.safetensors").exists()
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    for name, w in weights(a).items():
        assert torch.equal(hf.state_dict()[name], w), name


def test_one_process_computes_everything_and_says_so_when_asked_for_other_ranks(model_dir: Path) -> None:
    t = trainer(model_dir)
    t.compute_on(None)
    t.compute_on([0])
    with pytest.raises(ValueError, match=r"ranks \[1\], but this trainer computes on rank 0 alone"):
        t.compute_on([1])
