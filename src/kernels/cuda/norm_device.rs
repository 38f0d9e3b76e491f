//! The kernels of `norm.cu` on a candle CUDA device: compiled by NVRTC, loaded into candle's
//! context, applied as a custom op that keeps the rows' statistics for its backward.

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{CpuStorage, CudaStorage, CustomOp2, CustomOp3, DType, Device, Layout, Result, Shape, Tensor};

use super::{SOURCE, norm_plan};
use crate::kernels::cuda::buffers::{alloc, config, no_kernel, offsets, push_in, push_out, view, wrap};
use crate::kernels::cuda::nvrtc::Kernels;

/// The kernels of `norm.cu`: NVRTC's PTX and the module loaded per device.
static KERNELS: Kernels = Kernels::new(
    "candle_amp_norm",
    SOURCE,
    "amp_norm_fwd_f32",
    "norm",
    "layer and RMS norms run",
);

/// Whether the kernels are loaded on `dev` (see [`Kernels::available`]).
pub(crate) fn available(dev: &CudaDevice) -> bool {
    KERNELS.available(dev)
}

/// A contiguous f32 parameter of exactly `n` values.
fn param<'a>(s: &'a CudaStorage, l: &Layout, n: usize, what: &str) -> Result<CudaView<'a, f32>> {
    let (a, b) = offsets(l, what)?;
    if b - a != n {
        candle_core::bail!("{what}: a parameter of {} values for rows of {n}", b - a)
    }
    Ok(s.as_cuda_slice::<f32>()?.slice(a..b))
}

/// Rows and columns of a layout (the last dimension is the row).
fn rows_cols(l: &Layout) -> (usize, usize) {
    let cols = l.shape().dims().last().copied().unwrap_or(1);
    (l.shape().elem_count() / cols.max(1), cols)
}

/// The rows' statistics: `rows` means, then `rows` reciprocal standard deviations (f32).
type Stats = Arc<CudaSlice<f32>>;

/// The forward over `(x, w, b)` (`w`, `b` f32 of one value per column): `y` in x's type.
struct Forward {
    eps: f32,
    center: bool,
    /// Set by `cuda_fwd` and read by `bwd`.
    stats: Mutex<Option<Stats>>,
}

impl CustomOp3 for Forward {
    fn name(&self) -> &'static str {
        "amp-cuda-norm"
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
        // Only ever applied to CUDA tensors (see `norm`).
        candle_core::bail!("amp-cuda-norm: a CUDA op applied to CPU tensors")
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
        let plan = norm_plan(rows, cols, s1.dtype()).ok_or_else(|| no_kernel(what, l1))?;
        let dev = s1.device().clone();
        let ptx = KERNELS.ptx(&dev).map_err(candle_core::Error::Msg)?;
        let func = dev.get_or_load_custom_func(&plan.forward.kernel, KERNELS.module, &ptx)?;
        let x = view(s1, l1, what)?;
        let (w, b) = (param(s2, l2, cols, what)?, param(s3, l3, cols, what)?);
        let y = alloc(&dev, s1.dtype(), rows * cols, what)?;
        // SAFETY: the forward writes every row's mean and rstd.
        let stats = unsafe { dev.alloc::<f32>(2 * rows) }?;
        let (mean, rstd) = (stats.slice(0..rows), stats.slice(rows..2 * rows));
        let (rows_i, cols_i, center) = (rows as i32, cols as i32, i32::from(self.center));
        let mut bld = func.builder();
        push_in(&mut bld, &x);
        push_out(&mut bld, &y);
        bld.arg(&w)
            .arg(&b)
            .arg(&mean)
            .arg(&rstd)
            .arg(&rows_i)
            .arg(&cols_i)
            .arg(&self.eps)
            .arg(&center);
        // SAFETY: the arguments match `AMP_NORM_FWD_ARGS` in order and type; x and y hold
        // rows * cols values of x's type, w and b cols f32 values, mean and rstd rows each.
        unsafe { bld.launch(config(plan.forward.grid, plan.forward.block)) }.w()?;
        drop(bld);
        *self.stats.lock().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(stats));
        Ok((wrap(y, dev), l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let stats = self
            .stats
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or_else(|| candle_core::Error::Msg("amp-cuda-norm: backward before the forward".into()))?;
        let dy = crate::kernels::dense(&dy.to_dtype(x.dtype())?)?;
        // Only the gradients candle will use: of the tracked arguments (an absent parameter's
        // stand-in of ones or zeros is not tracked).
        let (want_w, want_b) = (w.track_op(), b.track_op());
        let dx = if x.track_op() {
            let g = GradX {
                center: self.center,
                stats: stats.clone(),
            };
            Some(x.detach().apply_op3_no_bwd(&w.detach(), &dy, &g)?)
        } else {
            None
        };
        let (mut dw, mut db) = (None, None);
        if want_w || want_b {
            let wb = x.detach().apply_op2_no_bwd(&dy, &GradWB { stats })?;
            if want_w {
                dw = Some(wb.get(0)?.reshape(w.shape())?);
            }
            if want_b {
                db = Some(wb.get(1)?.reshape(b.shape())?);
            }
        }
        Ok((dx, dw, db))
    }
}

/// `dx` from `(x, w, dy)` and the forward's statistics.
struct GradX {
    center: bool,
    stats: Stats,
}

impl CustomOp3 for GradX {
    fn name(&self) -> &'static str {
        "amp-cuda-norm-grad-x"
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
        candle_core::bail!("amp-cuda-norm-grad-x: a CUDA op applied to CPU tensors")
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
        if l1.shape() != l3.shape() || s1.dtype() != s3.dtype() {
            candle_core::bail!(
                "{what}: x {:?} {:?} and dy {:?} {:?}",
                l1.shape(),
                s1.dtype(),
                l3.shape(),
                s3.dtype()
            );
        }
        let (rows, cols) = rows_cols(l1);
        let plan = norm_plan(rows, cols, s1.dtype()).ok_or_else(|| no_kernel(what, l1))?;
        if self.stats.len() != 2 * rows {
            candle_core::bail!("{what}: statistics of {} values for {rows} rows", self.stats.len());
        }
        let dev = s1.device().clone();
        let ptx = KERNELS.ptx(&dev).map_err(candle_core::Error::Msg)?;
        let func = dev.get_or_load_custom_func(&plan.dx.kernel, KERNELS.module, &ptx)?;
        let (x, dy) = (view(s1, l1, what)?, view(s3, l3, what)?);
        let w = param(s2, l2, cols, what)?;
        let (mean, rstd) = (self.stats.slice(0..rows), self.stats.slice(rows..2 * rows));
        let dx = alloc(&dev, s1.dtype(), rows * cols, what)?;
        let (rows_i, cols_i, center) = (rows as i32, cols as i32, i32::from(self.center));
        let mut bld = func.builder();
        push_in(&mut bld, &x);
        push_in(&mut bld, &dy);
        bld.arg(&w).arg(&mean).arg(&rstd);
        push_out(&mut bld, &dx);
        bld.arg(&rows_i).arg(&cols_i).arg(&center);
        // SAFETY: the arguments match `AMP_NORM_DX_ARGS`; x, dy and dx hold rows * cols values
        // of one type, w cols f32 values, mean and rstd rows each.
        unsafe { bld.launch(config(plan.dx.grid, plan.dx.block)) }.w()?;
        drop(bld);
        Ok((wrap(dx, dev), l1.shape().clone()))
    }
}

/// `[Σ dy * x̂, Σ dy]` (f32, shape `(2, cols)`) from `(x, dy)` and the forward's statistics.
struct GradWB {
    stats: Stats,
}

impl CustomOp2 for GradWB {
    fn name(&self) -> &'static str {
        "amp-cuda-norm-grad-wb"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("amp-cuda-norm-grad-wb: a CUDA op applied to CPU tensors")
    }

    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        let what = self.name();
        if l1.shape() != l2.shape() || s1.dtype() != s2.dtype() {
            candle_core::bail!(
                "{what}: x {:?} {:?} and dy {:?} {:?}",
                l1.shape(),
                s1.dtype(),
                l2.shape(),
                s2.dtype()
            );
        }
        let (rows, cols) = rows_cols(l1);
        let plan = norm_plan(rows, cols, s1.dtype()).ok_or_else(|| no_kernel(what, l1))?;
        if self.stats.len() != 2 * rows {
            candle_core::bail!("{what}: statistics of {} values for {rows} rows", self.stats.len());
        }
        let dev = s1.device().clone();
        let ptx = KERNELS.ptx(&dev).map_err(candle_core::Error::Msg)?;
        let part_fn = dev.get_or_load_custom_func(&plan.wb_part.kernel, KERNELS.module, &ptx)?;
        let sum_fn = dev.get_or_load_custom_func(&plan.wb_sum.kernel, KERNELS.module, &ptx)?;
        let (x, dy) = (view(s1, l1, what)?, view(s2, l2, what)?);
        let (mean, rstd) = (self.stats.slice(0..rows), self.stats.slice(rows..2 * rows));
        // SAFETY: the partial kernel writes both sums of every column for every chunk, and the
        // sum kernel every one of the 2 * cols results.
        let part = unsafe { dev.alloc::<f32>(plan.chunks * 2 * cols) }?;
        let out = unsafe { dev.alloc::<f32>(2 * cols) }?;
        let (rows_i, cols_i) = (rows as i32, cols as i32);
        let (per_chunk, tiles, chunks) = (plan.rows_per_chunk as i32, plan.col_tiles as i32, plan.chunks as i32);
        let mut bld = part_fn.builder();
        push_in(&mut bld, &x);
        push_in(&mut bld, &dy);
        bld.arg(&mean)
            .arg(&rstd)
            .arg(&part)
            .arg(&rows_i)
            .arg(&cols_i)
            .arg(&per_chunk)
            .arg(&tiles);
        // SAFETY: the arguments match `AMP_NORM_PART_ARGS`; `part` holds chunks * 2 * cols f32.
        unsafe { bld.launch(config(plan.wb_part.grid, plan.wb_part.block)) }.w()?;
        drop(bld);
        let mut bld = sum_fn.builder();
        bld.arg(&part).arg(&out).arg(&cols_i).arg(&chunks);
        // SAFETY: the arguments match `AMP_NORM_SUM_ARGS`; `out` holds 2 * cols f32.
        unsafe { bld.launch(config(plan.wb_sum.grid, plan.wb_sum.block)) }.w()?;
        drop(bld);
        Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from((2, cols))))
    }
}

/// [`crate::kernels::layer_norm`] (`center`) or [`crate::kernels::rms_norm`] on a CUDA device:
/// `Ok(None)` where the kernels do not apply (another device, another type, parameters of
/// another length or device, an empty or oversized tensor, kernels that failed to load), and
/// the caller runs the composed ops. Differentiable; the parameters' gradients are computed in
/// f32 and come back in the parameters' own types.
pub(crate) fn norm(
    x: &Tensor,
    w: Option<&Tensor>,
    b: Option<&Tensor>,
    eps: f64,
    center: bool,
) -> Result<Option<Tensor>> {
    let Device::Cuda(dev) = x.device() else {
        return Ok(None);
    };
    let Some(&cols) = x.dims().last() else {
        return Ok(None);
    };
    let rows = x.elem_count() / cols.max(1);
    let fits = |p: Option<&Tensor>| {
        p.is_none_or(|p| {
            p.elem_count() == cols
                && p.device().same_device(x.device())
                && matches!(p.dtype(), DType::F32 | DType::F16 | DType::BF16)
        })
    };
    if !fits(w) || !fits(b) || norm_plan(rows, cols, x.dtype()).is_none() || !available(dev) {
        return Ok(None);
    }
    // f32 parameters (a cast of a half one is differentiable: its gradient comes back in its
    // type); an absent one is a constant that candle gives no gradient.
    let param = |p: Option<&Tensor>, fill: f64| -> Result<Tensor> {
        match p {
            Some(p) => crate::kernels::dense(&p.to_dtype(DType::F32)?),
            None => Tensor::full(fill as f32, cols, x.device()),
        }
    };
    let (w32, b32) = (param(w, 1.0)?, param(b, 0.0)?);
    let x = crate::kernels::dense(x)?;
    let op = Forward {
        eps: eps as f32,
        center,
        stats: Mutex::new(None),
    };
    let grad = x.track_op() || w32.track_op() || b32.track_op();
    Ok(Some(if grad {
        x.apply_op3(&w32, &b32, op)?
    } else {
        x.apply_op3_no_bwd(&w32, &b32, &op)?
    }))
}
