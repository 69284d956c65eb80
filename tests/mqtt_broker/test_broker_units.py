"""Pure logic of mqtt_broker: ACL model against the topic table, hashes, config and credentials files."""

from __future__ import annotations

import base64
import hashlib
import re
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mqtt_broker.acl import Acl, AclError, parse_acl, render_acl, topic_matches
from mqtt_broker.config import MQTT_HEADROOM, BrokerConfig, BrokerConfigError, payload_limit
from mqtt_broker.fsutil import find_executable
from mqtt_broker.mosquitto_conf import render_mosquitto_conf
from mqtt_broker.passwords import hash_password, read_passwd, set_passwd_entry, verify_password
from mqtt_broker.state import save_credentials
from protocol.topics import Topics
from transport.credentials import Credentials, CredentialsError, TlsSettings, mqtt_connect_settings

FED = "f1"
T = Topics(FED)


def _spec(role: str, me: str, topic: str, access: str) -> bool:
    """The design's topic table (docs/explanation/design.md), written out by hand: who writes and who reads each topic.
    The coordinator also holds the device rights for its own name (Mosquitto patterns apply to all)."""
    p = T.prefix + "/"
    if not topic.startswith(p):
        return False
    parts = topic[len(p):].split("/")
    kind, owner = parts[0], (parts[1] if len(parts) > 1 else None)
    device_rights = {
        "write": kind in ("update", "status", "metrics") and owner == me,
        "read": kind in ("round", "model") or (kind == "ack" and owner == me),
    }
    if role == "device":
        return device_rights[access]
    if role == "observer":  # read-only: the plan, statuses and metrics (not its own names), never a write
        return access == "read" and (kind == "round" or (kind in ("status", "metrics") and owner != me))
    coordinator_rights = {"write": kind in ("round", "model", "ack", "update", "metrics"),  # update, metrics: to clear
                          "read": kind in ("update", "status", "metrics")}                 # retained junk
    return coordinator_rights[access] or device_rights[access]


def _topics() -> list[str]:
    out = [T.round(), T.model_chunk("ab" * 16, 3), "fl/f1-x/round", "fl/f1", "other/x", "$SYS/broker/uptime"]
    for who in ("dev-a", "dev-b", "coordinator", "observer"):
        out += [T.update_chunk(who, 2, 0), T.ack(who), T.status(who), T.metrics(who)]
    return out


@pytest.mark.parametrize("access", ["read", "write"])
@pytest.mark.parametrize("user", ["dev-a", "dev-b", "coordinator", "observer"])
def test_rendered_acl_matches_the_topic_table(user: str, access: str) -> None:
    acl = parse_acl(render_acl(FED, "coordinator"))
    role = user if user in ("coordinator", "observer") else "device"
    for topic in _topics():
        assert acl.allows(user, user, topic, access) == _spec(role, user, topic, access), (user, access, topic)


def test_acl_text_uses_patterns_for_devices_and_a_user_block_for_the_coordinator() -> None:
    text = render_acl(FED, "boss")
    lines = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    user_at, observer_at = lines.index("user boss"), lines.index("user observer")
    assert all(ln.startswith("pattern ") for ln in lines[:user_at])
    assert all(ln.startswith("topic ") for ln in lines[user_at + 1:observer_at] + lines[observer_at + 1:]
               if ln != "user flayer-admin")
    admin_at = lines.index("user flayer-admin")  # only the admin writes the authority's revocation list
    assert lines[admin_at + 1:observer_at] == ["topic readwrite fl/f1/revocations"]
    assert "pattern read fl/f1/revocations" in lines and not any("/cert/" in ln for ln in lines)
    assert "topic deny fl/f1/model/#" in lines[observer_at:] and "topic deny fl/f1/status/observer" in lines
    assert "pattern write fl/f1/update/%u/#" in lines and "pattern read fl/f1/ack/%u" in lines
    assert "topic readwrite fl/f1/update/#" in lines and "topic write fl/f1/round" in lines


def test_dangerous_usernames_get_no_pattern_rights_and_unknown_users_only_device_rights() -> None:
    acl = parse_acl(render_acl(FED, "coordinator"))
    assert not acl.allows("dev+", "dev+", T.round(), "read")
    assert not acl.allows("dev-a", "x#", T.round(), "read")
    # %u patterns are skipped without a username (anonymous clients are refused anyway)
    assert not acl.allows(None, "anon", T.ack("anon"), "read")
    assert not acl.allows("stranger", "stranger", T.update_chunk("dev-a", 0, 0), "write")
    assert acl.allows("stranger", "stranger", T.update_chunk("stranger", 0, 0), "write")


def test_deny_lines_win_and_parse_errors_name_the_line() -> None:
    acl = parse_acl("user u\ntopic read a/#\ntopic deny a/secret\n")
    assert acl.allows("u", "u", "a/b", "read") and not acl.allows("u", "u", "a/secret", "read")
    with pytest.raises(AclError, match="line 2"):
        parse_acl("user u\ntopic read a/#/b\n")
    with pytest.raises(AclError, match="unknown access"):
        parse_acl("user u\ntopic sometimes a\n")
    with pytest.raises(AclError, match="anonymous"):
        parse_acl("topic read a\n")
    assert Acl.may_subscribe("fl/#") and not Acl.may_subscribe("fl/#/x")


@given(st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=4),
       st.lists(st.sampled_from(["a", "b", "+", "#"]), min_size=1, max_size=4))
def test_topic_matches_agrees_with_a_regex_translation(topic_levels: list[str], filter_levels: list[str]) -> None:
    if "#" in filter_levels[:-1]:
        return
    topic, flt = "/".join(topic_levels), "/".join(filter_levels)
    rx = "/".join("[^/]*" if lv == "+" else re.escape(lv) for lv in filter_levels)
    if filter_levels[-1] == "#":
        rx = rx[: -len(re.escape("#"))]
        rx = rx[:-1] + "(/.*)?" if rx.endswith("/") else rx + ".*"
    assert topic_matches(flt, topic) == bool(re.fullmatch(rx, topic)), (flt, topic)


def test_python_hash_has_mosquittos_format_and_verifies(tmp_path: Path) -> None:
    hashed = hash_password("u", "s3cret", tmp_path, use_mosquitto_passwd=False)
    _, alg, it, salt, digest = hashed.split("$")
    assert (alg, it) == ("7", "101")
    assert base64.b64decode(digest) == hashlib.pbkdf2_hmac("sha512", b"s3cret", base64.b64decode(salt), 101)
    assert verify_password("s3cret", hashed) and not verify_password("s3cret!", hashed)
    assert not verify_password("s3cret", "$7$101$!!$??") and not verify_password("x", "plain")


@pytest.mark.skipif(find_executable("mosquitto_passwd") is None, reason="mosquitto_passwd not installed")
def test_mosquitto_passwd_hash_verifies_and_leaves_no_plaintext(tmp_path: Path) -> None:
    hashed = hash_password("u", "pw-123", tmp_path)
    assert verify_password("pw-123", hashed) and not verify_password("pw-124", hashed)
    assert list(tmp_path.iterdir()) == []  # the temporary plaintext file is gone


def test_passwd_file_keeps_other_entries_and_is_private(tmp_path: Path) -> None:
    path = tmp_path / "passwd"
    set_passwd_entry(path, "a", "$7$1$AA==$AA==")
    set_passwd_entry(path, "b", "$7$1$BB==$BB==")
    set_passwd_entry(path, "a", "$7$1$CC==$CC==")
    assert read_passwd(path) == {"a": "$7$1$CC==$CC==", "b": "$7$1$BB==$BB=="}
    assert path.stat().st_mode & 0o777 == 0o600
    path.write_text("a:$7$x\nbroken line\n")
    with pytest.raises(ValueError, match=":2:"):
        read_passwd(path)


@pytest.mark.parametrize("kwargs, message", [
    ({"federation": "a/b"}, "federation"),
    ({"host": "not a host"}, "host"),
    ({"port": 70000}, "port"),
    ({"port": 1883, "tls_port": 1883}, "both"),
    ({"max_packet_size": 100}, "max_packet_size"),
    ({"max_queued_messages": 0}, "max_queued_messages"),
    ({"use_identity_as_username": True, "require_certificate": False}, "require_certificate"),
    ({"advertise_host": "0.0.0.0"}, "wildcard"),
    ({"persistence": "yes"}, "persistence"),
])
def test_bad_broker_settings_are_named(kwargs: dict, message: str) -> None:
    with pytest.raises(BrokerConfigError, match=message):
        BrokerConfig(**kwargs)


def test_config_json_round_trip_and_unknown_keys(tmp_path: Path) -> None:
    cfg = BrokerConfig(federation="x", port=1234, tls=True, tls_port=1235, max_packet_size=65536)
    cfg.save(tmp_path / "b.json")
    assert BrokerConfig.load(tmp_path / "b.json") == cfg
    with pytest.raises(BrokerConfigError, match="unknown key"):
        BrokerConfig.from_dict({**cfg.to_dict(), "colour": "red"})
    assert payload_limit(cfg.max_packet_size) == cfg.max_payload == 65536 - MQTT_HEADROOM
    assert replace(cfg, host="0.0.0.0").connect_host == "127.0.0.1"


def test_longest_topics_fit_the_headroom() -> None:
    t = Topics("f" * 64)
    longest = max(len(t.update_chunk("d" * 64, 10**12 - 1, 10**12 - 1)), len(t.model_chunk("a" * 128, 10**12 - 1)))
    assert 5 + 2 + longest + 2 + 64 < MQTT_HEADROOM  # fixed header, topic, packet id, MQTT 5 properties


def test_credentials_round_trip_hide_the_password_and_validate(tmp_path: Path) -> None:
    creds = Credentials("f1", "device", "dev-1", "pw-xyz", "127.0.0.1", 1883, 1 << 20,
                        TlsSettings("localhost", 8883, tmp_path / "ca.crt", tmp_path / "c.crt", tmp_path / "c.key"))
    path = tmp_path / "dev-1.toml"
    save_credentials(creds, path)
    assert Credentials.load(path) == creds
    assert path.stat().st_mode & 0o777 == 0o600
    assert "pw-xyz" not in repr(creds) and "pw-xyz" not in repr(mqtt_connect_settings(creds, use_tls=False))
    text = path.read_text()
    for bad, message in [(text.replace('role = "device"', 'role = "root"'), "role"),
                         (text.replace("port = 1883", "port = 0"), "port"),
                         (text.replace("max_payload = ", "max_payload = 1 #"), "max_payload"),
                         (text + "colour = 1\n", "unknown key"),
                         (text.replace('username = "dev-1"', 'username = "dev/1"'), "username")]:
        path.write_text(bad)
        with pytest.raises(CredentialsError, match=message):
            Credentials.load(path)


def test_mosquitto_conf_has_the_limits_and_no_secret(tmp_path: Path) -> None:
    cfg = BrokerConfig(federation="f1", port=1000, tls=True, tls_port=1001, max_packet_size=1 << 20)
    text = render_mosquitto_conf(cfg, tmp_path, tmp_path / "passwd", tmp_path / "acl",
                                 (tmp_path / "ca.crt", tmp_path / "s.crt", tmp_path / "s.key"))
    for line in ["per_listener_settings true", "max_packet_size 1048576", "max_queued_messages 10000",
                 "listener 1000 127.0.0.1", "listener 1001 127.0.0.1", "require_certificate true",
                 "allow_anonymous false", "persistence true", "use_username_as_clientid true"]:
        assert line in text.splitlines(), line
    assert text.count("allow_anonymous false") == 2  # per listener
    assert "password " not in text

