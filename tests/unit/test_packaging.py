"""The versions CI tests at the bottom of the supported range are pyproject.toml's lower bounds."""

from __future__ import annotations

import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_minimum_versions_are_the_lower_bounds():
    tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)
    from packaging.requirements import Requirement
    from packaging.version import Version

    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        declared = [Requirement(r) for r in tomllib.load(f)["project"]["dependencies"]]
    bounds = {}
    for req in declared:
        lower = [Version(s.version) for s in req.specifier if s.operator == ">="]
        assert len(lower) == 1, f"{req}: one '>=' lower bound expected"
        bounds[req.name.lower()] = lower[0]
    with open(os.path.join(ROOT, ".ci", "minimum-versions.txt")) as f:
        pinned = [Requirement(line) for line in (raw.split("#")[0].strip() for raw in f) if line]
    pins = {req.name.lower(): Version(next(iter(req.specifier)).version) for req in pinned}
    assert set(pins) == set(bounds), "minimum-versions.txt and pyproject.toml name different packages"
    for name, bound in bounds.items():
        # the pin is the bound itself, or the bound's release series at a later patch (numpy 1.26 -> 1.26.4)
        assert pins[name].release[: len(bound.release)] == bound.release, (name, str(pins[name]), str(bound))
