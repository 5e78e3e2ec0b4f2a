"""Rollout over several nodes without torchrun: the checks on engine nodes, the spec and
the host's command line, merging local and remote layouts, and the controller's side of
`launch_nodes` against a real host (a scripted replica) met through a dict store."""

from __future__ import annotations

import dataclasses
import json
import time
from datetime import timedelta
from typing import Any

import pytest

from rpk.cluster.host import HostService, UploadCaps, make_app, parse_args, serve
from rpk.cluster.nodes import (
    EngineSpec,
    HostStartError,
    NodeHost,
    NodesError,
    advertised_address,
    check_nodes,
    host_command,
    launch_nodes,
    merge_layouts,
    node_key,
    remote_hosts,
    wait_host,
    write_token,
)
from rpk.core.records import GenRequest
from rpk.engine.fleet import Fleet
from rpk.engine.layouts import Layout, Layouts, LayoutState
from rpk.gpu.layout import LayoutError, from_env
from rpk.sync.backends import Backend
from rpk.sync.spool import SpoolTransport
from tests.replicas import TOKEN, ScriptReplica, drain


class DictStore:
    """The part of torch.distributed's Store that rpk uses."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str | bytes) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(k in self.data for k in keys)

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        deadline = time.monotonic() + timeout.total_seconds()
        while not self.check(keys):
            if time.monotonic() > deadline:
                raise RuntimeError(f"timeout waiting for {keys}")
            time.sleep(0.01)


SPEC = EngineSpec("/models/m", {"dtype": "float32", "max_num_seqs": 8}, (1, 2), 1, (0, 1), 3, "",
                  Backend.GLOO, True, "/etc/rpk/host.pem", "/etc/rpk/host.key")


def test_engine_nodes_default_to_every_node_and_are_checked() -> None:
    assert check_nodes((), 3, "sleep", "shm") == (0, 1, 2)
    assert check_nodes((0,), 3, "restart", "nccl") == (0,)  # one node: as before
    with pytest.raises(NodesError, match=r"engine_nodes=\[0, 4\]: nodes \[4\] .* nodes 0..2"):
        check_nodes((0, 4), 3, "sleep", "shm")
    with pytest.raises(NodesError, match="tp_switch='restart' with engine nodes \\[0, 1\\]"):
        check_nodes((), 2, "restart", "shm")
    with pytest.raises(NodesError, match="weight_transfer='nccl' with engine nodes \\[1\\]"):
        check_nodes((1,), 2, "sleep", "nccl")


def test_from_env_puts_engines_on_every_node_unless_told() -> None:
    env = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "RANK": "2", "TORCHELASTIC_RUN_ID": "x"}
    place = from_env(env)
    assert place.engine_nodes == (0, 1) and place.node == 1 and place.hosts_engines
    assert not from_env({**env, "RANK": "3"}).hosts_engines  # local rank 1
    assert not from_env(env, engine_nodes=(0,)).hosts_engines
    with pytest.raises(LayoutError, match=r"engine_nodes \[2\] must name nodes 0..1"):
        from_env(env, engine_nodes=(2,))


def test_the_spec_round_trips_and_the_host_command_parses(monkeypatch) -> None:
    assert EngineSpec.from_json(SPEC.to_json()) == SPEC
    monkeypatch.setenv("RPK_ENGINE_TOKEN", TOKEN)
    cmd = host_command(SPEC, 2, "10.0.0.7", "/tmp/ready.json")  # type: ignore[arg-type]
    assert cmd[1:3] == ["-m", "rpk.cluster.host"]
    args = parse_args(cmd[3:])
    assert (args.model, args.node, args.tp_sizes, args.tp, args.devices, args.version) == (
        "/models/m", 2, (1, 2), 1, (0, 1), 3)
    assert json.loads(args.engine) == {"dtype": "float32", "max_num_seqs": 8}
    assert (args.bind, args.port, args.token_env) == ("10.0.0.7", 0, "RPK_ENGINE_TOKEN")
    assert (args.weight_transfer, args.verify, str(args.tls_cert), str(args.tls_key)) == (
        "gloo", True, "/etc/rpk/host.pem", "/etc/rpk/host.key")
    assert args.adapter == ""
    # A LoRA run's hosts start their replicas for adapters, from the run's adapter config.
    lora = dataclasses.replace(SPEC, weight_transfer=Backend.ADAPTER, adapter={"r": 8, "peft_type": "LORA"})
    assert EngineSpec.from_json(lora.to_json()) == lora
    args = parse_args(host_command(lora, 2, "10.0.0.7", "/tmp/ready.json")[3:])  # type: ignore[arg-type]
    assert (args.weight_transfer, json.loads(args.adapter)) == ("adapter", {"r": 8, "peft_type": "LORA"})


def test_the_host_refuses_to_start_without_its_token(monkeypatch, capsys) -> None:
    monkeypatch.delenv("RPK_ENGINE_TOKEN", raising=False)
    with pytest.raises(SystemExit):
        parse_args(["--model", "/m"])
    assert "--token-env=RPK_ENGINE_TOKEN: the variable is unset or empty" in capsys.readouterr().err


def test_the_advertised_address_routes_to_the_rendezvous() -> None:
    assert advertised_address({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}) == "127.0.0.1"
    assert advertised_address({"RPK_ENGINE_ADDR": "10.1.2.3"}) == "10.1.2.3"


def described(name: str, tp: int, state: str) -> dict[str, Any]:
    return {"name": name, "tp": tp, "state": state, "max_concurrency": 4, "weight_version": 0}


def test_layouts_merge_local_then_remote_nodes_in_order() -> None:
    a, b, c = ScriptReplica(), ScriptReplica(), ScriptReplica()
    local = Layouts([Layout(1, ("tp1.0", "tp1.1"), [a, b], LayoutState.AWAKE),
                     Layout(2, ("tp2.0",), [c], LayoutState.ASLEEP)])
    remote = {
        2: ("client2", [described("tp1.0", 1, "awake"), described("tp1.1", 1, "awake"),
                        described("tp2.0", 2, "asleep")]),
        1: ("client1", [described("tp1.0", 1, "awake"), described("tp1.1", 1, "awake"),
                        described("tp2.0", 2, "asleep")]),
    }
    merged = merge_layouts(local, remote, lambda client, info: (client, info["name"]))  # type: ignore[arg-type]
    tp1, tp2 = merged.all
    assert tp1.names == ("n0.tp1.0", "n0.tp1.1", "n1.tp1.0", "n1.tp1.1", "n2.tp1.0", "n2.tp1.1")
    assert tp1.replicas[:2] == [a, b] and tp1.replicas[2] == ("client1", "tp1.0")
    assert tp2.names == ("n0.tp2.0", "n1.tp2.0", "n2.tp2.0") and tp2.state is LayoutState.ASLEEP
    assert merged.awake is tp1
    remote[1] = ("client1", [described("tp1.0", 1, "asleep")])
    with pytest.raises(HostStartError, match="disagree on which layout is awake"):
        merge_layouts(local, remote, lambda client, info: info)  # type: ignore[arg-type]


async def test_wait_host_reports_a_failed_host_and_a_missing_one() -> None:
    store = DictStore()
    store.set(node_key(1), json.dumps({"error": "the engine host of node 1 exited with code 2"}))
    with pytest.raises(HostStartError, match="node 1 exited with code 2"):
        await wait_host(store, 1, timeout_s=1)
    with pytest.raises(HostStartError, match="no engine host of node 2 within 0s"):
        await wait_host(store, 2, timeout_s=0.2, poll_s=0.05)


async def test_launch_nodes_makes_one_fleet_over_local_and_remote_replicas() -> None:
    remote_fake, local_fake = ScriptReplica(), ScriptReplica()
    service = HostService(1, Layouts([Layout(1, ("tp1.0",), [remote_fake], LayoutState.AWAKE)]),
                          max_live=32, heartbeat_s=1, caps=UploadCaps(max_bucket_bytes=2**20))
    runner, port = await serve(make_app(service, TOKEN), "127.0.0.1", 0)
    store = DictStore()
    store.set(node_key(1), json.dumps({"url": f"http://127.0.0.1:{port}", "node": 1}))

    async def start_local() -> Fleet:
        return Fleet(Layouts([Layout(1, ("tp1.0",), [local_fake], LayoutState.AWAKE)]),
                     SpoolTransport(), version=0)

    spec = EngineSpec("/m", {}, (1,), 1, (), 0, "")
    try:
        fleet = await launch_nodes(spec, TOKEN, (0, 1), store, start_local=start_local, timeout_s=5, log=print)
        assert EngineSpec.from_json(store.get("rpk/engine/spec")) == spec
        assert list(fleet.versions()) == ["n0.tp1.0", "n1.tp1.0"]
        streams = await fleet.start([GenRequest("p", (1, 2), 4), GenRequest("q", (3,), 4)])
        got = {rid: [d.token_ids for d in await drain(s)] for rid, s in streams.items()}
        assert got == {"p": [(1,), (2,)], "q": [(3,)]}
        assert local_fake.added_while_paused == [True] and service.served == {"tp1.0": 1}
        hosts = remote_hosts(fleet)
        assert list(hosts) == [1] and (await hosts[1].health(timeout_s=2))["node"] == 1
        await fleet.shutdown()
        assert fleet.replicas[1].client._session is None  # type: ignore[attr-defined]
    finally:
        await runner.cleanup()


def test_a_host_that_cannot_start_is_reported_through_the_store(tmp_path) -> None:
    store = DictStore()
    token_file = str(write_token(tmp_path, TOKEN))
    store.set("rpk/engine/spec", EngineSpec(str(tmp_path / "no-model"), {}, (1,), 1, (), 0, token_file).to_json())
    with pytest.raises(HostStartError, match="engine host of node 1 exited with code 2"):
        NodeHost.start(store, 1, timedelta(seconds=5), start_timeout_s=120)
    assert "exited with code 2" in json.loads(store.get(node_key(1)))["error"]


@pytest.mark.parametrize("args, message", [
    (["--dist.engine_nodes", "0,3"], "engine_nodes [0, 3] must name nodes 0..1"),
    (["--rollout.tp_switch", "restart"], "rollout.tp_switch='restart' with engine nodes [0, 1]"),
    (["--dist.engine_nodes", "1,1"], "dist.engine_nodes=[1, 1] must be distinct"),
])
def test_rpk_run_refuses_bad_engine_nodes_before_joining(monkeypatch, capsys, args, message) -> None:
    from rpk.run import main

    for k, v in {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "RANK": "0", "TORCHELASTIC_RUN_ID": "t"}.items():
        monkeypatch.setenv(k, v)
    assert main(args) == 2
    assert message in capsys.readouterr().err


async def test_a_remote_only_fleet_regroups_across_a_hosts_layouts() -> None:
    tp1, tp2 = ScriptReplica(), ScriptReplica()
    tp2.weight_version = None  # asleep since start-up: weights dropped
    service = HostService(1, Layouts([Layout(1, ("tp1.0",), [tp1], LayoutState.AWAKE),
                                      Layout(2, ("tp2.0",), [tp2], LayoutState.ASLEEP)]),
                          max_live=32, heartbeat_s=1, caps=UploadCaps(max_bucket_bytes=2**20))
    runner, port = await serve(make_app(service, TOKEN), "127.0.0.1", 0)
    store = DictStore()
    store.set(node_key(1), json.dumps({"url": f"http://127.0.0.1:{port}", "node": 1}))

    async def no_local() -> Fleet:
        raise AssertionError("node 0 runs no engines here")

    async def weights():
        import torch

        yield [("w", torch.zeros(3))]

    try:
        fleet = await launch_nodes(EngineSpec("/m", {}, (1, 2), 1, (), 0, ""), TOKEN, (1,), store,
                                   start_local=no_local, timeout_s=5, log=print)
        report = await fleet.regroup(2, weights)
        assert (report.from_tp, report.to_tp, report.synced) == (1, 2, 1)
        assert tp1.sleeping and tp2.weight_version == 0 and fleet.versions() == {
            "n1.tp1.0": None, "n1.tp2.0": 0}
        streams = await fleet.start([GenRequest("p", (5,), 4)])
        assert [d.token_ids for d in await drain(streams["p"])] == [(5,)]
        assert tp2.added_while_paused == [True]
        client = fleet.replicas[0].client  # type: ignore[attr-defined]
        assert {r["name"]: r["state"] for r in await client.replicas()} == {
            "tp1.0": "asleep", "tp2.0": "awake"}
        await fleet.shutdown()
    finally:
        await runner.cleanup()
