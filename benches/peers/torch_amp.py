#!/usr/bin/env python3
"""The bench example's MLP in PyTorch, for comparison: fp32 and autocast(bfloat16).

Same model (64-1024-1024-10, ReLU), data (the repository's digits, standardised with the
training split's statistics), batch (512) and optimizer (AdamW, lr 1e-3, weight decay 0.01)
as `cargo run --release --example bench`. Runs the two modes in interleaved rounds and
prints one JSON object on stdout (progress on stderr):

    {"torch": "2.x", "threads": 1, "fp32_step_ms": .., "autocast_bf16_step_ms": ..,
     "gemm_gflops": {"f32": .., "bf16": ..}}

Usage: python3 benches/peers/torch_amp.py [--threads N] [--steps N] [--rounds N]

Pass the output to the bench example (`--torch FILE`) to get the PyTorch ratios in its
targets. Needs torch (`pip install torch`); never run in CI.
"""

import argparse
import gzip
import json
import os
import statistics
import sys
import time


def load_digits(path):
    xs, ys = [], []
    with gzip.open(path, "rt") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            v = line.split(",")
            xs.append([float(a) for a in v[:-1]])
            ys.append(int(v[-1]))
    return xs, ys


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per mode per round")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of both modes")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=512)
    a = ap.parse_args()

    import torch

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    here = os.path.dirname(os.path.abspath(__file__))
    xs, ys = load_digits(os.path.join(here, "..", "..", "data", "digits.csv.gz"))
    x = torch.tensor(xs, dtype=torch.float32)
    y = torch.tensor(ys, dtype=torch.long)
    # 80% training split, standardised with its statistics (as the Rust side does).
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(y), generator=g)
    n_train = len(y) - round(0.2 * len(y))
    x, y = x[perm[:n_train]], y[perm[:n_train]]
    std = x.std(0, unbiased=False)
    std[std <= 1e-6] = 1.0
    x = (x - x.mean(0)) / std
    batches = []
    for _ in range(a.steps + 1):
        idx = torch.randint(0, n_train, (a.batch,), generator=g)
        batches.append((x[idx].contiguous(), y[idx].contiguous()))

    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, a.hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(a.hidden, a.hidden),
            torch.nn.ReLU(),
            torch.nn.Linear(a.hidden, 10),
        )
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
        return model, opt

    def run(mode, model, opt):
        times = []
        for i, (xb, yb) in enumerate(batches):
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            if mode == "bf16":
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(xb)
                    loss = torch.nn.functional.cross_entropy(out, yb)
            else:
                loss = torch.nn.functional.cross_entropy(model(xb), yb)
            loss.backward()
            opt.step()
            if i > 0:  # the first step warms up
                times.append(time.perf_counter() - t0)
        return times

    models = {m: make() for m in ("fp32", "bf16")}
    times = {"fp32": [], "bf16": []}
    for r in range(a.rounds):
        for m in ("fp32", "bf16"):
            print(f"round {r + 1}/{a.rounds} {m} ...", file=sys.stderr)
            times[m] += run(m, *models[m])

    def gflops(dtype, n=1024, reps=10):
        p = torch.randn(n, n).to(dtype)
        q = torch.randn(n, n).to(dtype)
        p @ q
        t = []
        for _ in range(reps):
            t0 = time.perf_counter()
            p @ q
            t.append(time.perf_counter() - t0)
        return 2 * n**3 / statistics.median(t) / 1e9

    out = {
        "torch": torch.__version__,
        "threads": a.threads,
        "fp32_step_ms": statistics.median(times["fp32"]) * 1e3,
        "autocast_bf16_step_ms": statistics.median(times["bf16"]) * 1e3,
        "gemm_gflops": {"f32": gflops(torch.float32), "bf16": gflops(torch.bfloat16)},
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
