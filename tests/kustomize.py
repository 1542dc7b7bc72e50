"""A small kustomize for the tests: renders deploy/k8s's overlays without kubectl, for the subset they use
(``resources``, ``namespace``, ``configMapGenerator`` with files and ``disableNameSuffixHash``, ``images``,
``replicas``, ``patches`` of JSON6902 operations with a kind/name target). Anything else is an error, so an overlay
that grows beyond the subset fails here instead of rendering wrong. tests/test_deploy_k8s.py compares it with
``kubectl kustomize`` where kubectl is installed."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

Obj = dict[str, Any]
KNOWN = {"apiVersion", "kind", "resources", "namespace", "configMapGenerator", "generatorOptions", "images",
         "replicas", "patches"}  # fmt: skip
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass"}


class Unsupported(ValueError):
    """The kustomization uses something this renderer does not implement."""


def render(directory: Path) -> list[Obj]:
    """The objects ``kubectl kustomize directory`` prints (as parsed YAML, in no particular order)."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    if extra := set(k) - KNOWN:
        raise Unsupported(f"{directory}: kustomization fields {sorted(extra)}")
    objs: list[Obj] = []
    for res in k.get("resources", []):
        path = directory / res
        if path.is_dir():
            objs += render(path)
        else:
            objs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    objs += generate(directory, k)
    for p in k.get("patches", []):
        patch_targets(objs, p)
    if ns := k.get("namespace"):
        for o in objs:
            if o["kind"] not in CLUSTER_SCOPED:
                o["metadata"]["namespace"] = ns
    for image in k.get("images", []):
        set_image(objs, image)
    for r in k.get("replicas", []):
        hits = [o for o in objs if o["metadata"]["name"] == r["name"] and "replicas" in o.get("spec", {})]
        if not hits:
            raise Unsupported(f"replicas: no object named {r['name']} has spec.replicas")
        for o in hits:
            o["spec"]["replicas"] = r["count"]
    return objs


def generate(directory: Path, k: Obj) -> list[Obj]:
    gens = k.get("configMapGenerator", [])
    if gens and not k.get("generatorOptions", {}).get("disableNameSuffixHash"):
        raise Unsupported("configMapGenerator without disableNameSuffixHash (name hashes)")
    out = []
    for g in gens:
        if set(g) - {"name", "files"}:
            raise Unsupported(f"configMapGenerator fields {sorted(set(g) - {'name', 'files'})}")
        data = {Path(f).name: (directory / f).read_text() for f in g["files"]}
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": g["name"]}, "data": data})
    return out


def patch_targets(objs: list[Obj], p: Obj) -> None:
    target = p["target"]
    if set(target) - {"kind", "name"} or set(p) - {"target", "patch"}:
        raise Unsupported(f"patch {p}: only an inline JSON6902 patch with a kind/name target")
    hits = [o for o in objs if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]]
    if not hits:
        raise Unsupported(f"patch target {target} matches nothing")
    for o in hits:
        for op in yaml.safe_load(p["patch"]):
            json6902(o, op)


def json6902(obj: Obj, op: Obj) -> None:
    """One JSON patch operation (add, replace, remove) on ``obj``."""
    *parents, last = [x.replace("~1", "/").replace("~0", "~") for x in op["path"].lstrip("/").split("/")]
    node: Any = obj
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    kind = op["op"]
    if isinstance(node, list):
        i = len(node) if last == "-" else int(last)
        if kind == "add":
            node.insert(i, copy.deepcopy(op["value"]))
        elif kind == "replace":
            node[i] = copy.deepcopy(op["value"])
        elif kind == "remove":
            del node[i]
        else:
            raise Unsupported(f"JSON patch op {kind}")
    elif kind in ("add", "replace"):
        if kind == "replace" and last not in node:
            raise Unsupported(f"replace of a missing path {op['path']}")
        node[last] = copy.deepcopy(op["value"])
    elif kind == "remove":
        del node[last]
    else:
        raise Unsupported(f"JSON patch op {kind}")


def set_image(objs: list[Obj], image: Obj) -> None:
    for c in containers(objs):
        name, _, tag = c["image"].partition(":")
        if name == image["name"]:
            c["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"


def containers(objs: list[Obj]) -> list[Obj]:
    """Every container of every pod template."""
    out = []
    for o in objs:
        spec = o.get("spec", {}).get("template", {}).get("spec", {})
        out += spec.get("containers", []) + spec.get("initContainers", [])
    return out
