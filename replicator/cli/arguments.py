"""argparse types shared by the subcommands, and the parser that reports a bad flag in one line.

Each type turns a flag's text into its value or raises ``argparse.ArgumentTypeError`` with
``"VALUE: what is expected"``; the parser prefixes the command and the flag, so a bad value reads
``mtc status: --ca /x/ca.pem: no such file`` and exits 2. Files and directories that the command
would open later anyway are checked here, before anything is created or started.
"""

import argparse
import logging
import math
import os
import re
import socket
import ssl
import stat
import sys
import urllib.parse
from collections.abc import Callable
from typing import NoReturn, TypeVar

from csi_driver.quantity import parse_quantity
from csi_driver.server import socket_path
from replicator.backup_tier.filesystem import FileObjects
from replicator.backup_tier.object_store import bucket_and_prefix
from replicator.wire import redundancy, tls
from replicator.wire.messages import JobRef

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

# argparse's "argument --ca: /x: no such file" -> "--ca /x: no such file", and its "argument --replicas:
# invalid choice: 3 (choose from 1, 2)" -> "--replicas 3: not one of 1, 2".
_REWRITES = (
    (re.compile(r"^argument (\S+): invalid choice: (.*) \(choose from (.*)\)$"), r"\1 \2: not one of \3"),
    (re.compile(r"^argument (\S+): "), r"\1 "),
)


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr, ``PROG: --flag VALUE: why``, exit 2
    (the usage itself is what ``-h`` prints). Its subparsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        for pattern, replacement in _REWRITES:
            message = pattern.sub(replacement, message, count=1)
        self.exit(2, f"{self.prog}: {message}\n")


def _refuse(text: str, expected: str) -> argparse.ArgumentTypeError:
    shown = text if text and text.isprintable() and not any(c.isspace() for c in text) else repr(text)
    return argparse.ArgumentTypeError(f"{shown}: {expected}")


def non_empty(text: str) -> str:
    """Any text but the empty one (names, paths that need not exist yet)."""
    if not text:
        raise _refuse(text, "must not be empty")
    return text


def key_value(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise _refuse(text, "not KEY=VALUE")
    return key, value


def quantity(text: str) -> int:
    """A Kubernetes quantity above zero, in bytes (``512Mi``, ``2Gi``, ``1e9``)."""
    try:
        value = parse_quantity(text)
    except ValueError:
        raise _refuse(text, "not a Kubernetes quantity (e.g. 512Mi, 2Gi, 1e9)") from None
    if value <= 0:
        raise _refuse(text, "must be above zero")
    return value


_Number = TypeVar("_Number", int, float)


def _number(text: str, kind: Callable[[str], _Number], at_least: float, above: bool, expected: str) -> _Number:
    try:
        value = kind(text)
    except ValueError:
        raise _refuse(text, f"not {expected}") from None
    if not math.isfinite(value) or not (value > at_least if above else value >= at_least):
        raise _refuse(text, f"not {expected}")
    return value


def positive_float(text: str) -> float:
    return _number(text, float, 0.0, True, "a positive number")


def non_negative_float(text: str) -> float:
    return _number(text, float, 0.0, False, "a number of at least 0")


def redundancy_setting(text: str) -> str:
    """``replicas``, ``xor:N`` or ``rs:N:K`` (``replicator.wire.redundancy``), as given."""
    try:
        return str(redundancy.parse(text))
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def positive_int(text: str) -> int:
    return _number(text, int, 0, True, "a whole number of at least 1")


def non_negative_int(text: str) -> int:
    return _number(text, int, 0, False, "a whole number of at least 0")


def log_level(text: str) -> int:
    """A logging level by name, in any case (``debug``, ``INFO``)."""
    if text.lower() not in LOG_LEVELS:
        raise _refuse(text, f"not a log level ({', '.join(LOG_LEVELS)})")
    return logging.getLevelName(text.upper())


def job_ref(text: str) -> JobRef:
    try:
        return JobRef.parse(text)
    except ValueError:
        raise _refuse(text, "not NAMESPACE/JOB (e.g. default/llama)") from None


def listen_address(text: str) -> str:
    """``HOST:PORT`` to listen on (``0.0.0.0:8471``; an empty host listens on every address)."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) <= 65535 or any(c.isspace() or c in "/@" for c in host):
        raise _refuse(text, "not HOST:PORT (e.g. 0.0.0.0:8471, a port from 1 to 65535)")
    if host:  # the lookup the server makes before it binds, made here so that the error names the flag
        try:
            socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        except OSError as err:
            raise _refuse(text, f"no such host ({err.strerror or err})") from None
    return text


def http_url(text: str) -> str:
    """An ``http://`` or ``https://`` URL with a host (and an optional port and path)."""
    try:
        parts = urllib.parse.urlsplit(text)
        _ = parts.port  # a port that is not a number from 0 to 65535 raises ValueError
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise _refuse(text, "not an http:// or https:// URL (e.g. https://mtc-coordinator.mtc-system:8471)")
    return text


def backup_url(text: str) -> str:
    """The backup tier's URL, checked as its backend will read it (no store is opened)."""
    scheme = text.partition("://")[0]
    try:
        if scheme == "file":
            FileObjects.from_url(text)
        elif scheme in ("gs", "s3"):
            bucket_and_prefix(text, scheme)
        else:
            raise ValueError(text)
    except ValueError:
        raise _refuse(text, "not gs://BUCKET[/PREFIX], s3://BUCKET[/PREFIX] or file:///ABSOLUTE/PATH") from None
    return text


def csi_endpoint(text: str) -> str:
    """``unix:///path/csi.sock``, the socket the node agent serves (it creates the socket)."""
    try:
        socket_path(text)
    except ValueError:
        raise _refuse(text, "not unix:///ABSOLUTE/PATH (e.g. unix:///csi/csi.sock)") from None
    return text


def csi_socket(text: str) -> str:
    """A ``unix:///path`` CSI endpoint whose socket exists (a node agent serves it)."""
    path = socket_path(csi_endpoint(text))
    mode = _stat(text, path, "socket")
    if not stat.S_ISSOCK(mode):
        raise _refuse(text, "not a socket")
    return text


def _stat(text: str, path: str, what: str) -> int:
    try:
        return os.stat(path).st_mode
    except FileNotFoundError:
        raise _refuse(text, f"no such {what}") from None
    except OSError as err:
        raise _refuse(text, err.strerror or str(err)) from None


def readable_file(text: str) -> str:
    """A regular file this process can read (a Secret's mounted key, a PEM file, a kubeconfig)."""
    if not stat.S_ISREG(_stat(text, text, "file")):
        raise _refuse(text, "not a regular file")
    try:
        with open(text, "rb"):
            pass
    except OSError as err:
        raise _refuse(text, err.strerror or str(err)) from None
    return text


def token_file(text: str) -> str:
    """A readable file holding a token (white space around it is not part of it)."""
    with open(readable_file(text), "rb") as f:
        if not f.read().strip():
            raise _refuse(text, "empty (expected the cluster token)")
    return text


def ca_bundle(text: str) -> str:
    """A readable PEM file of CA certificates."""
    try:
        ssl.create_default_context(cafile=readable_file(text))
    except ssl.SSLError as err:
        raise _refuse(text, f"not a PEM CA bundle ({err.reason or err})") from None
    return text


def existing_directory(text: str) -> str:
    if not stat.S_ISDIR(_stat(text, text, "directory")):
        raise _refuse(text, "not a directory")
    return text


def directory(text: str) -> str:
    """A directory the command may create: it must not be something else already."""
    if os.path.lexists(non_empty(text)) and not os.path.isdir(text):
        raise _refuse(text, "not a directory")
    return text


def server_pair_error(cert: str | None, key: str | None, cert_flag: str, key_flag: str) -> str | None:
    """Why a serving certificate and its key (PEM files, given as ``cert_flag`` and ``key_flag``) cannot be
    used: given apart, or not loadable as a pair; None when both or neither load."""
    try:
        tls.check_pair(cert, key, f"{cert_flag} and {key_flag}")
        tls.server_context(cert, key)
    except ValueError as err:
        return str(err)
    except OSError as err:  # ssl.SSLError is one; its reason, when it has one, says more than "PEM lib"
        reason = getattr(err, "reason", None)
        return f"{cert_flag} {cert} and {key_flag} {key}: not a PEM certificate and its key" + (
            f" ({reason})" if reason else ""
        )
    return None


def usage_error(command: str, message: str) -> int:
    """Reports flags that do not go together the way ``Parser`` reports a bad one; returns exit code 2."""
    print(f"mtc {command}: {message}", file=sys.stderr)
    return 2
