"""Simulators that drive `rpk.loop` unchanged on virtual time: the engine and its
replicas on a node of devices (`engine`, costs in `cost`), their speculative decoding
(`spec`, its acceptance calibrated to published figures in `accept`), a fleet of them (`fleet`),
a trainer that trains nothing (`trainer`), and what a judge LLM costs on a GPU,
resident or layer-streamed, colocated or dedicated (`judge`)."""

from rpk.sim.cost import CostModel, VirtualClock
from rpk.sim.engine import SimEngine, SimEngineError, SimNode
from rpk.sim.spec import SimSpec, SoloFleet

__all__ = ["CostModel", "SimEngine", "SimEngineError", "SimNode", "SimSpec", "SoloFleet", "VirtualClock"]
