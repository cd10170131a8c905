"""The baseline's forward (PyTorch nn.Linear, cuBLAS, TF32 off) by batch size, in the
same units as gemm_bench: one line per measurement, median of --iterations.

    python3 bench/gemm/torch_mlp.py [--dims 16384,16384,12800] [--rows 1,16,64]
"""
import argparse
import time

import torch
import torch.nn as nn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", default="16384,16384,12800")
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--iterations", type=int, default=50)
    a = ap.parse_args()
    i, h, o = map(int, a.dims.split(","))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for dtype, name in ((torch.float32, "F32"), (torch.bfloat16, "BF16")):
        enc = nn.Linear(i, h).cuda().to(dtype).eval()
        head = nn.Linear(h, o).cuda().to(dtype).eval()
        weight_bytes = (i * h + h * o) * (4 if dtype == torch.float32 else 2)
        for rows in map(int, a.rows.split(",")):
            x = torch.randn(rows, i, device="cuda", dtype=dtype)
            with torch.no_grad():
                for _ in range(3):
                    head(torch.relu(enc(x)))
                torch.cuda.synchronize()
                times = []
                for _ in range(a.iterations):
                    t = time.perf_counter()
                    head(torch.relu(enc(x)))
                    torch.cuda.synchronize()
                    times.append(time.perf_counter() - t)
            ms = sorted(times)[len(times) // 2] * 1e3
            flops = 2.0 * rows * (i * h + h * o)
            print(f"torch dtype={name} rows={rows} ms={ms:.4f} weight_gbps={weight_bytes / ms / 1e6:.0f} "
                  f"tflops={flops / ms / 1e9:.1f}", flush=True)
        del enc, head
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
