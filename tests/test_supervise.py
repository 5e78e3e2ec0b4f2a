"""A lost node stops the run, named: the miss rule, the host watch beside the step loop,
naming the node after a trainer collective failed, and a trainer whose followers are
gone still abandoning and closing without hiding the error that stopped the run."""

from __future__ import annotations

import asyncio

import pytest

from rpk import controller
from rpk.assembly.settings import run_settings
from rpk.cluster.remote import HostError
from rpk.cluster.supervise import Misses, diagnose, watch_hosts
from rpk.config import Config
from rpk.core.errors import NodeFailure
from rpk.train.dist import DistTrainer, Signal


class FakeHost:
    """A host's health endpoint: answers until `dead`."""

    def __init__(self, node: int, dead: bool = False) -> None:
        self.node = node
        self.dead = dead
        self.checks = 0

    async def health(self, timeout_s: float | None = None) -> dict:
        self.checks += 1
        if self.dead:
            raise HostError(self.node, f"http://10.0.0.{self.node}:1", "GET /health: ClientConnectorError")
        return {"status": "ok", "node": self.node, "live": 0}


def test_misses_in_a_row_lose_the_node_and_an_answer_resets_the_count():
    rule = Misses(3)
    err = HostError(1, "http://h:1", "GET /health: timed out")
    assert rule.seen(1, err) is None and rule.seen(1, err) is None
    assert rule.seen(1, None) is None  # answered: the count starts again
    assert rule.seen(1, err) is None and rule.seen(1, err) is None
    lost = rule.seen(1, err)
    assert isinstance(lost, NodeFailure) and lost.node == 1
    assert str(lost).startswith("node 1 failed: engine host http://h:1") and "3 health checks in a row" in str(lost)
    assert rule.seen(2, err) is None  # per node
    with pytest.raises(ValueError, match="misses must be >= 1, got 0"):
        Misses(0)


async def test_the_watch_raises_for_the_node_that_stops_answering():
    hosts = {1: FakeHost(1), 2: FakeHost(2)}

    async def kill_later():
        await asyncio.sleep(0.05)
        hosts[2].dead = True

    killer = asyncio.create_task(kill_later())
    with pytest.raises(NodeFailure) as caught:
        await asyncio.wait_for(watch_hosts(hosts, interval_s=0.01, misses=2, timeout_s=1), 5)
    await killer
    assert caught.value.node == 2 and hosts[1].checks >= 2


async def test_diagnose_names_the_first_silent_node_or_none():
    assert await diagnose({1: FakeHost(1), 2: FakeHost(2)}, timeout_s=1) is None
    lost = await diagnose({1: FakeHost(1), 2: FakeHost(2, dead=True), 3: FakeHost(3, dead=True)}, 1)
    assert lost is not None and lost.node == 2


@pytest.fixture
def hosts():
    return {1: FakeHost(1)}


def fast() -> Config:
    from rpk.config import DistConfig

    return Config(dist=DistConfig(heartbeat_s=0.01, heartbeat_misses=2))


def heartbeat(cfg: Config) -> tuple[float, int]:
    settings = run_settings(cfg)
    return settings.heartbeat_s, settings.heartbeat_misses


async def test_supervised_steps_return_their_result_and_stop_the_watch(hosts):
    async def steps():
        await asyncio.sleep(0.05)
        return "ckpt"

    assert await controller._supervised(steps(), hosts, *heartbeat(fast())) == "ckpt"
    checks = hosts[1].checks
    await asyncio.sleep(0.05)
    assert checks >= 1 and hosts[1].checks == checks  # the watch ended with the steps


async def test_a_node_lost_while_the_steps_wait_cancels_them_and_names_it(hosts):
    cancelled = asyncio.Event()

    async def steps():
        try:
            await asyncio.sleep(3600)  # training: nothing flows to the hosts
        except asyncio.CancelledError:
            cancelled.set()
            raise

    hosts[1].dead = True
    with pytest.raises(BaseExceptionGroup) as caught:
        await asyncio.wait_for(controller._supervised(steps(), hosts, *heartbeat(fast())), 5)
    (lost,) = caught.value.subgroup(NodeFailure).exceptions
    assert lost.node == 1 and cancelled.is_set()


async def test_a_failed_collective_is_blamed_on_the_node_whose_host_is_gone(hosts):
    async def steps():
        raise RuntimeError("[gloo] Connection closed by peer [10.0.0.1]:29501")

    hosts[1].dead = True
    slow = Config()  # the watch would take seconds: the diagnosis names the node first
    with pytest.raises(NodeFailure) as caught:
        await controller._supervised(steps(), hosts, *heartbeat(slow))
    assert caught.value.node == 1 and isinstance(caught.value.__cause__, BaseExceptionGroup)
    hosts[1].dead = False
    with pytest.raises(BaseExceptionGroup) as other:  # every host answers: not a lost node
        await controller._supervised(steps(), hosts, *heartbeat(slow))
    assert other.value.subgroup(NodeFailure) is None


class GoneChannel:
    """A control channel whose followers are gone after the first `ok` sends."""

    world = 2
    rank = 0

    def __init__(self, ok: int) -> None:
        self.ok = ok
        self.sent: list = []

    def send(self, commands):
        if self.ok <= 0:
            raise RuntimeError("[gloo] Connection reset by peer")
        self.ok -= 1
        self.sent.append(commands[0])
        return commands[0]


class LocalTrainer:
    def __init__(self) -> None:
        self.abandoned = 0

    def abandon_step(self) -> None:
        self.abandoned += 1


def test_a_trainer_whose_followers_are_gone_abandons_locally_and_closes_quietly():
    channel = GoneChannel(ok=1)  # Build reaches them; nothing after
    local = LocalTrainer()
    trainer = DistTrainer(channel, lambda d: local, "model")  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="Connection reset"):
        trainer.begin_step()  # how the run learns of it: the step's error
    trainer.abandon_step()  # on the failure path: must not replace that error
    assert local.abandoned == 1
    trainer.close()
    assert not any(c is Signal.ABANDON or c is Signal.STOP for c in channel.sent)


def test_a_healthy_trainer_still_tells_its_followers():
    channel = GoneChannel(ok=10)
    local = LocalTrainer()
    trainer = DistTrainer(channel, lambda d: local, "model")  # type: ignore[arg-type]
    trainer.abandon_step()
    trainer.close()
    assert [c if isinstance(c, Signal) else type(c).__name__ for c in channel.sent] == [
        "Build", Signal.ABANDON, Signal.STOP]
