#!/usr/bin/env python3
"""8 gunicorn --preload workers on one GPU store: one copy of the weights, 8 contexts.

    python3 bench/python/gunicorn_gpu.py --cli build-gpu/bin/hearth --workers 8

Writes two checkpoints (the example's "scale", N=500, and the seed's MLP,
16384 -> 16384 -> 12800 f32 = 1.8 GiB), starts `hearth store --device cuda:0`
with both on a temporary socket, and measures device memory in use
(nvidia-smi, settled: polled until it stops changing):

  1. one bare CUDA context (build/tests/store/attach_probe context N, else a
     ctypes cuInit + cuDevicePrimaryCtxRetain in a subprocess);
  2. the store alone (its arenas + its context);
  3. `gunicorn -w 8 --preload run_server:app` of examples/gunicorn_flask
     (scale only: 2 KB of weights, so each worker costs its context + torch);
  4. `gunicorn -w 8 --preload gunicorn_gpu_app:app` (bench/python): each
     request reads all of scale AND all of the 1.8 GiB MLP.

For 3 and 4 it sends concurrent requests until each of the 8 workers has
answered (each answer carries its pid; gives up after --answer-timeout s),
checks every answer against numpy on the checkpoint files, and measures. If
any worker held a copy of the MLP, 4 would cost 8 x 1.8 GiB more than 3; the
check is that it costs less than half of one copy more. A markdown table is
printed last. Exit status 0 when every check passed, else 1.

--device cpu runs the same on host memory (a store on a memfd) and measures
PSS from /proc/PID/smaps instead (there is no context there): used to test
this script without a GPU, with a smaller --mlp-dims.

Needs flask, gunicorn and numpy for `python3` (and torch with CUDA for the
GPU workers); PYTHONPATH is passed on to gunicorn, with the repository's
python/ in front.
"""

import argparse
import concurrent.futures
import json
import os
import pathlib
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "python"))
from process_group import start, stop  # noqa: E402  (shared with the Python tests)
HERE = pathlib.Path(__file__).resolve().parent
ARENA = "memfd:hearth-arena"
MIB = 1 << 20
GIB = 1 << 30


def log(message):
    print(message, file=sys.stderr, flush=True)


# ---- checkpoints and references ---------------------------------------------


def safetensors_arrays(path):
    """{name: read-only numpy memmap} of an F32 checkpoint (no full read into memory)."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    base = 8 + header_len
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] != "F32":
            raise SystemExit(f"{path}: tensor {name} is {entry['dtype']}, expected F32")
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        out[name] = np.memmap(path, dtype="<f4", mode="r", offset=base + begin, shape=shape)
    return out


def scale_reference(weight, number, seed=None):
    """run_server.py's documented math, from the checkpoint's weight."""
    x = np.random.default_rng(number if seed is None else seed).random(
        (number, weight.shape[0]), dtype=np.float32)
    return float(np.dot(x.sum(axis=0, dtype=np.float64), weight.astype(np.float64)))


def mlp_reference(path):
    """{name: (float64 sum, float64 sum of |x|)} of every tensor of the checkpoint."""
    out = {}
    for name, a in safetensors_arrays(path).items():
        flat = a.reshape(-1)
        total = abs_total = 0.0
        step = 1 << 24
        for i in range(0, flat.size, step):
            chunk = np.asarray(flat[i:i + step])
            total += float(chunk.sum(dtype=np.float64))
            abs_total += float(np.abs(chunk).sum(dtype=np.float64))
        out[name] = (total, abs_total)
    return out


# ---- processes ----------------------------------------------------------------


def tail(path, n=4000):
    try:
        return pathlib.Path(path).read_text(errors="replace")[-n:]
    except OSError:
        return ""


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url, payload=None, timeout=120):
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        body = e.read()
        try:
            return e.code, json.loads(body)
        except ValueError:
            return e.code, body.decode(errors="replace")
    except (OSError, ValueError) as e:
        return None, f"{type(e).__name__}: {e}"


def parent_of(pid):
    stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def children(pid):
    out = []
    for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


# ---- measuring ------------------------------------------------------------------


def physical_gpu(device):
    """nvidia-smi's index of "cuda:N" (CUDA_VISIBLE_DEVICES honoured when numeric)."""
    index = int(device.partition(":")[2] or 0)
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
               if v.strip()]
    if visible and index < len(visible) and visible[index].isdigit():
        return int(visible[index])
    return index


def nvidia_smi_used(gpu):
    """Bytes of device memory in use on GPU `gpu` (nvidia-smi's MiB)."""
    out = subprocess.run(["nvidia-smi", "-i", str(gpu), "--query-gpu=memory.used",
                          "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return int(float(out.split()[0]) * MIB)


def nvidia_smi_apps():
    """{pid: bytes} of the compute processes nvidia-smi lists (may be empty in a container)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                              "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    apps = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            try:
                apps[int(parts[0])] = int(float(parts[1]) * MIB)
            except ValueError:
                pass
    return apps


def settled(read, tolerance=MIB, interval=0.5, limit=60):
    """read() once it has stopped changing (two readings `tolerance` apart at most)."""
    last = read()
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        time.sleep(interval)
        now = read()
        if abs(now - last) <= tolerance:
            return now
        last = now
    log(f"warning: memory reading did not settle within {limit} s; last {last / MIB:.0f} MiB")
    return last


def smaps(pid):
    """(total PSS, arena PSS, arena RSS) of `pid` in bytes, from /proc/PID/smaps."""
    total = arena_pss = arena_rss = 0
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if not first.endswith(":"):
                inside = ARENA in line
            elif first == "Pss:":
                kb = int(line.split()[1]) * 1024
                total += kb
                if inside:
                    arena_pss += kb
            elif inside and first == "Rss:":
                arena_rss += int(line.split()[1]) * 1024
    return total, arena_pss, arena_rss


def memfd_bytes(pid):
    """Bytes of memory held by the hearth arena memfds open in `pid` (distinct inodes)."""
    seen, total = set(), 0
    fd_dir = pathlib.Path(f"/proc/{pid}/fd")
    for fd in fd_dir.iterdir():
        try:
            if ARENA not in os.readlink(fd):
                continue
            st = os.stat(fd)
        except OSError:
            continue
        if st.st_ino not in seen:
            seen.add(st.st_ino)
            total += st.st_blocks * 512
    return total


def bare_context_cost(args, gpu, work):
    """Device memory one process with nothing but a CUDA context costs (bytes), and how."""
    read = lambda: nvidia_smi_used(gpu)  # noqa: E731
    index = str(int(args.device.partition(":")[2] or 0))
    probe = args.probe
    if probe and os.access(probe, os.X_OK):
        cmd, how = [probe, "context", index], f"{probe} context {index}"
    else:
        script = work / "bare_context.py"
        script.write_text(
            "import ctypes, signal, sys\n"
            "cu = ctypes.CDLL('libcuda.so.1')\n"
            "def check(rc, what):\n"
            "    if rc != 0:\n"
            "        print(f'{what} failed: CUresult {rc}', flush=True); sys.exit(1)\n"
            "check(cu.cuInit(0), 'cuInit')\n"
            "dev = ctypes.c_int()\n"
            "check(cu.cuDeviceGet(ctypes.byref(dev), int(sys.argv[1])), 'cuDeviceGet')\n"
            "ctx = ctypes.c_void_p()\n"
            "check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), 'cuDevicePrimaryCtxRetain')\n"
            "check(cu.cuCtxSetCurrent(ctx), 'cuCtxSetCurrent')\n"
            "print('ready', flush=True)\n"
            "signal.pause()\n")
        cmd, how = [sys.executable, str(script), index], "ctypes cuDevicePrimaryCtxRetain"
    idle = settled(read)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        line = proc.stdout.readline()
        if "ready" not in line:
            raise RuntimeError(f"{how}: {line.strip() or 'exited'} (rc {proc.poll()})")
        with_ctx = settled(read)
    finally:
        stop(proc, timeout=10)
    settled(read)  # its context is freed asynchronously
    return with_ctx - idle, how


# ---- the store ------------------------------------------------------------------


def store_arenas(cli, sock):
    """{model: arena bytes} from `hearth status`."""
    out = subprocess.run([cli, "status", "--socket", sock], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    arenas = {}
    for line in out.splitlines():
        fields = line.split()
        if len(fields) >= 3 and "@" in fields[0] and fields[2] == "bytes":
            arenas[fields[0].split("@")[0]] = int(fields[1])
    return arenas


# ---- one gunicorn phase --------------------------------------------------------


class Checks:
    def __init__(self):
        self.results = []

    def add(self, ok, what):
        self.results.append((bool(ok), what))
        log(("PASS " if ok else "FAIL ") + what)
        return ok

    @property
    def ok(self):
        return all(ok for ok, _ in self.results)


def run_phase(args, label, cwd, app, env, verify, work, checks, measure):
    """Runs gunicorn, gets an answer from every worker, verifies, measures. Returns a dict."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = work / f"gunicorn-{label}.log"
    cmd = [sys.executable, "-m", "gunicorn", "-w", str(args.workers), "--preload",
           "-b", f"127.0.0.1:{port}", "--timeout", "300", app]
    log(f"[{label}] {' '.join(cmd)}  (cwd {cwd})")
    proc = start(cmd, cwd, env, log_path)
    result = {"label": label, "app": app, "answers": 0, "errors": [], "pids": []}
    try:
        master = proc.pid
        deadline = time.monotonic() + args.start_timeout
        while True:
            status, _ = http(base + "/health", timeout=5)
            if status == 200:
                break
            if proc.poll() is not None or time.monotonic() > deadline:
                checks.add(False, f"[{label}] gunicorn came up (rc {proc.poll()}):\n"
                                  f"{tail(log_path)}")
                return result
            time.sleep(0.25)

        numbers = [1 + i % 40 for i in range(args.concurrency * 2)]
        pids, answers, errors = set(), 0, []
        start_time = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            while True:
                replies = list(pool.map(lambda n: (n, *http(base + "/", {"number": n})), numbers))
                for number, status, body in replies:
                    answers += 1
                    if status != 200 or not isinstance(body, dict):
                        errors.append(f"number {number}: {status} {body}")
                        continue
                    problem = verify(number, body)
                    if problem:
                        errors.append(f"number {number} (pid {body.get('pid')}): {problem}")
                    pids.add(body["pid"])
                if len(pids) >= args.workers or len(errors) > 20:
                    break
                if time.monotonic() - start_time > args.answer_timeout:
                    break
        elapsed = time.monotonic() - start_time
        result.update(answers=answers, errors=errors, pids=sorted(pids), seconds=elapsed)
        log(f"[{label}] {answers} answers from {len(pids)} workers in {elapsed:.1f} s")
        checks.add(not errors, f"[{label}] all {answers} answers equal the numpy reference"
                               + (f"; {len(errors)} wrong, first: {errors[:3]}" if errors else ""))
        checks.add(len(pids) == args.workers,
                   f"[{label}] every one of the {args.workers} workers answered "
                   f"({len(pids)} did, {answers} requests, {elapsed:.1f} s)")
        workers = [p for p in pids if p in children(master)]
        checks.add(len(workers) == len(pids),
                   f"[{label}] every answering pid is a worker of the master {master}")
        result["master"] = master
        if pids:
            result.update(measure(master, sorted(pids)))
    finally:
        stop(proc, timeout=30)
    return result


# ---- main ---------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_cli = ROOT / "build-gpu" / "bin" / "hearth"
    if not default_cli.exists():
        default_cli = ROOT / "build" / "bin" / "hearth"
    p.add_argument("--cli", default=str(default_cli), help="the hearth binary")
    p.add_argument("--library", help="libhearth.so (default: beside --cli's build)")
    p.add_argument("--probe", help="attach_probe for the bare context (default: beside --cli)")
    p.add_argument("--device", default="cuda:0", help="the store's device: cuda:N or cpu")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--scale-n", type=int, default=500)
    p.add_argument("--mlp-dims", default="16384,16384,12800")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    p.add_argument("--answer-timeout", type=float, default=60.0,
                   help="seconds to get an answer from every worker")
    p.add_argument("--start-timeout", type=float, default=120.0)
    p.add_argument("--workdir", help="where the checkpoints and logs go (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    args = p.parse_args(argv)
    args.cli = os.path.abspath(args.cli)
    build = pathlib.Path(args.cli).parent.parent
    args.library = os.path.abspath(args.library or build / "src" / "capi" / "libhearth.so")
    if args.probe is None:
        args.probe = str(build / "tests" / "store" / "attach_probe")
    args.cuda = args.device.startswith("cuda")
    return args


def fmt(value):
    return "n/a" if value is None else f"{value / MIB:,.1f}"


def main(argv=None):
    args = parse_args(argv)
    checks = Checks()
    for path in (args.cli, args.library):
        if not os.path.exists(path):
            raise SystemExit(f"not found: {path}")
    work = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="hearth-gg-"))
    work.mkdir(parents=True, exist_ok=True)
    sock = str(work / "store.sock")
    store_proc = None
    gpu = physical_gpu(args.device) if args.cuda else None
    try:
        files = {"scale": work / "scale.safetensors", "mlp": work / "mlp.safetensors"}
        log(f"writing checkpoints in {work}")
        for cmd in (["scale", "--dims", str(args.scale_n), "--seed", "11", "--out", files["scale"]],
                    ["mlp", "--dims", args.mlp_dims, "--dtype", "f32", "--seed", "13",
                     "--out", files["mlp"]]):
            subprocess.run([args.cli, "make-model", *map(str, cmd)], check=True,
                           capture_output=True, timeout=600)
        scale_weight = np.array(safetensors_arrays(files["scale"])["weight"])
        mlp_ref = mlp_reference(files["mlp"])
        mlp_bytes = sum(a.nbytes for a in safetensors_arrays(files["mlp"]).values())
        scale_bytes = scale_weight.nbytes

        # 1. One bare context.
        ctx_bare, ctx_how = None, "n/a on host memory"
        if args.cuda:
            read = lambda: nvidia_smi_used(gpu)  # noqa: E731
            ctx_bare, ctx_how = bare_context_cost(args, gpu, work)
            log(f"bare CUDA context: {fmt(ctx_bare)} MiB ({ctx_how})")
            checks.add(ctx_bare > 16 * MIB, f"a bare CUDA context costs device memory "
                                            f"({fmt(ctx_bare)} MiB)")

        # 2. The store alone.
        before_store = settled(read) if args.cuda else None
        store_out = work / "store.out"
        store_proc = start([args.cli, "store", "--socket", sock, "--device", args.device,
                            f"--model=scale={files['scale']}", f"--model=mlp={files['mlp']}"],
                           str(work), dict(os.environ), store_out)
        deadline = time.monotonic() + 600
        while "ready" not in tail(store_out, 100000):
            if store_proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"hearth store did not become ready:\n{tail(store_out)}")
            time.sleep(0.1)
        arenas = store_arenas(args.cli, sock)
        arena_total = sum(arenas.values())
        if args.cuda:
            store_alone = settled(read) - before_store
        else:
            store_alone = memfd_bytes(store_proc.pid) + smaps(store_proc.pid)[0]
        log(f"store alone: {fmt(store_alone)} MiB (arenas {arenas})")
        checks.add(store_alone >= 0.95 * arena_total,
                   f"the store holds one copy: {fmt(store_alone)} MiB >= arenas "
                   f"{fmt(arena_total)} MiB")

        env = dict(os.environ)
        paths = [str(ROOT / "python")] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                          if p]
        env.update(PYTHONPATH=os.pathsep.join(paths), HEARTH_SOCKET=sock,
                   HEARTH_LIBRARY=args.library, PYTHONDONTWRITEBYTECODE="1",
                   PYTHONUNBUFFERED="1", HEARTH_MODEL="scale", HEARTH_SCALE_MODEL="scale",
                   HEARTH_MLP_MODEL="mlp")

        def measure_factory():
            """measure(master, pids) for the device: taken against a fresh baseline."""
            if args.cuda:
                baseline = settled(read)

                def measure(master, pids):
                    total = settled(read) - baseline
                    apps = nvidia_smi_apps()
                    return {"total": total, "per_worker": total / len(pids) if pids else None,
                            "apps": {p: apps[p] for p in [master] + pids if p in apps}}
                return measure

            def measure(master, pids):
                rows = {p: smaps(p) for p in pids}
                total = sum(r[0] for r in rows.values())
                arena_pss = sum(r[1] for r in rows.values())
                private = total - arena_pss
                return {"total": total, "per_worker": private / len(pids) if pids else None,
                        "arena_pss": arena_pss, "arena_rss_min": min(r[2] for r in rows.values()),
                        "private": private, "master_arena_pss": smaps(master)[1]}
            return measure

        def verify_scale(number, body):
            want = scale_reference(scale_weight, number)
            got = body.get("result")
            if got is None or abs(got - want) > 1e-12 * abs(want):
                return f"result {got}, expected {want}"
            return None

        def verify_both(number, body):
            want = scale_reference(scale_weight, number)
            got = body.get("scale")
            if got is None or abs(got - want) > 1e-12 * abs(want):
                return f"scale {got}, expected {want}"
            if body.get("device") != args.device:
                return f"device {body.get('device')}, expected {args.device}"
            sums = body.get("mlp") or {}
            if sorted(sums) != sorted(mlp_ref):
                return f"mlp tensors {sorted(sums)}, expected {sorted(mlp_ref)}"
            for name, (total, abs_total) in mlp_ref.items():
                if abs(sums[name] - total) > 1e-5 * abs_total + 1e-6:
                    return f"sum of mlp {name} {sums[name]}, expected {total}"
            return None

        # 3. run_server.py of the example: scale only.
        phase_a = run_phase(args, "run_server", ROOT / "examples" / "gunicorn_flask",
                            "run_server:app", env, verify_scale, work, checks, measure_factory())
        # 4. Both models, the MLP read whole by every worker on every request.
        phase_b = run_phase(args, "scale+mlp", HERE, "gunicorn_gpu_app:app", env, verify_both,
                            work, checks, measure_factory())

        n = args.workers
        a_total, b_total = phase_a.get("total"), phase_b.get("total")
        measured = a_total is not None and b_total is not None
        if measured and args.cuda:
            extra = b_total - a_total
            checks.add(extra < max(0.5 * mlp_bytes, 64 * MIB),
                       f"no worker holds a copy of the MLP: {n} workers reading it cost "
                       f"{fmt(extra)} MiB more than {n} workers without it "
                       f"(one copy is {fmt(mlp_bytes)} MiB; {n} copies {fmt(n * mlp_bytes)} MiB)")
            if mlp_bytes >= GIB:
                checks.add(phase_b["per_worker"] < mlp_bytes,
                           f"per-worker cost {fmt(phase_b['per_worker'])} MiB is below one copy "
                           f"of the weights ({fmt(mlp_bytes)} MiB)")
            for ph in (phase_a, phase_b):
                apps = ph.get("apps", {})
                if apps and any(p in apps for p in ph["pids"]):  # nvidia-smi sees our pids
                    checks.add(ph["master"] not in apps,
                               f"[{ph['label']}] the gunicorn master has no CUDA context")
        elif measured:
            extra = phase_b["private"] - phase_a["private"]
            checks.add(extra < max(0.5 * mlp_bytes, 64 * MIB),
                       f"no worker holds a private copy of the MLP: private PSS grew by "
                       f"{fmt(extra)} MiB (one copy is {fmt(mlp_bytes)} MiB)")
            checks.add(phase_b["arena_pss"] <= 1.1 * arena_total + MIB,
                       f"the workers' arena PSS sums to one copy: {fmt(phase_b['arena_pss'])} "
                       f"MiB for arenas of {fmt(arena_total)} MiB")
            checks.add(phase_b["arena_rss_min"] >= 0.95 * mlp_bytes,
                       f"every worker mapped and read the whole MLP (arena RSS min "
                       f"{fmt(phase_b['arena_rss_min'])} MiB)")
            for ph in (phase_a, phase_b):
                checks.add(ph["master_arena_pss"] == 0,
                           f"[{ph['label']}] the gunicorn master maps no arena")

        # The table.
        unit = "device memory in use (nvidia-smi), MiB" if args.cuda else "host memory, MiB"
        lines = [f"### {n} gunicorn --preload workers, store on {args.device}", "",
                 f"| measurement | {unit} | notes |", "|---|---:|---|"]

        def row(label, value, note=""):
            lines.append(f"| {label} | {fmt(value)} | {note} |")

        row("weights: one copy (scale + mlp)", scale_bytes + mlp_bytes,
            f"scale {scale_bytes} B; mlp {args.mlp_dims} f32 {mlp_bytes / GIB:.2f} GiB; "
            f"arenas {fmt(arena_total)} MiB")
        row("store alone (arena + store context)" if args.cuda else
            "store alone (arena memfd pages + store PSS)", store_alone)
        row("one bare CUDA context", ctx_bare, ctx_how)
        for ph, what in ((phase_a, "run_server:app (scale only)"),
                         (phase_b, "gunicorn_gpu_app:app (scale + all of mlp per request)")):
            if ph.get("total") is None:
                row(f"{n} workers, {what}", None, "not measured: see the failures")
                continue
            note = f"{len(ph['pids'])} workers answered {ph['answers']} requests"
            if not args.cuda:
                note += (f"; arena PSS {fmt(ph['arena_pss'])} MiB, arena RSS min "
                         f"{fmt(ph['arena_rss_min'])} MiB")
            row(f"{n} workers, {what}: total", ph["total"], note)
            row("  per worker" if args.cuda else "  per worker (PSS outside the arena)",
                ph["per_worker"],
                "context + torch + allocator" if args.cuda else "interpreter, flask, numpy")
        if measured:
            row(f"if every worker held its own mlp: {n} copies", n * mlp_bytes)
            extra = (b_total - a_total) if args.cuda else (phase_b["private"] - phase_a["private"])
            row("workers reading mlp minus workers without it", extra,
                f"= {extra / mlp_bytes:.3f} copies of mlp")
            if args.cuda:
                total = store_alone + b_total
                model = arena_total + (ctx_bare or 0) + n * phase_a["per_worker"]
                row(f"total: store + {n} workers (scale + mlp)", total)
                row(f"one copy + store context + {n} x per-worker context", model,
                    f"per-worker context = a run_server worker's cost; "
                    f"torch adds {fmt(phase_a['per_worker'] - ctx_bare)} MiB to a bare context")
                close = abs(total - model) <= max(0.05 * model, 0.5 * mlp_bytes)
                lines.append("")
                lines.append(f"Total ≈ one copy + {n} × per-worker context: "
                             f"{'yes' if close else 'NO'} ({fmt(total)} vs {fmt(model)} MiB; "
                             f"{n} copies of the weights would add {fmt(n * mlp_bytes)} MiB).")
        lines.append("")
        for ok, what in checks.results:
            lines.append(f"- {'PASS' if ok else 'FAIL'}: {what.splitlines()[0]}")
        print("\n".join(lines), flush=True)
        summary = {"device": args.device, "workers": n, "weights_bytes": scale_bytes + mlp_bytes,
                   "arena_bytes": arena_total, "store_alone": store_alone, "bare_context": ctx_bare,
                   "run_server": {k: v for k, v in phase_a.items() if k != "errors"},
                   "scale_mlp": {k: v for k, v in phase_b.items() if k != "errors"},
                   "ok": checks.ok}
        print("RESULT_JSON " + json.dumps(summary, default=str), flush=True)
    finally:
        if store_proc is not None:
            stop(store_proc, timeout=30)
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
        elif args.keep:
            log(f"kept {work}")
    return 0 if checks.ok else 1


if __name__ == "__main__":
    sys.exit(main())
