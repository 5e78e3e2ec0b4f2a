"""Trajectories on virtual time: tools whose calls take the latency model's seconds on
the simulator's clock, so that `AgentEngine` (the same one a run drives), the round
loop and the policies run multi-turn rounds at any scale with no model and no tools.

`SimToolEnvs` makes one `SimToolEnv` per trajectory. A trajectory makes
`calls_of(prompt)` tool calls, one per model turn, then answers (its last turn calls
nothing). Each call takes its trajectory's draw of the latency model
(`rpk.sched.toolwait.LatencyDraws`, keyed on a hash of the prompt and the trajectory's
number among that prompt's) in virtual time, so a simulated run replays exactly; a call
that would take `timeout_s` or more (or never answer) ends at `timeout_s` as a timeout
observation, as `agent.tool_timeout_s` ends a real one.
Observations are `observation_tokens` tokens (`SimObservation`): the engine needs
their length, not their text.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rpk.agent.env import EnvStep
from rpk.agent.template import Encoded
from rpk.core.records import Prompt, ToolUse
from rpk.sched.toolwait import LatencyDraws, LatencyModel
from rpk.sim.node import SimNode

_OBSERVATION_ID = 5


@dataclass(frozen=True, slots=True)
class SimObservation:
    """The encoder `AgentEngine` needs, for a simulated run: every observation is
    `tokens` tokens long."""

    tokens: int = 8

    def encode(self, observation: Sequence[object], closed: bool = True) -> Encoded:
        return Encoded((_OBSERVATION_ID,) * self.tokens, "")

    def ends_turn(self, token_id: int | None) -> bool:
        return True


class SimToolEnv:
    """One trajectory's tools on the node's virtual clock; its calls and seed come with
    its prompt, at `reset`."""

    def __init__(self, envs: SimToolEnvs) -> None:
        self.envs = envs
        self.calls = 0
        self.wait: Callable[[int], float] = lambda call: 0.0
        self.made = 0
        self.closed = False

    async def reset(self, prompt: Prompt) -> None:
        self.calls, self.wait = self.envs.calls_of(prompt), self.envs.draws.start(prompt.uid)

    async def step(self, turn_text: str) -> EnvStep:
        if self.made >= self.calls:
            return EnvStep(done=True)
        envs = self.envs
        seconds = self.wait(self.made)
        self.made += 1
        hung = seconds >= envs.timeout_s
        seconds = min(seconds, envs.timeout_s)
        await envs.node.sleep_until(envs.node.clock.now() + seconds)
        text = f"error: timeout after {envs.timeout_s} s" if hung else "ok"
        return EnvStep(({"role": "tool", "content": text},),
                       tools=ToolUse(calls=1, failures=int(hung), seconds=seconds))

    async def close(self) -> None:
        self.closed = True


class SimToolEnvs:
    """The environment factory of a simulated multi-turn run (`AgentEngine.env_factory`):
    the n-th trajectory of a prompt to reset draws with the seed of (prompt, n)."""

    def __init__(self, node: SimNode, latency: LatencyModel, calls_of: Callable[[Prompt], int],
                 timeout_s: float) -> None:
        self.node, self.calls_of, self.timeout_s = node, calls_of, timeout_s
        self.draws = LatencyDraws(latency, _hashed)
        self.made: list[SimToolEnv] = []

    def __call__(self) -> SimToolEnv:
        self.made.append(SimToolEnv(self))
        return self.made[-1]


def _hashed(uid: object, n: int) -> int:
    """The key of trajectory `n` of prompt `uid`: a hash, as the simulator has always
    drawn (a run's tools key on `row seed/n`)."""
    digest = hashlib.blake2b(f"{uid}:{n}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
