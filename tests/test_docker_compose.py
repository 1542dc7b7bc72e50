"""docker-compose.yml cannot run here (no Docker engine, no GPU); check it parses and names real commands."""

import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_compose_services_and_commands_exist():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"redis", "router", "gateway", "worker0", "worker1"} <= set(services)
    scripts = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])
    for name, svc in services.items():
        if name == "redis":
            continue
        assert svc["command"][0] in scripts, f"{name} runs {svc['command'][0]}, not a console script"
    for i in (0, 1):
        w = services[f"worker{i}"]
        assert w["command"][w["command"].index("--engine") + 1] == str(i)
        [dev] = w["deploy"]["resources"]["reservations"]["devices"]
        assert dev["device_ids"] == [str(i)] and "gpu" in dev["capabilities"]
        assert "${MODEL_PATH}" in w["command"]
