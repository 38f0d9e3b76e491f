//! The kernels of `rows.cu` on a candle CUDA device: compiled by NVRTC, loaded into candle's
//! context, applied as custom ops whose backwards are the backward kernels.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, LaunchArgs, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{
    CpuStorage, CudaStorage, CustomOp1, CustomOp2, CustomOp3, DType, Device, Layout, Result, Shape, Tensor,
};

use super::{BiasGeluPlan, RowsLaunch, SOURCE, Tiles, add_plan, bias_gelu_plan, bias_gelu_tanh_plan, colsum_plan};
use crate::kernels::cuda::buffers::{Out, alloc, config, expect_len, no_kernel, push_in, push_out, stored, view, wrap};
use crate::kernels::cuda::nvrtc::Kernels;
use crate::kernels::dense;

/// The kernels of `rows.cu`: NVRTC's PTX and the module loaded per device.
static KERNELS: Kernels = Kernels::new(
    "candle_amp_rows",
    SOURCE,
    "amp_add_f32_f32_f32",
    "row (bias + GELU, add)",
    "bias + GELU and adds run",
);

/// Whether the kernels are loaded on `dev` (see [`Kernels::available`]).
pub(crate) fn available(dev: &CudaDevice) -> bool {
    KERNELS.available(dev)
}

/// Rows and columns of a layout (the last dimension is the row; a scalar is one value).
fn rows_cols(shape: &Shape) -> (usize, usize) {
    let cols = shape.dims().last().copied().unwrap_or(1);
    (shape.elem_count() / cols.max(1), cols)
}

/// Pushes the tiled kernels' four trailing arguments: rows, columns, rows per chunk, tiles.
/// `plan` checked that each fits an `i32`.
fn push_tiles<'a>(b: &mut LaunchArgs<'a>, t: &'a [i32; 4]) {
    for v in t {
        b.arg(v);
    }
}

fn tile_args(t: &Tiles) -> [i32; 4] {
    [
        t.rows as i32,
        t.cols as i32,
        t.rows_per_chunk as i32,
        t.col_tiles as i32,
    ]
}

/// `amp_colsum_sum_{o}`: the chunks' column sums (`part`, `chunks * cols` f32 values) added
/// in order into `out`.
fn launch_sum(
    dev: &CudaDevice,
    ptx: &str,
    kernel: &RowsLaunch,
    part: &CudaSlice<f32>,
    out: &Out,
    t: &Tiles,
) -> Result<()> {
    let func = dev.get_or_load_custom_func(&kernel.kernel, KERNELS.module, ptx)?;
    let (cols, chunks) = (t.cols as i32, t.chunks as i32);
    let mut b = func.builder();
    b.arg(part);
    push_out(&mut b, out);
    b.arg(&cols).arg(&chunks);
    // SAFETY: the arguments match `AMP_COLSUM_SUM_ARGS`; `part` holds chunks * cols f32 values
    // and `out` cols values of the kernel's output type.
    unsafe { b.launch(config(kernel.grid, kernel.block)) }.w()?;
    Ok(())
}

/// The plan of bias + GELU in the tanh form where `tanh`, else the erf form.
fn gelu_plan(tanh: bool, rows: usize, cols: usize, h: DType, b: DType, y: DType) -> Option<BiasGeluPlan> {
    if tanh {
        bias_gelu_tanh_plan(rows, cols, h, b, y)
    } else {
        bias_gelu_plan(rows, cols, h, b, y)
    }
}

/// The forward over `(h, bias)`: `gelu(h + bias)` in `out` (the tanh form where `tanh`).
struct BiasGelu {
    out: DType,
    tanh: bool,
}

impl CustomOp2 for BiasGelu {
    fn name(&self) -> &'static str {
        "amp-cuda-bias-gelu"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        // Only ever applied to CUDA tensors (see `bias_gelu`).
        candle_core::bail!("amp-cuda-bias-gelu: a CUDA op applied to CPU tensors")
    }

    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        let what = self.name();
        let (rows, cols) = rows_cols(l1.shape());
        expect_len(l2, cols, what)?;
        let plan =
            gelu_plan(self.tanh, rows, cols, s1.dtype(), s2.dtype(), self.out).ok_or_else(|| no_kernel(what, l1))?;
        let dev = s1.device().clone();
        let ptx = KERNELS.ptx(&dev).map_err(candle_core::Error::Msg)?;
        let func = dev.get_or_load_custom_func(&plan.forward.kernel, KERNELS.module, &ptx)?;
        let (h, bias) = (view(s1, l1, what)?, view(s2, l2, what)?);
        let y = alloc(&dev, self.out, rows * cols, what)?;
        let t = tile_args(&plan.tiles);
        let mut b = func.builder();
        push_in(&mut b, &h);
        push_in(&mut b, &bias);
        push_out(&mut b, &y);
        push_tiles(&mut b, &t);
        // SAFETY: the arguments match `AMP_BIAS_GELU_FWD_ARGS` in order and type; h and y hold
        // rows * cols values of their types, bias cols; the grid covers every row and column.
        unsafe { b.launch(config(plan.forward.grid, plan.forward.block)) }.w()?;
        drop(b);
        Ok((wrap(y, dev), l1.shape().clone()))
    }

    fn bwd(&self, h: &Tensor, bias: &Tensor, _res: &Tensor, dy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let dy = dense(&dy.to_dtype(self.out)?)?;
        let op = GradBiasGelu {
            out: self.out,
            tanh: self.tanh,
            want_bias: bias.track_op(),
            dbias: Mutex::new(None),
        };
        let dh = h.detach().apply_op3_no_bwd(&bias.detach(), &dy.detach(), &op)?;
        let dbias = match op.dbias.into_inner().unwrap_or_else(|e| e.into_inner()) {
            Some(o) => Some(stored(bias, o)?),
            None => None,
        };
        Ok((h.track_op().then_some(dh), dbias))
    }
}

/// The backward over `(h, bias, dy)`: `dh` in h's type; the bias gradient (in the bias's type)
/// computed in the same launch sequence and kept for [`stored`] where `want_bias`.
struct GradBiasGelu {
    out: DType,
    tanh: bool,
    want_bias: bool,
    dbias: Mutex<Option<Out>>,
}

impl CustomOp3 for GradBiasGelu {
    fn name(&self) -> &'static str {
        "amp-cuda-bias-gelu-grad"
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
        candle_core::bail!("amp-cuda-bias-gelu-grad: a CUDA op applied to CPU tensors")
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
        if l1.shape() != l3.shape() || s3.dtype() != self.out {
            candle_core::bail!("{what}: h {:?} and dy {:?} {:?}", l1.shape(), l3.shape(), s3.dtype());
        }
        let (rows, cols) = rows_cols(l1.shape());
        expect_len(l2, cols, what)?;
        let plan =
            gelu_plan(self.tanh, rows, cols, s1.dtype(), s2.dtype(), self.out).ok_or_else(|| no_kernel(what, l1))?;
        let dev = s1.device().clone();
        let ptx = KERNELS.ptx(&dev).map_err(candle_core::Error::Msg)?;
        let func = dev.get_or_load_custom_func(&plan.backward.kernel, KERNELS.module, &ptx)?;
        let (h, bias, dy) = (view(s1, l1, what)?, view(s2, l2, what)?, view(s3, l3, what)?);
        let dh = alloc(&dev, s1.dtype(), rows * cols, what)?;
        // SAFETY: the backward kernel writes every chunk's sum of every column.
        let part = if self.want_bias {
            Some(unsafe { dev.alloc::<f32>(plan.tiles.chunks * cols) }?)
        } else {
            None
        };
        // No bias gradient wanted: a null `part`, which the kernel skips.
        let null = 0u64;
        let t = tile_args(&plan.tiles);
        let mut b = func.builder();
        push_in(&mut b, &h);
        push_in(&mut b, &bias);
        push_in(&mut b, &dy);
        push_out(&mut b, &dh);
        match &part {
            Some(p) => b.arg(p),
            None => b.arg(&null),
        };
        push_tiles(&mut b, &t);
        // SAFETY: the arguments match `AMP_BIAS_GELU_BWD_ARGS`; h, dy and dh hold rows * cols
        // values of their types, bias cols, part (when given) chunks * cols f32 values.
        unsafe { b.launch(config(plan.backward.grid, plan.backward.block)) }.w()?;
        drop(b);
        if let Some(part) = &part {
            let dbias = alloc(&dev, s2.dtype(), cols, what)?;
            launch_sum(&dev, &ptx, &plan.sum, part, &dbias, &plan.tiles)?;
            *self.dbias.lock().unwrap_or_else(|e| e.into_inner()) = Some(dbias);
        }
        Ok((wrap(dh, dev), l1.shape().clone()))
    }
}

/// The forward over `(a, b)`: `a + b` in `out`, `b` of a's shape or one row (`bcast`).
struct AddCast {
    out: DType,
    bcast: bool,
}

impl CustomOp2 for AddCast {
    fn name(&self) -> &'static str {
        "amp-cuda-add"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        // Only ever applied to CUDA tensors (see `add_cast`).
        candle_core::bail!("amp-cuda-add: a CUDA op applied to CPU tensors")
    }

    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        let what = self.name();
        let (rows, cols) = rows_cols(l1.shape());
        expect_len(l2, if self.bcast { cols } else { rows * cols }, what)?;
        let plan =
            add_plan(rows, cols, self.bcast, s1.dtype(), s2.dtype(), self.out).ok_or_else(|| no_kernel(what, l1))?;
        let dev = s1.device().clone();
        let ptx = KERNELS.ptx(&dev).map_err(candle_core::Error::Msg)?;
        let func = dev.get_or_load_custom_func(&plan.forward.kernel, KERNELS.module, &ptx)?;
        let (a, b) = (view(s1, l1, what)?, view(s2, l2, what)?);
        let y = alloc(&dev, self.out, rows * cols, what)?;
        let t = tile_args(&plan.tiles);
        let bcast = i32::from(self.bcast);
        let mut bld = func.builder();
        push_in(&mut bld, &a);
        push_in(&mut bld, &b);
        push_out(&mut bld, &y);
        push_tiles(&mut bld, &t);
        bld.arg(&bcast);
        // SAFETY: the arguments match `AMP_ADD_ARGS`; a and out hold rows * cols values of
        // their types, b as many or (bcast) cols; the grid covers every value.
        unsafe { bld.launch(config(plan.forward.grid, plan.forward.block)) }.w()?;
        drop(bld);
        Ok((wrap(y, dev), l1.shape().clone()))
    }

    /// The output gradient cast to each operand's type; a broadcast `b`'s summed over the
    /// rows in f32 and rounded once.
    fn bwd(&self, a: &Tensor, b: &Tensor, _res: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = g.detach();
        let cast = |dt: DType| if g.dtype() == dt { Ok(g.clone()) } else { g.to_dtype(dt) };
        let da = if a.track_op() { Some(cast(a.dtype())?) } else { None };
        let db = if !b.track_op() {
            None
        } else if self.bcast {
            let op = ColSum { out: b.dtype() };
            Some(dense(&g)?.apply_op1_no_bwd(&op)?.reshape(b.shape())?)
        } else if let Some(da) = da.as_ref().filter(|_| a.dtype() == b.dtype()) {
            Some(da.clone())
        } else {
            Some(cast(b.dtype())?)
        };
        Ok((da, db))
    }
}

/// The column sums of `g` (rows over its last dimension), in f32, into `out`: shape `(cols)`.
struct ColSum {
    out: DType,
}

impl CustomOp1 for ColSum {
    fn name(&self) -> &'static str {
        "amp-cuda-colsum"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("amp-cuda-colsum: a CUDA op applied to a CPU tensor")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let what = self.name();
        let (rows, cols) = rows_cols(l.shape());
        let plan = colsum_plan(rows, cols, s.dtype(), self.out).ok_or_else(|| no_kernel(what, l))?;
        let dev = s.device().clone();
        let ptx = KERNELS.ptx(&dev).map_err(candle_core::Error::Msg)?;
        let func = dev.get_or_load_custom_func(&plan.part.kernel, KERNELS.module, &ptx)?;
        let g = view(s, l, what)?;
        // SAFETY: the part kernel writes every chunk's sum of every column.
        let part = unsafe { dev.alloc::<f32>(plan.tiles.chunks * cols) }?;
        let t = tile_args(&plan.tiles);
        let mut b = func.builder();
        push_in(&mut b, &g);
        b.arg(&part);
        push_tiles(&mut b, &t);
        // SAFETY: the arguments match `AMP_COLSUM_PART_ARGS`; g holds rows * cols values, part
        // chunks * cols f32 values.
        unsafe { b.launch(config(plan.part.grid, plan.part.block)) }.w()?;
        drop(b);
        let out = alloc(&dev, self.out, cols, what)?;
        launch_sum(&dev, &ptx, &plan.sum, &part, &out, &plan.tiles)?;
        Ok((wrap(out, dev), Shape::from(cols)))
    }
}

/// [`super::bias_gelu`] on a CUDA device.
pub(crate) fn bias_gelu(h: &Tensor, bias: &Tensor, out: DType, tanh: bool) -> Result<Option<Tensor>> {
    let Device::Cuda(dev) = h.device() else {
        return Ok(None);
    };
    let Some(&cols) = h.dims().last() else {
        return Ok(None);
    };
    let rows = h.elem_count() / cols.max(1);
    if bias.dims() != [cols]
        || !bias.device().same_device(h.device())
        || gelu_plan(tanh, rows, cols, h.dtype(), bias.dtype(), out).is_none()
        || !available(dev)
    {
        return Ok(None);
    }
    let (h, bias) = (dense(h)?, dense(bias)?);
    let op = BiasGelu { out, tanh };
    Ok(Some(if h.track_op() || bias.track_op() {
        h.apply_op2(&bias, op)?
    } else {
        h.apply_op2_no_bwd(&bias, &op)?
    }))
}

/// Whether `t` is one row of `full`: shape `(n)` or `(1, .., 1, n)` with `n` full's last
/// dimension and no more dimensions than `full` (so the broadcast has full's shape).
fn is_row(t: &Tensor, full: &Tensor) -> bool {
    let (d, f) = (t.dims(), full.dims());
    match (d.split_last(), f.last()) {
        (Some((n, lead)), Some(m)) => n == m && d.len() <= f.len() && lead.iter().all(|&x| x == 1),
        _ => false,
    }
}

/// [`super::add_cast`] on a CUDA device.
pub(crate) fn add_cast(a: &Tensor, b: &Tensor, out: DType) -> Result<Option<Tensor>> {
    let Device::Cuda(dev) = a.device() else {
        return Ok(None);
    };
    if !b.device().same_device(a.device()) {
        return Ok(None);
    }
    // The full operand first (the kernel adds in f32, where the order does not matter).
    let (full, other, bcast) = if a.shape() == b.shape() {
        (a, b, false)
    } else if is_row(b, a) {
        (a, b, true)
    } else if is_row(a, b) {
        (b, a, true)
    } else {
        return Ok(None);
    };
    let (rows, cols) = rows_cols(full.shape());
    if add_plan(rows, cols, bcast, full.dtype(), other.dtype(), out).is_none()
        || (bcast && colsum_plan(rows, cols, out, other.dtype()).is_none())
        || !available(dev)
    {
        return Ok(None);
    }
    let (x, y) = (dense(full)?, dense(other)?);
    let op = AddCast { out, bcast };
    Ok(Some(if x.track_op() || y.track_op() {
        x.apply_op2(&y, op)?
    } else {
        x.apply_op2_no_bwd(&y, &op)?
    }))
}
