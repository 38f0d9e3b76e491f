//! The device buffers the kernel families share: a contiguous operand as the view a kernel
//! reads, a fresh output of the type asked, their launch arguments, and the launch shape
//! (one dimension of blocks).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, LaunchArgs, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, CudaStorageSlice};
use std::sync::Mutex;

use candle_core::{CpuStorage, CudaStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use half::{bf16, f16};

/// A contiguous f32, f16 or bf16 operand (x, dy, logits) as the view a kernel reads.
pub(crate) enum View<'a> {
    F32(CudaView<'a, f32>),
    F16(CudaView<'a, f16>),
    BF16(CudaView<'a, bf16>),
}

/// The start and end of a contiguous layout; an error naming `what` otherwise.
pub(crate) fn offsets(l: &Layout, what: &str) -> Result<(usize, usize)> {
    l.contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg(format!("{what}: the input must be contiguous")))
}

/// The values a layout covers: `n` exactly, or an error naming `what`.
pub(crate) fn expect_len(l: &Layout, n: usize, what: &str) -> Result<()> {
    let (a, b) = offsets(l, what)?;
    if b - a != n {
        candle_core::bail!("{what}: {} values where {n} are needed", b - a)
    }
    Ok(())
}

/// The operand `s` laid out as `l` (contiguous, f32 or half) as a kernel's view.
pub(crate) fn view<'a>(s: &'a CudaStorage, l: &Layout, what: &str) -> Result<View<'a>> {
    let (a, b) = offsets(l, what)?;
    Ok(match &s.slice {
        CudaStorageSlice::F32(x) => View::F32(x.slice(a..b)),
        CudaStorageSlice::F16(x) => View::F16(x.slice(a..b)),
        CudaStorageSlice::BF16(x) => View::BF16(x.slice(a..b)),
        _ => candle_core::bail!("{what}: {:?} input", s.dtype()),
    })
}

/// A fresh buffer of `n` values of `dt`, for a kernel that writes it whole.
pub(crate) enum Out {
    F32(CudaSlice<f32>),
    F16(CudaSlice<f16>),
    BF16(CudaSlice<bf16>),
}

/// A buffer for an output that the kernel it is handed to writes whole.
pub(crate) fn alloc(dev: &CudaDevice, dt: DType, n: usize, what: &str) -> Result<Out> {
    // SAFETY: every caller hands the buffer to a kernel whose grid covers every row and whose
    // row loop writes every column (masked values as 0) before anything reads it.
    Ok(match dt {
        DType::F32 => Out::F32(unsafe { dev.alloc::<f32>(n) }?),
        DType::F16 => Out::F16(unsafe { dev.alloc::<f16>(n) }?),
        DType::BF16 => Out::BF16(unsafe { dev.alloc::<bf16>(n) }?),
        other => candle_core::bail!("{what}: {other:?} output"),
    })
}

/// Pushes a view as the next kernel argument.
pub(crate) fn push_in<'a>(b: &mut LaunchArgs<'a>, v: &'a View<'_>) {
    match v {
        View::F32(x) => b.arg(x),
        View::F16(x) => b.arg(x),
        View::BF16(x) => b.arg(x),
    };
}

/// Pushes an output buffer as the next kernel argument.
pub(crate) fn push_out<'a>(b: &mut LaunchArgs<'a>, o: &'a Out) {
    match o {
        Out::F32(x) => b.arg(x),
        Out::F16(x) => b.arg(x),
        Out::BF16(x) => b.arg(x),
    };
}

/// The buffer as candle storage on `dev`.
pub(crate) fn wrap(o: Out, dev: CudaDevice) -> CudaStorage {
    match o {
        Out::F32(x) => CudaStorage::wrap_cuda_slice(x, dev),
        Out::F16(x) => CudaStorage::wrap_cuda_slice(x, dev),
        Out::BF16(x) => CudaStorage::wrap_cuda_slice(x, dev),
    }
}

/// `grid` blocks of `block` threads in one dimension, no dynamic shared memory.
pub(crate) fn config(grid: u32, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The error where the launch plan has no kernel for a layout.
pub(crate) fn no_kernel(what: &str, l: &Layout) -> candle_core::Error {
    candle_core::Error::Msg(format!("{what}: no kernel for {:?}", l.shape()))
}

/// A second output of a launch (a bias's or a gate's gradient written beside the first) as a
/// tensor of `like`'s shape on its device, outside the graph: a custom op whose forward hands
/// on `out` (its length checked against the shape).
pub(crate) fn stored(like: &Tensor, out: Out) -> Result<Tensor> {
    like.detach().apply_op1_no_bwd(&Stored(Mutex::new(Some(out))))
}

/// The op behind [`stored`]: the buffer, taken by its one forward.
struct Stored(Mutex<Option<Out>>);

impl CustomOp1 for Stored {
    fn name(&self) -> &'static str {
        "amp-cuda-stored"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("amp-cuda-stored: a CUDA op applied to a CPU tensor")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let out = self.0.lock().unwrap_or_else(|e| e.into_inner()).take();
        let out = out.ok_or_else(|| candle_core::Error::Msg("amp-cuda-stored: applied twice".into()))?;
        let len = match &out {
            Out::F32(x) => x.len(),
            Out::F16(x) => x.len(),
            Out::BF16(x) => x.len(),
        };
        if len != l.shape().elem_count() {
            candle_core::bail!("amp-cuda-stored: {len} values for {:?}", l.shape())
        }
        Ok((wrap(out, s.device().clone()), l.shape().clone()))
    }
}
