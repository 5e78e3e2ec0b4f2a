"""What a lent GPU can check without vLLM (torch and Triton only, no registry), as one
table, in a few minutes on one GPU. Every check runs rpk's own code around the engine:

- `logprob_kernel`: the fused log-prob head (Triton forward, chunked backward) against
  the naive full-logits reference: values and gradients, relative to their scale;
- `fsdp_step`: a sharded training step over the process group `rpk.gpu.launch.join`
  makes (NCCL on CUDA): FSDP2 with bf16 compute, recomputed layers, deferred reduction
  and its flush, one AdamW step;
- `finish_step`: `TorchTrainer.finish_step` of a sharded trainer on that group: its sums
  over the ranks go through the group's backend for their device (the first optimizer
  step of every multi-GPU run);
- `handoff`: a step, then the hand-off a run makes before vLLM's KV cache wakes (offload
  `none` and `all`): the caching allocator gives back what the step reserved, so the
  memory is free for another process, and the next step equals one that never moved;
- `snapshot`: the weights leaving the trainer after an optimizer step queued on the
  trainer's side stream are the stepped ones;
- `ipc_bucket`: a sync's buckets as CUDA IPC handles to a second process, rebuilt there
  as vLLM 0.32's IPC engine does (handle looked up by the worker's GPU UUID, device index
  replaced), checked tensor by tensor; each bucket is released after the receiver has it,
  so the trainer's GPU never holds more than one bucket in flight;
- `plan_rows`: the memory plan's trainer rows (`rpk.gpu.plan`) against what the code
  allocates (`torch.cuda.max_memory_allocated`) at a real shape (Qwen2.5-1.5B, random
  weights): the train row's peak and the state kept between steps, within 10%;
- `judge_args`: the colocated judge's vLLM arguments (prefetch offload, memory share,
  sleep mode, log-prob mode) against the installed vLLM: its `AsyncEngineArgs` and its
  own validation of the offload section (skip where vLLM is not installed);
- `judge_offload`: the judge's layer pipeline by hand (`bench.gpu_judge`): Qwen2.5-7B's
  layers, half streamed from pinned host memory, unpipelined and pipelined, against the
  cost model behind Figure 13b (`rpk.sim.judge`) and the resident output;
- where vLLM's CUDA build is installed (`bench.gpu_vllm`; skip elsewhere): every engine of
  a 14B elastic judged dry run through vLLM's own config validation on the real CUDA
  platform (`vllm_configs`), an asleep layout's real residue against the plan's price
  (`asleep_residue`), and a judge's wake with streamed layers (`judge_wake`).

One informational row follows, which never fails the run: `mps`, whether CUDA MPS is on
(its control daemon's pipe in CUDA_MPS_PIPE_DIRECTORY, /tmp/nvidia-mps by default, and
the GPUs' compute mode from nvidia-smi). A judge colocated with the rollout runs its
kernels beside the rollout's under MPS; without it they take turns (README, "A judge
beside the rollout").

    python -m bench.gpu_check            # or scripts/gpu_check.sh
    python -m bench.gpu_check --dry      # the same checks on CPU over gloo, tiny shapes

Exit code 1 when a check fails. Without CUDA (and without --dry) every row says skip.
`--dry` runs every check's code path on the CPU: what needs a GPU (memory counts, IPC)
is reported as not measured, and the kernel runs under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import argparse
import functools
import gc
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench import gpu_judge, gpu_vllm
from bench.common import random_qwen2
from bench.gpu_vllm import Skipped
from rpk.core.modes import Offload
from rpk.gpu.device import MPS_PIPE_DEFAULT, mps_on

Row = tuple[str, str, float, str]  # check, ok / FAIL / skip, seconds, detail
CHECKS = ("logprob_kernel", "fsdp_step", "finish_step", "handoff", "snapshot", "ipc_bucket", "plan_rows",
          "lora_rows", "judge_args", "judge_offload", *gpu_vllm.CHECKS)
LORA_RANK = 8
PLAN_TOLERANCE = 0.10
# The plan and LoRA rows on CPU (max_len, micro-batch tokens): the code path runs, nothing
# is measured, so the length only costs time.
DRY_LEN = (256, 512)
# Qwen2.5-1.5B's config.json fields the plan and the model need (hub-free).
QWEN_1_5B = dict(
    architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=1536, intermediate_size=8960,
    num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
    max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
)


@dataclass(frozen=True, slots=True)
class Ctx:
    device: torch.device
    model_dir: Path  # the small model every check but plan_rows trains
    vocab: int
    sharding: object  # this process's rpk.gpu.launch.Sharding (world 1)
    dry: bool

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


def _samples(n: int, length: int, vocab: int, seed: int) -> list:
    from rpk.core.records import TrainSample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        out.append(TrainSample(prompt_ids=tuple(ids[:16]), response_ids=tuple(ids[16:]),
                               old_logprobs=(-8.3,) * (length - 16), advantage=(-1.0) ** i))
    return out


def _trainer(ctx: Ctx, model_dir: Path | None = None, micro_batch_tokens: int = 4096, sharded: bool = True):
    from rpk.train.trainer import TorchTrainer, TrainerSettings

    return TorchTrainer(model_dir or ctx.model_dir, TrainerSettings(lr=1e-3, micro_batch_tokens=micro_batch_tokens),
                        seed=0, device=ctx.device, max_response_tokens=4096,
                        sharding=ctx.sharding if sharded else None)


def _step(trainer, samples: list) -> dict:
    trainer.begin_step()
    trainer.accumulate(samples)
    return dict(trainer.finish_step())


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_logprob_kernel(ctx: Ctx) -> str:
    from rpk.kernels.chunked import reference_token_logprobs_entropy
    from rpk.kernels.logprob import token_logprobs_entropy, triton_available

    if not triton_available():
        raise RuntimeError("triton is not installed")
    n, h, v = (4096, 1024, 65536) if ctx.cuda else (64, 32, 256)
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    g = torch.Generator(device=ctx.device).manual_seed(0)
    hidden = torch.randn(n, h, device=ctx.device, generator=g, dtype=dtype, requires_grad=True)
    weight = (torch.randn(v, h, device=ctx.device, generator=g, dtype=dtype) * 0.02).requires_grad_()
    targets = torch.randint(0, v, (n,), device=ctx.device, generator=g)
    logp, ent = token_logprobs_entropy(hidden, weight, targets, 0.7, impl="triton")
    (logp.sum() + 0.1 * ent.sum()).backward()
    fused = (logp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    ref_logp, ref_ent = reference_token_logprobs_entropy(hidden, weight, targets, 0.7)
    (ref_logp.sum() + 0.1 * ref_ent.sum()).backward()
    ref = (ref_logp.detach(), ref_ent.detach(), hidden.grad, weight.grad)
    # Relative to each output's scale: a bf16 weight gradient summed over 4096 tokens has
    # magnitudes near 10, where one bf16 ulp is 0.06.
    errs = [float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))
            for a, b in zip(fused, ref)]
    limit = 1e-2
    if any(e > limit for e in errs):
        raise AssertionError(f"max relative errors logp/entropy/dh/dw {errs} exceed {limit}")
    return "max rel err logp {:.1e} entropy {:.1e} dh {:.1e} dw {:.1e}".format(*errs)


def check_fsdp_step(ctx: Ctx) -> str:
    from rpk.train import fsdp
    from rpk.train.load import load_policy_model

    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats()
    policy = load_policy_model(ctx.model_dir, torch.float32, ctx.device, ctx.sharding,
                          temperature=1.0, entropy_grad=False, recompute=True)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    length = 512 if ctx.cuda else 128  # on CPU the code path, not the size, is the check
    ids = torch.randint(0, ctx.vocab, (4, length), device=ctx.device)
    rows = torch.arange(4, device=ctx.device).repeat_interleave(length - 1)
    cols = torch.arange(length - 1, device=ctx.device).repeat(4)
    before = [fsdp.full(p).clone() for p in policy.parameters()]
    fsdp.defer_reduction(policy)
    for _ in range(2):  # two micro-batches, reduced once
        logp, _ = policy(ids, rows, cols, ids[:, 1:].reshape(-1))
        (-logp.mean()).backward()
    logp, _ = policy(ids, rows, cols, ids[:, 1:].reshape(-1))
    fsdp.flush(policy, logp.sum() * 0.0)
    norm = float(fsdp.full(torch.nn.utils.clip_grad_norm_(list(policy.parameters()), 1.0)))
    opt.step()
    moved = sum(int(not torch.equal(b, fsdp.full(p))) for b, p in zip(before, policy.parameters()))
    if not (norm > 0 and norm == norm) or moved == 0:
        raise AssertionError(f"grad norm {norm}, {moved} parameters changed")
    peak = f", peak {_gib(torch.cuda.max_memory_allocated())}" if ctx.cuda else ""
    return f"grad norm {norm:.3f}, {moved} params stepped{peak}"


def check_finish_step(ctx: Ctx) -> str:
    trainer = _trainer(ctx)
    if getattr(trainer, "_sharding", None) is None:
        raise AssertionError("the trainer given a Sharding is not sharded: finish_step's sums never cross the group")
    metrics = _step(trainer, _samples(4, 512 if ctx.cuda else 128, ctx.vocab, 1))
    if metrics.get("stepped") != 1.0 or metrics["train_samples"] != 4:
        raise AssertionError(f"finish_step returned {metrics}")
    return f"stepped, {int(metrics['train_tokens'])} tokens summed over the group, grad norm {metrics['grad_norm']:.3f}"


def _cached_bytes() -> tuple[int, int]:
    """(bytes in the allocator's segments that hold no live tensor, free bytes inside
    segments that still hold one)."""
    idle = split = 0
    for segment in torch.cuda.memory_snapshot():
        live = sum(b["size"] for b in segment["blocks"] if b["state"] == "active_allocated")
        if live:
            split += segment["total_size"] - live
        else:
            idle += segment["total_size"]
    return idle, split


def check_handoff(ctx: Ctx) -> str:
    reference, moved = _trainer(ctx), _trainer(ctx)
    n, length = (8, 1024) if ctx.cuda else (2, 128)
    out = []
    for mode in (Offload.NONE, Offload.ALL):
        for t in (reference, moved):
            _step(t, _samples(n, length, ctx.vocab, 2))
        if ctx.cuda:
            torch.cuda.synchronize()
            reserved_after_step = torch.cuda.memory_reserved()
            free_before = torch.cuda.mem_get_info()[0]
        moved.offload(mode)
        if ctx.cuda:
            idle, split = _cached_bytes()
            gained = torch.cuda.mem_get_info()[0] - free_before
            # A segment with no live tensor is what emptying the cache gives back; one that
            # still holds a tensor (the other trainer's, never offloaded) is not
            # releasable by anyone, so its free part is reported, not failed on.
            if idle:
                raise AssertionError(f"offload {mode.value}: the allocator still holds {_gib(idle)} in segments "
                                     f"with no live tensor (vLLM would wake into it)")
            out.append(f"{mode.value}: {_gib(gained)} returned to the device (reserved was "
                       f"{_gib(reserved_after_step)}; {_gib(split)} free inside segments still in use)")
        elif mode is Offload.ALL and any(p.device.type != "cpu" for p in moved.model.parameters()):
            raise AssertionError("offload all left parameters on the device")
    for t in (reference, moved):
        _step(t, _samples(n, length, ctx.vocab, 3))  # `moved` comes back with its first micro-batch
    pairs = zip(reference.model.parameters(), moved.model.parameters())
    diff = max(float((p.detach() - q.detach()).abs().max()) for p, q in pairs)
    # On CUDA two identical trainers differ at float32 rounding (atomics in the backward:
    # 2e-7 seen on an H200); AdamW state lost or stale in the trip would move a
    # parameter by about the learning rate (1e-3).
    limit = 1e-5 if ctx.cuda else 0.0
    if diff > limit:
        raise AssertionError(f"after the hand-off and restore: max param diff {diff} (limit {limit})")
    if not ctx.cuda:
        return "calls ran; next step identical (memory not measured)"
    return "; ".join(out + [f"next step equal (max diff {diff:.1e})"])


def check_snapshot(ctx: Ctx) -> str:
    from rpk.gpu.streams import side_stream_init

    t = _trainer(ctx, sharded=False)
    init = side_stream_init(str(ctx.device))
    if init is None:
        return "no side stream on CPU (nothing to order)"
    out: dict[str, object] = {}

    def on_trainer_thread() -> None:
        init()
        _step(t, _samples(8, 1024, ctx.vocab, 3))  # queued on the side stream; no wait here
        out["buckets"] = t.weight_buckets(2**20)

    thread = threading.Thread(target=on_trainer_thread)
    thread.start()
    thread.join()
    with torch.cuda.stream(torch.cuda.Stream()):  # read as the engine does: another stream
        sent = {n: x.clone() for b in out["buckets"] for n, x in b}  # type: ignore[attr-defined]
    torch.cuda.synchronize()
    final = {n: p.detach() for n, p in t.model.named_parameters()}
    stale = [n for n, x in sent.items() if n in final and not torch.equal(x, final[n])]
    if stale or not sent:
        raise AssertionError(f"{len(stale)} of {len(sent)} tensors left before the step finished: {stale[:3]}")
    return f"{len(sent)} tensors, all the stepped weights"


def _ipc_receiver(inbox, outbox) -> None:
    """vLLM 0.32's IPC engine, receive side (`ipc_engine.py` receive_weights, unpacked):
    the handle is looked up by this process's GPU UUID and rebuilt on its device index."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    device = torch.cuda.current_device()
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    while (message := inbox.get()) is not None:
        sums = []
        for handles in message:
            if uuid not in handles:
                outbox.put(f"IPC handle not found for GPU UUID {uuid}; available {list(handles)}")
                break
            args = list(handles[uuid])
            args[6] = device
            sums.append(float(rebuild_cuda_tensor(*args).double().sum()))
        else:
            torch.cuda.synchronize()
            outbox.put(sums)


def check_ipc_bucket(ctx: Ctx) -> str:
    if not ctx.cuda:
        return "not measured on CPU (CUDA IPC)"
    import torch.multiprocessing as mp
    from torch.multiprocessing.reductions import reduce_tensor

    trainer = _trainer(ctx, sharded=False)
    uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    spawn = mp.get_context("spawn")
    inbox, outbox = spawn.Queue(), spawn.Queue()
    receiver = spawn.Process(target=_ipc_receiver, args=(inbox, outbox), daemon=True)
    receiver.start()
    try:
        torch.cuda.synchronize()
        base, worst, n, bucket_bytes = torch.cuda.memory_allocated(), 0, 0, 2**20
        for bucket in trainer.weight_buckets(bucket_bytes):
            # As a sharded sync's buckets: fresh bf16 copies, the engine's dtype.
            tensors = [t.detach().to(torch.bfloat16).contiguous() for _, t in bucket]
            torch.cuda.synchronize()
            inbox.put([{uuid: reduce_tensor(t)[1]} for t in tensors])
            got = outbox.get(timeout=60)
            if isinstance(got, str):
                raise AssertionError(got)
            want = [float(t.double().sum()) for t in tensors]
            if got != want:
                raise AssertionError(f"bucket {n}: received sums {got[:3]} != sent {want[:3]}")
            worst = max(worst, torch.cuda.memory_allocated() - base)
            del tensors
            torch.cuda.ipc_collect()  # the receiver let go: its shared blocks can be freed
            n += 1
        torch.cuda.synchronize()
        left = torch.cuda.memory_allocated() - base
    finally:
        inbox.put(None)
        receiver.join(timeout=30)
        if receiver.is_alive():
            receiver.kill()
    if left > bucket_bytes:
        raise AssertionError(f"{_gib(left)} still allocated after the sync's {n} buckets")
    return f"{n} buckets rebuilt and equal; at most {worst / 2**20:.1f} MiB in flight, {left} B left after"


def _plan_for(model_dir: Path, max_len: int, micro_batch_tokens: int, gpu_bytes: int, lora_rank: int = 0):
    from rpk.gpu.plan import Knobs, ModelShape, Phase, Target, plan_memory

    shape = ModelShape.from_hf(json.loads((model_dir / "config.json").read_text()))
    plan = plan_memory(shape, Target(nodes=1, gpus_per_node=1, gpu_bytes=gpu_bytes),
                       Knobs(max_model_len=max_len, micro_batch_tokens=micro_batch_tokens,
                             offload=Offload.NONE, defer_reduction=True, lora_rank=lora_rank,
                             lora_slot_rank=lora_rank))
    train = next(p for p in plan.phases if p.phase is Phase.TRAIN)
    # The CUDA context is the process's, not the allocator's: memory_allocated never sees it.
    trainer = sum(r.bytes for r in train.residents if r.owner == "trainer" and r.name != "context")
    names = ("base", "adapters", "adapter_adamw") if lora_rank else ("params", "adamw")
    return trainer, sum(train.bytes_of("trainer", n) for n in names)


def _at_peak(snapshot: dict) -> list[dict]:
    """The blocks live at the traced peak, largest first, each with the first frames in
    rpk's code or torch's below it: where the plan's rows and the code part ways."""
    live: dict[int, dict] = {}
    total = peak = 0
    at_peak: list[dict] = []
    for e in snapshot["device_traces"][0]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > peak:
                peak, at_peak = total, list(live.values())
        elif e["action"] in ("free_completed",) and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
    rows = []
    for e in sorted(at_peak, key=lambda e: -e["size"])[:40]:
        frames = [f"{Path(f['filename']).name}:{f['line']}:{f['name']}" for f in e.get("frames", [])
                  if "/rpk/" in f["filename"] or "/torch/" in f["filename"]][:6]
        rows.append({"mib": round(e["size"] / 2**20, 1), "frames": frames})
    return [{"traced_peak_gib": round(peak / 2**30, 3)}, *rows]


def check_plan_rows(ctx: Ctx, big_dir: Path | None, trace_to: Path | None = None) -> str:
    model_dir, max_len, tokens = (big_dir, 4096, 8192) if ctx.cuda and big_dir else (ctx.model_dir, *DRY_LEN)
    planned_peak, planned_state = _plan_for(model_dir, max_len, tokens, 141 * 10**9)
    if not ctx.cuda:
        _step(_trainer(ctx, model_dir, tokens), _samples(2, max_len, ctx.vocab, 4))
        return f"plan: train {_gib(planned_peak)}, state {_gib(planned_state)} (not measured on CPU)"
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    trainer = _trainer(ctx, model_dir, tokens)
    torch.cuda.memory._record_memory_history(max_entries=200_000)
    _step(trainer, _samples(4, max_len, 151936, 4))  # two micro-batches of 8192 tokens
    if trace_to is not None:
        try:
            peak_rows = _at_peak(torch.cuda.memory._snapshot())
        except Exception as e:  # a diagnostic: it must not fail the check it explains
            peak_rows = [{"error": f"{type(e).__name__}: {e}"}]
        trace_to.write_text(json.dumps(peak_rows, indent=1))
    torch.cuda.memory._record_memory_history(enabled=None)
    trainer.offload(Offload.NONE)  # the gradients go, the state stays
    torch.cuda.synchronize()
    peak, state = torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base
    off = {name: (got - want) / want for name, got, want in
           (("train", peak, planned_peak), ("state", state, planned_state))}
    detail = ", ".join(f"{n}: code {_gib(g)} plan {_gib(w)} ({off[n]:+.1%})" for n, g, w in
                       (("train", peak, planned_peak), ("state", state, planned_state)))
    if any(abs(v) > PLAN_TOLERANCE for v in off.values()):
        raise AssertionError(f"plan off by more than {PLAN_TOLERANCE:.0%}: {detail}")
    return detail


def check_lora_rows(ctx: Ctx, big_dir: Path | None) -> str:
    """A LoRA step as a GPU plan makes it (the frozen base in bf16, rank 8 on every
    linear layer): only the adapters move, and the allocator's peak and the state left
    after it against the plan's LoRA rows."""
    from rpk.train.lora import LoraSettings
    from rpk.train.trainer import TorchTrainer, TrainerSettings

    model_dir, max_len, tokens = (big_dir, 4096, 8192) if ctx.cuda and big_dir else (ctx.model_dir, *DRY_LEN)
    planned_peak, planned_state = _plan_for(model_dir, max_len, tokens, 141 * 10**9, LORA_RANK)
    if ctx.cuda:
        gc.collect()  # the checks before leave trainers in reference cycles; their memory is not the step's
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if ctx.cuda else 0
    trainer = TorchTrainer(model_dir, TrainerSettings(lr=1e-3, micro_batch_tokens=tokens), seed=0,
                           device=ctx.device, max_response_tokens=4096, sharding=ctx.sharding,
                           dtype="bfloat16" if ctx.cuda else "float32",
                           adapters=LoraSettings(rank=LORA_RANK, alpha=16.0))

    def local(t: torch.Tensor) -> torch.Tensor:
        return (t.to_local() if hasattr(t, "to_local") else t).detach().float().clone()

    named = dict(trainer.model.named_parameters())
    trained = {n for n, p in named.items() if p.requires_grad}
    if not trained or any("lora_" not in n for n in trained):
        raise AssertionError(f"trainable beyond the adapters: {sorted(n for n in trained if 'lora_' not in n)[:4]}")
    frozen = next(n for n in named if "lora_" not in n and n.endswith("q_proj.base_layer.weight"))
    lora_b = next(n for n in trained if "lora_B" in n)
    before = {n: local(named[n]) for n in (frozen, lora_b)}
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    stats = _step(trainer, _samples(4, max_len, vocab, 5))
    moved = {n: float((local(named[n]) - before[n]).abs().max()) for n in before}
    if moved[frozen] != 0.0 or moved[lora_b] == 0.0:
        raise AssertionError(f"after a step: frozen {frozen} moved {moved[frozen]:.2e}, "
                             f"adapter {lora_b} moved {moved[lora_b]:.2e}")
    detail = f"{len(trained)} adapter tensors stepped, base still; grad norm {stats.get('grad_norm', 0.0):.3f}"
    if not ctx.cuda:
        return f"{detail}; plan: train {_gib(planned_peak)}, state {_gib(planned_state)} (not measured on CPU)"
    trainer.offload(Offload.NONE)  # the gradients go, the state stays
    torch.cuda.synchronize()
    peak, state = torch.cuda.max_memory_allocated() - base, torch.cuda.memory_allocated() - base
    off = {n: (got - want) / want for n, got, want in (("train", peak, planned_peak), ("state", state, planned_state))}
    detail += ", " + ", ".join(f"{n}: code {_gib(g)} plan {_gib(w)} ({off[n]:+.1%})" for n, g, w in
                               (("train", peak, planned_peak), ("state", state, planned_state)))
    if any(abs(v) > PLAN_TOLERANCE for v in off.values()):
        raise AssertionError(f"plan off by more than {PLAN_TOLERANCE:.0%}: {detail}")
    return detail


def _big_model(directory: Path) -> Path:
    """Qwen2.5-1.5B's shape with random weights, saved as the trainer loads a model."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    directory.mkdir(parents=True)
    config = Qwen2Config(**{k: v for k, v in QWEN_1_5B.items() if k not in ("architectures", "model_type")})
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.bfloat16)
    model.save_pretrained(directory)
    del model
    torch.cuda.empty_cache()
    return directory


def _join(cuda: bool):
    """This process as rank 0 of 1, joined as `rpk.run` joins its ranks."""
    import socket

    from rpk.gpu.launch import join
    from rpk.gpu.layout import ParallelLayout

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return join(ParallelLayout(), timeout_s=120)


def check_judge_args(ctx: Ctx) -> str:
    try:
        import vllm
        from vllm.config.offload import OffloadConfig, PrefetchOffloadConfig
        from vllm.engine.arg_utils import AsyncEngineArgs

        from rpk.engine.vllm_settings import engine_kwargs
    except ImportError as e:
        raise Skipped(f"no vLLM here ({e})") from None
    from rpk.judge.vllm import JudgeDevice, judge_vllm_settings
    from rpk.reward.judge import JudgeSettings

    # A 7B judge beside the rollout: a quarter of each GPU, half its 28 layers streamed.
    device = JudgeDevice(gpu_memory_utilization=0.25, layers=28, offloaded=14)
    kwargs = engine_kwargs(judge_vllm_settings(JudgeSettings(model="judge"), ctx.model_dir, 0, device), cuda=True)
    unknown = set(kwargs) - set(inspect.signature(AsyncEngineArgs).parameters)
    if unknown:
        raise AssertionError(f"vLLM {vllm.__version__}'s AsyncEngineArgs has no {sorted(unknown)}")
    AsyncEngineArgs(**kwargs)  # type: ignore[arg-type]
    prefetch = {k: v for k, v in kwargs.items() if k.startswith("offload_") and k != "offload_backend"}
    OffloadConfig(offload_backend=kwargs["offload_backend"], prefetch=PrefetchOffloadConfig(**prefetch))
    return (f"vLLM {vllm.__version__}: {len(kwargs)} arguments accepted; offload "
            f"{kwargs['offload_backend']}, groups of {kwargs['offload_group_size']} streaming "
            f"{kwargs['offload_num_in_group']}")


def mps_row(pipe_dir: Path, smi: str | None) -> Row:
    """Whether the MPS control daemon runs (its `control` pipe in `pipe_dir`), and the
    compute mode nvidia-smi (`smi`, None when absent) reports: information, never a
    failure, as rpk runs with MPS off too."""
    started = time.perf_counter()
    control = pipe_dir / "control"
    on = mps_on(pipe_dir)
    detail = f"{'on' if on else 'off'}: {'a' if on else 'no'} control pipe at {control}"
    if smi is None:
        detail += "; no nvidia-smi"
    else:
        try:
            done = subprocess.run([smi, "--query-gpu=compute_mode", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=30)
            modes = sorted(set(done.stdout.split())) if done.returncode == 0 else []
            detail += f"; compute mode {', '.join(modes)}" if modes else f"; nvidia-smi exit {done.returncode}"
        except (OSError, subprocess.TimeoutExpired) as e:
            detail += f"; nvidia-smi failed: {type(e).__name__}"
    if not on:
        detail += " (start it with nvidia-cuda-mps-control -d)"
    return ("mps", "info", time.perf_counter() - started, detail)


def run_checks(dry: bool = False, trace_to: Path | None = None) -> list[Row]:
    cuda = torch.cuda.is_available() and not dry
    if not cuda and not dry:
        return [(name, "skip", 0.0, "no CUDA device") for name in CHECKS]
    joined = _join(cuda)
    rows: list[Row] = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = random_qwen2(Path(tmp) / "model")
            ctx = Ctx(torch.device("cuda" if cuda else "cpu"), model_dir, 4096, joined.sharding, dry)
            big: list[Path] = []
            checks: list[tuple[str, Callable[[], str]]] = [
                ("logprob_kernel", lambda: check_logprob_kernel(ctx)),
                ("fsdp_step", lambda: check_fsdp_step(ctx)),
                ("finish_step", lambda: check_finish_step(ctx)),
                ("handoff", lambda: check_handoff(ctx)),
                ("snapshot", lambda: check_snapshot(ctx)),
                ("ipc_bucket", lambda: check_ipc_bucket(ctx)),
                ("plan_rows", lambda: check_plan_rows(ctx, big[0] if big else None, trace_to)),
                ("lora_rows", lambda: check_lora_rows(ctx, big[0] if big else None)),
                ("judge_args", lambda: check_judge_args(ctx)),
                ("judge_offload", lambda: gpu_judge.check(ctx.dry)),
                *((name, functools.partial(check, ctx.dry)) for name, check in gpu_vllm.CHECKS.items()),
            ]
            for name, fn in checks:
                if name == "plan_rows" and cuda:
                    big.append(_big_model(Path(tmp) / "qwen2.5-1.5b"))
                started = time.perf_counter()
                try:
                    status, detail = "ok", fn()
                except Skipped as e:
                    status, detail = "skip", str(e)
                except Exception as e:  # each check fails alone, in its row
                    status, detail = "FAIL", f"{type(e).__name__}: {e}"
                rows.append((name, status, time.perf_counter() - started, detail))
                if cuda:
                    torch.cuda.empty_cache()
    finally:
        joined.close()
    return rows


def table(rows: list[Row], dry: bool = False) -> str:
    device = "dry run on CPU" if dry else torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA"
    head = f"gpu_check: torch {torch.__version__}, {device}"
    width = max(len(r[0]) for r in rows)
    lines = [head, f"{'check'.ljust(width)}  result  seconds  detail"]
    lines += [f"{n.ljust(width)}  {s.ljust(6)}  {t:7.1f}  {d}" for n, s, t, d in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--dry", action="store_true", help="run the checks' code on CPU over gloo, tiny shapes")
    ap.add_argument("--peak", help="CUDA: write plan_rows' blocks live at the step's peak (JSON) here")
    args = ap.parse_args(argv)
    if args.dry and os.environ.get("TRITON_INTERPRET") != "1":
        # Triton reads it when it is imported, which torch may already have done.
        argv = sys.argv[1:] if argv is None else argv
        os.execve(sys.executable, [sys.executable, "-m", "bench.gpu_check", *argv],
                  {**os.environ, "TRITON_INTERPRET": "1"})
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rows = run_checks(args.dry, Path(args.peak) if args.peak else None)
    rows.append(mps_row(Path(os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_PIPE_DEFAULT),
                        shutil.which("nvidia-smi")))
    print(table(rows, args.dry))
    if args.json:
        Path(args.json).write_text(json.dumps([dict(zip(("check", "result", "s", "detail"), r)) for r in rows]))
    return 1 if any(r[1] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
