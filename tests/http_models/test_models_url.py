"""Models over HTTP, without a server: the plan's models_url is optional on the wire (a plan without it is
the JSON earlier devices decode) and checked on the device (http/https, bounded, no credentials); the
coordinator's models_dir/models_url are checked together; model files are written atomically and
pruned with the retained chunks."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from coordinator.config import FederationSettings
from coordinator.model_files import ModelFiles
from flayer.config import ConfigError
from protocol import Envelope, Kind, Plan, WireError, decode_message, encode_message
from protocol.model_url import model_file_url

PLAN = Plan(1, ("dev",), 0.0, "fedavg", {}, {"name": "cnn"}, "a" * 64, 1, 10)
# the fields of a plan before models_url: what every earlier device's decoder wants, exactly
EARLIER_FIELDS = {"round", "selected", "deadline", "strategy", "options", "model", "model_digest", "model_chunks",
                  "model_size", "value_codec", "compress", "phase", "seed", "train", "rounds", "max_update_bytes",
                  "mode", "max_staleness", "delta", "upload_fit", "close_by", "delta_chain", "privacy", "secure"}


def _body(payload: bytes) -> dict:
    env, _ = decode_message(payload)
    return json.loads(env.body)


def _plan_payload(obj: dict) -> bytes:
    body = json.dumps(obj).encode()
    return Envelope(Kind.PLAN, "fed", "coordinator", obj["round"], 0, 1, len(body), hashlib.sha256(body).hexdigest(),
                    body).encode()


def test_a_plan_without_models_url_is_the_json_earlier_devices_decode() -> None:
    assert set(_body(encode_message(PLAN, "fed", "coordinator"))) == EARLIER_FIELDS
    with_url = dataclasses.replace(PLAN, models_url="https://models.example.org:8443/fed/")
    body = _body(encode_message(with_url, "fed", "coordinator"))
    assert set(body) == EARLIER_FIELDS | {"models_url"}
    assert decode_message(_plan_payload(body))[1] == with_url
    del body["models_url"]
    assert decode_message(_plan_payload(body))[1] == PLAN  # absent: none
    del body["secure"]
    with pytest.raises(WireError, match="missing fields \\['secure'\\]"):  # the others stay required
        decode_message(_plan_payload(body))


@pytest.mark.parametrize("url, why", [
    ("ftp://host/models/", "http:// or https://"),
    ("file:///var/models/", "http:// or https://"),
    ("http://user:secret@host/models/", "credentials"),
    ("https://token@host/", "credentials"),
    ("http:///models/", "host"),
    ("http://host/models/?sig=1", "query"),
    ("http://host/models/#x", "query or a fragment"),
    ("http://host/mo dels/", "printable ASCII"),
    ("http://host/\u00e9/", "printable ASCII"),
    ("http://host:99999/", "not a URL"),
    ("http://host:0/", "port 0"),
    ("http://host/" + "a" * 600, "at most 512"),
    (7, "a string"),
])
def test_a_plan_naming_a_bad_models_url_is_refused(url: object, why: str) -> None:
    body = _body(encode_message(PLAN, "fed", "coordinator"))
    body["models_url"] = url
    with pytest.raises(WireError, match=why):
        decode_message(_plan_payload(body))


def test_the_coordinator_checks_models_dir_and_models_url_together() -> None:
    ok = FederationSettings(credentials="c.toml", models_dir="models", models_url="http://127.0.0.1:8080/")
    assert ok.models_url.startswith("http://")
    with pytest.raises(ConfigError, match="go together"):
        FederationSettings(credentials="c.toml", models_dir="models")
    with pytest.raises(ConfigError, match="go together"):
        FederationSettings(credentials="c.toml", models_url="http://127.0.0.1:8080/")
    with pytest.raises(ConfigError, match="credentials"):
        FederationSettings(credentials="c.toml", models_dir="m", models_url="http://u:p@127.0.0.1/")


def test_model_files_are_written_once_and_pruned_but_for_the_ones_offered(tmp_path: Path) -> None:
    files = ModelFiles(tmp_path / "models")
    a, b, c = "a" * 64, "b" * 64, "c" * 64
    assert files.write(a, b"model a") and not files.write(a, b"model a")  # immutable: written once
    files.write(b, b"delta b")
    files.write(c, b"model c")
    (tmp_path / "models" / f".{a}.123.tmp").write_bytes(b"left by a crash")
    (tmp_path / "models" / "index.html").write_bytes(b"not ours")
    assert files.prune({b, c}) == 2
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [b, c, "index.html"]
    assert files.path(c).read_bytes() == b"model c"
    assert model_file_url("http://h:1/m", c) == model_file_url("http://h:1/m/", c) == f"http://h:1/m/{c}"
