"""gymflow's Prefect events, read back from a real Prefect API: a run's evaluations (return and
env steps), its target reached and its end with what it delivered; and the run's system metrics
in MLflow, per node. (A model's promotion, a
sweep's end and a stopped run are held in tests/test_retrain.py, test_sweep.py, test_stops.py.)"""

from __future__ import annotations

import pytest

from tests.conftest import local_overrides, prefect_events


@pytest.mark.e2e
def test_a_run_sends_events_of_its_evaluations_target_and_end_and_logs_system_metrics_per_node(prefect_api, workspace, tiny_budget):
    from gymflow.flows.improve import improve

    summary = improve("cartpole-ppo", {**tiny_budget, "schedule.total_env_steps": 1280, "schedule.target_return": 0.5,
                                       **local_overrides(workspace)}, run_id="eventful")

    events = prefect_events("gymflow.run.eventful",
                            ["gymflow.run.evaluated", "gymflow.run.target-reached", "gymflow.run.finished"])
    evaluated = [event for event in events if event.event == "gymflow.run.evaluated"]
    assert [(e.payload["env_steps"], e.payload["version"]) for e in evaluated] == [
        (row.env_steps, row.version) for row in summary.evaluations]
    assert [e.payload["return"] for e in evaluated] == pytest.approx([row.mean for row in summary.evaluations])
    (finished,) = [event for event in events if event.event == "gymflow.run.finished"]
    assert finished.payload["final_return"] == pytest.approx(summary.final_return)
    assert finished.payload["model_uri"] == summary.model_uri and finished.payload["solved"] is summary.solved is True
    assert finished.resource["gymflow.mlflow_run_id"] == summary.mlflow_run_id
    assert any(related.role == "flow-run" for related in finished.related)  # Prefect ties it to the flow run

    # and MLflow's system metrics of the run: one node id for the flow's process, one for each rollout worker's
    from mlflow.tracking import MlflowClient

    metrics = MlflowClient(local_overrides(workspace)["tracking.tracking_uri"]).get_run(summary.mlflow_run_id).data.metrics
    nodes = {key.split("/")[1] for key in metrics if key.startswith("system/")}
    assert len(nodes) == 3 and sum(node.startswith("worker-") for node in nodes) == 2, nodes
    for node in nodes:
        assert 0 <= metrics[f"system/{node}/cpu_utilization_percentage"] <= 100
        assert metrics[f"system/{node}/process_memory_rss_megabytes"] > 10


def test_a_failed_run_says_its_error_in_one_line_and_a_stopped_one_how_it_was_stopped(prefect_api):
    from gymflow.tasks.tracking.events import RunEvents

    RunEvents("broken", "cartpole-ppo", "m1").failed(RuntimeError("the env raised at step 12\nTraceback ..."))
    RunEvents("halted", "cartpole-ppo", "m2").failed(KeyboardInterrupt())
    (failed,) = prefect_events("gymflow.run.broken", ["gymflow.run.failed"])
    assert failed.payload == {"error": "the env raised at step 12"} and failed.resource["gymflow.mlflow_run_id"] == "m1"
    (stopped,) = prefect_events("gymflow.run.halted", ["gymflow.run.stopped"])
    assert stopped.payload == {"how": "KeyboardInterrupt"}
