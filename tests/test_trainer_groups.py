"""The trainer's collectives against the groups a GPU box has (issue 30, defects 1 and 4),
on one gloo rank in a subprocess: there `launch.join`'s default group serves cuda alone,
modelled here by a "cuda:gloo" group, so a host tensor sent over it raises as on NCCL."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

_RANK = r"""
import dataclasses, json, sys, tempfile
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from rpk.core.modes import Offload
from rpk.gpu.launch import Sharding
from tests.dist_harness import make
from tests.trainers import make_samples

store = dist.FileStore(tempfile.mktemp(), 1)
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
cuda_only = dist.new_group(backend="cuda:gloo")  # what a plain "nccl" group serves
mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
control = dist.new_group(backend="gloo")
sharding = Sharding(mesh=mesh, group=dist.group.WORLD, rank=0, world=1, control=control)
# Built over a group that serves host tensors: the buffers it broadcasts are on the
# device on the box, host tensors only here. From then on, the box's group.
trainer = make(sys.argv[1], sharding)
trainer._sharding = dataclasses.replace(sharding, group=cuda_only)
barriers = []
plain_barrier = dist.barrier
def barrier(*args, **kwargs):
    barriers.append(kwargs.get("group") is control)
    return plain_barrier(*args, **kwargs)
dist.barrier = barrier
trainer.begin_step()
trainer.accumulate(make_samples(4, seed=1))
metrics = trainer.finish_step()
trainer.offload(Offload.OPTIMIZER)
print(json.dumps({"stepped": metrics["stepped"], "barriers": barriers}))
"""


def test_finish_step_sums_host_counts_off_a_cuda_only_group_and_offload_waits_for_every_rank(
    model_dir: Path,
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _RANK, str(model_dir)], capture_output=True, text=True, timeout=300,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["stepped"] == 1.0
    # The offload ends on a barrier over the control group: rank 0's before_kv returns
    # only once every rank's memory is free.
    assert out["barriers"] == [True]
