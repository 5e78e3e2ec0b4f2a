"""An environment whose every step calls a blocking tool that never returns, on rpk's
tool workers, for `python -m rpk.run --agent.env tests.hung_env:HungToolEnv`: the run's
first step hangs in its tools. It touches the file `RPK_HUNG_MARK` names once a call
runs, so that a test knows when to interrupt."""

from __future__ import annotations

import os
from pathlib import Path

from rpk.agent.env import EnvStep
from rpk.agent.parse import ToolCall
from rpk.agent.tools import ToolRunner, load_tool
from rpk.agent.workers import ToolWorkers
from rpk.core.records import Prompt, ToolUse

_RUNNER = ToolRunner([load_tool("tests.blocking_tools:hang_forever")], timeout_s=7200.0,
                     workers=ToolWorkers(64))


class HungToolEnv:
    async def reset(self, prompt: Prompt) -> None:
        return None

    async def step(self, turn_text: str) -> EnvStep:
        Path(os.environ["RPK_HUNG_MARK"]).touch()
        result = await _RUNNER.run(ToolCall("hang_forever", {"x": 0}))
        return EnvStep(({"role": "tool", "content": result.text},), tools=ToolUse(calls=1, seconds=result.seconds))

    async def close(self) -> None:
        return None
