#!/usr/bin/env python3
"""The bench example's models in PyTorch, for comparison: fp32 and autocast.

On the CPU (the default) it runs the bench example's MLP and its three transformers
(`examples/bench/measure.rs`, `transformers`: example, memory, mid), each in fp32 and
`autocast(bfloat16)` with `--threads` threads (1), and prints one JSON object on stdout
(progress on stderr):

    {"torch": "2.x", "threads": 1, "fp32_step_ms": .., "autocast_bf16_step_ms": ..,
     "gemm_gflops": {"f32": .., "bf16": ..}, "attention": "sdpa",
     "models": {"mlp": {"hidden": 1024, "batch": 512, "fp32_step_ms": .., "autocast_bf16_step_ms": ..},
                "example": {"layers": 2, "d_model": 64, "heads": 4, "context": 16, "vocab": 11,
                            "batch": 32, "fp32_step_ms": .., "autocast_bf16_step_ms": ..},
                "memory": {..}, "mid": {..}}}

The top-level step times are the MLP's: 64-1024-1024-10, ReLU, the repository's digits
(standardised with the training split's statistics), batch 512, AdamW (lr 1e-3, weight
decay 0.01), both modes in interleaved rounds. The transformers are the Rust model
(`examples/train/models.rs`: pre-norm, erf GELU, dropout 0.1 on the residual branches,
learned positions, untied head) on random tokens with the same AdamW, two interleaved rounds
of a warm-up step and as many timed steps as the bench times. `--quick` uses the bench's
`--quick` sizes; `--mlp-only` skips the transformers. If torch cannot be imported it says so
on stderr and exits with status 3 (`bench --torch` then omits the PyTorch ratios).

Usage: python3 benches/peers/torch_amp.py [--threads N] [--steps N] [--rounds N] [--quick]

With `--device cuda` (or `--gpu-model`) it runs the GPU bench's transformer instead
(`cargo run --release --features cuda --example bench -- --device cuda`): GPT-2 small (12
pre-norm blocks, width 768, 12 heads, context 1024, vocabulary 50257, untied head, erf
GELU, dropout 0, learned positions), the same batch (`--gpu-batch`, 8) and AdamW (lr 1e-4,
weight decay 0.01), on random tokens, in fp32 (TF32 off, as candle), autocast float16 with
GradScaler and autocast bfloat16, each from a fresh model: 2 warm-up steps, then the median
of `--steps` (10) steps, each ended by a device synchronisation. One JSON object on stdout:

    {"torch": "2.x", "device": "cuda", "gpu": "...", "transformer": {"layers": 12, ...,
     "batch": 8}, "attention": "sdpa", "steps": 10, "warmup_steps": 2,
     "modes": {"fp32": {"step_ms": .., "tokens_per_s": .., "peak_mib": ..},
               "autocast_f16": {..}, "autocast_bf16": {..}}}

`peak_mib` is `torch.cuda.max_memory_allocated` over the mode's run (null on the CPU).
Attention is `F.scaled_dot_product_attention` (the fused kernel a PyTorch user gets);
`--math-attention` writes it out as matmul, mask and softmax, as candle-amp computes it.
`--device cpu --gpu-model tiny` runs the tiny sizes on the CPU.

`cargo run --release --example bench -- --torch` runs the CPU comparison itself; `--torch
FILE` reads a saved output instead (the bench checks the sizes, batch and threads match, as
the GPU bench does for its transformer). Needs torch (`pip install torch`); never run in CI.
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


# The exit status when torch cannot be imported (the bench says so and omits the ratios).
NO_TORCH = 3

# The GPU bench's transformer sizes (examples/bench/gpu.rs, GpuModel::config).
SIZES = {
    "gpt2": {"layers": 12, "d_model": 768, "heads": 12, "context": 1024, "vocab": 50257},
    "tiny": {"layers": 2, "d_model": 64, "heads": 4, "context": 32, "vocab": 256},
}
DEFAULT_BATCH = {"gpt2": 8, "tiny": 4}


def gpt_class(torch, sz, dropout, math_attention):
    """The transformer of the bench (examples/train/models.rs): token and learned position
    embeddings, pre-norm blocks (causal attention, erf-GELU feed-forward of width 4d, dropout
    on each residual branch), a final layer norm and an untied head."""
    import torch.nn.functional as F

    d, heads, ctx, vocab = sz["d_model"], sz["heads"], sz["context"], sz["vocab"]

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = torch.nn.LayerNorm(d, eps=1e-5)
            self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))
            self.ln2 = torch.nn.LayerNorm(d, eps=1e-5)
            self.up = torch.nn.Linear(d, 4 * d)
            self.down = torch.nn.Linear(4 * d, d)
            self.drop = torch.nn.Dropout(dropout) if dropout > 0 else torch.nn.Identity()

        def split(self, x):
            b, t, _ = x.shape
            return x.view(b, t, heads, d // heads).transpose(1, 2)

        def forward(self, x):
            b, t, _ = x.shape
            h = self.ln1(x)
            q, k, v = self.split(self.q(h)), self.split(self.k(h)), self.split(self.v(h))
            if math_attention:
                s = (q @ k.transpose(-2, -1)) * (1.0 / (d // heads) ** 0.5)
                mask = torch.full((t, t), float("-inf"), device=x.device).triu(1)
                att = torch.softmax(s.float() + mask, dim=-1).to(v.dtype) @ v
            else:
                att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.drop(self.o(att.transpose(1, 2).reshape(b, t, d)))
            return x + self.drop(self.down(F.gelu(self.up(self.ln2(x)))))

    class Gpt(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = torch.nn.Embedding(vocab, d)
            self.pos = torch.nn.Parameter(torch.randn(ctx, d) * 0.02)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(sz["layers"]))
            self.ln = torch.nn.LayerNorm(d, eps=1e-5)
            self.head = torch.nn.Linear(d, vocab)

        def forward(self, ids):
            x = self.tok(ids) + self.pos[: ids.shape[1]]
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln(x))

    return Gpt


def transformer(a):
    """The GPU bench's transformer in fp32 and autocast; prints its JSON object."""
    import torch
    import torch.nn.functional as F

    dev = torch.device("cuda" if a.device == "cuda" else "cpu")
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device")
    torch.set_num_threads(a.threads)
    # candle computes f32 products in full f32; so does the fp32 mode here.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    sz = dict(SIZES[a.gpu_model])
    batch = a.gpu_batch or DEFAULT_BATCH[a.gpu_model]
    d, heads, ctx, vocab = sz["d_model"], sz["heads"], sz["context"], sz["vocab"]

    Gpt = gpt_class(torch, sz, dropout=0.0, math_attention=a.math_attention)

    g = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(2):
        seq = torch.randint(0, vocab, (batch, ctx + 1), generator=g).to(dev)
        batches.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def run(mode):
        half = {"fp32": None, "autocast_f16": torch.float16, "autocast_bf16": torch.bfloat16}[mode]
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        torch.manual_seed(0)
        model = Gpt().to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        scaler = torch.amp.GradScaler(dev.type, enabled=half == torch.float16)
        times = []
        for i in range(2 + a.steps):
            x, y = batches[i % len(batches)]
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with torch.autocast(dev.type, dtype=half or torch.float32, enabled=half is not None):
                logits = model(x)
                loss = F.cross_entropy(logits.float().view(-1, vocab), y.view(-1))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            sync()
            if i >= 2:  # the first two steps warm up
                times.append(time.perf_counter() - t0)
        s = statistics.median(times)
        peak = torch.cuda.max_memory_allocated() / 2**20 if dev.type == "cuda" else None
        del model, opt
        return {"step_ms": s * 1e3, "tokens_per_s": batch * ctx / s, "peak_mib": peak}

    modes = {}
    for mode in ("fp32", "autocast_f16", "autocast_bf16"):
        print(f"transformer {mode} ...", file=sys.stderr)
        modes[mode] = run(mode)
    out = {
        "torch": torch.__version__,
        "device": dev.type,
        "gpu": torch.cuda.get_device_name(0) if dev.type == "cuda" else None,
        "transformer": {**sz, "batch": batch},
        "attention": "math" if a.math_attention else "sdpa",
        "steps": a.steps,
        "warmup_steps": 2,
        "modes": modes,
    }
    print(json.dumps(out))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per mode (per round on the CPU MLP)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of both modes")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: the GPU bench's transformer (default cpu: the MLP)")
    ap.add_argument("--gpu-model", choices=tuple(SIZES), default=None,
                    help="the GPU bench's transformer sizes (implied gpt2 with --device cuda)")
    ap.add_argument("--gpu-batch", type=int, default=None, help="sequences per transformer step")
    ap.add_argument("--quick", action="store_true", help="the bench's --quick sizes (a smoke test)")
    ap.add_argument("--mlp-only", action="store_true", help="the MLP alone (no CPU transformers)")
    ap.add_argument("--math-attention", action="store_true",
                    help="attention as matmul, mask and softmax instead of the fused SDPA kernel")
    a = ap.parse_args()
    if a.device == "cuda" or a.gpu_model is not None:
        a.gpu_model = a.gpu_model or "gpt2"
        a.steps = 10 if a.steps is None else a.steps
        transformer(a)
        return
    if a.quick:
        a.hidden, a.batch, a.rounds = 128, 64, 1
        a.steps = 3 if a.steps is None else a.steps
    a.steps = 20 if a.steps is None else a.steps
    try:
        import torch
    except ImportError as e:
        print(f"torch_amp.py: {sys.executable} cannot import torch ({e}); pip install torch", file=sys.stderr)
        sys.exit(NO_TORCH)
    torch.set_num_threads(a.threads)
    out = {"torch": torch.__version__, "threads": a.threads}
    out.update(mlp(a, torch))
    models = {"mlp": {"hidden": a.hidden, "batch": a.batch, "fp32_step_ms": out["fp32_step_ms"],
                      "autocast_bf16_step_ms": out["autocast_bf16_step_ms"]}}
    if not a.mlp_only:
        for name, sz, batch, steps in cpu_transformers(a.quick):
            models[name] = cpu_transformer(a, torch, name, sz, batch, steps)
        out["attention"] = "math" if a.math_attention else "sdpa"
        out["models"] = models
    print(json.dumps(out))


def mlp(a, torch):
    """The bench MLP in fp32 and autocast bf16, in interleaved rounds: its step times and the
    1024^3 product's GFLOP/s."""
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

    return {
        "fp32_step_ms": statistics.median(times["fp32"]) * 1e3,
        "autocast_bf16_step_ms": statistics.median(times["bf16"]) * 1e3,
        "gemm_gflops": {"f32": gflops(torch.float32), "bf16": gflops(torch.bfloat16)},
    }


def cpu_transformers(quick):
    """The CPU bench's transformers (examples/bench/measure.rs, `transformers`): name, sizes,
    batch and timed steps per round (the Rust side times as many)."""
    example = {"layers": 2, "d_model": 64, "heads": 4, "context": 16, "vocab": 11}
    if quick:
        mid = dict(example, vocab=64, heads=8)
        return [("example", example, 32, 3), ("memory", example, 8, 1), ("mid", mid, 4, 1)]
    memory = {"layers": 4, "d_model": 256, "heads": 4, "context": 64, "vocab": 11}
    mid = {"layers": 6, "d_model": 512, "heads": 8, "context": 128, "vocab": 1024}
    return [("example", example, 32, 20), ("memory", memory, 64, 3), ("mid", mid, 16, 3)]


def cpu_transformer(a, torch, name, sz, batch, steps):
    """One CPU transformer in fp32 and autocast bf16 (dropout 0.1, AdamW lr 1e-3, weight
    decay 0.01, random tokens), `a.rounds` interleaved rounds of a warm-up step and `steps`
    timed ones per mode: its sizes and median step times."""
    import torch.nn.functional as F

    Gpt = gpt_class(torch, sz, dropout=0.1, math_attention=a.math_attention)
    g = torch.Generator().manual_seed(1)
    vocab, ctx = sz["vocab"], sz["context"]
    batches = []
    for _ in range(2):
        seq = torch.randint(0, vocab, (batch, ctx + 1), generator=g)
        batches.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))

    def make():
        torch.manual_seed(0)
        model = Gpt()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

    def run(half, model, opt):
        times = []
        for i in range(1 + steps):
            x, y = batches[i % len(batches)]
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=half):
                logits = model(x)
                loss = F.cross_entropy(logits.float().view(-1, vocab), y.view(-1))
            loss.backward()
            opt.step()
            if i > 0:  # the first step of a round warms up
                times.append(time.perf_counter() - t0)
        return times

    built = {m: make() for m in ("fp32", "bf16")}
    times = {"fp32": [], "bf16": []}
    rounds = max(1, min(a.rounds, 2))
    for r in range(rounds):
        for m in ("fp32", "bf16"):
            print(f"{name} transformer round {r + 1}/{rounds} {m} ...", file=sys.stderr)
            times[m] += run(m == "bf16", *built[m])
    return dict(sz, batch=batch,
                fp32_step_ms=statistics.median(times["fp32"]) * 1e3,
                autocast_bf16_step_ms=statistics.median(times["bf16"]) * 1e3)


if __name__ == "__main__":
    main()
