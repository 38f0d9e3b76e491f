//! Empty tensors off the CPU: the public ops run them on the host.
//!
//! candle's CUDA kernels launch one thread per element, and a launch over zero elements is a
//! grid of zero blocks, which the driver refuses (`CUDA_ERROR_INVALID_VALUE`): a cast, a
//! reduction, a comparison, a gather or a select of an empty tensor fails on a GPU where the
//! same op on the CPU gives an empty result (or the NaN mean of nothing). Allocating and
//! copying zero bytes works there, so an op whose inputs include an empty tensor on another
//! device takes its inputs to the CPU (differentiably: `to_device` has a backward), runs
//! there, and brings its result back. The values are the CPU's by construction, the cost is
//! the inputs' copies (nothing for the empty ones; a layer's weights for a layer on an empty
//! batch), and no non-empty op on a GPU changes. PyTorch's ops are defined on empty tensors
//! on every device; this is what keeps ours so on candle.

use std::cell::Cell;

use candle_core::{Device, Result, Tensor};

/// Runs `f` on host copies of `xs` and returns its result on their device, where some `xs`
/// is empty and some is off the CPU; `None` otherwise (the caller runs its op as usual).
///
/// `f` gets the tensors in the order given. It is the op itself, called again: inside the
/// host run this guard returns `None`, so the recursion ends there.
pub(crate) fn on_host(xs: &[&Tensor], f: impl FnOnce(&[Tensor]) -> Result<Tensor>) -> Option<Result<Tensor>> {
    let dev = applies(xs)?;
    Some(to_host(xs).and_then(|host| {
        let _inside = Inside::enter();
        f(&host)?.to_device(&dev)
    }))
}

/// [`on_host`] for an op with optional tensor arguments: `f` gets the host copies of
/// `required` and of `optional` (`Some` exactly where `optional` has one).
pub(crate) fn on_host_with(
    required: &[&Tensor],
    optional: &[Option<&Tensor>],
    f: impl FnOnce(&[Tensor], &[Option<Tensor>]) -> Result<Tensor>,
) -> Option<Result<Tensor>> {
    let mut all: Vec<&Tensor> = required.to_vec();
    all.extend(optional.iter().flatten());
    on_host(&all, |host| {
        let (req, rest) = host.split_at(required.len());
        let mut rest = rest.iter();
        let opt: Vec<Option<Tensor>> = optional.iter().map(|o| o.and_then(|_| rest.next().cloned())).collect();
        f(req, &opt)
    })
}

thread_local! {
    /// Whether this thread is inside a host run of an op (nested ops run as they are).
    static INSIDE: Cell<bool> = const { Cell::new(false) };
    /// Tests: whether the CPU counts as "another device" here (see [`emulate_device`]).
    static EMULATE: Cell<bool> = const { Cell::new(false) };
}

/// Marks this thread as inside a host run until dropped.
pub(crate) struct Inside(bool);

impl Inside {
    pub(crate) fn enter() -> Self {
        Inside(INSIDE.with(|i| i.replace(true)))
    }
}

impl Drop for Inside {
    fn drop(&mut self) {
        INSIDE.with(|i| i.set(self.0));
    }
}

/// Tests: makes the guard take CPU tensors through the same host run on this thread (its
/// copies are CPU copies), so CI checks the guards' argument plumbing without a GPU.
pub(crate) fn emulate_device(on: bool) {
    EMULATE.with(|e| e.set(on));
}

/// The device to bring a result back to where [`on_host`] applies to `xs`: some is empty
/// and some is off the CPU (that one's device), and no host run is open on this thread.
pub(crate) fn applies(xs: &[&Tensor]) -> Option<Device> {
    if INSIDE.with(|i| i.get()) {
        return None;
    }
    let off_cpu = |d: &Device| !d.is_cpu() || EMULATE.with(|e| e.get());
    let dev = xs.iter().map(|t| t.device()).find(|d| off_cpu(d))?.clone();
    xs.iter().any(|t| t.elem_count() == 0).then_some(dev)
}

/// Host copies of `xs` (differentiable: their gradients return to `xs`' devices).
pub(crate) fn to_host(xs: &[&Tensor]) -> Result<Vec<Tensor>> {
    xs.iter().map(|t| t.to_device(&Device::Cpu)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    #[test]
    fn the_cpu_runs_its_ops_itself() {
        let e = Tensor::zeros((0, 3), DType::F32, &Device::Cpu).unwrap();
        assert!(on_host(&[&e], |_| unreachable!()).is_none());
        assert!(on_host_with(&[&e], &[None], |_, _| unreachable!()).is_none());
    }

    #[test]
    fn an_empty_input_off_the_cpu_runs_once_on_host_copies() {
        let e = Tensor::zeros((0, 3), DType::F32, &Device::Cpu).unwrap();
        let x = Tensor::ones(3, DType::F32, &Device::Cpu).unwrap();
        emulate_device(true);
        // Nothing empty: the op runs as it is.
        assert!(on_host(&[&x], |_| unreachable!()).is_none());
        let mut calls = 0;
        let r = on_host_with(&[&e], &[None, Some(&x)], |t, o| {
            calls += 1;
            // Nested ops inside the host run run as they are.
            assert!(applies(&[&t[0]]).is_none());
            assert!(o[0].is_none());
            t[0].broadcast_add(o[1].as_ref().unwrap())
        });
        emulate_device(false);
        assert_eq!(calls, 1);
        assert_eq!(r.unwrap().unwrap().dims(), [0, 3]);
        assert!(applies(&[&e]).is_none());
    }
}
