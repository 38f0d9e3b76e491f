//! The kernels of `flash.cu` on a candle CUDA device: compiled by NVRTC, loaded into candle's
//! context, applied as a custom op on `(q, k, v)` that keeps the rows' f32 log-sum-exp for its
//! backward, which runs the three backward kernels. On compute capability 8.0 and newer the
//! f16 and bf16 kernels are `flash_mma.cu`'s (tensor cores), a module of their own: where it
//! fails to load, the FMA kernels of `flash.cu` run instead.

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::CudaDevice;
use candle_core::cuda_backend::WrapErr;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, PushKernelArg};
use candle_core::{CpuStorage, CudaStorage, CustomOp3, Device, Layout, Result, Shape, Storage, Tensor};

use super::{FlashPlan, SOURCE, SOURCE_MMA, flash_plan};
use crate::kernels::cuda::buffers::{alloc, config, no_kernel, push_in, push_out, view, wrap};
use crate::kernels::cuda::nvrtc::Kernels;

/// The kernels of `flash.cu`: NVRTC's PTX and the module loaded per device.
static KERNELS: Kernels = Kernels::new(
    "candle_amp_flash",
    SOURCE,
    "amp_flash_fwd_f32_d64l",
    "attention",
    "attention runs",
);

/// The tensor-core kernels of `flash_mma.cu` (compute capability 8.0 and newer only).
static KERNELS_MMA: Kernels = Kernels::new(
    "candle_amp_flash_mma",
    SOURCE_MMA,
    "amp_flash_fwd_bf16_d64m",
    "tensor-core attention",
    "attention runs on the FMA kernels instead of tensor cores, not",
);

/// Whether the kernels are loaded on `dev` (see [`Kernels::available`]).
pub(crate) fn available(dev: &CudaDevice) -> bool {
    KERNELS.available(dev)
}

/// `None` where `dev` cannot run the tensor-core kernels (compute capability below 8.0, the
/// `mma` shape they use), else whether their module loaded (compiling and loading it if not
/// yet).
pub(crate) fn tensor_cores_loaded(dev: &CudaDevice) -> Option<bool> {
    let cc = dev.cuda_stream().context().compute_capability();
    matches!(cc, Ok((major, _)) if major >= 8).then(|| KERNELS_MMA.available(dev))
}

/// Whether `dev` runs the tensor-core kernels for f16 and bf16.
fn tensor_cores(dev: &CudaDevice) -> bool {
    tensor_cores_loaded(dev) == Some(true)
}

/// The module holding the plan's forward, dK/dV and dQ kernels.
fn module(plan: &FlashPlan) -> &'static Kernels {
    if plan.tensor_cores { &KERNELS_MMA } else { &KERNELS }
}

/// `(bh, t, d)` of a `(..., t, d)` shape: the matrices, their rows and the head dimension.
fn dims(s: &Shape) -> (usize, usize, usize) {
    let d = s.dims();
    let (t, hd) = match d {
        [.., t, hd] => (*t, *hd),
        _ => (0, 0),
    };
    (s.elem_count() / (t * hd).max(1), t, hd)
}

/// The plan for three operands of one shape and type, or an error naming `what`.
fn plan_for(what: &str, ss: [&CudaStorage; 3], ls: [&Layout; 3]) -> Result<FlashPlan> {
    if ls[1].shape() != ls[0].shape() || ls[2].shape() != ls[0].shape() || ss.iter().any(|s| s.dtype() != ss[0].dtype())
    {
        candle_core::bail!(
            "{what}: q {:?} {:?}, k {:?} {:?}, v {:?} {:?}",
            ls[0].shape(),
            ss[0].dtype(),
            ls[1].shape(),
            ss[1].dtype(),
            ls[2].shape(),
            ss[2].dtype()
        );
    }
    let (bh, t, d) = dims(ls[0].shape());
    flash_plan(bh, t, d, ss[0].dtype(), None, tensor_cores(ss[0].device())).ok_or_else(|| no_kernel(what, ls[0]))
}

/// The rows' log-sum-exp of the scaled scores (f32, one per query row of every matrix).
type Lse = Arc<CudaSlice<f32>>;

/// The forward: `softmax(q k^T * scale) v`, causal if asked, in the inputs' type.
struct Forward {
    scale: f32,
    causal: bool,
    /// Set by `cuda_fwd` and read by `bwd`.
    lse: Mutex<Option<Lse>>,
}

impl CustomOp3 for Forward {
    fn name(&self) -> &'static str {
        "amp-cuda-flash-attention"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        // Only ever applied to CUDA tensors (see `attention`).
        candle_core::bail!("amp-cuda-flash-attention: a CUDA op applied to CPU tensors")
    }

    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let what = self.name();
        let plan = plan_for(what, [s1, s2, s3], [l1, l2, l3])?;
        let (bh, t, d) = dims(l1.shape());
        let dev = s1.device().clone();
        let kernels = module(&plan);
        let ptx = kernels.ptx(&dev).map_err(candle_core::Error::Msg)?;
        let func = dev.get_or_load_custom_func(&plan.forward.kernel, kernels.module, &ptx)?;
        let (q, k, v) = (view(s1, l1, what)?, view(s2, l2, what)?, view(s3, l3, what)?);
        let o = alloc(&dev, s1.dtype(), bh * t * d, what)?;
        // SAFETY: the forward writes the LSE of every row of every matrix.
        let lse = unsafe { dev.alloc::<f32>(bh * t) }?;
        // The kernels' 32-bit arguments (`flash_plan` checked that they fit).
        let (bh_i, t_i, causal) = (bh as i32, t as i32, i32::from(self.causal));
        let mut b = func.builder();
        push_in(&mut b, &q);
        push_in(&mut b, &k);
        push_in(&mut b, &v);
        push_out(&mut b, &o);
        b.arg(&lse).arg(&bh_i).arg(&t_i).arg(&self.scale).arg(&causal);
        // SAFETY: the arguments match `AMP_FLASH_FWD_ARGS` in order and type; q, k, v and o
        // hold bh * t * d values of the kernel's type, lse bh * t f32 values.
        unsafe { b.launch(config(plan.forward.grid, plan.forward.block)) }.w()?;
        drop(b);
        *self.lse.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(lse));
        Ok((wrap(o, dev), l1.shape().clone()))
    }

    /// The backward kernels on `(q, k, v)`, the output and its gradient, recomputing the
    /// probabilities from the kept LSE: dq, dk, dv in the inputs' type.
    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let lse = self
            .lse
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| candle_core::Error::Msg("amp-cuda-flash-attention: backward before the forward".into()))?;
        let op = Backward {
            scale: self.scale,
            causal: self.causal,
            lse,
            o: crate::kernels::dense(res)?.detach(),
            dout: crate::kernels::dense(&grad_res.to_dtype(res.dtype())?)?.detach(),
        };
        let g = q.detach().apply_op3_no_bwd(&k.detach(), &v.detach(), &op)?;
        Ok((Some(g.get(0)?), Some(g.get(1)?), Some(g.get(2)?)))
    }
}

/// The backward over `(q, k, v)`: `[dq, dk, dv]` stacked (shape `(3, ..q's shape)`), from the
/// forward's output `o`, its gradient `dout` (both of q's type and shape, contiguous) and LSE.
struct Backward {
    scale: f32,
    causal: bool,
    lse: Lse,
    o: Tensor,
    dout: Tensor,
}

impl CustomOp3 for Backward {
    fn name(&self) -> &'static str {
        "amp-cuda-flash-attention-grad"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("amp-cuda-flash-attention-grad: a CUDA op applied to CPU tensors")
    }

    fn cuda_fwd(
        &self,
        s1: &CudaStorage,
        l1: &Layout,
        s2: &CudaStorage,
        l2: &Layout,
        s3: &CudaStorage,
        l3: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let what = self.name();
        let plan = plan_for(what, [s1, s2, s3], [l1, l2, l3])?;
        let (bh, t, d) = dims(l1.shape());
        if self.o.shape() != l1.shape()
            || self.dout.shape() != l1.shape()
            || self.o.dtype() != s1.dtype()
            || self.dout.dtype() != s1.dtype()
            || self.lse.len() != bh * t
        {
            candle_core::bail!(
                "{what}: o {:?} {:?}, dout {:?} {:?}, {} LSE values for q {:?} {:?}",
                self.o.shape(),
                self.o.dtype(),
                self.dout.shape(),
                self.dout.dtype(),
                self.lse.len(),
                l1.shape(),
                s1.dtype()
            );
        }
        // The output and its gradient are not operands of this op (three at most): their
        // storage is read here, under candle's read locks.
        let (so, lo) = self.o.storage_and_layout();
        let (sd, ld) = self.dout.storage_and_layout();
        let (Storage::Cuda(so), Storage::Cuda(sd)) = (&*so, &*sd) else {
            candle_core::bail!("{what}: the output or its gradient is not on a CUDA device")
        };
        let dev = s1.device().clone();
        let ptx = KERNELS.ptx(&dev).map_err(candle_core::Error::Msg)?;
        let pre_fn = dev.get_or_load_custom_func(&plan.pre.kernel, KERNELS.module, &ptx)?;
        let kernels = module(&plan);
        let ptx = kernels.ptx(&dev).map_err(candle_core::Error::Msg)?;
        let dkv_fn = dev.get_or_load_custom_func(&plan.dkv.kernel, kernels.module, &ptx)?;
        let dq_fn = dev.get_or_load_custom_func(&plan.dq.kernel, kernels.module, &ptx)?;
        let (q, k, v) = (view(s1, l1, what)?, view(s2, l2, what)?, view(s3, l3, what)?);
        let (o, dout) = (view(so, lo, what)?, view(sd, ld, what)?);
        let rows = bh * t;
        // SAFETY: the Delta kernel writes every row's value.
        let delta = unsafe { dev.alloc::<f32>(rows) }?;
        // dq, dk, dv one after the other; the dK/dV pass writes every key row of the last two
        // thirds, the dQ pass every query row of the first.
        let out = alloc(&dev, s1.dtype(), 3 * rows * d, what)?;
        let (rows_i, bh_i, t_i, causal) = (rows as i32, bh as i32, t as i32, i32::from(self.causal));
        let lse: &CudaSlice<f32> = &self.lse;
        let mut b = pre_fn.builder();
        push_in(&mut b, &o);
        push_in(&mut b, &dout);
        b.arg(&delta).arg(&rows_i);
        // SAFETY: the arguments match `AMP_FLASH_PRE_ARGS`; o and dout hold rows * d values of
        // the kernel's type, delta rows f32 values.
        unsafe { b.launch(config(plan.pre.grid, plan.pre.block)) }.w()?;
        drop(b);
        for (l, func) in [(&plan.dkv, &dkv_fn), (&plan.dq, &dq_fn)] {
            let mut b = func.builder();
            push_in(&mut b, &q);
            push_in(&mut b, &k);
            push_in(&mut b, &v);
            push_in(&mut b, &dout);
            b.arg(lse).arg(&delta);
            push_out(&mut b, &out);
            b.arg(&bh_i).arg(&t_i).arg(&self.scale).arg(&causal);
            // SAFETY: the arguments match `AMP_FLASH_BWD_ARGS`; q, k, v and dout hold rows * d
            // values of the kernel's type, lse and delta rows f32 values, out 3 * rows * d.
            unsafe { b.launch(config(l.grid, l.block)) }.w()?;
        }
        let mut shape = vec![3];
        shape.extend_from_slice(l1.shape().dims());
        Ok((wrap(out, dev), Shape::from(shape)))
    }
}

/// Whether [`attention`] runs the kernels for `(q, k, v)`: on a CUDA device, one float type
/// and one shape `(..., t, d)` for the three, a head dimension with kernels, sizes that fit
/// their arguments (not empty), kernels that loaded.
pub(crate) fn applies(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    let Device::Cuda(dev) = q.device() else {
        return false;
    };
    let same = |x: &Tensor| x.dtype() == q.dtype() && x.shape() == q.shape() && x.device().same_device(q.device());
    if q.rank() < 2 || !same(k) || !same(v) {
        return false;
    }
    let (bh, t, d) = dims(q.shape());
    flash_plan(bh, t, d, q.dtype(), None, false).is_some() && available(dev)
}

/// `softmax(q k^T * scale) v` (causal if asked) on a CUDA device: `Ok(None)` where the kernels
/// do not apply (see [`applies`]), and the caller runs the composed ops. Differentiable: the
/// gradients come back in the inputs' type.
pub(crate) fn attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, causal: bool) -> Result<Option<Tensor>> {
    if !applies(q, k, v) {
        return Ok(None);
    }
    let (q, k, v) = (
        crate::kernels::dense(q)?,
        crate::kernels::dense(k)?,
        crate::kernels::dense(v)?,
    );
    let op = Forward {
        scale: scale as f32,
        causal,
        lse: Mutex::new(None),
    };
    Ok(Some(if q.track_op() || k.track_op() || v.track_op() {
        q.apply_op3(&k, &v, op)?
    } else {
        q.apply_op3_no_bwd(&k, &v, &op)?
    }))
}
