"""Publish the authority's signed revocation list (:mod:`mqtt_broker.authority`) to the running broker.

The admin's tooling connects as the admin user (:data:`protocol.topics.ADMIN_USER`, the only user the ACL lets
write ``fl/<federation>/revocations``) and publishes the list retained, QoS 1: every device subscribed gets it at
once, and one that connects later gets it from the broker. ``flayer broker start`` publishes it again (a broker
without persistence forgets retained messages), and every kit carries a copy, so a device never depends on a file
copied by hand. The list is signed: whoever relays it cannot change it, only withhold it (see
docs/explanation/security.md).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from mqtt_broker.authority import REVOCATION_LIST, ensure_authority
from mqtt_broker.config import BrokerConfig
from mqtt_broker.process import recorded_process
from mqtt_broker.state import BrokerFiles, _add_user, _locked, _write_acl, list_users
from protocol.topics import ADMIN_USER, Topics
from transport.credentials import Credentials, CredentialsError, make_client, mqtt_connect_settings

__all__ = ["ensure_admin", "publish_revocations"]

log = logging.getLogger(__name__)


def _publish_once(creds: Credentials, topic: str, payload: bytes, timeout: float) -> bool:
    settings = mqtt_connect_settings(creds)
    client = make_client(settings)
    done, ok = threading.Event(), [False]

    def on_connect(c, userdata, flags, reason, props=None):
        if reason.is_failure:
            done.set()
            return
        info = c.publish(topic, payload, qos=1, retain=True)
        ok[0] = info.rc == 0
        if not ok[0]:
            done.set()

    def on_publish(c, userdata, mid, reason, props=None):
        done.set()

    client.on_connect, client.on_publish = on_connect, on_publish
    try:
        client.connect(settings.host, settings.port, keepalive=10)
    except OSError as exc:
        log.info("revocation list not published: %s", exc)
        return False
    client.loop_start()
    try:
        return done.wait(timeout) and ok[0]
    finally:
        client.disconnect()
        client.loop_stop()


def ensure_admin(state_dir: str | Path) -> bool:
    """The authority and the admin user of a state folder made before they existed (True: the admin user was added
    now, and a running broker must reload to know it)."""
    files = BrokerFiles.at(state_dir)
    cfg = BrokerConfig.load(files.config)
    with _locked(files):
        ensure_authority(files.state_dir)
        if files.credentials(ADMIN_USER).exists():
            return False
        _add_user(files, cfg, ADMIN_USER, "admin")
        _write_acl(files, cfg, [u for u, r in list_users(files.state_dir) if r == "observer"])
    return True


def publish_revocations(state_dir: str | Path, attempts: int = 6) -> str:
    """Publish the state folder's revocation list retained to its recorded running broker; what happened, in words
    (never raises for a broker that is down: the list also travels in kits and at the next start)."""
    files = BrokerFiles.at(state_dir)
    path = files.state_dir / REVOCATION_LIST
    if not path.exists():
        return "no revocation list yet"
    if recorded_process(files.state_dir) is None:
        return "no running broker recorded: the revocation list is published when it starts (and is in every kit)"
    try:
        creds = Credentials.load(files.credentials(ADMIN_USER))
    except CredentialsError as exc:
        return f"revocation list not published ({exc}); restart the broker ('flayer broker start') to publish it"
    payload, topic = path.read_bytes(), Topics(creds.federation).revocations()
    for i in range(attempts):  # a reload that adds the admin user takes a moment
        if _publish_once(creds, topic, payload, 5.0):
            return f"revocation list published retained on {topic} (devices receive it; no file to copy)"
        time.sleep(0.5 * (i + 1))
    return f"revocation list NOT published on {topic} (see the broker's log); it is in every new kit"
