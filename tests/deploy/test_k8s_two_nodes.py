"""deploy/k8s/two-nodes: the LeaderWorkerSet of two nodes, linted offline.

LeaderWorkerSet is a CRD: kubernetes-validate has no schema for it (its CLI only warns). So its
two pod templates are validated strictly against the Kubernetes schemas (as a v1 PodTemplate
each), its own fields against the subset of the leaderworkerset.x-k8s.io/v1 schema it uses
(`LWS_SPEC` below, unknown fields refused), and its wiring against the server: the options
parse as `mlaserve serve` would read them on each node, the Service reaches the leader only, and
the GPUs per pod are the ranks per node."""

from __future__ import annotations

import jsonschema
import pytest
import yaml

from mlaserve.config.multi_node import parse_dist_init_addr
from mlaserve.service.cli import parse_settings
from mlaserve.service.settings import options
from tests.deploy.dashboard import REPO_ROOT

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="pip install kubernetes-validate"
)

MANIFEST = REPO_ROOT / "deploy" / "k8s" / "two-nodes" / "leaderworkerset.yaml"
SERVICE = REPO_ROOT / "deploy" / "k8s" / "service.yaml"
KUBERNETES_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())

_TEMPLATE = {"type": "object"}  # validated by kubernetes-validate, as a PodTemplate
# The fields of leaderworkerset.x-k8s.io/v1 this manifest uses, as the CRD defines them
# (kubernetes-sigs/lws, api/leaderworkerset/v1/leaderworkerset_types.go).
LWS_SPEC = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"},
        "kind": {"const": "LeaderWorkerSet"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["leaderWorkerTemplate"],
            "properties": {
                "replicas": {"type": "integer", "minimum": 0},
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "rolloutStrategy": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "type": {"enum": ["RollingUpdate"]},
                        "rollingUpdateConfiguration": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "maxUnavailable": {"type": ["integer", "string"]},
                                "maxSurge": {"type": ["integer", "string"]},
                            },
                        },
                    },
                },
                "leaderWorkerTemplate": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["workerTemplate"],
                    "properties": {
                        "size": {"type": "integer", "minimum": 1},
                        "restartPolicy": {"enum": ["RecreateGroupOnPodRestart", "None"]},
                        "leaderTemplate": _TEMPLATE,
                        "workerTemplate": _TEMPLATE,
                    },
                },
            },
        },
    },
}


@pytest.fixture(scope="module")
def lws() -> dict:
    (doc,) = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    return doc


def _templates(lws: dict) -> dict[str, dict]:
    t = lws["spec"]["leaderWorkerTemplate"]
    return {"leader": t["leaderTemplate"], "worker": t["workerTemplate"]}


def _container(template: dict) -> dict:
    (container,) = template["spec"]["containers"]
    return container


def test_kubernetes_validate_knows_no_schema_for_the_crd(lws: dict) -> None:
    # Why the pieces are validated apart: if this ever passes, validate the whole document.
    with pytest.raises(kubernetes_validate.utils.SchemaNotFoundError):
        kubernetes_validate.validate(lws, KUBERNETES_VERSIONS[-1], strict=True)


def test_the_crd_fields_follow_the_lws_schema(lws: dict) -> None:
    jsonschema.validate(lws, LWS_SPEC)
    misspelt = {**lws, "spec": {**lws["spec"], "startPolicy": "LeaderCreated"}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(misspelt, LWS_SPEC)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("role", ["leader", "worker"])
def test_pod_templates_validate_against_the_schemas(lws: dict, role: str, version: str) -> None:
    template = _templates(lws)[role]
    doc = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role},
           "template": template}  # fmt: skip
    kubernetes_validate.validate(doc, version, strict=True)
    broken = yaml.safe_load(yaml.safe_dump(doc))
    _container(broken["template"])["readynessProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


def _settings(container: dict, worker_index: int):
    """What `mlaserve serve` reads on that pod (LWS's variables substituted as the kubelet does)."""
    lws_env = {"LWS_LEADER_ADDRESS": "mlaserve-two-nodes-0.mlaserve-two-nodes",
               "LWS_WORKER_INDEX": str(worker_index)}  # fmt: skip
    args = []
    for arg in container["args"]:
        for name, value in lws_env.items():
            arg = arg.replace(f"$({name})", value)
        args.append(arg)
    env = {e["name"]: e["value"] for e in container["env"]}
    known = {opt.env for opt in options()}
    assert set(env) <= known, f"not mlaserve options: {set(env) - known}"
    _, settings = parse_settings(["serve", *args], env)
    return settings


def test_each_node_gets_its_rank_and_the_leaders_store(lws: dict) -> None:
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    templates = _templates(lws)
    leader = _settings(_container(templates["leader"]), 0).engine
    worker = _settings(_container(templates["worker"]), 1).engine
    assert (leader.node_rank, worker.node_rank) == (0, 1)
    assert leader.nnodes == worker.nnodes == size
    assert leader.dist_init_addr == worker.dist_init_addr
    _, port = parse_dist_init_addr(leader.dist_init_addr)
    ports = {p["name"]: p["containerPort"] for p in _container(templates["leader"])["ports"]}
    assert ports["dist"] == port
    assert leader.tensor_parallel_size == worker.tensor_parallel_size
    for template in templates.values():
        gpus = _container(template)["resources"]["limits"]["nvidia.com/gpu"]
        assert gpus == leader.tensor_parallel_size // size  # one GPU per rank of the node


def test_the_service_reaches_the_ready_leader_only(lws: dict) -> None:
    service = yaml.safe_load(SERVICE.read_text())
    selector = service["spec"]["selector"].items()
    templates = _templates(lws)
    assert selector <= templates["leader"]["metadata"]["labels"].items()
    assert not selector <= templates["worker"]["metadata"]["labels"].items()
    leader = _container(templates["leader"])
    assert leader["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert leader["livenessProbe"]["httpGet"]["path"] == "/health"
    # the worker serves no HTTP: its liveness is its process (the launcher exits on failure)
    worker = _container(templates["worker"])
    assert not {"readinessProbe", "livenessProbe", "startupProbe"} & set(worker)
    restart = lws["spec"]["leaderWorkerTemplate"]["restartPolicy"]
    assert restart == "RecreateGroupOnPodRestart"  # a rank cannot rejoin a running group
