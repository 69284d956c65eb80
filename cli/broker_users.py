"""``flayer broker add-observer|revoke|rekey`` and the reload they make (the user actions of :mod:`cli.broker`).

``rekey`` gives a device (``--kit``: and its new kit) or the coordinator a new Ed25519 signing key pair; the
old public key leaves the registry, so what the old key signs is refused from then on (docs/howto/devices.md). A
device's new certificate has a higher serial and its old one goes on the authority's signed revocation list;
``revoke`` lists the device's certificate too. Both publish the list retained to the running broker
(:mod:`mqtt_broker.publish_list`), so the other devices refuse the old key with no file copied to them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cli.common import CliError

__all__ = ["add_rekey_parser"]


def add_rekey_parser(actions: Any, state_dir_flag: Callable[[argparse.ArgumentParser], None],
                     run: Callable[[argparse.Namespace], int]) -> None:
    k = actions.add_parser("rekey", help="a new signing key pair for a device (--kit: its new kit) or the coordinator "
                                         "(every device then needs a new kit); the old key is refused from then on")
    state_dir_flag(k)
    k.add_argument("device_id", metavar="ID", nargs="?", help="the device to re-key")
    k.add_argument("--coordinator", action="store_true", help="re-key the coordinator instead of a device")
    k.add_argument("--kit", metavar="FILE.tar.gz", help="also write the device's new startup kit (replaces FILE when "
                   "it is a kit of the same device; any other existing file is refused)")
    k.set_defaults(func=run)


def _reload(state_dir: Path, note: str = "", out: list[str] | None = None) -> bool:
    """Make the running broker recorded in ``state_dir`` re-read its passwords and ACL (says so, on stdout or
    into ``out``); False when none is recorded."""
    from mqtt_broker.cluster import ClusterFiles, reload_recorded_cluster
    from mqtt_broker.process import reload_recorded

    say = print if out is None else out.append
    if ClusterFiles.at(state_dir).layout.exists():  # a cluster's files are kept up to date even while it is down
        cluster = reload_recorded_cluster(state_dir)
        if cluster is not None:
            say(f"reloaded the running broker cluster ({len(cluster.nodes)} aedes node(s)){note}")
            return True
    rec = reload_recorded(state_dir)
    if rec is not None:
        say(f"reloaded the running {rec.kind} broker (pid {rec.pid}){note}")
    return rec is not None


def _close_identity(state_dir: Path, user: str, out: list[str]) -> bool:
    """``--identity-as-username``: a reload closes no open TLS connection; close ``user``'s now (its
    certificate is already on the revocation list). False when the mode is off or no Mosquitto runs."""
    from mqtt_broker.evict import close_identity_session

    if close_identity_session(state_dir, user):
        out.append(f"closed any open TLS connection of {user} (the broker now refuses its old certificate)")
        return True
    return False


def _add_observer(args: argparse.Namespace) -> int:
    from mqtt_broker.state import BrokerFiles, add_observer

    files = BrokerFiles.at(args.state_dir)
    creds = add_observer(files.state_dir, args.name, rotate=args.rotate)
    out: list[str] = []
    _reload(files.state_dir, out=out)
    if args.rotate:
        _close_identity(files.state_dir, creds.username, out)
    print(f"credentials of observer {creds.username}: {files.credentials(creds.username)} (read-only; pass it to "
          f"'flayer status --credentials' or 'flayer dashboard --credentials')")
    if out:
        print("\n".join(out))
    return 0


def _published(state_dir: Path) -> str:
    """Publish the authority's revocation list to the running broker (adding the admin user first to a state folder
    made before it existed)."""
    from mqtt_broker.publish_list import ensure_admin, publish_revocations

    if ensure_admin(state_dir):
        _reload(state_dir, out=[])
    return publish_revocations(state_dir)


def _revoke(args: argparse.Namespace) -> int:
    from mqtt_broker.config import BrokerConfig
    from mqtt_broker.evict import identity_mode
    from mqtt_broker.kit import revoke_device
    from mqtt_broker.state import BrokerFiles
    from mqtt_broker.tls import client_cert_paths

    files = BrokerFiles.at(args.state_dir)
    identity = identity_mode(BrokerConfig.load(files.config))
    on_record = client_cert_paths(files.tls_dir, args.device_id)[0].exists()  # what the list can name
    first = revoke_device(files.state_dir, args.device_id)
    # the broker is told before anything is printed: a closed stdout must not leave the device connected
    out: list[str] = []
    running = _reload(files.state_dir, "" if identity else ": its connection is closed", out)
    if running and identity:
        _close_identity(files.state_dir, args.device_id, out)
    listed = ", certificate on the revocation list" if identity and on_record else ""
    print(f"revoked device {args.device_id}{'' if first else ' (already revoked)'}: password, credentials and "
          f"certificate removed{listed}; listed in {files.state_dir / 'revoked.json'} for the coordinator")
    if identity and not on_record:
        print(f"warning: no certificate of {args.device_id} is on record here, so none could be put on the revocation "
              f"list: under --identity-as-username a kit holding its certificate still passes the TLS handshake "
              f"(the coordinator refuses what it signs); re-create the federation's CA to shut it out at the broker",
              file=sys.stderr)
    if running:
        out.append(_published(files.state_dir))
        print("\n".join(out))
    elif identity:
        print("no broker started by this CLI is recorded: if one runs (a system Mosquitto), reload it to refuse the "
              "certificate at new connections and restart it to close an open one (a reload closes none)")
    else:
        print("no running broker recorded: it refuses the device when it starts")
    return 0


def _rekey(args: argparse.Namespace) -> int:
    from mqtt_broker.config import BrokerConfig
    from mqtt_broker.rekey import rekey
    from mqtt_broker.state import BrokerFiles

    files = BrokerFiles.at(args.state_dir)
    if args.coordinator == bool(args.device_id) or (args.coordinator and args.kit):
        raise CliError("name a device to re-key (ID, optionally --kit FILE), or pass --coordinator alone")
    user = BrokerConfig.load(files.config).coordinator_user if args.coordinator else args.device_id
    if args.kit and Path(args.kit).exists():  # checked first: nothing is re-keyed for a kit that cannot be written
        from mqtt_broker.kit import kit_identity

        if kit_identity(Path(args.kit)) != (BrokerConfig.load(files.config).federation, user):
            raise CliError(f"{args.kit} exists and is not a kit of {user}: remove it or name another file with --kit")
    creds = rekey(files.state_dir, user)
    print(f"new signing key of {creds.role} {user} in {files.credentials(user)} (mode 0600); its old key is refused "
          f"from now on")
    if args.coordinator:
        print("every device needs its new coordinator key: issue new kits ('flayer broker rekey ID --kit FILE', or "
              "'add-device ID --rotate --kit FILE'); a coordinator running now must be restarted")
    elif args.kit:
        from mqtt_broker.kit import write_kit

        kit = write_kit(files.state_dir, user, args.kit, replace=True)
        print(f"startup kit: {kit} (mode 0600, holds the key: copy it to the device privately and restart it there "
              f"with 'flayer edge --kit {kit.name}' in the same folder as before: its state is kept)")
    if not args.coordinator:
        _reload(files.state_dir)
        print(_published(files.state_dir))
    return 0
