"""docker-compose.yml cannot run here (no Docker engine, no GPU); check it parses and names real commands."""

import re
import tomllib
from pathlib import Path

import yaml

from gateway import main as gateway_main

ROOT = Path(__file__).resolve().parents[1]


def test_compose_services_and_commands_exist():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"redis", "router", "gateway", "worker0", "worker1"} <= set(services)
    scripts = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])
    for name, svc in services.items():
        if name in ("redis", "prometheus", "grafana"):
            continue
        assert svc["command"][0] in scripts, f"{name} runs {svc['command'][0]}, not a console script"
    for i in (0, 1):
        w = services[f"worker{i}"]
        assert w["command"][w["command"].index("--engine") + 1] == str(i)
        [dev] = w["deploy"]["resources"]["reservations"]["devices"]
        assert dev["device_ids"] == [str(i)] and "gpu" in dev["capabilities"]
        assert "${MODEL_PATH}" in w["command"]


def test_the_workers_commands_parse_and_let_them_bind():
    """Each worker's command is flying-worker's, with the communicator pool's rendezvous on worker0 (without
    --comm-port an engine never binds: the stack would serve in DP only)."""
    from worker_ext.launch import parser

    services = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
    for i in (0, 1):
        argv = [
            re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", a).replace("${MODEL_PATH}", "/models/m")
            for a in services[f"worker{i}"]["command"][1:]
        ]
        a = parser().parse_args(argv)
        assert (a.engine, a.num_engines, a.comm_port, a.comm_host) == (i, 2, 29500, "worker0")


def test_the_gateway_command_parses():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    argv = [
        re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", a).replace("${MODEL_PATH}", "/models/m")
        for a in compose["services"]["gateway"]["command"][1:]
    ]
    config = gateway_main.parse_args(argv)
    assert (config.host, config.port, config.workers) == ("0.0.0.0", 8000, 2)


def exported_metrics() -> set[str]:
    """Every ``flying_`` metric family our code defines (the gateway's, the router's and its collector's)."""
    import re

    names = set()
    for path in ("gateway/metrics.py", "router/metrics.py"):
        names |= set(re.findall(r'"(flying_[a-z_]+)"', (ROOT / path).read_text()))
    return names


def test_prometheus_scrapes_every_process_and_the_dashboard_uses_real_series():
    import json
    import re

    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    prom = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    targets = {t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert {t.split(":")[0] for t in targets} == {"gateway", "router", "router-standby", "worker0", "worker1"}
    for svc in ("router", "router-standby"):
        cmd = services[svc]["command"]
        assert f"{svc}:{cmd[cmd.index('--metrics-port') + 1]}" in targets
    assert all("--enable-metrics" in services[w]["command"] for w in ("worker0", "worker1"))
    dash = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "flying-serving.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {
        re.sub(r"_(total|bucket|count|sum)$", "", m) for e in exprs for m in re.findall(r"flying_[a-z_]+", e)
    }
    assert used and used <= exported_metrics(), used - exported_metrics()
