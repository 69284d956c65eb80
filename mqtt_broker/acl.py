"""The broker's ACL file: rendered from :func:`protocol.topics.acl_rules`, parsed back, and evaluated
with Mosquitto 2.0's semantics (the embedded broker enforces the same file through this module).

Mosquitto's ``acl_file`` semantics, as implemented in 2.0.11:

- ``user NAME`` starts a block; ``topic ACCESS T`` lines apply to that user only.
- ``pattern ACCESS T`` lines apply to EVERY authenticated client, wherever they appear, with the
  levels ``%u``/``%c`` replaced by the client's username/client id. So the coordinator also holds
  the device rights for its own name (it may write ``update/<coordinator>/...``): harmless, and the
  reason a device may never be named like the coordinator user.
- ACCESS is ``read`` (receive messages), ``write`` (publish), ``readwrite`` or ``deny``; deny
  lines are checked first. A client whose username or id holds ``+`` or ``#`` gets no pattern rights.
- Subscriptions are always granted (SUBACK success); what a client may read is enforced message by
  message on delivery, retained messages included. A device subscribing to ``fl/<fed>/#`` thus gets
  a successful SUBACK and only the messages it may read.
- ``$``-topics are matched only by rules that start with ``$``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from protocol.topics import ADMIN_USER, OBSERVER_USER, acl_rules

__all__ = ["ACCESS_BITS", "Acl", "AclError", "parse_acl", "render_acl", "topic_matches"]

READ, WRITE = 1, 2
ACCESS_BITS = {"read": READ, "write": WRITE, "readwrite": READ | WRITE, "deny": 0}
_ACCESS_NAMES = {v: k for k, v in ACCESS_BITS.items()}


class AclError(ValueError):
    """The ACL file is malformed."""


def render_acl(federation: str, coordinator_user: str, observers: Sequence[str] = (OBSERVER_USER,)) -> str:
    """Mosquitto ACL text for one federation: device rules as patterns, the coordinator's rules under its
    user, and a block per read-only observer user (each denied its own names: see acl_rules).

    A pattern granted both read and write is written once as ``readwrite``; a deny stays a deny."""
    lines = [
        f"# Access rules of federation {federation!r}, generated from protocol.topics.acl_rules.",
        "# Regenerated on every 'flayer broker start': change acl_rules, not this file.",
        "# 'pattern' lines apply to every authenticated client (%u = its username); devices are",
        "# users whose name is their device id. 'topic' lines apply to the user above them.",
        "",
    ]
    blocks: list[tuple[str, str]] = [("coordinator", coordinator_user), ("admin", ADMIN_USER)] + \
        [("observer", o) for o in observers]
    for i, (role, user) in enumerate(blocks):
        merged: dict[tuple[str, str], int] = {}
        for who, access, pattern in acl_rules(federation, coordinator_user, user if role == "observer"
                                              else OBSERVER_USER):
            if who not in ("coordinator", "admin", "observer", "device") or access not in ("read", "write", "deny"):
                raise AclError(f"acl_rules returned an unknown rule {(who, access, pattern)!r}")
            if access == "deny" and who == "device":
                raise AclError(f"a deny pattern would apply to every user: {pattern!r}")
            merged[(who, pattern)] = 0 if access == "deny" else merged.get((who, pattern), 0) | ACCESS_BITS[access]
        if i == 0:
            lines += [f"pattern {_ACCESS_NAMES[bits]} {pattern}" for (who, pattern), bits in merged.items()
                      if who == "device"]
        lines += ["", f"user {user}"]
        lines += [f"topic {_ACCESS_NAMES[bits]} {pattern}" for (w, pattern), bits in merged.items() if w == role]
    return "\n".join(lines) + "\n"


def _check_filter(topic: str, lineno: int) -> str:
    levels = topic.split("/")
    for i, level in enumerate(levels):
        if ("#" in level and (level != "#" or i != len(levels) - 1)) or ("+" in level and level != "+"):
            raise AclError(f"line {lineno}: invalid topic filter {topic!r}")
    if not topic or "\x00" in topic:
        raise AclError(f"line {lineno}: empty or invalid topic")
    return topic


@dataclass(frozen=True)
class Acl:
    """A parsed ACL file: per-user rules and global patterns, each ``(access bits, topic filter)``."""

    users: dict[str, tuple[tuple[int, str], ...]] = field(default_factory=dict)
    patterns: tuple[tuple[int, str], ...] = ()

    def allows(self, username: str | None, client_id: str, topic: str, access: str) -> bool:
        """Whether a client may ``read`` (receive) or ``write`` (publish) ``topic`` (a concrete topic).

        Mirrors Mosquitto 2.0.11's default ACL check, including deny-first ordering."""
        want = {"read": READ, "write": WRITE}.get(access)
        if want is None:
            raise ValueError(f"access must be 'read' or 'write', got {access!r}")
        if username is not None:
            verdict = _scan(self.users.get(username, ()), topic, want)
            if verdict is not None:
                return verdict
        if not self.patterns:
            return False
        if (username and any(c in username for c in "+#")) or any(c in client_id for c in "+#"):
            return False
        for bits, pattern in sorted(self.patterns, key=lambda r: r[0] != 0):
            if "%u" in pattern.split("/") and username is None:
                continue
            concrete = "/".join(
                (username or "") if lvl == "%u" else client_id if lvl == "%c" else lvl for lvl in pattern.split("/")
            )
            if _matches_rule(concrete, topic):
                if bits == 0:
                    return False
                if bits & want:
                    return True
        return False

    @staticmethod
    def may_subscribe(topic_filter: str) -> bool:
        """Mosquitto 2.0.11's default ACL grants every well-formed subscription (reads are checked later)."""
        try:
            _check_filter(topic_filter, 0)
        except AclError:
            return False
        return True


def _matches_rule(rule: str, topic: str) -> bool:
    if topic.startswith("$") and not rule.startswith("$"):
        return False
    return topic_matches(rule, topic)


def _scan(rules: tuple[tuple[int, str], ...], topic: str, want: int) -> bool | None:
    for bits, rule in sorted(rules, key=lambda r: r[0] != 0):
        if _matches_rule(rule, topic):
            if bits == 0:
                return False
            if bits & want:
                return True
    return None


def topic_matches(topic_filter: str, topic: str) -> bool:
    """MQTT topic-filter matching (``+`` one level, ``#`` the rest, including the parent level)."""
    f_levels = topic_filter.split("/")
    t_levels = topic.split("/")
    for i, lvl in enumerate(f_levels):
        if lvl == "#":
            return True
        if i >= len(t_levels):
            return False
        if lvl != "+" and lvl != t_levels[i]:
            return False
    return len(f_levels) == len(t_levels)


def parse_acl(text: str) -> Acl:
    """Parse the subset of Mosquitto's ACL syntax that :func:`render_acl` writes (user/topic/pattern)."""
    users: dict[str, list[tuple[int, str]]] = {}
    patterns: list[tuple[int, str]] = []
    user: str | None = None
    anonymous: list[tuple[int, str]] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not line or line.lstrip().startswith("#"):
            continue
        keyword, _, rest = line.strip().partition(" ")
        rest = rest.strip()
        if keyword == "user":
            if not rest or " " in rest:
                raise AclError(f"line {lineno}: 'user' needs exactly one name")
            user = rest
            users.setdefault(user, [])
            continue
        if keyword not in ("topic", "pattern"):
            raise AclError(f"line {lineno}: unknown keyword {keyword!r}")
        access, _, topic = rest.partition(" ")
        if not topic:
            access, topic = "readwrite", access
        if access not in ACCESS_BITS:
            raise AclError(f"line {lineno}: unknown access {access!r}")
        rule = (ACCESS_BITS[access], _check_filter(topic.strip(), lineno))
        if keyword == "pattern":
            patterns.append(rule)
        elif user is None:
            anonymous.append(rule)
        else:
            users[user].append(rule)
    if anonymous:
        raise AclError("topic rules before any 'user' line (anonymous access) are not used by FLAYER Edge")
    return Acl({u: tuple(r) for u, r in users.items()}, tuple(patterns))
