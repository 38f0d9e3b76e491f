#!/usr/bin/env python3
"""The library's three model families in PyTorch, for comparison: fp32 and autocast bf16.

Runs Llama, BERT and ViT at the shapes the bench trains them (`candle_amp::models`;
`bench --json` reports `llama_step_ms`, `bert_step_ms`, `vit_step_ms`), each in fp32 and
under `torch.autocast("cpu", torch.bfloat16)`, with `--threads` threads (1), and prints one
JSON object on stdout (progress on stderr):

    {"torch": "2.x", "threads": 1, "steps": 5, "rounds": 2,
     "llama": {"shape": {...}, "fp32_step_ms": .., "autocast_bf16_step_ms": ..},
     "bert": {...}, "vit": {...}}

A step is what the bench times: forward, loss, backward, AdamW (lr 1e-3, weight decay
0.01), on fixed random inputs. Each mode runs in interleaved rounds (a warm-up step, then
`--steps` timed steps); the figure is the median step over all rounds.

Shapes (the same as the bench's):
- Llama: dim 256, 6 layers, 8 heads with 4 key/value heads (grouped-query attention),
  SwiGLU hidden 768, RMSNorm, rotary embedding (theta 10000), causal, sequence 128, batch 8,
  vocabulary 1024, untied head, next-token cross entropy.
- BERT: hidden 256, 4 post-norm layers, 4 heads, intermediate 1024 (erf GELU), vocabulary
  1024, sequence 128, batch 8, lengths drawn from 64-128 with a key padding mask, token
  classification into 16 classes (padded positions ignored by the loss).
- ViT: hidden 192, 6 pre-norm layers, 3 heads, intermediate 768 (erf GELU), patch 4 on 32x32x3
  images, a class token and learned positions, batch 32, 10 classes.

Attention is `F.scaled_dot_product_attention` (what a PyTorch user gets). Needs torch
(`pip install torch`); if it cannot be imported, says so on stderr and exits with status 3.
Never run in CI.

Usage: python3 benches/peers/torch_models.py [--threads N] [--steps N] [--rounds N]
                                             [--only llama,bert,vit]
"""

import argparse
import json
import statistics
import sys
import time

NO_TORCH = 3

SHAPES = {
    "llama": {"dim": 256, "layers": 6, "heads": 8, "kv_heads": 4, "hidden": 768, "seq": 128,
              "batch": 8, "vocab": 1024, "rope_theta": 10000.0},
    "bert": {"hidden": 256, "layers": 4, "heads": 4, "intermediate": 1024, "vocab": 1024,
             "seq": 128, "batch": 8, "min_len": 64, "classes": 16},
    "vit": {"hidden": 192, "layers": 6, "heads": 3, "intermediate": 768, "patch": 4,
            "image": 32, "channels": 3, "batch": 32, "classes": 10},
}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def build(torch):
    nn = torch.nn
    F = torch.nn.functional

    class RMSNorm(nn.Module):
        def __init__(self, d, eps=1e-5):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))
            self.eps = eps

        def forward(self, x):
            xf = x.float()
            y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return (y * self.weight).to(x.dtype)

    def rope_tables(seq, hd, theta):
        inv = 1.0 / (theta ** (torch.arange(0, hd, 2).float() / hd))
        f = torch.outer(torch.arange(seq).float(), inv)
        return f.cos(), f.sin()

    def apply_rope(x, cos, sin):
        # candle's `rope` layout (the halves rotated), as Hugging Face's Llama.
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        c = torch.cat([cos, cos], -1)
        s = torch.cat([sin, sin], -1)
        rot = torch.cat([-x2, x1], -1)
        return (x.float() * c + rot.float() * s).to(x.dtype)

    class LlamaBlock(nn.Module):
        def __init__(self, s):
            super().__init__()
            d, h, kv = s["dim"], s["heads"], s["kv_heads"]
            self.h, self.kv, self.hd = h, kv, d // h
            self.q_proj = nn.Linear(d, d, bias=False)
            self.k_proj = nn.Linear(d, kv * self.hd, bias=False)
            self.v_proj = nn.Linear(d, kv * self.hd, bias=False)
            self.o_proj = nn.Linear(d, d, bias=False)
            self.gate_proj = nn.Linear(d, s["hidden"], bias=False)
            self.up_proj = nn.Linear(d, s["hidden"], bias=False)
            self.down_proj = nn.Linear(s["hidden"], d, bias=False)
            self.input_layernorm = RMSNorm(d)
            self.post_attention_layernorm = RMSNorm(d)

        def forward(self, x, cos, sin):
            b, t, d = x.shape
            hx = self.input_layernorm(x)
            q = self.q_proj(hx).view(b, t, self.h, self.hd).transpose(1, 2)
            k = self.k_proj(hx).view(b, t, self.kv, self.hd).transpose(1, 2)
            v = self.v_proj(hx).view(b, t, self.kv, self.hd).transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            rep = self.h // self.kv
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, d))
            hx = self.post_attention_layernorm(x)
            return x + self.down_proj(F.silu(self.gate_proj(hx)) * self.up_proj(hx))

    class Llama(nn.Module):
        def __init__(self, s):
            super().__init__()
            self.s = s
            self.embed_tokens = nn.Embedding(s["vocab"], s["dim"])
            self.layers = nn.ModuleList([LlamaBlock(s) for _ in range(s["layers"])])
            self.norm = RMSNorm(s["dim"])
            self.lm_head = nn.Linear(s["dim"], s["vocab"], bias=False)
            cos, sin = rope_tables(s["seq"], s["dim"] // s["heads"], s["rope_theta"])
            self.register_buffer("cos", cos)
            self.register_buffer("sin", sin)

        def loss(self, batch):
            ids, targets = batch
            x = self.embed_tokens(ids)
            for layer in self.layers:
                x = layer(x, self.cos, self.sin)
            logits = self.lm_head(self.norm(x))
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    class BertLayer(nn.Module):
        def __init__(self, s):
            super().__init__()
            d = s["hidden"]
            self.h, self.hd = s["heads"], d // s["heads"]
            self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
            self.attn_out = nn.Linear(d, d)
            self.attn_norm = nn.LayerNorm(d, eps=1e-12)
            self.intermediate = nn.Linear(d, s["intermediate"])
            self.output = nn.Linear(s["intermediate"], d)
            self.out_norm = nn.LayerNorm(d, eps=1e-12)

        def forward(self, x, mask):
            b, t, d = x.shape
            split = lambda y: y.view(b, t, self.h, self.hd).transpose(1, 2)
            a = F.scaled_dot_product_attention(split(self.query(x)), split(self.key(x)),
                                               split(self.value(x)), attn_mask=mask)
            x = self.attn_norm(x + self.attn_out(a.transpose(1, 2).reshape(b, t, d)))
            return self.out_norm(x + self.output(F.gelu(self.intermediate(x))))

    class Bert(nn.Module):
        def __init__(self, s):
            super().__init__()
            d = s["hidden"]
            self.word = nn.Embedding(s["vocab"], d)
            self.position = nn.Embedding(s["seq"], d)
            self.token_type = nn.Embedding(2, d)
            self.norm = nn.LayerNorm(d, eps=1e-12)
            self.layers = nn.ModuleList([BertLayer(s) for _ in range(s["layers"])])
            self.classifier = nn.Linear(d, s["classes"])

        def loss(self, batch):
            ids, lengths, targets = batch
            b, t = ids.shape
            pos = torch.arange(t)
            x = self.word(ids) + self.position(pos)[None] + self.token_type(torch.zeros_like(ids))
            x = self.norm(x)
            keep = pos[None, :] < lengths[:, None]  # (b, t): True where a key is real
            mask = keep[:, None, None, :]  # boolean: never a half -inf tensor
            for layer in self.layers:
                x = layer(x, mask)
            logits = self.classifier(x).float()
            return F.cross_entropy(logits.flatten(0, 1), targets.masked_fill(~keep, -100).flatten(),
                                   ignore_index=-100)

    class VitLayer(nn.Module):
        def __init__(self, s):
            super().__init__()
            d = s["hidden"]
            self.h, self.hd = s["heads"], d // s["heads"]
            self.layernorm_before = nn.LayerNorm(d, eps=1e-12)
            self.qkv = nn.ModuleList([nn.Linear(d, d) for _ in range(3)])
            self.attn_out = nn.Linear(d, d)
            self.layernorm_after = nn.LayerNorm(d, eps=1e-12)
            self.intermediate = nn.Linear(d, s["intermediate"])
            self.output = nn.Linear(s["intermediate"], d)

        def forward(self, x):
            b, t, d = x.shape
            hx = self.layernorm_before(x)
            q, k, v = (l(hx).view(b, t, self.h, self.hd).transpose(1, 2) for l in self.qkv)
            a = F.scaled_dot_product_attention(q, k, v)
            x = x + self.attn_out(a.transpose(1, 2).reshape(b, t, d))
            return x + self.output(F.gelu(self.intermediate(self.layernorm_after(x))))

    class Vit(nn.Module):
        def __init__(self, s):
            super().__init__()
            d, p = s["hidden"], s["patch"]
            n = (s["image"] // p) ** 2
            self.projection = nn.Conv2d(s["channels"], d, p, stride=p)
            self.cls_token = nn.Parameter(torch.randn(1, 1, d) * 0.02)
            self.position_embeddings = nn.Parameter(torch.randn(1, n + 1, d) * 0.02)
            self.layers = nn.ModuleList([VitLayer(s) for _ in range(s["layers"])])
            self.layernorm = nn.LayerNorm(d, eps=1e-12)
            self.classifier = nn.Linear(d, s["classes"])

        def loss(self, batch):
            images, labels = batch
            x = self.projection(images).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x], 1)
            x = x + self.position_embeddings.to(x.dtype)
            for layer in self.layers:
                x = layer(x)
            return F.cross_entropy(self.classifier(self.layernorm(x)[:, 0]).float(), labels)

    def data(name, s, g):
        if name == "llama":
            seq = torch.randint(0, s["vocab"], (s["batch"], s["seq"] + 1), generator=g)
            return seq[:, :-1], seq[:, 1:]
        if name == "bert":
            ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), generator=g)
            lengths = torch.randint(s["min_len"], s["seq"] + 1, (s["batch"],), generator=g)
            return ids, lengths, torch.randint(0, s["classes"], (s["batch"], s["seq"]), generator=g)
        images = torch.randn(s["batch"], s["channels"], s["image"], s["image"], generator=g)
        return images, torch.randint(0, s["classes"], (s["batch"],), generator=g)

    return {"llama": Llama, "bert": Bert, "vit": Vit}, data


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--only", default="llama,bert,vit")
    a = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        log(f"torch_models.py: cannot import torch ({e}); pip install torch")
        sys.exit(NO_TORCH)
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    models, data = build(torch)
    out = {"torch": torch.__version__, "threads": a.threads, "steps": a.steps, "rounds": a.rounds}
    for name in [n for n in a.only.split(",") if n]:
        if name not in SHAPES:
            log(f"--only: unknown model {name!r} (llama, bert, vit)")
            sys.exit(2)
        s = SHAPES[name]
        g = torch.Generator().manual_seed(1)
        batch = data(name, s, g)
        runs = {}
        for mode in ["fp32", "autocast_bf16"]:
            m = models[name](s)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)
            runs[mode] = (m, opt)
        times = {mode: [] for mode in runs}
        for r in range(a.rounds):
            for mode, (m, opt) in runs.items():
                def step():
                    with torch.autocast("cpu", torch.bfloat16, enabled=mode == "autocast_bf16"):
                        loss = m.loss(batch)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    return loss.item()
                step()  # warm-up
                for _ in range(a.steps):
                    t0 = time.perf_counter()
                    step()
                    times[mode].append((time.perf_counter() - t0) * 1e3)
                log(f"{name} {mode} round {r + 1}: {statistics.median(times[mode]):.1f} ms")
        out[name] = {"shape": s}
        for mode in runs:
            out[name][f"{mode}_step_ms"] = statistics.median(times[mode])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
