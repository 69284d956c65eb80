"""Where a device sends its models token (transport.models_auth.token_destination_problem): the hosts its own
configuration names, over https, plain http only to loopback or when [edge] models_plain_http allows it."""

from __future__ import annotations

import pytest

from edge_client.config import EdgeSettings
from flayer.config import ConfigError
from transport.models_auth import token_destination_problem

HOSTS = ["broker.example.org", "127.0.0.1"]


@pytest.mark.parametrize("url, plain, problem", [
    ("https://broker.example.org:8443/models", False, None),
    ("https://BROKER.example.org./models", False, None),
    ("http://127.0.0.1:8080/models", False, None),  # loopback: no network to cross
    ("http://broker.example.org:8080/models", False, "plain http across a network"),
    ("http://broker.example.org:8080/models", True, None),
    ("https://models.attacker.example/m", False, "is not this device's broker host"),
    ("https://127.0.0.2/m", True, "is not this device's broker host"),
    ("https://broker.example.org.attacker.example/m", False, "is not this device's broker host"),
])
def test_the_token_goes_to_the_devices_own_hosts_only(url: str, plain: bool, problem: str | None) -> None:
    got = token_destination_problem(url, HOSTS, plain)
    assert (got is None) if problem is None else (got is not None and problem in got), got


def test_models_hosts_are_checked() -> None:
    assert EdgeSettings(models_hosts=("models.example.org",)).models_hosts == ("models.example.org",)
    with pytest.raises(ConfigError, match="models_hosts"):
        EdgeSettings(models_hosts=("https://x/",))
