"""Simulators that drive `rpk.loop` unchanged on virtual time: the engine (`engine`) and
a trainer that trains nothing (`trainer`)."""

from rpk.sim.engine import CostModel, SimEngine, SimEngineError, VirtualClock

__all__ = ["CostModel", "SimEngine", "SimEngineError", "VirtualClock"]
