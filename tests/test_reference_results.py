"""Refactors must not move results: two fixed runs end with the final weights recorded in
tests/reference_results.json (see tests/reference_results.py, which also re-records them)."""

from __future__ import annotations

import json

import pytest

from tests import reference_results

pytestmark = [pytest.mark.e2e]


@pytest.mark.parametrize("preset", reference_results.PRESETS)
def test_a_fixed_run_ends_with_the_recorded_weights(preset):
    reference = json.loads(reference_results.REFERENCE.read_text())
    if reference_results.machine() not in reference["machines"]:
        pytest.skip(f"recorded on {reference['machines']}; float results differ across instruction sets")
    assert reference_results.final_weights(preset) == reference["results"][preset]
