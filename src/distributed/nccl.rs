//! The NCCL backend (feature `nccl`): one process per CUDA GPU, collectives in device
//! memory through candle's `nccl` feature (cudarc's NCCL bindings).
//!
//! [`Communicator::all_reduce_sum_tensor`] reduces a tensor's device buffer in place of the
//! host round trip the trait's default takes: a custom op whose CUDA forward hands the
//! tensor's slice to `ncclAllReduce` on candle's stream and wraps the result as a new
//! tensor (as candle's `llama_multiprocess` example does), so it is ordered after the ops
//! that produced the input and before those that use the sum, with no host synchronisation.
//! The slice methods ([`Communicator::all_reduce_sum`], broadcasts) stage host buffers
//! through the device, since NCCL only reads device memory.
//!
//! Compiled and linted in CI (`--features cuda,nccl`, with the PyPI CUDA toolchain of
//! `scripts/cuda-env.sh`), not yet run on GPUs. NCCL collectives block until every rank
//! joins: NCCL's own watchdog (`NCCL_TIMEOUT` in recent NCCL) rather than this crate's
//! timeout decides when a dead rank is reported.

use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DeviceRepr, ValidAsZeroBits};
use candle_core::cuda_backend::cudarc::nccl::{Comm, Id, ReduceOp};
use candle_core::{CpuStorage, CudaStorage, CustomOp1, Device, Layout, Shape, Tensor};

use crate::comm::{Communicator, agree_on_len, check_blocks, check_root, check_sum_tensor};
use crate::error::{AmpError, DistErrorKind, Result};

/// The NCCL unique id every rank must share (rank 0 makes it, then sends its bytes to the
/// others by any means: a file, `MpiComm::broadcast_bytes`).
#[cfg_attr(docsrs, doc(cfg(feature = "nccl")))]
#[derive(Debug, Clone, Copy)]
pub struct NcclId(Id);

impl NcclId {
    /// A fresh id (on rank 0).
    pub fn new() -> Result<Self> {
        Id::new()
            .map(Self)
            .map_err(|e| backend(0, format!("ncclGetUniqueId: {e:?}")))
    }

    /// Its bytes, to send to the other ranks.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.0.internal().iter().map(|&c| c as u8).collect()
    }

    /// The id from rank 0's bytes (128 of them, as [`to_bytes`](Self::to_bytes) gives).
    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        let mut internal: [std::ffi::c_char; 128] = [0; 128];
        if b.len() != internal.len() {
            return Err(AmpError::InvalidArgument {
                argument: "bytes",
                reason: format!(
                    "an NCCL id has 128 bytes, got {}: pass rank 0's NcclId::to_bytes unchanged",
                    b.len()
                ),
            });
        }
        for (d, s) in internal.iter_mut().zip(b) {
            *d = *s as std::ffi::c_char;
        }
        Ok(Self(Id::uninit(internal)))
    }
}

fn backend(rank: usize, detail: String) -> AmpError {
    AmpError::Distributed {
        rank,
        kind: DistErrorKind::Backend,
        detail,
    }
}

/// A rank of an NCCL group on one CUDA device.
#[cfg_attr(docsrs, doc(cfg(feature = "nccl")))]
pub struct NcclComm {
    comm: Mutex<Comm>,
    /// The device's candle stream: the communicator enqueues on it, so collectives are
    /// ordered with candle's own work on the device.
    stream: Arc<CudaStream>,
    device: Device,
    rank: usize,
    size: usize,
}

// SAFETY: every NCCL call goes through the mutex (an NCCL communicator must not be used by
// two threads at once); the stream is cudarc's thread-safe handle.
unsafe impl Send for NcclComm {}
// SAFETY: as above.
unsafe impl Sync for NcclComm {}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("device", &self.device)
            .finish()
    }
}

impl NcclComm {
    /// Joins the group `id` as `rank` of `world_size` on `device` (a CUDA device). Every
    /// rank calls it with the same id; it returns once all have joined.
    pub fn new(device: &Device, rank: usize, world_size: usize, id: NcclId) -> Result<Self> {
        let Device::Cuda(dev) = device else {
            return Err(AmpError::InvalidArgument {
                argument: "device",
                reason: format!("NCCL needs a CUDA device, got {device:?}: pass Device::new_cuda(ordinal)"),
            });
        };
        if rank >= world_size {
            return Err(AmpError::InvalidArgument {
                argument: "rank",
                reason: format!("rank {rank} is not in a group of {world_size} rank(s)"),
            });
        }
        let stream = dev.cuda_stream();
        let comm = Comm::from_rank(stream.clone(), rank, world_size, id.0)
            .map_err(|e| backend(rank, format!("ncclCommInitRank: {e:?}")))?;
        Ok(Self {
            comm: Mutex::new(comm),
            stream,
            device: device.clone(),
            rank,
            size: world_size,
        })
    }

    fn comm(&self) -> MutexGuard<'_, Comm> {
        self.comm.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn err(&self, what: &str, e: impl std::fmt::Debug) -> AmpError {
        backend(self.rank, format!("{what}: {e:?}"))
    }

    /// Copies `send` to the device, runs `collective` (named `what`) from it into a new
    /// device buffer of `recv`'s length, and copies that into `recv`, waiting for it: the
    /// collectives whose input and output differ in length. The callers skip empty buffers
    /// (the device allocator refuses them).
    fn staged<T, E: std::fmt::Debug>(
        &self,
        send: &[T],
        recv: &mut [T],
        what: &str,
        collective: impl FnOnce(&Comm, &CudaSlice<T>, &mut CudaSlice<T>) -> std::result::Result<(), E>,
    ) -> Result<()>
    where
        T: DeviceRepr + ValidAsZeroBits,
    {
        let src = self
            .stream
            .clone_htod(send)
            .map_err(|e| self.err("copy to device", e))?;
        let mut dst = self
            .stream
            .alloc_zeros::<T>(recv.len())
            .map_err(|e| self.err("device allocation", e))?;
        collective(&self.comm(), &src, &mut dst).map_err(|e| self.err(what, e))?;
        self.stream
            .memcpy_dtoh(&dst, recv)
            .map_err(|e| self.err("copy to host", e))?;
        self.stream.synchronize().map_err(|e| self.err(what, e))
    }

    /// Copies `buf` to the device, runs `collective` on the device copy, and copies the
    /// result back into `buf`, waiting for it.
    fn through_device(
        &self,
        buf: &mut [f32],
        what: &str,
        collective: impl FnOnce(&Comm, &mut CudaSlice<f32>) -> Result<()>,
    ) -> Result<()> {
        // NCCL refuses no empty buffer, but the device allocator does: every rank passes the
        // same length, so every rank skips together.
        if buf.is_empty() {
            return Ok(());
        }
        let mut dev = self
            .stream
            .clone_htod(&*buf)
            .map_err(|e| self.err("copy to device", e))?;
        collective(&self.comm(), &mut dev)?;
        self.stream
            .memcpy_dtoh(&dev, buf)
            .map_err(|e| self.err("copy to host", e))?;
        self.stream.synchronize().map_err(|e| self.err(what, e))
    }
}

/// The in-device all-reduce: its value is the element-wise sum over the ranks of its f32
/// argument, in a new device buffer.
struct AllReduce<'a> {
    comm: &'a Comm,
    rank: usize,
}

impl CustomOp1 for AllReduce<'_> {
    fn name(&self) -> &'static str {
        "candle-amp-nccl-all-reduce"
    }

    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        // all_reduce_sum_tensor moves the tensor to the communicator's device first.
        Err(backend(
            self.rank,
            "NCCL reduces CUDA buffers; a CPU tensor reached the NCCL op".into(),
        )
        .into())
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let (a, b) = l
            .contiguous_offsets()
            .ok_or_else(|| backend(self.rank, "the NCCL all-reduce needs a contiguous tensor".into()))?;
        let src = s.as_cuda_slice::<f32>()?;
        let dev = s.device().clone();
        // SAFETY: ncclAllReduce writes every element of the new buffer before anything reads
        // it (both are ordered on the device's stream).
        let mut dst = unsafe { dev.alloc::<f32>(b - a) }?;
        self.comm
            .all_reduce(&src.slice(a..b), &mut dst, &ReduceOp::Sum)
            .map_err(|e| backend(self.rank, format!("ncclAllReduce: {e:?}")))?;
        Ok((CudaStorage::wrap_cuda_slice(dst, dev), l.shape().clone()))
    }
}

impl Communicator for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    fn backend(&self) -> &'static str {
        "nccl"
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        self.through_device(buf, "ncclAllReduce", |comm, dev| {
            comm.all_reduce_in_place(dev, &ReduceOp::Sum)
                .map(|_| ())
                .map_err(|e| self.err("ncclAllReduce", e))
        })
    }

    /// In device memory: no host copy, no synchronisation (the sum is ready when candle's
    /// next op on the stream runs). A tensor on another device goes through this
    /// communicator's device and comes back.
    fn all_reduce_sum_tensor(&self, t: &Tensor) -> Result<Tensor> {
        check_sum_tensor(t)?;
        if t.elem_count() == 0 {
            // Every rank passes the same length: all skip the collective together.
            return Ok(t.clone());
        }
        let on_device = t.to_device(&self.device)?.contiguous()?;
        let sum = {
            let comm = self.comm();
            on_device.apply_op1_no_bwd(&AllReduce {
                comm: &comm,
                rank: self.rank,
            })?
        };
        Ok(sum.to_device(t.device())?)
    }

    /// Tensors on this communicator's device are summed there (`all_reduce_sum_tensor`).
    fn reduces_in_device_memory(&self) -> bool {
        true
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<()> {
        check_root(self, root)?;
        self.through_device(buf, "ncclBroadcast", |comm, dev| {
            comm.broadcast_in_place(dev, root as i32)
                .map(|_| ())
                .map_err(|e| self.err("ncclBroadcast", e))
        })
    }

    fn broadcast_bytes(&self, buf: &mut Vec<u8>, root: usize) -> Result<()> {
        check_root(self, root)?;
        // The length first, as the bits of two f32 words (a broadcast copies bits, and an
        // f32 value would round lengths above 2^24), then the bytes four to a word.
        let n = buf.len() as u64;
        let mut len = [f32::from_bits(n as u32), f32::from_bits((n >> 32) as u32)];
        self.broadcast(&mut len, root)?;
        let n = (len[0].to_bits() as u64 | ((len[1].to_bits() as u64) << 32)) as usize;
        let mut words: Vec<f32> = buf
            .chunks(4)
            .map(|c| {
                let mut w = [0u8; 4];
                w[..c.len()].copy_from_slice(c);
                f32::from_bits(u32::from_le_bytes(w))
            })
            .collect();
        words.resize(n.div_ceil(4), 0.0);
        self.broadcast(&mut words, root)?;
        *buf = words.iter().flat_map(|w| w.to_bits().to_le_bytes()).take(n).collect();
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.all_reduce_sum(&mut [0.0])
    }

    /// Staged through the device (`ncclReduceScatter` reads device memory only).
    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        check_blocks(self.rank, self.size, "reduce_scatter_sum", send.len(), recv.len())?;
        agree_on_len(self, "reduce_scatter_sum", recv.len())?;
        if recv.is_empty() {
            return Ok(());
        }
        self.staged(send, recv, "ncclReduceScatter", |comm, src, dst| {
            comm.reduce_scatter(src, dst, &ReduceOp::Sum).map(|_| ())
        })
    }

    /// Staged through the device (`ncclAllGather` reads device memory only).
    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        check_blocks(self.rank, self.size, "all_gather_bytes", recv.len(), send.len())?;
        agree_on_len(self, "all_gather_bytes", send.len())?;
        if send.is_empty() {
            return Ok(());
        }
        self.staged(send, recv, "ncclAllGather", |comm, src, dst| {
            comm.all_gather(src, dst).map(|_| ())
        })
    }
}
