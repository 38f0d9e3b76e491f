use std::arch::x86_64::*;

use super::AdamWConsts;
use crate::kernels::simd::Elem;
use crate::kernels::simd::x86::{V8, V16, nonfinite8, nonfinite16};

#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,avx2,fma")]
pub(super) unsafe fn convert512<S: Elem + V16, D: Elem + V16>(src: &[S], dst: &mut [D]) {
    let n = src.len();
    let mut i = 0;
    unsafe {
        while i + 16 <= n {
            D::store16(dst.as_mut_ptr().add(i), S::load16(src.as_ptr().add(i)));
            i += 16;
        }
    }
    for k in i..n {
        dst[k] = D::from_f32(src[k].to_f32());
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn convert256<S: Elem + V8, D: Elem + V8>(src: &[S], dst: &mut [D]) {
    let n = src.len();
    let mut i = 0;
    unsafe {
        while i + 8 <= n {
            D::store8(dst.as_mut_ptr().add(i), S::load8(src.as_ptr().add(i)));
            i += 8;
        }
    }
    for k in i..n {
        dst[k] = D::from_f32(src[k].to_f32());
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,avx2,fma")]
pub(super) unsafe fn unscale512<S: Elem + V16>(raw: &[S], out: &mut [f32], inv: f32, acc: bool) -> bool {
    let n = raw.len();
    let mut i = 0;
    let mut bad: __mmask16 = 0;
    unsafe {
        let vinv = _mm512_set1_ps(inv);
        while i + 16 <= n {
            let g = S::load16(raw.as_ptr().add(i));
            let mut v = _mm512_mul_ps(g, vinv);
            if acc {
                v = _mm512_add_ps(_mm512_loadu_ps(out.as_ptr().add(i)), v);
            }
            bad |= nonfinite16(g) | nonfinite16(v);
            _mm512_storeu_ps(out.as_mut_ptr().add(i), v);
            i += 16;
        }
    }
    let mut b = bad != 0;
    for k in i..n {
        let g = raw[k].to_f32();
        let v = if acc { out[k] + g * inv } else { g * inv };
        b |= !g.is_finite() | !v.is_finite();
        out[k] = v;
    }
    b
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn unscale256<S: Elem + V8>(raw: &[S], out: &mut [f32], inv: f32, acc: bool) -> bool {
    let n = raw.len();
    let mut i = 0;
    let mut bad = 0i32;
    unsafe {
        let vinv = _mm256_set1_ps(inv);
        while i + 8 <= n {
            let g = S::load8(raw.as_ptr().add(i));
            let mut v = _mm256_mul_ps(g, vinv);
            if acc {
                v = _mm256_add_ps(_mm256_loadu_ps(out.as_ptr().add(i)), v);
            }
            bad |= nonfinite8(g) | nonfinite8(v);
            _mm256_storeu_ps(out.as_mut_ptr().add(i), v);
            i += 8;
        }
    }
    let mut b = bad != 0;
    for k in i..n {
        let g = raw[k].to_f32();
        let v = if acc { out[k] + g * inv } else { g * inv };
        b |= !g.is_finite() | !v.is_finite();
        out[k] = v;
    }
    b
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,avx2,fma")]
pub(super) unsafe fn adamw512<P: Elem + V16, H: Elem + V16>(
    p: &mut [P],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    mut h: Option<&mut [H]>,
    c: &AdamWConsts,
) {
    let n = p.len();
    let mut i = 0;
    unsafe {
        let b1 = _mm512_set1_ps(c.b1);
        let ob1 = _mm512_set1_ps(c.one_minus_b1);
        let b2 = _mm512_set1_ps(c.b2);
        let ob2 = _mm512_set1_ps(c.one_minus_b2);
        let ib1 = _mm512_set1_ps(c.inv_bc1);
        let ib2 = _mm512_set1_ps(c.inv_bc2);
        let decay = _mm512_set1_ps(c.decay);
        let lr = _mm512_set1_ps(c.lr);
        let eps = _mm512_set1_ps(c.eps);
        while i + 16 <= n {
            let gv = _mm512_loadu_ps(g.as_ptr().add(i));
            let pv = P::load16(p.as_ptr().add(i));
            // The same operations, in the same order, as the scalar update (no FMA, so
            // the vector and portable paths agree bit for bit).
            let nm = _mm512_add_ps(
                _mm512_mul_ps(b1, _mm512_loadu_ps(m.as_ptr().add(i))),
                _mm512_mul_ps(ob1, gv),
            );
            let nv = _mm512_add_ps(
                _mm512_mul_ps(b2, _mm512_loadu_ps(v.as_ptr().add(i))),
                _mm512_mul_ps(ob2, _mm512_mul_ps(gv, gv)),
            );
            _mm512_storeu_ps(m.as_mut_ptr().add(i), nm);
            _mm512_storeu_ps(v.as_mut_ptr().add(i), nv);
            let mh = _mm512_mul_ps(nm, ib1);
            let vh = _mm512_mul_ps(nv, ib2);
            let upd = _mm512_mul_ps(_mm512_div_ps(mh, _mm512_add_ps(_mm512_sqrt_ps(vh), eps)), lr);
            let np = _mm512_sub_ps(_mm512_mul_ps(pv, decay), upd);
            P::store16(p.as_mut_ptr().add(i), np);
            if let Some(h) = h.as_deref_mut() {
                H::store16(h.as_mut_ptr().add(i), np);
            }
            i += 16;
        }
    }
    for k in i..n {
        let np = c.update(p[k].to_f32(), g[k], &mut m[k], &mut v[k]);
        p[k] = P::from_f32(np);
        if let Some(h) = h.as_deref_mut() {
            h[k] = H::from_f32(np);
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn adamw256<P: Elem + V8, H: Elem + V8>(
    p: &mut [P],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    mut h: Option<&mut [H]>,
    c: &AdamWConsts,
) {
    let n = p.len();
    let mut i = 0;
    unsafe {
        let b1 = _mm256_set1_ps(c.b1);
        let ob1 = _mm256_set1_ps(c.one_minus_b1);
        let b2 = _mm256_set1_ps(c.b2);
        let ob2 = _mm256_set1_ps(c.one_minus_b2);
        let ib1 = _mm256_set1_ps(c.inv_bc1);
        let ib2 = _mm256_set1_ps(c.inv_bc2);
        let decay = _mm256_set1_ps(c.decay);
        let lr = _mm256_set1_ps(c.lr);
        let eps = _mm256_set1_ps(c.eps);
        while i + 8 <= n {
            let gv = _mm256_loadu_ps(g.as_ptr().add(i));
            let pv = P::load8(p.as_ptr().add(i));
            let nm = _mm256_add_ps(
                _mm256_mul_ps(b1, _mm256_loadu_ps(m.as_ptr().add(i))),
                _mm256_mul_ps(ob1, gv),
            );
            let nv = _mm256_add_ps(
                _mm256_mul_ps(b2, _mm256_loadu_ps(v.as_ptr().add(i))),
                _mm256_mul_ps(ob2, _mm256_mul_ps(gv, gv)),
            );
            _mm256_storeu_ps(m.as_mut_ptr().add(i), nm);
            _mm256_storeu_ps(v.as_mut_ptr().add(i), nv);
            let mh = _mm256_mul_ps(nm, ib1);
            let vh = _mm256_mul_ps(nv, ib2);
            let upd = _mm256_mul_ps(_mm256_div_ps(mh, _mm256_add_ps(_mm256_sqrt_ps(vh), eps)), lr);
            let np = _mm256_sub_ps(_mm256_mul_ps(pv, decay), upd);
            P::store8(p.as_mut_ptr().add(i), np);
            if let Some(h) = h.as_deref_mut() {
                H::store8(h.as_mut_ptr().add(i), np);
            }
            i += 8;
        }
    }
    for k in i..n {
        let np = c.update(p[k].to_f32(), g[k], &mut m[k], &mut v[k]);
        p[k] = P::from_f32(np);
        if let Some(h) = h.as_deref_mut() {
            h[k] = H::from_f32(np);
        }
    }
}
