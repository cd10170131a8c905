"""seeds/torch-ipc-weight-sharing.md rebuilt on hearth: N spawned PyTorch workers, one copy.

    python3 demo.py --workers 4 --socket /tmp/hearth-demo/store.sock

The original loaded the MLP onto the GPU in the parent and handed it to
`torch.multiprocessing` children through CUDA IPC: it works only for children
the producer spawned itself, only while the producer lives, and the parent
must hold CUDA. Here the parent never touches CUDA or the weights: it spawns
N workers, and each worker attaches the model ("mlp") from a `hearth store`
itself, binds it into an nn.Module with hearth.torch.load_into (zero-copy,
read-only), runs a forward on a fixed input and reports back. The parent then
prints the seed's verification table (memory expected if every worker held
its own copy vs. memory in use) and checks that all outputs are equal.

The device is the store's: `hearth store --device cpu` (host memory, a sealed
memfd) or `--device cuda:0` (a CUDA VMM allocation).

Exit status: 0 when every worker ran and all outputs are equal, else 1.
"""

import argparse
import hashlib
import os
import queue
import sys
import time

import torch
import torch.multiprocessing as mp
import torch.nn as nn

ARENA = "memfd:hearth-arena"
MIB = 1024 * 1024


# =====================================================================
# 1. MODEL DEFINITION (the seed's)
# =====================================================================
class SharedWeightInferenceEngine(nn.Module):

    def __init__(self, in_features=16384, hidden_dim=16384, out_features=12800, device=None):
        super().__init__()
        self.encoder = nn.Linear(in_features, hidden_dim, device=device)
        self.head = nn.Linear(hidden_dim, out_features, device=device)

    def forward(self, x):
        x = torch.relu(self.encoder(x))
        return self.head(x)


# =====================================================================
# 2. HELPERS
# =====================================================================
def arena_maps(pid="self"):
    """[(start, end, inode)] of the hearth host arenas mapped by `pid`."""
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            if ARENA in line:
                fields = line.split()
                start, end = (int(v, 16) for v in fields[0].split("-"))
                out.append((start, end, int(fields[4])))
    return out


def arena_smaps(pid):
    """(Pss, Rss) in bytes summed over `pid`'s hearth arena mappings (/proc/PID/smaps)."""
    pss = rss = 0
    inside = False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if not first.endswith(":"):  # a mapping's header line
                inside = ARENA in line
            elif inside and first == "Pss:":
                pss += int(line.split()[1]) * 1024
            elif inside and first == "Rss:":
                rss += int(line.split()[1]) * 1024
    return pss, rss


def nvidia_smi_used(pids):
    """{pid: MiB} of device memory nvidia-smi reports per process, or {} if unavailable."""
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    used = {}
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and int(parts[0]) in pids:
            try:
                used[int(parts[0])] = float(parts[1])
            except ValueError:
                pass
    return used


def nvidia_smi_gpu_used():
    """[MiB in use] per GPU (nvidia-smi's order), or None: asked without touching CUDA."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used",
                              "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
        return [float(v) for v in out.stdout.split()] if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def physical_gpu(device):
    """nvidia-smi's index of torch device "cuda:N" (CUDA_VISIBLE_DEVICES honoured if numeric)."""
    index = int(device.split(":")[1]) if ":" in device else 0
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible and index < len(visible) and visible[index].isdigit():
        return int(visible[index])
    return index


def fixed_input(batch, in_features, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(batch, in_features, generator=generator)


# =====================================================================
# 3. WORKER
# =====================================================================
def worker(rank, args, results, measured, stop):
    """Attaches the model itself (not from the parent), runs one forward, reports."""
    try:
        import hearth
        import hearth.torch

        pid = os.getpid()
        weights = hearth.attach(args.model, socket=args.socket)
        device = torch.device(weights.device)  # whatever the store holds
        hidden, in_features = weights["encoder.weight"].shape
        out_features = weights["head.weight"].shape[0]
        weight_bytes = sum(t.nbytes for t in weights.values())
        if device.type == "cuda":
            torch.cuda.set_device(device)
        elif args.threads:
            torch.set_num_threads(args.threads)

        # "meta": the module allocates nothing; load_into binds the shared views.
        model = SharedWeightInferenceEngine(in_features, hidden, out_features, device="meta")
        hearth.torch.load_into(model, weights)
        model.eval()

        x = fixed_input(args.batch, in_features, args.seed).to(device)
        start = time.perf_counter()
        with torch.no_grad():
            logits = model(x)
            preds = torch.argmax(logits, dim=-1)
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed_ms = (time.perf_counter() - start) * 1000
        logits_cpu = logits.cpu().contiguous()
        digest = hashlib.sha256(logits_cpu.numpy().tobytes()).hexdigest()

        ptrs = {name: p.data_ptr() for name, p in model.named_parameters()}
        maps = arena_maps()
        inside = all(any(s <= ptr < e for s, e, _ in maps) for ptr in ptrs.values())
        lines = [f"\n[Worker {rank} | PID {pid}] attached {weights.model}@{weights.version} "
                 f"on {weights.device} ({in_features} -> {hidden} -> {out_features}), "
                 f"forward of {args.batch} in {elapsed_ms:.2f} ms"]
        names = list(ptrs)
        for i, name in enumerate(names):
            branch = "└──" if i == len(names) - 1 and device.type == "cuda" else "├──"
            lines.append(f"  {branch} Shared '{name}' {device.type.upper()} address : "
                         f"{hex(ptrs[name])}")
        if device.type != "cuda":
            inodes = sorted({inode for _, _, inode in maps})
            lines.append(f"  └── arena: {len(maps)} mapping(s), memfd inode {inodes}, "
                         f"parameters inside it: {inside}")
        print("\n".join(lines), flush=True)

        report = {
            "rank": rank, "pid": pid, "device": str(device), "weight_bytes": weight_bytes,
            "digest": digest, "preds": preds.cpu().tolist(),
            "logits_sum": float(logits_cpu.double().sum()), "inside": inside or device.type == "cuda",
            "inodes": sorted({inode for _, _, inode in maps}),
        }
        if device.type == "cuda":
            report["allocated"] = torch.cuda.memory_allocated(device)
        results.put(report)

        # Stay mapped while the parent measures; on a GPU rank 0 measures device-wide.
        if device.type == "cuda" and rank == 0:
            measured.wait(timeout=args.timeout)  # every worker has reported
            free, total = torch.cuda.mem_get_info(device)
            results.put({"rank": rank, "device_used": total - free, "device_total": total})
        stop.wait(timeout=args.timeout)
        print(f"[Worker {rank} | PID {pid}] Received shutdown signal. Exiting.", flush=True)
    except BaseException as e:  # report instead of dying silently
        results.put({"rank": rank, "pid": os.getpid(), "error": f"{type(e).__name__}: {e}"})
        raise


# =====================================================================
# 4. MAIN ORCHESTRATOR
# =====================================================================
def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="N spawned PyTorch workers sharing one copy of an MLP held by a hearth store")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--model", default="mlp", help="the store's model name (default mlp)")
    parser.add_argument("--socket", default=os.environ.get("HEARTH_SOCKET"),
                        help="the store's socket (default $HEARTH_SOCKET, else the library's)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0, help="seed of the fixed input")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads per worker on the host (0: cpus / workers)")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds to wait for the workers")
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if not args.threads:
        args.threads = max(1, (os.cpu_count() or 1) // args.workers)
    return args


def print_table(args, reports, device_info, gpu_used_before):
    n = len(reports)
    weight_bytes = reports[0]["weight_bytes"]
    device = reports[0]["device"]
    rows = [("Weight bytes (one copy)", weight_bytes),
            (f"Expected if duplicated ({n} copies)", n * weight_bytes)]
    notes = []
    if device.startswith("cuda"):
        allocated = sum(r["allocated"] for r in reports)
        rows.append(("Allocated by the workers' PyTorch allocators", allocated))
        if device_info:
            rows.append(("Device-wide memory in use", device_info["device_used"]))
            notes.append("device-wide memory in use includes the store's one copy and every "
                         "process's CUDA context")
        gpu = physical_gpu(device)
        if device_info and gpu_used_before and gpu < len(gpu_used_before):
            before = int(gpu_used_before[gpu] * MIB)
            rows.append(("Device memory in use before the workers", before))
            rows.append((f"Added by the {n} workers (no weights)",
                         device_info["device_used"] - before))
            notes.append("'before' (nvidia-smi, asked by the parent, which never touches CUDA) "
                         "already holds the store's copy; the workers add their CUDA contexts "
                         "and activations, not N copies")
        used = nvidia_smi_used({r["pid"] for r in reports})
        if used:
            rows.append(("Per-worker memory (nvidia-smi, sum)", int(sum(used.values()) * MIB)))
            notes.append("nvidia-smi per worker is mostly its CUDA context: the weights "
                         "belong to the store's allocation")
    else:
        measures = [arena_smaps(r["pid"]) for r in reports]
        rows.append(("Memory in use (sum of arena PSS)", sum(pss for pss, _ in measures)))
        rows.append(("Mapped by each worker (arena RSS, max)", max(rss for _, rss in measures)))
        notes.append("PSS divides each shared page among the processes mapping it: the sum "
                     "over the workers is the memory the weights really take")
    width = max(len(label) for label, _ in rows)
    print("\n" + "-" * 70)
    print(f"MEMORY VERIFICATION AFTER SPAWNING {n} WORKERS ({device}):")
    for i, (label, value) in enumerate(rows):
        branch = "└──" if i == len(rows) - 1 else "├──"
        print(f"  {branch} {label.ljust(width)} : ~{value / MIB:.2f} MiB ({value} bytes)")
    for note in notes:
        print(f"  ({note})")
    print("-" * 70 + "\n", flush=True)


def main(argv=None):
    args = parse_args(argv)
    ctx = mp.get_context("spawn")  # fresh interpreters: nothing inherited from the parent
    main_pid = os.getpid()
    print("=" * 70)
    print(f"MAIN PROCESS [PID {main_pid}] STARTING HEARTH SHARED-WEIGHTS DEMO")
    print("=" * 70)
    print(f"\n[Step A] The parent loads nothing: model {args.model!r} is held by the store at "
          f"{args.socket or '(the default socket)'}")

    # On a GPU store: device memory before any worker, asked without initialising CUDA here.
    gpu_used_before = nvidia_smi_gpu_used()
    results = ctx.Queue()
    measured = ctx.Event()
    stop = ctx.Event()
    print(f"\n[Step B] Spawning {args.workers} worker processes; each attaches the model itself...")
    workers = [ctx.Process(target=worker, args=(rank, args, results, measured, stop))
               for rank in range(args.workers)]
    for p in workers:
        p.start()

    ok = True
    reports, errors, device_info = [], [], None
    deadline = time.monotonic() + args.timeout
    try:
        while len(reports) + len(errors) < args.workers:
            try:
                r = results.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() > deadline:
                    errors.append(f"timed out after {args.timeout:.0f} s waiting for workers")
                    break
                dead = [p for p in workers if p.exitcode not in (None, 0)]
                if dead and results.empty():
                    errors.append("worker(s) died: " + ", ".join(
                        f"pid {p.pid} exit {p.exitcode}" for p in dead))
                    break
                continue
            if "error" in r:
                errors.append(f"worker {r['rank']} (pid {r['pid']}): {r['error']}")
            else:
                reports.append(r)
        measured.set()
        if not errors and reports[0]["device"].startswith("cuda"):
            try:
                device_info = results.get(timeout=60)
            except queue.Empty:
                device_info = None
        if errors:
            ok = False
            for e in errors:
                print(f"ERROR: {e}", file=sys.stderr)
        else:
            reports.sort(key=lambda r: r["rank"])
            print_table(args, reports, device_info, gpu_used_before)

            print("[Step C] Comparing the workers' outputs...")
            for r in reports:
                print(f"  ├── Worker {r['rank']} | PID {r['pid']} | Predictions: "
                      f"{r['preds'][:4]}... | logits sum {r['logits_sum']:.6f} | "
                      f"sha256 {r['digest'][:16]}")
            equal = len({r["digest"] for r in reports}) == 1
            print(f"  └── All {len(reports)} workers' outputs equal: {equal}")
            inodes = {tuple(r["inodes"]) for r in reports}
            if reports[0]["device"] == "cpu":
                one_arena = len(inodes) == 1 and all(len(r["inodes"]) == 1 for r in reports)
                print(f"      All workers map the same arena (memfd inode): {one_arena}")
                ok = ok and one_arena
            inside = all(r["inside"] for r in reports)
            print(f"      Every parameter points into the shared arena: {inside}")
            cuda_in_parent = torch.cuda.is_initialized()
            parent_maps = len(arena_maps())
            print(f"      Parent: CUDA initialised {cuda_in_parent}, arena mappings {parent_maps}")
            ok = ok and equal and inside and not cuda_in_parent and parent_maps == 0
    finally:
        print("\n[Step D] Terminating workers cleanly...")
        measured.set()
        stop.set()
        for p in workers:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
            if p.exitcode != 0:
                ok = False
    print("\n" + "=" * 70)
    print("ALL PROCESSES FINISHED SUCCESSFULLY" if ok else "DEMO FAILED")
    print("=" * 70)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
