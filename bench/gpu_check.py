"""What can be checked on a lent GPU without vLLM (torch and Triton only, no registry),
in a few minutes, as one table:

- `logprob_kernel`: the fused log-prob head compiled for CUDA (Triton forward, chunked
  backward) against the naive full-logits reference, values and gradients;
- `fsdp_step`: a sharded training step on one rank over NCCL: FSDP2 with bf16 compute,
  recomputed layers, deferred reduction and its flush, one AdamW step;
- `offload`: the trainer's state to host and back (`TorchTrainer.offload`): the device
  memory it frees, and a step after it equal to one that never moved;
- `snapshot`: the weights leaving the trainer after an optimizer step queued on the
  trainer's side stream are the stepped ones (`weight_buckets` waits for the stream).

    python -m bench.gpu_check            # or scripts/gpu_check.sh

On a machine without CUDA every row says skip and the exit code is 0.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch

Row = tuple[str, str, float, str]  # check, ok / FAIL / skip, seconds, detail


def _tiny_model(directory: Path, hidden: int = 256, layers: int = 4, vocab: int = 4096) -> Path:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=2, intermediate_size=4 * hidden,
                         max_position_embeddings=4096, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tok = Tokenizer(WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(directory)
    return directory


def _samples(n: int, length: int, vocab: int, seed: int) -> list:
    from rpk.core.records import TrainSample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        ids = torch.randint(0, vocab, (length,), generator=g).tolist()
        out.append(TrainSample(prompt_ids=tuple(ids[:16]), response_ids=tuple(ids[16:]),
                               old_logprobs=(-8.3,) * (length - 16), advantage=(-1.0) ** i))
    return out


def check_logprob_kernel() -> str:
    from rpk.kernels.chunked import reference_token_logprobs_entropy
    from rpk.kernels.logprob import token_logprobs_entropy, triton_available

    if not triton_available():
        raise RuntimeError("triton is not installed")
    g = torch.Generator(device="cuda").manual_seed(0)
    n, h, v = 4096, 1024, 65536
    hidden = torch.randn(n, h, device="cuda", generator=g, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(v, h, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02).requires_grad_()
    targets = torch.randint(0, v, (n,), device="cuda", generator=g)
    logp, ent = token_logprobs_entropy(hidden, weight, targets, 0.7, impl="triton")
    (logp.sum() + 0.1 * ent.sum()).backward()
    fused = (logp.detach(), ent.detach(), hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    ref_logp, ref_ent = reference_token_logprobs_entropy(hidden, weight, targets, 0.7)
    (ref_logp.sum() + 0.1 * ref_ent.sum()).backward()
    ref = (ref_logp.detach(), ref_ent.detach(), hidden.grad, weight.grad)
    errs = [float((a.float() - b.float()).abs().max()) for a, b in zip(fused, ref)]
    limits = (2e-2, 2e-2, 2e-2, 2e-2)  # bf16 inputs, float32 accumulation in both
    if any(e > lim for e, lim in zip(errs, limits)):
        raise AssertionError(f"max abs errors logp/entropy/dh/dw {errs} exceed {limits}")
    return "max abs err logp {:.1e} entropy {:.1e} dh {:.1e} dw {:.1e}".format(*errs)


def check_fsdp_step(model_dir: Path) -> str:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rpk.train import fsdp
    from rpk.gpu.launch import Sharding
    from rpk.train.load import build_policy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("shard",))
        # The sharded load (meta skeleton, to_empty, rank 0's weights broadcast over NCCL),
        # as a trainer of several ranks builds it, on one.
        sharding = Sharding(mesh, dist.group.WORLD, 0, 1, control=dist.group.WORLD)
        policy = build_policy(model_dir, torch.float32, torch.device("cuda"), sharding,
                              temperature=1.0, entropy_grad=False, recompute=True)
        loaded = torch.cuda.max_memory_allocated() / 2**30
        opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
        ids = torch.randint(0, 4096, (4, 512), device="cuda")
        rows = torch.arange(4, device="cuda").repeat_interleave(511)
        cols = torch.arange(511, device="cuda").repeat(4)
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
        peak = torch.cuda.max_memory_allocated() / 2**30
        return f"grad norm {norm:.3f}, {moved} params stepped, peak {peak:.2f} GiB (load {loaded:.2f})"
    finally:
        dist.destroy_process_group()


def _trainer(model_dir: Path):
    from rpk.train.trainer import TorchTrainer, TrainerSettings

    return TorchTrainer(model_dir, TrainerSettings(lr=1e-3, micro_batch_tokens=4096), seed=0,
                        device="cuda", max_response_tokens=512)


def check_offload(model_dir: Path) -> str:
    a, b = _trainer(model_dir), _trainer(model_dir)
    for t in (a, b):
        t.begin_step()
        t.accumulate(_samples(4, 512, 4096, 1))
        t.finish_step()
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    b.offload("all")
    freed = held - torch.cuda.memory_allocated()
    for t in (a, b):
        t.begin_step()
        t.accumulate(_samples(4, 512, 4096, 2))  # b's first micro-batch brings it back
        t.finish_step()
    diff = max(float((p - q).abs().max()) for p, q in zip(a.model.parameters(), b.model.parameters()))
    if diff != 0.0 or freed <= 0:
        raise AssertionError(f"after offload and restore: max param diff {diff}, freed {freed} B")
    return f"freed {freed / 2**20:.0f} MiB on offload; next step identical"


def check_snapshot(model_dir: Path) -> str:
    from rpk.gpu.streams import side_stream_init

    t = _trainer(model_dir)
    init = side_stream_init("cuda")
    assert init is not None
    out: dict[str, object] = {}

    def on_trainer_thread() -> None:
        init()
        t.begin_step()
        t.accumulate(_samples(8, 1024, 4096, 3))
        t.finish_step()  # queued on the side stream; this thread does not wait for it
        out["buckets"] = t.weight_buckets(2**20)

    thread = threading.Thread(target=on_trainer_thread)
    thread.start()
    thread.join()
    # Read as the engine does: on another thread and another stream.
    with torch.cuda.stream(torch.cuda.Stream()):
        sent = {n: x.clone() for b in out["buckets"] for n, x in b}  # type: ignore[attr-defined]
    torch.cuda.synchronize()
    final = {n: p.detach() for n, p in t.model.named_parameters()}
    stale = [n for n, x in sent.items() if n in final and not torch.equal(x, final[n])]
    if stale or not sent:
        raise AssertionError(f"{len(stale)} of {len(sent)} tensors left before the step finished: {stale[:3]}")
    return f"{len(sent)} tensors, all the stepped weights"


def run_checks() -> list[Row]:
    if not torch.cuda.is_available():
        return [(name, "skip", 0.0, "no CUDA device") for name in
                ("logprob_kernel", "fsdp_step", "offload", "snapshot")]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = _tiny_model(Path(tmp) / "model")
        checks: list[tuple[str, Callable[[], str]]] = [
            ("logprob_kernel", check_logprob_kernel),
            ("fsdp_step", lambda: check_fsdp_step(model_dir)),
            ("offload", lambda: check_offload(model_dir)),
            ("snapshot", lambda: check_snapshot(model_dir)),
        ]
        for name, fn in checks:
            started = time.perf_counter()
            try:
                status, detail = "ok", fn()
            except Exception as e:  # each check fails alone, in its row
                status, detail = "FAIL", f"{type(e).__name__}: {e}"
            rows.append((name, status, time.perf_counter() - started, detail))
    return rows


def table(rows: list[Row]) -> str:
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA"
    head = f"gpu_check: torch {torch.__version__}, {device}"
    width = max(len(r[0]) for r in rows)
    lines = [head, f"{'check'.ljust(width)}  result  seconds  detail"]
    lines += [f"{n.ljust(width)}  {s.ljust(6)}  {t:7.1f}  {d}" for n, s, t, d in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    rows = run_checks()
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([dict(zip(("check", "result", "s", "detail"), r)) for r in rows]))
    return 1 if any(r[1] == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
