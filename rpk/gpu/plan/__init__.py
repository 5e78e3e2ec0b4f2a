"""The GPU memory plan: what each GPU and each node's RAM holds in each phase of a step,
as plain arithmetic. `pricing` is the cost model, `shared` what both layouts build alike,
`colocated` and `split` the two layouts and their searches, `explain` the tables and the
one-line refusals."""

from rpk.core.modes import Offload
from rpk.gpu.plan.colocated import plan_memory
from rpk.gpu.plan.pricing import HEADROOM_FRAC, USEFUL_SEQS, GiB, HostPlan, Knobs, Phase, PhasePlan, Resident, Stream
from rpk.gpu.plan.shared import MemoryPlan
from rpk.gpu.plan.split import plan_split, split_gpus
from rpk.gpu.shape import ModelShape, PlanRefused, Target

__all__ = [
    "GiB", "HEADROOM_FRAC", "USEFUL_SEQS", "HostPlan", "Knobs", "MemoryPlan", "ModelShape", "Offload", "Phase",
    "PhasePlan", "PlanRefused", "Resident", "Stream", "Target", "plan_memory", "plan_split", "split_gpus",
]
