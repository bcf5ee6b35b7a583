"""The Grafana dashboard of docker/grafana/dashboards/mlaserve.json, read as its queries.

Grafana expands `$__rate_interval` and the dashboard's `$model_name` variable before a query
reaches Prometheus; `promql()` does the same so the tests can send the expressions as they are.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = REPO_ROOT / "docker" / "grafana" / "dashboards" / "mlaserve.json"
DATASOURCES = REPO_ROOT / "docker" / "grafana" / "provisioning" / "datasources"

# `mlaserve:` names; PromQL keywords and functions never contain a colon.
_METRIC = re.compile(r"\bmlaserve:[a-zA-Z_][a-zA-Z0-9_:]*")


@dataclass(frozen=True)
class Query:
    panel: str
    legend: str
    expr: str  # as written in the dashboard, Grafana variables included

    @property
    def key(self) -> str:
        return f"{self.panel} / {self.legend}"

    def promql(self, rate_interval: str = "30s", model_name: str = ".*") -> str:
        """The expression as Grafana would send it."""
        return self.expr.replace("$__rate_interval", rate_interval).replace(
            "$model_name", model_name
        )

    @property
    def metric_names(self) -> set[str]:
        return set(_METRIC.findall(self.expr))


def load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, those nested in collapsed rows included; rows themselves excluded."""
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def queries(dashboard: dict[str, Any]) -> list[Query]:
    return [
        Query(panel["title"], target.get("legendFormat", target["refId"]), target["expr"])
        for panel in panels(dashboard)
        for target in panel.get("targets", [])
    ]


def variable_metric_names(dashboard: dict[str, Any]) -> set[str]:
    """Metric names the template variables' `label_values(...)` queries read."""
    names: set[str] = set()
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        names |= set(_METRIC.findall(text))
    return names
