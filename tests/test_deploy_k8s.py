"""The Kubernetes manifests (deploy/k8s): every overlay rendered (tests/kustomize.py, and ``kubectl kustomize``
where kubectl is installed), every object valid against the Kubernetes schemas (kubernetes-validate, offline), and
the wiring checked against the code: ports, probes, selectors, the processes' real command-line parsers and
environment, the worker entrypoint's engines, the scrape config and the dashboard's metrics."""

from __future__ import annotations

import http.server
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import threading
import time
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from flying import redis_conn, settings
from gateway.main import parse_args as gateway_args
from router.main import parse_args as router_args
from tests.kustomize import Obj, Unsupported, containers, render
from worker_ext.launch import parser as worker_parser

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir())
K8S_VERSION = "1.30"


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> tuple[str, list[Obj]]:
    return request.param, render(K8S / "overlays" / request.param)


def one(objs: list[Obj], kind: str, name: str) -> Obj:
    [o] = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return o


def pod_spec(o: Obj) -> Obj:
    return o["spec"]["template"]["spec"]


def container(objs: list[Obj], kind: str, name: str) -> Obj:
    return pod_spec(one(objs, kind, name))["containers"][0]


def env_of(objs: list[Obj], c: Obj) -> dict[str, str]:
    """The container's environment from its ConfigMaps and literal values (downward-API values left out)."""
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        env.update(one(objs, "ConfigMap", src["configMapRef"]["name"])["data"])
    env.update({e["name"]: e["value"] for e in c.get("env", []) if "value" in e})
    return env


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' ``$(VAR)`` expansion of a container's args."""
    return [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in args]


def test_the_overlays_exist_and_the_renderer_refuses_what_it_does_not_implement(tmp_path):
    assert {"one-node", "multi-node"} <= set(OVERLAYS)
    (tmp_path / "kustomization.yaml").write_text("commonLabels: {a: b}\n")
    with pytest.raises(Unsupported, match="commonLabels"):
        render(tmp_path)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_the_renderer_matches_kubectl_kustomize(overlay):
    name, objs = overlay
    out = subprocess.run(["kubectl", "kustomize", str(K8S / "overlays" / name)], capture_output=True,
                         text=True, check=True, timeout=60).stdout  # fmt: skip
    theirs = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(out) if o}
    mine = {(o["kind"], o["metadata"]["name"]): o for o in objs}
    assert mine.keys() == theirs.keys()
    for key, o in mine.items():
        assert o == theirs[key], key


def test_every_object_is_valid_against_the_kubernetes_schemas(overlay):
    _, objs = overlay
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "StatefulSet", "Service", "HorizontalPodAutoscaler", "ConfigMap"} <= kinds
    for o in objs:
        kubernetes_validate.validate(o, K8S_VERSION, strict=True)


def test_the_validator_rejects_a_wrong_field():
    bad = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}, "spec": {"portz": []}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_selectors_match_their_pods_and_services_reach_named_container_ports(overlay):
    _, objs = overlay
    workloads = [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]
    for w in workloads:
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert w["spec"]["selector"]["matchLabels"].items() <= labels.items(), w["metadata"]["name"]
        if w["kind"] == "StatefulSet":
            svc = one(objs, "Service", w["spec"]["serviceName"])
            assert svc["spec"]["clusterIP"] == "None", (
                "a StatefulSet's pods are named through a headless Service"
            )
    for svc in (o for o in objs if o["kind"] == "Service"):
        pods = [w for w in workloads if svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]  # fmt: skip
        assert pods, f"Service {svc['metadata']['name']} selects no pods"
        names = {p["name"]: p["containerPort"] for w in pods for c in pod_spec(w)["containers"] for p in c.get("ports", [])}  # fmt: skip
        for port in svc["spec"]["ports"]:
            assert port["targetPort"] in names, (svc["metadata"]["name"], port)
    hpa = one(objs, "HorizontalPodAutoscaler", "gateway")
    assert one(objs, hpa["spec"]["scaleTargetRef"]["kind"], hpa["spec"]["scaleTargetRef"]["name"])
    replicas = one(objs, "Deployment", "gateway")["spec"]["replicas"]
    assert hpa["spec"]["minReplicas"] <= replicas <= hpa["spec"]["maxReplicas"]


def test_probes_use_declared_ports_and_the_health_endpoints(overlay):
    _, objs = overlay
    for c in containers(objs):
        ports = {p["name"] for p in c.get("ports", [])}
        for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
            probe = c.get(kind, {})
            for how in ("httpGet", "tcpSocket"):
                if how in probe:
                    assert probe[how]["port"] in ports, (c["name"], kind)
    gw = container(objs, "Deployment", "gateway")
    assert gw["readinessProbe"]["httpGet"]["path"] == "/health", "the gateway's /health (503 while draining)"
    assert "tcpSocket" in gw["livenessProbe"], "a Redis outage (503 on /health) must not restart gateways"
    router = container(objs, "Deployment", "router")
    assert router["livenessProbe"]["httpGet"]["path"] == "/metrics"
    worker = container(objs, "StatefulSet", "worker")
    for kind in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert worker[kind]["exec"]["command"] == ["bash", "/scripts/worker.sh", "probe"]


def test_the_processes_args_parse_with_their_real_parsers_and_read_the_shared_config(overlay, monkeypatch):
    _, objs = overlay
    config = one(objs, "ConfigMap", "flying-config")["data"]
    assert settings.REDIS_URL in config and settings.KEY_PREFIX in config
    gw = container(objs, "Deployment", "gateway")
    env = env_of(objs, gw)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert gw["command"] == ["flying-gateway"]
    g = gateway_args(expand(gw["args"], env))
    assert (g.redis_url, g.port, g.host) == (config[settings.REDIS_URL], 8000, "0.0.0.0")
    assert g.model_path == config["MODEL_PATH"] and g.served_model_name == config["MODEL_NAME"]
    assert {p["containerPort"] for p in gw["ports"]} == {g.port}
    spec = pod_spec(one(objs, "Deployment", "gateway"))
    pre = int(spec["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert spec["terminationGracePeriodSeconds"] > pre + g.drain_grace_s, "the drain ends before SIGKILL"
    router = container(objs, "Deployment", "router")
    assert router["command"] == ["flying-router"]
    r = router_args(expand(router["args"], env_of(objs, router)))
    assert r.redis_url == config[settings.REDIS_URL] and r.metrics_host == "0.0.0.0"
    assert [p["containerPort"] for p in router["ports"]] == [r.metrics_port]
    assert one(objs, "Deployment", "router")["spec"]["replicas"] == 2, "active and standby"


def worker_env(objs: list[Obj], ordinal: int, bin_dir: Path) -> dict[str, str]:
    c = container(objs, "StatefulSet", "worker")
    return {**env_of(objs, c), "POD_NAME": f"worker-{ordinal}", "POD_IP": "10.1.2.3",
            "NODE_NAME": f"gpu-node-{ordinal}", "PATH": f"{bin_dir}:{os.environ['PATH']}"}  # fmt: skip


def started_engines(objs: list[Obj], ordinal: int, tmp_path: Path) -> list[list[str]]:
    """The flying-worker command lines scripts/worker.sh starts in pod ``worker-{ordinal}``, CUDA_VISIBLE_DEVICES
    first (a stand-in flying-worker on PATH records them and waits for SIGTERM); then the pod is stopped as the
    kubelet stops it, and every engine must have been sent SIGTERM (their drain) and the script exit 0."""
    bin_dir, log, stopped = tmp_path / "bin", tmp_path / f"argv-{ordinal}", tmp_path / f"stopped-{ordinal}"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "flying-worker"
    fake.write_text(f"""#!/bin/bash
trap 'echo "$CUDA_VISIBLE_DEVICES" >> {stopped}; exit 0' TERM
echo "$CUDA_VISIBLE_DEVICES $*" >> {log}
sleep 30 &
wait
""")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    script = tmp_path / "worker.sh"
    script.write_text(one(objs, "ConfigMap", "flying-scripts")["data"]["worker.sh"])
    gpus = int(env_of(objs, container(objs, "StatefulSet", "worker"))["GPUS_PER_NODE"])
    proc = subprocess.Popen(["bash", str(script)], env=worker_env(objs, ordinal, bin_dir))
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and len(lines(log)) < gpus:
            time.sleep(0.05)
        time.sleep(0.2)  # every stand-in has set its trap
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, "a SIGTERM'd pod ends cleanly once its engines stopped"
    finally:
        if proc.poll() is None:
            proc.kill()
    assert sorted(lines(stopped)) == sorted(str(i) for i in range(gpus)), "every engine got SIGTERM"
    return sorted((line.split() for line in lines(log)), key=lambda r: int(r[0]))


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_each_worker_pod_starts_one_engine_per_gpu_with_cluster_wide_indices(overlay, tmp_path, monkeypatch):
    _, objs = overlay
    sts = one(objs, "StatefulSet", "worker")
    c = container(objs, "StatefulSet", "worker")
    env = env_of(objs, c)
    gpus, nodes = int(env["GPUS_PER_NODE"]), sts["spec"]["replicas"]
    assert next(e["valueFrom"] for e in c["env"] if e["name"] == "NODE_NAME") == {
        "fieldRef": {"fieldPath": "spec.nodeName"}
    }, "the engines announce the node the pod runs on"
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == gpus
    assert pod_spec(sts)["nodeSelector"] and pod_spec(sts)["affinity"]["podAntiAffinity"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert len(ports) == gpus and set(ports.values()) == {int(env["ENGINE_PORT"]) + i for i in range(gpus)}
    engines, pools = set(), {}
    for ordinal in range(nodes):
        runs = started_engines(objs, ordinal, tmp_path)
        assert [int(r[0]) for r in runs] == list(range(gpus)), "one GPU each"
        for name, value in env.items():  # the pod's environment, which the parser's defaults read
            monkeypatch.setenv(name, value)
        for run in runs:
            a = worker_parser().parse_args(run[1:])
            assert a.host == "10.1.2.3" and a.port in ports.values()
            assert a.redis_url == env[settings.REDIS_URL] and a.device == "cuda" and a.enable_metrics
            assert a.comm_port is not None and a.comm_host == "127.0.0.1", "binds, rendezvous inside the pod"
            # the pod's engines are one pool of their own, on the pod's node
            assert (a.node, a.first_engine, a.num_engines) == (f"gpu-node-{ordinal}", ordinal * gpus, gpus)
            assert a.first_engine <= a.engine < a.first_engine + a.num_engines
            assert a.engine not in engines, "every engine index once across the pods"
            engines.add(a.engine)
            pools.setdefault((a.node, a.first_engine, a.num_engines), set()).add(a.engine)
    assert engines == set(range(nodes * gpus))
    assert len(pools) == nodes and all(len(p) == gpus for p in pools.values()), "a pool per pod, none across"
    grace = int(env["DRAIN_GRACE_S"])
    assert pod_spec(sts)["terminationGracePeriodSeconds"] > grace, "the engines' drain ends before SIGKILL"


def consecutive_free_ports(n: int) -> int:
    for base in range(42000, 60000, 10):
        socks = []
        try:
            for i in range(n):
                s = socket.socket()
                s.bind(("127.0.0.1", base + i))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free ports")


def test_the_worker_probe_passes_only_while_every_engine_answers_health(tmp_path):
    objs = render(K8S / "overlays" / "one-node")
    script = tmp_path / "worker.sh"
    script.write_text(one(objs, "ConfigMap", "flying-scripts")["data"]["worker.sh"])
    base = consecutive_free_ports(2)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    def probe() -> int:
        env = {**os.environ, "GPUS_PER_NODE": "2", "ENGINE_PORT": str(base)}
        return subprocess.run(
            ["bash", str(script), "probe"], env=env, timeout=30, capture_output=True
        ).returncode

    servers = [http.server.HTTPServer(("127.0.0.1", base), Health)]
    threading.Thread(target=servers[0].serve_forever, daemon=True).start()
    try:
        assert probe() != 0, "engine 1 does not answer"
        servers.append(http.server.HTTPServer(("127.0.0.1", base + 1), Health))
        threading.Thread(target=servers[1].serve_forever, daemon=True).start()
        assert probe() == 0
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()


def test_redis_runs_with_sentinels_behind_the_names_the_processes_use(overlay):
    _, objs = overlay
    redis = one(objs, "StatefulSet", "redis")
    assert redis["spec"]["replicas"] == 3 and {c["name"] for c in pod_spec(redis)["containers"]} == {"redis", "sentinel"}  # fmt: skip
    url = one(objs, "ConfigMap", "flying-config")["data"][settings.REDIS_URL]
    assert url.startswith("redis+sentinel://redis-sentinel:26379/mymaster/")
    assert redis_conn.parse(url).master == "mymaster"  # the processes' own parser takes it
    scripts = one(objs, "ConfigMap", "flying-scripts")["data"]
    assert "redis-sentinel" in scripts["redis.sh"] and one(objs, "Service", "redis-sentinel")
    assert "sentinel monitor" in scripts["sentinel.sh"]


def test_grafana_and_prometheus_reuse_the_compose_files_and_scrape_every_process(overlay):
    _, objs = overlay
    grafana = ROOT / "deploy" / "grafana"
    dash = one(objs, "ConfigMap", "grafana-dashboards")["data"]["flying-serving.json"]
    assert dash == (grafana / "dashboards" / "flying-serving.json").read_text(), "a copy: keep them identical"
    prov = one(objs, "ConfigMap", "grafana-provisioning")["data"]
    assert prov["datasource.yml"] == (grafana / "provisioning" / "datasources" / "prometheus.yml").read_text()
    assert prov["dashboards.yml"] == (grafana / "provisioning" / "dashboards" / "flying.yml").read_text()
    assert one(objs, "Service", "prometheus")["spec"]["ports"][0]["port"] == 9090, "the datasource's URL"
    prom = yaml.safe_load(one(objs, "ConfigMap", "prometheus-config")["data"]["prometheus.yml"])
    compose = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    assert jobs.keys() == {j["job_name"] for j in compose["scrape_configs"]}
    for job, j in jobs.items():
        keep = {r["source_labels"][0]: r["regex"] for r in j["relabel_configs"] if r.get("action") == "keep"}
        component = keep["__meta_kubernetes_pod_label_app_kubernetes_io_component"]
        kind = "StatefulSet" if component == "worker" else "Deployment"
        c = container(objs, kind, component)
        names = [p["name"] for p in c["ports"] if re.fullmatch(keep["__meta_kubernetes_pod_container_port_name"], p["name"])]  # fmt: skip
        assert names, f"job {job} scrapes no port"


def test_every_metric_on_the_dashboard_exists_in_the_code():
    dash = (ROOT / "deploy" / "grafana" / "dashboards" / "flying-serving.json").read_text()
    names = set(re.findall(r"\b(flying_[a-z_]+)", dash))
    code = "".join(p.read_text() for p in [*ROOT.glob("gateway/*.py"), *ROOT.glob("router/*.py")])
    assert names
    for name in names:
        base = re.sub(r"_(total|bucket|sum|count)$", "", name)
        assert f'"{base}"' in code or f'"{name}"' in code, f"{name} is not a metric of the gateway or router"
