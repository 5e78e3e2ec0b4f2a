"""`AgentEngine`: multi-turn trajectories behind the plain `Engine` protocol.

The round loop (`RoundBook` + `run_round`) does not know trajectories exist: it starts
requests together, streams each as deltas, and aborts what it no longer needs. Here a
request is a whole trajectory. `start` starts every trajectory's first turn on the inner
engine in one call (so a round's requests start together, as before) and returns, per
request, an async generator that drives the rest: model turn -> environment step ->
observation -> next turn, each next turn a request of its own on the inner engine whose
prompt is the exact context so far (token in, token out; `rpk.agent.trajectory`).

The generator runs inside the round driver's task for that request; no task of its own.
So when the round aborts a trajectory, the cancellation lands wherever the trajectory
waits (an inner turn's stream, an environment step, a tool call) and the generator's
`finally` aborts the current inner turn and closes the environment. `abort(rid)` covers
a trajectory whose generator never ran: it aborts the first turn.

What the round sees per trajectory: the model's tokens as sampled (observation=False),
each observation's encoded ids (observation=True, log-probs 0.0), then an empty last
delta with the finish reason and the `TurnStats`. `rpk.loop.rollout.Received` turns
that into `Response.loss_mask` and `Response.turns`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from rpk.agent.env import EnvFactory, Environment, EnvStep
from rpk.agent.template import Encoded
from rpk.agent.trajectory import Trajectory
from rpk.core.protocols import Engine, WeightBucket
from rpk.core.records import GenDelta, GenRequest, Prompt, ToolUse


class Encoder(Protocol):
    """What the engine needs of `rpk.agent.template.ObservationEncoder`."""

    def encode(self, observation: Sequence[Mapping], closed: bool = True) -> Encoded: ...

    def ends_turn(self, token_id: int | None) -> bool: ...


class Activity:
    """Wall clocks of the trajectories in flight. `idle(now)`: seconds when some
    trajectory was live and no model turn decoded anywhere (the engine's bubble).
    `exposed(now)`: of those, the seconds when some trajectory waited on its environment
    (its tools): tool time that generation did not hide. Both count wall time once,
    however many trajectories wait together."""

    def __init__(self, now: float) -> None:
        self.live = 0
        self.decoding = 0
        self.acting = 0
        self._idle = 0.0
        self._exposed = 0.0
        self._since = now

    def _advance(self, now: float) -> None:
        if self.live and not self.decoding:
            self._idle += now - self._since
            if self.acting:
                self._exposed += now - self._since
        self._since = now

    def idle(self, now: float) -> float:
        self._advance(now)
        return self._idle

    def exposed(self, now: float) -> float:
        self._advance(now)
        return self._exposed

    def change(self, now: float, live: int = 0, decoding: int = 0, acting: int = 0) -> None:
        self._advance(now)
        self.live += live
        self.decoding += decoding
        self.acting += acting
        if min(self.live, self.decoding, self.acting) < 0:
            raise RuntimeError(f"activity counts fell below 0: live={self.live} "
                               f"decoding={self.decoding} acting={self.acting}")


@dataclass(slots=True)
class _Live:
    """A started trajectory: its state, its inner turn request and that turn's stream."""

    traj: Trajectory
    prompt: Prompt
    inner_rid: str
    stream: AsyncIterator[GenDelta]
    inner_running: bool = True
    env: Environment | None = None


@dataclass(eq=False, repr=False, slots=True)
class AgentEngine:
    """Runs each request as a trajectory of up to `max_turns` model turns on `inner`,
    answered by an environment from `env_factory` (one per trajectory); `prompts` are
    the rows by uid (`GenRequest.prompt_uid`), which the environment is reset with.
    `step_timeout_s` bounds one environment step (None: the environment bounds itself,
    as `ToolEnv` does per call); a step that fails or times out ends the trajectory and
    counts as a tool failure, and the first failure of each kind is said in `log`."""

    inner: Engine
    env_factory: EnvFactory
    encoder: Encoder
    prompts: Mapping[str, Prompt]
    max_turns: int
    step_timeout_s: float | None = None
    clock: Callable[[], float] = time.monotonic
    log: Callable[[str], None] | None = None
    # Each trajectory's tokens so far (turns and observations) once an observation is in,
    # with its prompt: the speculative tail's drafts for its siblings further behind.
    on_turn: Callable[[Prompt, tuple[int, ...]], None] | None = None
    _live: dict[str, _Live] = field(default_factory=dict, init=False)
    _failures_said: set[str] = field(default_factory=set, init=False)
    activity: Activity = field(init=False)
    _lapped: tuple[float, float] = field(default=(0.0, 0.0), init=False)

    def __post_init__(self) -> None:
        self.activity = Activity(self.clock())

    def lap(self) -> dict[str, float]:
        """The step record's wall clocks since the last lap: `engine_idle_s` (trajectories
        in flight, no model turn decoding) and `tool_exposed_s` (of that, some trajectory
        waiting on a tool)."""
        now = self.clock()
        idle, exposed = self.activity.idle(now), self.activity.exposed(now)
        last_idle, last_exposed = self._lapped
        self._lapped = (idle, exposed)
        return {"engine_idle_s": idle - last_idle, "tool_exposed_s": exposed - last_exposed}

    @property
    def max_concurrency(self) -> int:
        return self.inner.max_concurrency

    async def update_weights(self, buckets: AsyncIterable[WeightBucket], version: int) -> None:
        await self.inner.update_weights(buckets, version)

    async def shutdown(self) -> None:
        await self.inner.shutdown()

    def _prompt(self, request: GenRequest) -> Prompt:
        prompt = self.prompts.get(request.prompt_uid)
        if prompt is None:
            raise ValueError(
                f"request {request.request_id}: prompt_uid {request.prompt_uid!r} is not a "
                f"prompt this agent engine knows ({len(self.prompts)} prompts); a multi-turn "
                "environment is reset with the request's row"
            )
        return prompt

    async def start(self, requests: Sequence[GenRequest]) -> dict[str, AsyncIterator[GenDelta]]:
        if taken := [r.request_id for r in requests if r.request_id in self._live]:
            raise ValueError(f"trajectories already running: {taken}")
        prompts = [self._prompt(r) for r in requests]
        trajs = [Trajectory(r, self.max_turns) for r in requests]
        firsts = [t.next_request() for t in trajs]
        streams = await self.inner.start(firsts)
        self.activity.change(self.clock(), live=len(firsts), decoding=len(firsts))
        for traj, prompt, first in zip(trajs, prompts, firsts):
            self._live[traj.request_id] = _Live(traj, prompt, first.request_id,
                                                streams[first.request_id])
        return {t.request_id: self._drive(self._live[t.request_id]) for t in trajs}

    async def abort(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is not None:
            await self._release(live)

    async def _release(self, live: _Live) -> None:
        """Stop what the trajectory still holds: its running inner turn, its environment.
        Idempotent. It runs while the round cancels the trajectory, and the round may
        cancel it again meanwhile (a sibling's finish, then the round's end): the work
        runs to its end regardless, so no environment is left open."""
        if self._live.get(live.traj.request_id) is live:
            del self._live[live.traj.request_id]
            self.activity.change(self.clock(), live=-1)
        abort = live.inner_rid if live.inner_running else None
        self._turn_over(live)
        env, live.env = live.env, None
        if abort is None and env is None:
            return
        work = asyncio.ensure_future(self._stop(abort, env))
        cancelled = False
        while not work.done():
            try:
                await asyncio.shield(work)
            except asyncio.CancelledError:
                cancelled = True
        if cancelled:
            raise asyncio.CancelledError
        work.result()

    async def _stop(self, inner_rid: str | None, env: Environment | None) -> None:
        try:
            if inner_rid is not None:
                await self.inner.abort(inner_rid)
        finally:
            if env is not None:
                await env.close()

    async def _drive(self, live: _Live) -> AsyncIterator[GenDelta]:
        traj, rid = live.traj, live.traj.request_id
        accepted = 0  # drafted tokens its turns accepted (speculative decoding)
        try:
            live.env = self.env_factory()
            await live.env.reset(live.prompt)
            while True:
                reason = None
                async with contextlib.aclosing(live.stream) as stream:
                    async for d in stream:
                        traj.sampled(d.token_ids, d.logprobs, d.text)
                        if d.token_ids or d.text:
                            yield GenDelta(rid, d.token_ids, d.logprobs, d.text)
                        if d.finished:
                            reason, accepted = d.finish_reason, accepted + d.accepted
                            break
                self._turn_over(live)  # ended (or its stream did): nothing to abort
                if not traj.end_turn(reason):
                    break
                step = await self._step(live.env, traj)
                traj.acted(step)
                if traj.finished:
                    break
                encoded = self.encoder.encode(step.observation,
                                              closed=self.encoder.ends_turn(traj.last_id))
                kept = traj.observe(encoded.token_ids)
                # A cut observation ends the trajectory; its text would be a lie.
                text = encoded.text if len(kept) == len(encoded.token_ids) else ""
                yield GenDelta(rid, kept, (0.0,) * len(kept), text, observation=True)
                if traj.finished:
                    break
                if self.on_turn is not None:
                    self.on_turn(live.prompt, tuple(traj.response_ids))
                request = traj.next_request()
                streams = await self.inner.start([request])
                live.inner_rid, live.stream = request.request_id, streams[request.request_id]
                live.inner_running = True
                self.activity.change(self.clock(), decoding=1)
            yield GenDelta(rid, (), (), finished=True, finish_reason=traj.reason,
                           turns=traj.stats(), accepted=accepted)
        finally:
            await self._release(live)

    def _turn_over(self, live: _Live) -> None:
        if live.inner_running:
            live.inner_running = False
            self.activity.change(self.clock(), decoding=-1)

    async def _step(self, env: Environment, traj: Trajectory) -> EnvStep:
        """The environment's answer, with the part of its time that nothing decoded
        beside it; a failing or hanging one ends the trajectory, counted as a failed
        tool call (a step never fails the round)."""
        started = self.clock()
        idle = self.activity.idle(started)
        self.activity.change(started, acting=1)
        try:
            async with asyncio.timeout(self.step_timeout_s):
                step = await env.step(traj.text())
        except Exception as e:
            self._say_failure(traj, e)
            step = EnvStep(done=True, tools=ToolUse(calls=1, failures=1, seconds=self.clock() - started))
        finally:
            self.activity.change(self.clock(), acting=-1)
        exposed = self.activity.idle(self.clock()) - idle
        tools = dataclasses.replace(step.tools, exposed_s=min(exposed, step.tools.seconds))
        return dataclasses.replace(step, tools=tools)

    def _say_failure(self, traj: Trajectory, error: Exception) -> None:
        """A failed step ends its trajectory without failing the round; a broken
        environment would then go unseen, so each kind of failure is said once."""
        kind = type(error).__name__
        if self.log is None or kind in self._failures_said:
            return
        self._failures_said.add(kind)
        what = "timed out" if isinstance(error, TimeoutError) else f"failed: {kind}: {error}"
        self.log(f"agent: an environment step of {traj.request_id} {what}; the trajectory ends as "
                 f"a failed tool call (later {kind}s are counted in tool_failures, not said)")
