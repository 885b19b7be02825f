"""One temporary Prefect API for a whole suite run: tests/suite.py starts it beside its two pytest
runs, and every test process of both uses it (tests/conftest.py's `prefect_api`). One API a test
process cost each its start (~5 CPU-s) and its housekeeping while the run went on (~1.7 CPU-s a
minute under the tests' load, twice that at half the CPU): three of them a run (benchmarks/records/history.md,
"The test suite in two tiers"). Tests keep apart on it by their own run ids, flow-run ids and event resources.

`python -m tests.shared_prefect_api FILE`: the API's URL is written to FILE once it answers (or
`error: ...` where it could not start); it stops, its database removed, once its stdin closes (the
suite ended, or died)."""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from pathlib import Path

ERROR = "error: "  # in the URL's file: why there is none


def serve(url_file: Path) -> None:
    os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="gymflow-tests-prefect-shared-")  # not ~/.prefect
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "0")
    try:
        from prefect.settings import PREFECT_API_URL
        from prefect.testing.utilities import prefect_test_harness

        from tests.prefect_databases import harness_databases_seeded

        with harness_databases_seeded(), prefect_test_harness(server_startup_timeout=120):
            _write(url_file, PREFECT_API_URL.value())
            sys.stdin.read()  # until the suite closes it
    except BaseException:
        _write(url_file, ERROR + " ".join(traceback.format_exc().split())[-2000:])
        raise


def read_url(url_file: Path) -> str | None:
    """The shared API's URL once it answers; None until then. Raises where it could not start."""
    try:
        said = url_file.read_text()
    except FileNotFoundError:
        return None
    if said.startswith(ERROR):
        raise RuntimeError(f"the suite's shared Prefect API did not start: {said[len(ERROR):]}")
    return said


def _write(path: Path, text: str) -> None:
    partial = path.with_name(f"{path.name}.partial")
    partial.write_text(text)
    partial.replace(path)  # whole, or not there


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
