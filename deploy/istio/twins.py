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

With `--body SERVICE=VHOST` (and `--guard`, the EnvoyFilter of deploy/istio
as JSON), the same EnvoyFilter also carries SERVICE's body path
(docs/filter.md, "Requests with a body"), since the filter cannot replay a
request with a body:
  * a route inserted first in the gateway's virtual host VHOST sends
    POST/PUT/PATCH/DELETE to the hop cluster `<cluster>|staleguard-body`,
    and retries the guard's own rejection (`x-staleguard`) three times;
  * the hop runs the filter in its steering role (the guard's VM id, so it
    reads the guard's index), which names live members in the endpoint
    header, and leads to an internal listener of the same name (Istio's
    bootstrap enables internal listeners);
  * the internal listener routes a request that names members to the twin,
    and any other to the guarded cluster, judged by a copy of the guard
    (istiod adds listeners after patching, so the router REPLACE of
    deploy/istio never reaches this one) and re-picked on a refused
    connection;
  * every route of VHOST re-picks up to ten times on a connect failure
    (Istio's default two retries are too few at 92% stale endpoints).
The inserted route matches every path of VHOST: give a virtual host that
routes to SERVICE alone (its VirtualService's timeouts, rewrites and header
operations do not apply to the requests with a body it takes).

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
    # No failure_policy: the default, fail closed. A twin whose module did
    # not start fails every call, so the guard rejects: nothing unchecked
    # reaches a host.
    vm_config = {"vm_id": "staleguard-twin", "runtime": "envoy.wasm.runtime.v8", "code": code}
    hpo["http_filters"] = upstream_filters(
        vm_config, {"replay_twin": {"endpoint_header": header}}, None)
    return t


def upstream_filters(vm_config, configuration, failure_policy):
    """A cluster's upstream filter chain: the staleguard filter in the VM
    `vm_config` with the plugin `configuration`, then the codec."""
    config = {
        "name": "staleguard",
        "root_id": "staleguard",
        "vm_config": vm_config,
        "configuration": {
            "@type": "type.googleapis.com/google.protobuf.StringValue",
            "value": json.dumps(configuration),
        },
    }
    if failure_policy:
        config["failure_policy"] = failure_policy
    return [
        {
            "name": "envoy.filters.http.wasm",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.wasm.v3.Wasm",
                             "config": config},
        },
        {
            "name": "envoy.filters.http.upstream_codec",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.upstream_codec.v3.UpstreamCodec"
            },
        },
    ]


def guard_filters(envoyfilter):
    """The guard's upstream filters (the wasm filter and the codec) as the
    EnvoyFilter of deploy/istio attaches them to the router, so the body
    path's internal listener judges its fallback picks with the same guard."""
    for p in envoyfilter.get("spec", {}).get("configPatches", []):
        value = p.get("patch", {}).get("value", {})
        if p.get("applyTo") == "HTTP_FILTER" and value.get("name") == "envoy.filters.http.router":
            filters = value.get("typed_config", {}).get("upstream_http_filters")
            if filters:
                return snake_case(filters)
    sys.exit("twins.py: --guard has no router patch with upstream_http_filters "
             "(give the EnvoyFilter of deploy/istio as JSON)")


# Requests with a body take the body path (docs/filter.md, "Requests with a
# body"): the filter cannot replay them, and re-picks by the load balancer
# find a stale host as often as the first pick did.
BODY_METHODS = "POST|PUT|PATCH|DELETE"


def connect_failure_retries():
    """Re-picks after a refused connection: a deleted pod's IP that refuses
    connections resets the request before the guard can replay it (Envoy
    connects first, then runs the upstream filters). Nothing was sent, so
    this is safe for every method. Ten re-picks, each avoiding the hosts
    tried; a 1 ms back-off, since a refusal costs one round trip (Envoy's
    25 ms default would add up to 75 ms to the p99)."""
    return {
        "retry_on": "connect-failure,refused-stream",
        "num_retries": 10,
        "retry_back_off": {"base_interval": "0.001s", "max_interval": "0.005s"},
        "retry_host_predicate": [{
            "name": "envoy.retry_host_predicates.previous_hosts",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3.PreviousHostsPredicate"
            },
        }],
        "host_selection_retry_max_attempts": "5",
    }


def body_path(cluster, vhost, port, suffix, header, code, guard):
    """The body path of one guarded cluster, as CLUSTER, LISTENER and
    HTTP_ROUTE patches (see `--body`)."""
    name = cluster["name"]
    vm_config = next(
        (f["typed_config"]["config"]["vm_config"] for f in guard
         if f.get("name") == "envoy.filters.http.wasm"),
        None,
    )
    if vm_config is None:
        sys.exit("twins.py: --guard has no wasm filter among the router's upstream_http_filters")
    hop = name + "|staleguard-body"
    service = name.split("|")[3].split(".")
    target = port or int(name.split("|")[1])
    router = {
        "name": "envoy.filters.http.router",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
                         "upstream_http_filters": guard},
    }
    # A hop that cannot steer lets the request take the guarded cluster,
    # judged there. The guard's VM: the hop reads the index the guard's
    # poller keeps, and polls nothing itself. Its vm_config is the guard's
    # (the module aside, given as for the twins): Envoy before 1.40 starts one
    # VM per vm_id and module, and the guard's plugin needs the VM's
    # environment.
    steer = upstream_filters(
        dict(vm_config, code=code),
        {"steer": {"service": f"{service[1]}/{service[0]}", "port": target, "endpoint_header": header}},
        "FAIL_OPEN",
    )
    hop_cluster = {
        "name": hop,
        "type": "STATIC",
        "connect_timeout": "1s",
        # The route retries a rejection on the fallback (no fresh index):
        # allow as many retries in flight as requests (Envoy's default is 3;
        # Istio's own clusters allow 2^32-1).
        "circuit_breakers": {"thresholds": [{"priority": "DEFAULT", "max_retries": 1024}]},
        "load_assignment": {"cluster_name": hop, "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"envoy_internal_address": {"server_listener_name": hop}}}}]}]},
        "typed_extension_protocol_options": {HPO: {
            "@type": HPO_TYPE,
            "explicit_http_config": {"http_protocol_options": {}},
            "http_filters": steer,
        }},
    }
    listener = {
        "name": hop,
        "internal_listener": {},
        "filter_chains": [{"filters": [{
            "name": "envoy.filters.network.http_connection_manager",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
                "stat_prefix": "staleguard_body",
                "route_config": {"name": hop, "virtual_hosts": [{"name": hop, "domains": ["*"], "routes": [
                    # Named live members: the twin picks one, its filter lets
                    # through only a named pick, the body streams.
                    {"match": {"prefix": "/", "headers": [{"name": header, "present_match": True}]},
                     "route": {"cluster": name + suffix, "timeout": "0s"}},
                    # No fresh index or no live member: the guarded cluster,
                    # its pick judged by the guard on this router.
                    {"match": {"prefix": "/"},
                     "route": {"cluster": name, "timeout": "0s", "retry_policy": connect_failure_retries()}},
                ]}]},
                # Listeners an EnvoyFilter adds are not patched by the router
                # REPLACE of deploy/istio (istiod adds them after patching),
                # so this router carries the guard itself.
                "http_filters": [router],
            },
        }]}],
    }
    route = {
        "name": "staleguard-body",
        "match": {"prefix": "/", "headers": [
            {"name": ":method", "string_match": {"safe_regex": {"regex": BODY_METHODS}}}]},
        "route": {
            "cluster": hop,
            "timeout": "0s",
            # Only the guard's own rejection carries x-staleguard (the hop
            # and the guard strip it from upstream answers): a rejection on
            # the fallback is sent again, body included, to a new pick.
            "retry_policy": {
                "retry_on": "retriable-headers",
                "retriable_headers": [{"name": "x-staleguard", "present_match": True}],
                "num_retries": 3,
            },
        },
    }
    vhost_match = {"context": "GATEWAY", "routeConfiguration": {"vhost": {"name": vhost}}}
    return [
        {"applyTo": "CLUSTER", "match": {"context": "GATEWAY"},
         "patch": {"operation": "ADD", "value": hop_cluster}},
        {"applyTo": "LISTENER", "match": {"context": "GATEWAY"},
         "patch": {"operation": "ADD", "value": listener}},
        # Istio's default retries (2) are too few at 92% stale endpoints: a
        # request without a body that picks three refusing IPs in a row
        # fails. Every route of the vhost (those that route to a cluster)
        # re-picks up to ten times on a connect failure, with a 1 ms
        # back-off. The route's retry_on stays: a route that also retries
        # 503s (Istio's default) now does so up to ten times, each on
        # another host.
        {"applyTo": "HTTP_ROUTE",
         "match": {"context": "GATEWAY", "routeConfiguration": {"vhost": {"name": vhost, "route": {"action": "ROUTE"}}}},
         "patch": {"operation": "MERGE", "value": {"route": {"retry_policy": {
             "num_retries": 10, "retry_back_off": {"base_interval": "0.001s", "max_interval": "0.005s"}}}}}},
        # Requests with a body to the vhost take the hop (after the MERGE:
        # istiod inserts routes after merging, so this one keeps its own
        # retry policy).
        {"applyTo": "HTTP_ROUTE", "match": vhost_match,
         "patch": {"operation": "INSERT_FIRST", "value": route}},
    ]


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
    p.add_argument("--body", action="append", default=[], metavar="SERVICE=VHOST",
                   help="also the body path for SERVICE (an FQDN), whose requests with a body "
                        "arrive on the gateway's virtual host VHOST (`istioctl proxy-config route`); "
                        "needs --guard")
    p.add_argument("--guard", metavar="FILE",
                   help="the EnvoyFilter of deploy/istio as JSON (`kubectl get envoyfilter "
                        "staleguard -o json`): the body path's listener runs its guard")
    p.add_argument("--target-port", type=int,
                   help="the pods' port the body path names members on when the index lists "
                        "none (default: the cluster's service port)")
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
    bodies = {}
    for spec in args.body:
        service, _, vhost = spec.partition("=")
        if not vhost:
            sys.exit(f"twins.py: --body {spec!r} is not SERVICE=VHOST")
        bodies[service] = vhost
    unknown = set(bodies) - {c["name"].split("|")[3] for c in chosen}
    if unknown:
        sys.exit(f"twins.py: --body names no guarded cluster: {', '.join(sorted(unknown))}")
    guard = None
    if bodies:
        if not args.guard:
            sys.exit("twins.py: --body needs --guard (the EnvoyFilter of deploy/istio as JSON)")
        with open(args.guard) as f:
            guard = guard_filters(json.load(f))
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
            ] + [
                patch
                for c in sorted(chosen, key=lambda c: c["name"])
                if c["name"].split("|")[3] in bodies
                for patch in body_path(c, bodies[c["name"].split("|")[3]], args.target_port,
                                       args.suffix, args.header, code, guard)
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
