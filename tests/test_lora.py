"""LoRA in the trainer (`rpk.train.lora`), single process: only the adapters get
gradients and optimizer state, the base never moves, the KL reference is the base with
the adapters off, and what leaves the trainer is the adapter, PEFT-named."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from rpk.core.records import TrainSample
from rpk.train import lora
from rpk.train.losses import LOSSES
from rpk.train.trainer import TorchTrainer, TrainerSettings
from tests.trainers import make_samples, saved_after_a_step, step

pytestmark = pytest.mark.usefixtures("restore_torch_threads")

LORA = lora.LoraSettings(rank=4, alpha=8.0)


def lora_trainer(
    model_dir: Path, adapters: lora.LoraSettings | None = LORA, dtype: torch.dtype = torch.float32,
    **overrides: object,
) -> TorchTrainer:
    settings: dict[str, object] = dict(lr=1e-2, micro_batch_tokens=10_000, torch_threads=1, grad_clip=0.0)
    settings.update(overrides)
    return TorchTrainer(
        model_dir, TrainerSettings(**settings), max_response_tokens=12,  # type: ignore[arg-type]
        temperature=0.7, seed=0, adapters=adapters, dtype=dtype,
    )


def base_weights(t: TorchTrainer) -> dict[str, torch.Tensor]:
    return {n: w.detach().clone() for n, w in t._policy.state_dict().items() if not lora.is_adapter_name(n)}


def adapter_weights(t: TorchTrainer) -> dict[str, torch.Tensor]:
    return {n: w.detach().clone() for bucket in t.weight_buckets(1 << 30) for n, w in bucket}


def logprobs(policy: torch.nn.Module, samples: Sequence[TrainSample]) -> torch.Tensor:
    """Every response token's log-prob under `policy`, row by row."""
    out = []
    for s in samples:
        seq = torch.tensor([s.prompt_ids + s.response_ids])
        cols = torch.arange(len(s.prompt_ids) - 1, len(seq[0]) - 1)
        rows = torch.zeros_like(cols)
        out.append(policy(seq, rows, cols, seq[0, cols + 1])[0].detach())
    return torch.cat(out)


def test_only_the_adapters_get_gradients_and_optimizer_state(model_dir: Path) -> None:
    t = lora_trainer(model_dir)
    trainable = {n for n, p in t._policy.named_parameters() if p.requires_grad}
    assert trainable and all(lora.is_adapter_name(n) for n in trainable)
    # all-linear: every projection of every layer, never the LM head or the embedding.
    projections = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert {n.split(".")[-4] for n in trainable} == projections
    optimised = {id(p) for g in t.optimizer.param_groups for p in g["params"]}
    assert optimised == {id(p) for p in t._policy.parameters() if p.requires_grad}

    base, adapter = base_weights(t), adapter_weights(t)
    t.begin_step()
    t.accumulate(make_samples(6, seed=1))
    with_grad = {n for n, p in t._policy.named_parameters() if p.grad is not None}
    assert with_grad == trainable
    metrics = dict(t.finish_step())
    assert metrics["stepped"] == 1.0
    assert {id(p) for p in t.optimizer.state} <= optimised and t.optimizer.state

    after = base_weights(t)
    assert after.keys() == base.keys()
    for name in base:
        assert torch.equal(after[name], base[name]), f"the frozen base moved: {name}"
    moved = adapter_weights(t)
    assert any(not torch.equal(moved[n], adapter[n]) for n in adapter if ".lora_B." in n)


def test_adapters_start_as_the_base_model_and_leave_peft_named(model_dir: Path) -> None:
    t, base = lora_trainer(model_dir), lora_trainer(model_dir, adapters=None)
    samples = make_samples(4, seed=2)
    # B starts at zero: before the first step the adapted model is the base, exactly.
    assert torch.equal(logprobs(t._policy, samples), logprobs(base._policy, samples))
    names = list(adapter_weights(t))
    assert names and all(n.startswith("base_model.model.model.layers.") for n in names)
    assert all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in names)
    # The frozen base is the HF model's weights, wrapped (`base_layer`) where adapted.
    hf = {n.removeprefix("lm.base_model.model.").replace(".base_layer.", ".") for n in base_weights(t)}
    assert hf == set(base.model.state_dict())


def test_kl_reference_is_the_base_with_adapters_off(model_dir: Path) -> None:
    t, base = lora_trainer(model_dir, kl_coef=0.1, lr=5e-2), lora_trainer(model_dir, adapters=None)
    samples = make_samples(6, seed=3)
    first = step(t, samples)
    assert first["kl"] == 0.0  # B was zero: the policy was its own reference
    for _ in range(2):
        step(t, samples)

    want = logprobs(base._policy, samples)
    with lora.adapters_off(t._policy.lm):
        got = logprobs(t._policy, samples)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    adapted = logprobs(t._policy, samples)
    assert not torch.allclose(adapted, want, atol=1e-4)  # the adapters did move the policy
    assert step(t, samples)["kl"] > 0.0
    # Switching them off for the reference left them trainable.
    assert all(p.requires_grad for n, p in t._policy.named_parameters() if lora.is_adapter_name(n))
    assert t._reference is t._policy  # no second model


def test_lora_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="rank must be > 0, got 0"):
        lora.LoraSettings(rank=0, alpha=8.0)
    config = lora.adapter_config(lora.LoraSettings(rank=8, alpha=16.0, targets=("q_proj", "v_proj")), "/m")
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (8, 16.0, ["q_proj", "v_proj"])
    assert config["base_model_name_or_path"] == "/m" and config["peft_type"] == "LORA"


def test_checkpoint_holds_the_peft_adapter_and_resumes_exactly(model_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    first, second = make_samples(6, seed=4), make_samples(6, seed=5)
    a = lora_trainer(model_dir, weight_decay=0.1)
    ckpt = saved_after_a_step(a, first, tmp_path)
    assert {p.name for p in ckpt.iterdir()} == {"adapter_config.json", "adapter_model.safetensors", "trainer"}
    assert lora.base_of(ckpt) == model_dir.resolve()
    # DCP holds the adapters and their AdamW state, not the frozen base.
    from torch.distributed.checkpoint import FileSystemReader

    keys = set(FileSystemReader(str(ckpt / "trainer")).read_metadata().state_dict_metadata)
    assert any(".lora_A." in k for k in keys) and not any("base_layer" in k or "embed_tokens" in k for k in keys)

    # PEFT loads the adapter on the base as the trainer's policy computes it.
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), ckpt).eval()
    probe = make_samples(3, seed=8)
    with torch.no_grad():
        for s in probe:
            seq = torch.tensor([s.prompt_ids + s.response_ids])
            torch.testing.assert_close(peft(seq).logits, a.model(seq).logits, rtol=1e-5, atol=1e-6)

    b = lora_trainer(model_dir, weight_decay=0.1)
    b.load(ckpt)
    assert b.version == 1
    step(a, second)
    step(b, second)  # the same update: weights, AdamW moments and RNG came back
    want, got = adapter_weights(a), adapter_weights(b)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_merge_writes_an_hf_model_equal_to_base_plus_adapter(model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    from rpk.checkpoint import main

    t = lora_trainer(model_dir, lr=5e-2)
    for seed in (1, 2):
        step(t, make_samples(6, seed=seed))
    t.save(tmp_path / "ckpt")
    assert main(["merge", str(tmp_path / "ckpt"), str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any("lora" in n for n in merged.state_dict())
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    base = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    seq = torch.tensor([make_samples(1, seed=9)[0].prompt_ids])
    with torch.no_grad():
        want, got, before = t.model(seq).logits, merged(seq).logits, base(seq).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(before, want, atol=1e-4)  # the adapter is in the merge
    assert main(["merge", str(tmp_path / "nothing"), str(tmp_path / "out")]) == 2


def test_lora_config_fields_and_what_is_refused_with_them() -> None:
    from rpk.assembly.settings import fingerprint, lora_settings, trainer_settings
    from rpk.config import ConfigError, from_argv
    from rpk.sync.adapter import max_lora_rank

    cfg = from_argv(["--model.lora_rank", "8", "--model.lora_targets", "q_proj,v_proj"])
    assert lora_settings(cfg.model) == lora.LoraSettings(rank=8, alpha=16.0, targets=("q_proj", "v_proj"))
    assert trainer_settings(cfg.train, lora=True).lr == cfg.train.lora_lr == 10 * cfg.train.lr
    assert fingerprint(cfg)["model.lora"] == "rank 8, alpha 16.0, targets q_proj,v_proj"
    assert fingerprint(from_argv([]))["model.lora"] == "off"
    plain = from_argv([])
    assert lora_settings(plain.model) is None and trainer_settings(plain.train, lora=False).lr == 5e-5
    assert [max_lora_rank(r) for r in (1, 2, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]

    for argv, words in (
        (["--model.lora_rank", "513"], "lora_rank"),
        (["--model.lora_rank", "-1"], "lora_rank"),
        (["--model.lora_dropout", "1.0"], "lora_dropout"),
        (["--model.lora_targets", "all-linear,q_proj"], "lora_targets"),
        (["--model.lora_rank", "8", "--train.stream_mode", "borrow"], "borrow"),
        (["--model.lora_rank", "8", "--rollout.tp", "elastic"], "tp_switch restart"),
        (["--model.lora_rank", "8", "--rollout.weight_transfer", "m2n"], "m2n"),
    ):
        with pytest.raises(ConfigError, match=words):
            from_argv(argv)
    from_argv(["--model.lora_rank", "8", "--rollout.tp", "elastic", "--rollout.tp_switch", "restart"])


def test_lora_dropout_runs_on_the_adapters_alone(model_dir: Path) -> None:
    t = lora_trainer(model_dir, adapters=lora.LoraSettings(rank=4, alpha=8.0, dropout=0.5))
    training = {n for n, m in t._policy.lm.named_modules() if m.training}
    assert training and all(n.endswith("lora_dropout.default") for n in training)
    assert not lora_trainer(model_dir)._policy.lm.training  # no dropout asked: all in eval


@pytest.mark.parametrize("loss", sorted(LOSSES))
def test_every_loss_updates_the_adapters_independently_of_split_and_packing(model_dir: Path, loss: str) -> None:
    """Streamed chunks in any order and any micro-batch budget give the step one
    whole batch gives (float64, where the plain log-softmax path stands in for the
    fused kernel as it does for full fine-tuning)."""
    samples = make_samples(10, seed=11)
    whole = lora_trainer(model_dir, loss=loss, kl_coef=0.05, dtype=torch.float64)
    step(whole, samples)
    streamed = lora_trainer(model_dir, loss=loss, kl_coef=0.05, dtype=torch.float64, micro_batch_tokens=40)
    streamed.begin_step()
    for chunk in (samples[7:], samples[:3], samples[3:7]):
        streamed.accumulate(chunk)
    streamed.finish_step()
    want, got = adapter_weights(whole), adapter_weights(streamed)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12, msg=name)
    assert any(not torch.equal(w, lora_trainer(model_dir, dtype=torch.float64).model.state_dict()[k])
               for k, w in whole.model.state_dict().items() if ".lora_B." in k)


def test_adapters_and_their_moments_are_float32_beside_a_bf16_base_under_fsdp2(model_dir: Path) -> None:
    """A GPU plan loads a LoRA run's frozen base in bf16; the adapters stay float32 (bf16
    AdamW moments lose a long run's small updates). FSDP2 asks one dtype of a group's
    trainable parameters only: a layer group mixing the bf16 base and float32 adapters
    all-gathers, reduces its gradients in float32 and steps (a one-rank gloo group, in a
    process of its own)."""
    t = lora_trainer(model_dir, dtype=torch.bfloat16)
    dtypes = {lora.is_adapter_name(n): p.dtype for n, p in t._policy.named_parameters()}
    assert dtypes == {True: torch.float32, False: torch.bfloat16}
    code = """
import os, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
class Layer(torch.nn.Module):  # a frozen bf16 linear and its float32 adapter pair
    def __init__(self):
        super().__init__()
        self.base = torch.nn.Linear(8, 8, bias=False).to(torch.bfloat16).requires_grad_(False)
        self.a, self.b = torch.nn.Linear(8, 2, bias=False), torch.nn.Linear(2, 8, bias=False)

    def forward(self, x):
        return self.base(x) + self.b(self.a(x))

layer = Layer()
fully_shard(layer, mesh=init_device_mesh("cpu", (1,)),
            mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
opt = torch.optim.AdamW([layer.a.weight, layer.b.weight])
layer(torch.randn(3, 8)).float().sum().backward()
opt.step()
assert layer.a.weight.grad.dtype == torch.float32 and layer.base.weight.grad is None
assert {v.dtype for s in opt.state.values() for v in s.values()} == {torch.float32}
dist.destroy_process_group()
"""
    import subprocess
    import sys

    from tests.dist_harness import free_port

    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PORT": str(free_port())},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]

