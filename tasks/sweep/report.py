"""What a sweep reports: a ranking of its configurations by the interquartile mean of their
seeds' final returns (with 95% bootstrap intervals, and the same for the area under the learning
curve), learning curves per configuration as a mean with a confidence band, and the best
configuration as a preset YAML that `gymflow run` accepts."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import optuna
import yaml
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from gymflow.presets.load import flatten
from gymflow.presets.redaction import redacted
from gymflow.presets.sweep import Sweep
from gymflow.tasks.storage.layout import sweep_best_preset
from gymflow.tasks.storage.objects import StorageLocation, open_storage
from gymflow.tasks.sweep.aggregate import Estimate, curve_band, iqm_with_interval
from gymflow.tasks.sweep.study import Configuration
from gymflow.tasks.tracking.store import tracking_client
from gymflow.tasks.tracking.tracker import Tracker, TrackerOptions

PARENT_RUN_ATTR = "mlflow_parent_run_id"  # on the study: a restarted sweep reopens its MLflow run
PLOTTED_CONFIGURATIONS = 8  # the best ones; more bands on one plot are unreadable


@dataclass(frozen=True)
class RankedConfiguration:
    rank: int
    configuration: Configuration
    outcome: str  # complete | pruned | failed
    final_return: Estimate | None  # IQM over seeds, with its interval
    area_under_curve: Estimate | None

    def row(self) -> dict[str, Any]:
        """One row of the ranking table (Prefect table artifact, MLflow table)."""
        final, area = self.final_return, self.area_under_curve
        return {
            "rank": self.rank,
            "configuration": self.configuration.number,
            **{key: _short(value) for key, value in sorted(self.configuration.params.items())},
            "outcome": self.outcome,
            "seeds": len(self.configuration.results),
            "final return IQM": _rounded(final.value) if final else None,
            "final return 95% CI": f"[{final.low:.4g}, {final.high:.4g}]" if final else "",
            "AUC IQM": _rounded(area.value) if area else None,
            "AUC 95% CI": f"[{area.low:.4g}, {area.high:.4g}]" if area else "",
        }


def rank(configurations: Sequence[Configuration], seeds: int) -> list[RankedConfiguration]:
    """Complete configurations first, by final-return IQM, then by AUC IQM; then pruned ones
    (by what their seeds reached), then failed ones."""
    scored = []
    for configuration in configurations:
        results = [configuration.results[seed] for seed in sorted(configuration.results)]
        final = iqm_with_interval(np.array([r.final_return for r in results])) if results else None
        area = iqm_with_interval(np.array([r.area_under_curve for r in results])) if results else None
        if configuration.pruned:
            outcome = "pruned"
        elif len(results) == seeds and final is not None and np.isfinite(final.value):
            outcome = "complete"
        else:
            outcome = "failed"
        scored.append((configuration, outcome, final, area))
    order = {"complete": 0, "pruned": 1, "failed": 2}
    scored.sort(key=lambda item: (order[item[1]], -(item[2].value if item[2] else -np.inf),
                                  -(item[3].value if item[3] else -np.inf), item[0].number))
    return [RankedConfiguration(index + 1, *item) for index, item in enumerate(scored)]


def ranking_markdown(sweep_id: str, ranking: Sequence[RankedConfiguration]) -> str:
    rows = [ranked.row() for ranked in ranking]
    if not rows:
        return f"# sweep {sweep_id}\n\nno configuration finished"
    columns = list(rows[0])
    lines = [f"# sweep {sweep_id}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join("" if row[c] is None else str(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def plot_sweep_curves(ranking: Sequence[RankedConfiguration], path: str, title: str) -> str:
    """Evaluation return against env steps: for each of the best configurations the mean over
    its seeds with a 95% band; beside it, the final-return IQM of each with its interval."""
    figure, (curves_ax, bars_ax) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [2, 1]})
    shown = [ranked for ranked in ranking if ranked.configuration.results][:PLOTTED_CONFIGURATIONS]
    colors = plt.get_cmap("tab10")
    for index, ranked in enumerate(shown):
        curves = [tuple(zip(*result.curve)) for result in ranked.configuration.results.values() if result.curve]
        if not curves:
            continue
        grid, mean, low, high = curve_band(curves)
        label = f"#{ranked.rank} c{ranked.configuration.number}: {_params(ranked.configuration.params)}"
        curves_ax.plot(grid, mean, color=colors(index % 10), lw=2, label=label,
                       ls="--" if ranked.outcome == "pruned" else "-")
        curves_ax.fill_between(grid, low, high, color=colors(index % 10), alpha=0.18)
    curves_ax.set_xlabel("environment steps")
    curves_ax.set_ylabel("evaluation return (mean over seeds, 95% band)")
    curves_ax.grid(alpha=0.3)
    curves_ax.legend(fontsize=7, loc="lower right")
    curves_ax.set_title(title)

    ranked_final = [ranked for ranked in shown if ranked.final_return is not None]
    positions = np.arange(len(ranked_final))
    values = np.array([ranked.final_return.value for ranked in ranked_final])
    errors = np.array([[ranked.final_return.value - ranked.final_return.low,
                        ranked.final_return.high - ranked.final_return.value] for ranked in ranked_final]).T
    bars = bars_ax.barh(positions, values, xerr=errors if len(ranked_final) else None, capsize=3,
                        color=[colors(i % 10) for i in range(len(ranked_final))])
    for bar, ranked in zip(bars, ranked_final):
        bar.set_alpha(0.4 if ranked.outcome == "pruned" else 0.9)
    bars_ax.set_yticks(positions, [f"#{ranked.rank} c{ranked.configuration.number}" for ranked in ranked_final])
    bars_ax.invert_yaxis()
    bars_ax.set_xlabel("final return, IQM over seeds (95% CI)")
    bars_ax.grid(alpha=0.3, axis="x")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def best_preset_yaml(sweep: Sweep, best: RankedConfiguration) -> bytes:
    """The sweep's preset with its fixed overrides and the best configuration's values."""
    preset = sweep.trial_preset(best.configuration.params)
    data = redacted(preset.model_dump(mode="json"))
    header = (f"# the best configuration (#{best.configuration.number}) of a sweep of {sweep.spec.preset}: "
              f"final return IQM {best.final_return.value:.2f} over {len(best.configuration.results)} seeds\n"
              f"# {_params(best.configuration.params)}\n")
    return (header + yaml.safe_dump(data, sort_keys=False)).encode()


def _params(params: dict[str, Any]) -> str:
    return ", ".join(f"{key}={_short(value)}" for key, value in sorted(params.items()))


def _short(value: Any) -> Any:
    return float(f"{value:.4g}") if isinstance(value, float) else value


def _rounded(value: float) -> float | None:
    return round(value, 3) if np.isfinite(value) else None


@contextmanager
def sweep_parent_run(sweep: Sweep, sweep_id: str, study: optuna.Study, flow_run_id: str) -> Iterator[Tracker]:
    """The sweep's MLflow run, the parent of its runs; a restarted sweep reopens its own."""
    tracking = sweep.base.tracking
    existing = study.user_attrs.get(PARENT_RUN_ATTR)
    tracker = Tracker(tracking.tracking_uri, tracking.experiment, run_name=f"sweep {sweep_id}",
                      tags={"gymflow.sweep_id": sweep_id, "gymflow.sweep.role": "parent",
                            "prefect.flow_run_id": flow_run_id, "gymflow.preset": sweep.base.name},
                      existing_run_id=existing, options=TrackerOptions.of(tracking))
    if existing is None:
        spec = redacted(sweep.spec.model_dump(mode="json"))  # its overrides may name a password or key
        tracker.log_params(flatten({key: value for key, value in spec.items() if key != "space"}))
        tracker.log_params({f"space.{key}": value for key, value in spec["space"].items()})
        study.set_user_attr(PARENT_RUN_ATTR, tracker.run_id)
    status = "FINISHED"
    try:
        yield tracker
    except BaseException as ended:  # a stop from outside is KILLED, an error FAILED
        status = "FAILED" if isinstance(ended, Exception) else "KILLED"
        raise
    finally:
        tracker.finish(status)


def mark_pruned(tracking_uri: str, mlflow_run_id: str) -> None:
    tracking_client(tracking_uri).set_tag(mlflow_run_id, "gymflow.sweep.pruned", "true")


def report_sweep(sweep: Sweep, sweep_id: str, ranking: list[RankedConfiguration], parent: Tracker,
            location: StorageLocation) -> str | None:
    """The ranking (Prefect table artifact; MLflow table, markdown and plot on the parent run),
    and the best configuration as a preset YAML in storage and on the parent run."""
    rows = [ranked.row() for ranked in ranking]
    client = tracking_client(sweep.base.tracking.tracking_uri)
    client.log_dict(parent.run_id, {"ranking": rows}, "ranking.json")
    client.log_text(parent.run_id, ranking_markdown(sweep_id, ranking), "ranking.md")
    with tempfile.TemporaryDirectory() as folder:
        plot = plot_sweep_curves(ranking, str(Path(folder, "sweep_curves.png")),
                                 title=f"sweep {sweep_id}: {sweep.spec.preset}")
        parent.log_artifact(plot)
    create_table_artifact(key="sweep-ranking", table=rows,
                          description=f"sweep {sweep_id}: configurations by the IQM of their seeds' final returns")
    best = ranking[0] if ranking and ranking[0].outcome == "complete" else None
    if best is None:
        return None
    parent.log_metrics({"sweep/best_final_return_iqm": best.final_return.value,
                                "sweep/best_configuration": float(best.configuration.number)}, step=0)
    client.set_tag(parent.run_id, "gymflow.sweep.best_run_ids",
                   ",".join(result.run_id for result in best.configuration.results.values()))
    preset_yaml = best_preset_yaml(sweep, best)
    client.log_text(parent.run_id, preset_yaml.decode(), "best-preset.yaml")
    storage = open_storage(location)
    key = sweep_best_preset(sweep_id)
    storage.write(key, preset_yaml)
    create_markdown_artifact(key="sweep-best-preset", markdown=f"```yaml\n{preset_yaml.decode()}```",
                             description=f"sweep {sweep_id}: the best configuration, for `gymflow run`")
    return storage.url(key)
