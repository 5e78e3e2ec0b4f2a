"""The judge engines of another node, reached over aiohttp: the client side of
`rpk.cluster.host_judges`.

`RemoteJudge` is a judge engine a host serves on one of its GPUs, asked one request per
call (a vote); the controller's `rpk.judge.pool.JudgePool` holds them beside node 0's
and restarts one that dies through its host.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from rpk.cluster.remote import _BODY_EXCERPT, HostClient, HostError
from rpk.reward.judge import JudgeDied, JudgeRequest
from rpk.reward.verdict import Reading


class RemoteJudgeError(RuntimeError):
    """A host's judge engine refused one verdict's request; the others go on."""


class RemoteJudge:
    """A judge engine that a node's engine host serves on one of its GPUs
    (`rpk.reward.judge.JudgeEngine`, `rpk.cluster.host_judges`). A verdict's call has no
    time limit of its own: the scorer's `reward.judge.timeout_s` bounds it, and a
    timeout costs the sample alone. A dead engine is `JudgeDied`, naming the node and
    the GPU, and so is a host that cannot be reached: but only once the verdict failed
    twice to reach it (the second time on a fresh connection: a keep-alive socket the
    host or a proxy closed fails once and means nothing) and the host then failed its
    health probe. Two failures and a host that answers cost the sample alone."""

    def __init__(self, client: HostClient, index: int, gpu: int, can_sleep: bool) -> None:
        self.client = client
        client.users += 1
        self.index = index
        self.gpu = gpu
        self.can_sleep = can_sleep
        self.retried = 0  # verdicts asked again on a fresh connection
        self._shut = False
        self._asleep = False  # put to sleep by `sleep`, not yet woken by `ready`
        self._waking: asyncio.Future[None] | None = None

    @property
    def where(self) -> str:
        return f"node {self.client.node} GPU {self.gpu}"

    def __repr__(self) -> str:
        return f"RemoteJudge({self.where}, engine {self.index} at {self.client.url})"

    async def ready(self) -> None:
        """Wake the engine on its host after a rest (one call however many verdicts wait
        for it); nothing to do when it is awake."""
        if not self._asleep:
            return
        if self._waking is None:
            self._waking = asyncio.ensure_future(self._wake())
        await asyncio.shield(self._waking)

    async def _wake(self) -> None:
        try:
            await self.client.call("POST", f"/judges/{self.index}/ready")
            self._asleep = False
        except HostError as e:
            raise JudgeDied(f"the judge on {self.where} did not wake: {e}") from None
        finally:
            self._waking = None

    async def judge(self, request: JudgeRequest, request_id: str) -> Reading:
        body = {"request": request.to_dict(), "request_id": request_id}
        try:
            return await self._ask(self.client.session, body)
        except aiohttp.ClientError as e:
            first = e
        self.retried += 1
        try:
            async with self.client.fresh_session() as session:
                return await self._ask(session, body)
        except aiohttp.ClientError as e:
            second = e
        try:
            await self.client.health(timeout_s=self.client.timeouts.connect_s)
        except HostError as e:
            raise JudgeDied(f"the judge on {self.where}: its engine host {self.client.url} is lost: "
                            f"{type(first).__name__}: {first}, again {type(second).__name__}: {second}, "
                            f"and its health probe failed: {e.what}") from None
        raise RemoteJudgeError(f"the judge on {self.where} could not be reached twice "
                               f"({type(second).__name__}: {second}), though its host answers")

    async def _ask(self, session: aiohttp.ClientSession, body: dict[str, Any]) -> Reading:
        path = f"/judges/{self.index}/judge"
        try:
            async with session.post(self.client.url + path, json=body,
                                    timeout=self.client._timeout(None)) as resp:
                if resp.status == 410:
                    raise JudgeDied(f"the judge on {self.where} died: {(await resp.text())[:_BODY_EXCERPT]}")
                if resp.status >= 300:
                    raise RemoteJudgeError(f"the judge on {self.where}: HTTP {resp.status}: "
                                           f"{(await resp.text())[:_BODY_EXCERPT]}")
                answer = await resp.json()
        except aiohttp.ContentTypeError as e:
            raise RemoteJudgeError(f"the judge on {self.where} answered no JSON: {e}") from None
        try:
            return Reading(**answer)
        except TypeError as e:
            raise RemoteJudgeError(f"the judge on {self.where} answered {str(answer)[:_BODY_EXCERPT]}: {e}") from None

    async def restart(self, dead: Any = None) -> RemoteJudge:
        """Its host starts the dead engine again where it ran (`rpk.judge.pool.Relaunch`):
        the call lasts as long as the start; the engine it starts is awake."""
        await self.client.call("POST", f"/judges/{self.index}/restart", timeout_s=self.client.timeouts.weights_s)
        self._asleep = False
        return self

    async def sleep(self) -> None:
        """A sleep its host cannot make (the engine died, or the host is gone) is
        `JudgeDied`: the pool restarts the engine instead of stopping the rest."""
        try:
            await self.client.call("POST", f"/judges/{self.index}/sleep")
        except HostError as e:
            raise JudgeDied(f"the judge on {self.where} did not sleep: {e}") from None
        self._asleep = True

    async def aclose(self) -> None:
        """Stop the engine on its host; a host already gone is not an error here (its
        engines went with it). The node's client closes with its last user."""
        if self._shut:
            return
        self._shut = True
        await self.client.stop_and_release(f"/judges/{self.index}/shutdown")
