//! What the bench prints: the table on stderr and the targets as ratios from this run.

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

pub fn print_table(o: &Value) {
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    let mem = f(&o["memcpy_gbps"]);
    eprintln!(
        "\n{} | kernels {} (detected {}) | rustflags {:?} | mallopt {} | threads {}",
        o["cpu"].as_str().unwrap_or("?"),
        o["isa"].as_str().unwrap_or("?"),
        o["detected_isa"].as_str().unwrap_or("?"),
        o["rustflags"].as_str().unwrap_or(""),
        o["mallopt"],
        o["threads"]
    );
    for k in ["memcpy_gbps", "cast_gbps", "unscale_check_gbps", "adamw_gbps"] {
        eprintln!("{k:<20} {:>8.2}   {:.2}x memcpy", f(&o[k]), f(&o[k]) / mem);
    }
    for dt in ["f32", "f16", "bf16"] {
        eprintln!("gemm {dt:<15} {:>8.1} GFLOP/s", f(&o["gemm_gflops"][dt]));
    }
    let plain = f(&o["plain_candle_f32_step_ms"]);
    let o0 = f(&o["levels"]["O0"]["f16"]["step_ms"]);
    let t0 = f(&o["levels"]["O0"]["f16"]["transformer_step_ms"]);
    let p0 = f(&o["levels"]["O0"]["f16"]["peak_mb"]);
    let a0 = f(&o["levels"]["O0"]["f16"]["alloc_bytes_per_step"]);
    eprintln!("plain candle f32 MLP step {plain:.2} ms");
    eprintln!(
        "{:<6} {:<5} {:>10} {:>9} {:>11} {:>9} {:>12} {:>9} {:>9} {:>9}",
        "level", "half", "mlp_ms", "vs O0", "mlp_alloc", "vs O0", "transf_ms", "vs O0", "peak_mb", "vs O0"
    );
    for level in ["O0", "O1", "O2", "O3"] {
        for half in ["f16", "bf16"] {
            let r = &o["levels"][level][half];
            eprintln!(
                "{level:<6} {half:<5} {:>10.2} {:>8.2}x {:>9.1}MB {:>8.2}x {:>12.2} {:>8.2}x {:>9.1} {:>8.2}x",
                f(&r["step_ms"]),
                f(&r["step_ms"]) / o0,
                f(&r["alloc_bytes_per_step"]) / (1 << 20) as f64,
                f(&r["alloc_bytes_per_step"]) / a0,
                f(&r["transformer_step_ms"]),
                f(&r["transformer_step_ms"]) / t0,
                f(&r["peak_mb"]),
                f(&r["peak_mb"]) / p0
            );
        }
    }
    let targets = o["targets"].as_array().cloned().unwrap_or_default();
    if !targets.is_empty() {
        eprintln!("\ntargets (ratio from this run, one line each):");
        for t in &targets {
            eprintln!(
                "  {:<4} {:<52} {:>6.2} {} {:.2}",
                if t["met"].as_bool() == Some(true) {
                    "met"
                } else {
                    "MISS"
                },
                t["name"].as_str().unwrap_or(""),
                f(&t["ratio"]),
                t["rule"].as_str().unwrap_or(""),
                f(&t["limit"]),
            );
        }
    }
}

/// The PyTorch figures `benches/peers/torch_amp.py` printed (its last stdout line, or the
/// whole file as one JSON object), checked before anything is measured.
pub fn read_torch(path: &str, threads: usize) -> Result<Value> {
    let text = std::fs::read_to_string(path).with_context(|| format!("--torch: cannot read {path}"))?;
    let line = text.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
    let v: Value = serde_json::from_str(line)
        .with_context(|| format!("--torch: {path} must end with the JSON line torch_amp.py prints"))?;
    for k in ["fp32_step_ms", "autocast_bf16_step_ms"] {
        if !v[k].as_f64().is_some_and(|x| x > 0.0) {
            bail!("--torch: {path} has no positive {k:?}; run benches/peers/torch_amp.py again");
        }
    }
    if v["threads"].as_u64() != Some(threads as u64) {
        bail!(
            "--torch: {path} was measured with {} threads, this run uses {threads}; pass the same --threads to both",
            v["threads"]
        );
    }
    Ok(v)
}

/// The README's targets as ratios from this run: `{name, ratio, rule, limit, met}`, where
/// `rule` is `"<="`, `"<"` or `">="` (the ratio against the limit). The PyTorch ones appear
/// only with `--torch`.
pub fn targets(o: &Value) -> Value {
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    let lv = |level: &str, half: &str, k: &str| f(&o["levels"][level][half][k]);
    let mut t = Vec::new();
    let mut add = |name: String, ratio: f64, rule: &str, limit: f64| {
        let met = match rule {
            "<" => ratio < limit,
            ">=" => ratio >= limit,
            _ => ratio <= limit,
        };
        t.push(json!({ "name": name, "ratio": ratio, "rule": rule, "limit": limit, "met": met }));
    };
    let mem = f(&o["memcpy_gbps"]);
    add("cast bandwidth / memcpy".into(), f(&o["cast_gbps"]) / mem, ">=", 0.6);
    add(
        "unscale+check bandwidth / memcpy".into(),
        f(&o["unscale_check_gbps"]) / mem,
        ">=",
        0.6,
    );
    add(
        "fused AdamW bandwidth / memcpy".into(),
        f(&o["adamw_gbps"]) / mem,
        ">=",
        0.5,
    );
    let o0 = lv("O0", "f16", "step_ms");
    add(
        "O0 step / plain candle f32 step".into(),
        o0 / f(&o["plain_candle_f32_step_ms"]),
        "<=",
        1.0,
    );
    let best_bf16 = lv("O1", "bf16", "step_ms").min(lv("O2", "bf16", "step_ms"));
    // Only the bf16 tiers multiply bf16 natively; below them the product widens bf16 to
    // f32 first, so a bf16 step can at best tie O0 and the 0.6x target does not apply.
    if matches!(o["isa"].as_str(), Some("avx512bf16" | "amx")) {
        add(
            "best of O1/O2 bf16 MLP step / O0 (bf16 tiers)".into(),
            best_bf16 / o0,
            "<=",
            0.6,
        );
    }
    let t0 = lv("O0", "f16", "transformer_step_ms");
    for (model, key, base) in [("MLP", "step_ms", o0), ("transformer", "transformer_step_ms", t0)] {
        for level in ["O1", "O2", "O3"] {
            for half in ["f16", "bf16"] {
                add(
                    format!("no half level slower than O0: {model} {level} {half}"),
                    lv(level, half, key) / base,
                    "<=",
                    1.0,
                );
            }
        }
    }
    add(
        "alloc bytes per MLP step, O2 f16 / O0".into(),
        lv("O2", "f16", "alloc_bytes_per_step") / lv("O0", "f16", "alloc_bytes_per_step"),
        "<=",
        0.6,
    );
    let p0 = lv("O0", "f16", "peak_mb");
    for level in ["O2", "O3"] {
        for half in ["f16", "bf16"] {
            add(
                format!("{level} {half} peak memory / O0 (below 1)"),
                lv(level, half, "peak_mb") / p0,
                "<",
                1.0,
            );
        }
    }
    add(
        "checkpointing peak memory / plain (8-block transformer, O2 f16)".into(),
        f(&o["checkpoint_peak_ratio"]),
        "<=",
        0.6,
    );
    add(
        "checkpointing step time / plain".into(),
        f(&o["checkpoint_time_ratio"]),
        "<=",
        1.4,
    );
    add(
        "chunked feed-forward peak memory / plain (training)".into(),
        f(&o["chunk_peak_ratio"]),
        "<",
        1.0,
    );
    add(
        "numerics doctor on (every 10th step) / off, MLP step O1 f16".into(),
        f(&o["doctor_overhead"]),
        "<=",
        1.10,
    );
    if o["torch"].is_object() {
        let fp32 = f(&o["torch"]["fp32_step_ms"]);
        let tbf16 = f(&o["torch"]["autocast_bf16_step_ms"]);
        add("O0 step / PyTorch fp32 step".into(), o0 / fp32, "<=", 0.8);
        add("best of O1/O2 bf16 / PyTorch fp32".into(), best_bf16 / fp32, "<=", 1.0);
        let best_any = ["O1", "O2", "O3"]
            .iter()
            .map(|l| lv(l, "bf16", "step_ms"))
            .fold(f64::INFINITY, f64::min);
        add(
            "stretch: best bf16 level / PyTorch autocast bf16".into(),
            best_any / tbf16,
            "<=",
            0.8,
        );
    }
    Value::Array(t)
}
