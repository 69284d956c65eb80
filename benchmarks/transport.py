"""The federation's transport against plain baselines, measured side by side in one run.

1. Broadcast: the coordinator's publishing path (safetensors blob of a ResNet-18-size state, envelope
   chunks, retained QoS 1, PUBACKs awaited) to N subscribers that each run the edge client's download
   path (MqttLink events on a worker thread, envelope + CRC checks, reassembly, sha256, safetensors
   validation) -- against raw paho publishing the same number of same-size payloads to N raw paho
   subscribers that only count bytes. Ratio = raw time / federation time (1.0 = no overhead).
   Also the time one device's download path takes for the retained model, checks included.
2. Coordinator memory: peak traced memory (tracemalloc; numpy reports its buffers to it) of the
   fold path -- update chunks into the ChunkCollector, decode, validate, fold into the strategy's
   aggregator -- for 20 and for 200 ResNet-18-size sparse updates at FLAYER's layer-wise density
   (UP_i = min(max(i/L, 0.1), 1), random positions). Flat means O(model), not O(devices).
3. Aggregation throughput: that fold path in MB/s of dense-equivalent fp32 (45 MB per update),
   against ``np.copyto`` of the same 45 MB.

    python benchmarks/transport.py [--subscribers 10] [--updates 20 200] [--repeat 3]
"""

from __future__ import annotations

import argparse
import math
import queue
import shutil
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch

from coordinator.intake import IntakeContext, validate
from coordinator.publish import Publisher, model_blob
from flayer.aggregate import Aggregator
from flayer.layers import layer_plan
from flayer.models import ModelSpec, build_model
from flayer.update import TensorDelta, Update, float_state
from mqtt_broker import (
    BrokerConfig,
    add_device,
    load_credentials,
    make_client,
    mqtt_connect_settings,
    start_broker,
)
from protocol import (
    ChunkCollector,
    Kind,
    Reassembler,
    Topics,
    UpdateHeader,
    WireLimits,
    chunk_blob,
    decode_envelope,
    decode_state,
    encode_update,
)
from transport.link import Connected, MqttLink, Received

FED = "bench"
SPEC = ModelSpec("resnet18", in_channels=3, height=32, width=32, num_classes=10)


def resnet_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return float_state(build_model(SPEC))


# ---- 1. broadcast -----------------------------------------------------------------------------
class Downloader:
    """The edge client's download path for one model: events on a queue, a worker that checks and
    reassembles, sha256 and safetensors validation at the end."""

    def __init__(self, creds, topics: Topics, digest: str, shapes: dict) -> None:
        self.events: queue.Queue = queue.Queue()
        self.link = MqttLink(mqtt_connect_settings(creds), self.events.put, clean_session=True)
        self.topics, self.digest, self.shapes = topics, digest, shapes
        self.done = threading.Event()
        self.link.start()
        while not isinstance(self.events.get(timeout=10), Connected):
            pass
        self.worker = threading.Thread(target=self._run, daemon=True)

    def subscribe(self) -> None:
        self.worker.start()
        self.link.subscribe([self.topics.model_filter(self.digest)])

    def _run(self) -> None:
        reasm = Reassembler(WireLimits())
        while True:
            ev = self.events.get()
            if isinstance(ev, Received) and ev.payload and reasm.add(decode_envelope(ev.payload)):
                decode_state(reasm.blob(), expected=self.shapes)
                self.done.set()
                return

    def close(self) -> None:
        self.link.stop()


class Counter:
    """A raw paho subscriber that only counts the bytes of ``topic_filter`` until ``total`` arrived."""

    def __init__(self, creds, topic_filter: str, total: int) -> None:
        s = mqtt_connect_settings(creds)
        self.client, self.filter, self.total, self.got = make_client(s), topic_filter, total, 0
        self.done = threading.Event()
        self.client.on_message = self._on_message
        self.client.connect(s.host, s.port)
        self.client.loop_start()

    def _on_message(self, client, userdata, msg) -> None:
        self.got += len(msg.payload)
        if self.got >= self.total:
            self.done.set()

    def subscribe(self) -> None:
        self.client.subscribe(self.filter, qos=1)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def _coordinator_link(state_dir: Path) -> tuple[MqttLink, Publisher]:
    creds = load_credentials(state_dir, "coordinator")
    events: queue.Queue = queue.Queue()
    link = MqttLink(mqtt_connect_settings(creds), events.put, clean_session=True)
    link.start()
    while not isinstance(events.get(timeout=10), Connected):
        pass
    return link, Publisher(link, Topics(FED), creds.username, creds.max_payload, Path(tempfile.mkdtemp()), 300,
                           lambda: False, key=creds.signer())


def broadcast(state_dir: Path, creds_list, blob_info, sizes: list[int], federation: bool) -> float:
    """Seconds from the first publish until every subscriber holds every byte: the coordinator's
    Publisher (federation=True) or raw paho publishes of payloads of the same sizes."""
    topics = Topics(FED)
    subs = [Counter(c, f"{topics.prefix}/model/+/+", sum(sizes)) for c in creds_list]
    link, pub = _coordinator_link(state_dir)
    for s in subs:
        s.subscribe()
    time.sleep(0.5)
    payloads = [bytes(n) for n in sizes]
    t0 = time.perf_counter()
    if federation:
        pub.model(blob_info, 1)
    else:
        infos = [link.client.publish(topics.model_chunk("cd" * 32, i), p, qos=1, retain=True)
                 for i, p in enumerate(payloads)]
        for info in infos:
            info.wait_for_publish(300)
    for s in subs:
        assert s.done.wait(300), "a subscriber did not get every byte"
    dt = time.perf_counter() - t0
    for i in range(len(sizes)):  # empty the retained chunks again
        link.publish(topics.model_chunk(blob_info.digest if federation else "cd" * 32, i), b"", retain=True)
    link.stop()
    for s in subs:
        s.close()
    return dt


def download(state_dir: Path, creds, blob_info, sizes: list[int], shapes: dict, federation: bool) -> float:
    """One device fetching the retained model: the edge client's download path (checks, reassembly,
    sha256, safetensors validation) or a raw subscriber counting bytes (kept for experiments: on one
    loopback subscriber its time is too short to measure reliably here)."""
    topics = Topics(FED)
    link, pub = _coordinator_link(state_dir)
    pub.model(blob_info, 1)
    sub: Downloader | Counter = (Downloader(creds, topics, blob_info.digest, shapes) if federation
                                 else Counter(creds, topics.model_filter(blob_info.digest), sum(sizes)))
    t0 = time.perf_counter()
    sub.subscribe()
    assert sub.done.wait(300)
    dt = time.perf_counter() - t0
    pub.live = None
    pub.clear_old_models()
    link.stop()
    sub.close()
    return dt


# ---- 2 and 3. fold path ---------------------------------------------------------------------------
def flayer_like_updates(state: dict[str, torch.Tensor], count: int, seed: int) -> list[tuple[str, bytes]]:
    """``count`` encoded sparse updates at FLAYER's layer-wise upload fractions (random positions)."""
    plan = layer_plan(build_model(SPEC))
    frac = {}
    for layer in plan.layers:
        up = min(max(layer.index / plan.num_layers, 0.1), 1.0)
        for t in layer.tensors:
            frac[t] = up
    digest = model_blob(state).digest
    out = []
    for k in range(count):
        rng = np.random.default_rng(seed + k)
        deltas = {}
        for name, v in state.items():
            n = v.numel()
            idx = np.flatnonzero(rng.random(n) < frac.get(name, 1.0))
            vals = (rng.standard_normal(idx.size) * 1e-3).astype(np.float32)
            deltas[name] = TensorDelta(tuple(v.shape), vals, None if idx.size == n else idx)
        client = f"dev-{k}"
        out.append((client, encode_update(Update(deltas, 100 + k), UpdateHeader(FED, 1, client, digest))))
    return out


def fold_path(state: dict[str, torch.Tensor], blobs: list[tuple[str, bytes]], n: int, max_payload: int,
              trace: bool) -> tuple[float, int, dict[str, float]]:
    """Fold ``n`` updates (cycling through ``blobs``) the coordinator's way; (seconds, peak traced
    bytes, seconds per stage)."""
    digest = model_blob(state).digest
    limits = WireLimits()
    chunked = [(c, chunk_blob(b, Kind.UPDATE_CHUNK, FED, c, 1, max_payload)) for c, b in blobs]
    if trace:
        tracemalloc.start()
        tracemalloc.reset_peak()
    stages = {"chunks": 0.0, "decode+validate": 0.0, "fold": 0.0}
    t0 = time.perf_counter()
    agg = Aggregator(state, "carry")
    ctx = IntakeContext(FED, 1, digest, agg.shapes, limits, 1 << 30)
    collector = ChunkCollector(limits, 1 << 30)
    for i in range(n):
        client, payloads = chunked[i % len(chunked)]
        t1 = time.perf_counter()
        blob = None
        for p in payloads:
            blob = collector.add(decode_envelope(p, limits)) or blob
        assert blob is not None
        t2 = time.perf_counter()
        verdict = validate(client, blob, ctx)
        assert verdict.accepted and verdict.update is not None, verdict.reason
        t3 = time.perf_counter()
        agg.fold(verdict.update)
        stages["chunks"] += t2 - t1
        stages["decode+validate"] += t3 - t2
        stages["fold"] += time.perf_counter() - t3
    agg.result()
    dt = time.perf_counter() - t0
    peak = 0
    if trace:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return dt, peak, stages


def copy_rate(nbytes: int, repeat: int) -> float:
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    best = math.inf
    for _ in range(max(3, repeat)):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--subscribers", type=int, default=10)
    ap.add_argument("--updates", type=int, nargs=2, default=[20, 200], metavar=("FEW", "MANY"))
    ap.add_argument("--repeat", type=int, default=3, help="broadcast runs per variant (best is reported)")
    ap.add_argument("--distinct", type=int, default=4, help="distinct updates cycled through in the fold path")
    ap.add_argument("--skip-broadcast", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    state = resnet_state()
    blob_info = model_blob(state)
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    dense_mb = sum(v.numel() for v in state.values()) * 4 / 1e6
    rows: list[tuple[str, str, str, str]] = []
    if not args.skip_broadcast:
        tmp = Path(tempfile.mkdtemp(prefix="bench-transport-"))
        try:
            with start_broker(BrokerConfig(federation=FED, persistence=False), tmp, kind="mosquitto") as broker:
                creds = [add_device(tmp, f"dev-{i}") for i in range(args.subscribers)]
                broker.reload()
                time.sleep(0.5)
                max_payload = creds[0].max_payload
                sizes = [len(p) for p in chunk_blob(blob_info.blob, Kind.MODEL_CHUNK, FED, "coordinator", 1,
                                                    max_payload, blob_info.digest)]
                fed_t = min(broadcast(tmp, creds, blob_info, sizes, True) for _ in range(args.repeat))
                raw_t = min(broadcast(tmp, creds, blob_info, sizes, False) for _ in range(args.repeat))
                dl_fed = min(download(tmp, creds[0], blob_info, sizes, shapes, True) for _ in range(args.repeat))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        mb = blob_info.size / 1e6
        rows.append((f"broadcast {mb:.1f} MB ({len(sizes)} retained chunks) to {args.subscribers} subscribers",
                     f"coordinator publisher {fed_t:.2f} s ({mb * args.subscribers / fed_t:.0f} MB/s delivered)",
                     f"raw paho {raw_t:.2f} s ({mb * args.subscribers / raw_t:.0f} MB/s)",
                     f"{raw_t / fed_t:.2f} (target >= 0.7)"))
        rows.append((f"one device fetching the retained {mb:.1f} MB model",
                     f"edge download path {dl_fed:.2f} s ({mb / dl_fed:.0f} MB/s, envelope, CRC, sha256 and "
                     f"safetensors checks included)", "-", "-"))
    blobs = flayer_like_updates(state, args.distinct, seed=1)
    sent = np.mean([len(b) for _, b in blobs]) / 1e6
    few, many = args.updates
    t_few, peak_few, _ = fold_path(state, blobs, few, 1 << 20, trace=True)
    t_many, peak_many, _ = fold_path(state, blobs, many, 1 << 20, trace=True)
    rows.append((f"coordinator peak memory, fold path ({sent:.1f} MB updates, FLAYER density)",
                 f"{few} updates: {peak_few / 1e6:.0f} MB", f"{many} updates: {peak_many / 1e6:.0f} MB",
                 f"{peak_many / peak_few:.2f} (target: flat, ~1.0)"))
    t_fold, _, stages = fold_path(state, blobs, few, 1 << 20, trace=False)
    fold_rate = few * dense_mb / t_fold
    copy = copy_rate(int(dense_mb * 1e6), args.repeat)
    rows.append((f"aggregation throughput ({dense_mb:.1f} MB dense-equivalent per update)",
                 f"fold path {fold_rate:.0f} MB/s ({t_fold / few * 1e3:.0f} ms/update)",
                 f"np.copyto {copy:.0f} MB/s", f"{fold_rate / copy:.2f} (target >= 0.5)"))
    print("| measurement | federation path | baseline | ratio |")
    print("|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(r) + " |")
    per = ", ".join(f"{k} {v / few * 1e3:.0f} ms" for k, v in stages.items())
    print(f"\nfold path per update: {per} (untraced run of {few}; the traced runs took {t_few:.1f} s and "
          f"{t_many:.1f} s).\nCUDA: no GPU on this machine; the CUDA local-round timing was not run.")


if __name__ == "__main__":
    main()
