//! What the emulator tests (`cuda_kernels`, `cuda_norm`, `cuda_xent`) share: the harness of one
//! `.cu` built with g++ against the CPU grid emulator (`emu.h`), run with its arguments, and the
//! values written to and read from its raw little-endian files.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use candle_core::DType;
use half::{bf16, f16};

/// The emulator harness of `src/kernels/cuda/{kernels}.cu` (`tests/cuda_emu/{kernels}_harness.cpp`),
/// built once per test binary (each test binary runs one) into a temporary folder.
pub fn harness(kernels: &str) -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("cuda_emu_{kernels}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bin = dir.join(format!("{kernels}_harness"));
        let out = Command::new("g++")
            .args(["-std=c++20", "-O2", "-pthread", "-Wall", "-Wno-unknown-pragmas", "-I"])
            .arg(root.join("tests/cuda_emu"))
            .arg("-I")
            .arg(root.join("src/kernels/cuda"))
            .arg(root.join(format!("tests/cuda_emu/{kernels}_harness.cpp")))
            .arg("-o")
            .arg(&bin)
            .output()
            .unwrap_or_else(|e| panic!("g++ is needed to build the CUDA emulator (apt-get install g++): {e}"));
        assert!(
            out.status.success(),
            "g++ failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        bin
    })
}

/// Runs `kernels`' harness with `args`; panics if it fails.
pub fn run(kernels: &str, args: &[String]) {
    let st = Command::new(harness(kernels)).args(args).status().unwrap();
    assert!(st.success(), "harness failed: {args:?}");
}

/// A fresh folder for one test's files.
pub fn scratch(kernels: &str, name: &str) -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("cuda_emu_{kernels}-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Values stored in one of the three types, as bytes and as the exact values they hold.
pub fn encode(v: &[f64], dt: DType) -> (Vec<u8>, Vec<f64>) {
    let mut bytes = Vec::new();
    let mut held = Vec::new();
    for &x in v {
        match dt {
            DType::F32 => {
                bytes.extend((x as f32).to_le_bytes());
                held.push(x as f32 as f64);
            }
            DType::F16 => {
                let h = f16::from_f64(x);
                bytes.extend(h.to_bits().to_le_bytes());
                held.push(h.to_f64());
            }
            _ => {
                let h = bf16::from_f64(x);
                bytes.extend(h.to_bits().to_le_bytes());
                held.push(h.to_f64());
            }
        }
    }
    (bytes, held)
}

/// Values of `dt` read back from their bytes, as f64.
pub fn decode(b: &[u8], dt: DType) -> Vec<f64> {
    match dt {
        DType::F32 => b
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect(),
        DType::F16 => b
            .chunks(2)
            .map(|c| f16::from_le_bytes(c.try_into().unwrap()).to_f64())
            .collect(),
        _ => b
            .chunks(2)
            .map(|c| bf16::from_le_bytes(c.try_into().unwrap()).to_f64())
            .collect(),
    }
}

/// f32 values read back as f64.
pub fn f32s(b: &[u8]) -> Vec<f64> {
    decode(b, DType::F32)
}

/// Half a unit in the last place of `dt` (its rounding), relative.
pub fn eps(dt: DType) -> f64 {
    match dt {
        DType::F32 => 6e-8,
        DType::F16 => 4.9e-4,
        _ => 3.9e-3,
    }
}

/// Half the spacing of `dt`'s subnormals: the absolute rounding error of tiny values.
pub fn atol(dt: DType) -> f64 {
    match dt {
        DType::F16 => 2.99e-8,
        _ => 1e-30,
    }
}

/// Seeded values in [-lo, lo).
pub fn values(n: usize, seed: u64, lo: f64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * lo
        })
        .collect()
}

/// `erfc` in f64 (the references of GELU's kernels): the positive series of `erf` (no
/// cancellation) below 2.5, the continued fraction above; negative arguments by symmetry.
/// About 1e-13 relative or better.
pub fn erfc(x: f64) -> f64 {
    if x < 0.0 {
        return 2.0 - erfc(-x);
    }
    if x < 2.5 {
        // erf(x) = 2/√π e^{-x²} Σ 2^n x^{2n+1} / (1·3···(2n+1)).
        let (mut term, mut sum, mut n) = (x, x, 0.0);
        while term > 1e-18 * sum {
            n += 1.0;
            term *= 2.0 * x * x / (2.0 * n + 1.0);
            sum += term;
        }
        return 1.0 - 2.0 / std::f64::consts::PI.sqrt() * (-x * x).exp() * sum;
    }
    let mut k = x;
    for i in (1..=80).rev() {
        k = x + (i as f64 / 2.0) / k;
    }
    (-x * x).exp() / std::f64::consts::PI.sqrt() / k
}

/// The standard normal distribution function Φ(x) in f64.
pub fn cdf(x: f64) -> f64 {
    0.5 * erfc(-x / std::f64::consts::SQRT_2)
}

/// The standard normal density in f64.
pub fn pdf(x: f64) -> f64 {
    (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt()
}
