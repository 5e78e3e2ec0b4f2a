"""Response-length prediction, learned online from what rounds observe, with no task
knowledge.

A prompt's responses have a length distribution; the predictor works on log lengths and
guesses, per prompt, the mean `mu` of its responses' log lengths, how unsure that guess
is (`sigma`) and how much responses of one prompt spread around their mean (`spread`,
pooled over prompts). It reads of a prompt only its identity (`uid`), its token count
and its data source, never its text, answer or anything task-specific.

Two sources, combined by their measured errors:
- history: per prompt identity, the mean log length its last observed group reached
  (across epochs), and a floor when a round gave it up before it finished (its responses
  are known to be longer than the tokens they had reached, or than the siblings that
  did finish first);
- features: per data source, a least-squares line of log length on log prompt tokens,
  refined per exact prompt token count by shrunk bucket means. Stats decay a little per
  round, so the model follows the policy as its lengths drift during training.

Each source's weight is the inverse of its own out-of-sample squared error, measured
on every observation before it is learned from (for history: how much a prompt's length
moved since it was last seen). The same pairs give the calibration reported per step:
the rank correlation of predicted against observed lengths over a window of recent
prompts, and the mean absolute error in tokens over the last round.

Plain state (floats in dicts and lists): `state_dict` is JSON, so it rides in checkpoints.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import fmean
from typing import Any

from rpk.core.outcomes import PromptLengths
from rpk.core.records import Prompt

_PRIOR_SIGMA = 1.0  # log space: before any data a guess is good to a factor of e
_PRIOR_SPREAD = 0.3
_BUCKET_PSEUDO = 2.0  # a token-count bucket's own mean needs this weight to count half
_WINDOW = 256  # prompts in the rank-correlation window


@dataclass(frozen=True, slots=True)
class LengthGuess:
    """The predicted log-length distribution of one prompt's responses."""

    mu: float  # mean log length of its responses
    sigma: float  # uncertainty of mu
    spread: float  # response-to-response standard deviation of log length
    seen: int  # rounds in which its lengths were observed in full
    tool_s: float = 0.0  # expected seconds a trajectory of it spends in tool calls
    tool_calls: float = 0.0  # ... and the tool calls it makes

    def waiting(self, steps: float) -> LengthGuess:
        """The guess of a response's cost in decode steps when it also waits `steps`
        steps' time on its tools: log(tokens + steps), its uncertainty scaled by the
        tokens' share of that (the wait is taken as known)."""
        if steps <= 0:
            return self
        tokens = math.exp(self.mu)
        share = tokens / (tokens + steps)
        return LengthGuess(math.log(tokens + steps), self.sigma * share, self.spread, self.seen,
                           self.tool_s, self.tool_calls)

    @property
    def key(self) -> float:
        """Sort key for packing rounds: a pessimistic (one sigma up) log length."""
        return self.mu + self.sigma

    @property
    def tokens(self) -> float:
        """Expected length of one response, in tokens."""
        return math.exp(self.mu + 0.5 * self.spread**2)


class _Mean:
    """A decayed weighted mean."""

    __slots__ = ("w", "s")

    def __init__(self, w: float = 0.0, s: float = 0.0) -> None:
        self.w, self.s = w, s

    def add(self, y: float) -> None:
        self.w += 1
        self.s += y

    def decay(self, f: float) -> None:
        self.w *= f
        self.s *= f

    @property
    def mean(self) -> float:
        return self.s / self.w

    def mean_or(self, prior: float) -> float:
        """The mean with `prior` counted as one observation: a handful of lucky hits
        does not claim certainty, and an empty mean is the prior."""
        return (self.s + prior) / (self.w + 1.0)

    def to_list(self) -> list[float]:
        return [self.w, self.s]


class _Line:
    """Decayed weighted least squares of y on x."""

    __slots__ = ("w", "x", "y", "xx", "xy")

    def __init__(self, *v: float) -> None:
        self.w, self.x, self.y, self.xx, self.xy = v or (0.0,) * 5

    def add(self, x: float, y: float) -> None:
        self.w += 1
        self.x += x
        self.y += y
        self.xx += x * x
        self.xy += x * y

    def decay(self, f: float) -> None:
        for name in self.__slots__:
            setattr(self, name, getattr(self, name) * f)

    def at(self, x: float) -> float:
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        slope = (self.xy / self.w - mx * my) / var if var > 1e-9 else 0.0
        return my + slope * (x - mx)

    def to_list(self) -> list[float]:
        return [getattr(self, name) for name in self.__slots__]


class LengthPredictor:
    """Per-prompt response-length guesses; `observe` learns from a finished round."""

    def __init__(self, max_tokens: int, decay: float = 0.98) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.max_tokens = max_tokens
        self.decay = decay
        self.history: dict[str, list[float]] = {}  # uid -> [mu, seen, floor (log, 0: none)]
        self.lines: dict[str, _Line] = {}  # per data source
        self.buckets: dict[str, _Mean] = {}  # per "source\ttoken count"
        self.overall = _Mean()
        self.spread = _Mean()  # within-prompt variance of log length
        self.feature_err = _Mean()  # squared error of the feature guess
        self.history_err = _Mean()  # squared change of a prompt's mean since last seen
        self.window: deque[tuple[float, float]] = deque(maxlen=_WINDOW)  # (guess, seen)
        self.last_mae = 0.0
        self.last_n = 0  # trained prompts of the last round (the end of the window)
        # Trajectories' tool seconds: per prompt (decayed mean, as lengths are), and per
        # data source for prompts not yet seen.
        self.tool_history: dict[str, _Mean] = {}
        self.tool_sources: dict[str, _Mean] = {}
        self.call_history: dict[str, _Mean] = {}  # the same for their tool calls
        self.call_sources: dict[str, _Mean] = {}

    # -- guessing ---------------------------------------------------------------------

    def _features(self, prompt: Prompt) -> tuple[float, float]:
        if not self.overall.w:
            return math.log(max(1.0, self.max_tokens / 8)), _PRIOR_SIGMA**2
        x = math.log(len(prompt.token_ids) or 1)
        line = self.lines.get(prompt.data_source)
        mu = line.at(x) if line is not None and line.w > 0 else self.overall.mean
        bucket = self.buckets.get(f"{prompt.data_source}\t{len(prompt.token_ids)}")
        if bucket is not None and bucket.w > 0:
            mu = (bucket.s + _BUCKET_PSEUDO * mu) / (bucket.w + _BUCKET_PSEUDO)
        return mu, self.feature_err.mean_or(_PRIOR_SIGMA**2)

    def _spread(self) -> float:
        return math.sqrt(self.spread.mean_or(_PRIOR_SPREAD**2))

    def predict(self, prompt: Prompt) -> LengthGuess:
        mu, var = self._features(prompt)
        seen = 0
        h = self.history.get(prompt.uid)
        if h is not None:
            h_mu, seen, floor = h[0], int(h[1]), h[2]
            if seen:
                h_var = self.history_err.mean_or(_PRIOR_SIGMA**2 / 4)
                mu = (mu / var + h_mu / h_var) / (1 / var + 1 / h_var)
                var = 1 / (1 / var + 1 / h_var)
            if floor:
                mu, var = _above(mu, var, floor)
        return LengthGuess(mu, math.sqrt(var), self._spread(), seen,
                           _known(prompt, self.tool_history, self.tool_sources),
                           _known(prompt, self.call_history, self.call_sources))

    # -- learning ---------------------------------------------------------------------

    def observe(self, lengths: Sequence[PromptLengths]) -> None:
        """Learn from one round: trained prompts give their groups' lengths; prompts the
        round gave up or left unfinished give floors."""
        # Scored against the guesses the round was planned with, before any learning.
        guesses = [self.predict(pl.prompt) if pl.trained else None for pl in lengths]
        for store in (*self.lines.values(), *self.buckets.values(), self.overall):
            store.decay(self.decay)
        errors: list[float] = []
        for store in (*self.tool_sources.values(), *self.call_sources.values()):
            store.decay(self.decay)
        for pl in lengths:
            for values, history, sources in ((pl.tool_s, self.tool_history, self.tool_sources),
                                             (pl.tool_calls, self.call_history, self.call_sources)):
                if not values:
                    continue
                own = history.setdefault(pl.prompt.uid, _Mean())
                own.decay(0.5)  # a prompt's latest trajectories say most of its next ones
                for store in (own, sources.setdefault(pl.prompt.data_source, _Mean())):
                    for value in values:
                        store.add(value)
        for pl, guess in zip(lengths, guesses):
            seen = [*pl.finished, *pl.cut]
            if guess is None:
                if seen:
                    self._floor(pl.prompt.uid, seen)
                continue
            y = fmean([math.log(max(1, n)) for n in seen])
            self.window.append((guess.mu, y))
            errors.append(abs(math.exp(guess.mu) - math.exp(y)))
            self._learn(pl.prompt, y, pl.finished)
        self.last_n = len(errors)
        self.last_mae = fmean(errors) if errors else 0.0

    def _learn(self, prompt: Prompt, y: float, finished: Sequence[int]) -> None:
        f_mu, _ = self._features(prompt)
        if self.overall.w:
            self.feature_err.add((f_mu - y) ** 2)
        h = self.history.get(prompt.uid)
        if h is not None and h[1]:
            self.history_err.add((h[0] - y) ** 2)
        logs = [math.log(max(1, n)) for n in finished]
        if len(logs) > 1:
            m = fmean(logs)
            self.spread.add(sum((v - m) ** 2 for v in logs) / (len(logs) - 1))
        x = math.log(len(prompt.token_ids) or 1)
        self.lines.setdefault(prompt.data_source, _Line()).add(x, y)
        self.buckets.setdefault(f"{prompt.data_source}\t{len(prompt.token_ids)}", _Mean()).add(y)
        self.overall.add(y)
        self.history[prompt.uid] = [y, (h[1] if h else 0) + 1, 0.0]

    def _floor(self, uid: str, seen: Sequence[int]) -> None:
        """A prompt given up mid-round: its mean log length is at least that of what its
        responses reached (the ones still running were cut there, those that finished
        first are its shortest), so the next guess for it starts above that."""
        floor = fmean([math.log(max(1, n)) for n in seen])
        h = self.history.setdefault(uid, [0.0, 0, 0.0])
        h[2] = max(h[2], floor)

    # -- calibration ------------------------------------------------------------------

    def calibration(self) -> dict[str, float]:
        """Predicted against observed: rank correlation over the recent window (the
        packing only needs the order right) and over the last round (whose prompts were
        packed together, so their range is narrow), error in tokens over the last round."""
        last = list(self.window)[len(self.window) - self.last_n :] if self.last_n else []
        return {
            "pred_rank_corr": spearman(self.window),
            "pred_rank_corr_round": spearman(last),
            "pred_mae_tokens": self.last_mae,
            "pred_prompts": float(self.last_n),
            "pred_spread": self._spread(),
        }

    # -- checkpoints ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "history": self.history,
            "lines": {k: v.to_list() for k, v in self.lines.items()},
            "buckets": {k: v.to_list() for k, v in self.buckets.items()},
            "overall": self.overall.to_list(),
            "spread": self.spread.to_list(),
            "feature_err": self.feature_err.to_list(),
            "history_err": self.history_err.to_list(),
            "window": [list(p) for p in self.window],
            "last": [self.last_mae, self.last_n],
            "tool_history": {k: v.to_list() for k, v in self.tool_history.items()},
            "tool_sources": {k: v.to_list() for k, v in self.tool_sources.items()},
            "call_history": {k: v.to_list() for k, v in self.call_history.items()},
            "call_sources": {k: v.to_list() for k, v in self.call_sources.items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.history = {k: [float(v[0]), int(v[1]), float(v[2])] for k, v in state["history"].items()}
        self.lines = {k: _Line(*v) for k, v in state["lines"].items()}
        self.buckets = {k: _Mean(*v) for k, v in state["buckets"].items()}
        self.overall = _Mean(*state["overall"])
        self.spread = _Mean(*state["spread"])
        self.feature_err = _Mean(*state["feature_err"])
        self.history_err = _Mean(*state["history_err"])
        self.window = deque((tuple(p) for p in state["window"]), maxlen=_WINDOW)
        self.last_mae, self.last_n = float(state["last"][0]), int(state["last"][1])
        # Checkpoints from before tool seconds were learned have none.
        self.tool_history = {k: _Mean(*v) for k, v in state.get("tool_history", {}).items()}
        self.tool_sources = {k: _Mean(*v) for k, v in state.get("tool_sources", {}).items()}
        self.call_history = {k: _Mean(*v) for k, v in state.get("call_history", {}).items()}
        self.call_sources = {k: _Mean(*v) for k, v in state.get("call_sources", {}).items()}


def _known(prompt: Prompt, history: Mapping[str, _Mean], sources: Mapping[str, _Mean]) -> float:
    """The prompt's own decayed mean, else its data source's, else 0."""
    for store in (history.get(prompt.uid), sources.get(prompt.data_source)):
        if store is not None and store.w > 0:
            return store.mean
    return 0.0


def _above(mu: float, var: float, floor: float) -> tuple[float, float]:
    """Mean and variance of N(mu, var) given that it exceeds `floor` (truncated normal)."""
    sd = math.sqrt(var)
    a = (floor - mu) / sd
    tail = 0.5 * math.erfc(a / math.sqrt(2))
    if tail < 1e-12:
        return floor, var * 0.1
    lam = math.exp(-0.5 * a * a) / math.sqrt(2 * math.pi) / tail
    return mu + sd * lam, var * max(0.05, 1 + a * lam - lam * lam)


def _ranks(values: Sequence[float]) -> list[float]:
    order = sorted(range(len(values)), key=values.__getitem__)
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2
        i = j + 1
    return ranks


def spearman(pairs: Sequence[tuple[float, float]]) -> float:
    """Spearman rank correlation of (a, b) pairs, ties averaged; 0 when undefined."""
    if len(pairs) < 3:
        return 0.0
    ra = _ranks([a for a, _ in pairs])
    rb = _ranks([b for _, b in pairs])
    ma, mb = fmean(ra), fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va = sum((x - ma) ** 2 for x in ra)
    vb = sum((y - mb) ** 2 for y in rb)
    return cov / math.sqrt(va * vb) if va > 0 and vb > 0 else 0.0
