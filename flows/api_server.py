"""The temporary Prefect API's process (flows/stopping.py starts it under flows/tethered.py):
uvicorn serving Prefect's app on the socket the run's process bound, made ready for the run's
first request before it comes.

    python -m gymflow.flows.api_server PORT UVICORN_ARGS...

- Its connections answer without Nagle's delay (`no_delay`: 44-48 ms a request without it).
- No garbage collections while it imports and starts (`main`).
- It asks itself its first question (`warm_up`): a fresh server answers its first API request
  ~0.4 s slower than the next ones (measured on the 2-core VM: /api/admin/version 0.43 s, then
  0.03 s; /api/health does not warm it). The run's first request, the client's version check,
  comes after its imports, when the server has been idle on the other core for a while: asked
  here first, that 0.4 s leaves the run's path.
"""

from __future__ import annotations

import gc
import http.client
import runpy
import socket
import sys
import threading
import time

WARM_UP_PATH = "/api/admin/version"
WARM_UP_DEADLINE_S = 60.0
POLL_S = 0.05


def warm_up(port: int) -> bool:
    """Ask the server on `port` its first question once it listens (uvicorn listens only after
    the app's start-up). False if it never answered within `WARM_UP_DEADLINE_S`."""
    deadline = time.monotonic() + WARM_UP_DEADLINE_S
    while time.monotonic() < deadline:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=WARM_UP_DEADLINE_S)
        try:
            connection.request("GET", WARM_UP_PATH)
            connection.getresponse().read()
            return True
        except OSError:  # not listening yet
            time.sleep(POLL_S)
        finally:
            connection.close()
    return False


def warm_up_then_collect(port: int) -> None:
    """`warm_up`, then the garbage collector back on (see `main`), the start-up's objects frozen
    out of its scans."""
    try:
        warm_up(port)
    finally:
        gc.freeze()
        gc.enable()


def no_delay(fd: int) -> None:
    """TCP_NODELAY on the listening socket `fd`, which the connections it accepts inherit.

    uvicorn takes a socket passed by `--fd` as a Unix socket (`socket.fromfd(fd, AF_UNIX, ...)`),
    so asyncio, which sets TCP_NODELAY on every TCP connection it serves, skips it on these: each
    answer then went out in two writes, the second held by Nagle's algorithm until the client's
    delayed acknowledgement, 40 ms later. Every request of a run waited 45-50 ms instead of 2-5.
    """
    listening = socket.socket(fileno=fd)  # the family the socket really has
    try:
        listening.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        listening.detach()  # the fd stays open, for uvicorn


def main(argv: list[str]) -> None:
    port, *uvicorn_arguments = argv
    if "--fd" in uvicorn_arguments:
        no_delay(int(uvicorn_arguments[uvicorn_arguments.index("--fd") + 1]))
    # No garbage collections while Prefect's server imports and starts: they scanned its ~0.5 M
    # new objects over and over, and freed nothing (a fifth of an import's time, measured on the
    # run's side); back on once it has answered its first question
    gc.disable()
    threading.Thread(target=warm_up_then_collect, args=(int(port),), name="gymflow-warm-up", daemon=True).start()
    sys.argv = ["uvicorn", *uvicorn_arguments]
    runpy.run_module("uvicorn", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
