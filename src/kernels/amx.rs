//! bf16 matrix product on AMX tiles (Intel Sapphire Rapids and later).
//!
//! `tdpbf16ps c, a, b` multiplies a 16 x 32 bf16 tile of A by a 32 x 16 bf16 tile of B
//! (stored as 16 rows of depth pairs, "VNNI" layout) into a 16 x 16 f32 tile of C: 8192
//! multiply-adds in one instruction, products exact and sums in f32, except that subnormal
//! inputs are read as zero and subnormal results flushed to zero (as `vdpbf16ps`; see
//! `kernels::bf16_products_flush_subnormals`). The kernel keeps a
//! 32 x 32 block of C in four tile registers and, per 32 values of depth, loads two A tiles
//! and two B tiles and issues four dot products. Both operands are packed first (zero-padded
//! to whole tiles), so any strides, any sizes and transposed views work.
//!
//! AMX needs the OS to grant the tile state: Linux does it per process on request
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`), which `isa::amx_available` asks once.
//! AMX intrinsics are not stable in Rust; the instructions are written with `asm!`.

use std::arch::asm;

use half::bf16;
use rayon::prelude::*;

use super::mat::Mat;

/// Rows of A (and C) per tile, depth values per tile, columns of B (and C) per tile.
const TM: usize = 16;
const TK: usize = 32;
const TN: usize = 16;
/// Rows and columns of C kept in tiles by one kernel call (2 x 2 tiles).
const BM: usize = 2 * TM;
const BN: usize = 2 * TN;
/// Rows of A packed and computed per parallel task.
const MC: usize = 8 * BM;

/// The tile configuration: palette 1, tiles 0-7 all 16 rows of 64 bytes.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

const CONFIG: TileConfig = TileConfig {
    palette: 1,
    start_row: 0,
    reserved: [0; 14],
    colsb: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
    rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
};

/// This thread's tile state, configured with [`CONFIG`] while the guard lives: dropping it
/// (also while unwinding from a panic in between) releases the state, so a failed check never
/// leaves the tiles live (they make every context switch save 8 KiB more).
struct Tiles {
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Tiles {
    /// Loads the tile configuration on this thread.
    ///
    /// # Safety
    /// The CPU has AMX and the OS granted this process the tile state
    /// (`isa::amx_available`).
    unsafe fn configure() -> Self {
        // SAFETY: the caller guarantees AMX; CONFIG is a valid palette-1 configuration.
        unsafe { asm!("ldtilecfg [{0}]", in(reg) &CONFIG as *const TileConfig) };
        Self {
            _not_send: std::marker::PhantomData,
        }
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: a guard exists only after `configure` succeeded on this thread (not Send).
        unsafe { asm!("tilerelease") };
    }
}

/// The bit patterns of bf16 values.
fn bits(v: &[bf16]) -> &[u16] {
    // SAFETY: bf16 is a transparent u16.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u16, v.len()) }
}

/// Packs A's rows `[m0, m0+mc)` (all `k` of depth) into tiles: for each 16-row group, for
/// each 32 of depth, 16 rows of 32 bf16 (64 bytes). Row-major A is copied 64 bytes at a
/// time; a transposed view is read down its contiguous columns.
fn pack_a(a: &Mat<'_, bf16>, k: usize, m0: usize, mc: usize, out: &mut Vec<u16>) {
    let groups = mc.div_ceil(TM);
    let kt = k.div_ceil(TK);
    out.clear();
    out.resize(groups * kt * TM * TK, 0);
    let data = bits(a.data);
    if a.cs == 1 {
        for r in 0..mc {
            let (g, rr) = (r / TM, r % TM);
            let row = &data[a.off + (m0 + r) * a.rs..][..k];
            for (t, chunk) in row.chunks(TK).enumerate() {
                let dst = ((g * kt + t) * TM + rr) * TK;
                out[dst..dst + chunk.len()].copy_from_slice(chunk);
            }
        }
    } else if a.rs == 1 {
        for p in 0..k {
            let (t, q) = (p / TK, p % TK);
            let col = &data[a.off + p * a.cs + m0..][..mc];
            for (r, v) in col.iter().enumerate() {
                out[(((r / TM) * kt + t) * TM + r % TM) * TK + q] = *v;
            }
        }
    } else {
        for r in 0..mc {
            let (g, rr) = (r / TM, r % TM);
            let base = a.off + (m0 + r) * a.rs;
            for p in 0..k {
                out[((g * kt + p / TK) * TM + rr) * TK + p % TK] = data[base + p * a.cs];
            }
        }
    }
}

/// Packs B (`k` x `n`) into tiles: for each 16-column group, for each 32 of depth, 16 rows
/// (depth pairs) of 16 columns x 2 bf16. A transposed view (each column's depth contiguous,
/// as `w^T` in a linear layer) is read as 32-bit depth pairs; row-major B is interleaved two
/// rows at a time.
fn pack_b(b: &Mat<'_, bf16>, k: usize, n: usize, out: &mut Vec<u16>) {
    let groups = n.div_ceil(TN);
    let kt = k.div_ceil(TK);
    out.clear();
    out.resize(groups * kt * TK * TN, 0);
    let data = bits(b.data);
    if b.rs == 1 {
        for c in 0..n {
            let (g, j) = (c / TN, c % TN);
            let col = &data[b.off + c * b.cs..][..k];
            for (pp, pair) in col.chunks(2).enumerate() {
                // Pair pp of depth: tile pp/16, row pp%16.
                let dst = ((g * kt + pp / (TK / 2)) * (TK / 2) + pp % (TK / 2)) * (TN * 2) + j * 2;
                out[dst] = pair[0];
                if let Some(hi) = pair.get(1) {
                    out[dst + 1] = *hi;
                }
            }
        }
    } else if b.cs == 1 {
        for p in 0..k {
            let (t, q) = (p / TK, p % TK);
            let row = &data[b.off + p * b.rs..][..n];
            for (g, chunk) in row.chunks(TN).enumerate() {
                let base = ((g * kt + t) * (TK / 2) + q / 2) * (TN * 2) + q % 2;
                for (j, v) in chunk.iter().enumerate() {
                    out[base + 2 * j] = *v;
                }
            }
        }
    } else {
        for p in 0..k {
            let (t, q) = (p / TK, p % TK);
            for c in 0..n {
                let (g, j) = (c / TN, c % TN);
                out[((g * kt + t) * (TK / 2) + q / 2) * (TN * 2) + j * 2 + q % 2] = data[b.off + p * b.rs + c * b.cs];
            }
        }
    }
}

/// One 32 x 32 block of C from packed A (two row groups, `kt` depth tiles each) and packed B
/// (two column groups); stores the f32 block with row stride `ldc` (floats). `load` adds C's
/// current values.
///
/// # Safety
/// The CPU has AMX-BF16, the tile state was granted and the configuration loaded on this
/// thread; `a0`, `a1`, `b0`, `b1` point at `kt` packed tiles each; `c` at 32 rows of 32
/// floats with row stride `ldc`.
#[allow(clippy::too_many_arguments)]
unsafe fn block(
    kt: usize,
    a0: *const u16,
    a1: *const u16,
    b0: *const u16,
    b1: *const u16,
    c: *mut f32,
    ldc: usize,
    load: bool,
) {
    let stride = 64usize;
    let cs = ldc * 4;
    unsafe {
        let c01 = c.add(TN);
        let c10 = c.add(TM * ldc);
        let c11 = c.add(TM * ldc + TN);
        if load {
            asm!(
                "tileloadd tmm0, [{c00} + {cs}]",
                "tileloadd tmm1, [{c01} + {cs}]",
                "tileloadd tmm2, [{c10} + {cs}]",
                "tileloadd tmm3, [{c11} + {cs}]",
                c00 = in(reg) c, c01 = in(reg) c01, c10 = in(reg) c10, c11 = in(reg) c11, cs = in(reg) cs,
            );
        } else {
            asm!("tilezero tmm0", "tilezero tmm1", "tilezero tmm2", "tilezero tmm3");
        }
        let tile = TM * TK; // u16 elements per packed tile
        for t in 0..kt {
            asm!(
                "tileloadd tmm4, [{a0} + {s}]",
                "tileloadd tmm5, [{a1} + {s}]",
                "tileloadd tmm6, [{b0} + {s}]",
                "tileloadd tmm7, [{b1} + {s}]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                a0 = in(reg) a0.add(t * tile), a1 = in(reg) a1.add(t * tile),
                b0 = in(reg) b0.add(t * tile), b1 = in(reg) b1.add(t * tile),
                s = in(reg) stride,
            );
        }
        asm!(
            "tilestored [{c00} + {cs}], tmm0",
            "tilestored [{c01} + {cs}], tmm1",
            "tilestored [{c10} + {cs}], tmm2",
            "tilestored [{c11} + {cs}], tmm3",
            c00 = in(reg) c, c01 = in(reg) c01, c10 = in(reg) c10, c11 = in(reg) c11, cs = in(reg) cs,
        );
    }
}

/// Rows `[m0, m0+mc)` of C (`c` starts at row `m0`) against packed B.
#[allow(clippy::too_many_arguments)]
fn rows(a: &Mat<'_, bf16>, k: usize, n: usize, m0: usize, mc: usize, bp: &[u16], c: &mut [f32], ldc: usize, acc: bool) {
    let kt = k.div_ceil(TK);
    let mut ap = Vec::new();
    pack_a(a, k, m0, mc, &mut ap);
    let tile = TM * TK;
    let zero_a = vec![0u16; kt * tile];
    let zero_b = vec![0u16; kt * tile];
    let mut scratch = vec![0f32; BM * BN];
    let a_groups = mc.div_ceil(TM);
    let b_groups = n.div_ceil(TN);
    // SAFETY: `amx_available()` was checked by the caller; the configuration is per thread
    // and released when `_tiles` drops, on every path out of this function.
    let _tiles = unsafe { Tiles::configure() };
    for bi in (0..mc).step_by(BM) {
        let ga = bi / TM;
        let a0 = ap[ga * kt * tile..].as_ptr();
        let a1 = if ga + 1 < a_groups {
            ap[(ga + 1) * kt * tile..].as_ptr()
        } else {
            zero_a.as_ptr()
        };
        let rows = BM.min(mc - bi);
        for bj in (0..n).step_by(BN) {
            let gb = bj / TN;
            let b0 = bp[gb * kt * tile..].as_ptr();
            let b1 = if gb + 1 < b_groups {
                bp[(gb + 1) * kt * tile..].as_ptr()
            } else {
                zero_b.as_ptr()
            };
            let cols = BN.min(n - bj);
            if rows == BM && cols == BN {
                // A panic here unwinds through `_tiles`, which releases the tile state.
                assert!((bi + BM - 1) * ldc + bj + BN <= c.len());
                // SAFETY: the block lies inside `c` (checked), the packed panels hold kt tiles.
                unsafe { block(kt, a0, a1, b0, b1, c.as_mut_ptr().add(bi * ldc + bj), ldc, acc) };
            } else {
                for i in 0..rows {
                    for j in 0..cols {
                        scratch[i * BN + j] = if acc { c[(bi + i) * ldc + bj + j] } else { 0.0 };
                    }
                }
                // SAFETY: as above, on the local 32 x 32 scratch block.
                unsafe { block(kt, a0, a1, b0, b1, scratch.as_mut_ptr(), BN, true) };
                for i in 0..rows {
                    for j in 0..cols {
                        c[(bi + i) * ldc + bj + j] = scratch[i * BN + j];
                    }
                }
            }
        }
    }
}

/// `c (m x n, row stride ldc) (+)= a . b`. The caller checked `isa::amx_available`; every
/// dimension is at least 1 (the dispatcher sends empty products to the direct loop).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(
    m: usize,
    n: usize,
    k: usize,
    a: Mat<'_, bf16>,
    b: Mat<'_, bf16>,
    c: &mut [f32],
    ldc: usize,
    acc: bool,
) {
    super::bf16_gemm::check_product(m, n, k, &a, &b, c.len(), ldc, "amx gemm");
    let mut bp = Vec::new();
    pack_b(&b, k, n, &mut bp);
    if rayon::current_num_threads() > 1 && m > MC {
        c.par_chunks_mut(MC * ldc)
            .enumerate()
            .filter(|(i, _)| i * MC < m)
            .for_each(|(i, chunk)| rows(&a, k, n, i * MC, MC.min(m - i * MC), &bp, chunk, ldc, acc));
    } else {
        for m0 in (0..m).step_by(MC) {
            rows(&a, k, n, m0, MC.min(m - m0), &bp, &mut c[m0 * ldc..], ldc, acc);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether this thread's tiles are configured (`sttilecfg` stores zeros once released).
    fn configured() -> bool {
        let mut cfg = [0u8; 64];
        // SAFETY: only called where AMX is available; stores 64 bytes into `cfg`.
        unsafe { asm!("sttilecfg [{0}]", in(reg) cfg.as_mut_ptr()) };
        cfg[0] != 0
    }

    #[test]
    fn a_panic_with_the_tiles_configured_releases_them() {
        if !crate::kernels::isa::amx_available() {
            eprintln!("no AMX here: nothing to check");
            return;
        }
        let r = std::panic::catch_unwind(|| {
            // SAFETY: AMX is available (checked above).
            let _t = unsafe { Tiles::configure() };
            assert!(configured());
            panic!("a failed check between ldtilecfg and tilerelease");
        });
        assert!(r.is_err());
        assert!(!configured(), "the guard released the tile state while unwinding");
    }
}
