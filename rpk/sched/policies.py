"""The table of round policies: each `rollout.policy` name, the options a policy may read,
and the factory that builds it (the classes themselves live in rpk/sched/policy.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rpk.core.drafts import DraftSource
from rpk.core.records import Prompt
from rpk.sched.policy import (
    LengthAwarePolicy,
    OversamplePolicy,
    PartialPolicy,
    Policy,
    Sampling,
    SyncPolicy,
    TailPolicy,
    _Speculative,
)
from rpk.sched.provision import EtaBounds
from rpk.sched.speculate import SpecRule, Speculation
from rpk.sched.toolwait import LatencyModel


@dataclass(frozen=True, slots=True)
class PolicyOptions:
    """The knobs a policy may read beyond `Sampling` (each reads only its own)."""

    eta_prompts: float = 1.25
    eta_responses: float = 1.25
    shuffle: bool = True
    # length_aware only
    lookahead_rounds: int = 10
    adaptive_eta: bool = True
    eta_bounds: EtaBounds = EtaBounds()
    concurrency: int = 512
    tool_latency: LatencyModel | None = None  # the task's tool's, where configured
    tool_timeout_s: float | None = None  # a multi-turn run's agent.tool_timeout_s
    # the speculative tail: its draft sources and how it plans (None: off)
    spec_sources: frozenset[DraftSource] = frozenset()
    spec_rule: SpecRule | None = None


PolicyFactory = Callable[[Sequence[Prompt], Sampling, PolicyOptions], Policy]


def _speculative(cls: type[_Speculative]) -> PolicyFactory:
    def make(prompts: Sequence[Prompt], sampling: Sampling, o: PolicyOptions) -> Policy:
        return cls(
            prompts, sampling, eta_prompts=o.eta_prompts, eta_responses=o.eta_responses,
            shuffle=o.shuffle,
        )

    return make


def _length_aware(prompts: Sequence[Prompt], sampling: Sampling, o: PolicyOptions) -> Policy:
    return LengthAwarePolicy(
        prompts, sampling, lookahead_rounds=o.lookahead_rounds, bounds=o.eta_bounds,
        adaptive=o.adaptive_eta, eta_prompts=o.eta_prompts, eta_responses=o.eta_responses,
        concurrency=o.concurrency, shuffle=o.shuffle, tool_latency=o.tool_latency,
        tool_timeout_s=o.tool_timeout_s,
    )


# Each `rollout.policy` name and what builds it; the config checks names against it.
POLICIES: dict[str, PolicyFactory] = {
    TailPolicy.name: _speculative(TailPolicy),
    SyncPolicy.name: lambda prompts, s, o: SyncPolicy(prompts, s, shuffle=o.shuffle),
    OversamplePolicy.name: _speculative(OversamplePolicy),
    PartialPolicy.name: _speculative(PartialPolicy),
    LengthAwarePolicy.name: _length_aware,
}


def make_policy(
    name: str, prompts: Sequence[Prompt], sampling: Sampling, options: PolicyOptions
) -> Policy:
    """The policy registered under `name`; KeyError naming the choices otherwise."""
    factory = POLICIES.get(name)
    if factory is None:
        raise KeyError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    policy = factory(prompts, sampling, options)
    if options.spec_rule is not None:
        policy.speculation = Speculation(options.spec_sources, options.spec_rule, options.concurrency)
    return policy
