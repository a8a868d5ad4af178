"""The `serve` command: `mkdocs serve` on the project's environment, its mistakes said at once.

A bad or taken address, or an option `mkdocs serve` does not know, is said in one line (exit 2)
before the install check and the site's build, not after minutes of work.
"""

from __future__ import annotations

import errno
import os
import socket

from devtasks import supervision
from devtasks.checkout import die
from devtasks.child_env import run_in_venv

# `mkdocs serve`'s own parsing of the options, without serving: an unknown option or a missing
# value is said in one line before the build starts.
CHECK_SERVE_OPTIONS = """
import sys, click
from mkdocs.__main__ import cli
try:
    cli.commands["serve"].make_context("mkdocs serve", sys.argv[1:])
except click.UsageError as error:
    message = " ".join(error.format_message().split()).rstrip(".")
    print(f"tasks.py: serve: {message} (python3 tasks.py serve --help lists the options)", file=sys.stderr)
    sys.exit(2)
"""


def serve(rest: list[str], address: str) -> int:
    """`mkdocs serve` with `rest` (its options), on `address` (serve_address(rest))."""
    if "-h" in rest or "--help" in rest:
        return run_in_venv("-m", "mkdocs", "serve", *rest)
    if run_in_venv("-c", CHECK_SERVE_OPTIONS, *rest) != 0:  # it said why, in one line
        return 130 if supervision.interrupted else 2
    print(f"Serving the site on http://{address}/  (Ctrl-C stops)", flush=True)
    return run_in_venv("-m", "mkdocs", "serve", *rest)


def serve_address(rest: list[str]) -> str:
    """The address `mkdocs serve` will listen on; dies with one line if it is not one, or taken."""
    address = "127.0.0.1:8000"
    for i, arg in enumerate(rest):
        if arg.startswith(("--dev-addr=", "-a=")):
            address = arg.split("=", 1)[1]
        elif arg in {"--dev-addr", "-a"} and i + 1 < len(rest):
            address = rest[i + 1]
    host, colon, port = address.rpartition(":")
    if not colon or not host or not port.isdigit():
        die(f"--dev-addr {address!r} is not host:port (for example 127.0.0.1:8001)")
    if not 1 <= int(port) <= 65535:
        die(f"--dev-addr {address}: the port must be from 1 to 65535, not {port}")
    taken = port_taken(address)
    if taken == os.strerror(errno.EADDRINUSE):
        die(f"cannot serve on http://{address}/: {taken}. Another server (an earlier "
            f"`tasks.py serve`?) may be running there; stop it, or choose another address: "
            f"python3 tasks.py serve --dev-addr 127.0.0.1:8001")
    if taken:
        die(f"cannot serve on http://{address}/: {taken}")
    return address


def port_taken(address: str) -> str | None:
    """Why `mkdocs serve` could not listen on host:port, or None if it can."""
    host, _, port = address.rpartition(":")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as mkdocs' server does
            probe.bind((host.strip("[]"), int(port)))
    except OSError as error:
        return error.strerror or str(error)
    return None
