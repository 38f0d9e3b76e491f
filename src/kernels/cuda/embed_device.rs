//! The kernels of `embed.cu` on a candle CUDA device: compiled by NVRTC, loaded into candle's
//! context, applied as a custom op on `(table, ids)` whose backward runs the backward kernel
//! and returns the table's gradient through candle's graph (none for the ids).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaView, LaunchArgs, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, CudaStorageSlice, WrapErr};
use candle_core::{CpuStorage, CudaStorage, CustomOp2, DType, Device, Layout, Result, Shape, Tensor};

use super::{EmbedPass, SOURCE, embed_plan};
use crate::kernels::cuda::buffers::{alloc, config, no_kernel, offsets, push_in, push_out, view, wrap};
use crate::kernels::cuda::nvrtc::Kernels;
use crate::kernels::dense;

/// The kernels of `embed.cu`: NVRTC's PTX and the module loaded per device.
static KERNELS: Kernels = Kernels::new(
    "candle_amp_embed",
    SOURCE,
    "amp_embed_fwd_f32_u32",
    "embedding",
    "the embedding runs candle's index_select",
);

/// Whether the kernels are loaded on `dev` (see [`Kernels::available`]).
pub(crate) fn available(dev: &CudaDevice) -> bool {
    KERNELS.available(dev)
}

/// The ids, contiguous, as the kernels read them.
enum Ids<'a> {
    U32(CudaView<'a, u32>),
    I64(CudaView<'a, i64>),
}

fn ids_view<'a>(s: &'a CudaStorage, l: &Layout, what: &str) -> Result<Ids<'a>> {
    let (a, b) = offsets(l, what)?;
    Ok(match &s.slice {
        CudaStorageSlice::U32(x) => Ids::U32(x.slice(a..b)),
        CudaStorageSlice::I64(x) => Ids::I64(x.slice(a..b)),
        _ => candle_core::bail!("{what}: ids of type {:?}", s.dtype()),
    })
}

fn push_ids<'a>(b: &mut LaunchArgs<'a>, v: &'a Ids<'_>) {
    match v {
        Ids::U32(x) => b.arg(x),
        Ids::I64(x) => b.arg(x),
    };
}

/// The lookup over `(table, ids)`.
struct Lookup;

impl CustomOp2 for Lookup {
    fn name(&self) -> &'static str {
        "amp-cuda-embedding"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        // Only ever applied to CUDA tensors (see `lookup`).
        candle_core::bail!("amp-cuda-embedding: a CUDA op applied to CPU tensors")
    }

    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        let what = self.name();
        let (vocab, width) = l1.shape().dims2()?;
        let n = l2.shape().elem_count();
        let plan = embed_plan(EmbedPass::Forward, n, vocab, width, s1.dtype(), s2.dtype())
            .ok_or_else(|| no_kernel(what, l1))?;
        let dev = s1.device().clone();
        let ptx = KERNELS.ptx(&dev).map_err(candle_core::Error::Msg)?;
        let func = dev.get_or_load_custom_func(&plan.kernel, KERNELS.module, &ptx)?;
        let (table, ids) = (view(s1, l1, what)?, ids_view(s2, l2, what)?);
        let y = alloc(&dev, s1.dtype(), n * width, what)?;
        // The kernels' 32-bit arguments (`embed_plan` checked n * width and vocab * width).
        let (n_i, vocab_i, width_i) = (n as i32, vocab as i32, width as i32);
        let mut bld = func.builder();
        push_in(&mut bld, &table);
        push_ids(&mut bld, &ids);
        push_out(&mut bld, &y);
        bld.arg(&n_i).arg(&vocab_i).arg(&width_i);
        // SAFETY: the arguments match `AMP_EMBED_FWD_ARGS` in order and type; the table holds
        // vocab * width values of its type, the ids n, the output n * width; the grid-stride
        // loop writes every output value and reads only rows below vocab.
        unsafe { bld.launch(config(plan.grid, plan.block)) }.w()?;
        drop(bld);
        let mut dims = l2.shape().dims().to_vec();
        dims.push(width);
        Ok((wrap(y, dev), Shape::from(dims)))
    }

    /// The table's gradient, summed in f32 and returned in its type; the ids take none.
    fn bwd(&self, table: &Tensor, ids: &Tensor, _res: &Tensor, g: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        if !table.track_op() {
            return Ok((None, None));
        }
        let g = if g.dtype() == table.dtype() {
            g.clone()
        } else {
            g.to_dtype(table.dtype())?
        };
        let op = Grad { vocab: table.dim(0)? };
        let grad = ids.detach().apply_op2_no_bwd(&dense(&g)?.detach(), &op)?;
        Ok((Some(grad), None))
    }
}

/// The table's gradient over `(ids, g)`: `(vocab, width)` in g's type.
struct Grad {
    vocab: usize,
}

impl CustomOp2 for Grad {
    fn name(&self) -> &'static str {
        "amp-cuda-embedding-grad"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        // Only ever applied to CUDA tensors (see `Lookup::bwd`).
        candle_core::bail!("amp-cuda-embedding-grad: a CUDA op applied to CPU tensors")
    }

    fn cuda_fwd(&self, s1: &CudaStorage, l1: &Layout, s2: &CudaStorage, l2: &Layout) -> Result<(CudaStorage, Shape)> {
        let what = self.name();
        let n = l1.shape().elem_count();
        let gd = l2.shape().dims();
        let width = gd.last().copied().unwrap_or(0);
        if gd.len() != l1.shape().rank() + 1 || gd[..gd.len() - 1] != *l1.shape().dims() {
            candle_core::bail!("{what}: a gradient {:?} for ids {:?}", gd, l1.shape().dims());
        }
        let (vocab, dt) = (self.vocab, s2.dtype());
        let plan =
            embed_plan(EmbedPass::Backward, n, vocab, width, dt, s1.dtype()).ok_or_else(|| no_kernel(what, l2))?;
        let dev = s2.device().clone();
        let ptx = KERNELS.ptx(&dev).map_err(candle_core::Error::Msg)?;
        let func = dev.get_or_load_custom_func(&plan.kernel, KERNELS.module, &ptx)?;
        let (ids, g) = (ids_view(s1, l1, what)?, view(s2, l2, what)?);
        // SAFETY: the kernel writes every value of the accumulator (zeros, then the sums)
        // before reading it: each (row tile, column tile) pair is one block's, every row below
        // vocab in one row tile.
        let acc = unsafe { dev.alloc::<f32>(vocab * width) }?;
        // An f32 table's gradient is the accumulator itself.
        let out = if dt == DType::F32 {
            None
        } else {
            Some(alloc(&dev, dt, vocab * width, what)?)
        };
        let (n_i, vocab_i, width_i) = (n as i32, vocab as i32, width as i32);
        // `embed_plan` keeps both within i32.
        let (rpt, tiles) = (plan.rows_per_tile as i32, plan.row_tiles as i32);
        let mut bld = func.builder();
        push_ids(&mut bld, &ids);
        push_in(&mut bld, &g);
        bld.arg(&acc);
        match &out {
            Some(o) => push_out(&mut bld, o),
            None => {
                bld.arg(&acc);
            }
        }
        bld.arg(&n_i).arg(&vocab_i).arg(&width_i).arg(&rpt).arg(&tiles);
        // SAFETY: the arguments match `AMP_EMBED_BWD_ARGS` in order and type; the ids hold n
        // values, g n * width of the table's type, the accumulator and the output vocab *
        // width (the same buffer for f32, which the kernel expects: it writes only `acc`
        // then); the grid-stride loop over the tiles writes every value.
        unsafe { bld.launch(config(plan.grid, plan.block)) }.w()?;
        drop(bld);
        let grad = match out {
            Some(o) => wrap(o, dev),
            None => CudaStorage::wrap_cuda_slice(acc, dev),
        };
        Ok((grad, Shape::from((vocab, width))))
    }
}

/// [`super::lookup`] on a CUDA device.
pub(crate) fn lookup(ids: &Tensor, table: &Tensor) -> Result<Option<Tensor>> {
    let Device::Cuda(dev) = table.device() else {
        return Ok(None);
    };
    let Ok((vocab, width)) = table.dims2() else {
        return Ok(None);
    };
    if !ids.device().same_device(table.device())
        || embed_plan(
            EmbedPass::Forward,
            ids.elem_count(),
            vocab,
            width,
            table.dtype(),
            ids.dtype(),
        )
        .is_none()
        || !available(dev)
    {
        return Ok(None);
    }
    let table = dense(table)?;
    let ids = dense(&ids.detach())?;
    Ok(Some(if table.track_op() {
        table.apply_op2(&ids, Lookup)?
    } else {
        table.apply_op2_no_bwd(&ids, &Lookup)?
    }))
}
