"""What a person sees of a finished run, in a real browser (Debian's Chromium, headless, driven by
Playwright): the run's MLflow page, opened from the link the run prints, shows its return in the
first screen; the experiment's runs table, from the summary's link, has the return columns; the run's
own Prefect API's UI shows its flow run and its summary artifact; the improve deployment's custom-run
form lists the presets and, filled in one field, runs with that one override. The screenshots are kept in
test-artifacts/browser/ (GYMFLOW_TEST_ARTIFACTS moves it)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect.utilities.callables import parameter_schema_from_entrypoint

from gymflow.presets.load import builtin_presets
from gymflow.presets.overrides import PresetOverrides
from gymflow.testing.http import post_json, wait_for_answer
from tests.conftest import TINY_BUDGET, free_port
from tests.prefect_databases import seed_prefect_database

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
SCREEN = {"width": 1280, "height": 800}  # a laptop's browser window: the "first screen"
ARTIFACTS = Path(os.environ.get("GYMFLOW_TEST_ARTIFACTS", Path(__file__).parents[1] / "test-artifacts"), "browser")
BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed (make test installs "
                                                               "it where it runs as root)"),
]


class Served:
    """A server this test started, stopped by its id at the end."""

    def __init__(self, command: list[str], env: dict[str, str], cwd: Path):
        self.process = subprocess.Popen(command, env=env, cwd=cwd, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def prefect_ui(tmp_path: Path) -> Iterator[str]:
    """A Prefect server with its UI, as `prefect server start` serves it, on a database of its own."""
    home, port = tmp_path / "prefect-home", free_port()
    home.mkdir()
    seed_prefect_database(home / "prefect.db")
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "0",
           "PREFECT_UI_API_URL": f"http://127.0.0.1:{port}/api"}  # the UI's own calls: not to 4200
    env.pop("PREFECT_API_URL", None)
    server = Served([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)], env, home)
    try:
        wait_for_answer(f"http://127.0.0.1:{port}/api/health")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


def _finished_run(folder: Path, prefect: str) -> str:
    """`gymflow run` to its end against the Prefect server, in a local MLflow store: what it printed."""
    env = {**os.environ, "PREFECT_API_URL": f"{prefect}/api"}
    overrides = [f"{key}={json.dumps(value) if not isinstance(value, str) else value}"
                 for key, value in TINY_BUDGET.items()]
    command = [str(BIN / "gymflow"), "run", "cartpole-ppo", "--set", f"storage.root={folder / 'data'}",
               *(part for override in overrides for part in ("--set", override))]
    done = subprocess.run(command, env=env, cwd=folder, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def _run_page_printed(printed: str) -> str:
    (link,) = re.findall(r"MLflow run: \w+, at (http://127\.0\.0\.1:5000/\S+)", printed)
    return link


def _shot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"))


def _in_first_screen(page, locator) -> bool:
    """Shown in the window as it opened, unscrolled, and not hidden under or clipped by anything else."""
    box = locator.bounding_box()
    if box is None:
        return False
    x, y = box["x"] + box["width"] / 2, box["y"] + box["height"] / 2
    if not (0 <= x < SCREEN["width"] and 0 <= y < SCREEN["height"]):
        return False
    return locator.evaluate("(shown, [x, y]) => shown.contains(document.elementFromPoint(x, y))", [x, y])


def test_a_finished_runs_pages_show_its_return_at_a_glance_and_prefect_shows_its_run_and_summary(
        prefect_ui, tmp_path):
    playwright = pytest.importorskip("playwright.sync_api")
    printed = _finished_run(tmp_path, prefect_ui)
    link, port = _run_page_printed(printed), free_port()
    mlflow_ui = Served([str(BIN / "mlflow"), "ui", "--backend-store-uri", "sqlite:///mlflow.db",
                        "--host", "127.0.0.1", "--port", str(port)], dict(os.environ), tmp_path)
    try:
        wait_for_answer(f"http://127.0.0.1:{port}/health")
        with playwright.sync_playwright() as driver:
            browser = driver.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page(viewport=SCREEN)
            _look_at_mlflow(page, link.replace(":5000/", f":{port}/"))
            _look_at_prefect(page, prefect_ui, printed)
            _run_from_prefects_form(page, prefect_ui)
            browser.close()
    finally:
        mlflow_ui.stop()


def _look_at_mlflow(page, run_link: str) -> None:
    page.goto(run_link)
    returned = page.get_by_text("gymflow.return", exact=True)
    returned.wait_for(timeout=60_000)
    page.get_by_text(re.compile(r"\d, v\d+ delivered")).wait_for()
    _shot(page, "mlflow-run")
    assert _in_first_screen(page, returned), "the run's return is below MLflow's first screen"
    experiment = re.search(r"#/experiments/(\w+)/", run_link).group(1)
    base = run_link.split("#")[0]
    page.goto(f"{base}#/experiments/{experiment}/runs?viewStateShareKey=gymflow-returns"
              "&workflowType=machine_learning")
    page.locator(_cell("summary/final_return")).first.wait_for(timeout=60_000)
    _shot(page, "mlflow-runs-by-return")
    for column in ("summary/final_return", "summary/best_return", "eval/return_mean"):
        (value,) = page.locator(_cell(column)).all_inner_texts()
        assert re.fullmatch(r"-?\d+(\.\d+)?", value.strip()), (column, value)
    for column in ("summary/final_return", "summary/best_return"):  # the newest evaluation's may scroll in
        assert _in_first_screen(page, page.locator(_cell(column))), f"{column} is out of the runs table's first screen"
    _choose_the_returns_view_from_the_views_menu(page, f"{base}#/experiments/{experiment}/runs")


def _choose_the_returns_view_from_the_views_menu(page, runs: str) -> None:
    """As docs/usage.md says: MLflow's Views menu opens a view in the navigation the browser last chose
    (GenAI at first), so a person picks Model training once; then the view keeps it, best return first."""
    page.goto(runs)
    page.get_by_text("Model training", exact=True).click()
    page.get_by_text("Model registry", exact=True).wait_for(timeout=60_000)  # the model-training navigation
    page.get_by_role("button", name="Views").click()
    page.get_by_text("gymflow: returns").first.click()
    page.locator(_cell("summary/best_return")).first.wait_for(timeout=60_000)
    page.get_by_text("Sort: summary/best_return").wait_for()
    _shot(page, "mlflow-views-menu-returns")
    assert page.get_by_text("Model registry", exact=True).is_visible() and not page.get_by_text("Training runs").count()
    for column in ("summary/final_return", "summary/best_return"):
        assert _in_first_screen(page, page.locator(_cell(column))), f"{column} is out of the view's first screen"


def _cell(metric: str) -> str:
    """The runs table's cells of a metric's column (MLflow's grid names a column by its key)."""
    return f'[role=gridcell][col-id="metrics.`{metric}`"]'


def _look_at_prefect(page, prefect: str, printed: str) -> None:
    (flow_run,) = post_json(f"{prefect}/api/flow_runs/filter", {"limit": 1})
    (link,) = re.findall(r"Prefect flow run: (\S+)", printed)  # the run's page, printed with PREFECT_API_URL set
    assert link == f"{prefect}/runs/flow-run/{flow_run['id']}", link
    page.goto(link)
    page.get_by_text(flow_run["name"]).first.wait_for(timeout=60_000)
    page.get_by_text("Completed").first.wait_for()
    page.get_by_text(re.compile(r"v\d+ delivered to MLflow")).first.wait_for(timeout=60_000)  # its log, as sent
    _shot(page, "prefect-flow-run")
    (summary,) = post_json(f"{prefect}/api/artifacts/filter", {"artifacts": {"key": {"any_": ["improve-summary"]}}})
    page.goto(f"{prefect}/artifacts/artifact/{summary['id']}")
    page.get_by_text("final evaluation return").first.wait_for(timeout=60_000)
    page.get_by_text("the experiment's runs by return").first.wait_for()
    _shot(page, "prefect-summary-artifact")


def _run_from_prefects_form(page, prefect: str) -> None:
    """The improve deployment's custom run, as a person fills it: the preset's description lists every
    built-in preset, the override sections are open (no "None" to switch first), and a run with one
    field filled in overrides that field alone (the rest of the form, sent empty, changes nothing)."""
    flow = post_json(f"{prefect}/api/flows/", {"name": "improve"})
    schema = parameter_schema_from_entrypoint(f"{ROOT / 'flows' / 'improve.py'}:improve").model_dump_for_openapi()
    deployment = post_json(f"{prefect}/api/deployments/", {"name": "form", "flow_id": flow["id"], "parameters": {},
                                                          "entrypoint": "flows/improve.py:improve",
                                                          "parameter_openapi_schema": schema})
    page.goto(f"{prefect}/deployments/deployment/{deployment['id']}/run")
    learning_rate = page.locator("span.schema-form-property__label", has_text=re.compile(r"^Lr \(Optional\)$"))
    learning_rate.wait_for(timeout=60_000)
    described = page.get_by_text("What to train:").inner_text()
    assert all(name in described for name in builtin_presets()), described
    _shot(page, "prefect-custom-run-form")
    learning_rate.locator("xpath=../../../..").locator("input").fill("0.001")
    page.get_by_role("button", name="Submit").click()
    learning_rate.wait_for(state="detached", timeout=60_000)  # on the new run's page
    (run,) = post_json(f"{prefect}/api/flow_runs/filter", {"deployments": {"id": {"any_": [deployment["id"]]}}})
    assert PresetOverrides.model_validate(run["parameters"]["overrides"]).dotted() == {"agent.lr": 0.001}
