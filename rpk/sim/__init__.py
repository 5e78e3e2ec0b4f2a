"""Simulators that drive `rpk.loop` unchanged on virtual time: the engine and its
replicas on a node of devices (`engine`, costs in `cost`), their speculative decoding
(`spec`, its acceptance calibrated to published figures in `accept`), a fleet of them (`fleet`),
a trainer that trains nothing (`trainer`), and what a judge LLM costs on a GPU,
resident or layer-streamed, colocated or dedicated (`judge`).

No module of a run imports this package: it serves the benchmarks (bench/: policies,
scale and GPU figures no CPU machine can run for real) and the tests (the loop and
the schedulers on virtual time). It lives in rpk, not bench/, because it implements
rpk's own protocols (`rpk.core.protocols.Engine`, `rpk.engine.replica.Replica`) and
must change with them."""

from rpk.sim.cost import CostModel, VirtualClock
from rpk.sim.engine import SimEngine
from rpk.sim.fleet import SoloFleet
from rpk.sim.node import SimEngineError, SimNode
from rpk.sim.spec import SimSpec

__all__ = ["CostModel", "SimEngine", "SimEngineError", "SimNode", "SimSpec", "SoloFleet", "VirtualClock"]
