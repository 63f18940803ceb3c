"""The client finds its gateway and key where the ``sluice`` commands do: the arguments,
else ``SLUICE_URL`` and ``SLUICE_API_KEY``, else a local gateway without a key."""

from __future__ import annotations

import pytest

from sluice.client import AsyncClient, Client


def test_arguments_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_URL", "http://elsewhere:9000")
    monkeypatch.setenv("SLUICE_API_KEY", "from-the-environment")
    with Client("http://gateway:8000/", api_key="given") as client:
        assert client.url == "http://gateway:8000"
        assert client._http.headers["Authorization"] == "Bearer given"


def test_the_environment_names_the_gateway_and_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_URL", "https://sluice.example:8443/")
    monkeypatch.setenv("SLUICE_API_KEY", "team-key")
    with Client() as client:
        assert client.url == "https://sluice.example:8443"
        assert client._http.headers["Authorization"] == "Bearer team-key"


async def test_the_async_client_reads_them_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICE_URL", "http://async-gateway:8000")
    monkeypatch.delenv("SLUICE_API_KEY", raising=False)
    client = AsyncClient()
    try:
        assert client.url == "http://async-gateway:8000"
        assert "Authorization" not in client._http.headers
    finally:
        await client.aclose()


def test_without_either_a_local_gateway(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLUICE_URL", raising=False)
    monkeypatch.delenv("SLUICE_API_KEY", raising=False)
    with Client() as client:
        assert client.url == "http://127.0.0.1:8000"
        assert "Authorization" not in client._http.headers
