"""vLLM 0.32's own validation of the engines rpk would start, on a machine without a GPU.

`python -m tests.vllm_contract` is a worker process: it installs a CUDA platform stand-in
before anything of vLLM reads `current_platform`, then for each request (a JSON line on
stdin: an engine's exact `AsyncEngineArgs` keywords and the environment it starts in)
builds the whole `VllmConfig` as `AsyncLLM.from_engine_args` does
(`create_engine_config(UsageContext.ENGINE_CONTEXT)`), so every validator of every
config section runs (scheduler, cache, parallel, LoRA, offload, speculative, compilation,
the platform's `check_and_update_config`), resolves the executor class, the worker
extension and the weight-transfer engine by name, and answers one JSON line.

The stand-in is vLLM's own `CudaPlatformBase` (its config rules, run as they are), with
what a CUDA machine reports filled in: an H100's compute capability 9.0, the target's
memory per GPU, as many devices as `CUDA_VISIBLE_DEVICES` shows (the target's count
without it), the cumem allocator present (a compiled library of the CUDA wheel: rpk's
sleep mode needs it) and Triton present (a CUDA box has it; it decides Model Runner
V2). The compiled CUDA ops module is absent from the CPU wheel and stubbed: nothing it
registers is used before a device exists.

A worker of its own, not this process: every vLLM module binds `current_platform` when it
is first imported, and the test session's other vLLM users (the CPU engine of the
integration tests) need the CPU platform.

`Contract` is the client the tests use: one worker a session, one vLLM import, and each
distinct engine checked once.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class Verdict:
    """vLLM's answer for one engine: `error` (its one line) or the config it built."""

    ok: bool
    error: str | None
    config: Mapping[str, Any] = field(default_factory=dict)


class Contract:
    """The client: one worker, answers cached by engine (arguments, environment, shape)."""

    def __init__(self, gpu_bytes: int = 80 * 10**9, gpus: int = 8) -> None:
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "VLLM_LOGGING_LEVEL": "WARNING", "CONTRACT_GPU_BYTES": str(gpu_bytes),
               "CONTRACT_GPUS": str(gpus)}
        env.pop("CUDA_VISIBLE_DEVICES", None)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.vllm_contract"], cwd=ROOT, env=env, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )
        self._seen: dict[str, Verdict] = {}

    def check(self, kwargs: Mapping[str, Any], env: Mapping[str, str | None] | None = None,
              hf: Mapping[str, Any] | None = None) -> Verdict:
        """vLLM's verdict on an engine started with `kwargs` under `env`; `hf`: its
        model's config.json where `kwargs["model"]` is no directory yet (a model built at
        start, as the tiny judge)."""
        request = json.dumps({"kwargs": kwargs, "env": dict(env or {}), "hf": hf}, sort_keys=True)
        if request not in self._seen:
            assert self._proc.stdin is not None and self._proc.stdout is not None
            self._proc.stdin.write(request + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the vLLM contract worker died (exit {self._proc.wait()})")
            answer = json.loads(line)
            self._seen[request] = Verdict(answer["ok"], answer["error"], answer["config"])
        return self._seen[request]

    def close(self) -> None:
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()


def _stand_in(gpu_bytes: int, gpus: int) -> None:
    """vLLM's current platform: its CUDA platform with a device's answers filled in."""
    import types

    sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
    import vllm.platforms as platforms
    from vllm.platforms import cuda
    from vllm.platforms.interface import DeviceCapability

    class StandIn(cuda.CudaPlatformBase):
        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(9, 0)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return "NVIDIA H100 80GB HBM3 (stand-in)"

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return gpu_bytes

        @classmethod
        def is_fully_connected(cls, physical_device_ids: list[int]) -> bool:
            return True

        @classmethod
        def device_count(cls) -> int:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            return len([v for v in visible.split(",") if v.strip()]) if visible else gpus

        def is_cumem_allocator_available(self) -> bool:
            return True

    platforms._current_platform = StandIn()
    import vllm.config.vllm as vllm_config

    vllm_config.HAS_TRITON = True


def _shape_dir(hf: Mapping[str, Any], root: Path) -> str:
    """A directory holding `hf` as config.json, one per distinct shape."""
    text = json.dumps(hf, sort_keys=True)
    path = root / hashlib.sha256(text.encode()).hexdigest()[:16]
    if not path.exists():
        path.mkdir()
        (path / "config.json").write_text(text)
    return str(path)


def _summary(config: Any) -> dict[str, Any]:
    s, c, p, m = config.scheduler_config, config.cache_config, config.parallel_config, config.model_config
    lora, spec, off = config.lora_config, config.speculative_config, config.offload_config
    return {
        "max_num_batched_tokens": s.max_num_batched_tokens, "max_num_seqs": s.max_num_seqs,
        "max_model_len": m.max_model_len, "enable_chunked_prefill": s.enable_chunked_prefill,
        "gpu_memory_utilization": c.gpu_memory_utilization, "kv_cache_memory_bytes": c.kv_cache_memory_bytes,
        "enable_sleep_mode": m.enable_sleep_mode, "dtype": str(m.dtype), "runner": m.runner_type,
        "tensor_parallel_size": p.tensor_parallel_size, "worker_cls": p.worker_cls,
        "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
        "cudagraph_pool_in_sleep": config.use_cumem_cudagraph_pool,
        "max_lora_rank": lora.max_lora_rank if lora is not None else None,
        "speculative": spec.method if spec is not None else None,
        "num_speculative_tokens": spec.num_speculative_tokens if spec is not None else None,
        "offload_backend": off.offload_backend,
        "weight_transfer": config.weight_transfer_config.backend if config.weight_transfer_config else None,
        "model_runner_v2": config.use_v2_model_runner,
    }


def _serve() -> None:
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM's log lines go to stderr, the answers alone to the pipe
    _stand_in(int(os.environ["CONTRACT_GPU_BYTES"]), int(os.environ["CONTRACT_GPUS"]))
    shapes = Path(tempfile.mkdtemp(prefix="rpk-vllm-contract-"))
    for line in sys.stdin:
        request = json.loads(line)
        kwargs = dict(request["kwargs"])
        if request["hf"] is not None and not (Path(str(kwargs["model"])) / "config.json").is_file():
            kwargs["model"] = _shape_dir(request["hf"], shapes)
        with mock.patch.dict(os.environ):  # the request's environment, put back after it
            os.environ.update({k: v for k, v in request["env"].items() if v is not None})
            for k in (k for k, v in request["env"].items() if v is None):
                os.environ.pop(k, None)
            answer = _answer(kwargs)
        proto.write(json.dumps(answer) + "\n")
        proto.flush()


def _answer(kwargs: dict[str, Any]) -> dict[str, Any]:
    """What vLLM's config makes of one engine's keywords: its summary, or its refusal."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.executor import Executor

    try:
        config = AsyncEngineArgs(**kwargs).create_engine_config(UsageContext.ENGINE_CONTEXT)
        Executor.get_class(config)
        if config.parallel_config.worker_extension_cls:
            resolve_obj_by_qualname(config.parallel_config.worker_extension_cls)
        wt = config.weight_transfer_config
        if wt is not None and wt.backend not in WeightTransferEngineFactory._registry:
            raise ValueError(f"no weight-transfer engine {wt.backend!r} registered "
                             f"(vLLM's: {sorted(WeightTransferEngineFactory._registry)})")
        return {"ok": True, "error": None, "config": _summary(config)}
    except Exception as e:  # vLLM's refusal, whatever its type, is the answer
        return {"ok": False, "error": f"{type(e).__name__}: {' '.join(str(e).split())}", "config": {}}


if __name__ == "__main__":
    _serve()
