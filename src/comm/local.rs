//! [`LocalGroup`]: the ranks of a group as threads of one process, the test double of the
//! process backends. Each collective is one exchange of every rank's payload under a lock;
//! ranks that call different collectives, or pass different lengths, all fail with a
//! [`DistErrorKind::Mismatch`] before any value is combined, and the payloads are released
//! as soon as the last rank has read them. A rank whose thread panics while it holds its
//! communicator (dropped as the thread unwinds) breaks the group: every collective not
//! completed yet fails at once with [`DistErrorKind::PeerFailed`], so a panic on one rank
//! ends its peers promptly instead of leaving them waiting out the timeout. A rank that
//! merely stops calling (returns early) is a silent peer, as a stopped process is to MPI:
//! the others time out.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::{Communicator, DEFAULT_TIMEOUT, check_blocks, check_root, describe_lens};
use crate::error::{AmpError, DistErrorKind, Result};

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
                panicked: None,
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

/// A completed collective whose result some rank has not taken yet.
#[derive(Debug)]
struct Last {
    generation: u64,
    all: Contributions,
    /// Ranks that have not taken `all` yet: the last one clears [`State::last`], so the
    /// payloads live only as long as the calls that use them (a group that kept them would
    /// hold its largest recent collective's data, once per rank, for the run's life).
    unread: usize,
}

#[derive(Debug)]
struct State {
    generation: u64,
    slots: Vec<Option<(&'static str, Vec<u8>)>>,
    arrived: usize,
    /// The last completed collective, until every rank has taken its result.
    last: Option<Last>,
    /// The rank that timed out, which poisons the group. Set, checked and acted on under the
    /// same lock as the arrivals, so a collective completes only if no rank has timed out in
    /// it: a rank that timed out never has its contribution used.
    timed_out: Option<usize>,
    /// The first rank whose thread panicked while holding its communicator: it can never
    /// arrive again, so no later collective can complete.
    panicked: Option<usize>,
}

impl Drop for LocalComm {
    /// A rank dropped while its thread panics breaks the group: peers waiting in a
    /// collective it will never reach fail at once with [`DistErrorKind::PeerFailed`]
    /// instead of waiting out the timeout (a panicking rank left its peers blocked for the
    /// whole timeout, a minute in the tests, for each of their collectives). A collective
    /// that already completed is unaffected: its result stays for the ranks that have not
    /// taken it yet. An ordinary drop changes nothing (a rank that stopped early is a
    /// silent peer, and the others time out as they would with MPI).
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let mut st = self.shared.state.lock().unwrap_or_else(|p| p.into_inner());
        st.panicked.get_or_insert(self.rank);
        self.shared.changed.notify_all();
    }
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
        if let Some(r) = st.panicked {
            return Err(self.peer_panicked(op, r));
        }
        st.slots[self.rank] = Some((op, payload));
        st.arrived += 1;
        if st.arrived == self.size {
            let all: Vec<_> = st
                .slots
                .iter_mut()
                .map(|s| s.take().expect("every rank arrived"))
                .collect();
            st.last = Some(Last {
                generation: generation_now,
                all: Arc::new(all),
                unread: self.size,
            });
            st.arrived = 0;
            st.generation += 1;
            self.shared.changed.notify_all();
        } else {
            st = self.wait(st, op, generation_now)?;
        }
        // Every rank that arrived takes the result exactly once (a rank leaves `wait` only
        // when the collective completed, and the next cannot complete before it arrives), so
        // the count reaches 0 once all have it.
        let last = st.last.as_mut().expect("a completed collective");
        debug_assert_eq!(last.generation, generation_now);
        let all = last.all.clone();
        last.unread -= 1;
        if last.unread == 0 {
            st.last = None;
        }
        drop(st);
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
            if let Some(r) = st.panicked {
                // Under the lock, as a timeout: the collective has not completed and now
                // cannot, so this rank's contribution is withdrawn.
                st.slots[self.rank] = None;
                st.arrived -= 1;
                return Err(self.peer_panicked(op, r));
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

    /// The error of a collective that rank `rank` panicked before reaching.
    fn peer_panicked(&self, op: &str, rank: usize) -> AmpError {
        self.fail(
            DistErrorKind::PeerFailed,
            format!("rank {rank} panicked, so `{op}` cannot complete; start a new group"),
        )
    }

    /// Fails unless every rank's broadcast names `root` (ranks that named different roots
    /// would each copy another rank's values; an MPI broadcast would hang or mix them).
    fn same_root(&self, op: &str, root: usize, all: &[(&'static str, Vec<u8>)]) -> Result<()> {
        let named = |p: &[u8]| u64::from_le_bytes(p[..ROOT].try_into().expect("a root in front"));
        match all.iter().enumerate().find(|(_, (_, p))| named(p) != root as u64) {
            Some((r, (_, p))) => Err(self.fail(
                DistErrorKind::Mismatch,
                format!(
                    "`{op}` from rank {root} here but from rank {} on rank {r}: every rank must name the same \
                     root; nothing was copied",
                    named(p)
                ),
            )),
            None => Ok(()),
        }
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

/// A list of bucket lengths as bytes: the count, then each length (little-endian u64).
fn lens_bytes(lens: &[usize]) -> Vec<u8> {
    std::iter::once(lens.len())
        .chain(lens.iter().copied())
        .flat_map(|n| (n as u64).to_le_bytes())
        .collect()
}

/// The lengths in front of another rank's payload (as many as it holds).
fn lens_from(p: &[u8]) -> Vec<usize> {
    let mut words = p
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")) as usize);
    let n = words.next().unwrap_or(0);
    words.take(n).collect()
}

/// Bytes in front of a broadcast's payload: the root this rank names.
const ROOT: usize = 8;

fn root_bytes(root: usize) -> Vec<u8> {
    (root as u64).to_le_bytes().to_vec()
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
        self.all_reduce_sum_buckets(&mut [buf])
    }

    /// One exchange for all the buckets, their lengths in front: ranks that split a step into
    /// different buckets (or pass different lengths) all fail before any value is combined,
    /// as `MpiComm`'s header makes them, instead of pairing bucket by bucket.
    fn all_reduce_sum_buckets(&self, bufs: &mut [&mut [f32]]) -> Result<()> {
        let lens: Vec<usize> = bufs.iter().map(|b| b.len()).collect();
        let mut payload = lens_bytes(&lens);
        let head = payload.len();
        payload.reserve(4 * lens.iter().sum::<usize>());
        for b in bufs.iter() {
            payload.extend(b.iter().flat_map(|x| x.to_le_bytes()));
        }
        let all = self.exchange("all_reduce_sum", payload)?;
        let mine = &all[self.rank].1[..head];
        if let Some((r, (_, p))) = all.iter().enumerate().find(|(_, (_, p))| p.get(..head) != Some(mine)) {
            return Err(self.fail(
                DistErrorKind::Mismatch,
                format!(
                    "`all_reduce_sum` with {} here but {} on rank {r}: every rank must pass the same \
                     lengths (the same buckets); nothing was combined",
                    describe_lens(&lens),
                    describe_lens(&lens_from(p))
                ),
            ));
        }
        // In rank order from zero on every rank: the same sum everywhere, and the same bits
        // as `reduce_scatter_sum`'s blocks.
        let mut at = head;
        for b in bufs.iter_mut() {
            let n = 4 * b.len();
            b.fill(0.0);
            for (_, p) in all.iter() {
                for (d, x) in b.iter_mut().zip(f32_from(&p[at..at + n])) {
                    *d += x;
                }
            }
            at += n;
        }
        Ok(())
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<()> {
        check_root(self, root)?;
        let mut payload = root_bytes(root);
        payload.extend(buf.iter().flat_map(|x| x.to_le_bytes()));
        let all = self.exchange("broadcast", payload)?;
        self.same_root("broadcast", root, &all)?;
        let n = ROOT + 4 * buf.len();
        if let Some((r, (_, p))) = all.iter().enumerate().find(|(_, (_, p))| p.len() != n) {
            return Err(self.fail(
                DistErrorKind::Mismatch,
                format!(
                    "`broadcast` with {} values here but {} on rank {r}: every rank must pass the same length",
                    buf.len(),
                    (p.len() - ROOT) / 4
                ),
            ));
        }
        for (d, x) in buf.iter_mut().zip(f32_from(&all[root].1[ROOT..])) {
            *d = x;
        }
        Ok(())
    }

    fn broadcast_bytes(&self, buf: &mut Vec<u8>, root: usize) -> Result<()> {
        check_root(self, root)?;
        let mut payload = root_bytes(root);
        payload.extend_from_slice(buf);
        let all = self.exchange("broadcast_bytes", payload)?;
        self.same_root("broadcast_bytes", root, &all)?;
        buf.clear();
        buf.extend_from_slice(&all[root].1[ROOT..]);
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
mod tests;
