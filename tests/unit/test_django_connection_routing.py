"""Django's ``connections`` asks the body's context first (fence.py's routing), without a
server: what it relies on in Django (``ConnectionHandler`` keeps its connections in
``_connections``, read by attribute) and in Python (a context carried into the threads
asyncio and asgiref run code in, not into a plain thread). A Django release that keeps
connections elsewhere fails here first."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from typing import Any

import django
import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.conf import settings
from django.db import connections

from pglock_celery.django import fence


class StandIn:
    """What the fence sets for a body: a wrapper known by its alias."""

    alias = "default"


@pytest.fixture
def body() -> Iterator[StandIn]:
    if not settings.configured:
        settings.configure()
        django.setup()
    fence._route_connections()
    wrapper = StandIn()
    token = fence._bodys_wrapper.set(wrapper)  # type: ignore[arg-type]
    yield wrapper
    fence._bodys_wrapper.reset(token)


def in_a_plain_thread(read: Callable[[], Any]) -> Any:
    seen: list[Any] = []
    thread = threading.Thread(target=lambda: seen.append(read()))
    thread.start()
    thread.join(10)
    return seen[0]


def test_the_bodys_context_gets_its_wrapper_for_its_alias_only(body: StandIn) -> None:
    assert connections["default"] is body
    assert fence._bodys_wrapper.get() is body
    # The project's own connection, for any caller outside a body.
    assert in_a_plain_thread(lambda: connections["default"]) is not body


def test_asyncio_and_asgiref_carry_the_bodys_wrapper_into_their_threads(body: StandIn) -> None:
    def read() -> Any:
        return connections["default"]

    async def awaited(sensitive: bool) -> Any:
        return await sync_to_async(read, thread_sensitive=sensitive)()

    assert asyncio.run(awaited(True)) is body
    assert asyncio.run(awaited(False)) is body
    assert asyncio.run(asyncio.to_thread(read)) is body

    async def in_a_loop() -> Any:
        return read()

    assert async_to_sync(in_a_loop)() is body


def test_routing_is_installed_once_and_writes_go_to_the_threads_own_storage(
    body: StandIn,
) -> None:
    routed = connections._connections
    fence._route_connections()
    assert connections._connections is routed
    sentinel = object()
    connections["pglock_routing_test"] = sentinel
    try:
        assert connections["pglock_routing_test"] is sentinel
    finally:
        del connections["pglock_routing_test"]
