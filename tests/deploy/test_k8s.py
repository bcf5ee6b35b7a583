"""deploy/k8s: every manifest valid against the Kubernetes schemas (offline, strict: unknown
fields are errors), and the Deployment wired to the server's real lifecycle."""

from __future__ import annotations

import pytest
import yaml

from mlaserve.service.settings import ServerConfig, options
from tests.deploy.dashboard import REPO_ROOT

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="pip install kubernetes-validate"
)

MANIFESTS = sorted((REPO_ROOT / "deploy" / "k8s").glob("*.yaml"))
# The oldest version with preStop `sleep` on by default, and the newest the package knows.
KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())


def documents() -> list[dict]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_manifests_validate_against_the_schemas(version: str) -> None:
    assert MANIFESTS
    for doc in documents():
        kubernetes_validate.validate(doc, version, strict=True)


def test_strict_validation_rejects_a_misspelt_field() -> None:
    deployment = next(d for d in documents() if d["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readynessProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)


@pytest.fixture()
def deployment() -> dict:
    return next(d for d in documents() if d["kind"] == "Deployment")


def container_of(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_probes_follow_the_server_lifecycle(deployment: dict) -> None:
    container = container_of(deployment)
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/ready"
    # Loading, warm-up and CUDA-graph capture get minutes, not the default 30 s.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_grace_period_matches_the_drain_timeout(deployment: dict) -> None:
    container = container_of(deployment)
    env = {e["name"]: e.get("value") for e in container["env"]}
    known = {opt.env for opt in options()}
    assert set(env) <= known, f"not mlaserve options: {set(env) - known}"
    drain = float(env.get("MLASERVE_SHUTDOWN_TIMEOUT") or ServerConfig().shutdown_timeout)
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    # Long enough to drain after the preStop pause, not so long that a hung pod lingers.
    assert pre_stop + drain < grace <= pre_stop + drain + 30


def test_pods_are_scraped_and_served(deployment: dict) -> None:
    template = deployment["spec"]["template"]
    annotations = template["metadata"]["annotations"]
    (port,) = container_of(deployment)["ports"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == port["containerPort"]
    assert annotations["prometheus.io/path"] == "/metrics"
    service = next(d for d in documents() if d["kind"] == "Service")
    assert service["spec"]["selector"].items() <= template["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["targetPort"] == port["name"]
    claims = {d["metadata"]["name"] for d in documents() if d["kind"] == "PersistentVolumeClaim"}
    used = {
        v["persistentVolumeClaim"]["claimName"]
        for v in template["spec"]["volumes"]
        if "persistentVolumeClaim" in v
    }
    assert used <= claims
    assert template["spec"]["securityContext"]["runAsNonRoot"] is True
