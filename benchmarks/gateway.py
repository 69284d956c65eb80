"""Field gateway against a direct connection: round time and exactly-once accounting of the same
federation run (a) with every device connecting to the central broker over the backhaul and (b) with
the devices on a site broker bridged to the central one (mqtt_broker.bridge), side by side.

The backhaul is a veth pair into a network namespace that holds the centre (the central Mosquitto
and the coordinator, as processes run with ``ip netns exec``), shaped in both directions with a
``tc tbf`` token bucket (``--rate``; no added delay: netem is not available here). The devices are
real ``flayer edge`` processes in the root namespace; in (b) they reach the site broker on loopback
and only the bridge crosses the backhaul. Both runs use the same seeds and partition, so their final
models must be equal; the accounting is the fault suite's (tests/faults/faultlib.py): every update a
device saw acknowledged journaled exactly once, each round folding what its journal holds.

Needs root (namespaces, tc) and mosquitto. Run once, under nice; each mode's summary is kept in
``--out`` and a mode already there is not run again (delete its file to re-run)::

    sudo nice -n 10 python benchmarks/gateway.py --devices 4 --rounds 3 --rate 4mbit \
        --out docs/results/field-gateway
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Self

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
for sub in ("tests", "tests/integration", "tests/faults"):
    sys.path.insert(0, str(ROOT / sub))

from faultlib import PROC_ENV, Proc, ProcFederation, accounting, check_accounting, max_diff
from fedtestlib import FedBroker, device_toml, federation_toml

from cli.report import table
from mqtt_broker import BrokerConfig, add_device, load_credentials, start_broker
from mqtt_broker.bridge import set_gateway
from mqtt_broker.process import BrokerProcess
from mqtt_broker.state import add_gateway, write_broker_files

FEDERATION = "gwbench"
CENTRE_IP, ROOT_IP = "10.231.7.2", "10.231.7.1"
_RATE = re.compile(r"[0-9]{1,6}(kbit|mbit)")


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30)


class Backhaul:
    """The namespace ``ns`` (the centre) behind a veth pair, both ends shaped to ``rate``."""

    def __init__(self, rate: str) -> None:
        tag = os.getpid() % 100000
        self.ns, self.outer, self.inner = f"flgw-centre-{tag}", f"flgw{tag}a", f"flgw{tag}b"
        self.rate = rate

    def __enter__(self) -> Self:
        sh("ip", "netns", "add", self.ns)
        try:
            sh("ip", "link", "add", self.outer, "type", "veth", "peer", "name", self.inner)
            sh("ip", "link", "set", self.inner, "netns", self.ns)
            sh("ip", "addr", "add", f"{ROOT_IP}/30", "dev", self.outer)
            sh("ip", "link", "set", self.outer, "up")
            ns = ("ip", "netns", "exec", self.ns)
            sh(*ns, "ip", "addr", "add", f"{CENTRE_IP}/30", "dev", self.inner)
            sh(*ns, "ip", "link", "set", self.inner, "up")
            sh(*ns, "ip", "link", "set", "lo", "up")
            for dev, prefix in ((self.outer, ()), (self.inner, ns)):
                sh(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate, "burst", "32kb",
                   "latency", "400ms")
        except BaseException:
            self.__exit__()
            raise
        return self

    def counters(self) -> dict[str, int]:
        """Bytes that crossed the backhaul so far: up (towards the centre) and down."""
        stats = Path(f"/sys/class/net/{self.outer}/statistics")
        return {"up": int((stats / "tx_bytes").read_text()), "down": int((stats / "rx_bytes").read_text())}

    def __exit__(self, *exc: object) -> None:
        subprocess.run(["ip", "link", "del", self.outer], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, check=False)


class CentreBroker(BrokerProcess):
    """The central Mosquitto inside the centre's namespace (stopped by the PID it was started with)."""

    ns = ""

    def argv(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *super().argv()]

    def is_running(self) -> bool:  # 'ip netns exec' runs mosquitto in its own place: the recorded argv differs
        return self._proc is not None and self._proc.poll() is None


def launch_in(ns: str | None, tmp: Path, name: str, *argv: str) -> Proc:
    log = tmp / f"{name}.log"
    prefix = ["ip", "netns", "exec", ns] if ns else []
    with open(log, "wb") as fh:
        popen = subprocess.Popen([*prefix, sys.executable, "-m", "cli.main", *argv], cwd=ROOT, env=PROC_ENV,
                                 stdout=fh, stderr=subprocess.STDOUT)
    return Proc(name, popen, log)


class BenchFederation(ProcFederation):
    ns: str | None = None

    def start_coordinator(self, *extra: str) -> Proc:
        p = launch_in(self.ns, self.tmp, f"coordinator-{len(self.coordinators) + 1}", "-v", "coordinator",
                      "--config", str(self.fed_toml), *extra)
        self.coordinators.append(p)
        return p


def model_digest(state: dict[str, Any]) -> str:
    """SHA-256 over the final model's tensors (names, shapes, float32 bytes): equal digests, equal models."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().to("cpu").contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def run_mode(mode: str, tmp: Path, bh: Backhaul, devices: list[str], rounds: int) -> tuple[dict[str, Any], Any]:
    from flayer.data import load_dataset
    from flayer.partition import make_partition, save_partition

    ds = load_dataset("digits")
    cdir = tmp / "central"
    write_broker_files(BrokerConfig(federation=FEDERATION, host="0.0.0.0", port=18991, advertise_host=CENTRE_IP,
                                    persistence=True), cdir)
    CentreBroker.ns = bh.ns
    central = CentreBroker(cdir).start(30)
    site = None
    try:
        if mode == "direct":
            creds = {d: add_device(cdir, d) for d in devices}
            central.reload()
            cred_dir = cdir / "credentials"
        else:
            add_gateway(cdir, "site-a", devices)
            central.reload()
            scfg = BrokerConfig(federation=FEDERATION, persistence=True)
            set_gateway(tmp / "site", scfg, cdir / "credentials/site-a.toml", None, 30, (1, 5))
            site = start_broker(scfg, tmp / "site", kind="mosquitto", timeout=30)
            creds = {d: add_device(tmp / "site", d) for d in devices}
            site.reload()
            cred_dir = tmp / "site/credentials"
        del creds
        time.sleep(2.0)  # reloads; the bridge connects
        part = make_partition(ds.y, ds.num_classes, len(devices), "iid", 0,
                              meta={"dataset": ds.name, "dataset_fingerprint": ds.fingerprint()})
        part_file = save_partition(part, tmp / "part.npz")
        fed_toml = federation_toml(tmp / "federation.toml", cdir / "credentials/coordinator.toml", tmp / "coord",
                                   strategy="fedavg", rounds=rounds, dataset="digits", quorum=len(devices),
                                   min_devices=len(devices), over_selection=1.0, deadline_s=600.0, grace_s=0.0,
                                   keep_journals=1000)
        tomls = {d: device_toml(tmp / f"{d}.toml", cred_dir / f"{d}.toml", dataset="digits", partition_file=part_file,
                                client=i, state_dir=tmp / d, heartbeat_s=5.0, ack_timeout_s=60.0)
                 for i, d in enumerate(devices)}
        fed = BenchFederation(tmp, FedBroker(central, cdir, {}, load_credentials(cdir, "coordinator")), fed_toml,
                              tomls, tmp / "coord", rounds, 0, 0.05, "fedavg")
        fed.ns = bh.ns
        before = bh.counters()
        t0 = time.monotonic()
        for d in devices:
            fed.start_device(d)
        fed.start_coordinator()
        try:
            fed.wait_all(1200)
        finally:
            for p in [*fed.coordinators, *fed.procs.values()]:
                if p.alive():
                    p.popen.kill()
                    p.popen.wait(10)
        wall = time.monotonic() - t0
        after = bh.counters()
        acc = accounting(fed)
        check_accounting(acc, rounds)
        metrics = fed.metrics()
        from flayer.state import load_tensors

        state, _ = load_tensors(tmp / "coord/global.safetensors")
        return {
            "mode": mode, "devices": len(devices), "rounds": rounds, "rate": bh.rate,
            "round_wall_s": [float(m["wall_s"]) for m in metrics],
            "run_wall_s": round(wall, 2),
            "backhaul_bytes": {k: after[k] - before[k] for k in after},
            "acked": len(acc.acked), "journaled": sum(acc.journaled.values()),
            "journaled_twice": sum(1 for n in acc.journaled.values() if n > 1),
            "acked_not_journaled": len(acc.acked - set(acc.journaled)),
            "aggregated": acc.aggregated,
            "final_model_sha256": model_digest(state),
        }, state
    finally:
        if site is not None:
            site.stop()
        central.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rate", default="4mbit", help="backhaul rate each way, tc syntax: NNNkbit or NNNmbit")
    ap.add_argument("--out", type=Path, default=Path("docs/results/field-gateway"))
    args = ap.parse_args(argv)
    if not 1 <= args.devices <= 32 or not 1 <= args.rounds <= 50:
        ap.error("--devices must be 1-32 and --rounds 1-50")
    if not _RATE.fullmatch(args.rate):
        ap.error(f"--rate must look like 512kbit or 4mbit, got {args.rate!r}")
    if os.geteuid() != 0:
        ap.error("needs root: network namespaces and tc")
    if shutil.which("mosquitto") is None:
        ap.error("needs mosquitto")
    args.out.mkdir(parents=True, exist_ok=True)
    devices = [f"dev-{i}" for i in range(args.devices)]
    results, models = {}, {}
    for mode in ("direct", "gateway"):
        path = args.out / f"{mode}-{args.devices}dev-{args.rounds}r-{args.rate}.json"
        if path.exists():
            results[mode] = json.loads(path.read_text())
            continue
        with tempfile.TemporaryDirectory(prefix=f"gwbench-{mode}-") as tmp, Backhaul(args.rate) as bh:
            results[mode], models[mode] = run_mode(mode, Path(tmp), bh, devices, args.rounds)
        path.write_text(json.dumps(results[mode], indent=1) + "\n")
    rows = []
    for mode in ("direct", "gateway"):
        r = results[mode]
        walls = r["round_wall_s"]
        rows.append([mode, f"{sum(walls) / len(walls):.2f}", " ".join(f"{w:.2f}" for w in walls),
                     f"{r['backhaul_bytes']['down'] / 1e6:.2f}", f"{r['backhaul_bytes']['up'] / 1e6:.2f}",
                     r["acked"], r["journaled"], r["journaled_twice"], r["acked_not_journaled"], r["aggregated"]])
    print(f"{args.devices} devices, {args.rounds} rounds, digits, fedavg, backhaul tbf {args.rate} each way")
    print(table(["path", "mean round s", "rounds s", "backhaul MB down", "backhaul MB up", "acked", "journaled",
                 "journaled twice", "acked not journaled", "aggregated"], rows))
    same = results["direct"]["final_model_sha256"] == results["gateway"]["final_model_sha256"]
    print(f"final models: {'identical' if same else 'DIFFERENT'} (SHA-256 of the tensors)"
          + (f", max |direct - gateway| = {max_diff(models['direct'], models['gateway']):.3g}" if len(models) == 2 else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
