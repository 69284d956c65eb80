"""``mosquitto.conf`` for one federation (Mosquitto 2.0 syntax). Secrets never appear in it:
it names the password file (hashes only) and the key files."""

from __future__ import annotations

import getpass
import os
import pwd
from pathlib import Path

from mqtt_broker.config import BrokerConfig

__all__ = ["render_mosquitto_conf"]

AUTOSAVE_INTERVAL_S = 300
CLIENT_EXPIRATION = "7d"


def _run_as_user() -> str | None:
    """Mosquitto started as root drops to the user 'mosquitto', which could not read our 0600 files;
    naming the current user keeps it as the owner of the state folder (no effect for non-root)."""
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        try:
            return getpass.getuser()
        except OSError:
            return None


def _listener_auth(passwd: Path, acl: Path, max_connections: int) -> list[str]:
    return [
        # past this many, a connection is closed at accept: a stranger's idle sockets cannot take the descriptors
        # the broker needs (the process may open BrokerConfig.open_files_needed; mqtt_broker.config)
        f"max_connections {max_connections}",
        "allow_anonymous false",
        f"password_file {passwd}",
        f"acl_file {acl}",
        # the client id is replaced by the username: one device cannot take over another's session
        "use_username_as_clientid true",
    ]


def render_mosquitto_conf(cfg: BrokerConfig, state_dir: Path, passwd: Path, acl: Path,
                          tls: tuple[Path, Path, Path] | None, include_dir: Path | None = None,
                          crl: Path | None = None) -> str:
    """``tls`` is (ca cert, server cert, server key) when the TLS listener is on; ``crl`` the federation's
    revocation list (:mod:`mqtt_broker.crl`), named when client certificates are required; ``include_dir`` a folder of
    further ``.conf`` files read last (a field gateway's bridge, :mod:`mqtt_broker.bridge`: it holds the
    bridge's password, which must not be in this file)."""
    user = _run_as_user()
    lines = [
        f"# Mosquitto configuration of federation {cfg.federation!r}, written by FLAYER Edge (mqtt_broker).",
        "# Regenerated on every 'flayer broker start' from broker.json: edit that (or the flags), not this file.",
        "per_listener_settings true",
    ]
    if user:
        lines.append(f"user {user}")
    lines += [
        "",
        "# Limits (see docs/explanation/broker.md): clients check payload sizes against max_packet_size before",
        "# publishing; queues must hold every retained model chunk and bursts of update chunks.",
        f"max_packet_size {cfg.max_packet_size}",
        f"max_inflight_messages {cfg.max_inflight_messages}",
        f"max_queued_messages {cfg.max_queued_messages}",
        f"max_queued_bytes {cfg.max_queued_bytes}",
        f"persistent_client_expiration {CLIENT_EXPIRATION}",
        "set_tcp_nodelay true",
        "",
        f"persistence {'true' if cfg.persistence else 'false'}",
    ]
    if cfg.persistence:
        lines += [f"persistence_location {state_dir / 'data'}/", "persistence_file mosquitto.db",
                  f"autosave_interval {AUTOSAVE_INTERVAL_S}"]
    lines += [
        "",
        "log_dest stderr",
        "log_type error",
        "log_type warning",
        "log_type notice",
        "log_type information",
        "connection_messages true",
        "log_timestamp true",
        "log_timestamp_format %Y-%m-%dT%H:%M:%S",
    ]
    if cfg.plain:  # with TLS on: loopback unless insecure_plain (BrokerConfig.plain_host)
        lines += ["", f"listener {cfg.port} {cfg.plain_host}", "protocol mqtt",
                  *_listener_auth(passwd, acl, cfg.connection_limit)]
    if tls is not None:
        ca, cert, key = tls
        lines += [
            "",
            f"listener {cfg.tls_port} {cfg.tls_bind_host}",
            "protocol mqtt",
            *_listener_auth(passwd, acl, cfg.connection_limit),
            f"cafile {ca}",
            f"certfile {cert}",
            f"keyfile {key}",
            "tls_version tlsv1.2",
            f"require_certificate {'true' if cfg.require_certificate else 'false'}",
        ]
        if cfg.require_certificate and crl is not None:
            # a revoked or replaced certificate fails the handshake; reloaded on SIGHUP (mqtt_broker.crl)
            lines.append(f"crlfile {crl}")
        if cfg.use_identity_as_username:
            # the certificate's CN becomes the username (and so the client id); no password is asked
            lines.append("use_identity_as_username true")
    if include_dir is not None:
        lines += ["", "# the bridge to the central broker (mode 0600: it holds the gateway's password)",
                  f"include_dir {include_dir}"]
    return "\n".join(lines) + "\n"
