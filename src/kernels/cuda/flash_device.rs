//! The kernels of `flash.cu` on a candle CUDA device: compiled by NVRTC, loaded into candle's
//! context, applied as a custom op on `(q, k, v)` that keeps the rows' f32 log-sum-exp for its
//! backward, which runs the three backward kernels. On compute capability 8.0 and newer the
//! f16 and bf16 kernels are `flash_mma.cu`'s (tensor cores), a module of their own: where it
//! fails to load, the FMA kernels of `flash.cu` run instead. K and V may have fewer heads than Q
//! (grouped-query attention, read in place), and per-sequence key lengths travel to the
//! kernels as an i32 buffer on the device.

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::CudaDevice;
use candle_core::cuda_backend::WrapErr;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, LaunchArgs, PushKernelArg};
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

/// `(heads, group)` of q, k, v shapes: q's heads per batch entry (the third dimension from
/// the end; 1 for a rank-2 q) and how many of them read each key/value head; `None` unless k
/// and v have one shape, that of q or q's with fewer heads dividing its heads.
fn grouping(q: &Shape, k: &Shape, v: &Shape) -> Option<(usize, usize)> {
    let (qd, kd) = (q.dims(), k.dims());
    let r = qd.len();
    if r < 2 || k != v {
        return None;
    }
    let heads = if r >= 3 { qd[r - 3] } else { 1 };
    if k == q {
        return Some((heads.max(1), 1));
    }
    let same_else = kd.len() == r && r >= 3 && (0..r).all(|i| i == r - 3 || kd[i] == qd[i]);
    let kv = if same_else { kd[r - 3] } else { 0 };
    (kv > 0 && heads.is_multiple_of(kv)).then_some((heads, heads / kv))
}

/// The plan for three operands of one type, k and v of q's shape or with fewer heads (see
/// [`grouping`]), or an error naming `what`; with `(heads, group)`.
fn plan_for(what: &str, ss: [&CudaStorage; 3], ls: [&Layout; 3]) -> Result<(FlashPlan, usize, usize)> {
    let grouped = grouping(ls[0].shape(), ls[1].shape(), ls[2].shape());
    if grouped.is_none() || ss.iter().any(|s| s.dtype() != ss[0].dtype()) {
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
    let (heads, group) = grouped.unwrap_or((1, 1));
    let (bh, t, d) = dims(ls[0].shape());
    let plan = flash_plan(bh, group, t, d, ss[0].dtype(), None, tensor_cores(ss[0].device()));
    Ok((plan.ok_or_else(|| no_kernel(what, ls[0]))?, heads, group))
}

/// Per-batch key lengths on the device (i32, clipped to the sequence), shared by a forward
/// and its backward; `None`: no key masked.
type Lengths = Option<Arc<CudaSlice<i32>>>;

/// Pushes the key lengths' device pointer, or a null pointer (`null`, 0) without them: the
/// kernels' `const int *lengths`.
fn push_lengths<'a>(b: &mut LaunchArgs<'a>, lengths: &'a Lengths, null: &'a u64) {
    match lengths {
        Some(l) => b.arg(&**l),
        None => b.arg(null),
    };
}

/// The rows' log-sum-exp of the scaled scores (f32, one per query row of every matrix).
type Lse = Arc<CudaSlice<f32>>;

/// The forward: `softmax(q k^T * scale) v`, causal if asked, keys past `lengths` masked, in
/// the inputs' type.
struct Forward {
    scale: f32,
    causal: bool,
    lengths: Lengths,
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
        let (plan, heads, group) = plan_for(what, [s1, s2, s3], [l1, l2, l3])?;
        let (bh, t, d) = dims(l1.shape());
        let dev = s1.device().clone();
        let kernels = module(&plan);
        let ptx = kernels.ptx(&dev).map_err(candle_core::Error::Msg)?;
        let func = dev.get_or_load_custom_func(&plan.forward.kernel, kernels.module, &ptx)?;
        let (q, k, v) = (view(s1, l1, what)?, view(s2, l2, what)?, view(s3, l3, what)?);
        let o = alloc(&dev, s1.dtype(), bh * t * d, what)?;
        // SAFETY: the forward writes the LSE of every row of every matrix.
        let lse = unsafe { dev.alloc::<f32>(bh * t) }?;
        // The kernels' 32-bit arguments (`flash_plan` checked that they fit; d <= 128).
        let (bh_i, t_i, d_i, causal) = (bh as i32, t as i32, d as i32, i32::from(self.causal));
        // heads and group divide bh (`grouping`, `flash_plan`): they fit too.
        let (heads_i, group_i, null) = (heads as i32, group as i32, 0u64);
        let mut b = func.builder();
        push_in(&mut b, &q);
        push_in(&mut b, &k);
        push_in(&mut b, &v);
        push_out(&mut b, &o);
        b.arg(&lse).arg(&bh_i).arg(&t_i).arg(&d_i).arg(&self.scale).arg(&causal);
        b.arg(&heads_i).arg(&group_i);
        push_lengths(&mut b, &self.lengths, &null);
        // SAFETY: the arguments match `AMP_FLASH_FWD_ARGS` in order and type; d is at most the
        // kernel's head dimension (`flash_plan`); q and o hold bh * t * d values of the
        // kernel's type, k and v bh / group * t * d, lse bh * t f32 values, lengths
        // (`attention_with`) bh / heads i32 values or null.
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
            lengths: self.lengths.clone(),
            lse,
            o: crate::kernels::dense(res)?.detach(),
            dout: crate::kernels::dense(&grad_res.to_dtype(res.dtype())?)?.detach(),
        };
        let g = q.detach().apply_op3_no_bwd(&k.detach(), &v.detach(), &op)?;
        let (n, nkv) = (q.elem_count(), k.elem_count());
        Ok((
            Some(g.narrow(0, 0, n)?.reshape(q.shape())?),
            Some(g.narrow(0, n, nkv)?.reshape(k.shape())?),
            Some(g.narrow(0, n + nkv, nkv)?.reshape(v.shape())?),
        ))
    }
}

/// The backward over `(q, k, v)`: dq, dk and dv one after the other, flat (q's and twice k's
/// element count), from the forward's output `o`, its gradient `dout` (both of q's type and
/// shape, contiguous), LSE and key lengths.
struct Backward {
    scale: f32,
    causal: bool,
    lengths: Lengths,
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
        let (plan, heads, group) = plan_for(what, [s1, s2, s3], [l1, l2, l3])?;
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
        // dq, dk, dv one after the other; the dK/dV pass writes every key row of the last two,
        // the dQ pass every query row of the first.
        let total = rows * d + 2 * (rows / group) * d;
        let out = alloc(&dev, s1.dtype(), total, what)?;
        let (rows_i, bh_i, t_i, d_i) = (rows as i32, bh as i32, t as i32, d as i32);
        let causal = i32::from(self.causal);
        let (heads_i, group_i, null) = (heads as i32, group as i32, 0u64);
        let lse: &CudaSlice<f32> = &self.lse;
        let mut b = pre_fn.builder();
        push_in(&mut b, &o);
        push_in(&mut b, &dout);
        b.arg(&delta).arg(&rows_i).arg(&d_i);
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
            b.arg(&bh_i).arg(&t_i).arg(&d_i).arg(&self.scale).arg(&causal);
            b.arg(&heads_i).arg(&group_i);
            push_lengths(&mut b, &self.lengths, &null);
            // SAFETY: the arguments match `AMP_FLASH_BWD_ARGS` (d at most the kernels' head
            // dimension); q and dout hold rows * d values of the kernel's type, k and v
            // rows / group * d, lse and delta rows f32 values, out `total`, lengths bh / heads
            // i32 values or null.
            unsafe { b.launch(config(l.grid, l.block)) }.w()?;
        }
        Ok((wrap(out, dev), Shape::from(total)))
    }
}

/// Whether [`attention`] runs the kernels for `(q, k, v)`: on a CUDA device, one float type
/// and one shape `(..., t, d)` for the three, a head dimension with kernels (a multiple of 8
/// up to 128), sizes that fit their arguments (not empty), kernels that loaded. (Equal shapes only: the composed path of
/// `nn::scaled_dot_product_attention`, its caller, takes no grouped heads, and the two paths
/// accept the same inputs.)
pub(crate) fn applies(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    k.shape() == q.shape() && applies_with(q, k, v, None)
}

/// Whether [`attention_with`] runs the kernels for `(q, k, v)` and `lengths`: as [`applies`],
/// but k and v (of one shape) may have fewer heads than q (the third dimension from the end),
/// a divisor of q's; `lengths`, if given, holds one length per batch entry (q's matrices over
/// its heads).
pub(crate) fn applies_with(q: &Tensor, k: &Tensor, v: &Tensor, lengths: Option<&[usize]>) -> bool {
    let Device::Cuda(dev) = q.device() else {
        return false;
    };
    let same = |x: &Tensor| x.dtype() == q.dtype() && x.device().same_device(q.device());
    let Some((heads, group)) = grouping(q.shape(), k.shape(), v.shape()) else {
        return false;
    };
    if !same(k) || !same(v) {
        return false;
    }
    let (bh, t, d) = dims(q.shape());
    if lengths.is_some_and(|l| l.len() * heads != bh) {
        return false;
    }
    flash_plan(bh, group, t, d, q.dtype(), None, false).is_some() && available(dev)
}

/// `softmax(q k^T * scale) v` (causal if asked) on a CUDA device: `Ok(None)` where the kernels
/// do not apply (see [`applies`]), and the caller runs the composed ops. Differentiable: the
/// gradients come back in the inputs' type.
pub(crate) fn attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, causal: bool) -> Result<Option<Tensor>> {
    if !applies(q, k, v) {
        return Ok(None);
    }
    attention_with(q, k, v, scale, causal, None)
}

/// [`attention`] with grouped key/value heads (k and v of `(..., kv_heads, t, d)` for q's
/// `(..., heads, t, d)`, query head `h` reading key/value head `h / (heads / kv_heads)`, no
/// copies) and key lengths (keys at or past `lengths[i]` masked for batch entry `i`, lengths
/// past `t` counting as `t`; an entry of length 0 gets output 0 and gradients 0): `Ok(None)`
/// where the kernels do not apply (see [`applies_with`]). The gradients of k and v come back
/// in their own shape, summed over each group in a fixed order.
pub(crate) fn attention_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    causal: bool,
    lengths: Option<&[usize]>,
) -> Result<Option<Tensor>> {
    if !applies_with(q, k, v, lengths) {
        return Ok(None);
    }
    let Device::Cuda(dev) = q.device() else {
        return Ok(None);
    };
    let t = q.dim(candle_core::D::Minus2)?;
    // Clipped to t, which fits an i32 (`flash_plan`).
    let lengths = match lengths {
        Some(l) => {
            let l: Vec<i32> = l.iter().map(|&n| n.min(t) as i32).collect();
            Some(Arc::new(dev.clone_htod(&l)?))
        }
        None => None,
    };
    let (q, k, v) = (
        crate::kernels::dense(q)?,
        crate::kernels::dense(k)?,
        crate::kernels::dense(v)?,
    );
    let op = Forward {
        scale: scale as f32,
        causal,
        lengths,
        lse: Mutex::new(None),
    };
    Ok(Some(if q.track_op() || k.track_op() || v.track_op() {
        q.apply_op3(&k, &v, op)?
    } else {
        q.apply_op3_no_bwd(&k, &v, &op)?
    }))
}
