"""The base URL a client is given: the broker's, to which it appends `/v1/...` itself. A URL
ending in the API's prefix, or with a query or fragment the paths would be appended to, is
refused when the client is made, naming the URL to give instead; before, its first request met
a bare 404."""

from __future__ import annotations

import re

import pytest
from rollout_broker_client import AsyncBrokerClient, BrokerClient

CLIENTS = [BrokerClient, AsyncBrokerClient]


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("http://broker:8000/v1", "http://broker:8000"),
        ("http://broker:8000/v1/", "http://broker:8000"),
        ("https://gw.example/rollouts/v1", "https://gw.example/rollouts"),
    ],
)
def test_a_url_ending_in_the_api_prefix_is_refused_naming_the_base(
    client: type, url: str, base: str
) -> None:
    with pytest.raises(ValueError, match=rf"ends in /v1, .*without it, {re.escape(base)}$"):
        client(url, token="")


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("url", ["http://broker:8000/?tenant=a", "http://broker:8000/x#top"])
def test_a_url_with_a_query_or_fragment_is_refused(client: type, url: str) -> None:
    with pytest.raises(
        ValueError, match=r"query or a fragment.*base URL alone, http://broker:8000"
    ):
        client(url, token="")


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize(
    ("url", "base"),
    [
        ("http://broker:8000/", "http://broker:8000"),
        ("https://gw.example/rollouts/", "https://gw.example/rollouts"),
        ("http://broker:8000/v10", "http://broker:8000/v10"),  # not the prefix
    ],
)
def test_a_base_url_is_kept_without_its_trailing_slash(client: type, url: str, base: str) -> None:
    assert client(url, token="").base_url == base
