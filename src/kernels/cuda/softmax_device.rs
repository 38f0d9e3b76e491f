//! The kernels of `softmax.cu` on a candle CUDA device: compiled by NVRTC, loaded into
//! candle's context, applied as custom ops whose backward is the backward kernel.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{CpuStorage, CudaStorage, CustomOp1, CustomOp2, DType, Device, Layout, Result, Shape, Tensor};

use super::{Pass, SOURCE, plan};
use crate::kernels::cuda::buffers::{alloc, config, no_kernel, push_in, push_out, view, wrap};
use crate::kernels::cuda::nvrtc::Kernels;

/// The kernels of `softmax.cu`: NVRTC's PTX and the module loaded per device.
static KERNELS: Kernels = Kernels::new(
    "candle_amp_softmax",
    SOURCE,
    "amp_softmax_fwd_w2_f32_f32",
    "softmax",
    "attention's softmax runs",
);

/// Whether the kernels are loaded on `dev` (see [`Kernels::available`]).
pub(crate) fn available(dev: &CudaDevice) -> bool {
    KERNELS.available(dev)
}

/// Rows, columns and queries per matrix of a layout (its last two dimensions).
fn rows_cols(l: &Layout) -> (usize, usize, usize) {
    let dims = l.shape().dims();
    let cols = dims.last().copied().unwrap_or(1);
    let q = if dims.len() >= 2 { dims[dims.len() - 2] } else { 1 };
    (l.shape().elem_count() / cols.max(1), cols, q)
}

/// The forward: `softmax(x * scale)` over the last dimension, causal if asked, into `out`.
struct Forward {
    scale: f32,
    causal: bool,
    out: DType,
}

impl CustomOp1 for Forward {
    fn name(&self) -> &'static str {
        "amp-cuda-scaled-softmax"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        // Only ever applied to CUDA tensors (see `scaled_softmax`).
        candle_core::bail!("amp-cuda-scaled-softmax: a CUDA op applied to a CPU tensor")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let what = self.name();
        let (rows, cols, q_len) = rows_cols(l);
        let launch = plan(Pass::Forward, rows, cols, s.dtype(), self.out).ok_or_else(|| no_kernel(what, l))?;
        let dev = s.device().clone();
        let ptx = KERNELS.ptx(&dev).map_err(candle_core::Error::Msg)?;
        let func = dev.get_or_load_custom_func(&launch.kernel, KERNELS.module, &ptx)?;
        let x = view(s, l, what)?;
        let y = alloc(&dev, self.out, rows * cols, what)?;
        // The kernels' 32-bit arguments (`plan` checked that they fit).
        let (rows_i, cols_i, q_i) = (rows as i32, cols as i32, q_len as i32);
        let causal = i32::from(self.causal);
        // No padding lengths: a null `lens` pointer and its unused row count.
        let (no_lens, rows_per_len) = (0u64, 1i32);
        let mut b = func.builder();
        push_in(&mut b, &x);
        push_out(&mut b, &y);
        b.arg(&rows_i)
            .arg(&cols_i)
            .arg(&q_i)
            .arg(&self.scale)
            .arg(&causal)
            .arg(&no_lens)
            .arg(&rows_per_len);
        // SAFETY: the arguments match `AMP_FWD_ARGS` in order and type; `x` holds rows * cols
        // values of the kernel's input type and `y` as many of its output type.
        unsafe { b.launch(config(launch.grid, launch.block)) }.w()?;
        drop(b);
        Ok((wrap(y, dev), l.shape().clone()))
    }

    /// The backward kernel on the output alone, in the input's type.
    fn bwd(&self, arg: &Tensor, res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(grad(res, grad_res, self.scale, arg.dtype())?))
    }
}

/// The backward: `dx = scale * y * (dy - rowsum(dy * y))`, `y` and `dy` of one type.
struct Backward {
    scale: f32,
    out: DType,
}

impl CustomOp2 for Backward {
    fn name(&self) -> &'static str {
        "amp-cuda-softmax-grad"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("amp-cuda-softmax-grad: a CUDA op applied to CPU tensors")
    }

    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        let what = self.name();
        if l1.shape() != l2.shape() || s1.dtype() != s2.dtype() {
            candle_core::bail!(
                "{what}: y {:?} {:?} and dy {:?} {:?}",
                l1.shape(),
                s1.dtype(),
                l2.shape(),
                s2.dtype()
            );
        }
        let (rows, cols, _) = rows_cols(l1);
        let launch = plan(Pass::Backward, rows, cols, s1.dtype(), self.out).ok_or_else(|| no_kernel(what, l1))?;
        let dev = s1.device().clone();
        let ptx = KERNELS.ptx(&dev).map_err(candle_core::Error::Msg)?;
        let func = dev.get_or_load_custom_func(&launch.kernel, KERNELS.module, &ptx)?;
        let (y, dy) = (view(s1, l1, what)?, view(s2, l2, what)?);
        let dx = alloc(&dev, self.out, rows * cols, what)?;
        let (rows_i, cols_i) = (rows as i32, cols as i32);
        let mut b = func.builder();
        push_in(&mut b, &y);
        push_in(&mut b, &dy);
        push_out(&mut b, &dx);
        b.arg(&rows_i).arg(&cols_i).arg(&self.scale);
        // SAFETY: the arguments match `AMP_BWD_ARGS`; `y`, `dy` and `dx` hold rows * cols values.
        unsafe { b.launch(config(launch.grid, launch.block)) }.w()?;
        drop(b);
        Ok((wrap(dx, dev), l1.shape().clone()))
    }
}

/// The softmax's input gradient from its output `res` and the output's gradient, in `out`.
fn grad(res: &Tensor, grad_res: &Tensor, scale: f32, out: DType) -> Result<Tensor> {
    // One type for both (they share one when candle hands the output's gradient back).
    let (y, dy) = if res.dtype() == grad_res.dtype() {
        (crate::kernels::dense(res)?, crate::kernels::dense(grad_res)?)
    } else {
        (res.to_dtype(DType::F32)?, grad_res.to_dtype(DType::F32)?)
    };
    y.detach().apply_op2_no_bwd(&dy.detach(), &Backward { scale, out })
}

/// [`crate::kernels::scaled_softmax`] on a CUDA device: `Ok(None)` where the kernels do not
/// apply (another device, another type, an empty or oversized tensor, kernels that failed to
/// load), and the caller runs the composed ops. Differentiable.
pub(crate) fn scaled_softmax(x: &Tensor, scale: f64, causal: bool, out: DType) -> Result<Option<Tensor>> {
    let Device::Cuda(dev) = x.device() else {
        return Ok(None);
    };
    let cols = x.dims().last().copied().unwrap_or(0);
    let rows = x.elem_count() / cols.max(1);
    if plan(Pass::Forward, rows, cols, x.dtype(), out).is_none()
        || plan(Pass::Backward, rows, cols, out, x.dtype()).is_none()
        || !available(dev)
    {
        return Ok(None);
    }
    let op = Forward {
        scale: scale as f32,
        causal,
        out,
    };
    Ok(Some(crate::kernels::dense(x)?.apply_op1(op)?))
}
