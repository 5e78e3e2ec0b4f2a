"""The process layout as arithmetic: validated with the offending values named, read
from torchrun's environment, and no mesh built."""

from __future__ import annotations

import pytest

from rpk.gpu.layout import LayoutError, ParallelLayout, from_env, launched_by_torchrun


def test_one_process_by_default() -> None:
    layout = from_env({})
    assert (layout.world_size, layout.rank, layout.is_controller, layout.distributed) == (1, 0, True, False)
    assert layout.mesh_shape == (1,) and layout.hosts_engines


def test_an_8_gpu_box() -> None:
    layout = ParallelLayout(nproc_per_node=8, rank=3, rollout_tp_sizes=(1, 2, 4), rollout_devices=8)
    assert layout.world_size == 8 and layout.dp_shard == 8 and layout.mesh_shape == (8,)
    assert layout.local_rank == 3 and not layout.is_controller and not layout.hosts_engines
    assert "trainer mesh 8 (FSDP)" in layout.describe()


def test_hsdp_over_two_nodes() -> None:
    layout = ParallelLayout(nnodes=2, nproc_per_node=8, rank=9, dp_replicate=2, engine_nodes=(0, 1))
    assert layout.world_size == 16 and layout.mesh_shape == (2, 8)
    assert (layout.node, layout.local_rank) == (1, 1)
    first_of_node_1 = ParallelLayout(nnodes=2, nproc_per_node=8, rank=8, dp_replicate=2, engine_nodes=(0, 1))
    assert first_of_node_1.hosts_engines and not first_of_node_1.is_controller


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"nproc_per_node": 8, "rollout_tp_sizes": (3,), "rollout_devices": 8},
         "tp=3 does not divide 8 rollout devices per node"),
        ({"nproc_per_node": 8, "rank": 8}, "rank 8 is outside the world of 8 processes"),
        ({"nproc_per_node": 6, "dp_replicate": 4}, "dp_replicate=4 does not divide the world of 6"),
        ({"nnodes": 2, "nproc_per_node": 4, "dp_replicate": 8 // 3 + 1}, "dp_replicate=3 does not divide"),
        ({"nnodes": 3, "nproc_per_node": 4, "dp_replicate": 2}, "an FSDP shard group of 6 processes"),
        ({"nproc_per_node": 4, "rollout_devices": 8}, "rollout_devices=8 exceeds the node's 4 devices"),
        ({"nproc_per_node": 0}, "nproc_per_node must be a positive integer, got 0"),
        ({"engine_nodes": (1,)}, "engine_nodes [1] must name nodes 0..0"),
        ({"rollout_tp_sizes": ()}, "rollout_tp_sizes is empty"),
    ],
)
def test_bad_layouts_name_the_offending_values(kwargs: dict, message: str) -> None:
    with pytest.raises(LayoutError, match=message.replace("[", r"\[").replace("]", r"\]")):
        ParallelLayout(**kwargs)


def test_from_torchruns_environment() -> None:
    env = {"TORCHELASTIC_RUN_ID": "x", "RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    assert launched_by_torchrun(env) and not launched_by_torchrun({})
    layout = from_env(env, dp_replicate=2)
    assert (layout.nnodes, layout.nproc_per_node, layout.rank, layout.node, layout.local_rank) == (2, 4, 5, 1, 1)
    assert layout.mesh_shape == (2, 4)
    with pytest.raises(LayoutError, match="WORLD_SIZE=6 is not a whole number of nodes of LOCAL_WORLD_SIZE=4"):
        from_env({"RANK": "0", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"})
    with pytest.raises(LayoutError, match="incomplete or wrong"):
        from_env({"RANK": "x", "WORLD_SIZE": "2"})


def test_the_ranks_on_lent_devices_count_only_as_whole_hsdp_replicate_groups() -> None:
    # One 8-GPU node, HSDP 2 x 4: devices 4-7 are replicate group 1.
    box = ParallelLayout(nproc_per_node=8, dp_replicate=2, rollout_devices=8)
    assert box.ranks_on([(0, d) for d in (4, 5, 6, 7)]) == (4, 5, 6, 7)
    assert box.ranks_on([(0, 4), (0, 5)]) is None  # half a group: its passes need the rest
    assert ParallelLayout(nproc_per_node=8, rollout_devices=8).ranks_on([(0, 4)]) is None  # FSDP
    # Two nodes x 8, HSDP 2 x 8: node 1's devices are the second group.
    nodes = ParallelLayout(nnodes=2, nproc_per_node=8, dp_replicate=2, engine_nodes=(0, 1))
    assert nodes.ranks_on([(1, d) for d in range(8)]) == tuple(range(8, 16))
    # Two CPU ranks, HSDP 2 x 1: each rank its own group.
    cpu = ParallelLayout(nproc_per_node=2, dp_replicate=2)
    assert cpu.ranks_on([(0, 1)]) == (1,) and cpu.ranks_on([]) is None
