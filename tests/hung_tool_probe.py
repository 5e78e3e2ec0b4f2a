"""A process whose blocking tool calls hang, interrupted as `python -m rpk.run` is:
`python -m tests.hung_tool_probe` runs four calls of a tool that never returns, on
rpk's tool workers, inside rpk.run's own signal handling (`_interruptible`) and event
loop (`run_async`), prints `calling` once they run, and exits 128 + the signal's number
when SIGINT or SIGTERM stops it. The test checks it exits within seconds: a thread of
the loop's default executor would be joined at exit and keep it alive for the hour."""

from __future__ import annotations

import asyncio
import sys

from rpk.agent.parse import ToolCall
from rpk.agent.tools import ToolRunner, load_tool
from rpk.agent.workers import ToolWorkers
from rpk.obs.progress import LiveProgress
from rpk.run import Interrupted, _interruptible, run_async

CALLS = 4


async def _calls() -> None:
    runner = ToolRunner([load_tool("tests.blocking_tools:hang_forever")], timeout_s=7200.0,
                        workers=ToolWorkers(CALLS))
    async with asyncio.TaskGroup() as tg:
        for i in range(CALLS):
            tg.create_task(runner.run(ToolCall("hang_forever", {"x": i})), name=f"call-{i}")
        while runner.workers.running < CALLS:
            await asyncio.sleep(0.01)
        print("calling", flush=True)


def main() -> int:
    try:
        run_async(_interruptible(_calls(), LiveProgress(1, live=False)))
    except Interrupted as e:
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
