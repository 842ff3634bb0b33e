"""The oldest versions CI tests (scripts/oldest-constraints.txt) are the declared ones.

scripts/test_oldest.sh runs the unit and kernel groups in a venv built from that file;
these checks keep it in step with pyproject.toml's dependencies, so that every declared
lower bound is the version that run tests.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

tomllib = pytest.importorskip("tomllib")  # (Python 3.11+)

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "scripts" / "oldest-constraints.txt"


def _declared() -> dict[str, Requirement]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return {canonicalize_name(r.name): r for r in map(Requirement, deps)}


def _pins() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", f"not a pin: {line!r}"
        name = canonicalize_name(req.name)
        assert name not in pins, f"{req.name} pinned twice"
        pins[name] = Version(specs[0].version)
    return pins


def test_every_declared_lower_bound_is_pinned_at_that_version():
    pins = _pins()
    for name, req in _declared().items():
        lows = [s for s in req.specifier if s.operator in (">=", "==", "~=")]
        if name == "torch":  # the CPU build scripts/setup.sh installs first, not the bound
            assert name not in pins
            continue
        if not lows:
            continue
        assert name in pins, f"{name}: lower bound {lows[0]} is not tested (no pin)"
        assert pins[name] == Version(lows[0].version), (
            f"{name}: declared {req.specifier}, but the oldest run tests {pins[name]}")


def test_every_pin_of_a_declared_dependency_is_allowed_by_it():
    declared = _declared()
    for name, version in _pins().items():
        if name in declared:
            assert declared[name].specifier.contains(version, prereleases=True), (
                f"{name}=={version} is outside the declared {declared[name].specifier}")
