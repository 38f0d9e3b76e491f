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

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::{DType, Tensor};

use crate::error::{AmpError, DistErrorKind, Result};

/// How long a collective waits for the other ranks by default before it fails.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// One rank's handle on a group of processes (or threads) that train together.
///
/// Every method is a collective: all ranks call it, in the same order, with buffers of the
/// same length (but [`broadcast_bytes`](Self::broadcast_bytes)). A rank that calls a
/// different collective, or never calls, makes the others fail with a
/// [`DistErrorKind::Timeout`] (or a [`DistErrorKind::Mismatch`] where the backend can tell).
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
    /// stage 2 reduces each gradient shard to its owner this way). The order of the sum is the
    /// backend's: over two ranks it is exact in any order, over more the rounding may differ
    /// from `all_reduce_sum`'s (`LocalGroup` sums in rank order, as its all-reduce does).
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

/// A group of `n` ranks inside one process, one [`LocalComm`] per thread: a test double for
/// the process backends, with the same semantics (including timeouts).
///
/// ```
/// use candle_amp::distributed::{Communicator, LocalGroup};
/// let comms = LocalGroup::new(2);
/// let sums: Vec<Vec<f32>> = std::thread::scope(|s| {
///     let h: Vec<_> = comms
///         .iter()
///         .map(|c| s.spawn(move || {
///             let mut v = vec![c.rank() as f32 + 1.0; 3];
///             c.all_reduce_sum(&mut v).unwrap();
///             v
///         }))
///         .collect();
///     h.into_iter().map(|h| h.join().unwrap()).collect()
/// });
/// assert_eq!(sums, vec![vec![3.0; 3], vec![3.0; 3]]);
/// ```
#[derive(Debug)]
pub struct LocalGroup;

impl LocalGroup {
    /// `n` ranks with the default timeout.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(n: usize) -> Vec<LocalComm> {
        Self::with_timeout(n, DEFAULT_TIMEOUT)
    }

    /// `n` ranks whose collectives fail after waiting `timeout` for the others.
    pub fn with_timeout(n: usize, timeout: Duration) -> Vec<LocalComm> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                generation: 0,
                slots: (0..n).map(|_| None).collect(),
                arrived: 0,
                last: None,
                timed_out: None,
            }),
            changed: Condvar::new(),
        });
        (0..n)
            .map(|rank| LocalComm {
                rank,
                size: n,
                timeout,
                shared: shared.clone(),
                generation: AtomicU64::new(0),
                failed: AtomicBool::new(false),
            })
            .collect()
    }
}

/// One rank of a [`LocalGroup`]. Use it from one thread at a time.
#[derive(Debug)]
pub struct LocalComm {
    rank: usize,
    size: usize,
    timeout: Duration,
    shared: Arc<Shared>,
    /// The collective this rank is at.
    generation: AtomicU64,
    /// Whether this rank has already returned the group's failure.
    failed: AtomicBool,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

/// A collective's contributions: each rank's op name and bytes.
type Contributions = Arc<Vec<(&'static str, Vec<u8>)>>;

#[derive(Debug)]
struct State {
    generation: u64,
    slots: Vec<Option<(&'static str, Vec<u8>)>>,
    arrived: usize,
    /// The last completed collective: its generation and every rank's contribution.
    last: Option<(u64, Contributions)>,
    /// The rank that timed out, which poisons the group. Set, checked and acted on under the
    /// same lock as the arrivals, so a collective completes only if no rank has timed out in
    /// it: a rank that timed out never has its contribution used.
    timed_out: Option<usize>,
}

impl LocalComm {
    /// Every rank's `payload` for this collective (an all-gather of bytes), in rank order.
    fn exchange(&self, op: &'static str, payload: Vec<u8>) -> Result<Contributions> {
        let generation_now = self.generation.load(Ordering::Relaxed);
        let mut st = self.shared.state.lock().unwrap_or_else(|p| p.into_inner());
        // Checked under the lock that completes collectives: no rank can time out between
        // this check and this rank's arrival.
        if let Some(r) = st.timed_out {
            return Err(self.group_failed(op, r));
        }
        st.slots[self.rank] = Some((op, payload));
        st.arrived += 1;
        if st.arrived == self.size {
            let all: Vec<_> = st
                .slots
                .iter_mut()
                .map(|s| s.take().expect("every rank arrived"))
                .collect();
            st.last = Some((generation_now, Arc::new(all)));
            st.arrived = 0;
            st.generation += 1;
            self.shared.changed.notify_all();
        } else {
            st = self.wait(st, op, generation_now)?;
        }
        let (g, all) = st.last.clone().expect("a completed collective");
        drop(st);
        debug_assert_eq!(g, generation_now);
        self.generation.store(generation_now + 1, Ordering::Relaxed);
        if let Some((r, (other, _))) = all.iter().enumerate().find(|(_, (o, _))| *o != op) {
            return Err(self.fail(
                DistErrorKind::Mismatch,
                format!("rank {} called `{op}` while rank {r} called `{other}`", self.rank),
            ));
        }
        Ok(all)
    }

    /// Waits (holding `st` between wake-ups) until the collective at `generation_now`
    /// completes, or fails it: on this rank's deadline, or when another rank timed out.
    fn wait<'a>(
        &self,
        mut st: MutexGuard<'a, State>,
        op: &'static str,
        generation_now: u64,
    ) -> Result<MutexGuard<'a, State>> {
        let deadline = Instant::now() + self.timeout;
        while st.generation == generation_now {
            if let Some(r) = st.timed_out {
                return Err(self.group_failed(op, r));
            }
            let now = Instant::now();
            if now >= deadline {
                // Under the lock: the collective has not completed (checked above) and now
                // cannot, so no rank gets a result that includes this rank's contribution.
                st.timed_out = Some(self.rank);
                st.slots[self.rank] = None;
                st.arrived -= 1;
                self.failed.store(true, Ordering::Relaxed);
                self.shared.changed.notify_all();
                let waiting = st.slots.iter().filter(|s| s.is_none()).count() - 1;
                return Err(self.fail(
                    DistErrorKind::Timeout,
                    format!(
                        "`{op}` waited {:?} for {waiting} other rank(s) that never called it (a rank \
                         failed, stopped, or called another collective)",
                        self.timeout
                    ),
                ));
            }
            st = self
                .shared
                .changed
                .wait_timeout(st, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        Ok(st)
    }

    /// The error of a group in which rank `timed_out` timed out: a timeout of this
    /// collective the first time this rank hears of it, then a failed group.
    fn group_failed(&self, op: &str, timed_out: usize) -> AmpError {
        if self.failed.swap(true, Ordering::Relaxed) {
            return self.fail(
                DistErrorKind::Backend,
                "the group failed earlier (a rank timed out); start a new group".into(),
            );
        }
        self.fail(
            DistErrorKind::Timeout,
            format!("rank {timed_out} timed out waiting in `{op}`, so it cannot complete"),
        )
    }

    fn fail(&self, kind: DistErrorKind, detail: String) -> AmpError {
        AmpError::Distributed {
            rank: self.rank,
            kind,
            detail,
        }
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn f32_from(b: &[u8]) -> impl Iterator<Item = f32> + '_ {
    b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
}

fn check_len(rank: usize, op: &str, all: &[(&'static str, Vec<u8>)], n: usize) -> Result<()> {
    match all.iter().enumerate().find(|(_, (_, b))| b.len() != n) {
        Some((r, (_, b))) => Err(AmpError::Distributed {
            rank,
            kind: DistErrorKind::Mismatch,
            detail: format!(
                "`{op}` with {} values here but {} on rank {r}: every rank must pass the same length",
                n / 4,
                b.len() / 4
            ),
        }),
        None => Ok(()),
    }
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

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    fn backend(&self) -> &'static str {
        "local"
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        let all = self.exchange("all_reduce_sum", f32_bytes(buf))?;
        check_len(self.rank, "all_reduce_sum", &all, buf.len() * 4)?;
        // In rank order on every rank: the same sum everywhere.
        buf.fill(0.0);
        for (_, b) in all.iter() {
            for (d, x) in buf.iter_mut().zip(f32_from(b)) {
                *d += x;
            }
        }
        Ok(())
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<()> {
        check_root(self, root)?;
        let all = self.exchange("broadcast", f32_bytes(buf))?;
        check_len(self.rank, "broadcast", &all, buf.len() * 4)?;
        for (d, x) in buf.iter_mut().zip(f32_from(&all[root].1)) {
            *d = x;
        }
        Ok(())
    }

    fn broadcast_bytes(&self, buf: &mut Vec<u8>, root: usize) -> Result<()> {
        check_root(self, root)?;
        let all = self.exchange("broadcast_bytes", buf.clone())?;
        buf.clone_from(&all[root].1);
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.exchange("barrier", Vec::new()).map(|_| ())
    }

    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        check_blocks(self.rank, self.size, "reduce_scatter_sum", send.len(), recv.len())?;
        let all = self.exchange("reduce_scatter_sum", f32_bytes(send))?;
        // Every rank's length is known here, before any value is combined.
        check_len(self.rank, "reduce_scatter_sum", &all, send.len() * 4)?;
        let (a, b) = (self.rank * recv.len() * 4, (self.rank + 1) * recv.len() * 4);
        // Summed in rank order from zero, as `all_reduce_sum` does: the same bits.
        recv.fill(0.0);
        for (_, bytes) in all.iter() {
            for (d, x) in recv.iter_mut().zip(f32_from(&bytes[a..b])) {
                *d += x;
            }
        }
        Ok(())
    }

    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        check_blocks(self.rank, self.size, "all_gather_bytes", recv.len(), send.len())?;
        let all = self.exchange("all_gather_bytes", send.to_vec())?;
        if let Some((r, (_, b))) = all.iter().enumerate().find(|(_, (_, b))| b.len() != send.len()) {
            return Err(self.fail(
                DistErrorKind::Mismatch,
                format!(
                    "`all_gather_bytes` with {} bytes here but {} on rank {r}: every rank must pass the same length",
                    send.len(),
                    b.len()
                ),
            ));
        }
        for (r, (_, b)) in all.iter().enumerate() {
            recv[r * send.len()..(r + 1) * send.len()].copy_from_slice(b);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// The device the tests run on: `CANDLE_AMP_TEST_DEVICE=cuda` (with the `cuda` feature)
    /// or the CPU.
    fn test_device() -> Device {
        match std::env::var("CANDLE_AMP_TEST_DEVICE").as_deref() {
            #[cfg(feature = "cuda")]
            Ok("cuda") => Device::new_cuda(0).expect("CANDLE_AMP_TEST_DEVICE=cuda needs a CUDA device"),
            _ => Device::Cpu,
        }
    }

    #[test]
    fn the_default_tensor_all_reduce_sums_on_the_tensors_device_and_refuses_other_types() {
        let dev = test_device();
        let comms = LocalGroup::with_timeout(2, Duration::from_secs(60));
        let results: Vec<(Tensor, Tensor, Vec<AmpError>, Tensor)> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .iter()
                .map(|c| {
                    let dev = dev.clone();
                    s.spawn(move || {
                        let r = c.rank() as f32;
                        let t = Tensor::new(&[r + 1.0, 10.0 * (r + 1.0), -0.5, 0.25 * r], &dev).unwrap();
                        let sum = c.all_reduce_sum_tensor(&t).unwrap();
                        let empty = c
                            .all_reduce_sum_tensor(&Tensor::zeros(0, DType::F32, &dev).unwrap())
                            .unwrap();
                        // Refused on rank 0 only: had either call entered the collective, the
                        // ranks' next collectives would pair wrongly and fail.
                        let refused = if c.rank() == 0 {
                            vec![
                                c.all_reduce_sum_tensor(&t.to_dtype(DType::F16).unwrap()).unwrap_err(),
                                c.all_reduce_sum_tensor(&t.reshape((2, 2)).unwrap()).unwrap_err(),
                            ]
                        } else {
                            Vec::new()
                        };
                        let after = c.all_reduce_sum_tensor(&t.affine(1.0, 1.0).unwrap()).unwrap();
                        (sum, empty, refused, after)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (rank, (sum, empty, refused, after)) in results.iter().enumerate() {
            for t in [sum, empty, after] {
                assert!(t.device().same_device(&dev), "rank {rank}: {:?}", t.device());
                assert_eq!(t.dtype(), DType::F32);
            }
            assert_eq!(sum.to_vec1::<f32>().unwrap(), [3.0, 30.0, -1.0, 0.25], "rank {rank}");
            assert_eq!(after.to_vec1::<f32>().unwrap(), [5.0, 32.0, 1.0, 2.25], "rank {rank}");
            assert_eq!(empty.dims(), [0]);
            for e in refused {
                assert!(
                    matches!(e, AmpError::InvalidArgument { argument: "t", .. }),
                    "rank {rank}: {e}"
                );
            }
        }
        let msgs: Vec<String> = results[0].2.iter().map(|e| e.to_string()).collect();
        assert!(msgs[0].contains("F16") && msgs[0].contains("to_dtype"), "{}", msgs[0]);
        assert!(
            msgs[1].contains("[2, 2]") && msgs[1].contains("flatten_all"),
            "{}",
            msgs[1]
        );
    }

    /// Spins until `at` (sleeping is too coarse for the windows this test aims at).
    fn spin_until(at: Instant) {
        while Instant::now() < at {
            std::hint::spin_loop();
        }
    }

    #[test]
    fn a_rank_that_timed_out_is_never_part_of_a_completed_collective() {
        // Rank 1 arrives around rank 0's deadline: rank 0 either sees it (both complete) or
        // times out, and then rank 1 must fail too instead of completing with rank 0's
        // contribution.
        let timeout = Duration::from_micros(300);
        let (mut completed, mut failed) = (0, 0);
        for i in 0..3000u64 {
            let comms = LocalGroup::with_timeout(2, timeout);
            let start = Instant::now();
            let delay = Duration::from_micros((i * 7919) % 600);
            let results: Vec<Result<Vec<f32>>> = std::thread::scope(|s| {
                let handles: Vec<_> = comms
                    .iter()
                    .map(|c| {
                        s.spawn(move || {
                            if c.rank() == 1 {
                                spin_until(start + delay);
                            }
                            let mut v = vec![c.rank() as f32 + 1.0; 4];
                            c.all_reduce_sum(&mut v).map(|()| v)
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            match (&results[0], &results[1]) {
                (Ok(a), Ok(b)) => {
                    assert_eq!((a, b), (&vec![3.0; 4], &vec![3.0; 4]), "iteration {i}");
                    completed += 1;
                }
                (Err(_), Err(_)) => failed += 1,
                (a, b) => panic!("iteration {i} (delay {delay:?}): rank 0 {a:?}, rank 1 {b:?}"),
            }
            for (r, res) in results.iter().enumerate() {
                if let Err(e) = res {
                    assert!(
                        matches!(
                            e,
                            AmpError::Distributed {
                                kind: DistErrorKind::Timeout,
                                ..
                            }
                        ),
                        "iteration {i} rank {r}: {e}"
                    );
                }
            }
        }
        eprintln!("{completed} completed, {failed} timed out");
    }
}
