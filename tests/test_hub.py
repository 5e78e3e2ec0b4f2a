"""`model.path` as a Hugging Face Hub id, resolved from a local cache laid out as the
Hub's (refs, snapshots, blobs), offline: no network in tests."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from rpk import assembly, hub, run
from rpk.config import ConfigError, from_argv
from rpk.tasks import task

MODELS = Path(__file__).parent / "fixtures" / "models"
REPO = "Qwen/Qwen2.5-7B-Instruct"
COMMIT = "a09a35458c702b33eeacc393d103063234e8bc28"


def hub_cache(root: Path, files: dict[str, bytes]) -> Path:
    """`root` as huggingface_hub lays out its cache: blobs by hash, a snapshot of links
    to them under the commit, refs/main naming the commit."""
    repo = root / ("models--" + REPO.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(Path("..", "..", "blobs", blob.name))
    return root


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = (MODELS / "qwen2.5-7b" / "config.json").read_bytes()
    return hub_cache(tmp_path / "hub", {"config.json": config, "tokenizer_config.json": b"{}"})


def test_a_hub_id_is_told_from_a_local_path(tmp_path: Path) -> None:
    assert hub.is_hub_id(REPO)
    assert not hub.is_hub_id(str(tmp_path)) and not hub.is_hub_id("./model") and not hub.is_hub_id("a/b/c")


def test_a_cached_hub_id_resolves_offline_to_its_snapshot(cache: Path) -> None:
    cfg = from_argv(["--model.path", REPO, "--model.hub_cache", str(cache)])
    lines: list[str] = []
    model_dir = assembly.resolve_model(cfg.model, task(cfg.data.task), lines.append)
    assert model_dir.name == COMMIT and (model_dir / "config.json").is_file()
    assert json.loads((model_dir / "config.json").read_text())["hidden_size"] == 3584
    assert REPO in lines[0]


def test_a_dry_run_of_a_hub_id_reads_only_its_config(cache: Path, capsys) -> None:
    code = run.main(["--run.dry_run", "true", "--model.path", REPO, "--model.hub_cache", str(cache),
                     "--dist.gpus", "8", "--dist.gpu_mem_gb", "80"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["plan"]["model_params"] == 7615616512
    assert out["replicas"][0]["engine_args"]["model"].endswith(COMMIT)


def test_an_uncached_hub_id_offline_is_one_config_error(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = from_argv(["--model.path", "Qwen/Not-There", "--model.hub_cache", str(tmp_path)])
    with pytest.raises(ConfigError, match=r"model.path='Qwen/Not-There'.*offline") as e:
        assembly.resolve_model(cfg.model, task(cfg.data.task), lambda line: None)
    assert "\n" not in str(e.value)
