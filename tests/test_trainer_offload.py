"""The trainer's memory moves (rpk.train.offload) on the CPU: offload and restore run for
real and leave training unchanged; recomputed layers give the same gradients."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from rpk.core.modes import Offload
from rpk.train.trainer import TorchTrainer
from tests.trainers import make_samples, trainer


def _samples():
    return make_samples(6, seed=3)


def _step(trainer: TorchTrainer, offload: Offload | None = None) -> dict[str, float]:
    trainer.begin_step()
    if offload is not None:
        trainer.offload(offload)
        assert trainer.offloaded == offload
        assert all(p.grad is None for p in trainer.model.parameters())
    trainer.accumulate(_samples())
    assert trainer.offloaded is Offload.NONE  # the first micro-batch brought it back
    return dict(trainer.finish_step())


@pytest.mark.parametrize("what", list(Offload))
def test_offload_and_restore_leave_training_unchanged(model_dir: Path, what: Offload) -> None:
    plain, moved = trainer(model_dir), trainer(model_dir)
    for _ in range(2):
        a, b = _step(plain), _step(moved, what)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6) and a["stepped"] == 1.0
    for (n, p), (_, q) in zip(plain.model.named_parameters(), moved.model.named_parameters()):
        torch.testing.assert_close(p, q, msg=n)
    assert moved.optimizer.state  # AdamW's moments survived the trip


def test_offload_twice_is_refused(model_dir: Path) -> None:
    t = trainer(model_dir)
    t.offload(Offload.OPTIMIZER)
    with pytest.raises(RuntimeError, match="already offloaded"):
        t.offload(Offload.ALL)
    t.restore()
    t.offload(Offload.ALL)


def test_recomputed_layers_give_the_same_gradients(model_dir: Path, monkeypatch) -> None:
    from rpk.train import offload

    calls = []
    real = offload.checkpoint
    monkeypatch.setattr(offload, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    grads = []
    for recompute in (False, True):
        t = trainer(model_dir, activation_checkpointing=recompute)
        t.begin_step()
        t.accumulate(_samples())
        grads.append({n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None})
        t.abandon_step()
    assert len(calls) >= 2  # one per decoder layer and micro-batch, only when asked
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for n in grads[0]:
        torch.testing.assert_close(grads[0][n], grads[1][n], msg=n)


@pytest.mark.parametrize("tokens", [True, False])
def test_finish_step_hands_the_cache_back_after_the_optimizer_step(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, tokens: bool
) -> None:
    """vLLM's weights wake next, into what the step's activations and gradients reserved;
    a step with nothing to normalise by (no optimizer step) hands it back too."""
    t = trainer(model_dir)
    order: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: order.append("empty_cache"))
    step = t.optimizer.step
    monkeypatch.setattr(t.optimizer, "step", lambda *a, **k: order.append("step") or step(*a, **k))
    t.begin_step()
    samples = _samples()
    untrained = [dataclasses.replace(s, loss_mask=(0,) * len(s.response_ids)) for s in samples]
    t.accumulate(samples if tokens else untrained)
    order.clear()
    assert t.finish_step()["stepped"] == float(tokens)
    assert order == (["step", "empty_cache"] if tokens else ["empty_cache"])
