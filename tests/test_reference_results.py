"""Refactors must not move results: two fixed runs end with the final weights recorded in
tests/reference_results.json (see tests/reference_results.py, which also re-records them)."""

from __future__ import annotations

import pytest

from tests import reference_results

pytestmark = [pytest.mark.e2e]


# default tier (one of its 25 slowest): guards this machine kind's floats: `gymflow run cartpole-ppo` ends with the recorded weights
# long tier: cartpole-dqn (39 s); cartpole-ppo guards this machine's floats in the default run
@pytest.mark.parametrize("preset", [pytest.param(preset, marks=pytest.mark.slow) if preset == "cartpole-dqn" else preset
                                    for preset in reference_results.PRESETS])
def test_a_fixed_run_ends_with_the_recorded_weights(preset, prefect_api):
    expected = reference_results.recorded_here(reference_results.kinds(), reference_results.machine())
    if expected is None:
        pytest.skip("no results recorded for this machine's kind (tests/reference_results.py --record); "
                    "float results differ across instruction sets")
    assert reference_results.final_weights(preset) == expected[preset]


def test_recording_lists_a_machine_with_the_kind_whose_results_it_gives():
    first, other = {"cartpole-ppo": {"policy": "1"}}, {"cartpole-ppo": {"policy": "2"}}
    recorded = [{"machines": ["m1"], "results": first}]
    assert reference_results.with_results(recorded, "m2", first) == [{"machines": ["m1", "m2"], "results": first}]
    assert reference_results.with_results(recorded, "m2", other) == [{"machines": ["m1"], "results": first},
                                                                     {"machines": ["m2"], "results": other}]
    assert reference_results.with_results(recorded, "m1", other) == [{"machines": ["m1"], "results": other}]
    assert reference_results.recorded_here(recorded, "m2") is None
    assert reference_results.recorded_here(recorded, "m1") == first
