//! The NCCL backend (feature `nccl`): one process per CUDA GPU, collectives in device
//! memory through candle's `nccl` feature (cudarc).
//!
//! Unbuilt here: it needs the CUDA toolkit, which the development and CI machines lack, so
//! it is kept out of the CPU build and out of `clippy` (`--features mpi`, never
//! `--all-features`). NCCL collectives block until every rank joins; its own watchdog
//! (`NCCL_TIMEOUT` in recent NCCL) rather than this crate's timeout decides when a dead rank
//! is reported.

use std::sync::{Arc, Mutex};

use candle_core::cuda_backend::cudarc::driver::CudaStream;
use candle_core::cuda_backend::cudarc::nccl::{Comm, Id, ReduceOp};
use candle_core::{Device, Tensor};

use crate::comm::{Communicator, check_root};
use crate::error::{AmpError, DistErrorKind, Result};

/// The NCCL unique id every rank must share (rank 0 makes it, then sends its bytes to the
/// others by any means: a file, `MpiComm::broadcast_bytes`).
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

    /// The id from rank 0's bytes.
    pub fn from_bytes(b: &[u8]) -> Result<Self> {
        let mut internal = [0 as std::ffi::c_char; 128];
        if b.len() != internal.len() {
            return Err(AmpError::InvalidArgument {
                argument: "bytes",
                reason: format!("an NCCL id has 128 bytes, got {}", b.len()),
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
pub struct NcclComm {
    comm: Mutex<Comm>,
    stream: Arc<CudaStream>,
    device: Device,
    rank: usize,
    size: usize,
}

// SAFETY: every NCCL call goes through the mutex (NCCL communicators must not be used by two
// threads at once).
unsafe impl Send for NcclComm {}
// SAFETY: as above.
unsafe impl Sync for NcclComm {}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .finish()
    }
}

impl NcclComm {
    /// Joins the group `id` as `rank` of `world_size` on `device` (a CUDA device).
    pub fn new(device: &Device, rank: usize, world_size: usize, id: NcclId) -> Result<Self> {
        let Device::Cuda(dev) = device else {
            return Err(AmpError::InvalidArgument {
                argument: "device",
                reason: format!("NCCL needs a CUDA device, got {device:?}"),
            });
        };
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

    fn comm(&self) -> std::sync::MutexGuard<'_, Comm> {
        self.comm.lock().unwrap_or_else(|p| p.into_inner())
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
        let host = Tensor::from_slice(buf, buf.len(), &Device::Cpu)?.to_device(&self.device)?;
        let sum = self.all_reduce_sum_tensor(&host)?;
        buf.copy_from_slice(&sum.to_device(&Device::Cpu)?.to_vec1::<f32>()?);
        Ok(())
    }

    fn all_reduce_sum_tensor(&self, t: &Tensor) -> Result<Tensor> {
        let t = t
            .to_dtype(candle_core::DType::F32)?
            .to_device(&self.device)?
            .contiguous()?;
        let n = t.elem_count();
        let send = {
            let (storage, layout) = t.storage_and_layout();
            let candle_core::Storage::Cuda(cs) = &*storage else {
                return Err(backend(self.rank, "the tensor is not on the CUDA device".into()));
            };
            let slice = cs.as_cuda_slice::<f32>()?;
            let (a, _) = layout.contiguous_offsets().expect("contiguous");
            self.stream
                .clone_dtod(&slice.slice(a..a + n))
                .map_err(|e| backend(self.rank, format!("copy: {e:?}")))?
        };
        let mut recv = self
            .stream
            .alloc_zeros::<f32>(n)
            .map_err(|e| backend(self.rank, format!("alloc: {e:?}")))?;
        self.comm()
            .all_reduce(&send, &mut recv, &ReduceOp::Sum)
            .map_err(|e| backend(self.rank, format!("ncclAllReduce: {e:?}")))?;
        let Device::Cuda(dev) = &self.device else {
            unreachable!()
        };
        let storage = candle_core::CudaStorage::wrap_cuda_slice(recv, dev.clone());
        Ok(Tensor::from_storage(
            candle_core::Storage::Cuda(storage),
            t.shape().clone(),
        ))
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<()> {
        check_root(self, root)?;
        let send = self
            .stream
            .memcpy_stod(buf)
            .map_err(|e| backend(self.rank, format!("copy: {e:?}")))?;
        let mut recv = self
            .stream
            .alloc_zeros::<f32>(buf.len())
            .map_err(|e| backend(self.rank, format!("alloc: {e:?}")))?;
        self.comm()
            .broadcast(Some(&send), &mut recv, root as i32)
            .map_err(|e| backend(self.rank, format!("ncclBroadcast: {e:?}")))?;
        let host = self
            .stream
            .memcpy_dtov(&recv)
            .map_err(|e| backend(self.rank, format!("copy: {e:?}")))?;
        buf.copy_from_slice(&host);
        Ok(())
    }

    fn broadcast_bytes(&self, buf: &mut Vec<u8>, root: usize) -> Result<()> {
        // Through f32 words: the length first, then the bytes four at a time.
        let mut len = [buf.len() as f32];
        self.broadcast(&mut len, root)?;
        let n = len[0] as usize;
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
        self.all_reduce_sum(&mut [0.0]).map(|_| ())
    }
}
