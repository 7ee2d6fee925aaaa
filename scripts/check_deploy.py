#!/usr/bin/env python3
"""Checks the manifests `kubectl kustomize` rendered from deploy/ (called by
scripts/check-deploy, which installs what this needs).

Every object must pass a check; an object of a kind nobody checks is an error:
- built-in kinds: kubernetes-validate, strict (unknown fields refused), against
  the pinned Kubernetes version;
- EnvoyFilter: the openAPIV3Schema of Istio's CRD (vendored in
  scripts/schemas, with its source commit);
- PrometheusRule: its spec goes to `promtool check rules` (the caller runs it
  on the files written to --rules-out);
- PodMonitor: the fields a scrape needs (a hand-written subset of the
  operator's schema);
- CustomResourceDefinition-less kinds of nobody: refused.

Also checks facts that tie files together: each gateway overlay
(deploy/gateway/*) selects and admits one namespace and one set of pod labels,
no NetworkPolicy admits every namespace, the gateways' token is one the
validator accepts, the
validator image tag is the workspace version and its user is the image's,
the module version and sha256 are well-formed and agree across deploy/, and
every metric the alerts and the dashboard use is documented in docs/metrics.md.
"""

import argparse
import json
import pathlib
import re
import sys

import jsonschema
import kubernetes_validate
import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent
problems = []


def problem(where, what):
    problems.append(f"{where}: {what}")


def crd_schema(path, version):
    for doc in yaml.safe_load_all(path.read_text()):
        if doc and doc.get("kind") == "CustomResourceDefinition":
            for v in doc["spec"]["versions"]:
                if v["name"] == version:
                    return v["schema"]["openAPIV3Schema"]
    raise SystemExit(f"{path}: no version {version}")


def strip_k8s_extensions(schema):
    """jsonschema does not know the x-kubernetes-* keywords; they only relax
    (preserve-unknown-fields, int-or-string) or add CEL rules, checked below
    where they matter."""
    if isinstance(schema, dict):
        out = {k: strip_k8s_extensions(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
        if schema.get("x-kubernetes-int-or-string"):
            out.pop("type", None)
            out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        if schema.get("type") == "object" and "properties" in schema and not schema.get(
            "x-kubernetes-preserve-unknown-fields"
        ) and "additionalProperties" not in schema:
            # Strict: the API server prunes unknown fields of a structural
            # schema, silently dropping a typo; refuse them here instead.
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [strip_k8s_extensions(s) for s in schema]
    return schema


# prometheus-operator's PodMonitor, the fields a scrape needs (a subset of the
# operator's CRD, written here: the CRD itself is not vendored).
PODMONITOR_SCHEMA = {
    "type": "object",
    "required": ["spec"],
    "properties": {
        "spec": {
            "type": "object",
            "required": ["selector", "podMetricsEndpoints"],
            "properties": {
                "selector": {"type": "object", "minProperties": 1},
                "namespaceSelector": {"type": "object"},
                "podMetricsEndpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["port"],
                        "properties": {
                            "port": {"type": "string", "minLength": 1},
                            "path": {"type": "string", "pattern": "^/"},
                            "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                        },
                    },
                },
            },
        }
    },
}


def check_envoyfilter(where, obj, schema):
    body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
    for err in jsonschema.Draft7Validator(schema).iter_errors(body):
        problem(where, f"EnvoyFilter schema: {'/'.join(map(str, err.path))}: {err.message}")
    for i, p in enumerate(obj.get("spec", {}).get("configPatches", [])):
        # The CRD's CEL rules that matter here, by hand.
        if p.get("applyTo") in ("HTTP_FILTER", "NETWORK_FILTER") and p.get("patch", {}).get(
            "operation"
        ) == "MERGE" and not p.get("match", {}).get("listener"):
            problem(where, f"configPatches[{i}]: a filter MERGE needs a listener match")
        # Istio's MERGE appends lists: a second matching EnvoyFilter (a canary,
        # a copy in another namespace) would put the upstream filters in twice
        # and Envoy would refuse the listener. The router is REPLACEd instead.
        if p.get("applyTo") == "HTTP_FILTER" and p.get("patch", {}).get("operation") == "MERGE" and (
            "upstream_http_filters" in json.dumps(p.get("patch", {}).get("value", {}))
        ):
            problem(where, f"configPatches[{i}]: upstream_http_filters by MERGE is not idempotent; REPLACE the router")
    body = {k: v for k, v in obj.items() if k != "metadata"}
    if "istio-system" in json.dumps(body):
        problem(where, "names istio-system: the namespace comes from the kustomization")


def check_gateway_overlay(path, objs):
    """A rendered deploy/gateway/<install>: its EnvoyFilter and the
    NetworkPolicies that admit the gateway pods name one namespace and one set
    of pod labels, and no policy admits every namespace."""
    where = path.name
    efs = [o for o in objs if o.get("kind") == "EnvoyFilter"]
    if len(efs) != 1:
        problem(where, f"a gateway overlay renders one EnvoyFilter, not {len(efs)}")
        return
    ns = efs[0]["metadata"].get("namespace")
    labels = efs[0]["spec"].get("workloadSelector", {}).get("labels")
    if not ns or not labels:
        problem(where, "the EnvoyFilter needs the gateway's namespace and a workloadSelector")
    admitted = set()
    for o in objs:
        if o.get("kind") != "NetworkPolicy":
            continue
        pods = o["spec"]["podSelector"]["matchLabels"].get("app.kubernetes.io/name")
        for rule in o["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                peer_ns = peer.get("namespaceSelector", {}).get("matchLabels", {})
                if peer_ns.get("kubernetes.io/metadata.name") != ns:
                    problem(where, f"NetworkPolicy/{o['metadata']['name']}: admits {peer_ns or 'every namespace'}, not the gateway's namespace {ns}")
                if peer.get("podSelector", {}).get("matchLabels") != labels:
                    problem(where, f"NetworkPolicy/{o['metadata']['name']}: pod labels differ from the EnvoyFilter's {labels}")
            admitted.add(pods)
    for pods in ("staleguard-validator", "staleguard-module"):
        if pods not in admitted:
            problem(where, f"no NetworkPolicy admits the gateway to {pods}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kubernetes-version", required=True)
    ap.add_argument("--rules-out", required=True)
    ap.add_argument("rendered", nargs="+")
    args = ap.parse_args()

    ef_schema = strip_k8s_extensions(
        crd_schema(ROOT / "scripts/schemas/istio-envoyfilter-crd.yaml", "v1alpha3")
    )
    rules_out = pathlib.Path(args.rules_out)
    rules_out.mkdir(parents=True, exist_ok=True)
    counts = {}
    for path in map(pathlib.Path, args.rendered):
        objs = [o for o in yaml.safe_load_all(path.read_text()) if o]
        if path.name.startswith("deploy-gateway-"):
            check_gateway_overlay(path, objs)
        for o in objs:
            for rule in o.get("spec", {}).get("ingress", []) if o.get("kind") == "NetworkPolicy" else []:
                if any(peer.get("namespaceSelector") == {} for peer in rule.get("from", [])):
                    problem(f"{path.name} NetworkPolicy/{o['metadata']['name']}", "namespaceSelector: {} admits every namespace; name the gateway's")
        for n, obj in enumerate(yaml.safe_load_all(path.read_text())):
            if not obj:
                continue
            kind = obj.get("kind", "?")
            where = f"{path.name}#{n} {kind}/{obj.get('metadata', {}).get('name', '?')}"
            counts[kind] = counts.get(kind, 0) + 1
            if kind == "EnvoyFilter":
                check_envoyfilter(where, obj, ef_schema)
            elif kind == "PodMonitor":
                for err in jsonschema.Draft7Validator(PODMONITOR_SCHEMA).iter_errors(obj):
                    problem(where, f"PodMonitor: {'/'.join(map(str, err.path))}: {err.message}")
            elif kind == "PrometheusRule":
                name = f"{path.stem}-{obj['metadata']['name']}.rules.yaml"
                (rules_out / name).write_text(yaml.safe_dump(obj["spec"]))
            elif "." in obj.get("apiVersion", "").split("/")[0] and not obj["apiVersion"].split(
                "/"
            )[0].endswith(".k8s.io"):
                problem(where, f"no schema to check {obj['apiVersion']} {kind} against")
            else:
                try:
                    kubernetes_validate.validate(obj, args.kubernetes_version, strict=True)
                except Exception as e:  # noqa: BLE001 - every failure is reported
                    problem(where, f"Kubernetes {args.kubernetes_version} schema: {e}")

    # Files that must agree.
    # The validator's file holds one token per line, two while rotating; the
    # gateways' token must be one of them.
    accepted = [l.strip() for l in (ROOT / "deploy/validator/token.txt").read_text().splitlines() if l.strip()]
    clients = sorted(f for f in ROOT.glob("deploy/*/token.txt") if f.parent.name != "validator")
    if not clients:
        problem("deploy/", "no client token file (deploy/istio/token.txt) found")
    for client in clients:
        if client.read_text().strip() not in accepted:
            problem(str(client.relative_to(ROOT)), "is not one of the tokens in deploy/validator/token.txt")

    cargo = (ROOT / "Cargo.toml").read_text()
    version = re.search(r'^version = "([^"]+)"', cargo, re.M).group(1)
    deployment = (ROOT / "deploy/validator/deployment.yaml").read_text()
    image = re.search(r"image: (\S+)", deployment).group(1)
    if image != f"ghcr.io/staleguard/staleguard-validator:{version}":
        problem("deploy/validator/deployment.yaml", f"image {image} is not the Dockerfile's tag for version {version}")
    dockerfile = (ROOT / "Dockerfile").read_text()
    if "USER 65532:65532" not in dockerfile or "runAsUser: 65532" not in deployment:
        problem("Dockerfile", "the image's user and the Deployment's runAsUser must both be 65532")
    if f"ghcr.io/staleguard/staleguard-validator:{version}" not in dockerfile:
        problem("Dockerfile", f"its build command does not name the tag for version {version}")

    ef = (ROOT / "deploy/istio/envoyfilter.yaml").read_text()
    uri = re.search(r"uri: (\S+)", ef)
    sha = re.search(r"sha256: ([0-9a-f]+)\s*$", ef, re.M)
    if not uri or not uri.group(1).endswith(f"/staleguard_filter-{version}.wasm"):
        problem("deploy/istio/envoyfilter.yaml", f"the module URI must end in staleguard_filter-{version}.wasm")
    if not sha or len(sha.group(1)) != 64:
        problem("deploy/istio/envoyfilter.yaml", "sha256 must be 64 lowercase hex digits")
    module = (ROOT / "deploy/module/deployment.yaml").read_text()
    if f"name: staleguard-filter-{version}" not in module:
        problem("deploy/module/deployment.yaml", f"does not serve ConfigMap staleguard-filter-{version}")

    docs = (ROOT / "docs/metrics.md").read_text()
    used = set()
    watched = sorted(
        str(f.relative_to(ROOT))
        for pattern in ("deploy/monitoring/*", "deploy/audit/alerts.yaml")
        for f in ROOT.glob(pattern)
        if f.suffix in (".yaml", ".json") and f.name != "kustomization.yaml"
    )
    for p in watched:
        used |= {(p, m) for m in re.findall(r"staleguard_(?:filter|validator)_[a-z_]+", (ROOT / p).read_text())}
    for p, m in sorted(used):
        base = re.sub(r"_(bucket|sum|count)$", "", m)
        if f"`{base}`" not in docs:
            problem(p, f"uses {m}, which docs/metrics.md does not document")
    if not any(m.startswith("staleguard_filter_") for _, m in used):
        problem("deploy/monitoring", "no alert or panel uses a filter series")

    print("checked: " + ", ".join(f"{v} {k}" for k, v in sorted(counts.items())))
    if problems:
        print(f"{len(problems)} problem(s):", file=sys.stderr)
        for p in problems:
            print(f"  {p}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
