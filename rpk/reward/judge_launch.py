"""Where the judge's engines go and how they start, one engine per rollout GPU of a node.

The controller works the placement out once from the memory plan (`JudgeLaunch`: the
judge's settings, its per-GPU engine settings and the rollout GPUs) and every engine
node starts the same engines from it: node 0 in the controller's process, every other
node in its engine host (`rpk.cluster.host`), which receives the launch in the engine
spec. The only thing a node adds is its own `CUDA_VISIBLE_DEVICES`, through which each
engine is pinned to its GPU exactly as the rollout replicas are (`device_env`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from rpk.engine.placement import ReplicaPlace, device_env
from rpk.reward.judge import JudgeSettings
from rpk.reward.judge_vllm import JudgeDevice, JudgePool, VLLMJudge, VLLMRewardModel, start_pool


@dataclass(frozen=True, slots=True)
class JudgePlace:
    """One judge engine's GPU: the device id (this process's index), what pins it there,
    its settings, and its node where the run has several (None: one node)."""

    gpu: int
    env: Mapping[str, str | None]
    device: JudgeDevice
    node: int | None = None

    @property
    def name(self) -> str:
        where = f"GPU {self.gpu}"
        return where if self.node is None else f"node {self.node} {where}"


def places_on(devices: Sequence[int], device: JudgeDevice, visible: str | None,
              node: int | None = None) -> list[JudgePlace]:
    """A judge engine on each of `devices` (`visible`: this node's CUDA_VISIBLE_DEVICES)."""
    return [JudgePlace(d, device_env(ReplicaPlace(1, i, (d,)), "cuda", visible), device, node)
            for i, d in enumerate(devices)]


@dataclass(frozen=True, slots=True)
class JudgeLaunch:
    """What every engine node starts its judges from: the same on every node."""

    settings: JudgeSettings
    device: JudgeDevice
    devices: tuple[int, ...]  # each node's rollout GPUs (the same ids on every node)
    hub_cache: str | None = None
    seed: int = 0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> JudgeLaunch:
        d = json.loads(text)
        settings = dict(d["settings"], data_sources=tuple(d["settings"]["data_sources"]))
        return cls(JudgeSettings(**settings), JudgeDevice(**d["device"]), tuple(d["devices"]),
                   d["hub_cache"], d["seed"])

    def places(self, visible: str | None, node: int | None = None) -> list[JudgePlace]:
        return places_on(self.devices, self.device, visible, node)


def engine_kind(verdict: str) -> Any:
    """The engine class that reads `verdict`s: a reward model for `classify`, else vLLM's
    generative judge."""
    return VLLMRewardModel if verdict == "classify" else VLLMJudge


async def start_places(settings: JudgeSettings, places: Sequence[JudgePlace], *,
                       hub_cache: str | None, seed: int) -> JudgePool:
    """One engine per place, pinned there, started one after another (`start_pool`)."""
    kind = engine_kind(settings.verdict)

    def launcher(place: JudgePlace) -> Any:
        return lambda: kind.launch(settings, hub_cache=hub_cache, seed=seed, device=place.device, env=place.env)

    return await start_pool([launcher(p) for p in places], [p.name for p in places])


async def start_launch(launch: JudgeLaunch, visible: str | None, node: int | None = None) -> JudgePool:
    """`launch`'s engines on this node's rollout GPUs."""
    return await start_places(launch.settings, launch.places(visible, node),
                              hub_cache=launch.hub_cache, seed=launch.seed)
