"""Through a real broker: a 1 Mbit/s uplink takes at least size / bandwidth; the shared network loop
connects, delivers and disconnects many clients; an aborted link (thread or shared) makes the broker
publish its last will, a stopped one does not; EdgeClient.crash() during a local round saves and
sends nothing, and after_compute sees the round's CPU time."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from emutestlib import Recorder, start_test_broker, wait_until

from edge_client.client import EdgeClient
from edge_client.config import EdgeSettings
from edge_client.store import DeviceStore
from emulator.netloop import SharedNetwork
from emulator.profiles import DeviceProfile
from emulator.shaping import LinkShaper
from protocol import Topics, encode_message
from protocol.messages import Status
from transport.credentials import mqtt_connect_settings
from transport.link import Connected, MqttLink

pytestmark = pytest.mark.integration
T = Topics("etest")


def test_one_mbit_uplink_takes_at_least_size_over_bandwidth(tmp_path: Path) -> None:
    tb = start_test_broker(tmp_path, ["dev-a"])
    rec = Recorder(tb.coordinator, [T.all_updates()])
    events: queue.Queue[Any] = queue.Queue()
    link = MqttLink(mqtt_connect_settings(tb.users["dev-a"]), events.put)
    try:
        link.start()
        assert isinstance(events.get(timeout=10), Connected)
        shaper = LinkShaper(DeviceProfile("slow", up_mbps=1.0))
        chunks = [bytes([i]) * 62_500 for i in range(4)]  # 250,000 bytes = 2.0 s at 1 Mbit/s
        items = [(T.update_chunk("dev-a", 1, i), c, False) for i, c in enumerate(chunks)]

        def arrivals() -> list[float]:
            return [t for t, m in rec.pump() if m.topic == T.update_chunk("dev-a", 1, 3)]

        unshaped_t0 = time.monotonic()
        assert link.publish_all(items, 30)
        wait_until(lambda: len(arrivals()) == 1, 10, "the unshaped last chunk")
        unshaped = arrivals()[0] - unshaped_t0
        t0 = time.monotonic()
        assert link.publish_all(items, 30, before_each=lambda n: time.sleep(shaper(n, "up")))
        wait_until(lambda: len(arrivals()) == 2, 10, "the shaped last chunk")
        last = arrivals()[1]
        elapsed = last - t0
        size_over_bw = sum(map(len, chunks)) * 8 / 1e6
        print(f"250 kB at 1 Mbit/s: {elapsed:.2f}s through the broker (size/bandwidth {size_over_bw:.2f}s, "
              f"unshaped {unshaped:.3f}s)")
        assert elapsed >= size_over_bw
        assert elapsed <= 1.5 * size_over_bw + 1.0  # shaped, not stalled
    finally:
        link.stop()
        rec.close()
        tb.broker.stop()


def _will_and_clean(tb: Any, network: SharedNetwork | None, ids: list[str]) -> None:
    rec = Recorder(tb.coordinator, [T.all_status()])
    links: dict[str, MqttLink] = {}
    queues: dict[str, queue.Queue[Any]] = {}
    try:
        for d in ids:
            will = encode_message(Status(0, "offline", time.time(), {}), "etest", d)
            queues[d] = queue.Queue()
            links[d] = MqttLink(mqtt_connect_settings(tb.users[d]), queues[d].put, will=(T.status(d), will),
                                network=network)
            links[d].start()
        wait_until(lambda: all(link.connected.is_set() for link in links.values()), 30,
                   "every link to connect")
        if network is not None:  # a pass of its loop looks at the clients waiting to reconnect only: none now
            wait_until(lambda: not network._reconnecting, 5, "no client left waiting to reconnect")
        for d, link in links.items():  # each publishes (from this thread) and is heard
            link.publish(T.status(d), encode_message(Status(1, "online", time.time(), {}), "etest", d),
                         retain=True)
        wait_until(lambda: {m.topic for _, m in rec.pump()} >= {T.status(d) for d in ids}, 15, "every status")
        half = len(ids) // 2
        for d in ids[:half]:
            links[d].abort()  # as a power loss: the broker publishes the will
        for d in ids[half:]:
            links[d].stop()  # clean: no will

        def offline() -> set[str]:
            return {m.topic.rsplit("/", 1)[1] for _, m in rec.pump() if b"offline" in m.payload}

        wait_until(lambda: offline() >= set(ids[:half]), 15, "the wills of the aborted links")
        time.sleep(1.0)
        assert offline() == set(ids[:half]), "a cleanly stopped link must not trigger its will"
        if network is not None:
            wait_until(lambda: network.clients == 0, 5, "the network to forget every client")
            assert not network._reconnecting, "a forgotten client must not stay among those to reconnect"
    finally:
        for link in links.values():
            link.stop(timeout=1.0)
        rec.close()


def test_thread_links_abort_fires_the_will(tmp_path: Path) -> None:
    ids = [f"dev-{i}" for i in range(4)]
    tb = start_test_broker(tmp_path, ids)
    try:
        _will_and_clean(tb, None, ids)
    finally:
        tb.broker.stop()


def test_shared_network_drives_many_links_from_one_thread(tmp_path: Path) -> None:
    ids = [f"dev-{i}" for i in range(60)]
    tb = start_test_broker(tmp_path, ids)
    net = SharedNetwork().start()
    try:
        before = threading.active_count()
        _will_and_clean(tb, net, ids)
        assert threading.active_count() <= before + 2  # no thread per client (the recorder has one)
    finally:
        net.close()
        tb.broker.stop()


def test_crash_during_the_local_round_saves_and_sends_nothing(tmp_path: Path, digits: Any) -> None:
    from coordinator.config import load_coordinator_config
    from coordinator.publish import Publisher, make_plan, model_blob
    from flayer.partition import make_partition
    from flayer.engine import initial_global_state
    from flayer.strategies import make_strategy
    from flayer.train import client_data

    tb = start_test_broker(tmp_path, ["dev-a"])
    server = Recorder(tb.coordinator, [T.all_updates(), T.all_status()])
    shard = client_data(digits, make_partition(digits.y, digits.num_classes, 2, "iid", 0).clients[0])
    computed: list[tuple[str, float, float]] = []
    crashed = threading.Event()
    client: EdgeClient | None = None

    def after_compute(kind: str, wall: float, cpu: float) -> None:
        computed.append((kind, wall, cpu))
        assert client is not None
        def crash() -> None:
            assert client is not None
            client.crash()
            crashed.set()

        threading.Thread(target=crash).start()
        assert crashed.wait(15)

    try:
        fed = tmp_path / "f.toml"
        fed.write_text(f'[federation]\ncredentials = "{tb.state}/credentials/coordinator.toml"\nstate_dir = '
                       f'"{tmp_path}/coord"\n[run]\nstrategy = "fedavg"\nrounds = 1\n'
                       f'[data]\ndataset = "digits"\n')
        cfg = load_coordinator_config(fed)
        model = model_blob(initial_global_state(make_strategy("fedavg", cfg.spec, cfg.run.train, {}), 0))
        pub = Publisher(server.link, T, "coordinator", tb.coordinator.max_payload, tmp_path, 30,
                        lambda: False, key=tb.coordinator.signer())
        chunks, _ = pub.model(model, 1)
        pub.plan(make_plan(cfg, "fedavg", {}, 1, ["dev-a"], time.time() + 300, model, chunks))
        settings = EdgeSettings(state_dir=str(tmp_path / "dev-a"), device="cpu", heartbeat_s=1.0)
        client = EdgeClient(settings, tb.users["dev-a"], shard, after_compute=after_compute)
        client.start()
        assert crashed.wait(60), "the local round never reached after_compute"
        assert client.wait(10)
        client.jobs.shutdown(wait=True)
        kind, wall, cpu = computed[0]
        assert kind == "train" and 0 < cpu <= wall * 1.05 + 0.01
        stored = DeviceStore(settings.state_dir).load()
        assert stored.done_round == 0 and stored.upload is None, "a crashed round leaves the disk as it was"
        assert not (tmp_path / "dev-a" / "upload.bin").exists()
        time.sleep(1.0)
        msgs = [m for _, m in server.pump()]
        assert not [m for m in msgs if m.topic.startswith(T.update_chunk("dev-a", 1, 0).rsplit("/", 2)[0])]
        statuses = [m.payload for m in msgs if m.topic == T.status("dev-a")]
        assert statuses and b"offline" in statuses[-1], "the broker should have published the last will"
        assert client.error is None  # a crash is not an error of the client
    finally:
        server.close()
        tb.broker.stop()


def test_a_disconnected_client_does_not_spin(tmp_path: Path, digits: Any) -> None:
    """With no broker to talk to, a device's worker waits (a due heartbeat it cannot send must not turn
    its loop into a busy one: with hundreds of emulated devices connecting, that starved the network)."""
    import socket

    from flayer.partition import make_partition
    from flayer.train import client_data
    from mqtt_broker import Credentials

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from protocol import SigningKey

    creds = Credentials("etest", "device", "dev-a", "pw", "127.0.0.1", port, 1 << 20,
                        signing_key=SigningKey.generate().private_text(),
                        coordinator_key=SigningKey.generate().public.text)
    shard = client_data(digits, make_partition(digits.y, digits.num_classes, 2, "iid", 0).clients[0])
    client = EdgeClient(EdgeSettings(state_dir=str(tmp_path / "dev-a"), device="cpu"), creds, shard)
    client.start()
    try:
        time.sleep(0.5)
        c0, t0 = time.process_time(), time.monotonic()
        time.sleep(2.0)
        busy = (time.process_time() - c0) / (time.monotonic() - t0)
        assert not client.link.connected.is_set()
        assert busy < 0.2, f"the process used {busy:.0%} of a core while its only client waited for a broker"
    finally:
        client.stop(timeout=2)
