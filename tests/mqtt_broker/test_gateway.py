"""Field gateway (mqtt_broker.bridge): the site broker's bridge configuration, the central broker's
gateway users and their ACL, the refusals of bad input, and one live bridge between two Mosquittos.
The federations over a bridged site, with the bridge cut and the site broker restarted, are in
tests/faults/test_faults_gateway.py (slow)."""

from __future__ import annotations

import stat
import sys
import time
from pathlib import Path

import pytest

from cli.main import main as flayer_main
from mqtt_broker import (
    BrokerConfig,
    BrokerConfigError,
    add_device,
    load_credentials,
    mosquitto_available,
    start_broker,
)
from mqtt_broker.acl import parse_acl
from mqtt_broker.bridge import (
    GatewaySettings,
    parse_address,
    parse_restart,
    read_gateways,
    render_bridge_conf,
    set_gateway,
)
from mqtt_broker.kit import revoke_device
from mqtt_broker.state import add_gateway, write_broker_files

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from fedtestlib import Recorder

FED = "gw"
P = f"fl/{FED}"


def _central(tmp: Path, **cfg: object) -> Path:
    write_broker_files(BrokerConfig(federation=FED, port=18830, **cfg), tmp / "central")  # type: ignore[arg-type]
    return tmp / "central"


def test_gateway_acl_allows_exactly_the_topics_of_its_devices(tmp_path: Path) -> None:
    central = _central(tmp_path)
    creds = add_gateway(central, "site-a", ["dev-1", "dev-2"])
    assert creds.role == "gateway" and read_gateways(central) == {"site-a": ["dev-1", "dev-2"]}
    acl = parse_acl((central / "acl").read_text())
    ok = lambda topic, access: acl.allows("site-a", "site-a", topic, access)
    for d in ("dev-1", "dev-2"):
        assert ok(f"{P}/update/{d}/3/0", "write") and ok(f"{P}/status/{d}", "write")
        assert ok(f"{P}/metrics/{d}", "write") and ok(f"{P}/secagg/{d}", "write")
        assert ok(f"{P}/ack/{d}", "read") and ok(f"{P}/secreq/{d}", "read")
    assert ok(f"{P}/round", "read") and ok(f"{P}/model/abcdef12/0", "read")
    # not another site's device, not its own name (the device patterns' %u), not the coordinator's topics
    for topic, access in ((f"{P}/update/dev-9/1/0", "write"), (f"{P}/ack/dev-9", "read"), (f"{P}/round", "write"),
                          (f"{P}/update/site-a/1/0", "write"), (f"{P}/status/site-a", "write"),
                          (f"{P}/ack/site-a", "read"), (f"{P}/model/abcdef12/0", "write"),
                          (f"{P}/update/dev-1/1/0", "read"), (f"{P}/status/dev-2", "read")):
        assert not ok(topic, access), (topic, access)
    # a second gateway cannot take a device of the first; revoking a device takes it off its gateway
    with pytest.raises(BrokerConfigError, match="already behind gateway 'site-a'"):
        add_gateway(central, "site-b", ["dev-2"])
    revoke_device(central, "dev-2")
    assert read_gateways(central) == {"site-a": ["dev-1"]}
    assert not parse_acl((central / "acl").read_text()).allows("site-a", "site-a", f"{P}/update/dev-2/1/0", "write")


def test_gateway_inputs_are_refused_with_clear_errors(tmp_path: Path) -> None:
    central = _central(tmp_path)
    add_device(central, "direct-1")
    for bad, match in (("dev 1", "device id"), ("coordinator", "reserved"), ("direct-1", "own device credentials"),
                       ("site-a", "own gateway")):
        with pytest.raises(BrokerConfigError, match=match):
            add_gateway(central, "site-a", [bad])
    with pytest.raises(BrokerConfigError, match="at least one device"):
        add_gateway(central, "site-a", [])
    with pytest.raises(BrokerConfigError, match="already exists as a device"):
        add_gateway(central, "direct-1", ["dev-1"])
    for text in ("central", "central:0", "central:70000", "[::1]:1883", "::1:1883", "0.0.0.0:1883", "bad_host:1"):
        with pytest.raises(BrokerConfigError):
            parse_address(text)
    assert parse_address("central.example:1884") == ("central.example", 1884)
    for text in ("x", "3,1", "0,5", "1,2,3"):
        with pytest.raises(BrokerConfigError):
            parse_restart(text)
    with pytest.raises(BrokerConfigError, match="keepalive"):
        GatewaySettings("10.0.0.1", 1883, keepalive_s=2)
    add_gateway(central, "site-a", ["dev-1"])
    gw_file = central / "credentials/site-a.toml"
    site = BrokerConfig(federation=FED)
    with pytest.raises(BrokerConfigError, match="not a gateway's"):
        set_gateway(tmp_path / "site", site, central / "credentials/direct-1.toml", None, None, None)
    with pytest.raises(BrokerConfigError, match="federation 'gw'"):
        set_gateway(tmp_path / "site", BrokerConfig(federation="other"), gw_file, None, None, None)
    with pytest.raises(BrokerConfigError, match="--max-packet-size 1048576"):
        set_gateway(tmp_path / "site", BrokerConfig(federation=FED, max_packet_size=1 << 16), gw_file, None, None, None)
    with pytest.raises(BrokerConfigError, match="needs persistence"):
        set_gateway(tmp_path / "site", BrokerConfig(federation=FED, persistence=False), gw_file, None, None, None)
    with pytest.raises(BrokerConfigError, match="no gateway is set up"):
        set_gateway(tmp_path / "site", site, None, "10.0.0.1:1883", None, None)
    # through the command line: exit 2 and the reason
    assert flayer_main(["broker", "add-device", "--state-dir", str(central), "site-b", "--gateway-for", "dev-7",
                        "--kit", str(tmp_path / "k.tar.gz")]) == 2
    assert flayer_main(["broker", "start", "--state-dir", str(tmp_path / "site2"), "--no-gateway",
                        "--gateway-to", "10.0.0.1:1883"]) == 2
    assert flayer_main(["broker", "start", "--state-dir", str(tmp_path / "site2"), "--embedded",
                        "--gateway-credentials", str(gw_file)]) == 2


def test_site_files_bridge_at_qos1_with_retain_and_persistent_sessions(tmp_path: Path) -> None:
    central = _central(tmp_path)
    add_gateway(central, "site-a", ["dev-1"])
    site_cfg = BrokerConfig(federation=FED, port=18831)
    settings = set_gateway(tmp_path / "site", site_cfg, central / "credentials/site-a.toml", "10.0.0.1:1884", 10, (1, 5))
    assert (settings.host, settings.port, settings.keepalive_s, settings.restart_s) == ("10.0.0.1", 1884, 10, (1, 5))
    files = write_broker_files(site_cfg, tmp_path / "site")
    main_conf = files.mosquitto_conf.read_text()
    gw = load_credentials(central, "site-a")
    assert gw.password not in main_conf and f"include_dir {files.state_dir / 'bridge.d'}" in main_conf
    bridge = files.state_dir / "bridge.d/gateway.conf"
    assert stat.S_IMODE(bridge.stat().st_mode) == 0o600
    text = bridge.read_text()
    assert text == render_bridge_conf(FED, settings, gw)
    lines = set(text.splitlines())
    for want in ("address 10.0.0.1:1884", "bridge_protocol_version mqttv311", "try_private true",
                 "cleansession false", "local_cleansession false", "restart_timeout 1 5", "keepalive_interval 10",
                 "remote_username site-a", f"remote_password {gw.password}", "bridge_max_packet_size 1048576",
                 f"topic {P}/round in 1", f"topic {P}/model/# in 1", f"topic {P}/ack/+ in 1", f"topic {P}/secreq/+ in 1",
                 f"topic {P}/update/# out 1", f"topic {P}/status/+ out 1", f"topic {P}/metrics/+ out 1",
                 f"topic {P}/secagg/+ out 1"):
        assert want in lines, want
    # a later start without the flags keeps the bridge; --no-gateway drops it
    set_gateway(tmp_path / "site", site_cfg, None, None, 20, None)
    write_broker_files(site_cfg, tmp_path / "site")
    assert "keepalive_interval 20" in bridge.read_text() and "address 10.0.0.1:1884" in bridge.read_text()
    from mqtt_broker.bridge import remove_gateway

    assert remove_gateway(tmp_path / "site")
    assert "include_dir" not in write_broker_files(site_cfg, tmp_path / "site").mosquitto_conf.read_text()


@pytest.mark.integration
@pytest.mark.skipif(not mosquitto_available(), reason="mosquitto is not installed")
def test_live_bridge_carries_retained_plan_down_and_only_served_devices_up(tmp_path: Path) -> None:
    """Two real Mosquittos: a plan published (retained) while the bridge is up reaches a site device that
    subscribes later, still retained; a served device's update and ack cross; an unserved site device's
    update is dropped by the central ACL."""
    central = start_broker(BrokerConfig(federation=FED, persistence=True), tmp_path / "central", kind="mosquitto")
    site = None
    links: list[Recorder] = []
    try:
        add_gateway(tmp_path / "central", "site-a", ["dev-1"])
        central.reload()
        site_cfg = BrokerConfig(federation=FED, persistence=True)
        set_gateway(tmp_path / "site", site_cfg, tmp_path / "central/credentials/site-a.toml", None, 5, (1, 1))
        site = start_broker(site_cfg, tmp_path / "site", kind="mosquitto")
        d1, d3 = add_device(tmp_path / "site", "dev-1"), add_device(tmp_path / "site", "dev-3")
        site.reload()
        coord = Recorder(load_credentials(tmp_path / "central", "coordinator"), [f"{P}/update/#"])
        links.append(coord)
        deadline = time.monotonic() + 10  # the bridge is up once central holds its session
        while "site-a" not in (tmp_path / "central/broker.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # its SUBSCRIBEs
        coord.link.publish(f"{P}/round", b"plan-1", retain=True)
        coord.link.publish(f"{P}/model/abcdef12/0", b"chunk-0", retain=True)
        time.sleep(0.5)
        dev = Recorder(d1, [f"{P}/round", f"{P}/model/abcdef12/+", f"{P}/ack/dev-1"])
        links.append(dev)
        plan = dev.wait_message(lambda m: m.topic == f"{P}/round", 5)
        chunk = dev.wait_message(lambda m: m.topic.startswith(f"{P}/model/"), 5)
        assert plan is not None and plan.payload == b"plan-1" and plan.retain
        assert chunk is not None and chunk.payload == b"chunk-0" and chunk.retain
        dev.link.publish(f"{P}/update/dev-1/1/0", b"update-1")
        assert coord.wait_message(lambda m: m.topic == f"{P}/update/dev-1/1/0", 5) is not None
        coord.link.publish(f"{P}/ack/dev-1", b"ack-1")
        assert dev.wait_message(lambda m: m.topic == f"{P}/ack/dev-1", 5) is not None
        other = Recorder(d3, [])
        links.append(other)
        other.link.publish(f"{P}/update/dev-3/1/0", b"not-served")
        assert coord.wait_message(lambda m: m.topic.startswith(f"{P}/update/dev-3/"), 1.5) is None
    finally:
        for link in links:
            link.close()
        if site is not None:
            site.stop()
        central.stop()
