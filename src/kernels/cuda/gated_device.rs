//! The kernels of `gated.cu` on a candle CUDA device: compiled by NVRTC, loaded into candle's
//! context, applied as custom ops whose backwards are the backward kernels.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp2, CustomOp3, DType, Device, Layout, Result, Shape, Tensor,
};

use super::{PointAct, SOURCE, act_plan, gated_plan};
use crate::kernels::cuda::buffers::{Out, alloc, config, expect_len, no_kernel, push_in, push_out, stored, view, wrap};
use crate::kernels::cuda::nvrtc::Kernels;
use crate::kernels::dense;

/// The kernels of `gated.cu`: NVRTC's PTX and the module loaded per device.
static KERNELS: Kernels = Kernels::new(
    "candle_amp_gated",
    SOURCE,
    "amp_act_fwd_relu_f32",
    "pointwise (gated product, activation)",
    "gated products and activations run",
);

/// Whether the kernels are loaded on `dev` (see [`Kernels::available`]).
pub(crate) fn available(dev: &CudaDevice) -> bool {
    KERNELS.available(dev)
}

/// The forward over `(g, u)`: `act(g) * u`, the activation rounded to `a`, the product in `p`.
struct Gated {
    act: PointAct,
    a: DType,
    p: DType,
}

impl CustomOp2 for Gated {
    fn name(&self) -> &'static str {
        "amp-cuda-gated"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        // Only ever applied to CUDA tensors (see `gated_product`).
        candle_core::bail!("amp-cuda-gated: a CUDA op applied to CPU tensors")
    }

    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        let what = self.name();
        let n = l1.shape().elem_count();
        expect_len(l2, n, what)?;
        if s1.dtype() != s2.dtype() {
            candle_core::bail!("{what}: g {:?} and u {:?}", s1.dtype(), s2.dtype())
        }
        let plan = gated_plan(n, self.act, s1.dtype(), self.a, self.p).ok_or_else(|| no_kernel(what, l1))?;
        let dev = s1.device().clone();
        let ptx = KERNELS.ptx(&dev).map_err(candle_core::Error::Msg)?;
        let func = dev.get_or_load_custom_func(&plan.forward.kernel, KERNELS.module, &ptx)?;
        let (g, u) = (view(s1, l1, what)?, view(s2, l2, what)?);
        let y = alloc(&dev, self.p, n, what)?;
        let len = n as i64;
        let mut b = func.builder();
        push_in(&mut b, &g);
        push_in(&mut b, &u);
        push_out(&mut b, &y);
        b.arg(&len);
        // SAFETY: the arguments match `AMP_GATED_FWD_ARGS` in order and type; g, u and y hold
        // n values of their types; the grid-stride loop covers every value.
        unsafe { b.launch(config(plan.forward.grid, plan.forward.block)) }.w()?;
        drop(b);
        Ok((wrap(y, dev), l1.shape().clone()))
    }

    fn bwd(&self, g: &Tensor, u: &Tensor, _res: &Tensor, dy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dy = dense(&dy.to_dtype(self.p)?)?;
        let op = GradGated {
            act: self.act,
            a: self.a,
            p: self.p,
            du: Mutex::new(None),
        };
        let dg = g.detach().apply_op3_no_bwd(&u.detach(), &dy.detach(), &op)?;
        let du = match op.du.into_inner().unwrap_or_else(|e| e.into_inner()) {
            Some(o) if u.track_op() => Some(stored(u, o)?),
            _ => None,
        };
        Ok((g.track_op().then_some(dg), du))
    }
}

/// The backward over `(g, u, dy)`: `dg` in g's type; `du` (u's type) computed by the same
/// launch and kept for [`stored`].
struct GradGated {
    act: PointAct,
    a: DType,
    p: DType,
    du: Mutex<Option<Out>>,
}

impl CustomOp3 for GradGated {
    fn name(&self) -> &'static str {
        "amp-cuda-gated-grad"
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
        candle_core::bail!("amp-cuda-gated-grad: a CUDA op applied to CPU tensors")
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
        let n = l1.shape().elem_count();
        expect_len(l2, n, what)?;
        expect_len(l3, n, what)?;
        if s1.dtype() != s2.dtype() || s3.dtype() != self.p {
            candle_core::bail!("{what}: g {:?}, u {:?}, dy {:?}", s1.dtype(), s2.dtype(), s3.dtype())
        }
        let t = s1.dtype();
        let plan = gated_plan(n, self.act, t, self.a, self.p).ok_or_else(|| no_kernel(what, l1))?;
        let dev = s1.device().clone();
        let ptx = KERNELS.ptx(&dev).map_err(candle_core::Error::Msg)?;
        let func = dev.get_or_load_custom_func(&plan.backward.kernel, KERNELS.module, &ptx)?;
        let (g, u, dy) = (view(s1, l1, what)?, view(s2, l2, what)?, view(s3, l3, what)?);
        let dg = alloc(&dev, t, n, what)?;
        let du = alloc(&dev, t, n, what)?;
        let len = n as i64;
        let mut b = func.builder();
        push_in(&mut b, &g);
        push_in(&mut b, &u);
        push_in(&mut b, &dy);
        push_out(&mut b, &dg);
        push_out(&mut b, &du);
        b.arg(&len);
        // SAFETY: the arguments match `AMP_GATED_BWD_ARGS`; every buffer holds n values of its
        // type; the grid-stride loop writes every value of dg and du.
        unsafe { b.launch(config(plan.backward.grid, plan.backward.block)) }.w()?;
        drop(b);
        *self.du.lock().unwrap_or_else(|e| e.into_inner()) = Some(du);
        Ok((wrap(dg, dev), l1.shape().clone()))
    }
}

/// The forward over `x`: `act(x)` in x's type.
struct Act(PointAct);

impl CustomOp1 for Act {
    fn name(&self) -> &'static str {
        "amp-cuda-act"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        // Only ever applied to CUDA tensors (see `activation`).
        candle_core::bail!("amp-cuda-act: a CUDA op applied to a CPU tensor")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let what = self.name();
        let n = l.shape().elem_count();
        let plan = act_plan(n, self.0, s.dtype()).ok_or_else(|| no_kernel(what, l))?;
        let dev = s.device().clone();
        let ptx = KERNELS.ptx(&dev).map_err(candle_core::Error::Msg)?;
        let func = dev.get_or_load_custom_func(&plan.forward.kernel, KERNELS.module, &ptx)?;
        let x = view(s, l, what)?;
        let y = alloc(&dev, s.dtype(), n, what)?;
        let len = n as i64;
        let mut b = func.builder();
        push_in(&mut b, &x);
        push_out(&mut b, &y);
        b.arg(&len);
        // SAFETY: the arguments match `AMP_ACT_FWD_ARGS`; x and y hold n values of x's type.
        unsafe { b.launch(config(plan.forward.grid, plan.forward.block)) }.w()?;
        drop(b);
        Ok((wrap(y, dev), l.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _res: &Tensor, dy: &Tensor) -> Result<Option<Tensor>> {
        let dy = dense(&dy.to_dtype(x.dtype())?)?;
        Ok(Some(x.detach().apply_op2_no_bwd(&dy.detach(), &GradAct(self.0))?))
    }
}

/// The backward over `(x, dy)`: `dy * act'(x)` in x's type.
struct GradAct(PointAct);

impl CustomOp2 for GradAct {
    fn name(&self) -> &'static str {
        "amp-cuda-act-grad"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("amp-cuda-act-grad: a CUDA op applied to CPU tensors")
    }

    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        let what = self.name();
        let n = l1.shape().elem_count();
        expect_len(l2, n, what)?;
        if s1.dtype() != s2.dtype() {
            candle_core::bail!("{what}: x {:?} and dy {:?}", s1.dtype(), s2.dtype())
        }
        let plan = act_plan(n, self.0, s1.dtype()).ok_or_else(|| no_kernel(what, l1))?;
        let dev = s1.device().clone();
        let ptx = KERNELS.ptx(&dev).map_err(candle_core::Error::Msg)?;
        let func = dev.get_or_load_custom_func(&plan.backward.kernel, KERNELS.module, &ptx)?;
        let (x, dy) = (view(s1, l1, what)?, view(s2, l2, what)?);
        let dx = alloc(&dev, s1.dtype(), n, what)?;
        let len = n as i64;
        let mut b = func.builder();
        push_in(&mut b, &x);
        push_in(&mut b, &dy);
        push_out(&mut b, &dx);
        b.arg(&len);
        // SAFETY: the arguments match `AMP_ACT_BWD_ARGS`; x, dy and dx hold n values of x's type.
        unsafe { b.launch(config(plan.backward.grid, plan.backward.block)) }.w()?;
        drop(b);
        Ok((wrap(dx, dev), l1.shape().clone()))
    }
}

/// [`super::gated_product`] on a CUDA device.
pub(crate) fn gated_product(g: &Tensor, u: &Tensor, act: PointAct, a: DType, p: DType) -> Result<Option<Tensor>> {
    let Device::Cuda(dev) = g.device() else {
        return Ok(None);
    };
    if g.shape() != u.shape()
        || g.dtype() != u.dtype()
        || !u.device().same_device(g.device())
        || gated_plan(g.elem_count(), act, g.dtype(), a, p).is_none()
        || !available(dev)
    {
        return Ok(None);
    }
    let (g, u) = (dense(g)?, dense(u)?);
    let op = Gated { act, a, p };
    Ok(Some(if g.track_op() || u.track_op() {
        g.apply_op2(&u, op)?
    } else {
        g.apply_op2_no_bwd(&u, &op)?
    }))
}

/// [`super::activation`] on a CUDA device.
pub(crate) fn activation(x: &Tensor, act: PointAct) -> Result<Option<Tensor>> {
    let Device::Cuda(dev) = x.device() else {
        return Ok(None);
    };
    if act_plan(x.elem_count(), act, x.dtype()).is_none() || !available(dev) {
        return Ok(None);
    }
    let x = dense(x)?;
    Ok(Some(if x.track_op() {
        x.apply_op1(Act(act))?
    } else {
        x.apply_op1_no_bwd(&Act(act))?
    }))
}
