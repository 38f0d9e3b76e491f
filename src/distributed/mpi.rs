//! The MPI backend (feature `mpi`): rsmpi over the system's MPI (Debian's OpenMPI), one
//! process per rank, launched with `mpirun -np N`.
//!
//! MPI has no half type, and the library reduces f32 master gradients anyway, so every
//! collective moves f32 (or bytes). Collectives are MPI's non-blocking ones, polled until
//! they complete or the timeout passes: a rank that died or stopped makes the others return
//! [`DistErrorKind::Timeout`] instead of hanging (their buffers are then leaked, since MPI
//! may still write into them; the process should exit). The buckets of one step are in
//! flight together.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use mpi::Threading;
use mpi::collective::{CommunicatorCollectives, Root, SystemOperation};
use mpi::request::{Request, StaticScope};
use mpi::topology::{Communicator as _, SimpleCommunicator};

use crate::comm::{Communicator, DEFAULT_TIMEOUT, agree_on_len, check_blocks, check_root};
use crate::error::{AmpError, DistErrorKind, Result};

/// A rank of an MPI job (`MPI_COMM_WORLD`). Make one per process, at the start of `main`;
/// dropping it finalises MPI.
pub struct MpiComm {
    // Field order: the communicator goes before the universe that finalises MPI.
    world: Mutex<SimpleCommunicator>,
    rank: usize,
    size: usize,
    /// The timeout in nanoseconds (changeable while shared: [`MpiComm::set_timeout`]).
    timeout_ns: AtomicU64,
    _universe: mpi::environment::Universe,
}

// SAFETY: MPI is initialised with `Threading::Serialized` (checked in `init`), and every call
// goes through the mutex, so no two threads call MPI at once.
unsafe impl Send for MpiComm {}
// SAFETY: as above.
unsafe impl Sync for MpiComm {}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiComm")
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("timeout", &self.timeout())
            .finish()
    }
}

impl MpiComm {
    /// Whether this process was started by an MPI launcher (`mpirun`, `srun`): the
    /// environment variables they set are present.
    pub fn launched() -> bool {
        ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS"]
            .iter()
            .any(|v| std::env::var_os(v).is_some())
    }

    /// Initialises MPI with the default timeout (300 s).
    pub fn init() -> Result<Self> {
        Self::with_timeout(DEFAULT_TIMEOUT)
    }

    /// Initialises MPI; collectives fail after waiting `timeout` for the other ranks.
    pub fn with_timeout(timeout: Duration) -> Result<Self> {
        let backend = |detail: String| AmpError::Distributed {
            rank: 0,
            kind: DistErrorKind::Backend,
            detail,
        };
        let (universe, threading) = mpi::initialize_with_threading(Threading::Serialized).ok_or_else(|| {
            backend("MPI is already initialised in this process: make one MpiComm per process".into())
        })?;
        if threading < Threading::Serialized {
            return Err(backend(format!(
                "this MPI grants thread level {threading:?}; serialized calls from several threads are needed"
            )));
        }
        let world = universe.world();
        let (rank, size) = (world.rank() as usize, world.size() as usize);
        Ok(Self {
            world: Mutex::new(world),
            rank,
            size,
            timeout_ns: AtomicU64::new(timeout.as_nanos().min(u64::MAX as u128) as u64),
            _universe: universe,
        })
    }

    /// How long a collective waits for the other ranks before failing.
    pub fn timeout(&self) -> Duration {
        Duration::from_nanos(self.timeout_ns.load(Ordering::Relaxed))
    }

    /// Changes how long the next collectives wait for the other ranks (e.g. longer around
    /// a slow rank-0-only step, such as writing a large checkpoint, then back).
    pub fn set_timeout(&self, timeout: Duration) {
        self.timeout_ns
            .store(timeout.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
    }

    fn err(&self, kind: DistErrorKind, detail: String) -> AmpError {
        AmpError::Distributed {
            rank: self.rank,
            kind,
            detail,
        }
    }

    /// Polls `reqs` until all complete or the deadline passes. On a timeout the incomplete
    /// requests are released to MPI (their buffers must stay leaked).
    fn wait_all<D: ?Sized>(&self, op: &str, reqs: Vec<Request<'static, D, StaticScope>>) -> Result<()> {
        let timeout = self.timeout();
        let deadline = Instant::now() + timeout;
        let mut pending = reqs;
        loop {
            let mut still = Vec::new();
            for r in pending {
                if let Err(r) = r.test() {
                    still.push(r);
                }
            }
            if still.is_empty() {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let n = still.len();
                for r in still {
                    // SAFETY: the buffers the request uses are leaked by the caller on this
                    // path, so MPI may complete it at any later time.
                    let _ = unsafe { r.into_raw() };
                }
                return Err(self.err(
                    DistErrorKind::Timeout,
                    format!(
                        "`{op}` waited {:?} and {n} request(s) are still incomplete: another rank failed, stopped \
                         or called a different collective. Exit this process (mpirun stops the others)",
                        timeout
                    ),
                ));
            }
            pending = still;
            std::thread::yield_now();
        }
    }

    /// One non-blocking collective from `send` into `recv`, started by `start` on leaked
    /// copies of both (MPI may still use them after a timeout), waited for at most the
    /// timeout.
    fn one_collective<T: Copy + Default + 'static>(
        &self,
        op: &str,
        send: &[T],
        recv: &mut [T],
        start: impl FnOnce(&SimpleCommunicator, &'static [T], &'static mut [T]) -> Request<'static, [T], StaticScope>,
    ) -> Result<()> {
        let world = self.world();
        let s = Leaked::new(send.to_vec());
        let r = Leaked::new(vec![T::default(); recv.len()]);
        let req = start(&world, &*s.view(), r.view());
        if let Err(e) = self.wait_all(op, vec![req]) {
            s.leak();
            r.leak();
            return Err(e);
        }
        recv.copy_from_slice(&r.take());
        drop(s.take());
        Ok(())
    }

    fn world(&self) -> std::sync::MutexGuard<'_, SimpleCommunicator> {
        self.world.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// A heap buffer handed to MPI for a non-blocking call: leaked while MPI may use it, freed
/// once the call completed.
struct Leaked<T: 'static> {
    ptr: *mut [T],
}

impl<T: Copy + 'static> Leaked<T> {
    fn new(v: Vec<T>) -> Self {
        Self {
            ptr: Box::into_raw(v.into_boxed_slice()),
        }
    }

    /// A `'static` view for MPI. The caller either frees it after the call completed or
    /// leaks it.
    fn view(&self) -> &'static mut [T] {
        // SAFETY: the allocation is never freed while a view may be in use (see `free`).
        unsafe { &mut *self.ptr }
    }

    /// Gives the buffer up to MPI for good (a call that may still write into it timed
    /// out): `Leaked` has no `Drop`, so the allocation simply stays.
    fn leak(self) {}

    /// Copies the values out and frees the buffer (the call using it has completed).
    fn take(self) -> Vec<T> {
        // SAFETY: `ptr` came from `Box::into_raw` and no view is used any more.
        let b = unsafe { Box::from_raw(self.ptr) };
        b.into_vec()
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    fn backend(&self) -> &'static str {
        "mpi"
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        self.all_reduce_sum_buckets(&mut [buf])
    }

    fn all_reduce_sum_buckets(&self, bufs: &mut [&mut [f32]]) -> Result<()> {
        let world = self.world();
        let mut pairs = Vec::with_capacity(bufs.len());
        let mut reqs = Vec::with_capacity(bufs.len());
        for b in bufs.iter() {
            let send = Leaked::new(b.to_vec());
            let recv = Leaked::new(vec![0f32; b.len()]);
            reqs.push(world.immediate_all_reduce_into(StaticScope, &*send.view(), recv.view(), SystemOperation::sum()));
            pairs.push((send, recv));
        }
        if let Err(e) = self.wait_all("all_reduce_sum", reqs) {
            pairs.leak();
            return Err(e);
        }
        for (b, (send, recv)) in bufs.iter_mut().zip(pairs) {
            b.copy_from_slice(&recv.take());
            drop(send.take());
        }
        Ok(())
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<()> {
        check_root(self, root)?;
        let world = self.world();
        let data = Leaked::new(buf.to_vec());
        let req = world
            .process_at_rank(root as i32)
            .immediate_broadcast_into(StaticScope, data.view());
        if let Err(e) = self.wait_all("broadcast", vec![req]) {
            data.leak();
            return Err(e);
        }
        buf.copy_from_slice(&data.take());
        Ok(())
    }

    fn broadcast_bytes(&self, buf: &mut Vec<u8>, root: usize) -> Result<()> {
        check_root(self, root)?;
        let world = self.world();
        let len = Leaked::new(vec![buf.len() as u64]);
        let req = world
            .process_at_rank(root as i32)
            .immediate_broadcast_into(StaticScope, len.view());
        if let Err(e) = self.wait_all("broadcast_bytes", vec![req]) {
            len.leak();
            return Err(e);
        }
        let n = len.take()[0] as usize;
        let mut v = buf.clone();
        v.resize(n, 0);
        let data = Leaked::new(v);
        let req = world
            .process_at_rank(root as i32)
            .immediate_broadcast_into(StaticScope, data.view());
        if let Err(e) = self.wait_all("broadcast_bytes", vec![req]) {
            data.leak();
            return Err(e);
        }
        *buf = data.take();
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        let world = self.world();
        let req = world.immediate_barrier();
        self.wait_all("barrier", vec![req])
    }

    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        check_blocks(self.rank, self.size, "reduce_scatter_sum", send.len(), recv.len())?;
        // MPI cannot tell ranks with different counts apart (it would hang or mix data).
        agree_on_len(self, "reduce_scatter_sum", recv.len())?;
        if recv.is_empty() {
            return Ok(());
        }
        self.one_collective("reduce_scatter_sum", send, recv, |world, s, r| {
            world.immediate_reduce_scatter_block_into(StaticScope, s, r, SystemOperation::sum())
        })
    }

    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        check_blocks(self.rank, self.size, "all_gather_bytes", recv.len(), send.len())?;
        agree_on_len(self, "all_gather_bytes", send.len())?;
        if send.is_empty() {
            return Ok(());
        }
        self.one_collective("all_gather_bytes", send, recv, |world, s, r| {
            world.immediate_all_gather_into(StaticScope, s, r)
        })
    }
}
