"""The engine host and its client over real aiohttp on 127.0.0.1, with a scripted replica
in place of vLLM: streamed deltas, paused adds, aborts, weights, sleep, auth, timeouts."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest
import torch

from rpk.cluster.host import HostService, UploadCaps, make_app, serve
from rpk.cluster.remote import HostClient, HostError, NodeTransport, RemoteReplica, Timeouts
from rpk.core.drafts import Draft, DraftSource, PromptDrafts
from rpk.core.modes import RestLevel
from rpk.core.records import FinishReason, GenDelta, GenRequest, ReplicaStats
from rpk.engine.fleet import Fleet
from rpk.engine.layouts import Layout, Layouts, LayoutState
from tests.replicas import SPEC, TOKEN, ScriptReplica, drain


@contextlib.asynccontextmanager
async def hosting(heartbeat_s: float = 0.05, token: str = TOKEN, timeouts: Timeouts = Timeouts()):
    fake = ScriptReplica()
    layouts = Layouts([Layout(1, ("tp1.0",), [fake], LayoutState.AWAKE)])
    service = HostService(1, layouts, max_live=16, heartbeat_s=heartbeat_s, caps=UploadCaps(max_bucket_bytes=2**20))
    runner, port = await serve(make_app(service, TOKEN), "127.0.0.1", 0)
    client = HostClient(1, f"http://127.0.0.1:{port}", token, timeouts)
    try:
        yield fake, service, client
    finally:
        await client.close()
        await runner.cleanup()


async def remote_of(client: HostClient) -> RemoteReplica:
    (info,) = await client.replicas()
    return RemoteReplica(client, info["name"], info["max_concurrency"], info["weight_version"])


async def test_a_batch_streams_token_ids_logprobs_and_stats_and_was_added_paused() -> None:
    async with hosting() as (fake, service, client):
        replica = await remote_of(client)
        assert replica.max_concurrency == 8 and replica.weight_version == 0
        async with replica.paused():
            streams = await replica.add([GenRequest("a", (3, 4, 5), 8), GenRequest("b", (9,), 8)])
        got = dict(zip(streams, await asyncio.gather(*(drain(s) for s in streams.values()))))
        assert [d.token_ids for d in got["a"]] == [(3,), (4,), (5,)]
        assert [d.logprobs for d in got["a"]] == [(-0.3,), (-0.4,), (-0.5,)]
        assert got["a"][-1].finished and got["a"][-1].finish_reason is FinishReason.STOP
        assert [d.text for d in got["b"]] == ["9"] and got["b"][0].finished
        assert fake.added_while_paused == [True]
        # One stats line per finished request, summed; the take resets.
        assert replica.take_stats() == ReplicaStats(2, 0.25, 6)
        assert replica.take_stats() == ReplicaStats()
        assert service.live == 0 and service.served == {"tp1.0": 2}


async def test_abort_ends_a_request_and_closing_a_stream_aborts_it() -> None:
    async with hosting() as (fake, service, client):
        replica = await remote_of(client)
        streams = await replica.add([GenRequest("long", (0,), 8), GenRequest("gone", (0, 1), 8)])
        await replica.abort("long")
        (last,) = await drain(streams["long"])
        assert last.finish_reason is FinishReason.ABORT and last.token_ids == (7,)
        await streams["gone"].aclose()  # type: ignore[attr-defined]
        assert fake.aborted == ["long", "gone"]
        await replica.abort("long")  # ended: ignored, no call
        assert fake.aborted == ["long", "gone"]
        for _ in range(100):
            if service.live == 0:
                break
            await asyncio.sleep(0.01)
        assert service.live == 0


async def wait_until(predicate, timeout_s: float = 5) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_a_controller_that_goes_away_ends_its_batch_on_the_host() -> None:
    async with hosting() as (fake, service, client):
        replica = await remote_of(client)
        await replica.add([GenRequest("stuck", (0,), 8), GenRequest("also", (0, 1), 8)])
        await wait_until(lambda: service.live == 2)
        await client.close()  # the connection drops with the requests running
        await wait_until(lambda: service.live == 0)
        assert sorted(fake.closed_early) == ["also", "stuck"]


async def test_weights_reach_a_remote_replica_through_the_node_transport() -> None:
    async with hosting() as (fake, service, client):
        replica = await remote_of(client)

        async def buckets():
            yield [("a.weight", torch.ones(2, 3))]
            yield [("b.bias", torch.arange(4.0))]

        await NodeTransport().push(buckets(), [replica], version=5)
        assert replica.weight_version == 5
        ((files, version),) = fake.loaded
        assert version == 5 and [list(f) for f in files] == [["a.weight"], ["b.bias"]]
        assert torch.equal(files[1]["b.bias"], torch.arange(4.0))
        assert not list(service._updates)


async def test_a_fleet_of_remote_replicas_sleeps_and_wakes_them() -> None:
    async with hosting() as (fake, service, client):
        replica = await remote_of(client)
        fleet = Fleet(Layouts([Layout(1, ("n1.tp1.0",), [replica], LayoutState.AWAKE)]),
                      NodeTransport(), version=0)
        streams = await fleet.start([GenRequest("x", (1, 2), 4)])
        assert [d.token_ids for d in await drain(streams["x"])] == [(1,), (2,)]
        await replica.sleep()
        assert fake.sleeping and replica.weight_version is None
        await replica.wake()
        assert not fake.sleeping


async def test_a_wrong_token_is_refused_and_named() -> None:
    async with hosting(token="wrong") as (_, _, client):
        with pytest.raises(HostError, match=r"node 1 failed: engine host http://127\.0\.0\.1:\d+: .*HTTP 401"):
            await client.replicas()
        assert (await client.health())["status"] == "ok"  # the heartbeat needs no token


async def test_an_unreachable_host_names_node_and_address() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = HostClient(3, f"http://127.0.0.1:{port}", TOKEN, Timeouts(connect_s=1, call_s=2))
    try:
        with pytest.raises(HostError, match=rf"node 3 failed: engine host http://127\.0\.0\.1:{port}: .*GET /health"):
            await client.health()
    finally:
        await client.close()


async def test_a_silent_stream_fails_its_requests_in_bounded_time() -> None:
    # The host heartbeats every 10 s; the client calls a stream dead after 0.3 s of silence.
    async with hosting(heartbeat_s=10, timeouts=Timeouts(stream_idle_s=0.3)) as (fake, _, client):
        replica = await remote_of(client)
        streams = await replica.add([GenRequest("stuck", (0,), 8)])
        with pytest.raises(HostError, match="node 1 .*generate stream of tp1.0 went silent"):
            await asyncio.wait_for(drain(streams["stuck"]), 5)
        await replica.shutdown()


async def test_a_host_refuses_more_live_requests_than_its_bound() -> None:
    async with hosting() as (_, _, client):
        replica = await remote_of(client)
        many = [GenRequest(f"r{i}", (0,), 4) for i in range(17)]
        with pytest.raises(HostError, match="HTTP 503.*bound of 16"):
            await replica.add(many)


async def test_speculation_reaches_the_hosts_replica_and_its_counters_come_back() -> None:
    async with hosting() as (fake, service, client):
        replica = await remote_of(client)
        drafts = PromptDrafts((5, 6), (Draft(DraftSource.PARTIAL, (7, 8, 9)), Draft(DraftSource.EPOCH, (1,))))
        await replica.set_drafts([(1, 4, 3), (5, 8, 0)], [DraftSource.PARTIAL, DraftSource.EPOCH], [drafts])
        await replica.add_drafts([PromptDrafts((5, 6), (Draft(DraftSource.SIBLING, (2,)),))])
        await replica.add_drafts([])  # nothing to send: no call
        assert fake.spec_rounds == [([(1, 4, 3), (5, 8, 0)], [DraftSource.PARTIAL, DraftSource.EPOCH], [drafts])]
        assert fake.spec_added == [[PromptDrafts((5, 6), (Draft(DraftSource.SIBLING, (2,)),))]]
        assert await replica.take_spec_stats() == SPEC


async def test_a_bad_speculation_round_is_refused_naming_it() -> None:
    async with hosting() as (fake, service, client):
        with pytest.raises(HostError, match="bad speculation round"):
            await client.call("POST", "/replicas/tp1.0/spec/round", json={"schedule": [[1, 2]], "sources": []})
        with pytest.raises(HostError, match="prompts must be a list"):
            await client.call("POST", "/replicas/tp1.0/spec/add", json={"prompts": 3})


async def test_accepted_drafts_cross_the_wire_on_the_last_delta() -> None:
    from rpk.cluster.host import delta_line
    from rpk.cluster.remote import _from_line

    last = GenDelta("a", (1, 2), (-0.1, -0.2), "x", finished=True, finish_reason=FinishReason.STOP, accepted=5)
    assert _from_line(delta_line(last)) == last


async def test_a_sleep_level_reaches_the_hosts_replica_as_a_rest_level(monkeypatch) -> None:
    """Level 1 (the weights kept) crosses the wire as a number and reaches the host's
    replica as `RestLevel.KEEP_WEIGHTS`, which its engine asks whether the weights go."""
    async with hosting() as (fake, _, client):
        got: list[object] = []

        async def sleep(level: RestLevel = RestLevel.DROP_WEIGHTS) -> None:
            got.append(level)

        monkeypatch.setattr(fake, "sleep", sleep)
        replica = await remote_of(client)
        await replica.sleep(RestLevel.KEEP_WEIGHTS)
        assert got == [RestLevel.KEEP_WEIGHTS] and isinstance(got[0], RestLevel)
        assert replica.weight_version == 0 and not replica.base_dropped
        await replica.sleep(RestLevel.DROP_WEIGHTS)
        assert got[-1] is RestLevel.DROP_WEIGHTS and replica.weight_version is None


def test_a_rest_level_says_whether_the_weights_go_and_which_a_sync_needs() -> None:
    assert RestLevel.DROP_WEIGHTS.drops_weights and not RestLevel.KEEP_WEIGHTS.drops_weights
    assert RestLevel.for_sync(adapter=True) is RestLevel.KEEP_WEIGHTS
    assert RestLevel.for_sync(adapter=False) is RestLevel.DROP_WEIGHTS
