//! The data-parallel wrapper: one process per device, each with the whole model and a shard
//! of every batch (PyTorch's `DistributedDataParallel`).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use candle_core::Tensor;

use crate::amp::Amp;
use crate::comm::Communicator;
use crate::error::{AmpError, DistErrorKind, Result};
use crate::precision::store::ParamKind;
use crate::train::reduce::{StepGrads, StepReducer};

use super::zero::{self, Sharding, Shards};

mod device;
mod host;
mod overlapped;
mod save;
mod setup;

pub use overlapped::NoSync;

/// Settings of a [`DataParallel`].
#[derive(Debug, Clone, PartialEq)]
pub struct DataParallelConfig {
    /// Gradients are all-reduced in buckets of about this many bytes (PyTorch's
    /// `bucket_cap_mb`, 25 MiB by default): one collective per bucket, not per tensor.
    pub bucket_bytes: usize,
}

impl Default for DataParallelConfig {
    fn default() -> Self {
        Self { bucket_bytes: 25 << 20 }
    }
}

/// How many step timings [`DataParallel::comm_ms`] keeps (its median is over these).
const TIMINGS: usize = 1024;

/// The last [`TIMINGS`] durations (seconds), in a buffer allocated once: the statistics do
/// not grow with the step count.
#[derive(Debug)]
struct Timings {
    v: Vec<f64>,
    next: usize,
}

impl Default for Timings {
    fn default() -> Self {
        Self {
            v: Vec::with_capacity(TIMINGS),
            next: 0,
        }
    }
}

impl Timings {
    fn push(&mut self, x: f64) {
        if self.v.len() < TIMINGS {
            self.v.push(x);
        } else {
            self.v[self.next] = x;
        }
        self.next = (self.next + 1) % TIMINGS;
    }

    /// The median in milliseconds; 0 for none.
    fn median_ms(&self) -> f64 {
        median_ms(&self.v)
    }
}

#[derive(Debug, Default)]
struct Stats {
    /// Step reductions done (one per optimizer step).
    reductions: u64,
    /// Collective calls made for them (one per bucket).
    collectives: u64,
    /// Seconds spent in the collectives of each of the last [`TIMINGS`] reductions.
    comm_s: Timings,
    /// Of those, seconds in the step's first collective (the flags), where a rank waits for
    /// the slowest rank to finish its backward.
    wait_s: Timings,
    /// And seconds in the gradient buckets after it: the transfer.
    transfer_s: Timings,
    /// Sharded runs: seconds in each all-gather of the updated working weights.
    gather_s: Timings,
    /// Seconds each step's reduction kept the step waiting (all of `comm_s` without
    /// overlap; with it, the wait for the buckets still on their way and what follows).
    exposed_s: Timings,
    /// Steps whose reduction used the buckets sent during the backward.
    overlapped: u64,
}

/// Data-parallel training of one AMP run across the ranks of a [`Communicator`].
///
/// Build the model and optimizers on every rank, then call [`DataParallel::new`] on every
/// rank. It checks that every rank has the same opt level, half type and parameters (names,
/// shapes, types), failing on every rank with an [`AmpError::Distributed`] otherwise, copies
/// rank 0's parameters and buffers to the others so that every rank starts identical, and
/// installs itself as the run's step reducer:
///
/// * each optimizer step, the optimizer's accumulated f32 master gradients are averaged over
///   the ranks once, however many micro-batches were accumulated (PyTorch's `no_sync`), in
///   buckets of [`DataParallelConfig::bucket_bytes`], when the first of
///   `AmpOptimizer::step`, `AmpOptimizer::clip_grad_norm` and `GradScaler::unscale` needs
///   them; the buckets of one step are in flight together where the backend allows it
///   (MPI). With [`set_overlap`](Self::set_overlap) they leave while the backward runs
///   instead;
/// * the overflow flags are combined in the same collective: when any rank's gradients
///   overflowed, every rank skips the step and backs its scale off, so the ranks' scales and
///   weights never diverge;
/// * a parameter that got no gradient on some rank counts as a zero gradient there
///   (PyTorch's `find_unused_parameters`); one that got none on any rank stays without one;
/// * [`sync_batch_norm`](Self::sync_batch_norm) makes `nn::batch_norm` layers compute their
///   training statistics over the global batch.
///
/// * with [`DataParallel::sharded`] each rank keeps the f32 masters and optimizer state of
///   its own shard of the parameters (ZeRO stage 1 or 2, see [`Sharding`]).
///
/// Rank 0 alone should write checkpoints and logs ([`is_main`](Self::is_main),
/// [`barrier`](Self::barrier)), or every rank calls
/// [`save_checkpoint`](Self::save_checkpoint) (a sharded run must); a checkpoint holds no
/// rank-specific state, so it resumes on any number of ranks.
///
/// ```
/// use std::sync::Arc;
/// use candle_amp::distributed::{Communicator, DataParallel, LocalGroup};
/// use candle_amp::{self as amp, OptLevel};
/// # fn main() -> anyhow::Result<()> {
/// // Two ranks as two threads (a real run has one process per rank: `distributed::MpiComm`).
/// let comms = LocalGroup::new(2);
/// std::thread::scope(|s| {
///     for comm in comms {
///         s.spawn(move || -> anyhow::Result<()> {
///             let comm: Arc<dyn Communicator> = Arc::new(comm);
///             let seed = comm.rank() as u64; // different initial weights ...
///             let cfg = amp::AmpConfig::new(OptLevel::O2).seed(seed);
///             let (model, mut opt, amp) = amp::initialize(
///                 |vb| amp::nn::linear(4, 1, vb.pp("fc")),
///                 amp::optim::Sgd::new(amp::optim::SgdConfig::new(0.1))?,
///                 cfg,
///             )?;
///             let ddp = DataParallel::new(&amp, comm, Default::default())?; // ... made equal
///             let x = candle_core::Tensor::ones((2, 4), candle_core::DType::F32, &candle_core::Device::Cpu)?;
///             let loss = amp::ops::mse(&model.forward(&x)?, &x.narrow(1, 0, 1)?)?;
///             amp.scale_loss(&loss, &mut opt)?.backward()?;
///             opt.step()?;
///             assert_eq!(ddp.reductions(), 1);
///             Ok(())
///         });
///     }
/// });
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct DataParallel {
    comm: Arc<dyn Communicator>,
    config: DataParallelConfig,
    stats: Mutex<Stats>,
    /// The run, to take its device path and count its host reads (weak: the run holds this
    /// reducer).
    run: std::sync::Weak<crate::train::run::RunState>,
    /// Which rank owns each parameter, when sharded.
    shards: Mutex<Shards>,
    sharding: Sharding,
    /// Communication overlapped with the backward, when on.
    overlap: Mutex<Option<Arc<super::overlap::Overlap>>>,
    /// Whether synchronised batch norm is on (its group follows the overlap's thread).
    sync_bn: std::sync::atomic::AtomicBool,
}

/// A step's flags as the ranks sum them: 1 for each parameter that had a gradient here, 1
/// for each overflow flag set, then the parameter count (the sum checks that every rank
/// stepped over the same parameters).
fn step_meta(params: &[(String, Vec<usize>)], grads: &BTreeMap<String, Tensor>, found_inf: &[bool]) -> Vec<f32> {
    let mut meta: Vec<f32> = params
        .iter()
        .map(|(name, _)| if grads.contains_key(name) { 1.0f32 } else { 0.0 })
        .collect();
    meta.extend(found_inf.iter().map(|&b| if b { 1.0f32 } else { 0.0 }));
    meta.push(params.len() as f32);
    meta
}

/// The median of `v` (seconds) in milliseconds; 0 for none.
fn median_ms(v: &[f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2] * 1e3
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl DataParallel {
    /// Checks that every rank runs the same model, copies rank 0's parameters and buffers to
    /// every rank, and installs the step reduction on `amp`'s run. Call it on every rank
    /// after building the model (parameters built later are not broadcast).
    pub fn new(amp: &Amp, comm: Arc<dyn Communicator>, config: DataParallelConfig) -> Result<Arc<Self>> {
        Self::sharded(amp, comm, config, Sharding::None)
    }

    /// [`new`](Self::new) with the optimizer's work shared between the ranks as `sharding`
    /// says (ZeRO stage 1 or 2; [`Sharding::None`] is `new`). Every rank must pass the same
    /// `sharding`. After the checks and the copy of rank 0's values, each rank frees the f32
    /// masters of the parameters it does not own ([`owner_of`](Self::owner_of)); from then
    /// on it keeps gradients and optimizer state for its own shard only, steps it, and
    /// receives the other parameters' working values after each applied step. Clipping
    /// (`clip_grad_norm`) uses the norm over every rank's shard, and the skip decision is
    /// the whole group's, so a sharded run steps, clips and skips like the unsharded one.
    ///
    /// A rank then holds only a shard of the run's state: `Amp::state_dict`, checkpoints,
    /// `AmpOptimizer::state_dict` and `AmpOptimizer::master_params` are refused there with
    /// [`DistErrorKind::Sharded`]: save with [`save_checkpoint`](Self::save_checkpoint) on
    /// every rank, which writes each rank's shard. On the device path ([`Amp::device_path`])
    /// both stages all-reduce the gradients (the [`Communicator`] has no reduce-scatter of
    /// device tensors), and the all-gather of the updated weights goes through the host:
    /// one read per working type, counted in [`Amp::host_syncs`].
    pub fn sharded(
        amp: &Amp,
        comm: Arc<dyn Communicator>,
        config: DataParallelConfig,
        sharding: Sharding,
    ) -> Result<Arc<Self>> {
        if config.bucket_bytes < 4 {
            return Err(AmpError::InvalidArgument {
                argument: "bucket_bytes",
                reason: format!(
                    "buckets need room for at least one f32 value, got {} bytes",
                    config.bucket_bytes
                ),
            });
        }
        let world = comm.world_size();
        let ddp = Arc::new(Self {
            comm,
            config,
            stats: Mutex::new(Stats::default()),
            run: Arc::downgrade(amp.run()),
            shards: Mutex::new(Shards::new(world)),
            sharding,
            overlap: Mutex::new(None),
            sync_bn: std::sync::atomic::AtomicBool::new(false),
        });
        ddp.check_same_model(amp)?;
        ddp.broadcast_params(amp)?;
        if ddp.sharding.is_sharded() {
            ddp.place(&amp.run().store, &zero::trainable_sizes(amp.store()));
        }
        amp.run().set_step_reducer(Some(ddp.clone()));
        Ok(ddp)
    }

    /// Places the parameters of `sizes` not placed yet and frees this rank's f32 masters of
    /// the others' (their owners keep them).
    fn place(&self, store: &crate::precision::store::ParamStore, sizes: &[(String, usize)]) {
        let placed = lock(&self.shards).extend(sizes);
        for (name, r) in placed {
            if r != self.comm.rank() {
                store.drop_master(&name);
            }
        }
    }

    /// How the optimizer's work is shared between the ranks.
    pub fn sharding(&self) -> Sharding {
        self.sharding
    }

    /// The rank that keeps the f32 master and optimizer state of parameter `name` and steps
    /// it, on a sharded run (`None` when not sharded, or for a name that is not a trainable
    /// parameter of the run). Every rank computes the same partition: the trainable
    /// parameters, largest first, each to the rank with the fewest elements so far.
    pub fn owner_of(&self, name: &str) -> Option<usize> {
        if !self.sharding.is_sharded() {
            return None;
        }
        lock(&self.shards).owner(name)
    }

    /// The trainable elements each rank owns on a sharded run (empty when not sharded).
    pub fn shard_sizes(&self) -> Vec<usize> {
        if !self.sharding.is_sharded() {
            return Vec::new();
        }
        lock(&self.shards).loads().to_vec()
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.comm.rank()
    }

    /// How many ranks train together.
    pub fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    /// Whether this is rank 0, the one that writes checkpoints and logs.
    pub fn is_main(&self) -> bool {
        self.comm.rank() == 0
    }

    /// The communicator.
    pub fn communicator(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// Waits for every rank (e.g. rank 0 prepares data or writes a checkpoint, the others
    /// wait for it).
    pub fn barrier(&self) -> Result<()> {
        self.collective_comm().barrier()
    }

    /// Switches synchronised batch norm on (or off) for every `nn::batch_norm` layer of
    /// `amp`'s models, in one call (Apex's `convert_syncbn_model`, PyTorch's
    /// `SyncBatchNorm.convert_sync_batchnorm`): in training mode their statistics are
    /// computed over every rank's batch, so the result equals one process running the whole
    /// batch, running statistics included. The forward must run through `AmpModel`.
    ///
    /// On the device path ([`Amp::device_path`]) the statistics are summed as device tensors
    /// ([`Communicator::all_reduce_sum_tensor`]: two per-channel vectors in the forward, one
    /// in the backward), so only per-channel vectors travel; over a communicator without a
    /// device reduction (MPI, `LocalGroup`) each of those sums is one host read, counted in
    /// [`Amp::host_syncs`].
    ///
    /// Collective: call it on every rank with the same `on`. Ranks that disagree all fail
    /// with [`DistErrorKind::Mismatch`] naming `sync_batch_norm`, and nothing changes (a rank
    /// that synchronised alone would wait in its forward for sums the others never make).
    pub fn sync_batch_norm(&self, amp: &Amp, on: bool) -> Result<()> {
        let mut agree = [if on { 1.0f32 } else { 0.0 }];
        self.collective_comm().all_reduce_sum(&mut agree)?;
        let world = self.comm.world_size() as f32;
        if agree[0] != 0.0 && agree[0] != world {
            return Err(self.err(
                DistErrorKind::Mismatch,
                format!(
                    "`sync_batch_norm({on})` here but {} of {world} ranks switched it on: call it on every rank \
                     with the same value",
                    agree[0]
                ),
            ));
        }
        self.install_sync_bn(amp, on);
        Ok(())
    }

    /// Installs (or removes) synchronised batch norm's group on `amp`'s run, after the ranks
    /// agreed on `on` (or again when overlap changes which communicator the group uses).
    pub(super) fn install_sync_bn(&self, amp: &Amp, on: bool) {
        self.sync_bn.store(on, std::sync::atomic::Ordering::SeqCst);
        // Its sums in the backward keep their place among the buckets only if the buckets
        // wait for the flush (readiness may differ between ranks).
        if let Some(o) = self.overlap() {
            o.set_hold(on);
        }
        let group = on.then(|| crate::precision::autocast::SyncGroup {
            comm: Arc::new(super::counted::Counted::new(
                self.collective_comm(),
                Arc::downgrade(amp.run()),
            )),
            device_path: amp.run().device_path(),
        });
        amp.run().casts.set_sync_group(group);
    }

    /// Copies rank 0's parameters and buffers to every rank again (e.g. batch-norm running
    /// statistics, which differ between ranks without synchronised batch norm, before an
    /// evaluation; PyTorch's DDP does it before every forward).
    pub fn broadcast_buffers(&self, amp: &Amp) -> Result<()> {
        self.broadcast_kind(amp, Some(ParamKind::Buffer))
    }

    /// Optimizer steps reduced so far.
    pub fn reductions(&self) -> u64 {
        lock(&self.stats).reductions
    }

    /// Collective calls made for them: per step, one per gradient bucket, and on the host
    /// path one more before them for the flags (see [`comm_wait_ms`](Self::comm_wait_ms)).
    /// Sharded runs: stage 2 counts one per reduce-scatter round and one for the agreement
    /// on inf/NaN instead of the buckets; both stages count one per all-gather round of the
    /// updated weights after each applied step (rounds of about `bucket_bytes` in all).
    /// With [`set_overlap`](Self::set_overlap): one per bucket the backwards sent since the
    /// last step (every bucket of every overlapped backward), plus the flags, plus the
    /// buckets again where the step could not use them, plus two when the plan is made.
    pub fn collectives(&self) -> u64 {
        lock(&self.stats).collectives
    }

    /// The median time, in milliseconds, of the gradient collectives of one step over the
    /// last 1024 steps (0 before the first): [`comm_wait_ms`](Self::comm_wait_ms) and
    /// [`comm_transfer_ms`](Self::comm_transfer_ms) together, and with
    /// [`set_overlap`](Self::set_overlap) the all-reduces the communication thread ran for
    /// the step's buckets (mostly during the backward; each includes waiting for the other
    /// ranks to reach that bucket). What the step itself waited is
    /// [`comm_exposed_ms`](Self::comm_exposed_ms).
    pub fn comm_ms(&self) -> f64 {
        lock(&self.stats).comm_s.median_ms()
    }

    /// The median time, in milliseconds, a step's reduction waited for the other ranks (over
    /// the last 1024 steps; 0 before the first). On the host path the reduction starts with
    /// one small collective (which parameters had gradients, the overflow flags, the layout
    /// check): it returns when the slowest rank has finished its backward and called it, so
    /// its time is the waiting, and a rank whose backward is slower than the others' shows
    /// about 0 here while they show the difference. On the device path the collectives are
    /// enqueued on the device without waiting, so this is 0 and the whole time is in
    /// [`comm_transfer_ms`](Self::comm_transfer_ms).
    pub fn comm_wait_ms(&self) -> f64 {
        lock(&self.stats).wait_s.median_ms()
    }

    /// The median time, in milliseconds, of a step's gradient buckets after that first
    /// collective: the transfer itself (over the last 1024 steps; 0 before the first).
    pub fn comm_transfer_ms(&self) -> f64 {
        lock(&self.stats).transfer_s.median_ms()
    }

    /// The median time, in milliseconds, a step waited for its gradients' reduction (over the
    /// last 1024 steps; 0 before the first): the communication left exposed. Without overlap
    /// that is [`comm_ms`](Self::comm_ms); with [`set_overlap`](Self::set_overlap) it is the
    /// wait for the buckets still on their way when the step starts plus the step's small
    /// agreement, while `comm_ms` also counts the buckets' all-reduces that ran during the
    /// backward.
    pub fn comm_exposed_ms(&self) -> f64 {
        lock(&self.stats).exposed_s.median_ms()
    }

    /// The median time, in milliseconds, of the all-gather of the updated working weights
    /// after a step of a sharded run (over the last 1024; 0 before the first, and when not
    /// sharded). Not part of [`comm_ms`](Self::comm_ms), which times the gradients' reduction.
    pub fn comm_gather_ms(&self) -> f64 {
        lock(&self.stats).gather_s.median_ms()
    }

    fn err(&self, kind: DistErrorKind, detail: String) -> AmpError {
        AmpError::Distributed {
            rank: self.comm.rank(),
            kind,
            detail,
        }
    }
}

impl StepReducer for DataParallel {
    fn reduce_step(&self, step: StepGrads<'_>) -> Result<()> {
        // Two sums: first a small one (whether each parameter had a gradient, the overflow
        // flags, the parameter count, which checks that the ranks agree on the layout), then
        // every parameter's gradient (zeros where this rank has none) in buckets.
        let StepGrads {
            params,
            grads,
            found_inf,
            nonfinite,
            checked,
        } = step;
        if let Some(run) = self.run.upgrade()
            && run.device_path()
        {
            let (out, calls, comm_s) = self.reduce_on_device(&run, params, grads, found_inf, nonfinite)?;
            *checked = true;
            *grads = out;
            self.record(calls, 0.0, comm_s);
            return Ok(());
        }
        self.reduce_on_host(params, grads, found_inf, nonfinite, checked)
    }

    /// Sharded: every rank's sum over its shard, gathered and added in rank order in f64 (the
    /// same bits on every rank). Not sharded: the local sum is already the total.
    fn total_sum_squares(&self, local: f64) -> Result<f64> {
        if !self.sharding.is_sharded() {
            return Ok(local);
        }
        let mut all = vec![0u8; 8 * self.comm.world_size()];
        self.collective_comm()
            .all_gather_bytes(&local.to_le_bytes(), &mut all)?;
        Ok(all
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
            .sum())
    }

    fn after_step(&self, params: &[(String, Vec<usize>)]) -> Result<()> {
        if !self.sharding.is_sharded() {
            return Ok(());
        }
        let Some(run) = self.run.upgrade() else { return Ok(()) };
        let shards = lock(&self.shards).clone();
        let t = Instant::now();
        // Rounds of about one bucket in all: what a rank receives at once stays near
        // `bucket_bytes`, not a whole copy of the model's working weights.
        let cap = (self.config.bucket_bytes / self.comm.world_size()).max(1);
        let (reads, gathers) = zero::gather_working(&*self.collective_comm(), &run.store, &shards, params, cap)?;
        if run.device_path() {
            run.count_host_syncs(reads);
        }
        let mut st = lock(&self.stats);
        st.collectives += gathers;
        st.gather_s.push(t.elapsed().as_secs_f64());
        Ok(())
    }

    fn begin_backward(&self, start: crate::train::reduce::BackwardStart<'_>) -> Result<()> {
        self.begin_overlap(start)
    }

    fn flush_backward(
        &self,
        grads: &candle_core::backprop::GradStore,
        params: &[(String, candle_core::Var)],
    ) -> Result<()> {
        self.flush_overlap(grads, params)
    }

    fn end_backward(&self, committed: bool) {
        self.end_overlap(committed);
    }

    fn keeps(&self, name: &str) -> bool {
        self.owner_of(name).is_none_or(|r| r == self.comm.rank())
    }

    fn shard_rank(&self) -> Option<usize> {
        self.sharding.is_sharded().then(|| self.comm.rank())
    }
}

impl DataParallel {
    fn record(&self, calls: u64, wait_s: f64, transfer_s: f64) {
        self.record_overlapped(calls, wait_s, transfer_s, 0.0, 0.0);
    }

    /// `thread_s`: the overlap thread's all-reduces; `drain_s`: the step's wait for them.
    fn record_overlapped(&self, calls: u64, wait_s: f64, transfer_s: f64, thread_s: f64, drain_s: f64) {
        let mut st = lock(&self.stats);
        st.reductions += 1;
        st.collectives += calls;
        let st = &mut *st;
        st.comm_s.push(wait_s + transfer_s + thread_s);
        st.exposed_s.push(wait_s + transfer_s + drain_s);
        st.wait_s.push(wait_s);
        st.transfer_s.push(transfer_s);
    }
}
