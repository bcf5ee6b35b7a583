"""docs/api.md's metrics table names every family the server exposes (issue 45: three were
missing), and nothing it names is absent from the server."""

from __future__ import annotations

import re
from pathlib import Path

from mlaserve.service.metrics import Metrics

API_MD = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def _exposed() -> set[str]:
    """Every family's exposition name (counters with their `_total`)."""
    names = set()
    for family in Metrics().registry.collect():
        names.add(family.name + ("_total" if family.type == "counter" else ""))
    return names


def test_the_metrics_table_lists_every_family_and_no_other() -> None:
    rows = re.findall(r"^\| `(mlaserve:[a-z0-9_]+)(?:\{[^}]*\})?` \|", API_MD.read_text(), re.M)
    documented = set(rows)
    exposed = _exposed()
    assert len(exposed) > 30  # the registry was read
    assert exposed - documented == set(), "families missing from docs/api.md's table"
    assert documented - exposed == set(), "docs/api.md names families the server lacks"
