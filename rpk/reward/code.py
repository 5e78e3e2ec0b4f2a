"""Code-execution reward: the program in a response, run against the row's test cases.

Rows carry their tests in `ground_truth`, as a JSON string or a mapping, in the
PRIME / DeepCoder / TACO layout: {"inputs": [stdin, ...], "outputs": [stdout, ...]}; with
"fn_name" the tests are call-based instead (APPS / TACO: each input is the argument
list of the named function, or of the method of class Solution, and each output its
JSON return value). Each test runs in its own sandbox process (rpk.reward.sandbox).

Timeouts adapt per test as in RollPacker: min(max(T_min, lambda * T_anchor), T_max),
where T_anchor is the slowest run seen so far among the runs that passed that test, so
that a hung program stops costing T_max once the test's real cost is known.

The built-in reward of the data sources in DATA_SOURCES is `CHECKER`, a marker, not a
function: the reward stack (rpk.reward.stack) scores it with the one `CodeScorer` it
builds from `reward.sandbox`, on the event loop, so that a run has one sandbox, one set
of adaptive timeouts and one start-up probe, however its reward terms are combined.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rpk.core.errors import UserError
from rpk.reward.sandbox import Isolation, Limits, ProgramRun, Sandbox, SandboxUnavailable

DATA_SOURCES = ("code", "codecontests", "taco", "apps", "livecodebench", "primeintellect")

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

# Runs the program as a module (its `if __name__ == "__main__"` block stays idle), then
# calls the function with the JSON argument list on stdin and prints the JSON result.
_CALL_DRIVER = """\
import json, runpy, sys
namespace = runpy.run_path("solution.py", run_name="solution")
name = sys.argv[1]
fn = namespace[name] if name in namespace else getattr(namespace["Solution"](), name)
sys.stdout.write(json.dumps(fn(*json.loads(sys.stdin.read()))))
"""


class SandboxError(UserError):
    """This machine cannot isolate the programs that code rewards run."""


@dataclass(frozen=True, slots=True)
class CodeChecker:
    """The built-in code checker as a reward term. The reward stack replaces it with its
    own `CodeScorer`; it is never called."""


CHECKER = CodeChecker()


def extract_program(text: str) -> str:
    """The last ```python fenced block of a response, else the whole response."""
    blocks = _FENCE.findall(text)
    return blocks[-1] if blocks else text


@dataclass(frozen=True, slots=True)
class TestCases:
    inputs: tuple[Any, ...]
    outputs: tuple[Any, ...]
    fn_name: str | None = None
    suite_id: str = ""  # a digest of the whole suite: stable across the run


def parse_tests(ground_truth: Any) -> TestCases:
    """The tests of a row; ValueError naming what is wrong with them."""
    raw = ground_truth
    if isinstance(raw, (str, bytes)):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise ValueError(f"ground_truth is not JSON test cases: {e}") from None
    if not isinstance(raw, Mapping) or "inputs" not in raw or "outputs" not in raw:
        raise ValueError(f"ground_truth needs 'inputs' and 'outputs', got {type(raw).__name__}")
    inputs, outputs, fn_name = list(raw["inputs"]), list(raw["outputs"]), raw.get("fn_name") or None
    if not inputs or len(inputs) != len(outputs):
        raise ValueError(f"ground_truth has {len(inputs)} inputs and {len(outputs)} outputs")
    if fn_name is None:
        inputs = [_as_text(case, "input", i) for i, case in enumerate(inputs)]
        outputs = [_as_text(case, "output", i) for i, case in enumerate(outputs)]
    canonical = json.dumps([inputs, outputs, fn_name], sort_keys=True, default=str)
    suite_id = hashlib.sha1(canonical.encode()).hexdigest()[:16]
    return TestCases(tuple(inputs), tuple(outputs), fn_name, suite_id)


def _as_text(case: Any, kind: str, i: int) -> str:
    if isinstance(case, str):
        return case
    if isinstance(case, list) and all(isinstance(line, str) for line in case):
        return "\n".join(case)  # some datasets store stdin/stdout as a list of lines
    raise ValueError(f"stdin test {i}: the {kind} is a {type(case).__name__}, not text")


def _numbers_close(a: str, b: str) -> bool:
    try:
        return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-6)
    except ValueError:
        return False


def stdout_matches(actual: str, expected: str) -> bool:
    """Equal up to trailing whitespace and blank lines; else token by token with
    numbers equal to 1e-6 (judges accept either)."""
    if [x.rstrip() for x in actual.rstrip().splitlines()] == [
        x.rstrip() for x in expected.rstrip().splitlines()
    ]:
        return True
    got, want = actual.split(), expected.split()
    return len(got) == len(want) and all(g == w or _numbers_close(g, w) for g, w in zip(got, want))


def result_matches(stdout: str, expected: Any) -> bool:
    """A call-based test: the JSON result equals the expected value (APPS often wraps
    the expected value in a one-element list)."""
    try:
        got = json.loads(stdout)
    except json.JSONDecodeError:
        return False
    wrapped = isinstance(expected, list) and len(expected) == 1
    return got == expected or (wrapped and got == expected[0])


class AdaptiveTimeout:
    """Per-test timeout min(max(t_min, lam * anchor), t_max); t_max until a run passes."""

    def __init__(self, lam: float = 1.5, t_min: float = 2.0, t_max: float = 30.0) -> None:
        if not (lam > 0 and 0 < t_min <= t_max):
            raise ValueError(f"need lam > 0 and 0 < t_min <= t_max, got {lam}, {t_min}, {t_max}")
        self.lam, self.t_min, self.t_max = lam, t_min, t_max
        self._anchor: dict[str, float] = {}

    def timeout(self, test_id: str) -> float:
        anchor = self._anchor.get(test_id)
        if anchor is None:
            return self.t_max
        return min(max(self.t_min, self.lam * anchor), self.t_max)

    def observe(self, test_id: str, run_s: float, passed: bool) -> None:
        if passed and run_s > self._anchor.get(test_id, 0.0):
            self._anchor[test_id] = run_s

    def stats(self) -> dict[str, float]:
        current = [self.timeout(t) for t in self._anchor]
        return {
            "anchors": float(len(current)),
            "timeout_mean_s": sum(current) / len(current) if current else self.t_max,
            "timeout_max_s": max(current, default=self.t_max),
        }


@dataclass(frozen=True, slots=True)
class SandboxSettings:
    """How programs run: the config's `reward.sandbox` section (`rpk.config.SandboxConfig`,
    which says what each field means and checks it), as `rpk.assembly.settings` copies it; the
    defaults are that section's."""

    max_concurrency: int = 0
    all_or_nothing: bool = True
    timeout_lambda: float = 1.5
    timeout_min_s: float = 2.0
    timeout_max_s: float = 30.0
    limits: Limits = Limits()
    uid_base: int = 60000
    python: str = ""
    workdir: str = ""


class CodeScorer:
    """Scores programs against test cases; keeps the timeouts and run counts of a run."""

    def __init__(self, cfg: SandboxSettings = SandboxSettings()) -> None:
        self.cfg = cfg
        self.sandbox = Sandbox(cfg.limits, cfg.max_concurrency, cfg.python, cfg.uid_base, cfg.workdir)
        self.timeouts = AdaptiveTimeout(cfg.timeout_lambda, cfg.timeout_min_s, cfg.timeout_max_s)
        self.runs: Counter[str] = Counter()  # by outcome: passed, failed, timeout, output_limit

    async def probe(self) -> Isolation:
        """The isolation this machine gives; a `SandboxError` when too little."""
        try:
            return await self.sandbox.probe()
        except SandboxUnavailable as e:
            raise SandboxError(f"code rewards need a sandbox: {e}") from None

    async def _run_test(self, program: str, tests: TestCases, i: int) -> bool:
        test_id = f"{tests.suite_id}:{i}"
        if tests.fn_name is None:
            files, args, stdin = {"main.py": program}, ["main.py"], tests.inputs[i]
        else:
            args_list = tests.inputs[i] if isinstance(tests.inputs[i], list) else [tests.inputs[i]]
            files = {"solution.py": program, "driver.py": _CALL_DRIVER}
            args, stdin = ["driver.py", tests.fn_name], json.dumps(args_list)
        timeout_s = self.timeouts.timeout(test_id)
        result: ProgramRun = await self.sandbox.run(files, args, stdin, timeout_s)
        out = result.stdout.decode(errors="replace")
        passed = result.ok and (
            stdout_matches(out, tests.outputs[i]) if tests.fn_name is None
            else result_matches(out, tests.outputs[i])
        )
        self.timeouts.observe(test_id, result.wall_s, passed)
        outcome = "passed" if passed else "failed" if result.status == "exited" else result.status
        self.runs[outcome] += 1
        return passed

    async def score(self, solution_str: str, ground_truth: Any) -> dict[str, Any]:
        tests = parse_tests(ground_truth)
        program = extract_program(solution_str)
        passed = 0
        for i in range(len(tests.inputs)):
            if await self._run_test(program, tests, i):
                passed += 1
            elif self.cfg.all_or_nothing:
                break
        every = passed == len(tests.inputs)
        score = float(every) if self.cfg.all_or_nothing else passed / len(tests.inputs)
        return {"score": score, "acc": every}

    async def __call__(
        self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None
    ) -> dict[str, Any]:
        """veRL's reward signature; {"score", "acc"}. Bad test cases raise ValueError."""
        return await self.score(solution_str, ground_truth)

    def stats(self) -> dict[str, float]:
        """Metrics: the adaptive timeouts and the run outcomes so far."""
        out = {f"sandbox/{k}": v for k, v in self.timeouts.stats().items()}
        out.update({f"sandbox/runs_{k}": float(v) for k, v in self.runs.items()})
        return out
