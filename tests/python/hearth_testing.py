"""Helpers shared by the torch and transformers tests: checkpoints, a store, /proc readings.

Paths come from $HEARTH_CLI and $HEARTH_LIBRARY (set by ctest), defaulting to
build/; the store's device is $HEARTH_TEST_DEVICE ("cpu" by default).
"""

import contextlib
import json
import os
import pathlib
import select
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time

from process_group import start, stop

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLI = os.environ.get("HEARTH_CLI") or str(ROOT / "build" / "bin" / "hearth")
LIBRARY = os.environ.get("HEARTH_LIBRARY") or str(ROOT / "build" / "src" / "capi" / "libhearth.so")
os.environ["HEARTH_LIBRARY"] = LIBRARY
if str(ROOT / "python") not in sys.path:
    sys.path.insert(0, str(ROOT / "python"))

ARENA = "memfd:hearth-arena"
DEVICE = os.environ.get("HEARTH_TEST_DEVICE") or "cpu"  # the store's --device
ON_CUDA = DEVICE.startswith("cuda")

# torch dtype name -> safetensors dtype
_SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}


def write_safetensors(path, tensors):
    """Writes {name: torch.Tensor} as a safetensors file, from the format's definition alone."""
    import torch

    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        dtype = _SAFETENSORS_DTYPES[str(t.dtype).replace("torch.", "")]
        raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tobytes()
        header[name] = {"dtype": dtype, "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for raw in blobs:
            f.write(raw)


class Store:
    """A running `hearth store` on a private socket."""

    def __init__(self, directory, socket, proc):
        self.directory = directory
        self.socket = socket
        self.proc = proc


@contextlib.contextmanager
def running_store(models, timeout=120):
    """Starts `hearth store --device DEVICE` with {name: checkpoint path}; yields a Store."""
    if not os.path.exists(CLI):
        raise RuntimeError(f"hearth CLI not found at {CLI}; build target hearth_cli or set HEARTH_CLI")
    directory = tempfile.mkdtemp(prefix="hearth-st-")  # short: socket paths are limited
    socket = os.path.join(directory, "store.sock")
    out_path = os.path.join(directory, "store.out")
    proc = start([CLI, "store", "--socket", socket, "--device", DEVICE]
                 + [f"--model={name}={path}" for name, path in models.items()],
                 directory, dict(os.environ), out_path)
    try:
        wait_for(lambda: "hearth store ready" in pathlib.Path(out_path).read_text(errors="replace"),
                 "hearth store ready", timeout, procs=(proc,), log=out_path)
        yield Store(directory, socket, proc)
    finally:
        stop(proc)
        shutil.rmtree(directory, ignore_errors=True)


def child_env(**extra):
    env = dict(os.environ)
    paths = [str(ROOT / "python"), str(ROOT / "tests" / "python")]
    paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(PYTHONPATH=os.pathsep.join(paths), HEARTH_LIBRARY=LIBRARY,
               PYTHONDONTWRITEBYTECODE="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def run_script(code, *args, timeout=300, **env):
    """Runs `code` in a fresh interpreter; returns the CompletedProcess (any return code)."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                          env=child_env(**env), capture_output=True, text=True, timeout=timeout)


def arena_maps(pid="self"):
    """[(start, end, inode)] of every hearth host-arena mapping of `pid`."""
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            if ARENA in line:
                fields = line.split()
                begin, end = (int(x, 16) for x in fields[0].split("-"))
                out.append((begin, end, int(fields[4])))
    return out


def arena_smaps(pid):
    """{"Pss": bytes, "Rss": ..., "Private_Clean": ..., "Private_Dirty": ...} over `pid`'s arenas."""
    totals = dict.fromkeys(("Pss", "Rss", "Private_Clean", "Private_Dirty"), 0)
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header line
                inside = ARENA in line
            elif inside and first[:-1] in totals:
                totals[first[:-1]] += int(line.split()[1]) * 1024
    return totals


def store_attached_count(socket, model):
    """The store's count of live leases on `model` (from `hearth status`)."""
    out = subprocess.run([CLI, "status", "--socket", socket], check=True, capture_output=True,
                         text=True, timeout=30).stdout
    for line in out.splitlines():
        fields = line.split()
        if fields and fields[0].startswith(model + "@") and "attached" in fields:
            return int(fields[fields.index("attached") + 1])
    raise AssertionError(f"no arena of {model} in `hearth status`:\n{out}")


def wait_for(predicate, what, timeout=120, procs=(), log=None):
    """Polls predicate() until true; fails if one of `procs` exits or time runs out,
    with the end of the file `log` (what those processes said) if given."""
    deadline = time.monotonic() + timeout
    delay = 0.02

    def said():
        return f":\n{pathlib.Path(log).read_text(errors='replace')[-6000:]}" if log else ""

    while not predicate():
        for p in procs:
            if p.poll() is not None:
                raise AssertionError(f"{what}: process {p.pid} exited with {p.returncode}{said()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s{said()}")
        time.sleep(delay)
        delay = min(delay * 1.5, 0.25)


def spawn_reporter(code, *args):
    """Runs `code` in a fresh interpreter that prints one JSON line, then waits for a line on stdin.

    Its stderr goes to a file (a pipe nobody reads could fill and stall it).
    """
    err = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([sys.executable, "-c", code, *map(str, args)], env=child_env(),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
    proc.err = err
    return proc


def report_of(proc, timeout=300):
    """The JSON line `proc` (from spawn_reporter) prints; fails with its stderr if it exits first."""
    deadline = time.monotonic() + timeout
    while True:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if ready:
            line = proc.stdout.readline()
            if not line:
                proc.wait(timeout=30)
                proc.err.seek(0)
                raise AssertionError(f"process {proc.pid} exited with {proc.returncode}:\n"
                                     + proc.err.read()[-4000:])
            return json.loads(line)
        if time.monotonic() > deadline:
            raise AssertionError(f"process {proc.pid} said nothing within {timeout} s")


def finish_reporters(procs):
    """Lets every spawn_reporter process exit (killed if it does not) and closes its files."""
    for p in procs:
        if p.poll() is None:
            try:
                p.stdin.write("\n")
                p.stdin.flush()
            except BrokenPipeError:
                pass
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        for f in (p.stdin, p.stdout, p.err):
            f.close()
