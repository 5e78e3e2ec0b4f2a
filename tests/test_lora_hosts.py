"""LoRA adapter versions to an engine host on another node, without vLLM or torchrun: a
real host API on 127.0.0.1 (aiohttp) whose replicas record what they install, reached
through `RemoteReplica.load_adapter` by the run's `AdapterTransport`, beside a replica
of node 0: the same name, id and bytes everywhere, each node's old versions removed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rpk.cluster.host import HostService, UploadCaps, make_app, serve
from rpk.cluster.nodes import remote_replica
from rpk.cluster.remote import HostClient
from rpk.core.modes import RestLevel
from rpk.engine.layouts import Layout, Layouts, LayoutState
from rpk.sync.adapter import CONFIG_FILE, WEIGHTS_FILE, AdapterTransport, AdapterVersion
from tests.replicas import TOKEN, ScriptReplica

CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], "base_model_name_or_path": "/m"}


class AdapterReplica(ScriptReplica):
    """A replica that keeps a copy of each adapter it installs, read from its files."""

    def __init__(self) -> None:
        super().__init__()
        self.installed: list[tuple[AdapterVersion, int, dict[str, torch.Tensor], dict]] = []
        self.base_dropped = False

    async def load_adapter(self, adapter: AdapterVersion, version: int) -> None:
        path = Path(adapter.path)
        tensors = load_file(str(path / WEIGHTS_FILE))
        self.installed.append((adapter, version, tensors, json.loads((path / CONFIG_FILE).read_text())))
        self.weight_version = version


def adapter(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    stem = "base_model.model.model.layers.0.self_attn.q_proj"
    return {f"{stem}.lora_A.weight": torch.randn(2, 8, generator=gen),
            f"{stem}.lora_B.weight": torch.randn(8, 2, generator=gen)}


async def buckets(tensors: dict[str, torch.Tensor]):
    for name, t in tensors.items():
        yield [(name, t)]


async def test_adapter_versions_reach_a_host_replica_as_they_reach_node_0(tmp_path: Path) -> None:
    hosted, local = AdapterReplica(), AdapterReplica()
    service = HostService(1, Layouts([Layout(1, ("tp1.0",), [hosted], LayoutState.AWAKE)]),
                          max_live=16, heartbeat_s=1, caps=UploadCaps(max_bucket_bytes=2**20))
    runner, port = await serve(make_app(service, TOKEN), "127.0.0.1", 0)
    client = HostClient(1, f"http://127.0.0.1:{port}", TOKEN)
    transport = AdapterTransport(CONFIG, root=tmp_path / "node0")
    try:
        remote = remote_replica(client, (await client.replicas())[0])
        for version in (1, 2):
            sent = adapter(version)
            await transport.push(buckets(sent), [remote, local], version)
            assert remote.weight_version == local.weight_version == version
            (got_local, v_local, t_local, c_local) = local.installed[-1]
            (got_host, v_host, t_host, c_host) = hosted.installed[-1]
            named = (f"rpk-lora-v{version}", version + 1)
            assert (got_host.name, got_host.lora_id) == (got_local.name, got_local.lora_id) == named
            assert v_host == v_local == version and c_host == c_local == CONFIG
            assert Path(got_host.path) != Path(got_local.path)  # the host's own copy
            for name in sent:
                assert torch.equal(t_host[name], sent[name]) and torch.equal(t_local[name], sent[name])
            # Each node keeps only the version its replicas serve.
            assert [p.name for p in service.adapters.root.iterdir()] == [f"v{version}"]
            assert [p.name for p in (tmp_path / "node0").iterdir()] == [f"v{version}"]
        assert remote.adapter == local.installed[-1][0]

        # A replica whose base a level-2 sleep dropped is refused by name, nothing sent.
        await remote.sleep(RestLevel.DROP_WEIGHTS)
        with pytest.raises(RuntimeError, match=r"replicas \['tp1\.0'\] dropped their base weights"):
            await transport.push(buckets(adapter(3)), [local, remote], 3)
        assert local.weight_version == 2 and len(hosted.installed) == 2
    finally:
        await transport.close()
        service.adapters.remove()
        await client.close()
        await runner.cleanup()
