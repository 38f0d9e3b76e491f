//! Communication overlapped with the backward (PyTorch DDP's reducer): while candle's
//! backward runs, the library's layers hand each parameter's f32 gradient to the run's stash
//! ([`crate::precision::stash`]); once every piece of a parameter's gradient has arrived,
//! its share (`(master so far + unscaled gradient) / world`: what the step's reduction
//! would send) is written into its bucket, and a bucket whose parameters are all ready, and
//! all of whose predecessors are on their way, is handed to the communication thread
//! ([`thread`]). Parameters on candle's own path are ready when its backward returns; the
//! pipeline then sends every bucket not yet sent (`flush`). At the step the reduction waits
//! for the buckets and, when every rank's buckets hold its whole step (the last backward
//! before the step was an overlapped one, and nothing arrived after its bucket left), uses
//! them instead of sending the gradients again.
//!
//! In which order the parameters become complete is learned from the first backward (which
//! is reduced at the step as without overlap) and sent from rank 0 to the others ([`plan`]),
//! so every rank has the same buckets; how many pieces each parameter gets, and which get
//! none at all (written when the backward starts), each rank learns from its own backward,
//! so a rank whose graph differs from rank 0's (a head only rank 0 uses) still sends its
//! buckets early. A backward that does not match the plan (a piece after its bucket left:
//! the graph changed) is not used: the step reduces as without overlap, on every rank, and
//! the plan is learned again.
//!
//! Buckets always leave in plan order, every bucket once per overlapped backward, so every
//! rank hands the thread the same collectives in the same order. Each bucket carries a
//! header that tells ranks that sent different buckets at once apart (a backward under
//! `no_sync` on some ranks only): the step fails with a `Mismatch` naming the bucket.

mod hook;
pub(crate) mod plan;
mod results;
pub(crate) mod thread;

pub(crate) use results::{Results, StepFlags};

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use candle_core::backprop::GradStore;
use candle_core::{Tensor, TensorId, Var};

use crate::comm::Communicator;
use crate::error::{AmpError, DistErrorKind, Result};
use crate::kernels::unscale::{read_f32_into, unscale_share};
use crate::train::reduce::BackwardStart;

use plan::{Entry, HEADER, Plan};
use thread::CommThread;

/// The header's counter runs over at most this many values; fewer with many ranks, so that
/// `k` and `k²` summed over the ranks stay exact in f32 (below 2^24).
const HEADER_PERIOD: u64 = 256;

/// An overlapped run's state on one rank.
#[derive(Debug)]
pub(crate) struct Overlap {
    thread: Arc<CommThread>,
    rank: usize,
    world: usize,
    /// Bucket capacities in values: the first bucket, the others.
    caps: (usize, usize),
    /// Open `no_sync` guards.
    no_sync: AtomicUsize,
    /// Buckets wait for the flush (synchronised batch norm's sums in the backward must keep
    /// their place among the buckets on every rank, and readiness can differ between ranks).
    hold: AtomicBool,
    /// The header counter's period.
    period: u64,
    st: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    plan: Option<Plan>,
    /// Per bucket: its buffer, `None` while the thread has it.
    bufs: Vec<Option<Vec<f32>>>,
    /// Per bucket: the header value sent with it.
    sent: Vec<f32>,
    in_flight: usize,
    /// Backwards begun since the start, sending or not (the header counts buckets from it).
    backwards: u64,
    /// The thread is gone: every later call fails.
    broken: bool,
    mode: Mode,
    /// The buckets hold the step's averaged gradients (the last backward that changed the
    /// master gradients was an overlapped one that matched the plan).
    valid: bool,
    /// A piece of gradient arrived after its bucket had left (the plan no longer fits).
    stale: bool,
    /// The order observed in a learning backward, for the step to make a plan from.
    learned: Option<Vec<Entry>>,
    /// An error inside the hook (which cannot return one), reported by the flush.
    error: Option<AmpError>,
    /// Seconds the thread spent in all-reduces since the last step.
    thread_secs: f64,
    /// Buckets the thread summed since the last step.
    summed: u64,
    /// Buckets whose all-reduce started during candle's backward.
    early: u64,
}

#[derive(Debug, Default)]
enum Mode {
    #[default]
    Idle,
    Learning(Learning),
    Armed(Armed),
}

#[derive(Debug)]
struct Learning {
    params: Vec<(String, usize)>,
    index: HashMap<TensorId, usize>,
    counts: Vec<usize>,
    last: Vec<u64>,
    /// The last sum the hook saw per parameter.
    sums: Vec<Option<TensorId>>,
    /// Per parameter: whether the backward gave it any gradient (set at the flush; a
    /// parameter the flush does not list counts as present, so it is never written early).
    present: Vec<bool>,
    events: u64,
    flushed: bool,
}

#[derive(Debug)]
struct Armed {
    scale: f32,
    /// Working Var id to plan index.
    index: HashMap<TensorId, usize>,
    /// Per plan entry: the master gradient before this backward.
    accs: Vec<Option<Tensor>>,
    counts: Vec<usize>,
    /// Per plan entry: written into its bucket, and from which raw gradient.
    ready: Vec<bool>,
    used: Vec<Option<TensorId>>,
    /// Per bucket: entries not written yet.
    pending: Vec<usize>,
    /// The next bucket to hand over.
    next: usize,
    flushed: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// `e` with `what` (the bucket) in front of its detail.
fn about(e: AmpError, what: &str) -> AmpError {
    match e {
        AmpError::Distributed { rank, kind, detail } => AmpError::Distributed {
            rank,
            kind,
            detail: format!("{what}: {detail}"),
        },
        e => e,
    }
}

impl Overlap {
    /// Starts the communication thread over `comm`; buckets of at most `bucket_bytes` (the
    /// first of at most 1 MiB).
    pub(crate) fn start(comm: Arc<dyn Communicator>, bucket_bytes: usize) -> Result<Self> {
        let cap = (bucket_bytes / 4).max(1);
        let world = comm.world_size();
        Ok(Self {
            rank: comm.rank(),
            world: comm.world_size(),
            thread: Arc::new(CommThread::start(comm)?),
            caps: (cap.min((1 << 20) / 4), cap),
            no_sync: AtomicUsize::new(0),
            hold: AtomicBool::new(false),
            period: ((16_777_216.0 / world.max(1) as f64).sqrt() as u64).clamp(1, HEADER_PERIOD),
            st: Mutex::new(State::default()),
        })
    }

    /// The thread, for calls that must take their turn with the buckets.
    pub(crate) fn thread(&self) -> &Arc<CommThread> {
        &self.thread
    }

    /// Whether buckets wait for the flush (on while synchronised batch norm is).
    pub(crate) fn set_hold(&self, hold: bool) {
        self.hold.store(hold, Ordering::SeqCst);
    }

    pub(crate) fn enter_no_sync(&self) {
        self.no_sync.fetch_add(1, Ordering::SeqCst);
    }

    pub(crate) fn leave_no_sync(&self) {
        self.no_sync.fetch_sub(1, Ordering::SeqCst);
    }

    /// Buckets whose all-reduce started while candle's backward was still running.
    pub(crate) fn early_buckets(&self) -> u64 {
        lock(&self.st).early
    }

    /// The buckets of the plan (0 before one was made).
    pub(crate) fn buckets(&self) -> usize {
        lock(&self.st).plan.as_ref().map_or(0, |p| p.buckets.len())
    }

    /// A backward starts: waits for the last one's buckets, then arms the hook (or learns
    /// the order, before there is a plan). Under `no_sync`, or `enabled` false, the
    /// backward sends nothing.
    pub(crate) fn begin(&self, start: &BackwardStart<'_>, enabled: bool) -> Result<()> {
        let mut st = lock(&self.st);
        let drained = self.drain(&mut st);
        st.stale = false;
        st.error = None;
        st.mode = Mode::Idle;
        st.valid = false;
        st.backwards += 1;
        drained?;
        if st.broken {
            return Err(self.thread.gone());
        }
        if !enabled || self.no_sync.load(Ordering::SeqCst) > 0 {
            return Ok(());
        }
        let names = start.params.iter().map(|(n, _, _)| n.as_str());
        if st.plan.as_ref().is_some_and(|p| !p.covers_exactly(names)) {
            // Other parameters than the plan's (a parameter built since): learn again.
            log::info!("data parallel overlap: the backward's parameters changed, the buckets are made again");
            st.plan = None;
            st.bufs.clear();
            st.sent.clear();
        }
        let mode = match &st.plan {
            Some(plan) => {
                let n = plan.entries.len();
                let mut index = HashMap::with_capacity(n);
                let mut accs = vec![None; n];
                for (name, var, acc) in start.params {
                    let i = plan.index(name).expect("covered");
                    index.insert(var.as_tensor().id(), i);
                    accs[i] = acc.clone();
                }
                Mode::Armed(Armed {
                    scale: start.scale,
                    index,
                    accs,
                    counts: vec![0; n],
                    ready: vec![false; n],
                    used: vec![None; n],
                    pending: plan.buckets.iter().map(|b| b.params.len()).collect(),
                    next: 0,
                    flushed: false,
                })
            }
            None => Mode::Learning(Learning {
                params: start
                    .params
                    .iter()
                    .map(|(n, v, _)| (n.clone(), v.elem_count()))
                    .collect(),
                index: start
                    .params
                    .iter()
                    .enumerate()
                    .map(|(i, (_, v, _))| (v.as_tensor().id(), i))
                    .collect(),
                counts: vec![0; start.params.len()],
                last: vec![0; start.params.len()],
                sums: vec![None; start.params.len()],
                present: vec![true; start.params.len()],
                events: 0,
                flushed: false,
            }),
        };
        st.mode = mode;
        self.write_absent(&mut st);
        Ok(())
    }

    /// The backward's complete gradients: writes every parameter not written yet and hands
    /// over every bucket not sent yet (in plan order).
    pub(crate) fn flush(&self, grads: &GradStore, params: &[(String, Var)]) -> Result<()> {
        let mut st = lock(&self.st);
        let error = st.error.take();
        let st = &mut *st;
        if matches!(st.mode, Mode::Armed(_))
            && let Mode::Armed(mut a) = std::mem::take(&mut st.mode)
        {
            let out = self.flush_armed(st, &mut a, grads, params, error);
            st.mode = Mode::Armed(a);
            return out;
        }
        if let Some(e) = error {
            return Err(e);
        }
        match &mut st.mode {
            Mode::Idle | Mode::Armed(_) => Ok(()),
            Mode::Learning(l) => {
                // A parameter that also got a gradient on candle's path (a weight used by a
                // library layer and by raw tensor maths) is complete only when candle's
                // backward returns: planned as candle's.
                for (name, var) in params {
                    let Some(i) = l.params.iter().position(|(n, _)| n == name) else {
                        continue;
                    };
                    let raw = grads.get(var.as_tensor());
                    l.present[i] = l.counts[i] > 0 || raw.is_some();
                    if l.counts[i] > 0 && raw.map(|t| t.id()) != l.sums[i] {
                        l.counts[i] = 0;
                    }
                }
                l.flushed = true;
                Ok(())
            }
        }
    }

    /// [`flush`](Self::flush) of an armed backward. Every bucket not sent yet leaves, in plan
    /// order, even after an error (its values then unused: the backward fails), so that this
    /// rank's collectives stay paired with the other ranks'.
    fn flush_armed(
        &self,
        st: &mut State,
        a: &mut Armed,
        grads: &GradStore,
        params: &[(String, Var)],
        error: Option<AmpError>,
    ) -> Result<()> {
        let mut out = error.map_or(Ok(()), Err);
        let plan = st.plan.as_ref().expect("armed with a plan");
        for (name, var) in params {
            let Some(i) = plan.index(name) else { continue };
            let raw = grads.get(var.as_tensor());
            if a.ready[i] {
                // Written during the backward: from the gradient the pipeline has now?
                if raw.map(|t| t.id()) != a.used[i] {
                    st.stale = true;
                }
            } else if out.is_ok()
                && let Err(e) = write(plan, &mut st.bufs, a, i, raw, self.world as f32)
            {
                out = Err(e);
            }
        }
        if let (Err(e), _) = self.send(st, a, false) {
            out = out.and(Err(e));
        }
        a.flushed = out.is_ok();
        out
    }

    /// Hands over the buckets of `a`'s backward not sent yet, in plan order: every one, or
    /// with `ready_only` those up to the first not yet written. Returns the first failure
    /// (the others are still tried: the ranks' collectives stay paired) and how many went.
    fn send(&self, st: &mut State, a: &mut Armed, ready_only: bool) -> (Result<()>, u64) {
        let n = st.plan.as_ref().map_or(0, |p| p.buckets.len());
        let (mut out, mut sent) = (Ok(()), 0);
        while a.next < n && (!ready_only || a.pending[a.next] == 0) {
            let r = self.launch(st, a.next);
            a.next += 1;
            match r {
                Ok(()) => sent += 1,
                Err(e) => out = out.and(Err(e)),
            }
        }
        (out, sent)
    }

    /// The backward ended (`committed`: its gradients go into the master gradients).
    pub(crate) fn end(&self, committed: bool) {
        let mut st = lock(&self.st);
        match std::mem::take(&mut st.mode) {
            Mode::Armed(mut a) => {
                // A backward that failed before its flush still sends its buckets, so that
                // the ranks' collectives stay paired.
                if !a.flushed {
                    let _ = self.send(&mut st, &mut a, false);
                }
                st.valid = committed && a.flushed && !st.stale && st.error.is_none();
            }
            Mode::Learning(l) => {
                st.valid = false;
                if committed && l.flushed {
                    st.learned = Some(plan::observed_order(&l.params, &l.counts, &l.last, &l.present));
                }
            }
            // A backward that sent nothing changed the master gradients (or failed): the
            // buckets no longer hold the step.
            Mode::Idle => st.valid = false,
        }
    }

    /// At the step: waits for every bucket, and says what this rank has.
    pub(crate) fn step_flags(&self, names: &[(String, Vec<usize>)]) -> Result<StepFlags> {
        let mut st = lock(&self.st);
        self.drain(&mut st)?;
        let valid = st.valid
            && st
                .plan
                .as_ref()
                .is_some_and(|p| names.iter().all(|(n, _)| p.index(n).is_some()));
        Ok(StepFlags {
            valid,
            learned: st.learned.is_some() && st.plan.is_none(),
            stale: st.stale,
        })
    }

    /// Seconds the thread spent in all-reduces since the last call, and how many it made.
    pub(crate) fn take_thread_secs(&self) -> (f64, u64) {
        let mut st = lock(&self.st);
        (std::mem::take(&mut st.thread_secs), std::mem::take(&mut st.summed))
    }

    /// The averaged gradients in the buckets, by name (after [`step_flags`](Self::step_flags)
    /// said they are valid on every rank).
    pub(crate) fn results(&self) -> Results<'_> {
        Results(lock(&self.st))
    }

    /// After the step's agreement: `stale` anywhere drops the plan (it is learned again);
    /// `learned` everywhere makes a plan from rank 0's order (one broadcast and one small
    /// sum, both on every rank). Returns the collectives made.
    pub(crate) fn after_agreement(
        &self,
        comm: &dyn Communicator,
        stale: bool,
        learned_everywhere: bool,
    ) -> Result<u64> {
        let mut st = lock(&self.st);
        // `valid` stays: another optimizer of the same backward may step from the buckets
        // next; the next backward resets it.
        if stale {
            log::info!(
                "data parallel overlap: a gradient arrived after its bucket was sent; the buckets are made again"
            );
            st.plan = None;
            st.learned = None;
            st.valid = false;
            return Ok(0);
        }
        let Some(learned) = st.learned.take() else { return Ok(0) };
        if !learned_everywhere || st.plan.is_some() {
            return Ok(0);
        }
        let mut bytes = if self.rank == 0 {
            Plan::encode(&learned)
        } else {
            Vec::new()
        };
        comm.broadcast_bytes(&mut bytes, 0)?;
        let order = Plan::decode(&bytes);
        let same = order.as_ref().is_some_and(|o| {
            let mut a: Vec<(&str, usize)> = o.iter().map(|e| (e.name.as_str(), e.size)).collect();
            let mut b: Vec<(&str, usize)> = learned.iter().map(|e| (e.name.as_str(), e.size)).collect();
            a.sort();
            b.sort();
            a == b
        });
        let mut agree = [if same { 0.0f32 } else { 1.0 }];
        comm.all_reduce_sum(&mut agree)?;
        if agree[0] > 0.0 {
            return Err(AmpError::Distributed {
                rank: self.rank,
                kind: DistErrorKind::Mismatch,
                detail: "the ranks' backwards trained different parameters (names or sizes), so they cannot share \
                         gradient buckets: every rank must run the same model and pass the same optimizers to \
                         scale_loss"
                    .into(),
            });
        }
        let mut plan = Plan::new(order.expect("checked"), self.caps.0, self.caps.1);
        // Rank 0's order and sizes make the buckets; which pieces arrive is this rank's own.
        plan.localize(&learned);
        st.bufs = plan.buckets.iter().map(|b| Some(vec![0.0; b.len + HEADER])).collect();
        st.sent = vec![0.0; plan.buckets.len()];
        log::debug!(
            "data parallel overlap: {} bucket(s) over {} parameter(s)",
            plan.buckets.len(),
            plan.entries.len()
        );
        st.plan = Some(plan);
        Ok(2)
    }

    /// Hands bucket `b` to the thread, with its header.
    fn launch(&self, st: &mut State, b: usize) -> Result<()> {
        let plan = st.plan.as_ref().expect("buckets are sent under a plan");
        let mut buf = st.bufs[b].take().expect("a bucket is home until it is sent");
        let len = plan.buckets[b].len;
        // Distinct for each bucket of each backward (up to the period): ranks at different
        // backwards, or buckets, disagree on it.
        let seq = st.backwards * plan.buckets.len() as u64 + b as u64;
        let k = (seq % self.period + 1) as f32;
        buf[len] = k;
        buf[len + 1] = k * k;
        st.sent[b] = k;
        st.in_flight += 1;
        self.thread.send_bucket(b, buf).map_err(|e| about(e, &plan.describe(b)))
    }

    /// Waits for every bucket in flight and takes their buffers back; the first failure (a
    /// collective's, or a header that shows the ranks sent different buckets) is returned
    /// after all are back.
    fn drain(&self, st: &mut State) -> Result<()> {
        let mut first = None;
        while st.in_flight > 0 {
            let done = match self.thread.next_done() {
                Ok(d) => d,
                Err(e) => {
                    // The thread is gone with the buckets it held: nothing works any more.
                    st.in_flight = 0;
                    st.broken = true;
                    st.valid = false;
                    return Err(e);
                }
            };
            st.in_flight -= 1;
            st.thread_secs += done.secs;
            st.summed += 1;
            let what = st
                .plan
                .as_ref()
                .map_or_else(|| format!("bucket {}", done.id), |p| p.describe(done.id));
            let len = done.buf.len() - HEADER;
            let check = match done.result {
                Err(e) => Err(about(e, &what)),
                Ok(()) => {
                    let k = st.sent.get(done.id).copied().unwrap_or(0.0);
                    let w = self.world as f32;
                    // Σk = W·k and Σk² = W·k² only when every rank sent the same k.
                    if done.buf[len] == w * k && done.buf[len + 1] == w * k * k {
                        Ok(())
                    } else {
                        Err(AmpError::Distributed {
                            rank: self.rank,
                            kind: DistErrorKind::Mismatch,
                            detail: format!(
                                "{what}: the ranks summed different buckets at once (a backward under \
                                 `no_sync` on some ranks only, or a backward that failed on some): every \
                                 rank must run the same backwards; start a new group"
                            ),
                        })
                    }
                }
            };
            if let Some(slot) = st.bufs.get_mut(done.id) {
                *slot = Some(done.buf);
            }
            if let Err(e) = check {
                st.valid = false;
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }
}

/// Writes entry `i`'s share into its bucket (`raw`: its raw gradient from this backward).
fn write(
    plan: &Plan,
    bufs: &mut [Option<Vec<f32>>],
    a: &mut Armed,
    i: usize,
    raw: Option<&Tensor>,
    world: f32,
) -> Result<()> {
    let (b, off) = plan.slot[i];
    let size = plan.entries[i].size;
    let buf = bufs[b].as_mut().expect("a bucket is home while it is written");
    let out = &mut buf[off..off + size];
    match (raw, &a.accs[i]) {
        (Some(raw), acc) => unscale_share(raw, a.scale, acc.as_ref(), world, out)?,
        (None, Some(acc)) => {
            read_f32_into(acc, out)?;
            out.iter_mut().for_each(|v| *v /= world);
        }
        (None, None) => out.fill(0.0),
    }
    a.ready[i] = true;
    a.used[i] = raw.map(|t| t.id());
    a.pending[b] -= 1;
    Ok(())
}
