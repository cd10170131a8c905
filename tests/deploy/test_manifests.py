"""The manifests in deploy/ checked against what hearth and its image really
do, field by field (no cluster runs here, and no schema of KServe's
resources is packaged in Debian or npm; the Kubernetes kinds are also
checked against Kubernetes' schemas, from npm's kubernetes-models): every argument is a flag of
`hearth serve --help`, and the arguments start a real `hearth serve`; the
ports agree with each other, with the probes, the Prometheus annotations and
the image's (scripts/image); the probe and metrics paths answer 200 on that
server; the user is the image's; ServingRuntime, InferenceService,
Deployment, Service and HorizontalPodAutoscaler refer to each other
consistently; the pod's grace period outlasts hearth's drain.

Paths: $HEARTH_CLI (default build/bin/hearth).
"""

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLI = os.environ.get("HEARTH_CLI") or str(ROOT / "build" / "bin" / "hearth")
DEPLOY = ROOT / "deploy"
IMAGE_SCRIPT = (ROOT / "scripts" / "image").read_text()
VERSION = re.search(r"^project\(hearth VERSION ([0-9.]+)", (ROOT / "CMakeLists.txt").read_text(), re.M).group(1)


def documents():
    docs = []
    for path in sorted(DEPLOY.rglob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc is not None:
                docs.append((path.relative_to(ROOT), doc))
    return docs


DOCS = documents()


def of_kind(kind):
    return [(path, doc) for path, doc in DOCS if doc["kind"] == kind]


def serve_flags():
    text = subprocess.run([CLI, "serve", "--help"], check=True, capture_output=True, text=True).stdout
    return set(re.findall(r"^\s+(?:-\w,)?(--[a-z][a-z0-9-]*)", text, re.M))


def parse_args(args):
    """{flag: value} of --flag=value arguments; fails on anything else or a repeat."""
    out = {}
    for a in args:
        m = re.fullmatch(r"(--[a-z][a-z0-9-]*)=(.*)", a)
        assert m, f"argument {a!r} is not --flag=value"
        assert m.group(1) not in out, f"{m.group(1)} given twice"
        out[m.group(1)] = m.group(2)
    return out


def image_ports():
    return {int(p) for p in re.findall(r"--config\.exposedports (\d+)/tcp", IMAGE_SCRIPT)}


def image_user():
    return int(re.search(r"^USER_ID=(\d+)$", IMAGE_SCRIPT, re.M).group(1))


def hearth_containers():
    """(where, container, pod-level dict or None) for every container running hearth's image."""
    found = []
    for path, doc in of_kind("ServingRuntime"):
        for c in doc["spec"]["containers"]:
            found.append((f"{path}: ServingRuntime {doc['metadata']['name']}", c, doc))
    for path, doc in of_kind("Deployment"):
        for c in doc["spec"]["template"]["spec"]["containers"]:
            found.append((f"{path}: Deployment {doc['metadata']['name']}", c, doc))
    return found


def port_number(container, port):
    if isinstance(port, int):
        return port
    named = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    assert port in named, f"probe port {port!r} is not a port of the container"
    return named[port]


def test_the_manifests_hold_every_kind_hearth_is_deployed_with():
    kinds = sorted({doc["kind"] for _, doc in DOCS})
    assert kinds == ["Deployment", "HorizontalPodAutoscaler", "InferenceService", "Service", "ServingRuntime"]
    for path, doc in DOCS:
        assert set(doc) >= {"apiVersion", "kind", "metadata", "spec"}, path
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", doc["metadata"]["name"]), path


def test_every_hearth_container_runs_the_image_as_the_image_expects():
    flags = serve_flags()
    assert {"--model-repository", "--host", "--http-port", "--grpc-port", "--drain-timeout-ms"} <= flags
    containers = hearth_containers()
    assert len(containers) == 3
    for where, c, _ in containers:
        assert re.fullmatch(rf"hearth(-gpu)?:{re.escape(VERSION)}", c["image"]), f"{where}: {c['image']}"
        assert "command" not in c, f"{where}: the image's entry point is `hearth serve`; give args only"
        args = parse_args(c["args"])
        unknown = set(args) - flags
        assert not unknown, f"{where}: not flags of `hearth serve`: {unknown}"
        assert args["--model-repository"] == "/mnt/models", where
        assert args["--host"] == "0.0.0.0", where
        http, grpc = int(args["--http-port"]), int(args["--grpc-port"])
        assert {http, grpc} == image_ports() == {8080, 8081}, where
        assert http == 8080, where
        declared = {p["containerPort"] for p in c.get("ports", [])}
        assert http in declared, f"{where}: declares {declared}"
        assert port_number(c, c["livenessProbe"]["httpGet"]["port"]) == http, where
        assert port_number(c, c["readinessProbe"]["httpGet"]["port"]) == http, where
        assert c["livenessProbe"]["httpGet"]["path"] == "/v2/health/live", where
        assert c["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready", where
        gpu = c["image"].startswith("hearth-gpu")
        assert ("nvidia.com/gpu" in c["resources"].get("limits", {})) == gpu, where
        assert (args.get("--device") == "cuda") == gpu, where
        context = c.get("securityContext", {})
        assert context.get("allowPrivilegeEscalation") is False, where


def test_prometheus_annotations_name_hearths_metrics():
    for path, doc in of_kind("ServingRuntime"):
        a = doc["spec"]["annotations"]
        assert a["prometheus.kserve.io/path"] == "/metrics", path
        assert int(a["prometheus.kserve.io/port"]) == 8080, path
    for path, doc in of_kind("Deployment"):
        a = doc["spec"]["template"]["metadata"]["annotations"]
        assert a["prometheus.io/scrape"] == "true", path
        assert a["prometheus.io/path"] == "/metrics", path
        assert int(a["prometheus.io/port"]) == 8080, path


def test_serving_runtimes_are_kserve_v2_runtimes_of_the_hearth_format():
    runtimes = of_kind("ServingRuntime")
    assert {d["metadata"]["name"] for _, d in runtimes} == {"hearth", "hearth-gpu"}
    for path, doc in runtimes:
        spec = doc["spec"]
        assert doc["apiVersion"] == "serving.kserve.io/v1alpha1", path
        assert spec["protocolVersions"] == ["v2", "grpc-v2"], path
        assert [f["name"] for f in spec["supportedModelFormats"]] == ["hearth"], path
        assert spec["multiModel"] is False, path
        assert [c["name"] for c in spec["containers"]] == ["kserve-container"], path
        for c in spec["containers"]:
            # Knative (Serverless mode) refuses lifecycle hooks.
            assert "lifecycle" not in c, path
            user = c["securityContext"]
            assert user["runAsNonRoot"] is True and user["runAsUser"] == image_user(), path
    auto = [d["metadata"]["name"] for _, d in runtimes if d["spec"]["supportedModelFormats"][0].get("autoSelect")]
    assert auto == ["hearth"], "one runtime is chosen for the format by default"


def drain_seconds(container):
    return int(parse_args(container["args"])["--drain-timeout-ms"]) / 1000


def test_inference_services_name_a_runtime_that_serves_them():
    runtimes = {d["metadata"]["name"]: d for _, d in of_kind("ServingRuntime")}
    services = of_kind("InferenceService")
    assert len(services) == 3
    protocols = set()
    for path, doc in services:
        assert doc["apiVersion"] == "serving.kserve.io/v1beta1", path
        predictor = doc["spec"]["predictor"]
        model = predictor["model"]
        runtime = runtimes[model["runtime"]]
        formats = [f["name"] for f in runtime["spec"]["supportedModelFormats"]]
        assert model["modelFormat"]["name"] in formats, path
        assert model["protocolVersion"] in runtime["spec"]["protocolVersions"], path
        protocols.add(model["protocolVersion"])
        assert re.fullmatch(r"(s3|gs|https?|pvc|hf|oci)://\S+", model["storageUri"]), path
        container = runtime["spec"]["containers"][0]
        args = parse_args(container["args"])
        if model["protocolVersion"] == "grpc-v2":
            ports = model["ports"]
            assert [(p["name"], p["containerPort"]) for p in ports] == [("h2c", int(args["--grpc-port"]))], path
        annotations = doc["metadata"].get("annotations", {})
        if annotations.get("serving.kserve.io/deploymentMode") == "RawDeployment":
            assert predictor["terminationGracePeriodSeconds"] > drain_seconds(container) + 10, path
        if "nvidia.com/gpu" in model.get("resources", {}).get("limits", {}):
            assert model["runtime"] == "hearth-gpu", path
    assert protocols == {"v2", "grpc-v2"}


def test_deployment_service_and_autoscaler_fit_together():
    (_, deployment), = of_kind("Deployment")
    (_, service), = of_kind("Service")
    (_, hpa), = of_kind("HorizontalPodAutoscaler")
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert service["spec"]["selector"].items() <= labels.items()
    (container,) = pod["spec"]["containers"]
    names = {p["name"]: p["containerPort"] for p in container["ports"]}
    args = parse_args(container["args"])
    assert names == {"http": int(args["--http-port"]), "grpc": int(args["--grpc-port"])}
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(names)
    assert {p["port"] for p in service["spec"]["ports"]} == {8080, 8081}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/mnt/models"]["readOnly"] is True
    assert {v["name"] for v in pod["spec"]["volumes"]} >= {mounts["/mnt/models"]["name"]}
    assert pod["spec"]["securityContext"]["runAsUser"] == image_user()
    pause = 0
    if "lifecycle" in container:
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep", command
        pause = int(command[1])
    assert pod["spec"]["terminationGracePeriodSeconds"] > pause + drain_seconds(container) + 10
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    deploy_doc = (ROOT / "docs" / "deploy.md").read_text()
    assert name in deploy_doc, f"docs/deploy.md gives no adapter rule that publishes {name}"


def get(url):
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return None, ""


def test_the_arguments_start_hearth_serve_and_the_probed_paths_answer(tmp_path):
    """The CPU runtime's and the Deployment's arguments, on this machine: the
    repository and ports replaced (any free port), every other flag as given."""
    repo = tmp_path / "models"
    (repo / "scale" / "1").mkdir(parents=True)
    subprocess.run([CLI, "make-model", "scale", "--dims", "8", "--seed", "1",
                    "--out", str(repo / "scale" / "1" / "model.safetensors")], check=True, capture_output=True)
    (repo / "scale" / "config.yaml").write_text("""backend: scale
max_batch_size: 2
input:
  - {name: x, data_type: TYPE_FP32, dims: [8]}
output:
  - {name: y, data_type: TYPE_FP32, dims: [1]}
instance_group:
  - {count: 1, kind: KIND_CPU}
""")
    for where, c, _ in hearth_containers():
        if c["image"].startswith("hearth-gpu"):
            continue  # --device=cuda: no GPU here
        args = parse_args(c["args"])
        args.update({"--model-repository": str(repo), "--host": "127.0.0.1", "--http-port": "0",
                     "--grpc-port": "0"})
        log_path = tmp_path / "serve.log"
        with open(log_path, "w") as log:
            proc = subprocess.Popen([CLI, "serve", *[f"{k}={v}" for k, v in args.items()]], stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 120
            while not (m := re.search(r"ready on http://127\.0\.0\.1:(\d+)", log_path.read_text())):
                assert proc.poll() is None, f"{where}: hearth serve exited:\n{log_path.read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"{where}: no ready line:\n{log_path.read_text()[-3000:]}"
                time.sleep(0.1)
            url = f"http://127.0.0.1:{m.group(1)}"
            paths = [c["livenessProbe"]["httpGet"]["path"], c["readinessProbe"]["httpGet"]["path"], "/metrics"]
            for path in paths:
                status, body = get(url + path)
                assert status == 200, f"{where}: GET {path}: {status} {body[:500]}"
            assert 'hearth_inference_pending_request_count{model="scale"}' in get(url + "/metrics")[1]
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
        assert code == 0, f"{where}: exit {code}\n{log_path.read_text()[-3000:]}"


def test_the_gpu_containerfile_matches_the_cpu_image():
    """deploy/gpu/Containerfile is not built here (no container engine or
    GPU): its entry point, arguments, user and ports are checked as text."""
    text = (DEPLOY / "gpu" / "Containerfile").read_text()
    entry = json.loads(re.search(r"^ENTRYPOINT (\[.*\])$", text, re.M).group(1))
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", text, re.M).group(1))
    assert entry == ["/opt/hearth/bin/hearth", "serve"]
    flags = serve_flags()
    given = dict(zip(cmd[::2], cmd[1::2]))
    assert set(given) <= flags, set(given) - flags
    assert given["--model-repository"] == "/mnt/models" and given["--host"] == "0.0.0.0"
    assert {int(given["--http-port"]), int(given["--grpc-port"])} == image_ports()
    assert given["--device"] == "cuda"
    assert re.search(r"^EXPOSE 8080/tcp 8081/tcp$", text, re.M)
    assert re.search(rf"^USER {image_user()}:{image_user()}$", text, re.M)
    assert "scripts/image-packages" in text


SCHEMA_PACKAGES = ["kubernetes-models@4.5.1", "js-yaml@5.5.0"]


def test_kubernetes_kinds_match_kubernetes_schemas(tmp_path):
    """The Deployment, Service and HPA against Kubernetes' schemas, bundled by
    npm's kubernetes-models (installed once into the build directory); a
    document broken on purpose must fail, so the check is known to bite."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("needs node and npm (for npm's kubernetes-models, Kubernetes' schemas)")
    prefix = pathlib.Path(CLI).resolve().parent.parent / "deploy-schemas"
    modules = prefix / "node_modules"
    if not (modules / "kubernetes-models").is_dir() or not (modules / "js-yaml").is_dir():
        r = subprocess.run([npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--silent",
                            *SCHEMA_PACKAGES], capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            pytest.skip(f"npm install {' '.join(SCHEMA_PACKAGES)} failed (no network to the npm registry?): "
                        f"{r.stderr.strip()[-500:]}")
    script = pathlib.Path(__file__).resolve().parent / "kubernetes_schemas.js"
    env = dict(os.environ, NODE_PATH=str(modules))
    files = sorted(str(p) for p in (DEPLOY / "kubernetes").glob("*.yaml"))
    r = subprocess.run([node, str(script), *files], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("valid: ") == 3, r.stdout
    broken = tmp_path / "broken.yaml"
    broken.write_text((DEPLOY / "kubernetes" / "hearth.yaml").read_text()
                      .replace("containerPort: 8080", "containerPort: http-port", 1))
    r = subprocess.run([node, str(script), str(broken)], capture_output=True, text=True, env=env)
    assert r.returncode == 1 and "INVALID" in r.stdout and "containerPort" in r.stdout, r.stdout + r.stderr
