//! What the bench ran on: the CPU, the kernels' instruction-set tier, how it was compiled
//! and the allocator setting, so figures from different machines and builds can be told
//! apart.

use anyhow::{Result, bail};
use candle_amp::kernels::{self, Isa};
use serde_json::{Value, json};

/// The tier's name in the JSON and on the command line.
pub fn isa_name(i: Isa) -> &'static str {
    match i {
        Isa::Portable => "portable",
        Isa::Avx2 => "avx2",
        Isa::Avx512 => "avx512",
        Isa::Avx512Bf16 => "avx512bf16",
        Isa::Amx => "amx",
    }
}

/// Caps the kernels at the tier named `name`. A tier above the CPU's is refused rather than
/// silently capped to the detected one, so a report labelled with a tier measured it.
pub fn force_isa(name: &str) -> Result<()> {
    let names: Vec<_> = Isa::ALL.into_iter().map(isa_name).collect();
    let Some(cap) = Isa::ALL.into_iter().find(|i| isa_name(*i) == name) else {
        bail!("--isa {name:?}: one of {}", names.join(", "));
    };
    let detected = kernels::detected_isa();
    if cap > detected {
        bail!("--isa {name}: this CPU's highest tier is {}", isa_name(detected));
    }
    kernels::force_isa(Some(cap));
    Ok(())
}

/// The "model name" line of /proc/cpuinfo.
fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

/// The machine keys of the JSON, taken after `--isa` is applied.
pub fn describe(mallopt: bool) -> Value {
    json!({
        "cpu": cpu_model(),
        "isa": isa_name(kernels::isa()),
        "detected_isa": isa_name(kernels::detected_isa()),
        // Cargo passes RUSTFLAGS through to rustc, so this is what the user exported when
        // the bench was built; flags from a config file do not show here, which is what
        // the target features below are for.
        "rustflags": option_env!("RUSTFLAGS").unwrap_or(""),
        "compiled_target_features": {
            "avx2": cfg!(target_feature = "avx2"),
            "avx512f": cfg!(target_feature = "avx512f"),
            "f16c": cfg!(target_feature = "f16c"),
        },
        "mallopt": mallopt,
    })
}

/// glibc returns large freed blocks to the OS and faults fresh zeroed pages back in on the
/// next step; keeping them (as a caching allocator would) removes that cost. Opt-in
/// (`--mallopt`): the targets are measured with the allocator a user's program gets.
/// Whether it applied (glibc only).
pub fn keep_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        unsafe extern "C" {
            fn mallopt(param: i32, value: i32) -> i32;
        }
        const M_TRIM_THRESHOLD: i32 = -1;
        const M_MMAP_THRESHOLD: i32 = -3;
        // SAFETY: mallopt only changes glibc's thresholds; called before any other thread.
        unsafe {
            mallopt(M_MMAP_THRESHOLD, 1 << 30);
            mallopt(M_TRIM_THRESHOLD, i32::MAX);
        }
    }
    cfg!(all(target_os = "linux", target_env = "gnu"))
}
