#!/usr/bin/env python3
"""Generate the replay twins of an Istio ingress gateway's guarded clusters.

With `on_reject: retry` (the default once the plugin configuration has a
`retry` block), the staleguard filter replays a rejected request without a
body through the guarded cluster's *twin*, `<cluster>|staleguard-twin`
(docs/filter.md, "Retry"). Istio makes one cluster per service and port, each
with its own EDS resource and its own mTLS transport socket (the SNI and the
SANs name the service), so the twins are generated from the gateway's own
clusters rather than written by hand:

    istioctl proxy-config cluster -n istio-ingress deploy/istio-ingress -o json \\
      | deploy/istio/twins.py --service cart.shop.svc.cluster.local \\
          --module-uri URI --module-sha256 SHA256 > twins.json
    kubectl apply --server-side -f twins.json   # an EnvoyFilter; JSON is YAML

Server-side apply: each twin is about 3.8 KB, and a client-side
`kubectl apply` keeps the whole object in the last-applied-configuration
annotation, which the API server caps at 256 KiB (about 65 twins); the
script says so on stderr past 200 KiB.

The input is either spelling of the same clusters: `istioctl proxy-config
cluster -o json` writes proto JSON names (camelCase: `edsClusterConfig`,
`typedExtensionProtocolOptions`), Envoy's /config_dump the proto field names
(snake_case). Every cluster is read into snake_case first, so the twin never
carries both spellings of a field (istiod's jsonpb would read the camelCase
copy and the twin would lose its filter chain); map keys, metadata values and
transport socket `match` values are kept as they are.

Each twin is a copy of its cluster, field for field (the transport socket
matches, so mTLS keeps working; circuit breakers, protocol options, metadata),
except:
  * its name, `<cluster><suffix>`;
  * it reads the guarded cluster's EDS resource (`eds_cluster_config.service_name`),
    so it has the same endpoints, pushed by istiod with the guarded cluster's;
  * its load balancer is `envoy.load_balancing_policies.override_host`,
    reading the header the filter names live members in (round robin as the
    fallback), and the cluster's own load balancer settings are dropped,
    `common_lb_config` too: Envoy refuses its `locality_weighted_lb_config`
    (Istio sets it with locality load balancing) beside
    `load_balancing_policy`;
  * its HttpProtocolOptions keep Istio's protocol settings and add the filter
    in its `replay_twin` role, in a VM of its own (`vm_id: staleguard-twin`).

The twins carry their own upstream filter chain, so they work whether the
guard filter is attached per cluster or through the router's
`upstream_http_filters`: a cluster's own http_filters win, and the twins are
only ever reached by the filter's callouts. The twins are a snapshot: re-run
the generator when the guarded services, their ports or their
DestinationRules change (the audit reports a twin whose settings have drifted
from its cluster's, docs/audit.md).

Standard library only; reads JSON on stdin (a list of clusters, or an object
with a "clusters" list, or an Envoy /config_dump), writes JSON on stdout.
"""

import argparse
import copy
import json
import re
import sys

LB_FIELDS = (
    "lb_policy",
    "common_lb_config",
    "least_request_lb_config",
    "round_robin_lb_config",
    "ring_hash_lb_config",
    "maglev_lb_config",
    "original_dst_lb_config",
    "lb_subset_config",
)
HPO = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
HPO_TYPE = "type.googleapis.com/" + HPO


# Fields whose value is a map (keys are names, not fields) or a
# google.protobuf.Struct (keys are data): their keys are kept as written.
MAP_FIELDS = ("typed_extension_protocol_options", "typed_filter_metadata")
VERBATIM_FIELDS = ("filter_metadata", "match", "default_subset")

# What a manifest may hold before a client-side apply's annotation overflows.
CLIENT_SIDE_APPLY_LIMIT = 200 * 1024


# Proto JSON names a rule cannot map back: an underscore before a digit.
DIGIT_FIELDS = {"consecutive5xx": "consecutive_5xx", "enforcingConsecutive5xx": "enforcing_consecutive_5xx"}


def snake(name):
    """`edsClusterConfig` -> `eds_cluster_config`; snake_case stays."""
    if name in DIGIT_FIELDS:
        return DIGIT_FIELDS[name]
    return re.sub(r"(?<=[a-z0-9])([A-Z])", lambda m: "_" + m.group(1).lower(), name)


def snake_case(value):
    """A proto JSON message in either spelling, with snake_case field names."""
    if isinstance(value, list):
        return [snake_case(v) for v in value]
    if not isinstance(value, dict):
        return value
    out = {}
    for key, v in value.items():
        field = key if key.startswith("@") else snake(key)
        if field in VERBATIM_FIELDS:
            out[field] = copy.deepcopy(v)
        elif field in MAP_FIELDS and isinstance(v, dict):
            out[field] = {k: snake_case(entry) for k, entry in v.items()}
        else:
            out[field] = snake_case(v)
    return out


def clusters_of(doc):
    """The cluster objects in istioctl's or Envoy's JSON, snake_case."""
    if isinstance(doc, list):
        return [snake_case(c) for c in doc]
    if "clusters" in doc:
        return [snake_case(c) for c in doc["clusters"]]
    out = []
    for config in doc.get("configs", []):
        for key in ("static_clusters", "dynamic_active_clusters",
                    "staticClusters", "dynamicActiveClusters"):
            out.extend(snake_case(c["cluster"]) for c in config.get(key, []))
    return out


def module_code(args):
    """The twin VM's module source: the guard's (`--module-uri` and
    `--module-sha256`, as deploy/istio/envoyfilter.yaml fetches it), or a
    local file (`--wasm`)."""
    if args.module_uri or args.module_sha256:
        if not (args.module_uri and args.module_sha256):
            sys.exit("twins.py: --module-uri and --module-sha256 go together")
        return {
            "remote": {
                "http_uri": {"uri": args.module_uri, "cluster": args.module_cluster, "timeout": "10s"},
                "sha256": args.module_sha256,
                "retry_policy": {"num_retries": 5},
            }
        }
    return {"local": {"filename": args.wasm}}


def twin(cluster, suffix, header, code):
    """The twin of one cluster (see the module docs)."""
    name = cluster["name"]
    t = copy.deepcopy(cluster)
    t["name"] = name + suffix
    if t.get("type") == "EDS":
        eds = t.setdefault("eds_cluster_config", {})
        eds["service_name"] = eds.get("service_name") or name
    elif "load_assignment" in t:
        t["load_assignment"]["cluster_name"] = name + suffix
    for field in LB_FIELDS:
        t.pop(field, None)
    t["load_balancing_policy"] = {
        "policies": [
            {
                "typed_extension_config": {
                    "name": "envoy.load_balancing_policies.override_host",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                        "override_host_sources": [{"header": header}],
                        "fallback_policy": {
                            "policies": [
                                {
                                    "typed_extension_config": {
                                        "name": "envoy.load_balancing_policies.round_robin",
                                        "typed_config": {
                                            "@type": "type.googleapis.com/envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"
                                        },
                                    }
                                }
                            ]
                        },
                    },
                }
            }
        ]
    }
    options = t.setdefault("typed_extension_protocol_options", {})
    hpo = options.setdefault(HPO, {"@type": HPO_TYPE})
    if not any(
        k in hpo
        for k in ("explicit_http_config", "use_downstream_protocol_config", "auto_config")
    ):
        hpo["explicit_http_config"] = {"http_protocol_options": {}}
    hpo["http_filters"] = [
        {
            "name": "envoy.filters.http.wasm",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
                "config": {
                    "name": "staleguard",
                    "root_id": "staleguard",
                    # No failure_policy: the default, fail closed. A twin
                    # whose module did not start fails every call, so the
                    # guard rejects: nothing unchecked reaches a host.
                    "vm_config": {
                        "vm_id": "staleguard-twin",
                        "runtime": "envoy.wasm.runtime.v8",
                        "code": code,
                    },
                    "configuration": {
                        "@type": "type.googleapis.com/google.protobuf.StringValue",
                        "value": json.dumps({"replay_twin": {"endpoint_header": header}}),
                    },
                },
            },
        },
        {
            "name": "envoy.filters.http.upstream_codec",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.upstream_codec.v3.UpstreamCodec"
            },
        },
    ]
    return t


def guarded(cluster, services, suffix):
    """Is this an outbound cluster of a guarded service (and not a twin)?"""
    parts = cluster.get("name", "").split("|")
    if len(parts) != 4 or parts[0] != "outbound" or cluster["name"].endswith(suffix):
        return False
    host = parts[3]
    if services:
        return host in services
    return ".svc." in host


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--service", action="append", default=[],
                   help="FQDN of a guarded service (repeat); default: every *.svc.* outbound cluster")
    p.add_argument("--suffix", default="|staleguard-twin", help="retry.twin_suffix")
    p.add_argument("--header", default="x-gateway-destination-endpoint", help="retry.endpoint_header")
    p.add_argument("--module-uri", help="the module URL, as vm_config.code.remote in envoyfilter.yaml")
    p.add_argument("--module-sha256", help="the module's sha256, as in envoyfilter.yaml")
    p.add_argument("--module-cluster", default="staleguard-module", help="the cluster serving the module")
    p.add_argument("--wasm", default="/etc/staleguard/staleguard_filter.wasm",
                   help="a module file in the gateway pod, when --module-uri is not given")
    p.add_argument("--namespace", default="istio-ingress",
                   help="the gateway's namespace, as its deploy/gateway overlay names it")
    p.add_argument("--selector", default="istio=ingress",
                   help="workloadSelector label KEY=VALUE, as its deploy/gateway overlay names it "
                        "(Helm: istio=ingress; istioctl: istio=ingressgateway; Gateway API: "
                        "gateway.networking.k8s.io/gateway-name=NAME)")
    args = p.parse_args()
    try:
        doc = json.load(sys.stdin)
    except json.JSONDecodeError as e:
        sys.exit(f"twins.py: stdin is not JSON ({e}); pipe `istioctl proxy-config cluster ... -o json`")
    chosen = [c for c in clusters_of(doc) if guarded(c, set(args.service), args.suffix)]
    if not chosen:
        sys.exit("twins.py: no outbound cluster of the guarded services in the input")
    missing = set(args.service) - {c["name"].split("|")[3] for c in chosen}
    if missing:
        sys.exit(f"twins.py: no cluster for {', '.join(sorted(missing))}")
    code = module_code(args)
    key, _, value = args.selector.partition("=")
    out = {
        "apiVersion": "networking.istio.io/v1alpha3",
        "kind": "EnvoyFilter",
        "metadata": {"name": "staleguard-twins", "namespace": args.namespace},
        "spec": {
            "workloadSelector": {"labels": {key: value}},
            "configPatches": [
                {
                    "applyTo": "CLUSTER",
                    "match": {"context": "GATEWAY"},
                    "patch": {"operation": "ADD", "value": twin(c, args.suffix, args.header, code)},
                }
                for c in sorted(chosen, key=lambda c: c["name"])
            ],
        },
    }
    text = json.dumps(out, indent=2) + "\n"
    if len(text) > CLIENT_SIDE_APPLY_LIMIT:
        print(f"twins.py: {len(chosen)} twins, {len(text) // 1024} KiB: apply with "
              "`kubectl apply --server-side` (a client-side apply's annotation is capped at 256 KiB)",
              file=sys.stderr)
    sys.stdout.write(text)


if __name__ == "__main__":
    main()
