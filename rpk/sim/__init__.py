"""Simulators that drive `rpk.loop` unchanged on virtual time: the engine and its
replicas on a node of devices (`engine`, costs in `cost`), a fleet of them (`fleet`),
and a trainer that trains nothing (`trainer`)."""

from rpk.sim.cost import CostModel, VirtualClock
from rpk.sim.engine import SimEngine, SimEngineError, SimNode

__all__ = ["CostModel", "SimEngine", "SimEngineError", "SimNode", "VirtualClock"]
