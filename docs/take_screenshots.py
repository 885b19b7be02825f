"""Screenshots of what a person sees of a real run, for the docs: a Prefect server and an MLflow
tracking server on loopback, one `gymflow run` against both, then headless Chromium on the
Prefect flow run page, its artifacts, and the MLflow run, its logged model and its video.

    apt-get install -y chromium
    .venv/bin/python docs/take_screenshots.py            # writes docs/img/*.png

Nothing is left running: both servers are started in a temporary folder and stopped at the end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gymflow.testing.http import get_json, post_json, wait_for_answer

IMAGES = Path(__file__).with_name("img")
PREFECT_PORT, MLFLOW_PORT = 4231, 5231
PREFECT, MLFLOW = f"http://127.0.0.1:{PREFECT_PORT}", f"http://127.0.0.1:{MLFLOW_PORT}"
BIN = Path(sys.executable).parent


def screenshot(url: str, name: str, height: int = 1100) -> None:
    path = IMAGES / f"{name}.png"
    subprocess.run(["chromium", "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--window-size=1600,{height}", "--virtual-time-budget=20000", f"--screenshot={path}", url],
                   check=True, capture_output=True, timeout=120)
    print(f"{path}  <- {url}")


def main() -> None:
    IMAGES.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "PREFECT_HOME": folder, "PREFECT_SERVER_ANALYTICS_ENABLED": "0",
               "PREFECT_API_URL": f"{PREFECT}/api"}
        servers = [
            subprocess.Popen([BIN / "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(PREFECT_PORT)],
                             env=env, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
            subprocess.Popen([BIN / "mlflow", "server", "--backend-store-uri", f"sqlite:///{folder}/mlflow.db",
                              "--host", "127.0.0.1", "--port", str(MLFLOW_PORT)],
                             env=env, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
        ]
        try:
            wait_for_answer(f"{PREFECT}/api/health")
            wait_for_answer(f"{MLFLOW}/health")
            subprocess.run([BIN / "gymflow", "run", "cartpole-ppo", "--quiet", "--set",
                            f"tracking.tracking_uri={MLFLOW}"], env=env, cwd=folder, check=True)
            (flow_run,) = post_json(f"{PREFECT}/api/flow_runs/filter", {"limit": 1})
            experiment = get_json(f"{MLFLOW}/api/2.0/mlflow/experiments/get-by-name?experiment_name=gymflow")
            experiment_id = experiment["experiment"]["experiment_id"]
            (run,) = post_json(f"{MLFLOW}/api/2.0/mlflow/runs/search", {"experiment_ids": [experiment_id]})["runs"]
            run_id = run["info"]["run_id"]
            model_id = run["outputs"]["model_outputs"][0]["model_id"]
            films = get_json(f"{MLFLOW}/api/2.0/mlflow/artifacts/list?run_id={run_id}&path=videos")["files"]
            time.sleep(3)  # the last task runs and artifacts reach the API as events
            screenshot(f"{PREFECT}/runs/flow-run/{flow_run['id']}", "prefect-flow-run")
            summary_key = {"artifacts": {"key": {"any_": ["improve-summary"]}}}
            artifacts = post_json(f"{PREFECT}/api/artifacts/filter", summary_key)
            screenshot(f"{PREFECT}/artifacts/artifact/{artifacts[0]['id']}", "prefect-summary-artifact", 1500)
            page = f"{MLFLOW}/#/experiments/{experiment_id}"
            screenshot(f"{page}/runs/{run_id}?workflowType=machine_learning", "mlflow-run", 1400)
            screenshot(f"{page}/runs?viewStateShareKey=gymflow-returns&workflowType=machine_learning",
                       "mlflow-runs-by-return", 800)
            screenshot(f"{page}/runs/{run_id}/artifacts/{films[-1]['path']}?workflowType=machine_learning",
                       "mlflow-run-video")
            screenshot(f"{page}/models/{model_id}?workflowType=machine_learning", "mlflow-logged-model")
        finally:
            for server in servers:
                server.terminate()
                server.wait(timeout=30)


if __name__ == "__main__":
    main()
