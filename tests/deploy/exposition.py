"""Metric names a Prometheus text exposition (`GET /metrics`) offers to queries."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count", ""),
    "gauge": ("",),
}


def exposed_metric_names(text: str) -> set[str]:
    """Every series name the exposition declares, with or without samples yet.

    A labelled family with no child (e.g. `eager_steps_total{reason}` before the first eager
    step) has only its `# HELP`/`# TYPE` lines; its names still count: a query of it is valid
    and fills in as soon as a child appears.
    """
    names: set[str] = set()
    for family in text_string_to_metric_families(text):
        names |= {family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",))}
        names |= {sample.name for sample in family.samples}
    return names
