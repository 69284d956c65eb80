"""The embedded broker: amqtt 0.12.1 (pure Python, MQTT 3.1.1) serving one state folder on loopback.

Run as a child process by :class:`mqtt_broker.process.EmbeddedBroker`::

    python -m mqtt_broker.embedded --state-dir DIR

It reads the same ``passwd`` (Mosquitto hashes) and ``acl`` files as Mosquitto and enforces them
through :mod:`mqtt_broker.acl`, with two amqtt plugins defined here. amqtt's own file-auth plugin
only takes argon2 hashes, and its ACL plugin has no ``%u`` patterns, so neither is used.
Both files are re-read when they change (checked on each connection / each check), and on SIGHUP,
so ``flayer broker add-device`` works without a restart, as with Mosquitto.

What it does not enforce is listed in docs/explanation/broker.md and in :data:`NOT_ENFORCED`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from amqtt.broker import Broker
from amqtt.contexts import Action
from amqtt.errors import MQTTError
from amqtt.mqtt.connack import NOT_AUTHORIZED, ConnackPacket
from amqtt.mqtt.protocol.broker_handler import BrokerProtocolHandler
from amqtt.plugins.base import BaseAuthPlugin, BaseTopicPlugin
from amqtt.session import Session

from mqtt_broker.acl import Acl, parse_acl, topic_matches
from mqtt_broker.config import BrokerConfig, is_loopback
from mqtt_broker.passwords import read_passwd, verify_password

log = logging.getLogger("mqtt_broker.embedded")

NOT_ENFORCED = (
    "max_packet_size (amqtt reads any packet up to MQTT's 256 MB; clients must check sizes themselves)",
    "max_inflight_messages / max_queued_messages / max_queued_bytes (amqtt's queues are unbounded)",
    "persistence (retained messages and sessions are lost when it stops)",
    "TLS and client certificates (not offered: loopback only)",
    "MQTT 5 (amqtt speaks MQTT 3.1.1 only)",
)


class _Watched:
    """A file re-parsed whenever its modification time or size changes (or on demand)."""

    def __init__(self, path: Path, parse: Any) -> None:
        self.path, self._parse = path, parse
        self._stamp: tuple[int, int, int] | None = None
        self.value: Any = None
        self.refresh()

    def refresh(self, force: bool = False) -> Any:
        st = self.path.stat()
        stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        if force or stamp != self._stamp:
            self.value = self._parse(self.path)
            self._stamp = stamp
            log.info("loaded %s", self.path.name)
        return self.value


class PasswdAuthPlugin(BaseAuthPlugin):
    """Username + password against the Mosquitto password file; the client id must equal the username."""

    @dataclass
    class Config:
        password_file: str = ""

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self.passwd = _Watched(Path(self.config.password_file), read_passwd)
        self.granted: dict[str, str] = {}  # username -> the hash its current session was admitted with

    async def authenticate(self, *, session: Session) -> bool | None:
        users = self.passwd.refresh()
        name = session.username
        if not name or session.password is None:
            log.info("refused a client without username/password (client id %r)", session.client_id)
            return False
        hashed = users.get(name)
        if hashed is None or not verify_password(session.password, hashed):
            log.info("refused %r: bad username or password", name)
            return False
        if session.client_id != name:
            log.info("refused %r: client id %r differs from the username", name, session.client_id)
            return False
        self.granted[name] = hashed
        return True


class AclTopicPlugin(BaseTopicPlugin):
    """Publish (write) and delivery (read) checks from the Mosquitto ACL file, Mosquitto's semantics."""

    @dataclass
    class Config:
        acl_file: str = ""

    def __init__(self, context: Any) -> None:
        super().__init__(context)
        self.acl = _Watched(Path(self.config.acl_file), lambda p: parse_acl(p.read_text()))

    async def topic_filtering(self, *, session: Session | None = None, topic: str | None = None,
                              action: Action | None = None) -> bool | None:
        if session is None or not topic:
            return False
        acl: Acl = self.acl.refresh()
        if action == Action.SUBSCRIBE:
            return acl.may_subscribe(topic)
        access = "write" if action == Action.PUBLISH else "read"
        allowed = acl.allows(session.username, session.client_id or "", topic, access)
        if not allowed and action == Action.PUBLISH:
            log.info("denied PUBLISH from %r to %s", session.username, topic)
        return allowed


class _SnapshotDict(dict):
    """A dict whose iteration walks a snapshot: amqtt iterates its subscriptions across awaits while
    other clients (un)subscribe, and a broadcast died on "dictionary changed size during iteration"."""

    def __iter__(self) -> Any:
        return iter(list(super().__iter__()))

    def items(self) -> Any:
        return list(super().items())

    def keys(self) -> Any:
        return list(super().keys())

    def values(self) -> Any:
        return list(super().values())


class FilteringBroker(Broker):
    """Five fixes over amqtt 0.12.1 (pinned), all found by reading its broker.py:

    - it deletes (clean session) or rewrites (persistent session) the existing session of a client
      id BEFORE authenticating the new CONNECT, so anyone could wipe or hijack a connected device's
      session by sending its client id: here the CONNECT is authenticated first;
    - it sends retained messages to a subscriber without the receive check, and on each connection
      re-sends retained messages matching ANY client's subscriptions: here each one is checked;
    - a PUBLISH to a ``$`` topic (or an invalid topic) ended the client's message loop while its
      connection stayed up, so every later PUBLISH was acknowledged and silently dropped: here such a
      message is dropped (logged) and the loop goes on;
    - a broadcast iterated the subscriptions across awaits and died when a client (un)subscribed
      meanwhile: here iteration walks a snapshot (:class:`_SnapshotDict`);
    - a changed or removed password did not end the open session of that user: here
      :meth:`cut_changed_credentials` (every second, and on SIGHUP) closes those connections, so a
      rotated device must reconnect with its new password.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._subscriptions: dict[str, list[tuple[Session, int]]] = _SnapshotDict(self._subscriptions)

    async def _handle_message_delivery(self, client_session: Session, handler: BrokerProtocolHandler,
                                       wait_deliver: asyncio.Future[Any]) -> bool:
        message = wait_deliver.result() if wait_deliver.done() and not wait_deliver.exception() else None
        topic = getattr(message, "topic", None)
        if topic is not None and (not topic or topic.startswith("$") or "#" in topic or "+" in topic):
            log.info("dropped a PUBLISH from %r to the invalid or reserved topic %r", client_session.username, topic)
            return True
        return bool(await super()._handle_message_delivery(client_session, handler, wait_deliver))

    async def cut_changed_credentials(self) -> list[str]:
        """Close the connections of users whose password changed or was removed since their session was
        admitted; returns their names."""
        auth = next((p for p in self.plugins_manager.plugins if isinstance(p, PasswdAuthPlugin)), None)
        if auth is None:
            return []
        users = auth.passwd.refresh()
        cut = []
        for session, handler in list(self._sessions.values()):
            name = session.username
            if name and users.get(name) != auth.granted.get(name) and session.transitions.state == "connected" \
                    and handler is not None and handler.writer is not None:
                log.info("closing the session of %r: its password changed", session.username)
                await handler.writer.close()
                cut.append(str(session.username))
        return cut

    async def _initialize_client_session(self, reader: Any, writer: Any, remote_address: str,
                                         remote_port: int) -> tuple[BrokerProtocolHandler, Session]:
        try:
            handler, incoming = await BrokerProtocolHandler.init_from_connect(reader, writer, self.plugins_manager)
        except MQTTError:
            await writer.close()
            raise
        if not await self._authenticate(incoming, None):
            await ConnackPacket.build(0, NOT_AUTHORIZED).to_stream(writer)
            await writer.close()
            raise MQTTError(f"refused CONNECT of client id {incoming.client_id!r} from {remote_address}:{remote_port}")
        # amqtt's own session bookkeeping, now for an authenticated client (whose id is its username)
        session = incoming
        if incoming.clean_session:
            await self._delete_session(incoming.client_id)
            session.parent = 0
        elif incoming.client_id in self._sessions:
            session = self._sessions[incoming.client_id][0]
            for attr in ("will_flag", "will_message", "will_topic", "will_qos", "keep_alive", "username", "password"):
                setattr(session, attr, getattr(incoming, attr))
            session.parent = 1
        else:
            session.parent = 0
        return handler, session

    async def _publish_retained_messages_for_subscription(self, subscription: tuple[str, int], session: Session) -> None:
        topic_filter, qos = subscription
        handler = self._get_handler(session)
        if handler is None:
            return
        tasks = []
        for topic, retained in list(self._retained_messages.items()):
            wanted = topic_matches(topic_filter, topic) and not (topic.startswith("$") and topic_filter[:1] in "+#")
            if wanted and await self._topic_filtering(session, topic=topic, action=Action.RECEIVE):
                tasks.append(asyncio.ensure_future(
                    handler.mqtt_publish(retained.topic, retained.data, min(qos, retained.qos or qos), retain=True)))
        if tasks:
            await asyncio.wait(tasks)


def amqtt_config(cfg: BrokerConfig, passwd: Path, acl: Path) -> dict[str, Any]:
    if not is_loopback(cfg.host):
        raise ValueError(f"the embedded broker listens on loopback only, not on {cfg.host!r}")
    return {
        "listeners": {"default": {"type": "tcp", "bind": f"{cfg.host}:{cfg.port}"}},
        "plugins": {
            f"{__name__}.PasswdAuthPlugin": {"password_file": str(passwd)},
            f"{__name__}.AclTopicPlugin": {"acl_file": str(acl)},
        },
    }


async def serve(state_dir: Path) -> None:
    from mqtt_broker.state import BrokerFiles

    files = BrokerFiles.at(state_dir)
    cfg = BrokerConfig.load(files.config)
    broker = FilteringBroker(amqtt_config(cfg, files.passwd, files.acl))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: _reload(broker))
    await broker.start()
    log.info("embedded broker (amqtt) for federation %s listening on %s:%d", cfg.federation, cfg.host, cfg.port)
    log.info("not enforced: %s", "; ".join(NOT_ENFORCED))

    async def watch_passwords() -> None:
        while not stop.is_set():
            await broker.cut_changed_credentials()
            await asyncio.sleep(1.0)

    watcher = asyncio.ensure_future(watch_passwords())
    await stop.wait()
    watcher.cancel()
    await asyncio.gather(watcher, return_exceptions=True)
    await broker.shutdown()
    log.info("embedded broker stopped")


def _reload(broker: FilteringBroker) -> None:
    for plugin in broker.plugins_manager.plugins:
        if isinstance(plugin, PasswdAuthPlugin):
            plugin.passwd.refresh(force=True)
        elif isinstance(plugin, AclTopicPlugin):
            plugin.acl.refresh(force=True)
    asyncio.ensure_future(broker.cut_changed_credentials())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mqtt_broker.embedded", description=__doc__.splitlines()[0])
    p.add_argument("--state-dir", required=True, type=Path)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("amqtt", "transitions"):  # amqtt logs packets at debug and every state change at info
        logging.getLogger(noisy).setLevel(logging.WARNING)
    asyncio.run(serve(args.state_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
