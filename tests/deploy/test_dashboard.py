"""The Grafana dashboard: valid JSON with the panels operators expect, on the provisioned
datasource, every query valid PromQL (promtool) over metrics mlaserve exports."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from mlaserve.service.metrics import Metrics
from tests.deploy import dashboard as dash
from tests.deploy.exposition import exposed_metric_names

PROMTOOL = shutil.which("promtool")

# The list: each must be a panel, found by these words in its title.
REQUIRED_PANELS = {
    "TPOT p50/p90/p99": ("tpot", "p50", "p90", "p99"),
    "TTFT p50/p90/p99": ("ttft", "p50", "p90", "p99"),
    "output tokens/s": ("output tokens/s",),
    "accept length": ("accept length",),
    "per-position acceptance": ("acceptance", "position"),
    "running and waiting requests": ("running", "waiting"),
    "KV cache usage": ("kv cache",),
    "graph replays vs eager steps": ("graph replays", "eager"),
    "compiles while serving": ("compiles while serving",),
}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return dash.load()


def test_dashboard_has_the_required_panels(dashboard: dict) -> None:
    titles = [p["title"].lower() for p in dash.panels(dashboard)]
    missing = [
        name
        for name, words in REQUIRED_PANELS.items()
        if not any(all(w.lower() in t for w in words) for t in titles)
    ]
    assert not missing, f"panels missing: {missing}; titles: {titles}"
    assert dashboard["uid"] == "mlaserve"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for panel in dash.panels(dashboard):
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, f"{panel['title']}: wider than the grid"
        assert panel.get("targets"), f"{panel['title']}: no query"


def test_dashboard_uses_the_provisioned_datasource(dashboard: dict) -> None:
    provisioned = {
        ds["uid"]
        for path in dash.DATASOURCES.glob("*.yaml")
        for ds in yaml.safe_load(path.read_text())["datasources"]
    }
    used = {p["datasource"]["uid"] for p in dash.panels(dashboard)}
    used |= {t["datasource"]["uid"] for p in dash.panels(dashboard) for t in p["targets"]}
    used |= {v["datasource"]["uid"] for v in dashboard["templating"]["list"]}
    assert used <= provisioned, f"datasource uids {used - provisioned} are not provisioned"


def test_every_dashboard_metric_is_exported(dashboard: dict) -> None:
    metrics = Metrics()
    metrics.bind_model("m")
    exposed = exposed_metric_names(metrics.render().decode())
    used = set().union(*(q.metric_names for q in dash.queries(dashboard)))
    used |= dash.variable_metric_names(dashboard)
    assert used, "no mlaserve: metric found in the dashboard"
    assert not used - exposed, f"dashboard metrics mlaserve does not export: {used - exposed}"
    for query in dash.queries(dashboard):
        assert query.metric_names, f"{query.key}: reads no mlaserve metric"


@pytest.mark.skipif(PROMTOOL is None, reason="no promtool (apt-get install prometheus)")
def test_every_dashboard_query_is_valid_promql(dashboard: dict, tmp_path) -> None:
    """promtool parses each expression offline as the expression of a recording rule."""
    queries = dash.queries(dashboard)
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{i}", "expr": q.promql()}
                    for i, q in enumerate(queries)
                ],
            }
        ]
    }
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(rules))
    result = subprocess.run(
        [PROMTOOL, "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(queries)} rules found" in result.stdout
