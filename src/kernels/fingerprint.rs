//! A cheap sampled fingerprint of a tensor's data: the autocast cache's check against
//! writers it is not told about.
//!
//! `Var::set` writes new values into a tensor's storage and keeps its id (and its storage
//! pointer), so a cache of casts keyed on ids alone would serve casts of old values. Every
//! write this crate makes to a parameter bumps the parameter's write generation (see
//! `precision::autocast::invalidate`), which is what the cache relies on. For writers it does
//! not see (a user's own `Var::set`, a candle optimizer) the cache also compares this
//! fingerprint: a hash of [`SAMPLES`] values spread evenly over the data (the first and the
//! last included), of the element count and of the shape. It reads a few cache lines, not
//! the tensor, so a lookup costs the same for any size. It catches a rewrite of all (or most)
//! values; it can miss a change confined to values it does not sample. Such writers must
//! call `autocast::invalidate` (or `invalidate_all`).

use candle_core::{CpuStorage, Storage, Tensor};

/// How many values the fingerprint reads (all of them for smaller tensors).
pub(crate) const SAMPLES: usize = 64;

const K: [u64; 3] = [0x9E37_79B9_7F4A_7C15, 0xC2B2_AE3D_27D4_EB4F, 0x1656_67B1_9E37_79F9];

fn mix(h: u64, v: u64, k: u64) -> u64 {
    (h ^ v).wrapping_mul(k).rotate_left(29)
}

/// The index of sample `j` of `SAMPLES` in `n > SAMPLES` values: evenly spread, from the
/// first value to the last.
fn position(j: usize, n: usize) -> usize {
    j * (n - 1) / (SAMPLES - 1)
}

/// The hash of the sampled values' bit patterns and of the count.
fn hash_samples(v: &[f32]) -> u64 {
    let n = v.len();
    let h = mix(0, n as u64, K[0]);
    if n <= SAMPLES {
        return v.iter().fold(h, |h, x| mix(h, x.to_bits() as u64, K[1]));
    }
    (0..SAMPLES).fold(h, |h, j| mix(h, v[position(j, n)].to_bits() as u64, K[1]))
}

/// The sampled fingerprint of a contiguous f32 CPU tensor's data, or `None` where it cannot
/// be read cheaply (other types and devices, strided views: such tensors are not cached).
pub(crate) fn sampled_fingerprint(t: &Tensor) -> Option<u64> {
    let (storage, layout) = t.storage_and_layout();
    let (a, b) = layout.contiguous_offsets()?;
    match &*storage {
        Storage::Cpu(CpuStorage::F32(v)) => {
            let shape = t.dims().iter().fold(0u64, |h, &d| mix(h, d as u64, K[2]));
            Some(hash_samples(&v[a..b]) ^ shape)
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn var(x: Vec<f32>) -> Var {
        let n = x.len();
        Var::from_vec(x, n, &Device::Cpu).unwrap()
    }

    #[test]
    fn a_rewrite_changes_the_fingerprint() {
        let v = var((0..37).map(|i| i as f32).collect());
        let a = sampled_fingerprint(v.as_tensor()).unwrap();
        assert_eq!(sampled_fingerprint(v.as_tensor()), Some(a), "stable");
        // Small tensors are read whole: any single change shows.
        for i in [0usize, 20, 36] {
            let mut x: Vec<f32> = (0..37).map(|i| i as f32).collect();
            x[i] += 1.0;
            v.set(&Tensor::from_vec(x, 37, &Device::Cpu).unwrap()).unwrap();
            assert_ne!(sampled_fingerprint(v.as_tensor()), Some(a), "element {i} changed");
        }
        let h = v.as_tensor().to_dtype(candle_core::DType::F16).unwrap();
        assert_eq!(sampled_fingerprint(&h), None, "only f32 is fingerprinted");
    }

    #[test]
    fn large_tensors_are_sampled_first_and_last_included() {
        let n = 100_003;
        let base: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let v = var(base.clone());
        let a = sampled_fingerprint(v.as_tensor()).unwrap();
        for i in [0, n - 1, position(17, n)] {
            let mut x = base.clone();
            x[i] = -1.0;
            v.set(&Tensor::from_vec(x, n, &Device::Cpu).unwrap()).unwrap();
            assert_ne!(sampled_fingerprint(v.as_tensor()), Some(a), "sampled element {i}");
        }
        let reshaped = v.as_tensor().reshape((1, n)).unwrap();
        assert_ne!(
            sampled_fingerprint(&reshaped),
            sampled_fingerprint(v.as_tensor()),
            "the shape is part of it"
        );
    }
}
