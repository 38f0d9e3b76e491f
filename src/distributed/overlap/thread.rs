//! The communication thread of an overlapped run: every collective of the run goes through
//! it, one at a time, in the order they were handed over. Gradient buckets are handed over
//! while the backward runs and sum there while the backward goes on; everything else (the
//! step's flags, synchronised batch norm's sums) waits for its turn and for its result.
//!
//! One thread per rank keeps the order of collectives the program order on every rank (a
//! second thread calling the backend would race the first: different orders on different
//! ranks deadlock or mix buffers), and MPI needs only `Threading::Serialized`.

use std::sync::mpsc::{Receiver, Sender, channel};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use candle_core::Tensor;

use crate::comm::Communicator;
use crate::error::{AmpError, DistErrorKind, Result};

/// A call's result, on its way back.
type Reply = Box<dyn std::any::Any + Send>;

/// A call the thread runs on the communicator.
type Call = Box<dyn FnOnce(&dyn Communicator) -> Reply + Send>;

enum Job {
    /// Sum bucket `id` in place and send it back.
    Bucket {
        id: usize,
        buf: Vec<f32>,
    },
    Call(Call),
}

/// A summed bucket back from the thread.
pub(crate) struct Done {
    pub id: usize,
    pub buf: Vec<f32>,
    pub result: Result<()>,
    /// Seconds the all-reduce took on the thread.
    pub secs: f64,
}

/// The thread and its two channels.
#[derive(Debug)]
pub(crate) struct CommThread {
    comm: Arc<dyn Communicator>,
    /// `None` once dropping.
    jobs: Mutex<Option<Sender<Job>>>,
    done: Mutex<Receiver<Done>>,
    /// The calls' results, in one channel made once: a call allocates nothing that the
    /// thread frees after the caller has its result (what a memory count in between would
    /// see as growth).
    replies: Mutex<Receiver<Reply>>,
    handle: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Drop for CommThread {
    /// Ends the thread and waits for it: its handle on the communicator goes before this
    /// returns, so the process's last handle (MPI: the one that finalises) stays on the
    /// thread that dropped it, and no collective runs after the group is gone.
    fn drop(&mut self) {
        drop(lock(&self.jobs).take());
        if let Some(h) = lock(&self.handle).take() {
            let _ = h.join();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl CommThread {
    /// Starts the thread over `comm`. It ends when this value is dropped (after the calls
    /// handed over before).
    pub(crate) fn start(comm: Arc<dyn Communicator>) -> Result<Self> {
        let (jobs, rx) = channel::<Job>();
        let (tx, done) = channel::<Done>();
        let (reply_tx, replies) = channel::<Reply>();
        let c = comm.clone();
        let handle = std::thread::Builder::new()
            .name(format!("candle-amp-comm-{}", comm.rank()))
            .spawn(move || {
                for job in rx {
                    match job {
                        Job::Bucket { id, mut buf } => {
                            let t = Instant::now();
                            let result = c.all_reduce_sum(&mut buf);
                            let secs = t.elapsed().as_secs_f64();
                            if tx.send(Done { id, buf, result, secs }).is_err() {
                                return;
                            }
                        }
                        Job::Call(f) => {
                            // The call (and its box) is gone before its result leaves.
                            let r = f(&*c);
                            if reply_tx.send(r).is_err() {
                                return;
                            }
                        }
                    }
                }
            })
            .map_err(|e| AmpError::Distributed {
                rank: comm.rank(),
                kind: DistErrorKind::Backend,
                detail: format!("could not start the communication thread: {e}"),
            })?;
        Ok(Self {
            comm,
            jobs: Mutex::new(Some(jobs)),
            done: Mutex::new(done),
            replies: Mutex::new(replies),
            handle: Mutex::new(Some(handle)),
        })
    }

    pub(crate) fn gone(&self) -> AmpError {
        AmpError::Distributed {
            rank: self.comm.rank(),
            kind: DistErrorKind::Backend,
            detail: "the communication thread stopped (a collective panicked); start a new group".into(),
        }
    }

    /// Hands bucket `id` over: its all-reduce starts after every call handed over before.
    pub(crate) fn send_bucket(&self, id: usize, buf: Vec<f32>) -> Result<()> {
        self.send(Job::Bucket { id, buf })
    }

    fn send(&self, job: Job) -> Result<()> {
        match lock(&self.jobs).as_ref() {
            Some(tx) => tx.send(job).map_err(|_| self.gone()),
            None => Err(self.gone()),
        }
    }

    /// The next summed bucket, in the order they were handed over (blocks until it is done).
    pub(crate) fn next_done(&self) -> Result<Done> {
        lock(&self.done).recv().map_err(|_| self.gone())
    }

    /// Runs `f` on the thread after everything handed over before, and returns its result.
    pub(crate) fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&dyn Communicator) -> Result<R> + Send + 'static,
    ) -> Result<R> {
        // Held from the hand-over to the result: one call at a time gets its own result.
        let replies = lock(&self.replies);
        let job: Call = Box::new(move |c| Box::new(f(c)) as Reply);
        self.send(Job::Call(job))?;
        let reply = replies.recv().map_err(|_| self.gone())?;
        match reply.downcast::<Result<R>>() {
            Ok(r) => *r,
            Err(_) => Err(self.gone()),
        }
    }
}

/// A [`Communicator`] whose every collective runs on a [`CommThread`], in turn with the
/// gradient buckets: what synchronised batch norm uses while the run overlaps.
#[derive(Debug)]
pub(crate) struct Serial(pub Arc<CommThread>);

impl Communicator for Serial {
    fn rank(&self) -> usize {
        self.0.comm.rank()
    }

    fn world_size(&self) -> usize {
        self.0.comm.world_size()
    }

    fn backend(&self) -> &'static str {
        self.0.comm.backend()
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        let mut v = buf.to_vec();
        v = self.0.call(move |c| c.all_reduce_sum(&mut v).map(|_| v))?;
        buf.copy_from_slice(&v);
        Ok(())
    }

    /// All the buckets in one call on the thread, so the backend sees them as one
    /// collective (its length check covers every bucket), as without the thread.
    fn all_reduce_sum_buckets(&self, bufs: &mut [&mut [f32]]) -> Result<()> {
        let mut vs: Vec<Vec<f32>> = bufs.iter().map(|b| b.to_vec()).collect();
        vs = self.0.call(move |c| {
            let mut views: Vec<&mut [f32]> = vs.iter_mut().map(|v| v.as_mut_slice()).collect();
            let r = c.all_reduce_sum_buckets(&mut views);
            drop(views);
            r.map(|_| vs)
        })?;
        for (b, v) in bufs.iter_mut().zip(vs) {
            b.copy_from_slice(&v);
        }
        Ok(())
    }

    fn all_reduce_sum_tensor(&self, t: &Tensor) -> Result<Tensor> {
        let t = t.clone();
        self.0.call(move |c| c.all_reduce_sum_tensor(&t))
    }

    fn reduces_in_device_memory(&self) -> bool {
        self.0.comm.reduces_in_device_memory()
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<()> {
        let mut v = buf.to_vec();
        v = self.0.call(move |c| c.broadcast(&mut v, root).map(|_| v))?;
        buf.copy_from_slice(&v);
        Ok(())
    }

    fn broadcast_bytes(&self, buf: &mut Vec<u8>, root: usize) -> Result<()> {
        let mut v = std::mem::take(buf);
        *buf = self.0.call(move |c| c.broadcast_bytes(&mut v, root).map(|_| v))?;
        Ok(())
    }

    fn barrier(&self) -> Result<()> {
        self.0.call(|c| c.barrier())
    }

    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        let (s, mut r) = (send.to_vec(), recv.to_vec());
        r = self.0.call(move |c| c.reduce_scatter_sum(&s, &mut r).map(|_| r))?;
        recv.copy_from_slice(&r);
        Ok(())
    }

    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        let (s, mut r) = (send.to_vec(), recv.to_vec());
        r = self.0.call(move |c| c.all_gather_bytes(&s, &mut r).map(|_| r))?;
        recv.copy_from_slice(&r);
        Ok(())
    }
}
