"""`hearth serve` with a model placed on several GPUs: placement (count
instances on each listed GPU), one copy of the weights per device, each
worker attached to its device's copy, requests spread over every device,
per-device metrics, a device whose workers keep dying taken out and brought
back, and a config naming a GPU that is not there failing that model alone.

With HEARTH_TEST_DEVICE=cuda on a machine where nvidia-smi lists 2 GPUs or
more (and CUDA_VISIBLE_DEVICES is unset, so that nvidia-smi's indices are
CUDA's ordinals), on GPUs 0 and 1. Anywhere else (CI, machines without GPUs), on
`--stand-in-gpus 2`: GPUs 0 and 1 exist as host memory, each with a store
of its own (<run dir>/store-host0.sock, store-host1.sock), and the same
code runs for real.

What a worker is attached to is proved from outside the server: the
store's own lease list (`hearth status`), and the worker's /proc/PID/maps
(host memory) or nvidia-smi's processes of each GPU (GPUs).
"""

import concurrent.futures
import os
import pathlib
import re
import shutil
import signal
import subprocess
import tempfile

import numpy as np
import pytest
import requests

from serve_support import (CLI, SCALE_N, infer_binary, mlp_reference, model_workers, model_workers_alive,
                           parse_metrics, read_safetensors, split_binary, start_serve, stop_serve, wait_for)


def visible_gpus():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return 0
    return len(out.stdout.split()) if out.returncode == 0 else 0


ON_GPUS = (os.environ.get("HEARTH_TEST_DEVICE", "cpu").startswith("cuda")
           and "CUDA_VISIBLE_DEVICES" not in os.environ and visible_gpus() >= 2)
GPU_COUNT = visible_gpus() if ON_GPUS else 2
DEV = ["cuda:0", "cuda:1"] if ON_GPUS else ["host0", "host1"]  # the devices' names in /metrics
STAND_IN = [] if ON_GPUS else ["--stand-in-gpus", "2"]
GPU_SOURCE = "the CUDA driver" if ON_GPUS else "--stand-in-gpus"

# Large enough that a batch takes the CPU backend a few milliseconds: with
# more requests at once than a device has workers, work queues up and idle
# workers of the other device are woken for it.
MLP = (1024, 2048, 64)

MLP_CONFIG = f"""backend: mlp
max_batch_size: 8
input:
  - {{name: input, data_type: TYPE_FP32, dims: [{MLP[0]}]}}
output:
  - {{name: logits, data_type: TYPE_FP32, dims: [{MLP[2]}]}}
  - {{name: argmax, data_type: TYPE_INT64, dims: [1]}}
"""


def write_repository(root):
    def model(name, kind, dims, seed, groups):
        (root / name / "1").mkdir(parents=True)
        subprocess.run([CLI, "make-model", kind, "--dims", dims, "--seed", str(seed),
                        "--out", str(root / name / "1" / "model.safetensors")], check=True, capture_output=True)
        header = MLP_CONFIG if kind == "mlp" else f"""backend: scale
max_batch_size: 4
input:
  - {{name: x, data_type: TYPE_FP32, dims: [{SCALE_N}]}}
output:
  - {{name: y, data_type: TYPE_FP32, dims: [1]}}
"""
        (root / name / "config.yaml").write_text(header + "instance_group:\n" + groups)

    mlp_dims = ",".join(map(str, MLP))
    # Triton's meaning: 2 instances on each of GPUs 0 and 1.
    model("mlp", "mlp", mlp_dims, 5, "  - {count: 2, kind: KIND_GPU, gpus: [0, 1]}\n")
    # No gpus: the default GPU (--device cuda:0).
    model("scale", "scale", str(SCALE_N), 6, "  - {count: 1, kind: KIND_GPU}\n")
    # The host and GPU 0 at once.
    model("mixed", "scale", str(SCALE_N), 7, "  - {count: 1, kind: KIND_CPU}\n  - {count: 1, kind: KIND_GPU, gpus: [0]}\n")
    # One past the last GPU: this model fails alone.
    model("wide", "mlp", mlp_dims, 8, f"  - {{count: 1, kind: KIND_GPU, gpus: [0, {GPU_COUNT}]}}\n")


@pytest.fixture(scope="module")
def server():
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="hearth-multigpu-test-"))
    write_repository(tmp / "repo")
    state = start_serve(tmp, tmp / "repo", [*STAND_IN, "--exec-timeout-ms", "10000"], device="cuda:0")
    state["weights"] = read_safetensors(tmp / "repo" / "mlp" / "1" / "model.safetensors")
    yield state
    code, text = stop_serve(state)
    if os.environ.get("HEARTH_TEST_LOG_DIR"):
        shutil.copy(state["log"], pathlib.Path(os.environ["HEARTH_TEST_LOG_DIR"]) / "multigpu-test-server.log")
    shutil.rmtree(tmp, ignore_errors=True)
    assert code == 0, text[-2000:]
    assert not pathlib.Path(state["run_dir"]).exists(), "run directory left behind"
    assert not model_workers_alive(state["run_dir"]), "workers outlived the server"


def metrics(url):
    r = requests.get(f"{url}/metrics", timeout=10)
    assert r.status_code == 200
    return parse_metrics(r.text)


def store_status(run_dir, devices):
    """What each device's store says it holds and who is attached, from
    `hearth status --device` on the server's run directory: {device:
    {"arenas": [(model, version, bytes)], "leases": [(pid, model)]}}."""
    socket = lambda d: f"{run_dir}/store-{d.replace(':', '')}.sock"
    out = subprocess.run([CLI, "status", "--socket", f"{run_dir}/store.sock", "--device", ",".join(devices)],
                         check=True, capture_output=True, text=True).stdout
    if len(devices) == 1:  # one store: no heading
        out = f"== {devices[0]}: {socket(devices[0])}\n" + out
    stores = {}
    current = None
    for line in out.splitlines():
        heading = re.match(r"== (\S+): (\S+)$", line)
        if heading:
            assert heading.group(2) == socket(heading.group(1)), line
            current = stores.setdefault(heading.group(1), {"arenas": [], "leases": []})
            continue
        arena = re.match(r"  (\S+)@(\d+)  (\d+) bytes  registered", line)
        if arena:
            current["arenas"].append((arena.group(1), int(arena.group(2)), int(arena.group(3))))
        lease = re.match(r"  pid (\d+) uid \d+  (\S+)@\d+", line)
        if lease:
            current["leases"].append((int(lease.group(1)), lease.group(2)))
    assert sorted(stores) == sorted(devices), out
    return stores


def leased(run_dir, device, model):
    return sorted(p for p, m in store_status(run_dir, [device])[device]["leases"] if m == model)


def arena_mappings(pid):
    """(perms, inode, size) of each hearth arena the process maps."""
    out = []
    for line in pathlib.Path(f"/proc/{pid}/maps").read_text().splitlines():
        if "memfd:hearth-arena" not in line:
            continue
        fields = line.split()
        lo, hi = (int(x, 16) for x in fields[0].split("-"))
        out.append((fields[1], fields[4], hi - lo))
    return out


def mlp_request(url, rng, rows):
    x = rng.standard_normal((rows, MLP[0])).astype(np.float32)
    return x, infer_binary(url, "mlp", "input", x, outputs=["logits"])


def check_answer(server, x, r):
    assert r.status_code == 200, r.text
    _, parts = split_binary(r)
    got = np.frombuffer(parts["logits"], dtype="<f4").reshape(x.shape[0], MLP[2])
    np.testing.assert_allclose(got, mlp_reference(server["weights"], x)[0], rtol=1e-4, atol=1e-4)


def gpu_processes():
    """{pid: GPU index} of the compute processes nvidia-smi lists."""
    index = {}
    for line in subprocess.run(["nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader"],
                               capture_output=True, text=True, check=True).stdout.splitlines():
        i, bus = (x.strip() for x in line.split(","))
        index[bus] = int(i)
    pids = {}
    for line in subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id", "--format=csv,noheader"],
                               capture_output=True, text=True, check=True).stdout.splitlines():
        pid, bus = (x.strip() for x in line.split(","))
        pids.setdefault(int(pid), set()).add(index[bus])
    return pids


def test_two_instances_on_each_gpu_each_attached_to_its_own_devices_copy(server):
    run_dir = server["run_dir"]
    pids = sorted(model_workers(server["proc"].pid, "mlp"))
    assert len(pids) == 4, pids
    stores = store_status(run_dir, DEV)
    on = {d: sorted(p for p, m in stores[d]["leases"] if m == "mlp") for d in DEV}
    # The stores' own accounting: two of the four workers on each, none on both.
    assert len(on[DEV[0]]) == 2 and len(on[DEV[1]]) == 2, on
    assert sorted(on[DEV[0]] + on[DEV[1]]) == pids, (on, pids)
    # Each store holds exactly one copy of the model.
    copies = {d: [a for a in stores[d]["arenas"] if a[0] == "mlp"] for d in DEV}
    assert len(copies[DEV[0]]) == 1 and len(copies[DEV[1]]) == 1, copies
    arena_bytes = copies[DEV[0]][0][2]
    assert copies[DEV[1]][0][2] == arena_bytes
    if ON_GPUS:
        # Each worker's context is on its own GPU, and on no other.
        apps = gpu_processes()
        if not apps:
            pytest.skip("nvidia-smi lists no compute processes here (another PID namespace?)")
        for i, device in enumerate(DEV):
            for p in on[device]:
                assert apps.get(p) == {i}, f"worker {p} of {device} is on GPUs {apps.get(p)}"
    else:
        # What each worker maps: one arena, read-only, the same memfd as the
        # other worker of its device and another than the other device's.
        inode = {}
        for device, device_pids in on.items():
            seen = set()
            for p in device_pids:
                maps = arena_mappings(p)
                assert len(maps) == 1, f"worker {p} maps {len(maps)} arenas"
                perms, ino, size = maps[0]
                assert perms.startswith("r") and "w" not in perms, "the weights must be mapped read-only"
                assert size >= arena_bytes
                seen.add(ino)
            assert len(seen) == 1, f"the workers on {device} map different arenas: {seen}"
            inode[device] = seen.pop()
        assert inode[DEV[0]] != inode[DEV[1]], "both devices' workers map one arena"
    # /metrics agrees: one copy's bytes per device; GPU 1's store holds
    # nothing else, GPU 0's also the models placed only there.
    v = metrics(server["url"])
    for d in DEV:
        assert v[f'hearth_shared_weights_bytes{{model="mlp",device="{d}"}}'] == arena_bytes
        assert v[f'hearth_placement_workers{{model="mlp",device="{d}"}}'] == 2
        assert v[f'hearth_placement_ready_workers{{model="mlp",device="{d}"}}'] == 2
        assert v[f'hearth_placement_ready{{model="mlp",device="{d}"}}'] == 1
    assert v[f'hearth_store_arena_bytes{{device="{DEV[1]}"}}'] == arena_bytes
    assert v[f'hearth_store_arenas{{device="{DEV[1]}"}}'] == 1
    first_total = sum(b for _, _, b in stores[DEV[0]]["arenas"])
    assert v[f'hearth_store_arena_bytes{{device="{DEV[0]}"}}'] == first_total
    assert v[f'hearth_store_arenas{{device="{DEV[0]}"}}'] == len(stores[DEV[0]]["arenas"]) == 3  # mlp, scale, mixed
    workers = {k: val for k, val in v.items() if k.startswith('hearth_worker_ready{model="mlp"')}
    for d in DEV:
        assert sum(1 for k in workers if f'device="{d}"' in k) == 2, workers
    log = server["log"].read_text()
    assert f"model mlp version 1: mlp on {DEV[0]} (2 workers), {DEV[1]} (2 workers)" in log
    assert re.search(rf"model mlp: weights loaded on {DEV[0]}, {DEV[1]} in [\d.]+ s \(at once\)", log), log[-3000:]


def test_the_default_gpu_and_the_host_take_the_groups_that_name_them(server):
    v = metrics(server["url"])
    placed = lambda model: sorted(re.search(r'device="([^"]+)"', k).group(1) for k in v
                                  if k.startswith(f'hearth_placement_workers{{model="{model}"'))
    assert placed("scale") == [DEV[0]]
    assert placed("mixed") == sorted(["cpu", DEV[0]])
    run_dir = server["run_dir"]
    assert len(leased(run_dir, "cpu", "mixed")) == 1
    assert len(leased(run_dir, DEV[0], "mixed")) == 1
    assert leased(run_dir, DEV[1], "mixed") == []
    x = np.ones((2, SCALE_N), np.float32)
    for model in ("scale", "mixed"):
        r = infer_binary(server["url"], model, "x", x, outputs=["y"])
        assert r.status_code == 200, r.text


def test_requests_are_served_by_the_workers_of_both_gpus(server):
    url = server["url"]
    before = metrics(url)
    batches = lambda v, d: v.get(f'hearth_placement_batches{{model="mlp",device="{d}"}}', 0.0)
    rng = np.random.default_rng(21)

    def both_served():
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            for x, r in pool.map(lambda i: mlp_request(url, np.random.default_rng(i), 1 + i % 3),
                                 rng.integers(0, 1 << 30, size=64)):
                check_answer(server, x, r)
        v = metrics(url)
        return all(batches(v, d) > batches(before, d) for d in DEV)
    wait_for(both_served, f"batches answered on both {DEV[0]} and {DEV[1]}", timeout=120)


def test_a_config_naming_a_gpu_that_is_not_there_fails_that_model_alone(server):
    url = server["url"]
    r = requests.get(f"{url}/v2/models/wide/ready", timeout=10)
    assert r.status_code == 503
    want = (f"instance_group[0].gpus names GPU {GPU_COUNT}, but {GPU_COUNT} GPUs are visible "
            f"(GPUs 0 to {GPU_COUNT - 1}), by {GPU_SOURCE}")
    assert want in r.text, r.text
    assert "wide/config.yaml" in r.text, r.text
    assert want in server["log"].read_text()
    for model in ("mlp", "scale", "mixed"):
        assert requests.get(f"{url}/v2/models/{model}/ready", timeout=10).status_code == 200, model
    x, r = mlp_request(url, np.random.default_rng(3), 2)
    check_answer(server, x, r)


def test_a_gpu_whose_workers_keep_dying_is_failed_and_its_work_goes_to_the_other(server):
    """All of GPU 1's workers killed as soon as they are ready, again and
    again with no batch answered in between: GPU 1 is reported failed (log,
    /metrics) while the model stays ready and every request succeeds on
    GPU 0; once it is let be, a probe batch brings GPU 1 back."""
    url, run_dir = server["url"], server["run_dir"]
    key = lambda name, d: f'{name}{{model="mlp",device="{d}"}}'
    killed = set()
    failed_seen = None
    for _ in range(20):
        v = metrics(url)
        if v[key("hearth_placement_failed", DEV[1])] == 1:
            failed_seen = v
            break
        # GPU 1's workers as its store sees them, once both are new and ready.
        def fresh():
            pids = leased(run_dir, DEV[1], "mlp")
            ready = metrics(url)[key("hearth_placement_ready_workers", DEV[1])]
            return pids if len(pids) == 2 and not set(pids) & killed and ready == 2 else None
        pids = wait_for(fresh, "GPU 1's workers to be replaced and ready", timeout=60)
        for p in pids:
            os.kill(p, signal.SIGKILL)
        killed |= set(pids)

        def seen_dead_or_failed():
            v = metrics(url)
            return (v[key("hearth_placement_failed", DEV[1])] == 1
                    or not set(leased(run_dir, DEV[1], "mlp")) & set(pids))
        wait_for(seen_dead_or_failed, "the store to see GPU 1's killed workers go", timeout=60)
    assert failed_seen is not None, f"{DEV[1]} was never reported failed"
    v = failed_seen
    assert v[key("hearth_placement_ready", DEV[1])] == 0
    assert v[key("hearth_placement_failures", DEV[1])] == 1
    assert v[key("hearth_placement_failed", DEV[0])] == 0
    assert v[key("hearth_placement_ready", DEV[0])] == 1
    log = server["log"].read_text()
    assert re.search(rf"model mlp: {DEV[1]} has failed: its workers died \d+ times in a row without "
                     rf"answering a batch .*its work goes to {DEV[0]}", log), log[-3000:]
    # The model stays ready, and every request is answered right, by GPU 0:
    # while GPU 1 is failed its workers take no batch but a probe, and a
    # probe answered ends the failure (it is due 1 s after the failure, so
    # these requests may meet it).
    assert requests.get(f"{url}/v2/models/mlp/ready", timeout=10).status_code == 200
    # GPU 1's replacements are up, and would take work if let.
    wait_for(lambda: metrics(url)[key("hearth_placement_ready_workers", DEV[1])] == 2,
             "GPU 1's workers to be ready again", timeout=60)
    # Full batches (8 rows), more at once than GPU 0 has workers: the queue
    # holds work that idle workers of GPU 1 would be woken for.
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        for x, r in pool.map(lambda i: mlp_request(url, np.random.default_rng(100 + i), 8), range(64)):
            check_answer(server, x, r)
    after = metrics(url)
    delta = lambda d: after[key("hearth_placement_batches", d)] - v[key("hearth_placement_batches", d)]
    assert delta(DEV[0]) > 0
    if after[key("hearth_placement_failed", DEV[1])] == 1:
        assert delta(DEV[1]) == 0, "a failed placement's workers took batches"
    else:
        assert f"model mlp: {DEV[1]} serves again (a probe batch was answered)" in server["log"].read_text()

    # Let be, GPU 1's workers serve a probe batch and it comes back.
    def recovered():
        x, r = mlp_request(url, np.random.default_rng(7), 1)
        check_answer(server, x, r)
        v = metrics(url)
        return v[key("hearth_placement_failed", DEV[1])] == 0 and v[key("hearth_placement_ready", DEV[1])] == 1
    wait_for(recovered, "GPU 1 to serve again after its probe", timeout=120)
    assert f"model mlp: {DEV[1]} serves again" in server["log"].read_text()
