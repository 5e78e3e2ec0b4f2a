"""Simulators that drive `rpk.loop` unchanged on virtual time."""

from rpk.sim.engine import CostModel, SimEngine, SimEngineError, VirtualClock

__all__ = ["CostModel", "SimEngine", "SimEngineError", "VirtualClock"]
