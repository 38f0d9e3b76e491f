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
    Avx512Bf16,
    /// AMX tiles with BF16 (bf16 matrix products on 16 x 16 tiles), granted by the OS.
    Amx,
}

impl Isa {
    /// Every level, lowest first.
    pub const ALL: [Isa; 5] = [Isa::Portable, Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16, Isa::Amx];
}

fn detect() -> Isa {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 =
            is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && is_x86_feature_detected!("f16c");
        let avx512 = avx2
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl");
        if avx512 && amx_available() {
            return Isa::Amx;
        }
        if avx512 && is_x86_feature_detected!("avx512bf16") {
            return Isa::Avx512Bf16;
        }
        if avx512 {
            return Isa::Avx512;
        }
        if avx2 {
            return Isa::Avx2;
        }
    }
    Isa::Portable
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
    let d = detected();
    match FORCED.load(Ordering::Relaxed) {
        0 => d,
        f => Isa::ALL[(f - 1) as usize].min(d),
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
