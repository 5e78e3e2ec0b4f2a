"""Every GPU layout has a weight path vLLM 0.32 accepts (issue 30, defect 5).

For TP 1, 2 and 4 (and `rollout.tp elastic`'s layouts), colocated on 8 GPUs (the
trainer's ranks on all of them, rank 0 on GPU 0) and split (`dist.trainer_gpus`: the
trainer on the first GPUs, the replicas on the others): the lane each replica gets
(`rpk.sync.backends.resolve`, `for_replica`), then what its workers receive, rebuilt as vLLM's
IPC engine rebuilds it (a handle for the worker's own GPU UUID) and as vLLM's NCCL
engine ranks it (`rank_offset` + TP rank, on the worker's GPU: never two ranks on one).
"""

from __future__ import annotations

import importlib.util
import re

import pytest

from rpk.engine.placement import fleet_plan
from rpk.sync.backends import Backend, for_replica, resolve
from tests.replicas import FakeReplica, Opener, fake_cuda, in_buckets, small_weights

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"
)

GPUS = tuple(range(8))
# (name, fleet GPUs, tp_sizes, tp, elastic, trainer GPUs)
LAYOUTS = [
    *[(f"colocated tp{tp}", GPUS, (tp,), tp, False, GPUS) for tp in (1, 2, 4)],
    ("colocated elastic", GPUS, (), 1, True, GPUS),
    *[(f"split tp{tp}, one trainer rank", GPUS[4:], (tp,), tp, False, (0,)) for tp in (1, 2, 4)],
    *[(f"split tp{tp}, sharded trainer", GPUS[4:], (tp,), tp, False, GPUS[:4]) for tp in (1, 2, 4)],
]


def _lanes(fleet, tp_sizes, tp, elastic, trainer) -> dict[int, list[tuple[str, tuple[int, ...]]]]:
    """Per layout, each replica's (backend, GPUs)."""
    plan = fleet_plan(fleet, tp_sizes, tp, elastic)
    mode = resolve("auto", "cuda", set(plan.devices), trainer[0], trainer if len(trainer) > 1 else ()).local
    return {size: [(for_replica(mode, p.devices, trainer[0]), tuple(p.devices)) for p in places]
            for size, places in plan.layouts().items()}


@pytest.mark.parametrize("name, fleet, tp_sizes, tp, elastic, trainer", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_each_replica_gets_a_lane_no_gpu_of_which_holds_two_nccl_ranks(
    name: str, fleet, tp_sizes, tp, elastic, trainer,
) -> None:
    layouts = _lanes(fleet, tp_sizes, tp, elastic, trainer)
    assert set(layouts) == ({1, 2, 4, 8} if elastic else {tp})
    for size, replicas in layouts.items():
        for backend, devices in replicas:
            # the NCCL group's ranks: the trainer's (rank 0's alone for nccl, every one for m2n), then the workers
            joining = {"nccl": (trainer[0],), "nccl_m2n": trainer}.get(backend, ())
            assert backend in ("ipc", "nccl", "nccl_m2n"), (name, size, backend)
            if backend != "ipc":
                assert len({*joining, *devices}) == len(joining) + len(devices), (name, size, devices)
            else:
                assert trainer[0] in devices, (name, size, devices)  # otherwise NCCL takes it
    if fleet == GPUS:  # colocated: every layout has a replica on rank 0's GPU
        assert all(any(b == "ipc" for b, _ in replicas) for replicas in layouts.values())
    if len(trainer) > 1 and fleet != GPUS:
        assert {b for replicas in layouts.values() for b, _ in replicas} == {"nccl_m2n"}


@pytest.mark.parametrize("name, fleet, tp_sizes, tp, elastic, trainer",
                         [x for x in LAYOUTS if x[5] == GPUS or len(x[5]) == 1],
                         ids=[x[0] for x in LAYOUTS if x[5] == GPUS or len(x[5]) == 1])
async def test_what_every_worker_receives_is_what_vllms_engines_accept(
    name: str, fleet, tp_sizes, tp, elastic, trainer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo

    from rpk.sync.transport import CollectiveTransport

    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    weights = small_weights()
    for size, lanes in _lanes(fleet, tp_sizes, tp, elastic, trainer).items():
        replicas = [FakeReplica(f"tp{size}.{i}", b, tp=size, devices=d) for i, (b, d) in enumerate(lanes)]
        opener = Opener()
        transport = CollectiveTransport(open_trainer=opener, ipc=fake_cuda(lambda t: ("handle",), trainer[0]))
        await transport.push(in_buckets(weights), replicas, version=1)
        ranks: dict[int, int] = {0: trainer[0]}  # the NCCL group's rank -> GPU
        for r in replicas:
            if r.settings.backend is Backend.IPC:
                for info in (IPCWeightTransferUpdateInfo(**i) for i in r.llm.of("update")):
                    for handles in info.ipc_handles:  # vLLM's worker on GPU d looks up d's UUID
                        assert {f"GPU-fake-uuid-{d}" for d in r.settings.devices} <= set(handles), (name, r.name)
            else:
                init = NCCLWeightTransferInitInfo(**r.llm.of("init")[0])
                for tp_rank, device in enumerate(r.settings.devices):
                    assert init.rank_offset + tp_rank not in ranks
                    ranks[init.rank_offset + tp_rank] = device
            assert r.weight_version == 1
        assert len(set(ranks.values())) == len(ranks), (name, size, ranks)  # one rank a GPU


@pytest.mark.parametrize("transfer, trainer, shared", [
    ("nccl", (0,), [0]), ("nccl", GPUS, [0]), ("m2n", GPUS, list(GPUS)),
])
def test_an_nccl_path_onto_the_trainers_gpu_is_refused_at_config_time_naming_it(
    transfer: str, trainer, shared: list[int],
) -> None:
    plan = fleet_plan(GPUS, (2,), 2, False)
    with pytest.raises(ValueError, match=re.escape(f"weight_transfer={transfer} with replicas on the "
                                                   f"trainer's GPUs {shared}")):
        resolve(transfer, "cuda", set(plan.devices), trainer[0], trainer)
    assert resolve("ipc", "cuda", set(plan.devices), trainer[0], trainer).local == "ipc"
    assert resolve("nccl", "cuda", set(GPUS[4:]), 0, (0,)).local == "nccl"
