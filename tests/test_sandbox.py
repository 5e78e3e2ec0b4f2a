"""The code-execution reward: programs scored in sandbox processes, hostile ones contained."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import tempfile
import uuid
from dataclasses import asdict
from pathlib import Path

import pytest

from rpk.config import ConfigError, SandboxConfig
from rpk.reward import code
from rpk.reward.code import AdaptiveTimeout, CodeScorer, SandboxSettings, extract_program, parse_tests
from rpk.reward.sandbox import Limits, ProgramRun

REVERSE = {"inputs": ["abc\n", "hello\n"], "outputs": ["cba\n", "olleh\n"]}
CORRECT = "Here you go:\n```python\nprint(input()[::-1])\n```\n"
# a hostile program prints "done" (and so passes) only if it got out
EXPECT_DONE = {"inputs": ["\n"], "outputs": ["done\n"]}


def _cfg(**kw: object) -> SandboxSettings:
    base = dict(
        max_concurrency=1, timeout_min_s=1.0, timeout_max_s=2.0,
        limits=Limits(memory_mb=256, max_processes=16),
    )
    return SandboxSettings(**{**base, **kw})  # type: ignore[arg-type]


def _section(settings: SandboxSettings) -> dict[str, object]:
    """`settings` as the config's flat `reward.sandbox` section spells it."""
    flat = asdict(settings)
    limits = flat.pop("limits")
    return {**flat, **limits}


@pytest.fixture
def boxes():
    """A directory for sandbox directories that the sandbox uid can traverse."""
    path = Path(tempfile.mkdtemp(prefix="rpk-test-boxes-"))
    path.chmod(0o711)
    yield path
    path.rmdir()  # fails if a sandbox directory was left behind


def _recording(scorer: CodeScorer) -> list[ProgramRun]:
    results: list[ProgramRun] = []
    run = scorer.sandbox.run

    async def recorded(*args, **kwargs):
        results.append(await run(*args, **kwargs))
        return results[-1]

    scorer.sandbox.run = recorded  # type: ignore[method-assign]
    return results


def _survivors(pgid: int, uid: int | None) -> list[str]:
    """Processes in the run's session/group or under its uid: an independent /proc scan."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        real_uid = int(status.split("Uid:")[1].split()[0])
        if stat[0] != "Z" and (pgid in (int(stat[2]), int(stat[3])) or real_uid == uid):
            found.append(f"{pid} {stat[0]} uid={real_uid}")
    return found


async def test_correct_passes_wrong_fails(boxes):
    scorer = CodeScorer(_cfg(workdir=str(boxes)))
    assert await scorer.score(CORRECT, json.dumps(REVERSE)) == {"score": 1.0, "acc": True}
    assert await scorer.score("print(input())", REVERSE) == {"score": 0.0, "acc": False}
    assert scorer.runs == {"passed": 2, "failed": 1}  # all-or-nothing stops at the first failure
    fraction = CodeScorer(_cfg(workdir=str(boxes), all_or_nothing=False))
    half = "s = input()\nprint(s[::-1] if s == 'abc' else s)"
    assert await fraction.score(half, REVERSE) == {"score": 0.5, "acc": False}


async def test_call_based_tests(boxes):
    tests = {"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [[3], 7]}
    scorer = CodeScorer(_cfg(workdir=str(boxes)))
    assert (await scorer.score("def add(a, b):\n    return a + b", tests))["score"] == 1.0
    method = "class Solution:\n    def add(self, a, b):\n        return a - b"
    assert (await scorer.score(method, tests))["score"] == 0.0


def test_extract_and_parse():
    text = "```python\nprint(1)\n```\nbetter:\n```python\nprint(2)\n```"
    assert extract_program(text) == "print(2)\n"
    assert extract_program("print(3)") == "print(3)"
    tests = parse_tests({"inputs": [["1", "2"]], "outputs": ["3"]})
    assert tests.inputs == ("1\n2",)
    as_json = json.dumps({"inputs": [["1", "2"]], "outputs": ["3"]})
    assert tests.suite_id == parse_tests(as_json).suite_id
    with pytest.raises(ValueError, match="2 inputs and 1 outputs"):
        parse_tests({"inputs": ["a", "b"], "outputs": ["a"]})
    with pytest.raises(ValueError, match="stdin test 0: the input is a int"):
        parse_tests({"inputs": [5], "outputs": ["5"]})
    with pytest.raises(ValueError, match="not JSON"):
        parse_tests("{oops")


def test_adaptive_timeout_math():
    t = AdaptiveTimeout(lam=1.5, t_min=2.0, t_max=30.0)
    assert t.timeout("a") == 30.0  # nothing correct seen yet
    t.observe("a", 1.0, passed=True)
    assert t.timeout("a") == 2.0  # 1.5 s is below the floor
    t.observe("a", 4.0, passed=True)
    assert t.timeout("a") == 6.0
    t.observe("a", 3.0, passed=True)  # a faster correct run keeps the slowest as anchor
    t.observe("a", 100.0, passed=False)  # failing runs never move it
    assert t.timeout("a") == 6.0
    t.observe("b", 25.0, passed=True)
    assert t.timeout("b") == 30.0  # capped at t_max
    assert t.stats() == {"anchors": 2.0, "timeout_mean_s": 18.0, "timeout_max_s": 30.0}
    with pytest.raises(ValueError, match="t_min <= t_max"):
        AdaptiveTimeout(1.5, 5.0, 1.0)
    with pytest.raises(ConfigError, match="timeout_max_s"):
        SandboxConfig(timeout_min_s=3.0, timeout_max_s=1.0)


async def test_anchor_updates_from_a_correct_run(boxes):
    scorer = CodeScorer(_cfg(workdir=str(boxes), timeout_min_s=0.1, timeout_max_s=30.0))
    results = _recording(scorer)
    suite = parse_tests(REVERSE).suite_id
    assert scorer.timeouts.timeout(f"{suite}:0") == 30.0
    await scorer.score("print(input())", REVERSE)  # wrong: no anchor
    assert scorer.timeouts.timeout(f"{suite}:0") == 30.0
    await scorer.score(CORRECT, REVERSE)
    first = results[-2].wall_s
    assert scorer.timeouts.timeout(f"{suite}:0") == pytest.approx(max(0.1, 1.5 * first))
    assert scorer.stats()["sandbox/anchors"] == 2.0


HOSTILE = {
    "infinite_loop": "while True:\n    pass",
    "fork_bomb": (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    ),
    "memory_bomb": "chunks = []\nwhile True:\n    chunks.append(bytearray(1 << 24))",
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
async def test_runaway_programs_contained(kind, boxes):
    cfg = _cfg(workdir=str(boxes))
    scorer = CodeScorer(cfg)
    results = _recording(scorer)
    assert (await scorer.score(HOSTILE[kind], EXPECT_DONE))["score"] == 0.0
    (result,) = results
    if kind == "memory_bomb":  # stopped by the address-space limit, not by the clock
        assert result.status == "exited" and b"MemoryError" in result.stderr
    else:
        assert result.status == "timeout" and result.wall_s < cfg.timeout_max_s + 1
    uid = cfg.uid_base if os.geteuid() == 0 else None
    assert _survivors(result.pgid, uid) == []
    assert list(boxes.iterdir()) == []


async def test_cancelled_score_leaves_nothing_behind(boxes):
    """The reward scorer's own timeout cancels a score mid-run: the program must die too."""
    cfg = _cfg(workdir=str(boxes), timeout_max_s=30.0)
    # Other tests' long-lived children (the session's vLLM engine, reward pools) are not ours.
    before = _children()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(CodeScorer(cfg).score(HOSTILE["fork_bomb"], EXPECT_DONE), 1.0)
    assert _children() - before == set()
    if os.geteuid() == 0:
        assert _survivors(-1, cfg.uid_base) == []
    assert list(boxes.iterdir()) == []


def _children() -> set[str]:
    return {
        pid for pid in filter(str.isdigit, os.listdir("/proc"))
        if _field(pid, "PPid") == os.getpid() and _field(pid, "State") != "Z"
    }


def _field(pid: str, name: str) -> object:
    try:
        value = Path(f"/proc/{pid}/status").read_text().split(f"{name}:")[1].split()[0]
    except (OSError, IndexError):
        return None
    return int(value) if value.isdigit() else value


async def test_writes_outside_the_sandbox_fail(boxes, tmp_path):
    shared = Path(tempfile.mkdtemp(prefix="rpk-test-open-"))
    shared.chmod(0o1777)  # world-writable like /tmp: only Landlock keeps the program out
    home = Path.home() / f".rpk-escape-{uuid.uuid4().hex}"
    targets = [tmp_path / "escaped", home, shared / "escaped"]
    program = (
        "import sys\nwrote = 0\n"
        f"for path in {[str(t) for t in targets]!r}:\n"
        "    try:\n        open(path, 'w').write('x')\n        wrote += 1\n"
        "    except OSError as e:\n        print(e, file=sys.stderr)\n"
        "print('done' if wrote else 'blocked')"
    )
    scorer = CodeScorer(_cfg(workdir=str(boxes)))
    results = _recording(scorer)
    try:
        assert (await scorer.score(program, EXPECT_DONE))["score"] == 0.0
        assert results[0].stdout == b"blocked\n"
        assert [t for t in targets if t.exists()] == []
    finally:
        for t in targets:
            t.unlink(missing_ok=True)
        shared.rmdir()
    assert list(boxes.iterdir()) == []


async def test_network_is_cut_off(boxes):
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    program = (
        f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('done')"
    )
    scorer = CodeScorer(_cfg(workdir=str(boxes)))
    results = _recording(scorer)
    try:
        assert (await scorer.score(program, EXPECT_DONE))["score"] == 0.0
        assert results[0].status == "exited" and results[0].returncode != 0
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing ever connected
    finally:
        listener.close()


async def test_the_code_scorer_is_called_as_verl_calls_a_reward(boxes):
    from rpk.reward import resolve_rewards

    assert resolve_rewards(None, ["codecontests"])["codecontests"] is code.CHECKER  # bound per run
    scorer = CodeScorer(_cfg(workdir=str(boxes)))
    iso = await scorer.probe()
    assert iso.network_blocked and (iso.uid_drop or os.geteuid() != 0)
    result = await scorer(
        data_source="codecontests", solution_str=CORRECT, ground_truth=json.dumps(REVERSE),
        extra_info={},
    )
    assert result == {"score": 1.0, "acc": True}
    stats = scorer.stats()
    assert stats["sandbox/anchors"] == 2.0 and stats["sandbox/runs_passed"] == 2.0


def _code_response(program: str, tests: str, index: int = 0):
    from rpk.core.records import Prompt, Response

    return Response(Prompt("c0", (1,), "code", tests), index, (1,), (0.0,), "stop", 0, text=program)


async def test_make_scorer_routes_code_to_the_sandbox_and_the_rest_to_its_backend(boxes):
    from rpk.core.records import Prompt, Response
    from rpk.reward import BySource, RewardSettings, make_scorer, resolve_rewards
    from rpk.tasks import arith

    cfg = RewardSettings(backend="thread", sandbox=_cfg(workdir=str(boxes)))
    functions = resolve_rewards(None, {"code", arith.DATA_SOURCE})
    scorer = make_scorer(cfg, functions, max_tokens=64)
    assert isinstance(scorer.scorer, BySource)
    assert scorer.sandbox is not None and scorer.sandbox.cfg == cfg.sandbox
    tests = json.dumps({"inputs": ["2 3\n"], "outputs": ["5\n"]})
    program = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    arith_prompt = Prompt("a0", (1,), arith.DATA_SOURCE, "5")
    try:
        good = await scorer.score(_code_response(program, tests))
        bad = await scorer.score(_code_response("print(6)", tests, 1))
        right = await scorer.score(Response(arith_prompt, 0, (1,), (0.0,), "stop", 0, text="answer: 5"))
    finally:
        await scorer.aclose()
    assert (good.reward, good.correct) == (1.0, True)
    assert (bad.reward, bad.correct) == (0.0, False)
    assert right.reward == arith.compute_score(arith.DATA_SOURCE, "answer: 5", "5")
    metrics = scorer.metrics()
    assert metrics["sandbox/anchors"] == 1.0 and metrics["sandbox/runs_passed"] >= 1.0


SUM_TESTS = json.dumps({"inputs": ["2 3\n"], "outputs": ["5\n"]})
# Right, but slow: it passes under a 5 s timeout and not under 0.5 s.
SLOW_SUM = (
    "```python\nimport time\ntime.sleep(1.0)\na, b = map(int, input().split())\n"
    "print(a + b)\n```"
)


@pytest.mark.parametrize("t_max, passed", [(0.5, False), (5.0, True)])
async def test_a_weighted_code_term_runs_on_the_configured_sandbox(boxes, t_max, passed):
    """reward.functions "builtin=1" "...:prefix=0.5": the code term is scored by the
    stack's one sandbox, built from reward.sandbox (its timeout decides here), and the
    function term runs in the pool; the parts add, and the first term's verdict counts."""
    from rpk.reward import ProcessScorer, RewardSettings, SandboxScorer, make_scorer, resolve_rewards

    sandbox = _cfg(workdir=str(boxes), timeout_min_s=0.5, timeout_max_s=t_max)
    functions = ("builtin=1", "tests.reward_fns:prefix=0.5")
    cfg = RewardSettings(sandbox=sandbox)
    stack = make_scorer(cfg, resolve_rewards(None, ["code"], functions), max_tokens=64)
    try:
        got = await stack.score(_code_response(SLOW_SUM, SUM_TESTS))
        metrics = stack.metrics()
    finally:
        await stack.aclose()
    assert [type(s) for s in stack.scorer.scorers] == [ProcessScorer, SandboxScorer]
    assert stack.sandbox is not None and stack.sandbox.cfg is sandbox
    assert got.error is None
    assert (got.reward, got.correct) == (float(passed) + 0.5 * 0.5, passed)
    if passed:  # and its run now anchors the test's timeout
        assert metrics["sandbox/runs_passed"] == 1.0 and metrics["sandbox/anchors"] == 1.0
    else:
        assert metrics["sandbox/runs_timeout"] == 1.0 and metrics["sandbox/timeout_max_s"] == t_max


async def test_the_first_term_gives_the_verdict_when_it_is_a_function(boxes):
    from rpk.reward import RewardSettings, make_scorer, resolve_rewards

    functions = ("tests.reward_fns:prefix=0.5", "builtin=2")
    cfg = RewardSettings(backend="thread", sandbox=_cfg(workdir=str(boxes)))
    stack = make_scorer(cfg, resolve_rewards(None, ["code"], functions), max_tokens=64)
    program = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    try:
        got = await stack.score(_code_response(program, SUM_TESTS))
    finally:
        await stack.aclose()
    # prefix: 0.5 * 0.5, its verdict False (the text does not start with the tests);
    # the code passes: + 2 * 1
    assert (got.reward, got.correct, got.error) == (2.25, False, None)
    assert stack.name_of("code") == "0.5*tests.reward_fns:prefix + 2*the built-in code checker"


async def test_start_up_probes_the_owned_sandbox_before_the_engine_starts(boxes, tmp_path, monkeypatch):
    from dataclasses import replace

    from rpk import assembly
    from rpk.config import Config, RewardConfig, RolloutConfig
    from rpk.core.records import Prompt
    from rpk.loop.trainer import AsyncTrainer
    from rpk.reward.code import SandboxError
    from tests.fakes import RecordingTrainer, ScriptedEngine

    events: list[str] = []

    async def start_engine(cfg, model_dir, plan, version, log, trainer=None, rest=None, judge=None):
        events.append("engine")
        return ScriptedEngine(lambda request: 4)

    monkeypatch.setattr(assembly.start, "start_engine", start_engine)
    monkeypatch.setattr(assembly.start, "build_trainer",
                        lambda cfg, model_dir, box, joined=None: AsyncTrainer(RecordingTrainer()))
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 4096}')
    prompts = [Prompt(f"c{i}", (1, 2), "code", SUM_TESTS) for i in range(4)]
    reward = RewardConfig(
        functions=("builtin", "tests.reward_fns:prefix=0.1"),
        sandbox=SandboxConfig(**_section(_cfg(workdir=str(boxes)))),
    )
    cfg = Config(rollout=RolloutConfig(policy="sync", prompts_per_step=2), reward=reward)
    parts = await assembly.start_parts(cfg, assembly.place(cfg.rollout), tmp_path, prompts, events.append)
    await parts.aclose()
    assert events[0].startswith("code sandbox: Isolation(") and events[1:] == ["engine"]
    assert parts.scorer.sandbox is not None and _section(parts.scorer.sandbox.cfg) == asdict(reward.sandbox)

    events.clear()
    no_python = _cfg(workdir=str(boxes), python=str(tmp_path / "no-python"))
    nowhere = replace(reward, sandbox=SandboxConfig(**_section(no_python)))
    with pytest.raises(SandboxError, match="code rewards need a sandbox: no interpreter runs"):
        await assembly.start_parts(replace(cfg, reward=nowhere), assembly.place(cfg.rollout), tmp_path, prompts,
                                   events.append)
    assert events == []


async def test_the_reference_server_serves_the_built_in_code_checker():
    from rpk.core.records import Prompt, Response
    from rpk.reward.remote import HTTPScorer
    from rpk.reward.server import lookup_for, make_app
    from rpk.tasks import arith
    from tests.helpers import serving

    program = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    arith_prompt = Prompt("a0", (1,), "rpk/arith", "5")
    with serving(make_app(lookup_for(None), None)) as url:
        remote = HTTPScorer(f"{url}/score", batch_size=4, linger_ms=20)
        try:
            got = await asyncio.gather(
                remote.score(_code_response(program, SUM_TESTS)),
                remote.score(_code_response("print(6)", SUM_TESTS, 1)),
                remote.score(Response(arith_prompt, 0, (1,), (0.0,), "stop", 0, text="answer: 5")),
            )
        finally:
            await remote.aclose()
    assert [(s.reward, s.correct, s.error) for s in got[:2]] == [(1.0, True, None), (0.0, False, None)]
    assert (got[2].reward, got[2].error) == (arith.compute_score("rpk/arith", "answer: 5", "5"), None)


async def test_a_program_s_files_are_written_off_the_event_loop(boxes, monkeypatch):
    import threading

    from rpk.reward import sandbox

    writers: list[int] = []

    def recording_open(*args, **kwargs):
        writers.append(threading.get_ident())
        return open(*args, **kwargs)

    monkeypatch.setattr(sandbox, "open", recording_open, raising=False)
    box = sandbox.Sandbox(sandbox.Limits(), concurrency=1, workdir=str(boxes))
    run = await box.run({"main.py": "print(6 * 7)"}, ["main.py"], "", 5.0)
    assert run.ok and run.stdout == b"42\n"
    assert writers and threading.get_ident() not in writers


async def test_a_directory_that_cannot_be_made_gives_the_slot_back(tmp_path):
    from rpk.reward.sandbox import Limits, Sandbox, SandboxUnavailable

    box = Sandbox(Limits(), concurrency=1, workdir=str(tmp_path / "missing"))
    for _ in range(2):  # the second would wait forever on a slot the first kept
        with pytest.raises(SandboxUnavailable, match="No such file"):
            await asyncio.wait_for(box.probe(), 10)
