"""Reading everything a private round sends (docs/reference/private-fields.md).

The adversary is twofold, on a real broker: the read-only observer (its own connection, subscribed to the whole
federation: the broker delivers what its ACL lets it read) and the coordinator (every message the coordinator's
connection receives, as it receives it). A private federation of real edge clients runs two rounds (or two
asynchronous model versions) in each mode of ``MODES`` and the adversary decodes every message a
device sent: updates (the update codec's header, tensors and info entries, or a secure round's masked input),
secure-aggregation messages, status and metrics. Each field must be a row of the page's table (the test reads
the table from the page, so the docs and the check are one list), the sample count must be the fixed weight 1,
a skip reason only one of the generic ones, and every upload of a round the same size.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from fedtestlib import device_toml, federation_toml, finished

from coordinator.config import load_coordinator_config
from coordinator.device_privacy import device_privacy
from coordinator.server import Coordinator
from edge_client.client import EdgeClient
from edge_client.config import load_device_config
from flayer.partition import make_partition, save_partition
from flayer.secagg import decode_message as decode_secagg
from flayer.train import client_data
from protocol import Kind, Metrics, Status, decode_envelope, decode_message, decode_update
from protocol.chunks import Reassembler
from protocol.metrics_schema import read_metrics
from protocol.topics import Topics
from transport.link import Received

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # about 7 s a federation
DEVICES = [f"dev-{i}" for i in range(4)]
PAGE = Path(__file__).resolve().parents[2] / "docs" / "reference" / "private-fields.md"
GENERIC_SKIPS = {"budget spent", "round skipped"}
MODES = {
    "central-adaptive": "enabled = true\nmode = \"central\"\nclipping = \"adaptive\"\ncount_stddev = 2.0\n"
                        "noise_multiplier = 1.0\n",
    "local-secure": "enabled = true\nmode = \"local\"\nsecure_aggregation = true\nnoise_multiplier = 1.0\n"
                    "secure_stage_s = 20.0\n",
    "local": "enabled = true\nmode = \"local\"\nnoise_multiplier = 1.0\n",
    "central-adaptive-secure": "enabled = true\nmode = \"central\"\nclipping = \"adaptive\"\ncount_stddev = 2.0\n"
                               "noise_multiplier = 1.0\nsecure_aggregation = true\nsecure_stage_s = 20.0\n",
    "local-async": "enabled = true\nmode = \"local\"\nnoise_multiplier = 1.0\n",  # buffered asynchronous versions
}
ASYNC = {"mode": "async", "buffer": 2, "quorum": 1, "concurrency": 0}  # the "-async" modes' [federation]


def documented() -> set[tuple[str, str]]:
    """(message, field) of every row of the page's table."""
    rows = re.findall(r"^\| `([a-z-]+)` \| `([A-Za-z_.]+)` \|", PAGE.read_text(), re.MULTILINE)
    assert len(rows) >= 10, f"{PAGE}: the table of fields is missing"
    return set(rows)


def _fields(payloads: list[tuple[str, bytes]], topics: Topics) -> tuple[set[tuple[str, str]], list[str]]:
    """(every (message, field) a device sent, the problems with their values)."""
    seen: set[tuple[str, str]] = set()
    problems: list[str] = []
    blobs: dict[tuple[str, int], Reassembler] = defaultdict(Reassembler)
    sizes: dict[int, set[int]] = defaultdict(set)
    done: set[tuple[str, int]] = set()
    for topic, payload in payloads:
        parsed = topics.parse(topic)
        if parsed.client not in DEVICES or not payload:
            continue
        env = decode_envelope(payload)
        if env.kind == Kind.UPDATE_CHUNK:
            r = blobs[(parsed.client, env.round)]
            r.add(env)
            if r.complete and (parsed.client, env.round) not in done:
                done.add((parsed.client, env.round))
                blob = r.blob()
                sizes[env.round].add(len(blob))
                try:
                    kind: str | None = type(decode_secagg(blob)).__name__
                except ValueError:  # not a secure-aggregation message: an update
                    kind = None
                if kind is not None:
                    seen.add(("masked-input", "values"))
                    if kind != "MaskedInput":
                        problems.append(f"{parsed.client}: a {kind} on its update topic")
                    continue
                up = decode_update(blob)
                seen |= {("update", f) for f in ("federation", "sender", "round", "base_digest", "num_samples",
                                                 "tensors", "values", "size")}
                seen |= {("update", f"info.{k}") for k in up.update.info}
                if up.update.num_samples != 1:
                    problems.append(f"{parsed.client} round {env.round}: num_samples {up.update.num_samples}")
        elif env.kind == Kind.SECAGG:
            seen.add(("secagg", type(decode_secagg(env.body)).__name__))
        elif env.kind == Kind.STATUS:
            st = decode_message(payload)[1]
            assert isinstance(st, Status)
            seen |= {("status", f) for f in ("round", "state", "time")} | {("status", f"info.{k}") for k in st.info}
            if "skip_reason" in st.info and st.info["skip_reason"] not in GENERIC_SKIPS:
                problems.append(f"{parsed.client}: skip reason {st.info['skip_reason']!r}")
        elif env.kind == Kind.METRICS:
            msg = decode_message(payload)[1]
            assert isinstance(msg, Metrics)
            seen |= {("metrics", f"values.{k}") for k in msg.values}
    problems += [f"round {r}: uploads of different sizes {sorted(s)}" for r, s in sizes.items() if len(s) > 1]
    return seen, problems


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_private_round_sends_only_the_documented_fields(tmp_path: Path, digits: Any, mode: str,
                                                           attack_fed: Any) -> None:
    part = make_partition(digits.y, digits.num_classes, 4, "dir0.5", seed=0, samples=400,
                          meta={"dataset": digits.name, "dataset_fingerprint": digits.fingerprint()})
    pfile = save_partition(part, tmp_path / "digits-4.npz")
    fb = attack_fed(DEVICES, view="observer")  # the adversary: the broker's read-only observer
    topics = Topics(fb.coordinator.federation)
    observer = fb.listen([f"{topics.prefix}/#"])
    coordinator_view: list[Received] = []
    devices: list[EdgeClient] = []
    try:
        fed = federation_toml(tmp_path / "federation.toml", fb.state_dir / "credentials/coordinator.toml",
                              tmp_path / "coord", strategy="fedavg", rounds=2, dataset="digits", seed=0, lr=0.05,
                              **{"quorum": 4, "min_devices": 4, "deadline_s": 120.0,
                                 **(ASYNC if mode.endswith("-async") else {})})
        fed.write_text(fed.read_text() + "[privacy]\npopulation = 4\nclip = 0.5\ndelta = 0.01\n" + MODES[mode])
        coord = Coordinator(load_coordinator_config(fed), fb.coordinator)
        put = coord.events.put

        def tap(ev: Any) -> Any:  # the coordinator's view: every message its connection receives
            if isinstance(ev, Received):
                coordinator_view.append(ev)
            return put(ev)

        coord.events.put = tap  # type: ignore[method-assign,assignment]
        thread = coord.start()
        for i, name in enumerate(DEVICES):
            path = device_toml(tmp_path / f"{name}.toml", fb.state_dir / f"credentials/{name}.toml",
                               dataset="digits", partition_file=pfile, client=i, state_dir=tmp_path / name,
                               heartbeat_s=1.0)
            devices.append(EdgeClient(load_device_config(path).edge, fb.devices[name], client_data(digits,
                                                                                                 part.clients[i])))
            devices[-1].start()
        finished(coord, thread, 240, rounds=2)
        for dev in devices:
            assert dev.wait(60) and dev.error is None
        observed = observer.drain(1.0)
    finally:
        for dev in devices:
            dev.stop()
        observer.close()
    allowed = documented()
    for who, messages in (("the coordinator", coordinator_view), ("an observer", observed)):
        seen, problems = _fields([(m.topic, bytes(m.payload)) for m in messages], topics)
        assert seen, f"{who} saw nothing of the devices"
        extra = sorted(seen - allowed)
        assert not extra, f"{who} read fields of a private round that docs/reference/private-fields.md does not " \
                          f"list: {extra}"
        assert not problems, f"{who}: {problems}"
    coord_seen, _ = _fields([(m.topic, bytes(m.payload)) for m in coordinator_view], topics)
    want = ("masked-input", "values") if mode.endswith("secure") else ("update", "values")
    assert want in coord_seen  # the coordinator did read the uploads
    if mode == "central-adaptive":
        assert ("update", "info.dp_unclipped") in coord_seen
    last: dict[str, dict[str, Any]] = {}  # what flayer status and the dashboard make of the observer's view
    for m in observed:
        parsed = topics.parse(m.topic)
        if parsed.kind == "status" and parsed.client in DEVICES and m.payload:
            st = decode_message(bytes(m.payload))[1]
            assert isinstance(st, Status)
            last[parsed.client] = dict(st.info)
    rounds = [r for r in read_metrics(tmp_path / "coord" / "metrics.jsonl") if r["kind"] == "round"]
    assert len(rounds) == 2  # the round record holds no device's evaluation (there is none to hold)
    assert all(r["acc"] is None and r["train_loss"] is None and all(d["acc"] is None for d in r["devices"])
               for r in rounds), rounds
    dp = device_privacy(last.values())
    assert dp is not None and dp["devices"] == 4 and dp["with_epsilon"] == 4 and dp["at_budget"] == 0
    if mode.endswith("-async"):  # versions take whoever uploads first: devices contribute unevenly
        assert dp["max"] > 0
    else:
        assert dp["min"] == dp["max"] > 0  # every device took part in both rounds
