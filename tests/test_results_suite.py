"""The results suite: entries run as sweeps over env ids under the real Prefect API, Dask workers
and MLflow store; the page holds gymflow's IQM with its interval beside the published figures; a
second start of the same suite trains nothing again."""

from __future__ import annotations

import pytest
import yaml
from mlflow.tracking import MlflowClient

from benchmarks import results_suite
from benchmarks.results_suite import Entry, Suite, TaskResult, image_name, results_markdown, sweep_spec

FAST = {"distribution.rollout_workers": 1, "distribution.envs_per_worker": 4, "schedule.rollout_steps_per_env": 32,
        "schedule.evaluate_every_env_steps": 128, "schedule.evaluation_episodes": 2, "tracking.video": "off"}


# default tier (one of its 25 slowest): the results suite's one test
@pytest.mark.e2e
def test_a_suite_runs_its_entries_over_tasks_and_seeds_writes_the_page_and_continues_without_retraining(
        prefect_api, workspace):
    suite = workspace / "suite.yaml"
    suite.write_text(yaml.safe_dump({
        "root": str(workspace / "results"), "concurrency": 2,
        "entries": [{"preset": "cartpole-ppo", "tasks": ["gymflow.testing.envs:Corridor", "CartPole-v1"], "seeds": 2,
                     "env_steps": 256, "overrides": FAST}],
    }))
    docs = workspace / "docs"
    assert results_suite.main(["--suite", str(suite), "--docs", str(docs)]) == 0

    page = (docs / "results.md").read_text()
    rows = [line for line in page.splitlines() if line.startswith("| gymflow.testing") or line.startswith("| CartPole")]
    assert len(rows) == 2
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        assert cells[1:5] == ["PPO", "`cartpole-ppo`", "256", "2"]
        assert cells[5].startswith("**") and "[" in cells[5]  # IQM [low, high]
        assert len(cells[7].split(",")) == 2  # each seed's final return
        assert cells[8] == "not measured" and cells[9] == "none at this budget"
    images = sorted(path.name for path in (docs / "img").iterdir())
    assert images == ["results-cartpole-v1-cartpole-ppo.png", "results-gymflow.testing.envs-corridor-cartpole-ppo.png"]

    client = MlflowClient(f"sqlite:///{workspace / 'results' / 'mlflow.db'}")
    runs = lambda: len(client.search_runs([e.experiment_id for e in client.search_experiments()]))  # noqa: E731
    before = runs()
    assert before >= 4  # two tasks x two seeds (and the sweep's parent run)
    assert results_suite.main(["--suite", str(suite), "--docs", str(docs)]) == 0
    assert runs() == before  # finished runs are kept, none trained again
    assert (docs / "results.md").read_text() == page


def test_the_page_sets_published_figures_beside_gymflows_at_the_same_budget():
    entry = Entry(preset="hopper-ppo", env_steps=1_000_000, seeds=3)
    hopper = TaskResult(entry, "ppo", "Hopper-v5", finals={0: 3000.0, 1: 3300.0, 2: 2900.0})
    walker = TaskResult(entry, "ppo", "Walker2d-v5", finals={0: 4000.0}, failed=True)
    short = TaskResult(Entry(preset="hopper-td3", env_steps=300_000), "td3", "Hopper-v5", finals={0: 2000.0})
    page = results_markdown([hopper, walker, short], "python benchmarks/results_suite.py", "a test machine")
    hopper_row, walker_row, short_row = (line for line in page.splitlines() if line.startswith("| Hopper")
                                         or line.startswith("| Walker"))
    assert "**3,067** [2,900, 3,300]" in hopper_row and "| 3,000 |" in hopper_row  # 3 seeds: no run trimmed; median
    assert "rl-zoo 2,410 (Hopper-v3); CleanRL 2,383 (Hopper-v4); Tianshou 2,609 (Hopper-v4)" in hopper_row
    assert "(1 of 3 seeds)" in walker_row and "rl-zoo 3,479 (Walker2d-v3)" in walker_row
    assert "none at this budget" in short_row  # TD3's published figures are at 1M, not 300k


@pytest.mark.parametrize(("text", "says"), [
    ("entries: [{preset: hopper-ppo, env_steps: 0}]", "entries.0.env_steps: Input should be greater than 0"),
    ("entries: [{preset: hopper-ppo, env_steps: 10, typo: 1}]", "entries.0.typo: Extra inputs are not permitted"),
    ("root: x\n", "entries: Field required"),
    ("entries: [", "is not valid YAML"),
])
def test_a_bad_suite_file_is_one_line_naming_the_field(tmp_path, capsys, text, says):
    suite = tmp_path / "suite.yaml"
    suite.write_text(text)
    assert results_suite.main(["--suite", str(suite), "--docs", str(tmp_path / "docs")]) == 2
    error = capsys.readouterr().err
    assert error.startswith("results suite: error: ") and says in error and error.count("\n") == 1
    assert not (tmp_path / "docs").exists()


def test_a_preset_file_given_by_a_relative_path_is_found_from_the_suites_root_and_names_its_image(tmp_path, monkeypatch):
    from gymflow.presets.load import _BUILTIN

    monkeypatch.chdir(tmp_path)
    (tmp_path / "presets").mkdir()
    (tmp_path / "presets" / "mine.yaml").write_text((_BUILTIN / "cartpole-ppo.yaml").read_text())
    suite = Suite(root=str(tmp_path / "results"), entries=[Entry(preset="presets/mine.yaml", env_steps=256)])
    spec = sweep_spec(suite, suite.entries[0])
    assert spec["preset"] == str(tmp_path / "presets" / "mine.yaml")  # the sweep runs from the suite's root
    assert spec["space"] == {"env.id": {"values": ["CartPole-v1"]}}
    assert sweep_spec(suite, Entry(preset="cartpole-ppo", env_steps=256))["preset"] == "cartpole-ppo"
    assert image_name(TaskResult(suite.entries[0], "ppo", "CartPole-v1")) == "results-cartpole-v1-mine.png"
