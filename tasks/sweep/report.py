"""What a sweep reports: a ranking of its configurations by the interquartile mean of their
seeds' final returns (with 95% bootstrap intervals, and the same for the area under the learning
curve), learning curves per configuration as a mean with a confidence band, and the best
configuration as a preset YAML that `gymflow run` accepts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import yaml

from gymflow.presets.load import redacted
from gymflow.presets.sweep import Sweep
from gymflow.tasks.sweep.aggregate import Estimate, curve_band, iqm_with_interval
from gymflow.tasks.sweep.study import Configuration

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
