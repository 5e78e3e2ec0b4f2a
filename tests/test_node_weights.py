"""Weights and secrets across nodes, without vLLM or torchrun: the trainer's gloo group
reaching the replicas of an engine host through the host's API (real gloo, real
aiohttp on 127.0.0.1, replicas whose workers are gloo receivers), the run's token kept
out of the rendezvous store, and engine hosts over TLS checked by the controller."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import ipaddress
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from rpk.cluster.host import HostService, UploadCaps, make_app, parse_args, serve, server_ssl
from rpk.cluster.nodes import (
    EngineSpec,
    HostStartError,
    node_transport,
    read_token,
    remote_replica,
    run_token,
    write_token,
)
from rpk.cluster.remote import HostClient, HostError, client_ssl
from rpk.config import ConfigError, from_argv
from rpk.engine.fleet import Fleet
from rpk.engine.layouts import Layout, Layouts, LayoutState
from rpk.sync.backends import Backend, WeightPath, resolve
from tests.replicas import TOKEN, ScriptReplica


class GlooWorkerLLM:
    """One TP-1 replica's weight-sync surface of `AsyncLLM`, its worker a real member of
    the trainer's gloo group (what `GlooWeightTransferEngine` does, minus vLLM's load)."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.fail_on = fail_on
        self.group: Any = None
        self.inits = 0
        self.received: dict[str, torch.Tensor] = {}
        self.finished: list[str | None] = []

    def _maybe_fail(self, what: str) -> None:
        if what == self.fail_on:
            # As a dead engine's workers do: their ends of the group close with them.
            from rpk.sync.gloo import close_group

            close_group(self.group)
            raise RuntimeError("EngineDeadError: the engine core died")

    async def init_weight_transfer_engine(self, request: Any) -> None:
        from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo

        from rpk.sync.gloo import open_group

        info = NCCLWeightTransferInitInfo(**request.init_info)  # what vLLM would accept
        self.inits += 1
        self.group = await asyncio.to_thread(
            open_group, info.master_address, info.master_port, info.rank_offset, info.world_size, 10.0)

    async def start_weight_update(self) -> None:
        self.received = {}

    async def update_weights(self, request: Any) -> None:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

        from rpk.sync.gloo import broadcast

        self._maybe_fail("update")
        info = NCCLWeightTransferUpdateInfo(**request.update_info)
        got = [torch.empty(s, dtype=getattr(torch, d)) for s, d in zip(info.shapes, info.dtype_names)]
        await asyncio.to_thread(broadcast, self.group, got)
        self.received.update(zip(info.names, got))

    async def finish_weight_update(self, version: str | None = None) -> None:
        self.finished.append(version)

    async def shutdown_weight_transfer_engine(self) -> None:
        from rpk.sync.gloo import close_group

        close_group(self.group)
        self.group = None

    async def collective_rpc(self, method: str) -> list[dict[str, str]]:
        from rpk.sync.verify import digest

        assert method == "rpk_weight_digests"
        return [{name: digest(t) for name, t in self.received.items()}]


class GlooReplica(ScriptReplica):
    """A host's replica started with the gloo weight-transfer engine."""

    def __init__(self, fail_on: str | None = None) -> None:
        super().__init__()
        self.llm = GlooWorkerLLM(fail_on)
        self.settings = SimpleNamespace(tensor_parallel_size=1, backend=Backend.GLOO)

    async def weights_loaded(self, version: int, started: float) -> None:
        self.weight_version = version


@contextlib.asynccontextmanager
async def gloo_host(*fakes: GlooReplica):
    names = tuple(f"tp1.{i}" for i in range(len(fakes)))
    service = HostService(1, Layouts([Layout(1, names, list(fakes), LayoutState.AWAKE)]),
                          max_live=16, heartbeat_s=1, caps=UploadCaps(max_bucket_bytes=2**20))
    runner, port = await serve(make_app(service, TOKEN), "127.0.0.1", 0)
    client = HostClient(1, f"http://127.0.0.1:{port}", TOKEN)
    try:
        replicas = [remote_replica(client, info) for info in await client.replicas()]
        yield replicas
    finally:
        await client.close()
        await runner.cleanup()


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(11, 4, generator=g),
            "model.layers.0.mlp.up_proj.weight": torch.randn(6, 4, generator=g),
            "model.norm.weight": torch.randn(4, generator=g).to(torch.bfloat16)}


async def buckets(w: dict[str, torch.Tensor]):
    items = list(w.items())
    yield items[:2]
    yield items[2:]


async def test_gloo_reaches_every_replica_of_a_host_through_its_api_verified(monkeypatch) -> None:
    from rpk.sync.verify import VerifiedTransport

    # As under torchrun, whose agent store setting made every rank a client of a store
    # that nobody served.
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")

    fakes = (GlooReplica(), GlooReplica())
    async with gloo_host(*fakes) as replicas:
        assert [(r.settings.tensor_parallel_size, r.settings.backend) for r in replicas] == [
            (1, Backend.GLOO), (1, Backend.GLOO)]
        fleet = Fleet(Layouts([Layout(1, ("n1.tp1.0", "n1.tp1.1"), replicas, LayoutState.AWAKE)]),
                      VerifiedTransport(node_transport(Backend.GLOO, "127.0.0.1")), version=0)
        for version in (1, 2):
            sent = weights(version)
            await asyncio.wait_for(fleet.update_weights(buckets(sent), version), 60)
            for fake in fakes:
                assert fake.llm.received.keys() == sent.keys()
                assert all(torch.equal(fake.llm.received[n], t) for n, t in sent.items())
                assert fake.weight_version == version and fake.llm.finished[-1] == str(version)
            assert fleet.versions() == {"n1.tp1.0": version, "n1.tp1.1": version}
        assert [f.llm.inits for f in fakes] == [1, 1]  # one group, kept from sync to sync
        await fleet.shutdown()
        assert all(f.llm.group is None for f in fakes)  # the group ended on the host's side too


async def test_a_remote_replica_failing_mid_sync_is_named_and_nobody_takes_the_version() -> None:
    from rpk.sync.gloo import open_group
    from rpk.sync.lanes import GlooEnd, WeightSyncError
    from rpk.sync.transport import CollectiveTransport

    good, bad = GlooReplica(), GlooReplica(fail_on="update")
    async with gloo_host(good, bad) as replicas:
        # The sender's thread waits out gloo's timeout on the group it dropped: short here.
        transport = CollectiveTransport(lambda b, a, port, world: GlooEnd(open_group(a, port, 0, world, 5.0)))
        fleet = Fleet(Layouts([Layout(1, ("n1.tp1.0", "n1.tp1.1"), replicas, LayoutState.AWAKE)]),
                      transport, version=0)
        with pytest.raises(WeightSyncError, match=r"replica tp1\.1 failed in update_weights: .*"
                                                  r"node 1 replica tp1\.1: transfer update: .*EngineDeadError"):
            await asyncio.wait_for(fleet.update_weights(buckets(weights(1)), 1), 60)
        assert fleet.versions() == {"n1.tp1.0": 0, "n1.tp1.1": 0}
        assert good.weight_version == bad.weight_version == 0 and not good.llm.finished
        await fleet.shutdown()


def test_weights_reach_other_nodes_over_gloo_unless_shm_is_asked() -> None:
    def remote(choice: str, platform: str) -> Backend:
        return resolve(choice, platform, {1}).remote

    assert [remote(t, "cpu") for t in ("auto", "cpu_ipc", "gloo", "shm")] == [
        "gloo", "gloo", "gloo", "shm"]
    assert [remote(t, "cuda") for t in ("auto", "gloo", "shm")] == ["shm", "gloo", "shm"]
    # A LoRA run's adapters, on this node and the others, whatever the choice.
    assert resolve("gloo", "cpu", {0}, adapter=True) == WeightPath(Backend.ADAPTER, Backend.ADAPTER)


# -- the run's token ------------------------------------------------------------------


def test_the_token_goes_through_a_file_only_its_user_reads_never_the_spec(tmp_path) -> None:
    token, path = run_token(tmp_path / "runs", env={})
    assert path is not None and path.parent == (tmp_path / "runs").resolve()
    assert oct(path.stat().st_mode & 0o777) == "0o600" and path.read_text() == token
    spec = EngineSpec("/m", {}, (1,), 1, (), 0, str(path))
    assert token not in spec.to_json()
    assert read_token(spec, env={}) == token
    path.chmod(0o644)
    with pytest.raises(HostStartError, match=r"-rw-r--r--.*must be this user's .* alone"):
        read_token(spec, env={})
    with pytest.raises(HostStartError, match="run.out_dir must be shared by the nodes"):
        read_token(EngineSpec("/m", {}, (1,), 1, (), 0, str(tmp_path / "gone")), env={})


def test_a_token_the_launcher_set_is_used_and_written_nowhere(tmp_path) -> None:
    assert run_token(tmp_path, env={"RPK_ENGINE_TOKEN": "from-launcher"}) == ("from-launcher", None)
    assert list(tmp_path.iterdir()) == []
    spec = EngineSpec("/m", {}, (1,), 1, (), 0, "")
    assert read_token(spec, env={"RPK_ENGINE_TOKEN": "from-launcher"}) == "from-launcher"
    with pytest.raises(HostStartError, match="RPK_ENGINE_TOKEN set by the launcher on every node"):
        read_token(spec, env={})
    assert write_token(tmp_path, "x") != write_token(tmp_path, "x")  # never one file reused


# -- TLS -------------------------------------------------------------------------------


def self_signed(into: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, made here: with `cryptography` if it is
    installed, else the openssl command; the test is skipped without either."""
    cert, key = into / "host.pem", into / "host.key"
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        if shutil.which("openssl") is None:
            pytest.skip("neither the cryptography package nor the openssl command is here")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
                        "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-addext",
                        "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                       check=True, capture_output=True)
        return cert, key
    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(private.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                       critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(private, hashes.SHA256())
    )
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    os.chmod(key, 0o600)
    return cert, key


async def test_a_host_serves_tls_and_the_controller_checks_its_certificate(tmp_path) -> None:
    cert, key = self_signed(tmp_path)
    service = HostService(1, Layouts([Layout(1, ("tp1.0",), [ScriptReplica()], LayoutState.AWAKE)]),
                          max_live=16, heartbeat_s=1, caps=UploadCaps(max_bucket_bytes=2**20))
    runner, port = await serve(make_app(service, TOKEN), "127.0.0.1", 0, server_ssl(cert, key))
    url = f"https://127.0.0.1:{port}"
    clients = [HostClient(1, url, TOKEN, tls=client_ssl(str(cert))),
               HostClient(1, url, TOKEN),  # the system's CAs: they do not know this certificate
               HostClient(1, f"http://127.0.0.1:{port}", TOKEN)]
    try:
        trusted, untrusted, plain = clients
        assert (await trusted.health())["node"] == 1
        assert [r["name"] for r in await trusted.replicas()] == ["tp1.0"]
        with pytest.raises(HostError, match=rf"node 1 .*{url}.*certificate verify failed"):
            await untrusted.replicas()
        with pytest.raises(HostError, match=r"node 1 .*http://127\.0\.0\.1"):
            await plain.replicas()
    finally:
        for client in clients:
            await client.close()
        await runner.cleanup()


def test_tls_settings_are_checked(tmp_path) -> None:
    with pytest.raises(ConfigError, match="dist.tls_ca='ca.pem' without dist.tls_cert"):
        from_argv(["--dist.tls_ca", "ca.pem"])
    with pytest.raises(ConfigError, match="set both or neither"):
        from_argv(["--dist.tls_key", "k.pem"])
    with pytest.raises(ValueError, match=r"dist.tls_ca='.*missing.pem': cannot load it"):
        client_ssl(str(tmp_path / "missing.pem"))
    os.environ.setdefault("RPK_ENGINE_TOKEN", "t")
    with pytest.raises(SystemExit):
        parse_args(["--model", "/m", "--tls-cert", "c.pem"])
