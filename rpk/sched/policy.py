"""Round scheduling policies: which prompts a step launches, how many responses each,
and what happens to prompts a round did not finish.

Plain synchronous code over explicit state (the dataset cursor, the long-prompt queue,
counters): no I/O, no awaits, so a policy is unit-tested on its own and its state goes
into checkpoints.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from rpk.core.outcomes import RoundPlan, RoundResult
from rpk.core.records import Carried, FinishReason, Prompt, RoundKind
from rpk.sched.cursor import PromptCursor
from rpk.sched.predictor import LengthPredictor
from rpk.sched.provision import CostCurve, EtaBounds, EtaChooser, Provision, fixed
from rpk.sched.speculate import Speculation
from rpk.sched.toolwait import CallLog, LatencyModel, ToolWait


class Policy(Protocol):
    """What the step loop asks of a round scheduling policy."""

    name: str
    # The speculative tail's plan state (`rpk.sched.speculate`), None without it.
    speculation: Speculation | None

    def plan(self, step: int) -> RoundPlan: ...

    def commit(self, result: RoundResult) -> None: ...

    def next_kind(self) -> RoundKind:
        """The kind `plan` will give the next round, without planning it (no prompt is
        drawn): the engine's layout for that round is chosen before the weight sync."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    def metrics(self) -> dict[str, float | str]: ...


@dataclass(frozen=True, slots=True)
class Sampling:
    """What every round of a policy shares."""

    prompts_per_step: int  # P0
    responses_per_prompt: int  # R0
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    # DAPO's dynamic sampling: a group whose rewards are all equal has no advantage to
    # learn from, so it is neither trained nor counted towards P0 (nor queued again).
    drop_zero_variance: bool = False


class _CursorPolicy:
    """Shared by the policies: the prompts, a seeded cursor over them, and plan-building."""

    name = ""
    # Partial rollout keeps the tokens of cut-off requests for the next round.
    keeps_partial = False

    def __init__(self, prompts: Sequence[Prompt], sampling: Sampling, shuffle: bool = True):
        self.prompts = prompts
        self.s = sampling
        self.cursor = PromptCursor(len(prompts), sampling.seed, shuffle)
        self._index = {p.uid: i for i, p in enumerate(prompts)}
        if len(self._index) != len(prompts):
            raise ValueError("prompt uids must be unique")
        # The speculative tail (`make_policy` sets it): each prompt's stored draft texts
        # go into its round's plan.
        self.speculation: Speculation | None = None

    def _plan(
        self,
        step: int,
        kind: RoundKind,
        indices: Sequence[int],
        launched: int,
        needed: int,
        carried: tuple[tuple[Carried, ...], ...] = (),
        launch: tuple[int, ...] = (),
        defer_after: int = 0,
    ) -> RoundPlan:
        spec = self.speculation
        chosen = [self.prompts[i] for i in indices]
        return RoundPlan(
            step=step,
            kind=kind,
            prompts=tuple(chosen),
            responses_per_prompt=launched,
            group_size=self.s.responses_per_prompt,
            groups_needed=needed,
            max_tokens=self.s.max_tokens,
            temperature=self.s.temperature,
            top_p=self.s.top_p,
            seed=self.s.seed,
            carried=carried,
            keep_partial=self.keeps_partial,
            drop_zero_variance=self.s.drop_zero_variance,
            launch=launch,
            defer_after=defer_after,
            drafts=spec.drafts(chosen) if spec is not None else (),
        )

    def commit(self, result: RoundResult) -> None:
        """The round's result into the policy's state (and the speculation's)."""
        if self.speculation is not None:
            self.speculation.observe(result)
        self._commit(result)

    def _commit(self, result: RoundResult) -> None:
        raise NotImplementedError

    def _check_complete(self, result: RoundResult) -> None:
        if result.incomplete:
            raise RuntimeError(
                f"{result.plan.kind.value} round of step {result.plan.step} left "
                f"{len(result.incomplete)} of {len(result.plan.prompts)} prompts incomplete"
            )

    def metrics(self) -> dict[str, float | str]:
        """Policy state worth a column in metrics.jsonl."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        spec = self.speculation
        return {"policy": self.name, "cursor": self.cursor.state_dict(),
                **({"speculation": spec.state_dict()} if spec is not None else {})}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("policy") != self.name:
            raise ValueError(
                f"checkpoint was made with policy {state.get('policy')!r}, not {self.name!r}"
            )
        self.cursor.load_state_dict(state["cursor"])
        # A checkpoint made without speculation starts this one's state afresh.
        if self.speculation is not None and "speculation" in state:
            self.speculation.load_state_dict(state["speculation"])


class SyncPolicy(_CursorPolicy):
    """veRL's synchronous step: P0 prompts x R0 responses, every response runs to the
    end of its length budget, so the step waits for its longest response."""

    name = "sync"

    def plan(self, step: int) -> RoundPlan:
        p0 = self.s.prompts_per_step
        return self._plan(step, RoundKind.SYNC, self.cursor.take(p0), self.s.responses_per_prompt, p0)

    def next_kind(self) -> RoundKind:
        return RoundKind.SYNC

    def _commit(self, result: RoundResult) -> None:
        self._check_complete(result)


class _Speculative(_CursorPolicy):
    """Short rounds that over-provision: ceil(eta_p * P0) prompts x ceil(eta_r * R0)
    responses, ending when P0 groups of R0 are complete."""

    def __init__(
        self,
        prompts: Sequence[Prompt],
        sampling: Sampling,
        *,
        eta_prompts: float = 1.25,
        eta_responses: float = 1.25,
        shuffle: bool = True,
    ) -> None:
        super().__init__(prompts, sampling, shuffle)
        if eta_prompts < 1 or eta_responses < 1:
            raise ValueError(
                f"eta_prompts and eta_responses must be >= 1, got {eta_prompts}, {eta_responses}"
            )
        self.eta_prompts = eta_prompts
        self.eta_responses = eta_responses

    @property
    def short_prompts(self) -> int:
        return math.ceil(self.eta_prompts * self.s.prompts_per_step - 1e-9)

    @property
    def short_responses(self) -> int:
        return math.ceil(self.eta_responses * self.s.responses_per_prompt - 1e-9)

    def _short(self, step: int) -> RoundPlan:
        fresh = self.cursor.take(self.short_prompts)
        return self._plan(
            step, RoundKind.SHORT, fresh, self.short_responses, self.s.prompts_per_step
        )

    def _unfinished(self, result: RoundResult) -> list[int]:
        return [self._index[p.uid] for p in result.incomplete]

    def next_kind(self) -> RoundKind:
        return RoundKind.SHORT


class OversamplePolicy(_Speculative):
    """veRL's `over_sample_rate` / slime's over-sampling: every round is a short round,
    and the prompts it did not finish are dropped. What is lost: those prompts are never
    trained in this epoch, and the dropped ones are the long-tail prompts, so training
    is biased towards short answers. `prompts_dropped_total` counts them."""

    name = "oversample"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dropped = 0

    def plan(self, step: int) -> RoundPlan:
        return self._short(step)

    def _commit(self, result: RoundResult) -> None:
        self.dropped += len(self._unfinished(result))

    def metrics(self) -> dict[str, float | str]:
        return {"prompts_dropped_total": float(self.dropped)}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "dropped": self.dropped}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.dropped = int(state["dropped"])


class TailPolicy(_Speculative):
    """RollPacker's tail batching.

    Short round: launch ceil(eta_p * P0) fresh prompts with ceil(eta_r * R0) responses
    each; a prompt's group is its first R0 responses to finish, the round ends when P0
    groups are complete, and everything else is aborted at once. Prompts without a
    complete group join the long-prompt queue (FIFO, one entry per prompt); their partial
    tokens are dropped, so the long round regenerates them with the newest weights and
    training stays on-policy. Long round: once the queue holds P0 prompts, the next step
    takes P0 of them with exactly R0 responses, no speculation, full length budget.
    No prompt is dropped, only reordered."""

    name = "tail"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.queue: deque[int] = deque()

    def plan(self, step: int) -> RoundPlan:
        p0 = self.s.prompts_per_step
        if self.next_kind() is RoundKind.LONG:
            chosen = [self.queue.popleft() for _ in range(p0)]
            return self._plan(step, RoundKind.LONG, chosen, self.s.responses_per_prompt, p0)
        return self._short(step)

    def next_kind(self) -> RoundKind:
        return RoundKind.LONG if len(self.queue) >= self.s.prompts_per_step else RoundKind.SHORT

    def _commit(self, result: RoundResult) -> None:
        if result.plan.kind is RoundKind.LONG:
            self._check_complete(result)
            return
        self.queue.extend(self._unfinished(result))

    def metrics(self) -> dict[str, float | str]:
        return {"queue_size": float(len(self.queue))}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "queue": list(self.queue)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.queue = deque(int(i) for i in state["queue"])


class PartialPolicy(_Speculative):
    """APRIL-style partial rollout (slime's `--partial-rollout`).

    Every round launches ceil(eta_p * P0) prompts, prompts carried over from the last
    round first, with R0 responses each, and ends once P0 prompts have all R0 responses.
    A prompt it leaves incomplete is carried whole into the next round: its finished
    responses as they are, its cut-off ones continued from their tokens. Nothing is
    wasted and no prompt is dropped, but a continued response mixes tokens of two or
    more policy versions: each token keeps the version that sampled it (and its
    behaviour log-prob, which the PPO ratio corrects with), and the step records count
    how many off-policy tokens were trained."""

    name = "partial"
    keeps_partial = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # FIFO of (prompt index, what its responses carry), oldest first.
        self.carry: deque[tuple[int, tuple[Carried, ...]]] = deque()

    def plan(self, step: int) -> RoundPlan:
        carried = [self.carry.popleft() for _ in range(min(len(self.carry), self.short_prompts))]
        fresh = self.cursor.take(max(0, self.short_prompts - len(carried)))
        indices = [i for i, _ in carried] + list(fresh)
        slots = tuple(c for _, c in carried) + ((),) * len(fresh)
        needed = min(self.s.prompts_per_step, len(indices))
        return self._plan(
            step, RoundKind.SHORT, indices, self.s.responses_per_prompt, needed, slots
        )

    def _commit(self, result: RoundResult) -> None:
        self.carry.extend(
            (self._index[p.uid], c) for p, c in zip(result.incomplete, result.carry, strict=True)
        )

    def metrics(self) -> dict[str, float | str]:
        return {
            "carried_prompts": float(len(self.carry)),
            "carried_tokens": float(sum(len(c.token_ids) for _, cs in self.carry for c in cs)),
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "carry": [[i, [_carried_to_json(c) for c in cs]] for i, cs in self.carry],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.carry = deque(
            (int(i), tuple(_carried_from_json(c) for c in cs)) for i, cs in state["carry"]
        )


class LengthAwarePolicy(_CursorPolicy):
    """Tail batching that predicts response lengths (`rollout.policy length_aware`).

    Prompts are drawn `lookahead_rounds` x P0 at a time and their lengths guessed
    (rpk.sched.predictor, learned online). The P0 guessed longest of a draw are never
    launched in a short round: they make the draw's last round, the long round (R0
    each, full budget, no speculation), as in RollPacker. Each short round takes one
    prompt from every band of the rest's guesses (`spread_order`), not the shortest
    left: rounds packed shortest first made each gradient step a narrow band of
    lengths, in the same order every draw, and lost validation accuracy against sync
    (issue 22). Speculation is chosen per short round (rpk.sched.provision): extra
    prompts, extra responses for the prompts whose guess is unsure, and a
    `defer_after` cap that gives up a prompt turning out long as soon as it can no
    longer complete. A prompt left unfinished goes back to the pending ones with a
    floor on its guess and runs later in the same draw, at the latest in its long
    round. So every prompt of a draw is trained exactly once within lookahead_rounds
    steps, on-policy (cut-off tokens are discarded); with dynamic sampling a draw may
    come up short and its rest joins the next draw."""

    name = "length_aware"

    def __init__(
        self,
        prompts: Sequence[Prompt],
        sampling: Sampling,
        *,
        lookahead_rounds: int = 10,
        bounds: EtaBounds = EtaBounds(),
        adaptive: bool = True,
        eta_prompts: float = 1.25,
        eta_responses: float = 1.25,
        concurrency: int = 512,
        shuffle: bool = True,
        tool_latency: LatencyModel | None = None,
        tool_timeout_s: float | None = None,
    ) -> None:
        super().__init__(prompts, sampling, shuffle)
        if lookahead_rounds < 1 or concurrency < 1:
            raise ValueError(
                f"lookahead_rounds and concurrency must be >= 1, got {lookahead_rounds}, "
                f"{concurrency}"
            )
        if tool_latency is not None and tool_timeout_s is None:
            raise ValueError("a tool latency is priced with the timeout that ends a hung call: "
                             "give tool_timeout_s")
        self.lookahead = lookahead_rounds
        self.adaptive = adaptive
        self.fixed_eta = (eta_prompts, eta_responses)
        self.concurrency = concurrency
        self.pending: list[int] = []  # drawn, not yet trained (dataset indices)
        self.predictor = LengthPredictor(sampling.max_tokens)
        self.cost = CostCurve()
        self.chooser = EtaChooser(bounds)
        self.provision: Provision | None = None
        self.step_s = 0.0  # a decode step's seconds, as the rounds showed (0: not yet)
        # Trajectories' tool calls: one call's latency as configured for the task's tool,
        # else as the rounds show it (`calls`, when a timeout is known to tell hung calls).
        self.tool_latency = tool_latency
        self.calls = CallLog(tool_timeout_s) if tool_timeout_s is not None else None

    def _draw(self) -> int:
        """How many prompts the next plan draws: none while P0 are pending, else at most
        an epoch's worth, so that a draw holds a prompt once (or twice, where it
        straddles two epochs)."""
        p0 = self.s.prompts_per_step
        if len(self.pending) >= p0:
            return 0
        return max(1, min(self.lookahead, len(self.prompts) // p0)) * p0

    def next_kind(self) -> RoundKind:
        # The long round is a draw's last P0 prompts, those guessed longest.
        last = len(self.pending) + self._draw() == self.s.prompts_per_step
        return RoundKind.LONG if last else RoundKind.SHORT

    def plan(self, step: int) -> RoundPlan:
        p0, r0 = self.s.prompts_per_step, self.s.responses_per_prompt
        kind = self.next_kind()
        self.pending += self.cursor.take(self._draw())
        step_s = self._step_s()
        # A trajectory costs its tokens and its tool waits: the waits, in decode steps'
        # time, lengthen its guess, so packing, the long round and provisioning see them.
        raw = {i: self.predictor.predict(self.prompts[i]) for i in self.pending}
        guesses = {i: g.waiting(g.tool_s / step_s) if step_s > 0 else g for i, g in raw.items()}
        order = sorted(self.pending, key=lambda i: guesses[i].key)  # ties: draw order
        if kind is RoundKind.SHORT:
            order = spread_order(order, p0)
        if kind is RoundKind.LONG:
            prov = fixed(p0, r0, p0, r0, "long round")
        elif self.adaptive:
            # With a call latency known, the chooser draws each trajectory's wait, tail
            # and all, on top of its tokens; else it takes the lengthened guesses.
            latency = self._call_latency()
            tools = (ToolWait(latency, self.calls.timeout_s, step_s)
                     if latency is not None and self.calls is not None and step_s > 0 else None)
            priced = raw if tools is not None else guesses
            cost = self.cost.fit()
            if cost is None and tools is not None:
                # Until the curve is fitted: all of a step's seconds per sequence, the
                # curve that prices waste dearest, so that only the tail buys spares.
                cost = (0.0, step_s / self._running())
            prov = self.chooser.choose(
                [priced[i] for i in order], p0=p0, r0=r0, max_tokens=self.s.max_tokens,
                cost=cost, concurrency=self.concurrency,
                seed=self.s.seed * 1_000_003 + step, tools=tools,
            )
        else:
            n = min(len(order), math.ceil(self.fixed_eta[0] * p0 - 1e-9))
            prov = fixed(n, math.ceil(self.fixed_eta[1] * r0 - 1e-9), p0, r0, "adaptive_eta off")
        self.provision = prov
        chosen, self.pending = order[: prov.prompts], order[prov.prompts :]
        # Launched longest guess first: an engine that cannot take the whole round at
        # once starts the long ones early, and the round book gives up the longest
        # guesses first when several prompts pass defer_after in the same step.
        launch = sorted(zip(chosen, prov.launch), key=lambda c: guesses[c[0]].key, reverse=True)
        return self._plan(
            step, kind, [i for i, _ in launch], max(prov.launch), p0,
            launch=tuple(k for _, k in launch), defer_after=prov.defer_after,
        )

    def _call_latency(self) -> LatencyModel | None:
        if self.tool_latency is not None:
            return self.tool_latency
        return self.calls.latency() if self.calls is not None else None

    def _step_s(self) -> float:
        """A decode step's seconds with a round's requests in flight: from the cost
        curve once it is fitted, else the rounds' own estimate."""
        fit = self.cost.fit()
        if fit is None:
            return self.step_s
        return fit[0] + fit[1] * self._running()

    def _running(self) -> int:
        """Requests in flight in a round without speculation."""
        return min(self.concurrency, self.s.prompts_per_step * self.s.responses_per_prompt)

    def _commit(self, result: RoundResult) -> None:
        self.predictor.observe(result.lengths)
        if self.calls is not None:
            for pl in result.lengths:
                self.calls.observe(pl.tool_s, pl.tool_calls)
        self.cost.observe(result.finishes, result.timeline, self.concurrency, result.launched)
        # Until the cost curve is fitted: the fastest any finished request went, seconds
        # a token from the round's start (a trajectory's tool waits only slow it down).
        rates = [(t - result.started_at) / n for t, n in result.finishes if n >= 8 and t > result.started_at]
        if rates:
            self.step_s = min(rates) if not self.step_s else 0.5 * (self.step_s + min(rates))
        if result.plan.kind is RoundKind.LONG:
            self._check_complete(result)
        self.pending.extend(self._index[p.uid] for p in result.incomplete)

    def metrics(self) -> dict[str, float | str]:
        fit = self.cost.fit()
        out: dict[str, float | str] = {
            "pending_prompts": float(len(self.pending)),
            **self.predictor.calibration(),
            "cost_base_ms": fit[0] * 1e3 if fit else 0.0,
            "cost_per_seq_ms": fit[1] * 1e3 if fit else 0.0,
            "cost_step_ms": self._step_s() * 1e3,  # what a tool second is worth in steps
        }
        if (latency := self._call_latency()) is not None:
            out["tool_call_timeout_p"] = latency.timeout_frac  # the tail provisioning prices
        if self.provision is not None:
            out.update(self.provision.metrics())
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "pending": list(self.pending),
            "predictor": self.predictor.state_dict(),
            "cost": self.cost.state_dict(),
            "step_s": self.step_s,
            **({"calls": self.calls.state_dict()} if self.calls is not None else {}),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.pending = [int(i) for i in state["pending"]]
        self.predictor.load_state_dict(state["predictor"])
        self.cost.load_state_dict(state["cost"])
        if self.calls is not None and "calls" in state:
            self.calls.load_state_dict(state["calls"])
        self.step_s = float(state.get("step_s", 0.0))  # absent from older checkpoints


def spread_order(order: Sequence[int], p0: int) -> list[int]:
    """A short round's candidates, in launch order, from the pending prompts sorted
    shortest guess first: the P0 guessed longest are held back for the draw's long
    round (last, extras at most); the rest is cut into as many bands as short rounds
    remain, and the round takes each band's shortest first, then each band's next ones
    as extras. So every short round holds the same mix of lengths as the draw, and the
    speculation still gives up the round's longest first."""
    cut = len(order) - p0 if len(order) > p0 else len(order)
    rest, held = order[:cut], list(order[cut:])
    rounds = max(1, len(rest) // p0)
    return [rest[i] for j in range(rounds) for i in range(j, len(rest), rounds)] + held


def _carried_to_json(c: Carried) -> dict[str, Any]:
    return {
        "index": c.index,
        "token_ids": list(c.token_ids),
        "logprobs": list(c.logprobs),
        "versions": list(c.versions),
        "text": c.text,
        "finish_reason": c.finish_reason,
    }


def _carried_from_json(d: Mapping[str, Any]) -> Carried:
    return Carried(
        index=int(d["index"]),
        token_ids=tuple(int(t) for t in d["token_ids"]),
        logprobs=tuple(float(x) for x in d["logprobs"]),
        versions=tuple(int(v) for v in d["versions"]),
        text=str(d["text"]),
        finish_reason=FinishReason(d["finish_reason"]) if d["finish_reason"] else None,
    )
