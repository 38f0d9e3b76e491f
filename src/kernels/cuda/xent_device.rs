//! The kernels of `xent.cu` on a candle CUDA device: compiled by NVRTC, loaded into candle's
//! context, applied as a custom op that keeps each row's maximum and sum for its backward.

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchArgs, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, CudaStorageSlice, WrapErr};
use candle_core::{CpuStorage, CudaStorage, CustomOp2, CustomOp3, DType, Device, Layout, Result, Shape, Tensor};
use half::{bf16, f16};

use super::{SOURCE, xent_plan};
use crate::kernels::cuda::buffers::{alloc, config, no_kernel, offsets, push_in, push_out, view, wrap};
use crate::kernels::cuda::nvrtc::Kernels;

/// The kernels of `xent.cu`: NVRTC's PTX and the module loaded per device.
static KERNELS: Kernels = Kernels::new(
    "candle_amp_xent",
    SOURCE,
    "amp_xent_fwd_f32_u32",
    "cross-entropy",
    "cross_entropy runs",
);

/// Whether the kernels are loaded on `dev` (see [`Kernels::available`]).
pub(crate) fn available(dev: &CudaDevice) -> bool {
    KERNELS.available(dev)
}

/// The contiguous targets as the view a kernel reads.
enum Targets<'a> {
    U8(CudaView<'a, u8>),
    U32(CudaView<'a, u32>),
    I64(CudaView<'a, i64>),
}

fn targets<'a>(s: &'a CudaStorage, l: &Layout, rows: usize, what: &str) -> Result<Targets<'a>> {
    let (a, b) = offsets(l, what)?;
    if b - a != rows {
        candle_core::bail!("{what}: {} targets for {rows} rows", b - a)
    }
    Ok(match &s.slice {
        CudaStorageSlice::U8(x) => Targets::U8(x.slice(a..b)),
        CudaStorageSlice::U32(x) => Targets::U32(x.slice(a..b)),
        CudaStorageSlice::I64(x) => Targets::I64(x.slice(a..b)),
        _ => candle_core::bail!("{what}: {:?} targets", s.dtype()),
    })
}

fn push_targets<'a>(b: &mut LaunchArgs<'a>, t: &'a Targets<'_>) {
    match t {
        Targets::U8(x) => b.arg(x),
        Targets::U32(x) => b.arg(x),
        Targets::I64(x) => b.arg(x),
    };
}

/// Rows and columns of a layout (the last dimension is the row).
fn rows_cols(l: &Layout) -> (usize, usize) {
    let cols = l.shape().dims().last().copied().unwrap_or(1);
    (l.shape().elem_count() / cols.max(1), cols)
}

/// Each row's maximum and sum of exponentials, interleaved (2 f32 values per row).
type Stats = Arc<CudaSlice<f32>>;

/// The forward over `(logits (rows, cols), targets (rows,))`: the mean loss, f32, shape `()`.
struct Forward {
    /// Set by `cuda_fwd` and read by `bwd`.
    stats: Mutex<Option<Stats>>,
}

impl CustomOp2 for Forward {
    fn name(&self) -> &'static str {
        "amp-cuda-cross-entropy"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        // Only ever applied to CUDA tensors (see `cross_entropy`).
        candle_core::bail!("amp-cuda-cross-entropy: a CUDA op applied to CPU tensors")
    }

    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        let what = self.name();
        let (rows, cols) = rows_cols(l1);
        let plan = xent_plan(rows, cols, s1.dtype(), s2.dtype()).ok_or_else(|| no_kernel(what, l1))?;
        let dev = s1.device().clone();
        let ptx = KERNELS.ptx(&dev).map_err(candle_core::Error::Msg)?;
        let fwd = dev.get_or_load_custom_func(&plan.forward.kernel, KERNELS.module, &ptx)?;
        let mean = dev.get_or_load_custom_func(&plan.mean.kernel, KERNELS.module, &ptx)?;
        let x = view(s1, l1, what)?;
        let t = targets(s2, l2, rows, what)?;
        // SAFETY: the forward writes every row's log-probability, maximum and sum (thread 0
        // of each row's block), the mean kernel the loss, before anything reads them.
        let logp = unsafe { dev.alloc::<f32>(rows) }?;
        let stats = unsafe { dev.alloc::<f32>(2 * rows) }?;
        let loss = unsafe { dev.alloc::<f32>(1) }?;
        let (rows_i, cols_i) = (rows as i32, cols as i32);
        let mut b = fwd.builder();
        push_in(&mut b, &x);
        push_targets(&mut b, &t);
        b.arg(&logp).arg(&stats).arg(&rows_i).arg(&cols_i);
        // SAFETY: the arguments match `AMP_XENT_FWD_ARGS` in order and type; x holds
        // rows * cols logits, targets rows values, logp rows and stats 2 * rows f32 values.
        unsafe { b.launch(config(plan.forward.grid, plan.forward.block)) }.w()?;
        drop(b);
        // The mean as the composed path takes it: the sum times -1/rows rounded to f32.
        let scale = (-1.0 / rows as f64) as f32;
        let mut b = mean.builder();
        b.arg(&logp).arg(&loss).arg(&rows_i).arg(&scale);
        // SAFETY: the arguments match `AMP_XENT_MEAN_ARGS`; logp holds rows values, loss one.
        unsafe { b.launch(config(plan.mean.grid, plan.mean.block)) }.w()?;
        drop(b);
        *self.stats.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(stats));
        Ok((CudaStorage::wrap_cuda_slice(loss, dev), Shape::from(())))
    }

    fn bwd(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let stats = self
            .stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| candle_core::Error::Msg("amp-cuda-cross-entropy: backward before the forward".into()))?;
        let g = crate::kernels::dense(&g.to_dtype(DType::F32)?.reshape(1)?)?;
        let dx = logits
            .detach()
            .apply_op3_no_bwd(&targets.detach(), &g, &Grad { stats })?;
        Ok((Some(dx), None))
    }
}

/// `dlogits` from `(logits, targets, g)` and the forward's statistics, in the logits' type.
struct Grad {
    stats: Stats,
}

impl CustomOp3 for Grad {
    fn name(&self) -> &'static str {
        "amp-cuda-cross-entropy-grad"
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
        candle_core::bail!("amp-cuda-cross-entropy-grad: a CUDA op applied to CPU tensors")
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
        let (rows, cols) = rows_cols(l1);
        let plan = xent_plan(rows, cols, s1.dtype(), s2.dtype()).ok_or_else(|| no_kernel(what, l1))?;
        if self.stats.len() != 2 * rows {
            candle_core::bail!("{what}: statistics of {} values for {rows} rows", self.stats.len());
        }
        let dev = s1.device().clone();
        let ptx = KERNELS.ptx(&dev).map_err(candle_core::Error::Msg)?;
        let func = dev.get_or_load_custom_func(&plan.backward.kernel, KERNELS.module, &ptx)?;
        let x = view(s1, l1, what)?;
        let t = targets(s2, l2, rows, what)?;
        let (a, b) = offsets(l3, what)?;
        if b - a != 1 {
            candle_core::bail!("{what}: a loss gradient of {} values", b - a)
        }
        let g = s3.as_cuda_slice::<f32>()?.slice(a..b);
        let n = rows * cols;
        // SAFETY: the backward writes every value of every row (the grid covers every row,
        // each block's loop every column).
        let dx = match s1.dtype() {
            DType::F32 => CudaStorageSlice::F32(unsafe { dev.alloc::<f32>(n) }?),
            DType::F16 => CudaStorageSlice::F16(unsafe { dev.alloc::<f16>(n) }?),
            DType::BF16 => CudaStorageSlice::BF16(unsafe { dev.alloc::<bf16>(n) }?),
            other => candle_core::bail!("{what}: {other:?} logits"),
        };
        let (rows_i, cols_i) = (rows as i32, cols as i32);
        let inv_rows = (1.0 / rows as f64) as f32;
        let mut bld = func.builder();
        push_in(&mut bld, &x);
        push_targets(&mut bld, &t);
        bld.arg(self.stats.as_ref()).arg(&g);
        match &dx {
            CudaStorageSlice::F32(d) => bld.arg(d),
            CudaStorageSlice::F16(d) => bld.arg(d),
            CudaStorageSlice::BF16(d) => bld.arg(d),
            _ => unreachable!("allocated as one of the three above"),
        };
        bld.arg(&rows_i).arg(&cols_i).arg(&inv_rows);
        // SAFETY: the arguments match `AMP_XENT_BWD_ARGS` in order and type; x and dx hold
        // rows * cols values of the logits' type, targets rows, stats 2 * rows, g one.
        unsafe { bld.launch(config(plan.backward.grid, plan.backward.block)) }.w()?;
        drop(bld);
        let storage = match dx {
            CudaStorageSlice::F32(d) => CudaStorage::wrap_cuda_slice(d, dev),
            CudaStorageSlice::F16(d) => CudaStorage::wrap_cuda_slice(d, dev),
            CudaStorageSlice::BF16(d) => CudaStorage::wrap_cuda_slice(d, dev),
            _ => unreachable!("allocated as one of the three above"),
        };
        Ok((storage, l1.shape().clone()))
    }
}

/// [`crate::ops::cross_entropy`] on a CUDA device for logits `(..., C)` as the autocast
/// policy left them and integer targets `(...)`: `Ok(None)` where the kernels do not apply
/// (another device, logits or targets of another type or device, a count of targets that does
/// not match the rows, an empty or oversized tensor, kernels that failed to load), and the
/// caller runs the composed ops. Differentiable in the logits.
pub(crate) fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Option<Tensor>> {
    let Device::Cuda(dev) = logits.device() else {
        return Ok(None);
    };
    let Some(&cols) = logits.dims().last() else {
        return Ok(None);
    };
    let rows = logits.elem_count() / cols.max(1);
    if targets.elem_count() != rows
        || !targets.device().same_device(logits.device())
        || xent_plan(rows, cols, logits.dtype(), targets.dtype()).is_none()
        || !available(dev)
    {
        return Ok(None);
    }
    let x = crate::kernels::dense(&logits.reshape((rows, cols))?)?;
    let t = crate::kernels::dense(&targets.flatten_all()?)?;
    let op = Forward {
        stats: Mutex::new(None),
    };
    Ok(Some(if x.track_op() {
        x.apply_op2(&t, op)?
    } else {
        x.apply_op2_no_bwd(&t, &op)?
    }))
}

/// One chunk of the chunked LM head (`kernels::lm_head_chunked`): from its logits
/// `(rows, cols)` and targets `(rows,)`, each row's log-probability at its target (f32, 0 for
/// an ignored row) and the logits' gradient `(softmax - onehot) * inv_n` in the logits' type,
/// in one launch of `amp_xent_rows_{t}_{i}`. Errors where no kernel applies (the caller checks
/// [`xent_plan`] and [`available`] first).
pub(crate) fn rows_logp_grad(
    x: &CudaStorage,
    lx: &Layout,
    t: &CudaStorage,
    lt: &Layout,
    inv_n: f32,
) -> Result<(CudaStorage, CudaStorage)> {
    let what = "amp-chunked-linear-xent";
    let (rows, cols) = rows_cols(lx);
    let plan = xent_plan(rows, cols, x.dtype(), t.dtype()).ok_or_else(|| no_kernel(what, lx))?;
    let dev = x.device().clone();
    let ptx = KERNELS.ptx(&dev).map_err(candle_core::Error::Msg)?;
    let func = dev.get_or_load_custom_func(&plan.rows.kernel, KERNELS.module, &ptx)?;
    let xv = view(x, lx, what)?;
    let tv = targets(t, lt, rows, what)?;
    // SAFETY: thread 0 of each row's block writes its log-probability; the grid covers every
    // row and each block's loop every column of dx.
    let logp = unsafe { dev.alloc::<f32>(rows) }?;
    let dx = alloc(&dev, x.dtype(), rows * cols, what)?;
    let (rows_i, cols_i) = (rows as i32, cols as i32);
    let mut b = func.builder();
    push_in(&mut b, &xv);
    push_targets(&mut b, &tv);
    b.arg(&logp);
    push_out(&mut b, &dx);
    b.arg(&rows_i).arg(&cols_i).arg(&inv_n);
    // SAFETY: the arguments match `AMP_XENT_ROWS_ARGS` in order and type; x and dx hold
    // rows * cols values of the logits' type, targets and logp rows values.
    unsafe { b.launch(config(plan.rows.grid, plan.rows.block)) }.w()?;
    drop(b);
    Ok((CudaStorage::wrap_cuda_slice(logp, dev.clone()), wrap(dx, dev)))
}
