"""Does a device's own data path cost anything? The same three-device federation over Mosquitto with
TLS, run twice: each device reading its share as a PNG image folder (source "folder", from its kit)
and reading it from the saved partition of the data set (source "partition"). Same model (the test
suite's fleetmodel, 1x16x16 inputs), same samples per device, same FLAYER settings; only the data path
differs. Prints each round's wall time (coordinator's metrics.jsonl) and the mean.

    python benchmarks/fleet_sources.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "integration")]

from fleetlib import MODEL_FILE, federation_toml, launch, stop_all, wait_all

from cli.main import main
from flayer.data import load_dataset
from flayer.partition import make_partition, save_partition
from transport.kit import unpack_kit

DEVICES = ("dev-1", "dev-2", "dev-3")


def _federation(tmp: Path, source: str, rounds: int) -> list[float]:
    from PIL import Image

    ds = load_dataset("digits")
    part = make_partition(ds.y, ds.num_classes, len(DEVICES), "dir0.5", seed=0,
                          meta={"dataset": ds.name, "dataset_fingerprint": ds.fingerprint()})
    part_file = save_partition(part, tmp / "digits-3.npz")
    state = tmp / "broker"
    assert main(["broker", "start", "--state-dir", str(state), "--federation", "bench", "--tls", "--port", "0",
                 "--tls-port", "0", "--mosquitto"]) == 0
    procs = []
    try:
        names = [str(i) for i in range(ds.num_classes)]
        fed = federation_toml(tmp / "coord", state / "credentials/coordinator.toml", rounds=rounds, size=16,
                              channels=1, classes=names)
        for i, dev in enumerate(DEVICES):
            machine = tmp / dev
            machine.mkdir()
            kit = machine / f"{dev}.tar.gz"
            assert main(["broker", "add-device", dev, "--state-dir", str(state), "--kit", str(kit)]) == 0
            (machine / "fleetmodel.py").write_bytes(MODEL_FILE.read_bytes())
            toml = unpack_kit(kit)
            share = part.clients[i]
            if source == "folder":
                for j in (*share.train, *share.val, *share.test):
                    folder = machine / "images" / names[int(ds.y[j])]
                    folder.mkdir(parents=True, exist_ok=True)
                    Image.fromarray(ds.x[j, 0], "L").save(folder / f"{j}.png")
                argv = ["edge", "--kit", kit.name, "--data", "./images"]
            else:
                text = toml.read_text()
                data = (f'\n[data]\nsource = "partition"\ndataset = "digits"\npartition_file = "{part_file}"\n'
                        f"client = {i}\n\n[edge]")
                toml.write_text(text[: text.index("\n[data]\n")] + data + text.split("\n[edge]", 1)[1])
                argv = ["edge", "--kit", kit.name]
            procs.append((machine, argv))
        running = [launch(["coordinator", "--config", str(fed)], tmp / "coord", tmp / "coordinator.log")]
        running += [launch(argv, m, tmp / f"{m.name}.log") for m, argv in procs]
        procs = running
        wait_all(procs, 600)
        if any(p.returncode != 0 for p in procs):
            logs = "\n".join(f"--- {f.name}\n{f.read_text()[-1500:]}" for f in sorted(tmp.glob("*.log")))
            raise SystemExit(f"a process failed or timed out:\n{logs}")
        rows = [json.loads(x) for x in (tmp / "coord/state/metrics.jsonl").read_text().splitlines()]
        return [float(r["wall_s"]) for r in rows]
    finally:
        stop_all(procs if procs and not isinstance(procs[0], tuple) else [])
        main(["broker", "stop", "--state-dir", str(state)])


def run() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    results = {}
    for source in ("partition", "folder"):
        with tempfile.TemporaryDirectory(prefix=f"fleet-{source}-") as tmp:
            results[source] = _federation(Path(tmp), source, args.rounds)
    print(f"{'source':<10} {'round wall s (coordinator metrics)':<48} {'mean':>6} {'mean r2+':>9}")
    for source, walls in results.items():
        print(f"{source:<10} {' '.join(f'{w:.2f}' for w in walls):<48} {statistics.mean(walls):6.2f} "
              f"{statistics.mean(walls[1:]):9.2f}")


if __name__ == "__main__":
    run()
