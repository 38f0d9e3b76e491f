//! A content fingerprint of a tensor's data.
//!
//! `Var::set` writes new values into a tensor's storage and keeps its id, so a cache of
//! casts keyed on ids alone would serve casts of old values. The autocast cache stores this
//! fingerprint with each cast and checks it on every hit. It is a 64-bit multiply-rotate
//! hash over four independent lanes (reading memory is the cost, not the arithmetic); a
//! changed tensor matching the old fingerprint by accident has probability about 2^-64.

use candle_core::{CpuStorage, Storage, Tensor};

const K: [u64; 4] = [
    0x9E37_79B9_7F4A_7C15,
    0xC2B2_AE3D_27D4_EB4F,
    0x1656_67B1_9E37_79F9,
    0x85EB_CA77_C2B2_AE63,
];

fn mix(h: u64, v: u64, k: u64) -> u64 {
    (h ^ v).wrapping_mul(k).rotate_left(29)
}

fn hash_words(words: &[u32]) -> u64 {
    let mut h = K;
    let mut chunks = words.chunks_exact(8);
    for c in &mut chunks {
        for lane in 0..4 {
            let v = c[2 * lane] as u64 | (c[2 * lane + 1] as u64) << 32;
            h[lane] = mix(h[lane], v, K[lane]);
        }
    }
    let mut t = (words.len() as u64).wrapping_mul(K[0]);
    for (i, w) in chunks.remainder().iter().enumerate() {
        t = mix(t, *w as u64 | (i as u64) << 32, K[1]);
    }
    h.iter().fold(t, |acc, &x| mix(acc, x, K[2]))
}

/// The fingerprint of an f32 CPU tensor's data, or `None` where it cannot be read cheaply
/// (other types and devices: such tensors are not cached).
pub(crate) fn fingerprint(t: &Tensor) -> Option<u64> {
    let (storage, layout) = t.storage_and_layout();
    let (a, b) = layout.contiguous_offsets()?;
    match &*storage {
        Storage::Cpu(CpuStorage::F32(v)) => {
            let shape = t.dims().iter().fold(0u64, |h, &d| mix(h, d as u64, K[3]));
            Some(hash_words(as_bits(&v[a..b])) ^ shape)
        }
        _ => None,
    }
}

/// The f32 values' bit patterns.
fn as_bits(v: &[f32]) -> &[u32] {
    // SAFETY: f32 and u32 have the same size and alignment, and every bit pattern is a u32.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u32, v.len()) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn an_in_place_write_changes_the_fingerprint() {
        let v = Var::from_vec((0..37).map(|i| i as f32).collect::<Vec<_>>(), 37, &Device::Cpu).unwrap();
        let a = fingerprint(v.as_tensor()).unwrap();
        assert_eq!(fingerprint(v.as_tensor()), Some(a), "stable");
        for i in [0usize, 20, 36] {
            let mut x: Vec<f32> = (0..37).map(|i| i as f32).collect();
            x[i] += 1.0;
            v.set(&Tensor::from_vec(x, 37, &Device::Cpu).unwrap()).unwrap();
            assert_ne!(fingerprint(v.as_tensor()), Some(a), "element {i} changed");
        }
        let h = v.as_tensor().to_dtype(candle_core::DType::F16).unwrap();
        assert_eq!(fingerprint(&h), None, "only f32 is fingerprinted");
    }
}
