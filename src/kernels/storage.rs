//! Which tensors share storage.
//!
//! candle's `Tensor::clone`, `detach`, a contiguous `reshape` and `to_dtype` to the type a
//! tensor already has all return a tensor over its source's storage. A buffer the library
//! writes in place (a master gradient, an optimizer's state, a parameter) must share it
//! with nothing else that is kept, or the write changes the other tensor too: these helpers
//! let the places that keep a tensor make sure it is theirs.

use candle_core::{Storage, Tensor};

use crate::error::Result;

/// A key for `t`'s storage: two tensors have equal keys exactly when they share one storage
/// (the address of the storage behind its lock, as candle's own crate-private key). For
/// tests that check that no two live buffers of a run share storage.
#[doc(hidden)]
pub fn storage_key(t: &Tensor) -> usize {
    // The read guard goes at once: holding it while the storage is written would deadlock.
    let (s, _) = t.storage_and_layout();
    std::ptr::from_ref::<Storage>(&s).addr()
}

/// Whether `a` and `b` share storage.
pub(crate) fn same_storage(a: &Tensor, b: &Tensor) -> bool {
    storage_key(a) == storage_key(b)
}

/// `t`, detached, in storage shared with none of `others`: `t` itself where it shares
/// none, a copy otherwise (what a buffer kept across steps is made of, so that writing in
/// place into one of `others` cannot change it, nor it them).
pub(crate) fn apart_from(t: &Tensor, others: &[&Tensor]) -> Result<Tensor> {
    let t = t.detach();
    if others.iter().any(|o| same_storage(&t, o)) {
        return Ok(t.copy()?.detach());
    }
    Ok(t)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn clones_detaches_and_same_type_casts_share_storage_and_copies_do_not() {
        let a = Tensor::new(&[1f32, 2., 3.], &Device::Cpu).unwrap();
        assert!(same_storage(&a, &a.clone()));
        assert!(same_storage(&a, &a.detach()));
        assert!(same_storage(&a, &a.to_dtype(DType::F32).unwrap()));
        assert!(!same_storage(&a, &a.copy().unwrap()));
        assert!(!same_storage(&a, &(&a * 1.0).unwrap()));
        let apart = apart_from(&a.clone(), &[&a]).unwrap();
        assert!(!same_storage(&a, &apart));
        assert_eq!(apart.to_vec1::<f32>().unwrap(), [1., 2., 3.]);
        let fresh = (&a + 1.0).unwrap();
        assert!(
            same_storage(&apart_from(&fresh, &[&a]).unwrap(), &fresh),
            "no copy when apart"
        );
    }
}
