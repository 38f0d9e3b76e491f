//! The CUDA stream-ordered memory pool that candle allocates from (`cuMemAllocAsync`).
//!
//! Its release threshold is 0 by default, so every stream or context synchronisation
//! (`Device::synchronize`, which a training step calls) hands every freed block back to the
//! driver, and the next step maps the memory again: 7.8 ms for 64 buffers of 32 MiB a step
//! on an H200, against 0.8 ms with the threshold raised. A run keeps the pool's freed memory
//! instead (as PyTorch's caching allocator and RMM's async resource do), and
//! [`empty_cache`] gives it back on request (PyTorch's `torch.cuda.empty_cache`).

use candle_core::Device;

use crate::error::Result;

/// Keeps the freed memory of `device`'s default pool across synchronisations (the release
/// threshold set to its maximum). Nothing to do off CUDA. Idempotent: one driver call.
pub(crate) fn keep_freed_memory(device: &Device) -> Result<()> {
    set_release_threshold(device, u64::MAX)
}

/// Hands the memory that `device`'s default CUDA memory pool keeps for reuse back to the
/// driver (PyTorch's `torch.cuda.empty_cache`): the pool is trimmed to what live tensors
/// use. A run keeps freed device memory between steps so that each step does not map it
/// again (see the crate's CUDA documentation); call this after a run to let other
/// processes have the memory. Nothing to do on the CPU.
///
/// ```
/// # fn main() -> candle_amp::Result<()> {
/// candle_amp::empty_cache(&candle_core::Device::Cpu)?; // a no-op on the CPU
/// # Ok(()) }
/// ```
pub fn empty_cache(device: &Device) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        use candle_core::cuda_backend::cudarc::driver::result;
        let dev = d.cuda_stream().context().cu_device();
        // SAFETY: `dev` is a device of a live context (candle's); the pool is the device's
        // default one, which exists as long as the device does, and trimming frees only
        // blocks no allocation uses.
        unsafe {
            let pool = result::device::get_default_mem_pool(dev).map_err(candle_core::Error::wrap)?;
            result::mem_pool::trim_to(pool, 0).map_err(candle_core::Error::wrap)?;
        }
    }
    let _ = device;
    Ok(())
}

fn set_release_threshold(device: &Device, bytes: u64) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        use candle_core::cuda_backend::cudarc::driver::{result, sys};
        let dev = d.cuda_stream().context().cu_device();
        let mut value = bytes;
        // SAFETY: as in `empty_cache`; the attribute is a `cuuint64_t` read through the
        // pointer during the call only.
        unsafe {
            let pool = result::device::get_default_mem_pool(dev).map_err(candle_core::Error::wrap)?;
            result::mem_pool::set_attribute(
                pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&mut value as *mut u64).cast(),
            )
            .map_err(candle_core::Error::wrap)?;
        }
    }
    let _ = (device, bytes);
    Ok(())
}
