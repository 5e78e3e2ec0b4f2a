"""The engine host and its client over real aiohttp on 127.0.0.1, with a scripted replica
in place of vLLM: streamed deltas, paused adds, aborts, weights, sleep, auth, timeouts."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from pathlib import Path
from typing import AsyncIterator, Sequence

import pytest
import torch
from safetensors.torch import load_file

from rpk.core.drafts import Draft, DraftSource, PromptDrafts, SourceCounts, SpecStats
from rpk.core.records import FinishReason, GenDelta, GenRequest, ReplicaStats
from rpk.engine.fleet import Fleet
from rpk.cluster.host import HostService, make_app, serve
from rpk.engine.layouts import Layout, Layouts, LayoutState
from rpk.cluster.remote import HostClient, HostError, NodeTransport, RemoteReplica, Timeouts

TOKEN = "s3cret"


class ScriptReplica:
    """Each request yields its prompt's tokens one by one (log-prob -token/10); a prompt
    starting with 0 never ends until aborted."""

    def __init__(self) -> None:
        self.weight_version: int | None = 0
        self.is_paused = False
        self.added_while_paused: list[bool] = []
        self.aborted: list[str] = []
        self.loaded: list[tuple[list[dict], int]] = []
        self.sleeping = False
        self.closed_early: list[str] = []  # streams closed before their end (VLLMEngine aborts these)
        self._abort: dict[str, asyncio.Event] = {}

    @property
    def max_concurrency(self) -> int:
        return 8

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        self.is_paused = True
        try:
            yield
        finally:
            self.is_paused = False

    async def add(self, requests: Sequence[GenRequest]) -> dict[str, AsyncIterator[GenDelta]]:
        self.added_while_paused.append(self.is_paused)
        for r in requests:
            self._abort[r.request_id] = asyncio.Event()
        return {r.request_id: self._run(r) for r in requests}

    async def _run(self, r: GenRequest) -> AsyncIterator[GenDelta]:
        stop = self._abort[r.request_id]
        ended = False
        try:
            if r.prompt_token_ids[0] == 0:
                await stop.wait()
                ended = True
                yield GenDelta(r.request_id, (7,), (-0.5,), finished=True, finish_reason=FinishReason.ABORT)
                return
            last = len(r.prompt_token_ids) - 1
            for i, t in enumerate(r.prompt_token_ids):
                await asyncio.sleep(0.001)
                ended = i == last
                yield GenDelta(r.request_id, (t,), (-t / 10,), text=str(t), finished=ended,
                               finish_reason=FinishReason.STOP if ended else None)
        finally:
            if not ended:
                self.closed_early.append(r.request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self._abort[request_id].set()

    async def sleep(self) -> None:
        self.sleeping, self.weight_version = True, None

    async def wake(self) -> None:
        self.sleeping = False

    def take_stats(self) -> ReplicaStats:
        return ReplicaStats(preemptions=1, kv_usage_max=0.25, tokens_generated=3)

    async def load_weight_files(self, paths: Sequence[Path], version: int) -> None:
        self.loaded.append(([load_file(str(p)) for p in paths], version))
        self.weight_version = version

    async def set_drafts(self, schedule, sources, prompts) -> None:
        self.spec_rounds = getattr(self, "spec_rounds", []) + [(list(schedule), list(sources), list(prompts))]

    async def add_drafts(self, prompts) -> None:
        self.spec_added = getattr(self, "spec_added", []) + [list(prompts)]

    async def take_spec_stats(self) -> SpecStats:
        return SPEC

    async def shutdown(self) -> None:
        pass


SPEC = SpecStats(drafts=3, draft_tokens=9, accepted=4, drafted_by_pos=(3, 3, 3), accepted_by_pos=(2, 1, 1),
                 spec_steps=2, spec_step_tokens=7, spec_step_rows=3, steps=5,
                 by_source={DraftSource.PARTIAL: SourceCounts(3, 9, 4)})


@contextlib.asynccontextmanager
async def hosting(heartbeat_s: float = 0.05, token: str = TOKEN, timeouts: Timeouts = Timeouts()):
    fake = ScriptReplica()
    layouts = Layouts([Layout(1, ("tp1.0",), [fake], LayoutState.AWAKE)])
    service = HostService(1, layouts, max_live=16, heartbeat_s=heartbeat_s, max_bucket_bytes=2**20)
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


async def drain(stream: AsyncIterator[GenDelta]) -> list[GenDelta]:
    return [d async for d in stream]


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
