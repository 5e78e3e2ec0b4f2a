"""An engine host caps what a client may upload: buckets and bytes per update (one
weight version), and updates spooled but not loaded."""

from __future__ import annotations

import pytest
from aiohttp import web

from rpk.cluster.host import HostService, UploadCaps
from rpk.engine.layouts import Layout, Layouts, LayoutState


@pytest.fixture
def service():
    layouts = Layouts([Layout(1, ("tp1.0",), [object()], LayoutState.AWAKE)])
    s = HostService(1, layouts, max_live=4, heartbeat_s=1.0, caps=UploadCaps(
        max_bucket_bytes=100, max_update_buckets=2, max_update_bytes=150, max_pending_updates=2))
    yield s
    s.discard_updates()


def refusal(service: HostService, update: str, index: int, nbytes: int, kind: type) -> str:
    with pytest.raises(kind) as refused:
        service.spool(update, index, nbytes)
    return refused.value.text


def test_buckets_per_update_are_capped(service: HostService) -> None:
    service.spool("u1", 0, 10)
    service.spool("u1", 1, 10)
    text = refusal(service, "u1", 2, 10, web.HTTPRequestEntityTooLarge)
    assert "update u1 has 2 buckets; the cap is 2" in text


def test_bytes_per_update_are_capped(service: HostService) -> None:
    service.spool("u1", 0, 100)
    text = refusal(service, "u1", 1, 60, web.HTTPRequestEntityTooLarge)
    assert "would hold 160 bytes; the cap is 150" in text
    service.spool("u1", 1, 50)  # up to the cap is fine


def test_updates_waiting_to_load_are_capped_and_loading_frees_a_place(service: HostService) -> None:
    service.spool("u1", 0, 10)
    service.spool("u2", 0, 10)
    assert "(['u1', 'u2']); the cap is 2" in refusal(service, "u3", 0, 10, web.HTTPTooManyRequests)
    for path in service.take_update("u1"):
        path.unlink()
    service.spool("u3", 0, 140)  # a loaded update's bytes no longer count either
