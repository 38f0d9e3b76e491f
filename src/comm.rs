//! What data-parallel training needs from a process group, and an in-process group of
//! threads that implements it as a test double.
//!
//! A [`Communicator`] is one rank's handle on a group of `world_size` ranks that run the
//! same program: every rank calls the same collectives in the same order, and a call
//! returns when every rank has made it. The MPI backend (`distributed::MpiComm`, feature `mpi`) and
//! the NCCL backend (`distributed::NcclComm`, feature `nccl`) implement it for real processes;
//! [`LocalGroup`] implements it for threads of one process, so the data-parallel logic is
//! tested without launching anything.
//!
//! Collectives fail instead of hanging: a rank that waits longer than the group's timeout
//! for the others returns [`AmpError::Distributed`] with [`DistErrorKind::Timeout`], and the
//! group is unusable afterwards (as an MPI communicator is after an error).

use std::time::Duration;

use candle_core::{DType, Tensor};

use crate::error::{AmpError, DistErrorKind, Result};

mod local;

pub use local::{LocalComm, LocalGroup};

/// How long a collective waits for the other ranks by default before it fails.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// One rank's handle on a group of processes (or threads) that train together.
///
/// Every method is a collective: all ranks call it, in the same order, with buffers of the
/// same length (but [`broadcast_bytes`](Self::broadcast_bytes)) and the same root. A rank
/// that never calls makes the others fail with a [`DistErrorKind::Timeout`]. Ranks that call
/// different collectives, or the same one with different lengths, bucket splits or roots,
/// all fail with a [`DistErrorKind::Mismatch`] before any data moves, their buffers
/// untouched and the group still paired, on [`LocalGroup`] and `MpiComm` (whose every call
/// starts with a small header collective for this); `NcclComm` cannot tell (NCCL does not
/// compare counts: such ranks hang until the timeout, or mix data), nor can the trait's
/// defaults over a backend that cannot.
///
/// Sums: [`LocalGroup`] and `MpiComm` add in rank order (`0 + rank 0's + rank 1's + ...`)
/// for every element, whatever the collective or the buffers' split, so an all-reduce, a
/// reduce-scatter and any bucketing of the same values give the same bits on any number of
/// ranks, and the two backends give each other's bits.
pub trait Communicator: Send + Sync + std::fmt::Debug {
    /// This rank, `0..world_size()`.
    fn rank(&self) -> usize;

    /// How many ranks the group has.
    fn world_size(&self) -> usize;

    /// The backend's name for messages (`"mpi"`, `"nccl"`, `"local"`).
    fn backend(&self) -> &'static str;

    /// Sums `buf` element-wise over the ranks, in place, in f32; every rank gets the same
    /// values, bit for bit.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()>;

    /// [`all_reduce_sum`](Self::all_reduce_sum) over several buffers (gradient buckets). A
    /// backend may run them concurrently; the default runs them one after another.
    /// `LocalGroup` and `MpiComm` agree on every bucket's length first: ranks that split the
    /// buffers differently all fail with [`DistErrorKind::Mismatch`] before any is summed
    /// (the default, pairing bucket by bucket, may sum the first ones before it can tell).
    fn all_reduce_sum_buckets(&self, bufs: &mut [&mut [f32]]) -> Result<()> {
        for b in bufs.iter_mut() {
            self.all_reduce_sum(b)?;
        }
        Ok(())
    }

    /// Sums a 1-d f32 tensor element-wise across ranks and returns the sum on the tensor's device.
    ///
    /// Every rank passes a tensor of the same length; every rank gets the same values, bit
    /// for bit. Any other type or rank is an [`AmpError::InvalidArgument`] before anything
    /// is sent (convert with `to_dtype(DType::F32)`, flatten with `flatten_all`). The
    /// default goes through host memory (`to_vec1`, [`all_reduce_sum`](Self::all_reduce_sum),
    /// a new tensor on `t`'s device); a device backend overrides it to reduce in device
    /// memory (`NcclComm`: no host copy, no synchronisation).
    fn all_reduce_sum_tensor(&self, t: &Tensor) -> Result<Tensor> {
        check_sum_tensor(t)?;
        let mut v = t.to_vec1::<f32>()?;
        self.all_reduce_sum(&mut v)?;
        Ok(Tensor::from_vec(v, t.elem_count(), t.device())?)
    }

    /// Whether [`all_reduce_sum_tensor`](Self::all_reduce_sum_tensor) sums tensors on this
    /// communicator's device in device memory, without reading them on the host. `false` by
    /// default (the default `all_reduce_sum_tensor` reads every tensor on the host once);
    /// a backend that overrides `all_reduce_sum_tensor` to reduce in device memory answers
    /// `true` (`NcclComm`). `DataParallel` and synchronised batch norm count one host read
    /// ([`crate::Amp::host_syncs`]) per tensor sum of a communicator that answers `false`.
    fn reduces_in_device_memory(&self) -> bool {
        false
    }

    /// Copies rank `root`'s `buf` into every rank's `buf` (all the same length).
    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<()>;

    /// Copies rank `root`'s bytes to every rank; the others' vectors are resized to match.
    fn broadcast_bytes(&self, buf: &mut Vec<u8>, root: usize) -> Result<()>;

    /// Returns when every rank has called it.
    fn barrier(&self) -> Result<()>;

    /// Sums `send` element-wise over the ranks and leaves this rank's block of the sum in
    /// `recv` (`MPI_Reduce_scatter_block`, `ncclReduceScatter`, PyTorch's
    /// `reduce_scatter_tensor`): `send` holds `world_size()` blocks of `recv.len()` values,
    /// and rank `r` gets the sum of every rank's block `r`, the same bits as the matching
    /// part of [`all_reduce_sum`](Self::all_reduce_sum) gives on the same backend (ZeRO
    /// stage 2 reduces each gradient shard to its owner this way). `LocalGroup` and `MpiComm`
    /// add in rank order in both, so the bits match on any number of ranks; for another
    /// backend the order is its own: over two ranks the sum is exact in any order, over more
    /// the rounding may differ from `all_reduce_sum`'s (NCCL picks its algorithms).
    ///
    /// Every rank must pass the same partition (the same `recv.len()`). A `send` that is not
    /// `world_size()` blocks is an [`AmpError::InvalidArgument`] on that rank before anything
    /// is sent; ranks that disagree on the block length all fail with a
    /// [`DistErrorKind::Mismatch`] before any data moves, and `recv` is left as it was. The
    /// default agrees on the length first, then all-reduces the whole buffer and keeps this
    /// rank's block (the traffic of an all-reduce); the backends override it.
    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        check_blocks(
            self.rank(),
            self.world_size(),
            "reduce_scatter_sum",
            send.len(),
            recv.len(),
        )?;
        agree_on_len(self, "reduce_scatter_sum", recv.len())?;
        let mut all = send.to_vec();
        self.all_reduce_sum(&mut all)?;
        let r = self.rank();
        recv.copy_from_slice(&all[r * recv.len()..(r + 1) * recv.len()]);
        Ok(())
    }

    /// Gathers every rank's `send` into `recv`, rank `r`'s bytes at `r * send.len()`
    /// (`MPI_Allgather`, `ncclAllGather`, PyTorch's `all_gather_into_tensor`): every rank
    /// gets the same bytes. Bytes, so any element type travels at its own size (ZeRO's
    /// half working weights: half the bytes of f32).
    ///
    /// Every rank must pass the same `send.len()`; `recv` must hold `world_size()` times
    /// that ([`AmpError::InvalidArgument`] before anything is sent otherwise). Ranks that
    /// disagree on the length all fail with a [`DistErrorKind::Mismatch`] before any data
    /// moves, `recv` untouched. The default agrees on the length, then broadcasts each
    /// rank's bytes in turn; the backends override it.
    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        check_blocks(
            self.rank(),
            self.world_size(),
            "all_gather_bytes",
            recv.len(),
            send.len(),
        )?;
        agree_on_len(self, "all_gather_bytes", send.len())?;
        for r in 0..self.world_size() {
            let mut b = if r == self.rank() { send.to_vec() } else { Vec::new() };
            self.broadcast_bytes(&mut b, r)?;
            recv[r * send.len()..(r + 1) * send.len()].copy_from_slice(&b);
        }
        Ok(())
    }
}

/// That `whole` is `world` blocks of `block` values: the local half of a reduce-scatter's or
/// an all-gather's partition check.
pub(crate) fn check_blocks(rank: usize, world: usize, op: &str, whole: usize, block: usize) -> Result<()> {
    if Some(whole) != block.checked_mul(world) {
        return Err(AmpError::InvalidArgument {
            argument: if op == "all_gather_bytes" { "recv" } else { "send" },
            reason: format!(
                "`{op}` on rank {rank} of {world}: {whole} values are not {world} blocks of {block}; pass \
                 world_size() blocks of the per-rank length"
            ),
        });
    }
    Ok(())
}

/// Fails on every rank with a [`DistErrorKind::Mismatch`] unless every rank passes the same
/// `len` (rank 0's length is broadcast, then the disagreements are counted), so a collective
/// over a partition the ranks disagree on never starts.
pub(crate) fn agree_on_len<C: Communicator + ?Sized>(c: &C, op: &str, len: usize) -> Result<()> {
    let mut root = (len as u64).to_le_bytes().to_vec();
    c.broadcast_bytes(&mut root, 0)?;
    let root_len = u64::from_le_bytes(root.as_slice().try_into().unwrap_or([0xFF; 8]));
    let mut bad = [if root_len == len as u64 { 0.0f32 } else { 1.0 }];
    c.all_reduce_sum(&mut bad)?;
    if bad[0] == 0.0 {
        return Ok(());
    }
    Err(AmpError::Distributed {
        rank: c.rank(),
        kind: DistErrorKind::Mismatch,
        detail: format!(
            "`{op}` with blocks of {len} here and {root_len} on rank 0 ({} rank(s) differ from rank 0): \
             every rank must pass the same partition; nothing was sent",
            bad[0] as usize
        ),
    })
}

/// What [`Communicator::all_reduce_sum_tensor`] accepts: a 1-d f32 tensor.
pub(crate) fn check_sum_tensor(t: &Tensor) -> Result<()> {
    if t.dtype() != DType::F32 {
        return Err(AmpError::InvalidArgument {
            argument: "t",
            reason: format!(
                "all_reduce_sum_tensor sums f32 tensors, got {:?}: convert it with to_dtype(DType::F32) first",
                t.dtype()
            ),
        });
    }
    if t.rank() != 1 {
        return Err(AmpError::InvalidArgument {
            argument: "t",
            reason: format!(
                "all_reduce_sum_tensor sums 1-d tensors, got shape {:?}: flatten it with flatten_all first",
                t.dims()
            ),
        });
    }
    Ok(())
}

/// A root outside the group (checked before any rank waits on it).
pub(crate) fn check_root(c: &dyn Communicator, root: usize) -> Result<()> {
    if root >= c.world_size() {
        return Err(AmpError::InvalidArgument {
            argument: "root",
            reason: format!("rank {root} is not in a group of {} rank(s)", c.world_size()),
        });
    }
    Ok(())
}

/// `5 values`, or `3 buckets of [2, 2, 1] values`.
pub(crate) fn describe_lens(lens: &[usize]) -> String {
    match lens {
        [n] => format!("{n} values"),
        _ => format!("{} buckets of {lens:?} values", lens.len()),
    }
}
