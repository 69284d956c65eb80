"""A device cycling its ``[edge] label`` to blind the fleet's Prometheus metrics (docs/explanation/guarantees.md,
"Bounds on a hostile device"; docs/reference/metrics.md).

The adversary is one enrolled device: all it can do here is publish statuses on its own status topic, each
with a label of its choosing (any value the label syntax allows). It publishes a new label with every
status, before and while the honest devices come online, trying to use up the exporter's bounded set of
label values so that every honest device is counted as ``other``. The operator's view is the scrape:
``flayer_devices_online`` by label. The guarantee holds when every honest label is exported with its true
count, the adversary occupies at most one label value at a time, and the number of label values stays
bounded however many labels it has cycled through.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from coordinator.config import load_coordinator_config
from coordinator.exporter import MAX_LABELS
from coordinator.server import Coordinator
from protocol import SigningKey, Status, Topics, encode_message
from transport.credentials import Credentials
from transport.link import Received

FED = "labels"
CREDS = Credentials(FED, "coordinator", "coordinator", "pw", "127.0.0.1", 1883, 1 << 20,
                    signing_key=SigningKey.generate().private_text())
KEYS: dict[str, SigningKey] = {}  # each device's own key (made on first use), registered with the coordinator
HONEST = {f"dev-{i}": ("jetson", "phone", "pi")[i % 3] for i in range(9)}


def _coordinator(tmp: Path, now: list[float]) -> Coordinator:
    lines = ["[federation]", 'credentials = "creds.toml"', 'state_dir = "coord"', "min_devices = 100",
             "[run]", 'strategy = "fedavg"', "rounds = 1", "[data]", 'dataset = "digits"']
    (tmp / "federation.toml").write_text("\n".join(lines) + "\n")
    c = Coordinator(load_coordinator_config(tmp / "federation.toml"), CREDS, clock=lambda: now[0])
    c.device_keys.path = None  # the keys below, as the broker's registry would hold them
    return c


def _status(c: Coordinator, device: str, label: str, now: float) -> None:
    """A status exactly as the device publishes it (retained, on its own topic)."""
    key = KEYS.setdefault(device, SigningKey.generate())
    c.device_keys.keys[device] = key.public
    payload = encode_message(Status(0, "online", now, {"label": label}), FED, device, key=key)
    c.intake.on_message(Received(Topics(FED).status(device), payload, True))


def _online(c: Coordinator) -> dict[str, float]:
    c.exporter.sync(c, force=True)
    return {s.labels["label"]: s.value for m in c.exporter.registry.collect() if m.name == "flayer_devices_online"
            for s in m.samples}


def test_a_label_cycling_device_cannot_push_the_honest_labels_out(tmp_path: Path) -> None:
    now = [1000.0]
    c = _coordinator(tmp_path, now)
    try:
        cycled = 0

        def cycle(n: int) -> dict[str, Any]:
            nonlocal cycled
            got: dict[str, Any] = {}
            for _ in range(n):
                _status(c, "dev-evil", f"cyc{cycled}", now[0])
                cycled += 1
                now[0] += 0.01
                got = _online(c)  # the coordinator syncs its gauges twice a second
            return got

        cycle(3 * MAX_LABELS)  # before any honest device is online
        for dev, label in HONEST.items():
            _status(c, dev, label, now[0])
            cycle(2)
        got = cycle(3 * MAX_LABELS)
        honest = {label: float(list(HONEST.values()).count(label)) for label in set(HONEST.values())}
        assert {k: got.get(k) for k in honest} == honest, f"honest labels lost: {got}"
        assert got.get("other", 0.0) == 0.0
        assert sum(1 for k, v in got.items() if k.startswith("cyc") and v) == 1  # one label at a time
        assert len(got) <= MAX_LABELS + 2  # bounded, after 6 x MAX_LABELS + 18 distinct values
        assert sum(got.values()) == len(HONEST) + 1
    finally:
        c.metrics.close()
