"""`make image` (scripts/image) as a user gets it: the image is built from
Debian packages into BUILD/image, its archive unpacked with umoci, and its
contents run as a container runtime would run them (bundle_run.py: unshare
and chroot, with the image's own user, environment, entry point and
arguments) on a demo model repository bound at /mnt/models. The server must
be PID 1 of its namespace and non-root, answer its health probes, infer over
REST on 8080 and gRPC on 8081 (a C++ model and a backend: python model
running Debian's torch), serve /metrics, and exit 0 on SIGTERM.

Skips only where the image cannot be built at all: not root (mmdebstrap's
root mode, mounts and chroot), or no network to the Debian archive.
Paths: $HEARTH_CLI (default build/bin/hearth); the image goes to its build
directory's image/.
"""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request

import numpy as np
import pytest

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / "tests" / "serve"))
from serve_support import mlp_reference, read_safetensors, wait_for  # noqa: E402

CLI = os.environ.get("HEARTH_CLI") or str(ROOT / "build" / "bin" / "hearth")
BUILD = pathlib.Path(CLI).resolve().parent.parent
MIRROR = os.environ.get("HEARTH_IMAGE_MIRROR", "http://deb.debian.org/debian")
PREFIX = "/opt/hearth"
GRPC_BUILT = os.environ.get("HEARTH_GRPC_BUILT", "ON").upper() not in ("OFF", "0", "FALSE")
MLP = (64, 128, 16)
SCALE_N = 500

TORCH_PY = """
import numpy as np
import torch


class Model:
    def initialize(self, args):
        self.w = args["weights"]["weight"]  # the store's copy, read-only
        assert isinstance(self.w, torch.Tensor), type(self.w)

    def execute(self, inputs):
        x = torch.tensor(np.asarray(inputs["x"]))
        y = torch.nn.functional.linear(x, self.w.unsqueeze(0))
        return {"y": y.numpy(), "torch_version": np.full((x.shape[0], 1), int(torch.__version__.split(".")[0]), np.int32)}
"""


def debian_suite():
    text = pathlib.Path("/etc/os-release").read_text()
    m = re.search(r"^VERSION_CODENAME=(\S+)", text, re.M)
    return m.group(1) if m else None


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    """Builds the image and unpacks its archive; yields the paths, and
    removes what it unpacked afterwards."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the image's root filesystem is built by mmdebstrap in root mode and run with "
                    "mounts and chroot")
    suite = debian_suite()
    url = f"{MIRROR}/dists/{suite}/InRelease"
    try:
        urllib.request.urlopen(url, timeout=30).close()
    except OSError as e:
        pytest.skip(f"no network to the Debian archive ({url}: {e}): the image's packages cannot be fetched")
    subprocess.run(["bash", str(ROOT / "scripts" / "setup-image")], check=True)
    tmp = tmp_path_factory.mktemp("image")
    log = tmp / "image.log"
    started = time.monotonic()
    with open(log, "w") as out:
        r = subprocess.run(["bash", str(ROOT / "scripts" / "image"), str(BUILD)], cwd=ROOT, stdout=out,
                           stderr=subprocess.STDOUT)
    assert r.returncode == 0, "scripts/image failed:\n" + log.read_text()[-6000:]
    print(f"scripts/image took {time.monotonic() - started:.0f} s")
    out = BUILD / "image"
    # The archive a user loads, not the layout beside it: unpacked and run.
    layout = tmp / "oci"
    with tarfile.open(out / "hearth.tar") as archive:
        archive.extractall(layout)
    tags = subprocess.run(["umoci", "ls", "--layout", str(layout)], check=True, capture_output=True,
                          text=True).stdout.split()
    assert len(tags) == 1, tags
    bundle = tmp / "bundle"
    subprocess.run(["umoci", "unpack", "--image", f"{layout}:{tags[0]}", str(bundle)], check=True,
                   capture_output=True)
    yield {"out": out, "layout": layout, "tag": tags[0], "bundle": bundle, "rootfs": bundle / "rootfs",
           "log": log.read_text()}
    # 2 GB unpacked: not left for pytest's kept temporary directories.
    shutil.rmtree(layout)
    shutil.rmtree(bundle)


def blob(layout, digest):
    algorithm, hex_digest = digest.split(":")
    return json.loads((layout / "blobs" / algorithm / hex_digest).read_text())


def image_config(image):
    index = json.loads((image["layout"] / "index.json").read_text())
    assert len(index["manifests"]) == 1, index
    entry = index["manifests"][0]
    manifest = blob(image["layout"], entry["digest"])
    return entry, manifest, blob(image["layout"], manifest["config"]["digest"])


def flag(args, name):
    assert args.count(name) == 1, f"{name} in {args}"
    return args[args.index(name) + 1]


def test_image_config_runs_hearth_serve_non_root_on_kserve_ports(image):
    entry, manifest, config = image_config(image)
    assert entry["annotations"]["io.containerd.image.name"] == f"docker.io/library/hearth:{image['tag']}"
    assert len(manifest["layers"]) == 2, "a Debian layer, then hearth's"
    c = config["config"]
    assert c["User"] == "1000:1000"
    assert c["Entrypoint"] == [f"{PREFIX}/bin/hearth", "serve"]
    args = c["Cmd"]
    assert flag(args, "--model-repository") == "/mnt/models"
    assert flag(args, "--host") == "0.0.0.0"
    assert flag(args, "--http-port") == "8080"
    assert flag(args, "--grpc-port") == "8081"
    assert set(c["ExposedPorts"]) == {"8080/tcp", "8081/tcp"}
    passwd = (image["rootfs"] / "etc" / "passwd").read_text()
    assert re.search(r"^hearth:x:1000:1000:", passwd, re.M), passwd


def test_every_library_comes_from_a_debian_package(image):
    """hearth's binaries load nothing but libhearth from /opt/hearth: every
    other library is a file of an installed Debian package of the image."""
    rootfs = image["rootfs"]
    copied = sorted(p.name for p in (rootfs / PREFIX.lstrip("/")).rglob("*.so*") if "libhearth.so" not in p.name
                    and p.parent.name != "bin")
    assert copied == [], f"libraries copied into {PREFIX}: {copied}"
    elf = [p for p in (rootfs / PREFIX.lstrip("/") / "bin").iterdir()] + \
          [rootfs / PREFIX.lstrip("/") / "lib" / "libhearth.so"]
    assert {p.name for p in elf} >= {"hearth", "hearth-worker", "libhearth.so"}
    owners = {}
    for path in elf:
        inside = "/" + str(path.relative_to(rootfs))
        ldd = subprocess.run(["chroot", str(rootfs), "ldd", inside], capture_output=True, text=True)
        assert ldd.returncode == 0 and "not found" not in ldd.stdout, f"{inside}:\n{ldd.stdout}{ldd.stderr}"
        for lib in re.findall(r"=> (/\S+)", ldd.stdout):
            owners[lib] = package_of(rootfs, lib)
            assert owners[lib], f"{inside} loads {lib}, which no Debian package of the image holds"
    assert "libc6" in owners.values(), owners
    assert (image["out"] / "packages").read_text().count("python3-torch") == 1


def package_of(rootfs, path):
    """The package of the image that holds `path` (through links such as
    Debian's alternatives, and under /lib or /usr/lib: usrmerge), or None."""
    real = subprocess.run(["chroot", str(rootfs), "readlink", "-f", path], capture_output=True,
                          text=True).stdout.strip()
    for p in (path, real):
        for candidate in (p, p[4:] if p.startswith("/usr/") else "/usr" + p):
            owner = subprocess.run(["chroot", str(rootfs), "dpkg-query", "-S", candidate], capture_output=True,
                                   text=True)
            if owner.returncode == 0:
                return owner.stdout.split(":")[0]
    return None


def write_repository(root):
    for name in ("scale", "mlp", "torch_scale"):
        (root / name / "1").mkdir(parents=True)
    subprocess.run([CLI, "make-model", "scale", "--dims", str(SCALE_N), "--seed", "3",
                    "--out", str(root / "scale" / "1" / "model.safetensors")], check=True, capture_output=True)
    subprocess.run([CLI, "make-model", "mlp", "--dims", ",".join(map(str, MLP)), "--seed", "4",
                    "--out", str(root / "mlp" / "1" / "model.safetensors")], check=True, capture_output=True)
    (root / "torch_scale" / "1" / "model.safetensors").write_bytes(
        (root / "scale" / "1" / "model.safetensors").read_bytes())
    (root / "torch_scale" / "1" / "model.py").write_text(TORCH_PY)
    scale_io = f"""max_batch_size: 4
input:
  - {{name: x, data_type: TYPE_FP32, dims: [{SCALE_N}]}}
output:
  - {{name: y, data_type: TYPE_FP32, dims: [1]}}
"""
    (root / "scale" / "config.yaml").write_text("backend: scale\n" + scale_io +
                                                "instance_group:\n  - {count: 1, kind: KIND_CPU}\n")
    (root / "torch_scale" / "config.yaml").write_text(
        "backend: python\n" + scale_io + "  - {name: torch_version, data_type: TYPE_INT32, dims: [1]}\n"
        "instance_group:\n  - {count: 1, kind: KIND_CPU}\n")
    (root / "mlp" / "config.yaml").write_text(f"""backend: mlp
max_batch_size: 4
input:
  - {{name: input, data_type: TYPE_FP32, dims: [{MLP[0]}]}}
output:
  - {{name: logits, data_type: TYPE_FP32, dims: [{MLP[2]}]}}
  - {{name: argmax, data_type: TYPE_INT64, dims: [1]}}
instance_group:
  - {{count: 1, kind: KIND_CPU}}
""")
    # The server runs as uid 1000: the repository is readable by all, as a
    # volume of the storage initializer's would be.
    for p in [root, *root.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)


def test_serves_a_model_repository_at_mnt_models(image, tmp_path):
    from bundle_run import Container

    repo = tmp_path / "models"
    write_repository(repo)
    container = Container(image["bundle"], {"/mnt/models": repo}, tmp_path / "container.log")
    stopped = False
    try:
        def ready():
            if container.proc.poll() is not None:
                pytest.fail("the container exited:\n" + (tmp_path / "container.log").read_text()[-6000:])
            return container.http("GET", 8080, "/v2/health/ready")[0] == 200

        # backend: python's first worker imports torch: seconds on a loaded machine.
        wait_for(ready, lambda: "/v2/health/ready 200:\n" + (tmp_path / "container.log").read_text()[-3000:], 300)
        pid = container.init_pid()
        status = pathlib.Path(f"/proc/{pid}/status").read_text()
        assert os.path.basename(os.readlink(f"/proc/{pid}/exe")) == "hearth"
        assert re.search(r"^NSpid:\s+\d+\s+1$", status, re.M), "hearth is PID 1 of the container:\n" + status
        assert re.search(r"^Uid:\s+1000\s+1000\s+1000\s+1000$", status, re.M), status
        assert container.http("GET", 8080, "/v2/health/live")[0] == 200

        x = np.linspace(-1, 1, 2 * SCALE_N, dtype=np.float32).reshape(2, SCALE_N)
        w = read_safetensors(repo / "scale" / "1" / "model.safetensors")["weight"]
        expected = (x.astype(np.float64) * w.astype(np.float64)).sum(axis=1)
        body = json.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                                       "data": x.ravel().tolist()}]}).encode()
        for model in ("scale", "torch_scale"):
            code, text = container.http("POST", 8080, f"/v2/models/{model}/infer", body)
            assert code == 200, f"{model}: {code} {text!r}"
            outputs = {o["name"]: o for o in json.loads(text)["outputs"]}
            np.testing.assert_allclose(np.array(outputs["y"]["data"]), expected, rtol=1e-4, atol=1e-4)
        assert outputs["torch_version"]["data"] == [1, 1], "Debian 12's torch is 1.x: " + str(outputs)

        xm = np.linspace(-2, 2, 3 * MLP[0], dtype=np.float32).reshape(3, MLP[0])
        logits, argmax = mlp_reference(read_safetensors(repo / "mlp" / "1" / "model.safetensors"), xm)
        if GRPC_BUILT:
            np.save(tmp_path / "mlp.npy", xm)
            probe = container.exec(["/usr/bin/python3", str(HERE / "grpc_probe.py"), "8081", "mlp", "input",
                                    str(tmp_path / "mlp.npy")], timeout=120)
            assert probe.returncode == 0, probe.stderr.decode()[-4000:]
            answer = json.loads(probe.stdout)
            assert answer["ready"] is True
            outputs = answer["outputs"]
        else:  # a hearth built without gRPC: REST alone
            body = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": list(xm.shape),
                                           "data": xm.ravel().tolist()}]}).encode()
            code, text = container.http("POST", 8080, "/v2/models/mlp/infer", body)
            assert code == 200, f"mlp: {code} {text!r}"
            outputs = {o["name"]: o["data"] for o in json.loads(text)["outputs"]}
        np.testing.assert_allclose(np.array(outputs["logits"]).reshape(logits.shape), logits, rtol=1e-4, atol=1e-4)
        assert np.array(outputs["argmax"]).ravel().tolist() == argmax.tolist()

        code, text = container.http("GET", 8080, "/metrics")
        assert code == 200
        text = text.decode()
        for model in ("scale", "torch_scale", "mlp"):
            m = re.search(rf'^hearth_inference_request_success{{model="{model}"}} (\S+)$', text, re.M)
            assert m and float(m.group(1)) >= 1, f"{model}: " + text[:3000]
        for gauge in ("hearth_inference_pending_request_count", "hearth_inference_queued_request_count"):
            assert re.search(rf'^{gauge}{{model="scale"}} \S+$', text, re.M), gauge

        code, log = container.stop()
        stopped = True
        assert code == 0, "hearth serve did not exit 0 on SIGTERM as PID 1:\n" + log[-6000:]
    finally:
        if not stopped:
            container.stop()
