"""A checkpoint's `rpk_state.json` as a typed record: what `save` writes, `read_state`
reads back field for field; a file that is not a run state is refused naming the file
and what is wrong with it."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from rpk import checkpoint
from rpk.checkpoint import STATE_FILE, CheckpointError, RunState, read_state


def test_what_save_writes_read_state_reads_back(tmp_path: Path) -> None:
    state = RunState(7, {"queue": [3, 1], "cursor": {"epoch": 1, "position": 5}}, version=7,
                     tp_planner={"history": []}, fingerprint={"run.seed": 0, "model": "tiny-x"})

    async def save_model(directory: Path) -> None:
        (directory / "weights").write_bytes(b"w")

    ckpt = asyncio.run(checkpoint.save(tmp_path, state, save_model))
    assert ckpt.name == "step_000007"
    assert read_state(ckpt) == state
    point = checkpoint.resume_point(tmp_path)
    assert point.state == state and point.step == 7


def test_a_checkpoint_from_before_the_version_and_planner_reads_with_defaults(tmp_path: Path) -> None:
    (tmp_path / STATE_FILE).write_text(json.dumps({"step": 2, "policy": {"dropped": 0}}))
    assert read_state(tmp_path) == RunState(2, {"dropped": 0}, version=0, tp_planner={}, fingerprint={})


@pytest.mark.parametrize("content, needle", [
    ("{not json", "unreadable rpk_state.json"),
    ("[1, 2]", "must hold a JSON object, got list"),
    ('{"policy": {}}', "no 'step'"),
    ('{"step": "3", "policy": {}}', "'step' must be int, got '3'"),
    ('{"step": true, "policy": {}}', "'step' must be int, got True"),
    ('{"step": 3, "policy": {}, "cursor": 1}', "unknown fields ['cursor']"),
])
def test_a_bad_state_file_is_named_with_its_problem(tmp_path: Path, content: str, needle: str) -> None:
    (tmp_path / STATE_FILE).write_text(content)
    with pytest.raises(CheckpointError) as info:
        read_state(tmp_path)
    assert str(tmp_path) in str(info.value)
    assert needle in str(info.value)


def test_a_save_reads_each_file_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rpk import manifest

    read: list[str] = []
    real = manifest._hash

    def counted(path: Path, sync: bool = False) -> tuple[int, str]:
        read.append(path.name)
        return real(path, sync)

    monkeypatch.setattr(manifest, "_hash", counted)

    async def save_model(directory: Path) -> None:
        (directory / "weights").write_bytes(b"w" * 1000)

    ckpt = asyncio.run(checkpoint.save(tmp_path, RunState(1, {}), save_model))
    assert sorted(read) == ["rpk_state.json", "weights"]  # sealed, not hashed again
    assert manifest.verify(ckpt).ok
