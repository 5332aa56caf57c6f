"""deploy/k8s validates offline: built-in kinds with kubernetes-validate (strict, pinned Kubernetes version), the
InferencePool and Gateway API kinds with the JSON schemas in tests/k8s/schemas (written for sluice from the API
types), and the manifests agree with each other and with the code (names, ports, labels, RBAC, probes)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from extproc import epp
from extproc.discovery.kubernetes import GROUP, PLURAL, PoolSpec

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
SCHEMAS = Path(__file__).parent / "schemas"
KUBERNETES_VERSION = "1.33.0"
BUILT_IN = {"v1", "apps/v1", "rbac.authorization.k8s.io/v1"}


def documents() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.name, doc))
    return out


DOCS = documents()


def schema(name: str) -> jsonschema.Draft202012Validator:
    data = json.loads((SCHEMAS / name).read_text())
    jsonschema.Draft202012Validator.check_schema(data)
    return jsonschema.Draft202012Validator(data)


INFERENCE_POOL = schema("inferencepool.v1.json")
GATEWAY_API = schema("gateway-api.v1.json")


def find(kind: str, name: str | None = None) -> dict[str, Any]:
    hits = [d for _, d in DOCS if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(hits) == 1, f"expected one {kind} {name or ''}, found {len(hits)}"
    return hits[0]


def test_every_manifest_is_a_known_kind():
    kinds = {(d["apiVersion"], d["kind"]) for _, d in DOCS}
    assert kinds == {("v1", "ServiceAccount"), ("rbac.authorization.k8s.io/v1", "Role"),
                     ("rbac.authorization.k8s.io/v1", "RoleBinding"), ("v1", "ConfigMap"), ("apps/v1", "Deployment"),
                     ("v1", "Service"), ("inference.networking.k8s.io/v1", "InferencePool"),
                     ("gateway.networking.k8s.io/v1", "GatewayClass"), ("gateway.networking.k8s.io/v1", "Gateway"),
                     ("gateway.networking.k8s.io/v1", "HTTPRoute")}


@pytest.mark.parametrize("where, doc", [(f"{f}:{d['kind']}/{d['metadata']['name']}", d) for f, d in DOCS
                                        if d["apiVersion"] in BUILT_IN])
def test_built_in_kinds_validate_strictly(where, doc):
    kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("where, doc", [(f"{f}:{d['kind']}/{d['metadata']['name']}", d) for f, d in DOCS
                                        if d["apiVersion"] not in BUILT_IN])
def test_inference_pool_and_gateway_api_kinds_validate(where, doc):
    validator = INFERENCE_POOL if doc["kind"] == "InferencePool" else GATEWAY_API
    errors = [e.message for e in validator.iter_errors(doc)]
    assert not errors, errors


@pytest.mark.parametrize("break_it", [
    lambda p: p["spec"].pop("targetPorts"),
    lambda p: p["spec"]["targetPorts"].append({"number": 0}),
    lambda p: p["spec"]["endpointPickerRef"].update(failureMode="Open"),
    lambda p: p["spec"]["endpointPickerRef"].pop("port"),
    lambda p: p["spec"]["selector"].update(matchLabels={}),
    lambda p: p["spec"].update(targetPort=[{"number": 8000}]),  # a typo
    lambda p: p.update(apiVersion="inference.networking.x-k8s.io/v1alpha2"),
])
def test_the_inference_pool_schema_refuses_broken_pools(break_it):
    pool = copy.deepcopy(find("InferencePool"))
    break_it(pool)
    assert list(INFERENCE_POOL.iter_errors(pool))


def test_the_gateway_api_schema_refuses_broken_routes():
    route = copy.deepcopy(find("HTTPRoute"))
    route["spec"]["rules"][0]["matches"][0]["path"]["type"] = "Prefix"
    assert list(GATEWAY_API.iter_errors(route))
    gateway = copy.deepcopy(find("Gateway"))
    gateway["spec"]["listeners"][0]["port"] = 70000
    assert list(GATEWAY_API.iter_errors(gateway))
    with pytest.raises(kubernetes_validate.ValidationError):
        service = copy.deepcopy(find("Service", "sluice-epp"))
        service["spec"]["ports"][0]["port"] = "grpc"
        kubernetes_validate.validate(service, KUBERNETES_VERSION, strict=True)


def test_the_pool_points_at_sluice_and_selects_the_model_servers():
    pool = find("InferencePool")
    ref = pool["spec"]["endpointPickerRef"]
    service = find("Service", ref["name"])
    assert ref["port"]["number"] in {p["port"] for p in service["spec"]["ports"]}
    grpc_port = next(p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"])
    assert grpc_port["appProtocol"] == "kubernetes.io/h2c"  # ext_proc is gRPC: HTTP/2 without TLS
    spec = PoolSpec.from_object(pool)
    servers = find("Deployment", "vllm-qwen3")["spec"]["template"]
    assert spec.selects(servers["metadata"]["labels"])
    container_ports = {p["containerPort"] for c in servers["spec"]["containers"] for p in c["ports"]}
    assert set(spec.target_ports) <= container_ports
    route = find("HTTPRoute")
    assert route["spec"]["rules"][0]["backendRefs"] == [
        {"group": GROUP, "kind": "InferencePool", "name": pool["metadata"]["name"]}]
    assert route["spec"]["parentRefs"][0]["name"] == find("Gateway")["metadata"]["name"]
    assert find("Gateway")["spec"]["gatewayClassName"] == find("GatewayClass")["metadata"]["name"]


def test_sluice_has_the_rights_and_probes_it_needs():
    deployment = find("Deployment", "sluice-epp")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == find("ServiceAccount")["metadata"]["name"]
    binding = find("RoleBinding")
    assert binding["subjects"][0]["name"] == pod["serviceAccountName"]
    rules = {(g, r): set(rule["verbs"]) for rule in find("Role")["rules"]
             for g in rule["apiGroups"] for r in rule["resources"]}
    assert {"get"} <= rules[(GROUP, PLURAL)]  # discovery reads the pool ...
    assert {"list", "watch"} <= rules[("", "pods")]  # ... and lists and watches its pods
    (container,) = pod["containers"]
    assert container["readinessProbe"]["grpc"]["service"] == epp.READINESS
    assert container["livenessProbe"]["grpc"]["service"] == epp.LIVENESS
    policy = yaml.safe_load(find("ConfigMap")["data"]["sluice.yaml"])
    grpc = next(p for p in container["ports"] if p["name"] == "grpc")["containerPort"]
    assert policy["sidecar"]["grpc_port"] == grpc == container["readinessProbe"]["grpc"]["port"]
    k8s = policy["pools"][0]["discovery"]["kubernetes"]
    pool = find("InferencePool")
    assert (k8s["namespace"], k8s["inference_pool"]) == (pool["metadata"]["namespace"], pool["metadata"]["name"])
    assert policy["epp"]["max_endpoints"] == 1  # Envoy Gateway routes by the header through ORIGINAL_DST: one
