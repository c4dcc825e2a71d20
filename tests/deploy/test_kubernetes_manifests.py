"""deploy/kubernetes/: every manifest is a valid object of its kind, and the objects point at each other.

Offline, from PyPI packages alone: core and RBAC objects are checked by the `kubernetes` client's models
(pydantic: unknown fields, missing required fields and wrong types are errors); the InferencePool's spec
against its CRD schema (tests/deploy/schemas/, derived from the Gateway API Inference Extension's CRD);
the Gateway, the HTTPRoute and the endpoint picker's EndpointPickerConfig by the fields the tests name.
loraplex's arguments are parsed by loraplex's own command line, as tests/test_docker.py does for compose.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

kubernetes_client = pytest.importorskip("kubernetes.client")

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
SCHEMAS = Path(__file__).resolve().parent / "schemas"
MANIFEST_FILES = sorted(p for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")
DOCUMENTS = [(path.name, doc) for path in MANIFEST_FILES for doc in yaml.safe_load_all(path.read_text()) if doc]

# (apiVersion, kind) -> the kubernetes client model that describes it.
CORE_MODELS = {
    ("apps/v1", "Deployment"): "V1Deployment",
    ("v1", "Service"): "V1Service",
    ("v1", "ServiceAccount"): "V1ServiceAccount",
    ("v1", "ConfigMap"): "V1ConfigMap",
    ("v1", "PersistentVolumeClaim"): "V1PersistentVolumeClaim",
    ("rbac.authorization.k8s.io/v1", "Role"): "V1Role",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "V1RoleBinding",
}
INFERENCE_POOL = ("inference.networking.k8s.io/v1", "InferencePool")
GATEWAY_API = {("gateway.networking.k8s.io/v1", "Gateway"), ("gateway.networking.k8s.io/v1", "HTTPRoute")}
# EndpointPickerConfig's fields (llm-d-router apix/config/v1alpha1/endpointpickerconfig_types.go).
EPP_CONFIG_FIELDS = {"apiVersion", "kind", "featureGates", "plugins", "schedulingProfiles", "dataLayer",
                     "flowControl", "requestHandler", "saturationDetector", "parser"}
# Plugin types the picker registers (llm-d-router cmd/epp/runner/runner.go) that this config uses.
EPP_PLUGIN_TYPES = {"metrics-data-source", "core-metrics-extractor", "queue-scorer", "kv-cache-utilization-scorer",
                    "prefix-cache-scorer", "lora-affinity-scorer", "max-score-picker", "single-profile-handler",
                    "endpoint-notification-source", "token-producer", "precise-prefix-cache-producer"}


def objects(kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for _, doc in DOCUMENTS if doc["kind"] == kind}


def only(kind: str, name: str) -> dict:
    found = objects(kind)
    assert name in found, f"no {kind} named {name!r} in {DEPLOY}"
    return found[name]


def container(deployment: dict, name: str) -> dict:
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def epp_config() -> dict:
    config_map = only("ConfigMap", "loraplex-epp")
    args = container(only("Deployment", "loraplex-epp"), "epp")["args"]
    key = Path(flag(args, "--config-file")).name
    return yaml.safe_load(config_map["data"][key])


def test_every_manifest_is_listed_in_the_kustomization():
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == [p.name for p in MANIFEST_FILES]


@pytest.mark.parametrize("file, doc", DOCUMENTS, ids=[f"{f}:{d['kind']}/{d['metadata']['name']}" for f, d in DOCUMENTS])
def test_manifest_is_a_valid_object_of_its_kind(file, doc):
    key = (doc["apiVersion"], doc["kind"])
    if key in CORE_MODELS:
        model = getattr(kubernetes_client, CORE_MODELS[key])
        model.model_validate(doc)     # unknown fields and missing required fields
        model.from_dict(doc)          # field types, strictly
    elif key == INFERENCE_POOL:
        assert set(doc) == {"apiVersion", "kind", "metadata", "spec"}
        schema = json.loads((SCHEMAS / "inferencepool-v1-spec.json").read_text())
        jsonschema.validate(doc["spec"], schema)
    else:
        assert key in GATEWAY_API, f"{file}: no check for {key}"


def test_the_checks_refuse_a_misspelled_field_and_a_missing_one():
    deployment = json.loads(json.dumps(only("Deployment", "loraplex")))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(ValueError, match="readinesProbe"):
        kubernetes_client.V1Deployment.model_validate(deployment)
    pool = json.loads(json.dumps(only("InferencePool", "loraplex")))
    del pool["spec"]["targetPorts"]
    with pytest.raises(jsonschema.ValidationError, match="targetPorts"):
        jsonschema.validate(pool["spec"], json.loads((SCHEMAS / "inferencepool-v1-spec.json").read_text()))


def test_inference_pool_selects_the_loraplex_pods_on_their_port():
    pool, deployment = only("InferencePool", "loraplex"), only("Deployment", "loraplex")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    ports = {p["name"]: p["containerPort"] for p in container(deployment, "loraplex")["ports"]}
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [ports["http"]]


def test_inference_pool_points_at_the_pickers_ext_proc_port():
    pool, service = only("InferencePool", "loraplex"), only("Service", "loraplex-epp")
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] == service["metadata"]["name"]
    ext_proc = next(p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"])
    assert ext_proc["appProtocol"] == "kubernetes.io/h2c"
    epp = only("Deployment", "loraplex-epp")
    assert service["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    named = {p["name"]: p["containerPort"] for p in container(epp, "epp")["ports"]}
    assert named[ext_proc["targetPort"]] == 9002


def test_picker_watches_this_pool_with_a_role_that_allows_it():
    epp = only("Deployment", "loraplex-epp")
    args = container(epp, "epp")["args"]
    assert flag(args, "--pool-name") == only("InferencePool", "loraplex")["metadata"]["name"]
    assert flag(args, "--pool-group") == INFERENCE_POOL[0].split("/")[0]
    account = epp["spec"]["template"]["spec"]["serviceAccountName"]
    assert account in objects("ServiceAccount")
    binding = only("RoleBinding", "loraplex-epp")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    rules = only("Role", binding["roleRef"]["name"])["rules"]
    granted = {(group, resource) for rule in rules if {"get", "watch", "list"} <= set(rule["verbs"])
               for group in rule["apiGroups"] for resource in rule["resources"]}
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools")} <= granted


def test_picker_config_turns_the_lora_affinity_scorer_on():
    config = epp_config()
    assert config["apiVersion"] == "llm-d.ai/v1alpha1" and config["kind"] == "EndpointPickerConfig"
    assert set(config) <= EPP_CONFIG_FIELDS
    declared = {plugin.get("name", plugin["type"]): plugin["type"] for plugin in config["plugins"]}
    assert set(declared.values()) <= EPP_PLUGIN_TYPES
    profile = next(p for p in config["schedulingProfiles"] if p["name"] == "default")
    weights = {declared[p["pluginRef"]]: p.get("weight", 1) for p in profile["plugins"]}
    assert weights["lora-affinity-scorer"] > 0
    sources = config["dataLayer"]["sources"]
    assert [(declared[s["pluginRef"]], [declared[e["pluginRef"]] for e in s["extractors"]]) for s in sources] == [
        ("metrics-data-source", ["core-metrics-extractor"]),
        ("endpoint-notification-source", ["precise-prefix-cache-producer"])]
    source = next(p for p in config["plugins"] if p["type"] == "metrics-data-source")
    assert source["parameters"]["path"] == "/metrics"


def test_picker_mounts_its_config():
    epp = only("Deployment", "loraplex-epp")
    spec, args = epp["spec"]["template"]["spec"], container(epp, "epp")["args"]
    config_dir = str(Path(flag(args, "--config-file")).parent)
    mount = next(m for m in container(epp, "epp")["volumeMounts"] if m["mountPath"] == config_dir)
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == "loraplex-epp"


def test_route_sends_the_gateways_traffic_to_the_pool():
    route, gateway = only("HTTPRoute", "loraplex"), only("Gateway", "loraplex-gateway")
    assert [ref["name"] for ref in route["spec"]["parentRefs"]] == [gateway["metadata"]["name"]]
    backends = [ref for rule in route["spec"]["rules"] for ref in rule["backendRefs"]]
    assert backends == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "loraplex"}]
    assert gateway["spec"]["gatewayClassName"] and gateway["spec"]["listeners"]


@pytest.fixture(scope="module")
def loraplex_args():
    """The loraplex container's arguments, parsed by `loraplex` (the gpu image's entrypoint is `loraplex serve`)."""
    from gateway.__main__ import build_parser

    gpu_stage = (ROOT / "docker" / "Dockerfile").read_text().split(" AS gpu", 1)[1]
    assert json.loads(re.search(r"^ENTRYPOINT (.*)$", gpu_stage, re.MULTILINE).group(1)) == ["loraplex", "serve"]
    return build_parser().parse_args(["serve", *container(only("Deployment", "loraplex"), "loraplex")["args"]])


def test_loraplex_listens_where_the_probes_and_the_pool_point(loraplex_args):
    pod = only("Deployment", "loraplex")["spec"]["template"]["spec"]
    server = container(only("Deployment", "loraplex"), "loraplex")
    named = {p["name"]: p["containerPort"] for p in server["ports"]}
    assert loraplex_args.host == "0.0.0.0" and named["http"] == loraplex_args.port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert server[probe]["httpGet"]["path"] == "/health"
        assert named[server[probe]["httpGet"]["port"]] == loraplex_args.port
    from gateway.__main__ import FORCE_EXIT_MARGIN_S
    assert pod["terminationGracePeriodSeconds"] > loraplex_args.shutdown_timeout + FORCE_EXIT_MARGIN_S


def test_loraplex_takes_a_gpu_and_reads_model_and_adapters_from_read_only_volumes(loraplex_args):
    pod = only("Deployment", "loraplex")["spec"]["template"]["spec"]
    server = container(only("Deployment", "loraplex"), "loraplex")
    assert server["resources"]["requests"]["nvidia.com/gpu"] == server["resources"]["limits"]["nvidia.com/gpu"] == "1"
    mounts = {m["mountPath"]: m for m in server["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    for path in (loraplex_args.model, *loraplex_args.lora_dir):
        assert mounts[path]["readOnly"]
        claim = volumes[mounts[path]["name"]]["persistentVolumeClaim"]["claimName"]
        assert "ReadOnlyMany" in only("PersistentVolumeClaim", claim)["spec"]["accessModes"]
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
    assert loraplex_args.allow_runtime_lora_updating      # an adapter under --lora-dir loads on first use
    assert any(e["name"] == "VLLM_API_KEY" and "secretKeyRef" in e["valueFrom"] for e in server["env"])


def test_picker_subscribes_to_each_pods_kv_events_and_renders_on_loraplex(loraplex_args):
    """The precise prefix-cache wiring, as llm-d-router ebab6879 reads it: the picker dials
    tcp://<pod ip>:<socketPort> (replay on <replaySocketPort>) and parses topics as kv@<pod>@<model>, the model
    being what base requests name; the token-producer POSTs to <url>/v1/completions/render with `model` set to
    its modelName; the prefix-cache scorer reads the precise producer's match info."""
    events = loraplex_args.kv_events_config
    server = container(only("Deployment", "loraplex"), "loraplex")
    named = {p["name"]: p["containerPort"] for p in server["ports"]}
    plugins = {p["type"]: p.get("parameters", {}) for p in epp_config()["plugins"]}
    producer = plugins["precise-prefix-cache-producer"]
    discovery = producer["kvEventsConfig"]["podDiscoveryConfig"]
    assert events.publishes and events.endpoint == f"tcp://*:{discovery['socketPort']}" == "tcp://*:5556"
    assert events.replay_endpoint == f"tcp://*:{discovery['replaySocketPort']}"
    assert {named["kv-events"], named["kv-replay"]} == {discovery["socketPort"], discovery["replaySocketPort"]}
    subscribing = producer["kvEventsConfig"]
    assert subscribing["discoverPods"] and events.topic.startswith(subscribing["topicFilter"])
    served = loraplex_args.served_model_name[0]
    assert events.topic == f"kv@$(POD_IP):{loraplex_args.port}@{served}"
    assert any(e["name"] == "POD_IP" and e["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
               for e in server["env"])
    assert producer["tokenProcessorConfig"]["blockSizeTokens"] == loraplex_args.block_size
    assert plugins["prefix-cache-scorer"]["prefixMatchInfoProducerName"] == "precise-prefix-cache-producer"
    render = plugins["token-producer"]
    assert render["modelName"] == served
    service = only("Service", render["vllm"]["url"].removeprefix("http://").split(":")[0])
    pod_labels = only("Deployment", "loraplex")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    port = next(p for p in service["spec"]["ports"] if p["port"] == int(render["vllm"]["url"].rsplit(":", 1)[1]))
    assert named[port["targetPort"]] == loraplex_args.port
