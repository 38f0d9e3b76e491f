//! The data-parallel wrapper: one process per device, each with the whole model and a shard
//! of every batch (PyTorch's `DistributedDataParallel`).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use candle_core::{DType, Tensor};

use crate::amp::Amp;
use crate::comm::Communicator;
use crate::error::{AmpError, DistErrorKind, Result};
use crate::precision::store::ParamKind;
use crate::train::reduce::{StepGrads, StepReducer};

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

#[derive(Debug, Default)]
struct Stats {
    /// Step reductions done (one per optimizer step).
    reductions: u64,
    /// Collective calls made for them (one per bucket).
    collectives: u64,
    /// Seconds spent in the collectives of each of the last [`TIMINGS`] reductions.
    comm_s: Vec<f64>,
    /// Of those, seconds in the step's first collective (the flags), where a rank waits for
    /// the slowest rank to finish its backward.
    wait_s: Vec<f64>,
    /// And seconds in the gradient buckets after it: the transfer.
    transfer_s: Vec<f64>,
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
///   them. candle has no backward hooks, so communication does not overlap the backward;
///   the buckets of one step are in flight together where the backend allows it (MPI);
/// * the overflow flags are combined in the same collective: when any rank's gradients
///   overflowed, every rank skips the step and backs its scale off, so the ranks' scales and
///   weights never diverge;
/// * a parameter that got no gradient on some rank counts as a zero gradient there
///   (PyTorch's `find_unused_parameters`); one that got none on any rank stays without one;
/// * [`sync_batch_norm`](Self::sync_batch_norm) makes `nn::batch_norm` layers compute their
///   training statistics over the global batch.
///
/// Rank 0 alone should write checkpoints and logs ([`is_main`](Self::is_main),
/// [`barrier`](Self::barrier)); a checkpoint holds no rank-specific state, so it resumes on
/// any number of ranks.
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
        if config.bucket_bytes < 4 {
            return Err(AmpError::InvalidArgument {
                argument: "bucket_bytes",
                reason: format!(
                    "buckets need room for at least one f32 value, got {} bytes",
                    config.bucket_bytes
                ),
            });
        }
        let ddp = Arc::new(Self {
            comm,
            config,
            stats: Mutex::new(Stats::default()),
            run: Arc::downgrade(amp.run()),
        });
        ddp.check_same_model(amp)?;
        ddp.broadcast_params(amp)?;
        amp.run().set_step_reducer(Some(ddp.clone()));
        Ok(ddp)
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
        self.comm.barrier()
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
    pub fn sync_batch_norm(&self, amp: &Amp, on: bool) {
        let group = on.then(|| crate::precision::autocast::SyncGroup {
            comm: Arc::new(super::counted::Counted::new(
                self.comm.clone(),
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
    pub fn collectives(&self) -> u64 {
        lock(&self.stats).collectives
    }

    /// The median time, in milliseconds, of the gradient collectives of one step over the
    /// last 1024 steps (0 before the first): [`comm_wait_ms`](Self::comm_wait_ms) and
    /// [`comm_transfer_ms`](Self::comm_transfer_ms) together.
    pub fn comm_ms(&self) -> f64 {
        median_ms(&lock(&self.stats).comm_s)
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
        median_ms(&lock(&self.stats).wait_s)
    }

    /// The median time, in milliseconds, of a step's gradient buckets after that first
    /// collective: the transfer itself (over the last 1024 steps; 0 before the first).
    pub fn comm_transfer_ms(&self) -> f64 {
        median_ms(&lock(&self.stats).transfer_s)
    }

    fn err(&self, kind: DistErrorKind, detail: String) -> AmpError {
        AmpError::Distributed {
            rank: self.comm.rank(),
            kind,
            detail,
        }
    }

    /// Fails on every rank unless every rank describes the same run.
    fn check_same_model(&self, amp: &Amp) -> Result<()> {
        let props = amp.properties();
        let mut lines = vec![format!("opt level {}, half type {}", props.opt_level, props.half)];
        for p in amp.store().params() {
            lines.push(format!(
                "parameter `{}`: {:?}, shape {:?}, {:?}",
                p.name(),
                p.kind(),
                p.working().dims(),
                p.working().dtype()
            ));
        }
        let mine = lines.join("\n");
        let mut root = mine.clone().into_bytes();
        self.comm.broadcast_bytes(&mut root, 0)?;
        let root = String::from_utf8_lossy(&root).into_owned();
        let differs = root != mine;
        // Every rank learns how many differ, so every rank fails (none waits for the others).
        let mut bad = [if differs { 1.0f32 } else { 0.0 }];
        self.comm.all_reduce_sum(&mut bad)?;
        if bad[0] == 0.0 {
            return Ok(());
        }
        let detail = if differs {
            let (r, m): (Vec<&str>, Vec<&str>) = (root.lines().collect(), mine.lines().collect());
            let first = (0..r.len().max(m.len()))
                .find(|&i| r.get(i) != m.get(i))
                .map(|i| {
                    format!(
                        "rank 0 has `{}`, this rank has `{}`",
                        r.get(i).unwrap_or(&"nothing more"),
                        m.get(i).unwrap_or(&"nothing more")
                    )
                })
                .unwrap_or_default();
            format!(
                "this rank's model differs from rank 0's: {first}. Build the same model, opt level and half type on every rank"
            )
        } else {
            format!(
                "{} rank(s) have a model that differs from rank 0's (opt level, half type, parameter names or shapes); build the same model on every rank",
                bad[0] as usize
            )
        };
        Err(self.err(DistErrorKind::Mismatch, detail))
    }

    fn broadcast_params(&self, amp: &Amp) -> Result<()> {
        self.broadcast_kind(amp, None)
    }

    /// Broadcasts rank 0's f32 values of the store's parameters (of one kind, or all),
    /// bucketed, and writes them on the other ranks.
    fn broadcast_kind(&self, amp: &Amp, kind: Option<ParamKind>) -> Result<()> {
        let mut params = amp.store().params();
        params.retain(|p| kind.is_none_or(|k| p.kind() == k) && p.working().dtype().is_float());
        params.sort_by(|a, b| a.name().cmp(b.name()));
        let mut flat = Vec::new();
        for p in &params {
            flat.extend(p.f32_value()?.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?);
        }
        let per = (self.config.bucket_bytes / 4).max(1);
        for chunk in flat.chunks_mut(per) {
            self.comm.broadcast(chunk, 0)?;
        }
        if self.is_main() {
            return Ok(());
        }
        let mut at = 0;
        for p in &params {
            let dims = p.working().dims().to_vec();
            let n: usize = dims.iter().product();
            let t = Tensor::from_slice(&flat[at..at + n], dims, p.working().device())?;
            amp.store().write_f32(p.name(), &t)?;
            at += n;
        }
        Ok(())
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
        let sizes: Vec<usize> = params.iter().map(|(_, d)| d.iter().product()).collect();
        let n: usize = sizes.iter().sum();
        let mut flat = Vec::with_capacity(n);
        let mut device = None;
        let world = self.comm.world_size() as f32;
        for ((name, _), &len) in params.iter().zip(&sizes) {
            match grads.get(name) {
                Some(g) => {
                    device.get_or_insert_with(|| g.device().clone());
                    // Divided before the sum, as PyTorch's DDP does: the sum of the shares
                    // is finite wherever the average is (2e38 on each of two ranks averages
                    // to 2e38, where their sum would be inf).
                    let v = g.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
                    flat.extend(v.into_iter().map(|g| g / world));
                }
                None => flat.resize(flat.len() + len, 0.0),
            }
        }
        let mut meta = step_meta(&params, grads, found_inf);
        let check = params.len() as f32;

        // The first collective returns once the slowest rank has called it: the waiting.
        let t0 = Instant::now();
        self.comm.all_reduce_sum(&mut meta)?;
        let wait_s = t0.elapsed().as_secs_f64();
        // The layout is checked before any gradient moves: ranks that disagree would
        // otherwise pair up buckets of different lengths.
        if *meta.last().expect("non-empty") != check * world {
            return Err(self.err(
                DistErrorKind::Mismatch,
                "the ranks stepped optimizers over different parameters (the same optimizers, over the same \
                 parameters, must step in the same order on every rank)"
                    .into(),
            ));
        }
        let t1 = Instant::now();
        let per = (self.config.bucket_bytes / 4).max(1);
        let mut buckets: Vec<&mut [f32]> = flat.chunks_mut(per).collect();
        let calls = buckets.len() as u64 + 1;
        self.comm.all_reduce_sum_buckets(&mut buckets)?;
        let transfer_s = t1.elapsed().as_secs_f64();

        let present = &meta[..params.len()];
        let flags = &meta[params.len()..params.len() + found_inf.len()];
        let device = device.unwrap_or(candle_core::Device::Cpu);
        let mut out = BTreeMap::new();
        let mut at = 0;
        for (((name, dims), &len), &had) in params.iter().zip(&sizes).zip(present) {
            if had > 0.0 {
                // The average is what the optimizer applies: checked in this pass.
                let avg = flat[at..at + len].to_vec();
                if avg.iter().any(|g| !g.is_finite()) {
                    nonfinite.push(name.clone());
                }
                out.insert(name.clone(), Tensor::from_vec(avg, dims.as_slice(), &device)?);
            }
            at += len;
        }
        for (f, &v) in found_inf.iter_mut().zip(flags) {
            *f = v > 0.0;
        }
        *checked = true;
        *grads = out;
        self.record(calls, wait_s, transfer_s);
        Ok(())
    }
}

impl DataParallel {
    fn record(&self, calls: u64, wait_s: f64, transfer_s: f64) {
        let mut st = lock(&self.stats);
        st.reductions += 1;
        st.collectives += calls;
        let st = &mut *st;
        for (v, x) in [
            (&mut st.comm_s, wait_s + transfer_s),
            (&mut st.wait_s, wait_s),
            (&mut st.transfer_s, transfer_s),
        ] {
            if v.len() == TIMINGS {
                v.remove(0);
            }
            v.push(x);
        }
    }

    /// The step reduction on the device path: the same layout as the host path's flat
    /// vector, built and summed as one f32 tensor on the gradients' device
    /// ([`Communicator::all_reduce_sum_tensor`]: in device memory over NCCL), in buckets.
    /// After the sum the averages are checked on the device, and the host reads the layout
    /// check, which parameters had gradients, the overflow flags and the averages' flags in
    /// one transfer (one synchronisation, counted in the run's host reads). A communicator
    /// without a device reduction (`reduces_in_device_memory` false) also reads each bucket
    /// on the host: one more counted read per bucket.
    fn reduce_on_device(
        &self,
        run: &crate::train::run::RunState,
        params: Vec<(String, Vec<usize>)>,
        grads: &BTreeMap<String, Tensor>,
        found_inf: &mut [bool],
        nonfinite: &mut Vec<String>,
    ) -> Result<(BTreeMap<String, Tensor>, u64, f64)> {
        let dev = run.store.device().clone();
        let world = self.comm.world_size() as f32;
        // A true division, as the host path's (candle's `t / x` multiplies by `1 / x`).
        let world_t = Tensor::new(world, &dev)?;
        let mut parts = Vec::with_capacity(params.len() + 1);
        for (name, dims) in &params {
            let len: usize = dims.iter().product();
            parts.push(match grads.get(name) {
                // Divided before the sum, as on the host path.
                Some(g) => g.flatten_all()?.to_dtype(DType::F32)?.broadcast_div(&world_t)?,
                None => Tensor::zeros(len, DType::F32, &dev)?,
            });
        }
        let meta = step_meta(&params, grads, found_inf);
        let m = meta.len();
        parts.push(Tensor::from_vec(meta, m, &dev)?);
        let flat = Tensor::cat(&parts, 0)?;
        drop(parts);

        let t0 = Instant::now();
        let total = flat.elem_count();
        let per = (self.config.bucket_bytes / 4).max(1);
        let mut sums = Vec::with_capacity(total.div_ceil(per));
        let mut at = 0;
        while at < total {
            let len = per.min(total - at);
            sums.push(self.comm.all_reduce_sum_tensor(&flat.narrow(0, at, len)?)?);
            at += len;
        }
        let calls = sums.len() as u64;
        if !self.comm.reduces_in_device_memory() {
            // The default tensor sum read each bucket on the host (MPI, `LocalGroup`).
            run.count_host_syncs(calls);
        }
        let flat = Tensor::cat(&sums, 0)?;
        drop(sums);
        let comm_s = t0.elapsed().as_secs_f64();

        let n = total - m;
        let mut avgs = Vec::with_capacity(params.len());
        let mut flags = vec![flat.narrow(0, n, m)?];
        let mut at = 0;
        for (_, dims) in &params {
            let len: usize = dims.iter().product();
            let avg = flat.narrow(0, at, len)?.reshape(dims.as_slice())?;
            flags.push(crate::train::optim::device_flag(&avg)?);
            avgs.push(avg);
            at += len;
        }
        let read = crate::train::optim::read_device_values(run, &flags)?;
        let (meta, avg_bad) = read.split_at(m);
        if meta[m - 1] != params.len() as f32 * world {
            return Err(self.err(
                DistErrorKind::Mismatch,
                "the ranks stepped optimizers over different parameters (the same optimizers, over the same \
                 parameters, must step in the same order on every rank)"
                    .into(),
            ));
        }
        let (present, flag_sums) = meta.split_at(params.len());
        let mut out = BTreeMap::new();
        for ((((name, _), avg), &had), &bad) in params.into_iter().zip(avgs).zip(present).zip(avg_bad) {
            if had > 0.0 {
                if bad.is_nan() {
                    nonfinite.push(name.clone());
                }
                // Its own storage, so the step's bucket is freed.
                out.insert(name, avg.copy()?);
            }
        }
        for (f, &v) in found_inf.iter_mut().zip(flag_sums) {
            *f = v > 0.0;
        }
        Ok((out, calls, comm_s))
    }
}
