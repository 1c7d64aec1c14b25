"""The Dockerfile and docker-compose.yml ask only for what the CLI accepts (Docker cannot run here)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from skyring.cli import build_parser, settings_from_args
from skyring.settings import ENV_PREFIX, FIELDS

ROOT = Path(__file__).resolve().parents[2]
KNOWN_VARIABLES = {ENV_PREFIX + f.name.upper() for f in FIELDS}


def dockerfile_instruction(name: str) -> str:
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    [value] = re.findall(rf"^{name}\s+(.*)$", text, flags=re.MULTILINE)
    return value.strip()


def image_env() -> dict[str, str]:
    env: dict[str, str] = {}
    text = (ROOT / "Dockerfile").read_text().replace("\\\n", " ")
    for line in re.findall(r"^ENV\s+(.*)$", text, flags=re.MULTILINE):
        env.update(dict(re.findall(r"(\w+)=(\S+)", line)))
    return env


def compose_services() -> dict[str, dict]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def skyring_services() -> list[tuple[str, dict]]:
    return [(name, svc) for name, svc in compose_services().items() if svc.get("build")]


def test_image_runs_skyring_serve_with_valid_settings():
    """The image's entrypoint and default command parse, and its environment is valid settings."""
    argv = json.loads(dockerfile_instruction("ENTRYPOINT"))[1:] + json.loads(dockerfile_instruction("CMD"))
    env = image_env()

    args = build_parser().parse_args(argv)
    settings = settings_from_args(args, env)

    assert json.loads(dockerfile_instruction("ENTRYPOINT")) == ["skyring"]
    assert args.command == "serve"
    assert {k for k in env if k.startswith(ENV_PREFIX)} <= KNOWN_VARIABLES
    assert settings.host == "0.0.0.0"
    assert f"EXPOSE {settings.port}" in (ROOT / "Dockerfile").read_text()
    assert "/ping" in dockerfile_instruction("HEALTHCHECK")


@pytest.mark.parametrize(("name", "service"), skyring_services())
def test_compose_service_command_and_environment_are_accepted(name, service):
    """Each skyring service's command and SKYRING_* variables are ones the CLI accepts."""
    env = {**image_env(), **{k: str(v) for k, v in service.get("environment", {}).items()}}
    args = build_parser().parse_args(service.get("command", json.loads(dockerfile_instruction("CMD"))))

    settings = settings_from_args(args, env)

    assert {k for k in service.get("environment", {}) if k.startswith(ENV_PREFIX)} <= KNOWN_VARIABLES
    assert settings.host == "0.0.0.0"
    published = {int(p.split(":")[-1]) for p in service.get("ports", [])}
    assert published == {settings.port}
    assert f":{settings.port}/ping" in " ".join(service["healthcheck"]["test"])
    if settings.storage == "sqlite":
        mounts = [v.split(":")[1] for v in service.get("volumes", [])]
        assert settings.data_dir in mounts


def test_compose_runs_a_cluster_on_host_ports_8080_to_8082():
    """Three nodes, each published on its own host port, with distinct ids, data volumes and peer addresses."""
    services = skyring_services()
    host_ports = sorted(int(p.split(":")[0]) for _, svc in services for p in svc["ports"])
    node_ids = {svc["command"][svc["command"].index("--node-id") + 1] for _, svc in services}
    volumes = {svc["volumes"][0].split(":")[0] for _, svc in services}
    advertised = {svc["command"][svc["command"].index("--advertise-host") + 1] for _, svc in services}

    assert host_ports == [8080, 8081, 8082]
    assert len(node_ids) == len(volumes) == 3
    assert advertised == {name for name, _ in services}


@pytest.mark.parametrize(("name", "service"), skyring_services())
def test_compose_nodes_reach_the_nats_service(name, service):
    """SKYRING_NATS names the compose NATS service on its client port, with JetStream on for later."""
    nats = compose_services()["nats"]
    url = service["environment"]["SKYRING_NATS"]

    assert url == "nats://nats:4222"
    assert "--jetstream" in nats["command"]
    assert service["depends_on"]["nats"]["condition"] == "service_healthy"
