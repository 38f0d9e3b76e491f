//! In-place, one-pass optimizer updates on the CPU: what the fused optimizers share.
//!
//! A fused step updates each parameter's f32 values (the master at O2, the model's own Var
//! at O0/O1) in place, reading its gradient and updating the optimizer's own f32 state
//! buffers in the same pass, then writes the half working copy (O2) with
//! [`crate::kernels::cast_into`]. At O3, where no f32 value exists, the half parameter itself
//! is read, updated in f32 and written back. Everything is checked before anything is written,
//! so a step is all or nothing.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, InplaceOp2, Layout, Tensor};
use half::{bf16, f16};

use super::ParamUpdate;
use crate::error::Result;
use crate::precision::autocast::invalidate;

/// The parameter values a fused kernel updates.
pub(crate) enum Target<'s> {
    /// f32 values (master or f32 working Var).
    F32(&'s mut [f32]),
    /// A half parameter without an f32 master (O3).
    F16(&'s mut [f16]),
    /// A half parameter without an f32 master (O3).
    Bf16(&'s mut [bf16]),
}

type Kernel<'a> = Box<dyn FnOnce(Target<'_>, &[f32]) + Send + 'a>;

/// An in-place op running one kernel over (parameter, gradient).
struct InPlace<'a> {
    kernel: Mutex<Option<Kernel<'a>>>,
}

impl InplaceOp2 for InPlace<'_> {
    fn name(&self) -> &'static str {
        "amp-fused-step"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, dl: &Layout, src: &CpuStorage, sl: &Layout) -> candle_core::Result<()> {
        let msg = || candle_core::Error::Msg("amp-fused-step: tensors must be contiguous".into());
        let (da, db) = dl.contiguous_offsets().ok_or_else(msg)?;
        let (sa, sb) = sl.contiguous_offsets().ok_or_else(msg)?;
        let CpuStorage::F32(g) = src else {
            candle_core::bail!("amp-fused-step: the gradient must be f32, got {:?}", src.dtype())
        };
        let t = match dst {
            CpuStorage::F32(v) => Target::F32(&mut v[da..db]),
            CpuStorage::F16(v) => Target::F16(&mut v[da..db]),
            CpuStorage::BF16(v) => Target::Bf16(&mut v[da..db]),
            other => candle_core::bail!("amp-fused-step: {:?} parameter", other.dtype()),
        };
        if sb - sa != db - da {
            candle_core::bail!("amp-fused-step: {} gradient values for {} parameters", sb - sa, db - da)
        }
        let k = self.kernel.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(k) = k {
            k(t, &g[sa..sb]);
        }
        Ok(())
    }
}

fn contiguous_cpu(t: &Tensor) -> bool {
    t.device().is_cpu() && t.is_contiguous()
}

/// Whether every parameter can take the fused CPU path: f32 gradients, and an f32 Var (or a
/// half working Var at O3), all contiguous on the CPU.
pub(crate) fn fusable(params: &[ParamUpdate<'_>]) -> bool {
    // Under `kernels::plain` (and the forced device path) the tensor-op path runs.
    crate::kernels::enabled()
        && params.iter().all(|p| {
            let grad_ok = contiguous_cpu(p.grad) && p.grad.dtype() == DType::F32 && p.grad.dims() == p.var.dims();
            let target_ok = if p.persistent {
                contiguous_cpu(p.var) && p.var.dtype() == DType::F32
            } else {
                p.working
                    .is_some_and(|w| contiguous_cpu(w) && matches!(w.dtype(), DType::F16 | DType::BF16))
            };
            let working_ok = p.working.is_none_or(|w| {
                contiguous_cpu(w)
                    && w.elem_count() == p.var.elem_count()
                    && matches!(w.dtype(), DType::F16 | DType::BF16 | DType::F32)
            });
            grad_ok && target_ok && working_ok
        })
}

/// Runs `kernel` over one parameter in place (checked by [`fusable`]), then writes the half
/// working copy from the updated f32 values where there is one. Both are invalidated in
/// autocast's cast caches.
pub(crate) fn apply<'a>(p: &ParamUpdate<'_>, kernel: impl FnOnce(Target<'_>, &[f32]) + Send + 'a) -> Result<()> {
    let op = InPlace {
        kernel: Mutex::new(Some(Box::new(kernel))),
    };
    let target = if p.persistent {
        p.var.as_tensor()
    } else {
        p.working.expect("checked by fusable").as_tensor()
    };
    let updated = target.inplace_op2(p.grad, &op);
    // The values changed in place under the same tensor ids: autocast's cached casts of
    // them must not be served again (bumped even on an error, which may follow a write).
    invalidate(target);
    updated?;
    if p.persistent
        && let Some(w) = p.working
    {
        let copied = crate::kernels::cast_into(p.var.as_tensor(), w.as_tensor());
        invalidate(w);
        copied?;
    }
    Ok(())
}

/// Invalidates the cached casts of every parameter (and working copy) of a step: what an
/// optimizer calls after a step that wrote them other than through [`apply`].
pub(crate) fn invalidate_all_of(params: &[ParamUpdate<'_>]) {
    for p in params {
        invalidate(p.var);
        if let Some(w) = p.working {
            invalidate(w);
        }
    }
}

/// One optimizer buffer: f32 values on the host (what the fused CPU passes write in place),
/// or a tensor on the parameter's device (the tensor-op path, which replaces it each step:
/// no host round trip off the CPU). Each converts to the other the first time the other
/// path needs it.
#[derive(Debug, Clone)]
pub(crate) enum Buf {
    /// Host values, row-major.
    Host(Vec<f32>),
    /// A detached f32 tensor of the parameter's shape.
    Device(Tensor),
}

impl Buf {
    /// A tensor-path buffer kept from `t`, a new value of `p`'s state: f32, detached, and in
    /// storage of its own. A value computed from the step's inputs can be one of them (SGD's
    /// first momentum is the gradient itself), and the master gradient is written in place
    /// by the next backward: kept as it is, the state would change with it.
    pub(crate) fn kept(t: &Tensor, p: &ParamUpdate<'_>) -> Result<Self> {
        let mut inputs = vec![p.grad, p.var.as_tensor()];
        inputs.extend(p.working.map(|w| w.as_tensor()));
        Ok(Buf::Device(crate::kernels::apart_from(
            &t.to_dtype(DType::F32)?,
            &inputs,
        )?))
    }

    /// The host values, read from the device first if they are there.
    pub(crate) fn host_mut(&mut self) -> Result<&mut Vec<f32>> {
        if let Buf::Device(t) = self {
            *self = Buf::Host(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?);
        }
        match self {
            Buf::Host(v) => Ok(v),
            Buf::Device(_) => unreachable!("converted above"),
        }
    }

    /// The values as a tensor of `shape` on `dev` (uploaded the first time).
    pub(crate) fn tensor(&mut self, shape: &[usize], dev: &candle_core::Device) -> Result<Tensor> {
        match self {
            Buf::Device(t) if t.device().same_device(dev) => Ok(t.clone()),
            Buf::Device(t) => {
                let t = t.to_device(dev)?;
                *self = Buf::Device(t.clone());
                Ok(t)
            }
            Buf::Host(v) => {
                let t = Tensor::from_slice(v, shape, dev)?;
                *self = Buf::Device(t.clone());
                Ok(t)
            }
        }
    }

    /// The values, borrowed from the host or copied from the device.
    pub(crate) fn values(&self) -> Result<std::borrow::Cow<'_, [f32]>> {
        Ok(match self {
            Buf::Host(v) => std::borrow::Cow::Borrowed(&v[..]),
            Buf::Device(t) => std::borrow::Cow::Owned(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?),
        })
    }
}

/// One parameter's state in buffers the optimizer owns.
#[derive(Debug, Clone)]
pub(crate) struct Slots {
    /// Steps applied.
    pub step: u64,
    /// The parameter's shape.
    pub shape: Vec<usize>,
    /// The named f32 buffers, each with the parameter's element count.
    pub bufs: Vec<(&'static str, Buf)>,
}

impl Slots {
    /// Zeroed buffers for a parameter of `shape`.
    pub(crate) fn zeros(shape: &[usize], names: &[&'static str]) -> Self {
        let n: usize = shape.iter().product();
        Self {
            step: 0,
            shape: shape.to_vec(),
            bufs: names.iter().map(|k| (*k, Buf::Host(vec![0f32; n]))).collect(),
        }
    }

    /// The buffers as tensors: copies of host values, the device tensors themselves (the
    /// tensor path replaces rather than writes them, so sharing is a snapshot too).
    pub(crate) fn to_state(&self) -> Result<super::ParamState> {
        let mut buffers = std::collections::BTreeMap::new();
        for (k, b) in &self.bufs {
            let t = match b {
                Buf::Host(v) => Tensor::from_slice(v, self.shape.as_slice(), &candle_core::Device::Cpu)?,
                Buf::Device(t) => t.clone(),
            };
            buffers.insert(k.to_string(), t);
        }
        Ok(super::ParamState {
            step: self.step,
            buffers,
        })
    }

    /// Buffers from saved tensors (`names` required, each of the same shape): host values
    /// for tensors on the CPU, kept on their device otherwise.
    pub(crate) fn from_state(ps: &super::ParamState, names: &[&'static str], param: &str) -> Result<Self> {
        let mut bufs = Vec::new();
        let mut shape = None;
        for k in names {
            let t = ps
                .buffers
                .get(*k)
                .ok_or_else(|| crate::AmpError::OptimizerState(format!("parameter `{param}` has no `{k}` buffer")))?;
            shape = Some(t.dims().to_vec());
            let b = if t.device().is_cpu() {
                Buf::Host(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
            } else {
                // Owned storage: the caller keeps the saved state (a snapshot) it loaded from.
                Buf::Device(crate::kernels::apart_from(&t.to_dtype(DType::F32)?, &[t])?)
            };
            bufs.push((*k, b));
        }
        Ok(Self {
            step: ps.step,
            shape: shape.unwrap_or_default(),
            bufs,
        })
    }
}
