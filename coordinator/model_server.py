"""Serving a federation's model files (``[federation] models_dir``) with Debian's nginx.

:func:`nginx_config` writes the whole nginx configuration for one folder: GET and HEAD only, byte ranges
(nginx serves ``Range`` natively for static files), no directory listing, dotfiles (the coordinator's
temporary files) refused, an access log with the bytes each response sent (``$bytes_sent``), timeouts on
every connection, TLS when given a certificate and key, and -- given the broker state folder's
``models.htpasswd`` -- the federation's devices and coordinator only (HTTP basic authentication with the
token :mod:`transport.models_auth` derives from each one's broker password; anyone else gets 401). :class:`NginxServer` runs nginx in the foreground (``daemon off``)
as a child of this process with its own prefix folder (pid file, logs, temporary folders), waits until
it accepts connections, and stops it by its PID (SIGQUIT, then SIGTERM/SIGKILL): ``flayer models serve``,
the emulator's ``--http-models`` and the tests use it. nginx is not started by its Debian package here
(``make apt-http`` installs it through ``deploy/apt-no-start.sh``).
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from mqtt_broker.fsutil import free_port, listens

__all__ = ["NginxError", "NginxServer", "find_nginx", "nginx_config"]

LOG_FORMAT = '$remote_addr [$time_local] "$request" $status $bytes_sent $body_bytes_sent "$http_range"'


class NginxError(Exception):
    """nginx is missing, its configuration is refused or it did not start."""


def find_nginx() -> str | None:
    """The nginx binary (PATH, then /usr/sbin), or None."""
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)


def _quote(value: str | Path) -> str:
    text = str(value)
    if any(c in text for c in '"\\;{}\n\r\t') or not text:
        raise NginxError(f"path {text!r} cannot be written into an nginx configuration")
    return f'"{text}"'


def nginx_config(root: str | Path, prefix: str | Path, host: str, port: int, tls_cert: str | Path | None = None,
                 tls_key: str | Path | None = None, htpasswd: str | Path | None = None) -> str:
    """The nginx.conf serving ``root`` at ``http(s)://host:port/`` (module docstring)."""
    root, prefix = Path(root).resolve(), Path(prefix).resolve()
    if (tls_cert is None) != (tls_key is None):
        raise NginxError("TLS needs both a certificate and its key")
    if not 1 <= port <= 65535:
        raise NginxError(f"port must be in [1, 65535], got {port}")
    user = ""
    if os.geteuid() == 0:  # workers would run as nobody, who may not read a private folder: run them as us
        user = f"user {pwd.getpwuid(os.getuid()).pw_name} {grp.getgrgid(os.getgid()).gr_name};\n"
    listen = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    tls = ""
    if tls_cert is not None and tls_key is not None:
        listen += " ssl"
        tls = (f"        ssl_certificate {_quote(Path(tls_cert).resolve())};\n"
               f"        ssl_certificate_key {_quote(Path(tls_key).resolve())};\n"
               f"        ssl_protocols TLSv1.2 TLSv1.3;\n")
    tmp = prefix / "tmp"
    auth = ""
    if htpasswd is not None:  # read by nginx on every request: a user added or revoked counts at once
        auth = (f'            auth_basic "flayer models";\n'
                f"            auth_basic_user_file {_quote(Path(htpasswd).resolve())};\n")
    return f"""# written by flayer (coordinator.model_server): the model files of one federation
{user}daemon off;
master_process on;
worker_processes 1;
pid {_quote(prefix / 'nginx.pid')};
error_log {_quote(prefix / 'error.log')} warn;
events {{ worker_connections 1024; }}
http {{
    log_format flayer '{LOG_FORMAT}';
    access_log {_quote(prefix / 'access.log')} flayer;
    client_body_temp_path {_quote(tmp / 'body')};
    proxy_temp_path {_quote(tmp / 'proxy')};
    fastcgi_temp_path {_quote(tmp / 'fastcgi')};
    uwsgi_temp_path {_quote(tmp / 'uwsgi')};
    scgi_temp_path {_quote(tmp / 'scgi')};
    types {{ }}
    default_type application/octet-stream;
    sendfile on;
    server_tokens off;
    keepalive_timeout 30s;
    client_header_timeout 10s;
    client_body_timeout 10s;
    send_timeout 30s;
    server {{
        listen {listen};
{tls}        root {_quote(root)};
        autoindex off;
        location / {{
            limit_except GET {{ deny all; }}
{auth}            add_header Cache-Control "public, max-age=31536000, immutable";
        }}
        location ~ /\\. {{ deny all; }}
    }}
}}
"""


@dataclass
class NginxServer:
    """nginx serving ``root`` on ``host:port`` (0: a free port), its files under ``prefix``."""

    root: Path
    prefix: Path
    host: str = "127.0.0.1"
    port: int = 0
    tls_cert: Path | None = None
    tls_key: Path | None = None
    htpasswd: Path | None = None  # the broker state folder's models.htpasswd: who may fetch (None: anyone)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        scheme = "https" if self.tls_cert is not None else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}/"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def access_log(self) -> Path:
        return Path(self.prefix) / "access.log"

    def start(self, timeout: float = 15.0) -> NginxServer:
        binary = find_nginx()
        if binary is None:
            raise NginxError("nginx is not installed (Debian: apt-get install nginx, or make apt-http)")
        self.root, self.prefix = Path(self.root).resolve(), Path(self.prefix).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (self.prefix / "tmp" / sub).mkdir(parents=True, exist_ok=True)
        attempts = 3 if self.port == 0 else 1
        fixed = self.port
        for attempt in range(attempts):
            self.port = fixed or free_port(self.host)
            conf = self.prefix / "nginx.conf"
            conf.write_text(nginx_config(self.root, self.prefix, self.host, self.port, self.tls_cert, self.tls_key,
                                         self.htpasswd))
            err = self.prefix / "error.log"
            check = subprocess.run([binary, "-t", "-q", "-p", str(self.prefix), "-c", str(conf), "-e", str(err)],
                                   capture_output=True, text=True)
            if check.returncode != 0:
                raise NginxError(f"nginx refused {conf}: {(check.stderr or check.stdout).strip()[-800:]}")
            self.proc = subprocess.Popen([binary, "-p", str(self.prefix), "-c", str(conf), "-e", str(err)],
                                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=open(self.prefix / "nginx.stderr", "ab"), start_new_session=True)
            if self._wait_ready(timeout):
                return self
            self.stop()
            if attempt == attempts - 1:
                tail = err.read_text(errors="replace")[-800:] if err.exists() else ""
                raise NginxError(f"nginx did not start on {self.host}:{self.port}: {tail.strip()}")
        raise AssertionError("unreachable")

    def _wait_ready(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc is None or self.proc.poll() is not None:
                return False
            if listens(self.proc.pid, self.host, self.port, connect=True):  # nginx's master holds the port
                return True
            time.sleep(0.05)
        return False

    def stop(self, timeout: float = 10.0) -> int | None:
        """Stop nginx by its PID: SIGQUIT (finish the responses under way), then SIGTERM, then SIGKILL."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        for sig, wait in ((signal.SIGQUIT, timeout), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            if proc.poll() is not None:
                break
            try:
                proc.send_signal(sig)
                proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                break
        return proc.returncode

    def __enter__(self) -> NginxServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
