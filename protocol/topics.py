"""Every MQTT topic string of the federation, built and parsed in one place.

Layout (prefix ``fl/<federation>/``):

==========================================  ========================  ================================
topic                                       written by                 read by
==========================================  ========================  ================================
``round``                 (retained)        coordinator                devices
``model/<digest>/<i>``    (retained)        coordinator                devices
``update/<client>/<round>/<i>``             that client                coordinator
``ack/<client>``                            coordinator                that client
``status/<client>``       (retained, will)  that client                coordinator
``metrics/<client>``                        that client                coordinator
``secagg/<client>``                         that client                coordinator
``secreq/<client>``                         coordinator                that client
``revocations``           (retained)        the admin user             devices, coordinator
==========================================  ========================  ================================

``revocations`` carries the authority's signed, versioned revocation list, which only the admin user
(:data:`ADMIN_USER`, the admin's tooling ``flayer broker revoke|rekey``) may publish; it is checked against the
authority key a device's kit pins, so whoever relays it cannot forge it. A device's certificate
(:mod:`protocol.certs`: the federation's authority vouches for its signing key) has no topic of its own: it rides in
the device's secure-round key adverts on ``secagg/<client>`` and the coordinator relays it with them.

``secagg/<client>`` and ``secreq/<client>`` carry a secure round's protocol messages (keys, encrypted
shares, unmasking: :mod:`flayer.secagg`): a device writes only its own ``secagg/`` and reads only its own
``secreq/``, so the shares the coordinator relays reach only the device they are sealed for.

``model/<digest>/<i>`` also carries the delta to the current model when the coordinator offers one
(:mod:`protocol.model_delta`): a blob named by its digest like a model's, under the same ACL.

The read-only ``observer`` user (``flayer status``, ``flayer dashboard``) reads ``round``,
``status/+`` and ``metrics/+`` and nothing else, and may publish nothing.

Federation and client ids are 1-64 characters of ``[A-Za-z0-9_-]`` (no MQTT wildcards or
separators), digests are lowercase hex. Broker ACLs (``mqtt_broker``) are generated from
:func:`acl_rules`, so the topics and the access rules cannot drift apart.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "ADMIN_USER",
    "OBSERVER_USER",
    "ROOT",
    "ParsedTopic",
    "TopicError",
    "Topics",
    "acl_rules",
    "validate_id",
]

ROOT = "fl"
OBSERVER_USER = "observer"  # the read-only user of status and dashboard; no device may take this name
ADMIN_USER = "flayer-admin"  # the admin's tooling: publishes the signed revocation list; no device may take this name
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_DIGEST = re.compile(r"[0-9a-f]{8,128}")


class TopicError(ValueError):
    """A topic or an id in it is malformed."""


def validate_id(value: str, what: str = "id") -> str:
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise TopicError(f"{what} {value!r} must be 1-64 characters of letters, digits, '_' or '-'")
    return value


@dataclass(frozen=True)
class ParsedTopic:
    kind: str  # round | revocations | model | update | ack | status | metrics | secagg | secreq | cert
    client: str | None = None
    digest: str | None = None
    round: int | None = None
    chunk: int | None = None


@dataclass(frozen=True)
class Topics:
    """Topic builders for one federation."""

    federation: str

    def __post_init__(self) -> None:
        validate_id(self.federation, "federation id")

    @property
    def prefix(self) -> str:
        return f"{ROOT}/{self.federation}"

    # ---- coordinator -> devices
    def round(self) -> str:
        return f"{self.prefix}/round"

    def model_chunk(self, digest: str, index: int) -> str:
        if not _DIGEST.fullmatch(digest) or index < 0:
            raise TopicError(f"bad model digest {digest!r} or chunk index {index}")
        return f"{self.prefix}/model/{digest}/{index}"

    def model_filter(self, digest: str) -> str:
        if not _DIGEST.fullmatch(digest):
            raise TopicError(f"bad model digest {digest!r}")
        return f"{self.prefix}/model/{digest}/+"

    def ack(self, client: str) -> str:
        return f"{self.prefix}/ack/{validate_id(client, 'client id')}"

    def secreq(self, client: str) -> str:
        """A secure round's messages to one device (its key bundle, its shares, the unmask request)."""
        return f"{self.prefix}/secreq/{validate_id(client, 'client id')}"

    def secagg(self, client: str) -> str:
        """A device's secure-round messages to the coordinator (keys, shares, unmasking shares)."""
        return f"{self.prefix}/secagg/{validate_id(client, 'client id')}"

    def all_secagg(self) -> str:
        return f"{self.prefix}/secagg/+"

    # ---- devices -> coordinator
    def update_chunk(self, client: str, round_: int, index: int) -> str:
        if round_ < 0 or index < 0:
            raise TopicError(f"bad round {round_} or chunk index {index}")
        return f"{self.prefix}/update/{validate_id(client, 'client id')}/{round_}/{index}"

    def status(self, client: str) -> str:
        return f"{self.prefix}/status/{validate_id(client, 'client id')}"

    def metrics(self, client: str) -> str:
        return f"{self.prefix}/metrics/{validate_id(client, 'client id')}"

    # ---- subscriptions of the coordinator
    def all_updates(self) -> str:
        return f"{self.prefix}/update/+/+/+"

    def revocations(self) -> str:
        """Retained: the authority's signed revocation list (written by the admin user only)."""
        return f"{self.prefix}/revocations"

    def all_status(self) -> str:
        return f"{self.prefix}/status/+"

    def all_metrics(self) -> str:
        return f"{self.prefix}/metrics/+"

    def parse(self, topic: str) -> ParsedTopic:
        """Inverse of the builders; raises TopicError for anything else."""
        head = self.prefix + "/"
        if not topic.startswith(head):
            raise TopicError(f"topic {topic!r} is not under {head}")
        parts = topic[len(head):].split("/")
        try:
            if parts == ["round"] or parts == ["revocations"]:
                return ParsedTopic(parts[0])
            if parts[0] == "model" and len(parts) == 3 and _DIGEST.fullmatch(parts[1]):
                return ParsedTopic("model", digest=parts[1], chunk=_nonneg(parts[2]))
            if parts[0] == "update" and len(parts) == 4:
                return ParsedTopic("update", client=validate_id(parts[1], "client id"), round=_nonneg(parts[2]),
                                   chunk=_nonneg(parts[3]))
            if parts[0] in ("ack", "status", "metrics", "secagg", "secreq") and len(parts) == 2:
                return ParsedTopic(parts[0], client=validate_id(parts[1], "client id"))
        except ValueError as exc:
            raise TopicError(f"malformed topic {topic!r}: {exc}") from exc
        raise TopicError(f"unknown topic {topic!r}")


def _nonneg(text: str) -> int:
    if not text.isdigit() or len(text) > 12:
        raise ValueError(f"{text!r} is not a non-negative integer")
    return int(text)


def acl_rules(federation: str, coordinator_user: str,
              observer_user: str = OBSERVER_USER) -> list[tuple[str, str, str]]:
    """Access rules as (who, access, topic pattern): ``who`` is ``coordinator``, ``observer`` or ``device``
    (device patterns use Mosquitto's ``%u`` = the connecting username); access is read|write|deny.

    Mosquitto applies the device patterns to every user, so the observer's rules deny what those patterns
    would give it under its own name (and the model, which devices read); deny rules win over the rest."""
    t = Topics(federation)
    validate_id(coordinator_user, "coordinator user")
    validate_id(observer_user, "observer user")
    p = t.prefix
    return [
        ("coordinator", "write", f"{p}/round"),
        ("coordinator", "write", f"{p}/model/#"),
        ("coordinator", "write", f"{p}/ack/#"),
        ("coordinator", "read", f"{p}/update/#"),
        ("coordinator", "write", f"{p}/update/#"),  # only to empty what a device left retained there
        ("coordinator", "read", f"{p}/status/#"),
        ("coordinator", "read", f"{p}/metrics/#"),
        ("coordinator", "write", f"{p}/metrics/#"),  # (same)
        ("coordinator", "write", f"{p}/secreq/#"),
        ("coordinator", "read", f"{p}/secagg/#"),
        ("coordinator", "write", f"{p}/secagg/#"),  # (same as update/: only to empty a retained message)
        ("observer", "read", f"{p}/round"),
        ("observer", "read", f"{p}/status/#"),
        ("observer", "read", f"{p}/metrics/#"),
        ("observer", "deny", f"{p}/model/#"),
        ("observer", "deny", f"{p}/update/#"),
        ("observer", "deny", f"{p}/ack/#"),
        ("observer", "deny", f"{p}/secagg/#"),
        ("observer", "deny", f"{p}/secreq/#"),
        ("observer", "deny", f"{p}/status/{observer_user}"),
        ("observer", "deny", f"{p}/metrics/{observer_user}"),
        ("admin", "write", f"{p}/revocations"),
        ("admin", "read", f"{p}/revocations"),
        ("device", "read", f"{p}/round"),
        ("device", "read", f"{p}/revocations"),
        ("device", "read", f"{p}/model/#"),
        ("device", "read", f"{p}/ack/%u"),
        ("device", "read", f"{p}/secreq/%u"),
        ("device", "write", f"{p}/secagg/%u"),
        ("device", "write", f"{p}/update/%u/#"),
        ("device", "write", f"{p}/status/%u"),
        ("device", "write", f"{p}/metrics/%u"),
    ]
