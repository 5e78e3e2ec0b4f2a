"""`AgentEngine` under the real round driver, on scripted inner engines and tools: the
ids the trainer gets are exactly the sampled and template-encoded ones, masks reach the
trainer's loss, aborts inside tool calls leave nothing behind, failing tools never fail
the round, and the RoundBook schedules trajectories as it schedules completions."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import pytest

from rpk.agent.engine import AgentEngine
from rpk.agent.env import EnvStep, ToolEnv
from rpk.agent.parse import ToolCall, format_tool_call
from rpk.agent.template import ObservationEncoder
from rpk.agent.tools import ToolRunner, load_tool
from rpk.config import TinySpec
from rpk.core.outcomes import RoundPlan
from rpk.core.records import FinishReason, Prompt, RoundKind, TrainSample
from rpk.loop.feed import train_samples
from rpk.loop.rollout import run_round
from rpk.loop.step import run_step
from rpk.loop.trainer import AsyncTrainer
from rpk.obs.metrics import step_record, turn_metrics
from rpk.sched.policy import Sampling, TailPolicy
from rpk.sim import CostModel, SimEngine
from rpk.tasks.tiny import build_tokenizer
from tests.agent_fakes import CountingEnv, FixedObservation, SlowTools, TurnEngine, trajectory_of, turn_of
from tests.fakes import LengthScorer, RecordingTrainer, ScriptedEngine, mean_centred
from tests.trainers import stepped_gradient, trainer


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return build_tokenizer(TinySpec())


def encode_with(tokenizer: Any):
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


def prompts(n: int) -> list[Prompt]:
    return [Prompt(f"p{i}", (7, i), "test", str(i)) for i in range(n)]


def plan(ps: list[Prompt], launched: int, group: int, needed: int, max_tokens: int = 400,
         kind: RoundKind = RoundKind.SHORT) -> RoundPlan:
    return RoundPlan(1, kind, tuple(ps), launched, group, needed, max_tokens, seed=3)


def prompt_pos(rid: str) -> int:
    return int(rid.split("-p", 1)[1].split("-", 1)[0])


class Recording:
    """An environment factory that keeps every environment it made, and tells whether
    each was closed."""

    def __init__(self, make) -> None:
        self.make = make
        self.made: list[Any] = []
        self.closed = 0

    def __call__(self) -> Any:
        env = self.make()
        close = env.close

        async def counted_close() -> None:
            self.closed += 1
            await close()

        env.close = counted_close
        self.made.append(env)
        return env


def tool_env(*tools: str, timeout_s: float = 5.0, cap: int = 512) -> Recording:
    runner = ToolRunner([load_tool(f"tests.agent_fakes:{t}") for t in tools], timeout_s, cap)
    return Recording(lambda: ToolEnv(runner, max_parallel_calls=4))


def agent(inner, factory, ps, tokenizer, max_turns: int = 4) -> AgentEngine:
    return AgentEngine(inner, factory, ObservationEncoder(tokenizer), {p.uid: p for p in ps},
                       max_turns)


def other_tasks() -> set[asyncio.Task]:
    return asyncio.all_tasks() - {asyncio.current_task()}


async def test_trainer_gets_exactly_the_sampled_and_encoded_ids(tokenizer) -> None:
    ps = prompts(2)

    def reply(req):
        pos = prompt_pos(req.request_id)
        if turn_of(req) == 1:
            return "add " + format_tool_call(ToolCall("add_numbers", {"a": pos, "b": 40}))
        return f"The answer is {pos + 40}."

    inner = TurnEngine(reply, encode_with(tokenizer))
    encoder = ObservationEncoder(tokenizer)
    factory = tool_env("add_numbers")
    engine = agent(inner, factory, ps, tokenizer)
    result = await run_round(plan(ps, 2, 2, 2, kind=RoundKind.SYNC), engine, LengthScorer(10**6),
                             mean_centred, version=0)
    samples = train_samples(result.groups)
    members = [m for g in result.groups for m in g.members]
    assert len(samples) == 4
    for sample, m in zip(samples, members):
        pos = int(m.response.prompt.uid[1:])
        rid = f"s1-p{pos}-r{m.response.index}"
        ids1, lps1 = inner.sampled[f"{rid}-t1"]
        ids2, lps2 = inner.sampled[f"{rid}-t2"]
        obs = encoder.encode([{"role": "tool", "name": "add_numbers", "content": str(pos + 40)}])
        assert sample.prompt_ids == (7, pos)
        assert sample.response_ids == ids1 + obs.token_ids + ids2
        assert sample.old_logprobs == lps1 + (0.0,) * len(obs.token_ids) + lps2
        assert sample.loss_mask == (1,) * len(ids1) + (0,) * len(obs.token_ids) + (1,) * len(ids2)
        assert ids1[-1] == ids2[-1] == tokenizer.eos_token_id  # the turn's end is trained
        second = next(r for r in inner.seen if r.request_id == f"{rid}-t2")
        assert second.prompt_token_ids == (7, pos) + ids1 + obs.token_ids
        assert second.max_tokens == 400 - len(ids1) - len(obs.token_ids)
        assert second.affinity == rid and second.prompt_uid == f"p{pos}"
        r = m.response
        assert r.finish_reason is FinishReason.STOP and r.turns is not None
        assert (r.turns.turns, r.turns.tools.calls, r.turns.tools.failures) == (2, 1, 0)
        assert f"<|im_start|>tool\n{pos + 40}<|im_end|>" in r.text
    assert factory.closed == len(factory.made) == 4 and not other_tasks()


def test_masked_tokens_are_out_of_the_trainers_loss(model_dir) -> None:
    """Whatever the old log-probs on observation tokens, the step is the same: they are
    out of the loss (their tokens still condition the later ones); and only model
    tokens count as trained."""
    def samples(garbage: float, mask: bool) -> list[TrainSample]:
        out = []
        for k in range(4):
            resp = tuple((k * 7 + j) % 60 + 1 for j in range(9))
            m = (1, 1, 1, 0, 0, 0, 1, 1, 1)
            lps = tuple(garbage if not b else -4.0 - 0.1 * j for j, b in enumerate(m))
            out.append(TrainSample((3, k + 1), resp, lps, advantage=(-1.0) ** k,
                                   loss_mask=m if mask else ()))
        return out

    a_grads, a = stepped_gradient(trainer(model_dir), [samples(50.0, True)])
    b_grads, b = stepped_gradient(trainer(model_dir), [samples(-900.0, True)])
    for name, g in a_grads.items():
        assert b_grads[name].equal(g), name
    assert a["loss"] == b["loss"] and a["train_tokens"] == b["train_tokens"] == 4 * 6
    unmasked, _ = stepped_gradient(trainer(model_dir), [samples(50.0, False)])
    assert any(not unmasked[n].equal(g) for n, g in a_grads.items())


async def test_abort_inside_a_tool_call_and_inside_a_turn_leaves_nothing_behind(
    tokenizer, monkeypatch
) -> None:
    """Prompt 0 answers in one turn; meanwhile prompt 1's first trajectory hangs in a
    tool and its second is deep in a long second turn. The round needs one group: it
    aborts both."""
    ps = prompts(2)
    in_tool = asyncio.Event()

    def reply(req):
        pos, idx = prompt_pos(req.request_id), int(trajectory_of(req).rsplit("-r", 1)[1])
        if pos == 0:
            return "4" * 200
        if turn_of(req) == 1:
            args = {"seconds": 60} if idx == 0 else {"seconds": 0}
            return format_tool_call(ToolCall("sleepy_tool", args))
        return "x" * 300

    inner = TurnEngine(reply, encode_with(tokenizer), chunk=1)
    factory = tool_env("sleepy_tool", timeout_s=120)
    engine = agent(inner, factory, ps, tokenizer)
    scorer = LengthScorer(10**6)
    orig_step = ToolEnv.step

    async def step(self, text):
        if "60" in text:
            in_tool.set()
        return await orig_step(self, text)

    monkeypatch.setattr(ToolEnv, "step", step)
    result = await asyncio.wait_for(
        run_round(plan(ps, 2, 2, 1, max_tokens=1000), engine, scorer, mean_centred, version=0),
        timeout=30)
    assert in_tool.is_set()
    assert [g.prompt.uid for g in result.groups] == ["p0"] and result.incomplete[0].uid == "p1"
    assert result.aborted == 2
    assert "s1-p1-r1-t2" in inner.aborted  # the running second turn
    assert not inner.running and not engine._live
    assert factory.closed == len(factory.made) == 4
    assert not other_tasks()


async def test_failing_hanging_and_flooding_tools_become_observations(tokenizer) -> None:
    ps = prompts(1)
    calls = "".join(format_tool_call(c) for c in (
        ToolCall("failing_tool", {"x": 1}), ToolCall("sleepy_tool", {"seconds": 30}),
        ToolCall("flooding_tool", {"n": 5000}), ToolCall("missing", {})))

    def reply(req):
        return calls if turn_of(req) == 1 else "done"

    inner = TurnEngine(reply, encode_with(tokenizer))
    factory = tool_env("failing_tool", "sleepy_tool", "flooding_tool", timeout_s=0.2, cap=64)
    result = await run_round(plan(ps, 2, 2, 1, max_tokens=2000), agent(inner, factory, ps, tokenizer),
                             LengthScorer(10**6), mean_centred, version=0)
    (group,) = result.groups
    for m in group.members:
        r = m.response
        assert r.turns is not None and (r.turns.tools.calls, r.turns.tools.failures) == (4, 4)
        assert 0.2 <= r.turns.tools.seconds < 5
        for text in ("error: broken on 1", "error: timeout after 0.2 s",
                     "z" * 64 + "...[4936 chars cut]", "error: no tool named 'missing'"):
            assert text in r.text


class BrokenEnv:
    """An environment whose every step raises: a bug in the user's environment."""

    async def reset(self, prompt: Prompt) -> None:
        pass

    async def step(self, turn_text: str) -> EnvStep:
        raise KeyError("no such board")

    async def close(self) -> None:
        pass


async def test_a_broken_environment_ends_its_trajectories_and_is_said_once(tokenizer) -> None:
    ps = prompts(2)
    inner = TurnEngine(lambda req: "move", encode_with(tokenizer))
    said: list[str] = []
    engine = AgentEngine(inner, BrokenEnv, ObservationEncoder(tokenizer), {p.uid: p for p in ps},
                         4, log=said.append)
    result = await run_round(plan(ps, 2, 2, 2), engine, LengthScorer(10**6), mean_centred, version=0)
    members = [m for g in result.groups for m in g.members]
    assert len(members) == 4
    assert all(m.response.turns is not None and m.response.turns.tools.failures == 1 for m in members)
    assert len(said) == 1
    assert "failed: KeyError: 'no such board'" in said[0] and "later KeyErrors" in said[0]


async def test_round_book_accepts_first_trajectories_and_defers_the_rest(tokenizer) -> None:
    """A short round over trajectories: 3 prompts x 3 trajectories launched, groups of 2,
    2 groups needed. Prompt 2 takes many turns; each prompt's third trajectory writes
    long turns. The first two trajectories of prompts 0 and 1 make the groups; the rest
    are aborted and prompt 2 is left incomplete, for the long-prompt queue."""
    ps = prompts(3)
    log: list[tuple[str, str]] = []
    factory = Recording(lambda: CountingEnv(lambda p: 6 if p.uid == "p2" else 2, log))

    def reply(req):
        idx = int(trajectory_of(req).rsplit("-r", 1)[1])
        return "y" * (60 if idx == 2 else 4 + idx)

    inner = TurnEngine(reply, encode_with(tokenizer), chunk=2)
    engine = agent(inner, factory, ps, tokenizer, max_turns=8)
    result = await run_round(plan(ps, 3, 2, 2, max_tokens=1000), engine, LengthScorer(10**6),
                             mean_centred, version=0)
    assert sorted(g.prompt.uid for g in result.groups) == ["p0", "p1"]
    for g in result.groups:
        assert sorted(m.response.index for m in g.members) == [0, 1]
        for m in g.members:
            assert m.response.turns is not None and m.response.turns.turns == 2
            assert m.response.turns.env_reward == 1.0
            assert 0 < sum(m.response.loss_mask) < len(m.response.token_ids)
    assert [p.uid for p in result.incomplete] == ["p2"]
    assert result.launched == 9 and result.finished + result.aborted == 9
    assert result.finished == 4
    # observations are context, not generated work: the round counts sampled tokens only
    sampled = sum(len(ids) for ids, _ in inner.sampled.values())
    assert result.tokens_generated <= sampled
    assert result.tokens_generated == sum(sum(m.response.loss_mask) for g in result.groups
                                          for m in g.members) + result.tokens_aborted
    # ... and so does what the length predictor learns from
    by_uid = {pl.prompt.uid: pl for pl in result.lengths}
    for g in result.groups:
        assert sorted(by_uid[g.prompt.uid].finished) == sorted(m.response.trained() for m in g.members)
    assert not inner.running and not engine._live and not other_tasks()
    assert factory.closed == len(factory.made)
    assert sum(1 for kind, _ in log if kind == "reset") == len(factory.made)
    responses = [m.response for g in result.groups for m in g.members]
    masked = sum(len(r.token_ids) - sum(r.loss_mask) for r in responses)
    assert turn_metrics(responses) == {
        "turns_mean": 2.0, "turns_p50": 2.0, "turns_max": 2.0, "tool_calls": 4.0,
        "tool_failures": 0.0, "tool_seconds": 2.0, "tool_s_p50": 0.5, "tool_s_p99": 0.5,
        "tool_queued_s": 0.0,
        "masked_token_frac": masked / sum(len(r.token_ids) for r in responses)}
    assert turn_metrics([dataclasses.replace(r, turns=None, loss_mask=()) for r in responses]) == {}


async def test_tail_batching_defers_many_turn_prompts_to_a_long_round(tokenizer) -> None:
    """Over steps: one prompt in five takes 6 turns, the others 1; short rounds train
    the quick ones and defer the slow ones, whose long round runs every trajectory to
    its end; the step records carry the turn metrics."""
    ps = prompts(20)
    log: list[tuple[str, str]] = []
    factory = Recording(lambda: CountingEnv(lambda p: 6 if int(p.uid[1:]) % 5 == 0 else 1, log))
    inner = TurnEngine(lambda req: "y" * 4, encode_with(tokenizer), chunk=1)
    engine = agent(inner, factory, ps, tokenizer, max_turns=8)
    policy = TailPolicy(ps, Sampling(prompts_per_step=4, responses_per_prompt=2, max_tokens=600),
                        shuffle=False)
    runner = AsyncTrainer(RecordingTrainer())
    try:
        outcomes = [await run_step(step, policy, engine, LengthScorer(10**6), runner, mean_centred,
                                   version=0) for step in range(1, 6)]
    finally:
        await runner.aclose()
    kinds = [o.round.plan.kind for o in outcomes]
    assert kinds == [RoundKind.SHORT] * 4 + [RoundKind.LONG]
    for o in outcomes[:4]:
        assert all(int(g.prompt.uid[1:]) % 5 for g in o.round.groups)
        assert step_record(o)["turns_max"] == 1.0
        assert step_record(o)["multi_call_trajectories"] == 0.0
    long = outcomes[4]
    assert {g.prompt.uid for g in long.round.groups} == {"p0", "p5", "p10", "p15"}
    assert long.round.aborted == 0
    record = step_record(long)
    assert record["turns_mean"] == 6.0 and record["tool_calls"] == 8 * 5
    assert record["multi_call_trajectories"] == 8.0
    assert record["multi_call_reward_sum"] == sum(m.reward for g in long.round.groups for m in g.members)
    assert 0 < record["masked_token_frac"] < 1
    assert not inner.running and not engine._live and factory.closed == len(factory.made)


async def test_unknown_prompt_uid_is_refused_before_anything_starts(tokenizer) -> None:
    inner = TurnEngine(lambda r: "hi", encode_with(tokenizer))
    engine = agent(inner, tool_env("add_numbers"), prompts(1), tokenizer)
    from rpk.core.records import GenRequest

    with pytest.raises(ValueError, match="prompt_uid 'zzz'"):
        await engine.start([GenRequest("r", (1,), 10, prompt_uid="zzz")])
    assert not inner.seen


def test_schema_file_json_round_trips(tmp_path) -> None:
    """The schemas a ToolEnv's runner exposes are what a chat template takes."""
    runner = ToolRunner([load_tool("calculator")])
    assert json.loads(json.dumps(runner.schemas))[0]["function"]["name"] == "calculator"


async def test_short_round_on_virtual_time_does_not_wait_for_slow_tools() -> None:
    """Four prompts, three trajectories each, groups of two, two groups needed; the
    tools of prompts 2 and 3 take 30 virtual seconds a call. The round ends once the
    quick prompts' groups are in, a fraction of one slow call, with the slow
    trajectories aborted inside their tool calls and their prompts left incomplete."""
    ps = prompts(4)
    sim = SimEngine(lambda r: 20, cost=CostModel(base_s=0.01, per_seq_s=0.0), chunk=5)
    envs: list[SlowTools] = []

    def make() -> SlowTools:
        envs.append(SlowTools(sim, 2, lambda p: 30.0 if p.uid in ("p2", "p3") else 0.1))
        return envs[-1]

    engine = AgentEngine(sim, make, FixedObservation(), {p.uid: p for p in ps}, max_turns=8)
    result = await run_round(plan(ps, 3, 2, 2), engine, LengthScorer(10**6), mean_centred,
                             version=0, clock=sim.clock)
    assert sorted(g.prompt.uid for g in result.groups) == ["p0", "p1"]
    assert sorted(p.uid for p in result.incomplete) == ["p2", "p3"]
    # 3 turns of 20 tokens at 10 ms a step, 2 tool calls of 0.1 s: about 0.8 s
    assert result.ended_at - result.started_at == pytest.approx(0.8, abs=0.05)
    for g in result.groups:
        for m in g.members:
            assert m.response.turns.turns == 3 and m.response.turns.tools.seconds == pytest.approx(0.2)
            assert m.response.loss_mask == (1,) * 20 + (0,) * 3 + (1,) * 20 + (0,) * 3 + (1,) * 20
    assert all(env.closed for env in envs) and len(envs) == 12
    assert not engine._live
    assert not [t for t in other_tasks() if t.get_name() != "sim-engine"]
    await sim.shutdown()


@pytest.mark.parametrize("staggered", [False, True])
async def test_tool_time_is_exposed_only_while_no_turn_decodes(staggered: bool) -> None:
    """Two trajectories of one prompt, one 0.1 s tool call each between two turns of
    20 tokens (10 ms a token). In lockstep both call at once, 0.2-0.3 s, with nothing
    decoding: every tool second is exposed. Staggered (trajectory 1's first turn is 40
    tokens), each call overlaps the other's decoding: none is."""
    ps = prompts(1)

    def length(r) -> int:
        return 40 if staggered and r.request_id.endswith("-r1-t1") else 20

    sim = SimEngine(length, cost=CostModel(base_s=0.01, per_seq_s=0.0), chunk=5)
    engine = AgentEngine(sim, lambda: SlowTools(sim, 1, lambda p: 0.1), FixedObservation(),
                         {p.uid: p for p in ps}, max_turns=8, clock=sim.clock)
    result = await run_round(plan(ps, 2, 2, 1, kind=RoundKind.SYNC), engine, LengthScorer(10**6),
                             mean_centred, version=0, clock=sim.clock)
    turns = [m.response.turns for g in result.groups for m in g.members]
    assert len(turns) == 2 and all(t.tools.seconds == pytest.approx(0.1) for t in turns)
    expected = 0.0 if staggered else 0.1
    assert [t.tools.exposed_s for t in turns] == pytest.approx([expected, expected], abs=1e-6)
    # The step's figure is wall time: in lockstep the two calls' 0.2 tool seconds overlap
    # in 0.1 s, and that is all the engine idled.
    lap = engine.lap()
    assert lap == pytest.approx({"engine_idle_s": expected, "tool_exposed_s": expected}, abs=1e-6)
    assert engine.lap() == {"engine_idle_s": 0.0, "tool_exposed_s": 0.0}
    activity = engine.activity
    assert (activity.live, activity.decoding, activity.acting) == (0, 0, 0)
    await sim.shutdown()


class _CloseRaisesCancelled(ScriptedEngine):
    """p0's response runs long and its stream's close ends in CancelledError, as a
    trajectory's close can (its inner turn's abort shielded, then cancelled); the other
    prompts' responses take 10 ms a chunk, so p0 gives itself up first."""

    async def generate(self, request):
        slow = not request.request_id.startswith("s1-p0-")
        try:
            async for delta in super().generate(request):
                if slow:
                    await asyncio.sleep(0.01)
                yield delta
        finally:
            if not slow:
                raise asyncio.CancelledError


async def test_a_request_that_gave_itself_up_is_aborted_once_when_its_close_is_cancelled() -> None:
    """defer_after gives up p0 (the round needs 2 of 3 prompts); the close of its stream
    raises CancelledError. The round completes on p1 and p2 with p0 aborted, once
    (before the fix: `IllegalTransition: aborted -> aborted`, the run's end)."""
    ps = prompts(3)
    engine = _CloseRaisesCancelled(lambda r: 400 if r.request_id.startswith("s1-p0-") else 8)
    round_plan = dataclasses.replace(plan(ps, 1, 1, 2), defer_after=8)
    result = await run_round(round_plan, engine, LengthScorer(10**6), mean_centred, version=0)
    assert sorted(g.prompt.uid for g in result.groups) == ["p1", "p2"]
    assert [p.uid for p in result.incomplete] == ["p0"]
    assert result.aborted == 1


async def test_sibling_trajectories_draft_from_each_others_turns(tokenizer) -> None:
    """Speculative decoding over trajectories: every trajectory so far (turns and
    observations) goes out as a sibling draft once an observation is in, and whole
    trajectories when they finish; each keyed by the prompt all of its turns start with."""
    from rpk.core.drafts import DraftSource
    from rpk.loop.speculate import SpecTail
    from rpk.sched.speculate import SpecRule, Speculation

    ps = prompts(2)
    log: list[tuple[str, str]] = []
    factory = Recording(lambda: CountingEnv(lambda p: 3, log))
    inner = TurnEngine(lambda req: "y" * 5, encode_with(tokenizer), chunk=2)
    engine = agent(inner, factory, ps, tokenizer, max_turns=8)

    class Fleet:
        def __init__(self) -> None:
            self.added: list = []

        def draft_targets(self) -> dict[str, int]:
            return {"r0": 64}

        async def set_drafts(self, schedules, sources, prompts) -> None:
            return None

        async def add_drafts(self, prompts) -> None:
            self.added += prompts

        async def take_spec_stats(self) -> dict:
            return {}

        def tail_in_flight(self) -> None:
            return None

        def settle(self) -> None:
            return None

    fleet = Fleet()
    spec = SpecTail(Speculation(set(DraftSource), SpecRule(adaptive=False)), fleet)
    engine.on_turn = spec.turn
    p = plan(ps, 2, 2, 2, max_tokens=1000, kind=RoundKind.SYNC)
    await spec.before_round(p)
    async with asyncio.TaskGroup() as tg:
        feed = tg.create_task(spec.feed())
        result = await run_round(p, engine, LengthScorer(10**6), mean_centred, version=0,
                                 on_finished=spec.finished)
        spec.end_round()
    assert feed.done()
    # 2 prompts x 2 trajectories x (2 observations + the finish)
    assert len(fleet.added) == 12
    assert {d.prompt for d in fleet.added} == {q.token_ids for q in ps}
    finals = {m.response.token_ids for g in result.groups for m in g.members}
    texts = [d.drafts[0].token_ids for d in fleet.added]
    assert finals <= set(texts)
    # A trajectory so far is a prefix of its whole: the drafts run ahead of a sibling behind.
    assert all(any(f[: len(t)] == t for f in finals) for t in texts)
