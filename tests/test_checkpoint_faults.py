"""Checkpoints that prove themselves, under faults at every write: ENOSPC, EIO or a
SIGKILL at each file of a save (one process, and two gloo ranks with DCP shards). Each
stops the run with one line naming the failure, leaves nothing a resume picks but the
previous checkpoint, which still verifies, and the resumed run takes the same steps as
the run never interrupted. The real step loop, checkpoint writer and trainer (a tiny
Qwen2 on CPU); a scripted engine stands in for vLLM (rewards vary by prompt and seed)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from rpk import checkpoint, manifest
from rpk.gpu.launch import Joined
from rpk.obs.metrics import read_records
from tests.dist_harness import two_ranks as harness_two_ranks
from tests.fault_runs import FAILED_STEP, FAULT_FILE, RANK1_SHARD, STEPS, config, on_two, run, same
from tests.faults import FAULT_FILE_ENV, KINDS, Fault, Recorder

# Every collective rpk issues is of a device its group serves on the GPU box.
pytestmark = pytest.mark.usefixtures("collective_guard")


# Every file a one-process save opens for writing, in order: the injection points.
FILES = (
    "model-00001.safetensors", "config.json", "generation_config.json", "tokenizer.json",
    "tokenizer_config.json", "trainer/meta.json", "trainer/__0_0.distcp",
    "trainer/.metadata.tmp", "rpk_state.json", "manifest.json",
)
CHECKPOINT_FILES = ("rpk_state.json", "manifest.json")  # rpk.checkpoint's, after the trainer's
# What they are called once in place (renamed by their writers).
RENAMED = {"model-00001.safetensors": "model.safetensors", "trainer/.metadata.tmp": "trainer/.metadata"}


@pytest.fixture(scope="module")
def uninterrupted(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    run_dir = tmp_path_factory.mktemp("whole")
    recorder = Recorder()
    asyncio.run(run(config(), run_dir, model_dir, recorder))
    # Each save shows the hook every file it writes, and the manifest lists them all.
    assert recorder.seen == list(FILES) * STEPS
    listed = manifest.read(run_dir / "checkpoints" / "step_000001")
    assert listed is not None
    assert set(listed["files"]) == {RENAMED.get(f, f) for f in FILES} - {"manifest.json"}
    on_disk = {p.relative_to(run_dir / "checkpoints" / "step_000001").as_posix()
               for p in (run_dir / "checkpoints" / "step_000001").rglob("*") if p.is_file()}
    assert on_disk == set(listed["files"]) | {"manifest.json"}
    assert listed["step"] == 1 and listed["version"] == 1 and listed["bytes"] > 0
    return [same(r) for r in read_records(run_dir / "metrics.jsonl")]


def check_fell_back_and_resumes_exactly(run_dir: Path, model: Path, want: list[dict], make: Any = None) -> None:
    """After a save of step 2 failed: nothing of step 2 is picked, step 1 verifies, and
    the resumed run takes steps 2.. exactly as the uninterrupted one."""
    ckpts = run_dir / "checkpoints"
    assert not (ckpts / f"step_{FAILED_STEP:06d}").exists()
    first = ckpts / "step_000001"
    assert manifest.verify(first).ok
    assert checkpoint.resume_point(run_dir).checkpoint == first
    assert checkpoint.newest(run_dir) == first
    asyncio.run(run(config(resume=run_dir), run_dir, model, make=make))
    assert not list(ckpts.glob(".tmp-*"))
    assert [same(r) for r in read_records(run_dir / "metrics.jsonl")] == want
    assert all(manifest.verify(c).ok for c in ckpts.glob("step_*"))


@pytest.mark.parametrize("kind", ["ENOSPC", "EIO"])
@pytest.mark.parametrize("file", FILES)
def test_a_failed_write_stops_the_run_in_one_line_and_the_resume_is_exact(
    tmp_path: Path, model_dir: Path, uninterrupted: list[dict], file: str, kind: str
) -> None:
    with pytest.raises(checkpoint.CheckpointWriteError) as stopped:
        asyncio.run(run(config(), tmp_path, model_dir, Fault(file, kind, FAILED_STEP)))
    line = str(stopped.value)
    assert "\n" not in line
    assert line.startswith(f"checkpoint step_{FAILED_STEP:06d} not written: ")
    assert f"/{file} ({kind})" in line
    assert ("disk full writing " in line) == (kind == "ENOSPC")
    assert line.endswith(f"the last good one is {tmp_path / 'checkpoints' / 'step_000001'}")
    assert not list((tmp_path / "checkpoints").glob(".tmp-*"))  # removed: its space is back
    check_fell_back_and_resumes_exactly(tmp_path, model_dir, uninterrupted)


@pytest.mark.parametrize("file", FILES)
def test_a_kill_at_any_file_of_a_save_leaves_nothing_a_resume_picks(
    tmp_path: Path, model_dir: Path, uninterrupted: list[dict], file: str
) -> None:
    pid = os.fork()
    if pid == 0:  # the run, SIGKILLed at `file` of step 2's save
        try:
            asyncio.run(run(config(), tmp_path, model_dir, Fault(file, "kill", FAILED_STEP)))
        finally:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == 9, status
    assert (tmp_path / "checkpoints" / f".tmp-step_{FAILED_STEP:06d}").is_dir()
    check_fell_back_and_resumes_exactly(tmp_path, model_dir, uninterrupted)


def test_a_disk_too_full_for_the_checkpoint_is_refused_before_writing(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = manifest.shutil.disk_usage

    def usage(path: Any) -> Any:
        total, used, free = real(path)
        return type(real(path))(total, used, 1000 if FAILED_STEP_DIR in str(path) else free)

    FAILED_STEP_DIR = f"step_{FAILED_STEP:06d}"
    monkeypatch.setattr(manifest.shutil, "disk_usage", usage)
    with pytest.raises(checkpoint.CheckpointWriteError) as stopped:
        asyncio.run(run(config(), tmp_path, model_dir))
    line = str(stopped.value)
    tmp = tmp_path / "checkpoints" / f".tmp-{FAILED_STEP_DIR}"
    prefix = f"checkpoint {FAILED_STEP_DIR} not written: disk full: {tmp} needs "
    assert line.startswith(prefix) and " bytes, 1,000 free;" in line, line
    needed = int(line[len(prefix):].split(" ")[0].replace(",", ""))
    written = manifest.read(tmp_path / "checkpoints" / "step_000001")
    assert written is not None and 0.9 * written["bytes"] <= needed <= 2 * written["bytes"]
    assert not tmp.exists()


# -- damaged checkpoints: verify, fall back, refuse, prune ---------------------------


@pytest.fixture
def finished(tmp_path: Path, model_dir: Path) -> Path:
    """A finished run: checkpoints of steps 1, 2 and 3."""
    asyncio.run(run(config(), tmp_path, model_dir))
    return tmp_path


def test_a_truncated_weight_file_is_named_and_the_resume_falls_back(finished: Path, capsys: Any) -> None:
    newest = finished / "checkpoints" / "step_000003"
    os.truncate(newest / "model.safetensors", 1000)
    point = checkpoint.resume_point(finished)
    assert point.checkpoint == finished / "checkpoints" / "step_000002"
    [damaged] = point.rejected
    assert damaged.checkpoint == newest
    assert damaged.problem is not None and damaged.problem.startswith("model.safetensors is 1,000 bytes")
    assert damaged.problem.endswith("(truncated)")
    # Named as the one to resume from, it stops the run instead.
    with pytest.raises(checkpoint.CheckpointError,
                       match="checkpoint step_000003 fails its check: model.safetensors is 1,000"):
        checkpoint.resume_point(newest)
    # The table: every checkpoint, the newest failing (exit 1).
    assert checkpoint.main(["verify", str(finished)]) == 1
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert lines[0].split() == ["checkpoint", "step", "files", "bytes", "check"]
    assert [line.split()[0] for line in lines[1:]] == ["step_000001", "step_000002", "step_000003"]
    assert lines[1].endswith("  ok") and lines[2].endswith("  ok")
    assert "FAILED: model.safetensors is 1,000 bytes" in lines[3]
    assert lines[3].split()[1:3] == ["3", str(len(FILES) - 1)]
    assert err.strip() == "rpk: the newest checkpoint, step_000003, fails; a resume takes step_000002"


def test_a_flipped_bit_is_caught_by_the_hash_and_only_by_it(finished: Path) -> None:
    shard = finished / "checkpoints" / "step_000003" / "trainer" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    point = checkpoint.resume_point(finished)
    assert point.checkpoint.name == "step_000002"
    assert point.rejected[0].problem == "trainer/__0_0.distcp does not match its xxh3_128 hash (its bytes changed)"
    # run.verify_checkpoint=false checks the sizes only.
    assert checkpoint.resume_point(finished, hashes=False).checkpoint.name == "step_000003"
    assert checkpoint.main(["verify", str(finished), "--sizes-only"]) == 0


def test_missing_files_and_a_lost_manifest(finished: Path) -> None:
    """A run directory copied half-way: a file missing, a manifest missing."""
    ckpts = finished / "checkpoints"
    (ckpts / "step_000003" / "trainer" / "meta.json").unlink()
    (ckpts / "step_000002" / manifest.MANIFEST_FILE).unlink()
    point = checkpoint.resume_point(finished)
    assert point.checkpoint.name == "step_000001"
    # Only the damaged one is reported: one with no manifest is unfinished, not damaged.
    assert [v.problem for v in point.rejected] == ["trainer/meta.json is missing"]
    assert manifest.verify(ckpts / "step_000002").problem == (
        "manifest.json is missing: the checkpoint is incomplete")
    for c in ckpts.glob("step_*"):
        (c / "rpk_state.json").unlink()
    damaged = "step_000003: rpk_state.json is missing; step_000001: rpk_state.json is missing"
    with pytest.raises(checkpoint.CheckpointError, match=f"no complete checkpoint in .*; damaged: {damaged}"):
        checkpoint.resume_point(finished)


def test_retention_prunes_only_after_the_new_checkpoint_verifies(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keep_one = replace(config(), run=replace(config().run, keep_checkpoints=1))
    asyncio.run(run(keep_one, tmp_path, model_dir))
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_000003"]

    # A new checkpoint that does not verify once written (lost by the filesystem): the
    # run stops, and the last good one stays.
    good = tmp_path / "checkpoints" / "step_000003"

    def lossy(ckpt: Path, hashes: bool = True) -> manifest.Verdict:
        if ckpt.name == "step_000004":
            return manifest.Verdict(ckpt, "model.safetensors is 0 bytes, its manifest says 93,944")
        return real(ckpt, hashes)

    real = manifest.verify
    monkeypatch.setattr(manifest, "verify", lossy)

    async def save_model(directory: Path) -> None:
        (directory / "weights").write_bytes(b"w")

    with pytest.raises(checkpoint.CheckpointWriteError,
                       match="step_000004 does not verify right after its write: model.safetensors is 0 bytes"):
        asyncio.run(checkpoint.save(tmp_path, checkpoint.RunState(4, {}, version=4), save_model, keep=1))
    assert good.is_dir() and real(good).ok


# -- two ranks: DCP shards ------------------------------------------------------------


# Rank 0 writes every file of a one-process save (its own shard included); rank 1 its shard.
TWO_RANK_FILES = (*FILES, RANK1_SHARD)


@pytest.fixture(scope="module")
def two_ranks() -> Iterator[Joined]:
    with harness_two_ranks(env={FAULT_FILE_ENV: str(FAULT_FILE)}) as joined:
        yield joined
    FAULT_FILE.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def uninterrupted_on_two(two_ranks: Joined, model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    run_dir = tmp_path_factory.mktemp("whole-two")
    asyncio.run(run(config(), run_dir, model_dir, make=on_two(two_ranks)))
    listed = manifest.read(run_dir / "checkpoints" / "step_000001")
    assert listed is not None and RANK1_SHARD in listed["files"]
    return [same(r) for r in read_records(run_dir / "metrics.jsonl")]


@pytest.mark.parametrize(
    "file, kind",
    [(f, KINDS[i % 2]) for i, f in enumerate(TWO_RANK_FILES)] + [(RANK1_SHARD, "EIO")],
)
def test_a_failed_write_on_either_rank_stops_both_and_the_resume_is_exact(
    tmp_path: Path, model_dir: Path, two_ranks: Joined, uninterrupted_on_two: list[dict],
    file: str, kind: str,
) -> None:
    with pytest.raises(checkpoint.CheckpointWriteError) as stopped:
        asyncio.run(run(config(), tmp_path, model_dir, Fault(file, kind, FAILED_STEP), make=on_two(two_ranks)))
    line = str(stopped.value)
    # The trainer's files name the rank that failed; rpk's own (written after) do not.
    rank = "rank 1: " if file == RANK1_SHARD else "" if file in CHECKPOINT_FILES else "rank 0: "
    assert "\n" not in line
    assert line.startswith(f"checkpoint step_{FAILED_STEP:06d} not written: {rank}"), line
    assert f"/{file} ({kind})" in line
    # Both ranks stopped the save together: rank 1 follows the next run's commands.
    check_fell_back_and_resumes_exactly(tmp_path, model_dir, uninterrupted_on_two, make=on_two(two_ranks))
