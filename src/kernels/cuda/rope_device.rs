//! The kernels of `rope.cu` on a candle CUDA device: compiled by NVRTC, loaded into candle's
//! context, applied as a custom op on `x` that holds the tables and whose backward is the
//! backward kernel.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{CpuStorage, CudaStorage, CustomOp1, DType, Device, Layout, Result, Shape, Storage, Tensor};

use super::{RopePass, SOURCE, rope_plan};
use crate::kernels::cuda::buffers::{View, alloc, config, no_kernel, push_in, push_out, view, wrap};
use crate::kernels::cuda::nvrtc::Kernels;
use crate::kernels::dense;

/// The kernels of `rope.cu`: NVRTC's PTX and the module loaded per device.
static KERNELS: Kernels = Kernels::new(
    "candle_amp_rope",
    SOURCE,
    "amp_rope_halves_fwd_f32",
    "rotary embedding",
    "the rotary embedding runs",
);

/// Whether the kernels are loaded on `dev` (see [`Kernels::available`]).
pub(crate) fn available(dev: &CudaDevice) -> bool {
    KERNELS.available(dev)
}

/// The rotation of `x` (the op's operand) by the tables it holds, one way or the other.
struct Rope {
    /// f32 `(t or more, w)`, contiguous, on x's device, tracking no gradient.
    cos: Tensor,
    sin: Tensor,
    pass: RopePass,
}

impl CustomOp1 for Rope {
    fn name(&self) -> &'static str {
        match self.pass {
            RopePass::Forward => "amp-cuda-rope",
            RopePass::Backward => "amp-cuda-rope-grad",
        }
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        // Only ever applied to CUDA tensors (see `rope`).
        candle_core::bail!("{}: a CUDA op applied to a CPU tensor", self.name())
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let what = self.name();
        let (b, h, t, d) = l.shape().dims4()?;
        let (ct, w) = self.cos.dims2()?;
        if self.sin.dims() != self.cos.dims() || ct < t {
            candle_core::bail!(
                "{what}: tables {:?} and {:?} for {t} positions",
                self.cos.dims(),
                self.sin.dims()
            );
        }
        let rows = b * h * t;
        let plan = rope_plan(self.pass, rows, t, d, w, s.dtype()).ok_or_else(|| no_kernel(what, l))?;
        // The tables are not operands of this op (one only): their storage is read here,
        // under candle's read locks.
        let (sc, lc) = self.cos.storage_and_layout();
        let (ss, ls) = self.sin.storage_and_layout();
        let (Storage::Cuda(sc), Storage::Cuda(ss)) = (&*sc, &*ss) else {
            candle_core::bail!("{what}: the tables are not on a CUDA device")
        };
        let (View::F32(cos), View::F32(sin)) = (view(sc, lc, what)?, view(ss, ls, what)?) else {
            candle_core::bail!("{what}: the tables must be f32")
        };
        let dev = s.device().clone();
        let ptx = KERNELS.ptx(&dev).map_err(candle_core::Error::Msg)?;
        let func = dev.get_or_load_custom_func(&plan.kernel, KERNELS.module, &ptx)?;
        let x = view(s, l, what)?;
        let y = alloc(&dev, s.dtype(), rows * d, what)?;
        // The kernels' 32-bit arguments (`rope_plan` checked that rows * d fits).
        let (rows_i, t_i, d_i) = (rows as i32, t as i32, d as i32);
        let mut bld = func.builder();
        push_in(&mut bld, &x);
        bld.arg(&cos).arg(&sin);
        push_out(&mut bld, &y);
        bld.arg(&rows_i).arg(&t_i).arg(&d_i);
        // SAFETY: the arguments match `AMP_ROPE_ARGS` in order and type; `x` and `y` hold
        // rows * d values of the kernel's type, the tables at least t * w f32 values each; the
        // grid-stride loop covers every pair of every row.
        unsafe { bld.launch(config(plan.grid, plan.block)) }.w()?;
        drop(bld);
        Ok((wrap(y, dev), l.shape().clone()))
    }

    /// The transposed rotation of the output's gradient, in `x`'s type.
    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let g = if grad_res.dtype() == arg.dtype() {
            grad_res.clone()
        } else {
            grad_res.to_dtype(arg.dtype())?
        };
        let op = Rope {
            cos: self.cos.clone(),
            sin: self.sin.clone(),
            pass: RopePass::Backward,
        };
        Ok(Some(dense(&g)?.detach().apply_op1_no_bwd(&op)?))
    }
}

/// [`super::rope`] on a CUDA device.
pub(crate) fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Option<Tensor>> {
    let Device::Cuda(dev) = x.device() else {
        return Ok(None);
    };
    let (Ok((b, h, t, d)), Ok((ct, w))) = (x.dims4(), cos.dims2()) else {
        return Ok(None);
    };
    let table = |c: &Tensor| c.dtype() == DType::F32 && c.device().same_device(x.device()) && !c.track_op();
    if !table(cos)
        || !table(sin)
        || sin.dims() != cos.dims()
        || ct < t
        || rope_plan(RopePass::Forward, b * h * t, t, d, w, x.dtype()).is_none()
        || !available(dev)
    {
        return Ok(None);
    }
    let op = Rope {
        cos: dense(cos)?,
        sin: dense(sin)?,
        pass: RopePass::Forward,
    };
    let x = dense(x)?;
    Ok(Some(if x.track_op() {
        x.apply_op1(op)?
    } else {
        x.apply_op1_no_bwd(&op)?
    }))
}
