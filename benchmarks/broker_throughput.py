"""Model fan-out through the federation's broker: Mosquitto against the embedded broker, one run.

The coordinator publishes a model as retained chunks of the largest payload the broker allows,
then devices subscribe and download every chunk (QoS 1), as edge clients will. Prints, per broker:
start time, publish time, download time and throughput, and the embedded/Mosquitto ratios.

    python benchmarks/broker_throughput.py [--model-mb 45] [--devices 4]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mqtt_broker import (
    BrokerConfig,
    add_device,
    load_credentials,
    make_client,
    mosquitto_available,
    mqtt_connect_settings,
    start_broker,
)
from protocol.topics import Topics


def _client(creds):  # type: ignore[no-untyped-def]
    settings = mqtt_connect_settings(creds)
    client = make_client(settings)
    client.max_inflight_messages_set(20)
    client.max_queued_messages_set(0)
    client.connect(settings.host, settings.port)
    client.loop_start()
    return client


def run(kind: str, model_bytes: int, devices: int) -> dict[str, float]:
    state = Path(tempfile.mkdtemp(prefix=f"bench-{kind}-"))
    try:
        t0 = time.perf_counter()
        broker = start_broker(BrokerConfig(federation="bench", persistence=False), state, kind=kind)
        started = time.perf_counter() - t0
        with broker:
            ids = [f"dev-{i}" for i in range(devices)]
            creds = [add_device(state, d) for d in ids]
            broker.reload()
            time.sleep(0.3)
            topics = Topics("bench")
            chunk = broker.config.max_payload
            n = -(-model_bytes // chunk)
            digest = "ab" * 16
            coord = _client(load_credentials(state, "coordinator"))
            payload = bytes(chunk)
            t0 = time.perf_counter()
            infos = [coord.publish(topics.model_chunk(digest, i), payload, qos=1, retain=True) for i in range(n)]
            for info in infos:
                info.wait_for_publish(120)
            published = time.perf_counter() - t0
            coord.disconnect()
            coord.loop_stop()

            done = threading.Barrier(devices + 1)
            counts = [0] * devices
            clients = []

            def on_message(idx: int):  # type: ignore[no-untyped-def]
                def handler(client, userdata, msg):  # type: ignore[no-untyped-def]
                    counts[idx] += 1
                    if counts[idx] == n:
                        threading.Thread(target=done.wait, daemon=True).start()
                return handler

            for i, c in enumerate(creds):
                cl = _client(c)
                cl.on_message = on_message(i)
                clients.append(cl)
            t0 = time.perf_counter()
            for cl in clients:
                cl.subscribe(topics.model_filter(digest), qos=1)
            done.wait(timeout=300)
            downloaded = time.perf_counter() - t0
            for cl in clients:
                cl.disconnect()
                cl.loop_stop()
        return {"start_s": started, "chunks": n, "publish_s": published, "download_s": downloaded,
                "download_MBps": devices * n * chunk / downloaded / 1e6, "complete": float(min(counts) == n)}
    finally:
        shutil.rmtree(state, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-mb", type=float, default=45.0, help="model size in MB (ResNet-18 is ~45)")
    p.add_argument("--devices", type=int, default=4)
    args = p.parse_args()
    if args.model_mb <= 0 or args.devices < 1:
        p.error("--model-mb must be > 0 and --devices >= 1")
    kinds = (["mosquitto"] if mosquitto_available() else []) + ["embedded"]
    rows = {k: run(k, int(args.model_mb * 1e6), args.devices) for k in kinds}
    print(f"model {args.model_mb:g} MB as retained chunks, {args.devices} devices downloading at once (QoS 1)")
    print(f"{'broker':<10} {'start s':>8} {'chunks':>7} {'publish s':>10} {'download s':>11} {'MB/s':>8} {'all got all':>12}")
    for k, r in rows.items():
        print(f"{k:<10} {r['start_s']:8.2f} {r['chunks']:7.0f} {r['publish_s']:10.2f} {r['download_s']:11.2f} "
              f"{r['download_MBps']:8.1f} {'yes' if r['complete'] else 'NO':>12}")
    if len(rows) == 2:
        m, e = rows["mosquitto"], rows["embedded"]
        print(f"embedded / mosquitto: publish time x{e['publish_s'] / m['publish_s']:.1f}, "
              f"download time x{e['download_s'] / m['download_s']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
