"""Placement on its own: the router's explicit state, the device arithmetic of layouts,
and what a replica is told about its devices."""

from __future__ import annotations

import pytest

from rpk.core.records import GenRequest
from rpk.engine.fleet import Router
from rpk.engine.placement import PlacementError, device_env, fleet_plan, plan_layouts, replica_devices


def reqs(spec: dict[int, int], step: int = 1) -> list[GenRequest]:
    """`spec`: prompt -> responses; ids like the round book's."""
    return [GenRequest(f"s{step}-p{p}-r{j}", (7, p), 16) for p, n in spec.items() for j in range(n)]


def test_a_prompts_requests_go_to_one_replica_and_prompts_are_balanced():
    router = Router([8, 8])
    shares = router.place(reqs({0: 3, 1: 3, 2: 3, 3: 3}))
    assert [[r.request_id for r in s] for s in shares] == [
        ["s1-p0-r0", "s1-p0-r1", "s1-p0-r2", "s1-p2-r0", "s1-p2-r1", "s1-p2-r2"],
        ["s1-p1-r0", "s1-p1-r1", "s1-p1-r2", "s1-p3-r0", "s1-p3-r1", "s1-p3-r2"],
    ]
    assert router.in_flight == [6, 6] and router.busy
    assert router.replica_of("s1-p3-r1") == 1 and router.replica_of("unknown") is None


def test_load_is_in_flight_over_capacity():
    router = Router([4, 12])  # a TP-1 replica beside a larger one
    shares = router.place(reqs({p: 2 for p in range(8)}))
    assert [len(s) for s in shares] == [4, 12]
    router2 = Router([8, 8])
    router2.place(reqs({0: 6}))  # replica 0 is busier
    second = router2.place(reqs({0: 2, 1: 2}, step=2))
    assert [len(s) for s in second] == [0, 4]  # both new prompts go to the idle one ...
    assert router2.in_flight == [6, 4]


def test_done_frees_the_slot_once_and_aborts_find_their_replica():
    router = Router([8, 8])
    router.place(reqs({0: 2, 1: 2}))
    router.done("s1-p1-r0")
    router.done("s1-p1-r0")  # twice: counted once
    assert router.in_flight == [2, 1] and router.replica_of("s1-p1-r0") is None
    for rid in ("s1-p0-r0", "s1-p0-r1", "s1-p1-r1"):
        router.done(rid)
    assert router.in_flight == [0, 0] and not router.busy


def test_repeated_ids_are_refused():
    router = Router([8])
    router.place(reqs({0: 1}))
    with pytest.raises(ValueError, match="already in flight"):
        router.place(reqs({0: 1}))
    with pytest.raises(ValueError, match="repeat"):
        Router([8]).place(reqs({0: 1}) + reqs({0: 1}))
    with pytest.raises(ValueError, match="capacities"):
        Router([0])


def test_layouts_split_the_devices_into_contiguous_tp_groups():
    plans = plan_layouts(range(8), (4, 1, 2))
    assert list(plans) == [1, 2, 4]
    assert [p.devices for p in plans[2]] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [p.name for p in plans[4]] == ["tp4.0", "tp4.1"] and len(plans[1]) == 8
    with pytest.raises(PlacementError, match="tp=3 does not divide 8 rollout devices"):
        plan_layouts(range(8), (1, 3))
    with pytest.raises(PlacementError, match="distinct"):
        plan_layouts((0, 0), (1,))


def test_fleet_plan_defaults():
    default = fleet_plan((), (), 1, elastic=False)
    assert (default.devices, default.tp_sizes, default.pinned) == ((0,), (1,), False)
    elastic = fleet_plan((), (), 1, elastic=True)
    assert (elastic.devices, elastic.tp_sizes, elastic.pinned) == ((0, 1), (1, 2), True)
    eight = fleet_plan(tuple(range(8)), (), 2, elastic=True)
    assert eight.tp_sizes == (1, 2, 4, 8) and eight.tp == 2
    assert fleet_plan((3,), (), 1, elastic=False).pinned  # asked for a device: pinned
    with pytest.raises(PlacementError, match="two layouts") as e:
        fleet_plan((), (2,), 2, elastic=True)
    assert e.value.field == "tp_sizes"
    with pytest.raises(PlacementError, match="tp=4 is not among") as e:
        fleet_plan((), (1, 2), 4, elastic=True)
    assert e.value.field == "tp"


def test_device_env_pins_each_replica_to_its_devices():
    tp1, tp2 = plan_layouts((4, 5), (1, 2)).values()
    assert device_env(tp1[1], "cpu") == {"GOMP_CPU_AFFINITY": "5", "VLLM_CPU_OMP_THREADS_BIND": None}
    assert device_env(tp2[0], "cpu") == {"VLLM_CPU_OMP_THREADS_BIND": "4|5", "GOMP_CPU_AFFINITY": None}
    assert device_env(tp2[0], "cuda") == {"CUDA_VISIBLE_DEVICES": "4,5"}


def test_device_env_maps_device_indices_through_an_inherited_mask():
    """Under `CUDA_VISIBLE_DEVICES=4,5,6,7` rpk's device 1 is physical GPU 5: a replica
    started with `CUDA_VISIBLE_DEVICES=1` would sit outside the allocation."""
    tp1, tp2 = plan_layouts((0, 1, 2, 3), (1, 2)).values()
    assert device_env(tp1[1], "cuda", "4,5,6,7") == {"CUDA_VISIBLE_DEVICES": "5"}
    assert device_env(tp2[1], "cuda", "4, 5,6,7") == {"CUDA_VISIBLE_DEVICES": "6,7"}
    uuids = "GPU-aa,GPU-bb,GPU-cc,GPU-dd"
    assert device_env(tp2[0], "cuda", uuids) == {"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb"}
    assert device_env(tp1[3], "cuda", "") == {"CUDA_VISIBLE_DEVICES": "3"}
    with pytest.raises(PlacementError, match=r"devices \[2, 3\], but CUDA_VISIBLE_DEVICES='4,5'"):
        device_env(tp2[1], "cuda", "4,5")


def test_a_replicas_devices_from_its_name_on_any_node():
    plan = fleet_plan((0, 1, 2, 3), (1, 2), 1, elastic=True)
    assert replica_devices("tp2.1", plan) == [(0, 2), (0, 3)]
    assert replica_devices("n1.tp1.3", plan) == [(1, 3)]
    with pytest.raises(PlacementError, match="replica 'tp4.0'"):
        replica_devices("tp4.0", plan)


def test_a_trajectorys_turns_follow_its_affinity_key_unless_the_replica_is_barred():
    router = Router([8, 8])
    first = [GenRequest("s1-p0-r0-t0", (7, 0), 16, affinity="s1-p0-r0"),
             GenRequest("s1-p1-r0-t0", (7, 1), 16, affinity="s1-p1-r0")]
    assert [[r.request_id for r in s] for s in router.place(first)] == [["s1-p0-r0-t0"], ["s1-p1-r0-t0"]]
    router.place(reqs({5: 4}))  # replica 0 is now the busier one
    # The next turn of p1's trajectory (a longer context) goes back where p1 went, and so
    # does p0's, though least-load would send it to replica 1.
    turn = [GenRequest("s1-p0-r0-t1", (7, 0, 3, 4), 16, affinity="s1-p0-r0")]
    assert [len(s) for s in router.place(turn)] == [1, 0]
    # Replica 0 lent to the trainer: the turn goes to an open replica.
    again = [GenRequest("s1-p0-r0-t2", (7, 0, 3, 4, 5), 16, affinity="s1-p0-r0")]
    assert [len(s) for s in router.place(again, barred=(0,))] == [0, 1]
    with pytest.raises(ValueError, match="barred"):
        router.place(reqs({9: 1}), barred=(0, 1))
