"""Noticing a lost node: the controller's watch over the other nodes' engine hosts.

A node that dies mid-round shows at once: its host's streams drop (`HostError`). One
that dies while nothing flows to it (during training, a weight sync, a validation on
other nodes) would show only at the next trainer collective, and one that hangs only at
`dist.timeout_s`. So the controller checks every host's health every `interval_s`
beside the step loop, and `misses` failed checks in a row stop the run, naming the node:
a lost node stops the run within about `interval_s * misses + timeout_s` seconds.

A host dies with its node's rank (it is that rank's child), so when a trainer
collective fails, `diagnose` asks the hosts which node is gone, to name it.

`Misses` is the rule (pure); `watch_hosts` and `diagnose` are the thin async drivers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field

from rpk.cluster.remote import HostClient, HostError
from rpk.core.errors import NodeFailure


@dataclass(slots=True)
class Misses:
    """Failed health checks in a row, per node; `limit` of them lose the node."""

    limit: int
    counts: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise ValueError(f"misses must be >= 1, got {self.limit!r}")

    def seen(self, node: int, error: HostError | None) -> NodeFailure | None:
        """One check of `node` (`error`: it failed). The node's failure once it missed
        `limit` checks in a row, else None."""
        if error is None:
            self.counts[node] = 0
            return None
        self.counts[node] = n = self.counts.get(node, 0) + 1
        if n < self.limit:
            return None
        return NodeFailure(node, f"{error.what} ({n} health checks in a row failed)")


async def _check(client: HostClient, timeout_s: float) -> HostError | None:
    try:
        await client.health(timeout_s=timeout_s)
    except HostError as e:
        return e
    return None


async def watch_hosts(
    hosts: Mapping[int, HostClient], *, interval_s: float, misses: int, timeout_s: float
) -> None:
    """Check every host every `interval_s` until cancelled; raise the first node's
    `NodeFailure` once it missed `misses` checks in a row."""
    rule = Misses(misses)
    nodes = sorted(hosts)
    while True:
        errors = await asyncio.gather(*(_check(hosts[n], timeout_s) for n in nodes))
        for node, error in zip(nodes, errors):
            if (lost := rule.seen(node, error)) is not None:
                raise lost
        await asyncio.sleep(interval_s)


async def diagnose(hosts: Mapping[int, HostClient], timeout_s: float) -> NodeFailure | None:
    """After a failure that names no node (a trainer collective): the first node whose
    host does not answer, or None when every host does."""
    nodes = sorted(hosts)
    errors = await asyncio.gather(*(_check(hosts[n], timeout_s) for n in nodes))
    for node, error in zip(nodes, errors):
        if error is not None:
            return NodeFailure(node, error.what)
    return None
