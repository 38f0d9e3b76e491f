//! Gradients in f32 before they are rounded to half precision, kept for the numerics doctor.
//!
//! A product of half tensors accumulates in f32 and is rounded once to the half type: a
//! weight gradient of 1e-9 becomes an exact 0 in f16, and nothing after the rounding can
//! tell it from a true zero. While a capture is open on the thread (the guard opens one for
//! a backward the doctor records), the backward of [`super::linear`] and [`super::matmul`]
//! keeps the f32 value of each half gradient it makes for an input, keyed by that input's
//! tensor id (summed when an input is used twice), and [`super::cast`]'s backward hands a
//! kept gradient on from the cast's output to its input, so a parameter cast per forward (O1)
//! finds its own. Closed (always, unless the doctor records this step), each hook is one
//! thread-local read.

use std::cell::RefCell;
use std::collections::HashMap;

use candle_core::{DType, Result, Tensor, TensorId};

thread_local! {
    static CAPTURE: RefCell<Option<HashMap<TensorId, Tensor>>> = const { RefCell::new(None) };
}

/// Whether a capture is open on this thread.
pub(crate) fn active() -> bool {
    CAPTURE.with(|c| c.borrow().is_some())
}

/// An open capture; dropping it closes the capture (what it kept is lost unless
/// [`take`](Self::take)n).
#[derive(Debug)]
pub(crate) struct Capture(());

impl Capture {
    /// Opens a capture on this thread (replacing one left open).
    pub(crate) fn open() -> Capture {
        CAPTURE.with(|c| *c.borrow_mut() = Some(HashMap::new()));
        Capture(())
    }

    /// What was kept so far (the capture stays open, empty).
    pub(crate) fn take(&self) -> HashMap<TensorId, Tensor> {
        CAPTURE.with(|c| c.borrow_mut().as_mut().map(std::mem::take).unwrap_or_default())
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        CAPTURE.with(|c| *c.borrow_mut() = None);
    }
}

/// Keeps `f32` (the f32 value of the gradient of `of`, before rounding), adding it to what is
/// kept for `of` already. A no-op without an open capture.
pub(crate) fn keep(of: &Tensor, f32: &Tensor) -> Result<()> {
    if f32.dtype() != DType::F32 {
        return Ok(());
    }
    CAPTURE.with(|c| {
        let mut c = c.borrow_mut();
        let Some(map) = c.as_mut() else {
            return Ok(());
        };
        let v = match map.remove(&of.id()) {
            Some(old) if old.shape() == f32.shape() => (old + f32)?,
            _ => f32.detach(),
        };
        map.insert(of.id(), v);
        Ok(())
    })
}

/// Moves what is kept for `from` to `to` (a cast's output to its input).
pub(crate) fn hand_on(from: &Tensor, to: &Tensor) -> Result<()> {
    CAPTURE.with(|c| {
        let mut c = c.borrow_mut();
        let Some(map) = c.as_mut() else {
            return Ok(());
        };
        if let Some(v) = map.remove(&from.id()) {
            let v = match map.remove(&to.id()) {
                Some(old) if old.shape() == v.shape() => (old + v)?,
                _ => v,
            };
            map.insert(to.id(), v);
        }
        Ok(())
    })
}
