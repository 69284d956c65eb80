"""Small file, executable and port helpers: private folders, atomic 0600 writes, free ports, who listens."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

from flayer.files import atomic_write, private_dir  # the one place state is written (0700 / 0600)

__all__ = ["atomic_write", "find_executable", "free_port", "holds_listener", "listens", "open_files_limit",
           "port_in_use", "private_dir"]

# Debian installs mosquitto in /usr/sbin, which is not on a normal user's PATH.
_EXTRA_BIN_DIRS = ("/usr/sbin", "/usr/local/sbin", "/sbin", "/opt/homebrew/sbin", "/usr/local/opt/mosquitto/sbin")


def find_executable(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for folder in _EXTRA_BIN_DIRS:
        candidate = Path(folder) / name
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def open_files_limit(needed: int) -> tuple[int, int]:
    """Raise this process's soft open-file limit to ``needed`` when the hard limit allows (a child it starts
    inherits it); returns (soft, hard) as they are then."""
    try:
        import resource
    except ImportError:  # not POSIX: no limit to raise
        return needed, needed
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        want = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    big = 1 << 62
    return (big if soft == resource.RLIM_INFINITY else soft), (big if hard == resource.RLIM_INFINITY else hard)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port the OS reports free on ``host`` now (it may be taken again before use)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    """True when binding ``host:port`` fails (someone listens there)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as brokers do: TIME_WAIT is no obstacle
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _listening_inodes(pid: int, port: int) -> set[str]:
    """The inodes of the TCP sockets listening on ``port`` in ``pid``'s network namespace (Linux's
    ``/proc/<pid>/net/tcp{,6}``; none where those tables cannot be read)."""
    found: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # sl local_address rem_address st ... inode: state 0A is LISTEN, the port is hex after the colon
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                found.add(fields[9])
    return found


def holds_listener(pid: int, port: int) -> bool | None:
    """True when process ``pid`` itself holds a socket listening on TCP ``port``; False when it does not
    (another process may: a port picked free can be taken by someone else before the child binds it, and a
    connection test alone then greets the wrong server); None where /proc cannot tell (not Linux)."""
    if not Path("/proc/self/net/tcp").exists():
        return None
    inodes = _listening_inodes(pid, port)
    if not inodes:  # none listening, or the process is gone
        return False
    wanted = {f"socket:[{inode}]" for inode in inodes}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in wanted:
                return True
        except OSError:
            continue
    return False


def listens(pid: int, host: str, port: int, connect: bool) -> bool:
    """Whether process ``pid`` listens on ``port``: from /proc where it tells, else by a connection
    (``connect``) or a bind probe."""
    held = holds_listener(pid, port)
    if held is not None:
        return held
    if not connect:
        return port_in_use(host, port)
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False
