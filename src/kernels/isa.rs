//! Which instruction set the kernels use: detected at run time, or forced lower (tests force
//! the portable fallback to check it against the vector paths).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU8, Ordering};

/// The instruction sets the kernels have paths for, lowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// Plain Rust, any CPU.
    Portable,
    /// x86-64 AVX2 with FMA and F16C.
    Avx2,
    /// x86-64 AVX-512 (F, BW, VL) with F16C.
    Avx512,
    /// AVX-512 with the BF16 dot-product instruction `vdpbf16ps` (bf16 matrix products).
    /// The instruction flushes subnormal inputs and results to zero, so bf16 products on this
    /// tier do too (see [`bf16_products_flush_subnormals`](super::bf16_products_flush_subnormals)).
    Avx512Bf16,
    /// AMX tiles with BF16 (bf16 matrix products on 16 x 16 tiles), granted by the OS, on a
    /// CPU that also has AVX-512 BF16 (every tier has the features of the tiers below).
    /// `tdpbf16ps` flushes subnormal inputs and results to zero, as `vdpbf16ps` does (see
    /// [`bf16_products_flush_subnormals`](super::bf16_products_flush_subnormals)).
    Amx,
}

impl Isa {
    /// Every level, lowest first.
    pub const ALL: [Isa; 5] = [Isa::Portable, Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16, Isa::Amx];
}

/// The CPU features the tiers need, as detected (a plain struct, so the tier logic can be
/// tested for CPUs this one is not).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Features {
    avx2: bool,
    fma: bool,
    f16c: bool,
    avx512f: bool,
    avx512bw: bool,
    avx512vl: bool,
    avx512bf16: bool,
    /// AMX-BF16 and AMX-TILE, and the OS granted the tile state.
    amx: bool,
}

/// The highest tier `f` has every feature of. Each tier needs all the features of the
/// tiers below it: the kernels of a tier call the lower tiers' helpers, and [`force`] caps
/// at any lower tier, so a tier is never reported for a CPU that lacks a lower one's
/// instructions (AMX without AVX-512 BF16 would run `vdpbf16ps` once capped at
/// [`Isa::Avx512Bf16`]).
fn tier(f: Features) -> Isa {
    let avx2 = f.avx2 && f.fma && f.f16c;
    let avx512 = avx2 && f.avx512f && f.avx512bw && f.avx512vl;
    let avx512bf16 = avx512 && f.avx512bf16;
    if avx512bf16 && f.amx {
        Isa::Amx
    } else if avx512bf16 {
        Isa::Avx512Bf16
    } else if avx512 {
        Isa::Avx512
    } else if avx2 {
        Isa::Avx2
    } else {
        Isa::Portable
    }
}

#[cfg(target_arch = "x86_64")]
fn features() -> Features {
    Features {
        avx2: is_x86_feature_detected!("avx2"),
        fma: is_x86_feature_detected!("fma"),
        f16c: is_x86_feature_detected!("f16c"),
        avx512f: is_x86_feature_detected!("avx512f"),
        avx512bw: is_x86_feature_detected!("avx512bw"),
        avx512vl: is_x86_feature_detected!("avx512vl"),
        avx512bf16: is_x86_feature_detected!("avx512bf16"),
        amx: amx_available(),
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn features() -> Features {
    Features::default()
}

fn detect() -> Isa {
    tier(features())
}

/// What this CPU supports.
pub fn detected() -> Isa {
    static D: OnceLock<Isa> = OnceLock::new();
    *D.get_or_init(detect)
}

/// 0: no limit; otherwise the forced level + 1.
static FORCED: AtomicU8 = AtomicU8::new(0);

/// The level the kernels use now: the detected one, or lower if [`force`] asked for it.
pub fn current() -> Isa {
    capped(FORCED.load(Ordering::Relaxed), detected())
}

/// The level under the cap `forced` (0: none, else the level's index + 1) on a CPU whose
/// highest tier is `detected`: never above `detected` (each tier implies the ones below).
fn capped(forced: u8, detected: Isa) -> Isa {
    match forced {
        0 => detected,
        f => Isa::ALL
            .get((f - 1) as usize)
            .copied()
            .unwrap_or(Isa::Portable)
            .min(detected),
    }
}

/// Caps the kernels at `isa` (never above what the CPU has); `None` lifts the cap. For
/// checking the fallbacks against the vector paths; process-wide.
pub fn force(isa: Option<Isa>) {
    let v = match isa {
        None => 0,
        Some(i) => Isa::ALL.iter().position(|x| *x == i).unwrap_or(0) as u8 + 1,
    };
    FORCED.store(v, Ordering::Relaxed);
}

/// Whether bf16 matrix products on the active tier ([`current`]) flush subnormals to zero:
/// true on [`Isa::Amx`] and [`Isa::Avx512Bf16`], whose dot-product instructions treat
/// subnormal bf16 inputs as zero and flush subnormal f32 results to zero (they ignore the
/// MXCSR register). The tiers below widen to f32 and keep subnormals, as candle does.
pub fn bf16_products_flush_subnormals() -> bool {
    matches!(current(), Isa::Amx | Isa::Avx512Bf16)
}

#[cfg(target_arch = "x86_64")]
/// Whether the CPU has AMX-BF16 and the OS granted this process the tile state.
pub(crate) fn amx_available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        // CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE.
        let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
        if edx & (1 << 22) == 0 || edx & (1 << 24) == 0 {
            return false;
        }
        request_tile_state()
    })
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_tile_state() -> bool {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_GET_XCOMP_PERM: i64 = 0x1022;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    unsafe extern "C" {
        fn syscall(n: i64, ...) -> i64;
    }
    // SAFETY: arch_prctl with these codes only reads and sets the process's permission bits
    // (and writes the u64 we pass).
    unsafe {
        if syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0 {
            return false;
        }
        let mut bits = 0u64;
        syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, &mut bits as *mut u64) == 0 && bits >> XFEATURE_XTILEDATA & 1 == 1
    }
}

#[cfg(all(target_arch = "x86_64", not(target_os = "linux")))]
fn request_tile_state() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Everything up to AVX-512 (F, BW, VL).
    fn avx512() -> Features {
        Features {
            avx2: true,
            fma: true,
            f16c: true,
            avx512f: true,
            avx512bw: true,
            avx512vl: true,
            ..Features::default()
        }
    }

    #[test]
    fn each_tier_needs_the_features_of_the_tiers_below() {
        assert_eq!(tier(Features::default()), Isa::Portable);
        assert_eq!(tier(avx512()), Isa::Avx512);
        let bf16 = Features {
            avx512bf16: true,
            ..avx512()
        };
        assert_eq!(tier(bf16), Isa::Avx512Bf16);
        assert_eq!(tier(Features { amx: true, ..bf16 }), Isa::Amx);
        // A VM that masks AVX-512 BF16 but passes AMX through: capping at Avx512Bf16 would
        // then run `vdpbf16ps`, so AMX is not reported.
        assert_eq!(tier(Features { amx: true, ..avx512() }), Isa::Avx512);
        assert_eq!(
            tier(Features {
                amx: true,
                avx512bf16: true,
                avx512f: false,
                ..avx512()
            }),
            Isa::Avx2
        );
        assert_eq!(tier(Features { f16c: false, ..bf16 }), Isa::Portable);
    }

    #[test]
    fn a_cap_never_raises_the_level() {
        for (i, cap) in Isa::ALL.iter().enumerate() {
            for d in Isa::ALL {
                let got = capped(i as u8 + 1, d);
                assert!(got <= d && got <= *cap, "cap {cap:?} on {d:?} gave {got:?}");
            }
        }
        assert_eq!(capped(0, Isa::Avx2), Isa::Avx2);
        assert_eq!(capped(200, Isa::Amx), Isa::Portable, "an unknown cap is the lowest");
    }
}
