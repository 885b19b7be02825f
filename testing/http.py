"""Waiting on and asking a local HTTP server, for the tests and docs/take_screenshots.py: a server they
started (Prefect, MLflow) is used once it answers."""

from __future__ import annotations

import json
import time
import urllib.request


def wait_for_answer(url: str, seconds: float = 120) -> None:
    """Return once `url` answers 200; raise after `seconds` without."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer within {seconds:.0f} s")
        time.sleep(0.5)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return json.load(answer)


def post_json(url: str, body: dict) -> list | dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.load(answer)
