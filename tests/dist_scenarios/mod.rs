//! The data-parallel scenarios shared by `tests/dist.rs` (ranks as threads) and
//! `examples/ddp_check.rs` (ranks as MPI processes): a small network trained for `STEPS`
//! steps on a rank's shard of every batch, or on whole batches in one process.

#![allow(dead_code)]

use std::sync::Arc;

use candle_amp::distributed::{Communicator, DataParallel, DataParallelConfig, Sharding};
use candle_amp::nn::{BatchNorm, Linear, batch_norm, linear};
use candle_amp::optim::{AdamW, AdamWConfig, Sgd, SgdConfig};
use candle_amp::{self as amp, AmpConfig, GradScaler, HalfType, LossScaleSpec, OptLevel};
use candle_core::{DType, Device, Tensor};
use candle_nn::{ModuleT, VarBuilder};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub mod disagree;

pub const B: usize = 8;
pub const STEPS: usize = 20;
/// The step at which rank 1's shard (and so the full batch) holds an inf.
pub const INF_STEP: usize = 7;

/// Batches of B samples; with `inf`, at `INF_STEP` the last sample (rank 1's shard) is inf.
pub fn data_with(inf: bool) -> Vec<(Tensor, Tensor)> {
    let mut r = ChaCha8Rng::seed_from_u64(5);
    (0..STEPS)
        .map(|s| {
            let mut x: Vec<f32> = (0..B * 6).map(|_| r.random_range(-1.0..1.0)).collect();
            if inf && s == INF_STEP {
                x[B * 6 - 1] = f32::INFINITY;
            }
            let y: Vec<f32> = (0..B * 2).map(|_| r.random_range(-1.0..1.0)).collect();
            (
                Tensor::from_vec(x, (B, 6), &Device::Cpu).unwrap(),
                Tensor::from_vec(y, (B, 2), &Device::Cpu).unwrap(),
            )
        })
        .collect()
}

pub fn data() -> Vec<(Tensor, Tensor)> {
    data_with(true)
}

/// Rank `rank` of `world`'s rows of a batch.
pub fn shard(t: &Tensor, rank: usize, world: usize) -> Tensor {
    let n = t.dim(0).unwrap() / world;
    t.narrow(0, rank * n, n).unwrap()
}

pub struct Net {
    pub a: Linear,
    bn: Option<BatchNorm>,
    b: Linear,
    /// A head only some ranks use.
    extra: Linear,
}

impl Net {
    pub fn new(vb: VarBuilder, with_bn: bool) -> candle_core::Result<Self> {
        Ok(Self {
            a: linear(6, 16, vb.pp("a"))?,
            bn: if with_bn {
                Some(batch_norm(16, 1e-5, vb.pp("bn"))?)
            } else {
                None
            },
            b: linear(16, 2, vb.pp("b"))?,
            extra: linear(16, 2, vb.pp("extra"))?,
        })
    }
}

/// Input `x` with a flag column: the model runs `extra` only when told to through the
/// input's last element being 1 (so the same `ModuleT` can skip it on one rank).
impl ModuleT for Net {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let use_extra = x.dim(1)? == 7;
        let x = x.narrow(1, 0, 6)?;
        let mut h = self.a.forward_t(&x, train)?;
        if let Some(bn) = &self.bn {
            h = bn.forward_t(&h, train)?;
        }
        let h = amp::ops::relu(&h)?;
        let y = self.b.forward_t(&h, train)?;
        if use_extra {
            y + self.extra.forward_t(&h, train)?
        } else {
            Ok(y)
        }
    }
}

#[derive(Clone, Copy, PartialEq)]
pub enum Api {
    Guard,
    /// `GradScaler`, with every step's batch split into two accumulated micro-batches.
    ScalerAccumulating,
    /// The guard over two accumulated micro-batches of half the rows (the first under
    /// `DataParallel::no_sync` with [`Extras::no_sync`]).
    GuardAccumulating,
}

/// What else a run does: ZeRO sharding, AdamW instead of SGD, clipping to a norm.
#[derive(Clone, Copy, PartialEq, Default)]
pub struct Extras {
    pub sharding: Sharding,
    pub adamw: bool,
    pub clip: Option<f64>,
    /// The device path forced on the CPU (`AmpConfig::device_path(true)`).
    pub device_path: bool,
    /// Communication overlapped with the backward (`DataParallel::set_overlap`).
    pub overlap: bool,
    /// `Api::GuardAccumulating`: the first micro-batch under `DataParallel::no_sync`.
    pub no_sync: bool,
}

impl Extras {
    /// AdamW, its gradients clipped to a norm of 0.05.
    pub fn adamw_clipped() -> Self {
        Self {
            adamw: true,
            clip: Some(0.05),
            ..Default::default()
        }
    }
}

pub struct Run {
    /// Every store tensor (parameters and buffers) as f32 bits, by name order.
    pub state: Vec<(String, Vec<u32>)>,
    /// Every store tensor's working value (the model's own, half at O2 and O3) as f32 bits.
    pub working: Vec<(String, Vec<u32>)>,
    /// The parameters this rank keeps a master of and steps (every one unless sharded).
    pub owned: Vec<String>,
    /// The norms `clip_grad_norm` returned, as bits.
    pub norms: Vec<u32>,
    pub skipped: u64,
    pub reductions: u64,
    pub collectives: u64,
    /// Steps reduced from the buckets sent during the backward.
    pub overlapped_steps: u64,
    /// Buckets sent while candle's backward was still running.
    pub early_buckets: u64,
}

/// Trains `STEPS` steps on `rank` of `world` (`comm` None: one process, whole batches, as
/// `ref_world` ranks would see them). `extra_on_rank0`: the `extra` head is used on rank 0's
/// samples only.
pub fn train(
    comm: Option<Arc<dyn Communicator>>,
    ref_world: usize,
    level: OptLevel,
    half: HalfType,
    api: Api,
    with_bn: bool,
    extra_on_rank0: bool,
) -> Run {
    train_with(
        comm,
        ref_world,
        level,
        half,
        api,
        with_bn,
        extra_on_rank0,
        Extras::default(),
    )
}

/// [`train`] with [`Extras`].
#[allow(clippy::too_many_arguments)]
pub fn train_with(
    comm: Option<Arc<dyn Communicator>>,
    ref_world: usize,
    level: OptLevel,
    half: HalfType,
    api: Api,
    with_bn: bool,
    extra_on_rank0: bool,
    extras: Extras,
) -> Run {
    let (rank, world) = comm.as_ref().map_or((0, 1), |c| (c.rank(), c.world_size()));
    // Different seeds per rank: DataParallel::new must make the weights equal.
    let cfg = AmpConfig::new(level)
        .half(half)
        .seed(10 + rank as u64)
        .loss_scale(LossScaleSpec::Static(64.0))
        .verbosity(0);
    let cfg = if extras.device_path { cfg.device_path(true) } else { cfg };
    let amp = amp::Amp::new(cfg, &Device::Cpu).unwrap();
    let model = amp.model(|vb| Net::new(vb, with_bn)).unwrap();
    let mut opt = if extras.adamw {
        amp.optimizer(
            AdamW::new(AdamWConfig {
                lr: 0.01,
                ..Default::default()
            })
            .unwrap(),
        )
    } else {
        amp.optimizer(Sgd::new(SgdConfig::new(0.05)).unwrap())
    }
    .unwrap();
    let mut norms = Vec::new();
    let ddp = comm.map(|c| {
        let d = DataParallel::sharded(&amp, c, DataParallelConfig { bucket_bytes: 256 }, extras.sharding).unwrap();
        if with_bn {
            d.sync_batch_norm(&amp, true).unwrap();
        }
        if extras.overlap {
            d.set_overlap(&amp, true).unwrap();
        }
        d
    });
    let mut scaler = GradScaler::with_params(64.0, 2.0, 0.5, 1_000_000, true).unwrap();
    // The loss of one group of samples: MSE, plus the extra head on rank 0's samples.
    let loss_of = |x: &Tensor, y: &Tensor, shard_rank: usize| -> Tensor {
        let x = if extra_on_rank0 && shard_rank == 0 {
            Tensor::cat(
                &[
                    x,
                    &Tensor::ones((x.dim(0).unwrap(), 1), DType::F32, &Device::Cpu).unwrap(),
                ],
                1,
            )
            .unwrap()
        } else {
            x.clone()
        };
        let out = model.forward(&x).unwrap().to_dtype(DType::F32).unwrap();
        amp::ops::mse(&out, y).unwrap()
    };
    // What the rank (or the single process, for every shard) computes: the mean of the
    // per-rank losses, so one process equals the average of W ranks.
    let losses = |x: &Tensor, y: &Tensor| -> Tensor {
        if world > 1 || !extra_on_rank0 {
            return loss_of(x, y, rank);
        }
        let parts: Vec<Tensor> = (0..ref_world)
            .map(|r| loss_of(&shard(x, r, ref_world), &shard(y, r, ref_world), r))
            .collect();
        (Tensor::stack(&parts, 0).unwrap().sum_all().unwrap() / ref_world as f64).unwrap()
    };
    // An inf sample would make batch norm's running statistics inf for good (as in
    // PyTorch): the batch-norm runs have no skipped step.
    for (x, y) in data_with(!with_bn) {
        let (x, y) = (shard(&x, rank, world), shard(&y, rank, world));
        match api {
            Api::Guard => {
                amp.scale_loss(&losses(&x, &y), &mut opt).unwrap().backward().unwrap();
                if let Some(max) = extras.clip {
                    norms.push(opt.clip_grad_norm(max).unwrap().to_bits());
                }
                opt.step().unwrap();
            }
            Api::ScalerAccumulating => {
                // Two micro-batches of half the rows, each half the loss.
                let h = x.dim(0).unwrap() / 2;
                let micro = |scaler: &GradScaler, i: usize| {
                    let l = (losses(&x.narrow(0, i * h, h).unwrap(), &y.narrow(0, i * h, h).unwrap()) / 2.0).unwrap();
                    scaler.scale(&l).unwrap().backward().unwrap()
                };
                let g0 = micro(&scaler, 0);
                scaler.accumulate(&mut opt, &g0).unwrap();
                let g1 = micro(&scaler, 1);
                if let Some(max) = extras.clip {
                    scaler.unscale(&mut opt, &g1).unwrap();
                    norms.push(opt.clip_grad_norm(max).unwrap().to_bits());
                }
                scaler.step(&mut opt, &g1).unwrap();
                scaler.update(None).unwrap();
            }
            Api::GuardAccumulating => {
                let h = x.dim(0).unwrap() / 2;
                let micro = |i: usize| {
                    (losses(&x.narrow(0, i * h, h).unwrap(), &y.narrow(0, i * h, h).unwrap()) / 2.0).unwrap()
                };
                {
                    let _local = ddp.as_ref().filter(|_| extras.no_sync).map(|d| d.no_sync());
                    amp.scale_loss(&micro(0), &mut opt).unwrap().backward().unwrap();
                }
                amp.scale_loss(&micro(1), &mut opt).unwrap().backward().unwrap();
                if let Some(max) = extras.clip {
                    norms.push(opt.clip_grad_norm(max).unwrap().to_bits());
                }
                opt.step().unwrap();
            }
        }
        opt.zero_grad();
    }
    let owned = amp
        .store()
        .params()
        .iter()
        .map(|p| p.name().to_string())
        .filter(|n| {
            ddp.as_ref()
                .and_then(|d| d.owner_of(n))
                .is_none_or(|r| Some(r) == ddp.as_ref().map(|d| d.rank()))
        })
        .collect();
    Run {
        state: state_of(&amp),
        working: working_of(&amp),
        owned,
        norms,
        skipped: opt.skipped_steps(),
        reductions: ddp.as_ref().map_or(0, |d| d.reductions()),
        collectives: ddp.as_ref().map_or(0, |d| d.collectives()),
        overlapped_steps: ddp.as_ref().map_or(0, |d| d.overlapped_steps()),
        early_buckets: ddp.as_ref().map_or(0, |d| d.early_buckets()),
    }
}

/// Every store tensor (parameters and buffers) as f32 bits, by name: `value` picks which
/// tensor of each parameter.
fn bits_of(amp: &amp::Amp, value: impl Fn(&amp::Param) -> Tensor) -> Vec<(String, Vec<u32>)> {
    let mut state: Vec<(String, Vec<u32>)> = amp
        .store()
        .params()
        .iter()
        .map(|p| {
            let v = value(p)
                .to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            (p.name().to_string(), v.into_iter().map(f32::to_bits).collect())
        })
        .collect();
    state.sort();
    state
}

/// Every store tensor's f32 value (the master where there is one), by name.
pub fn state_of(amp: &amp::Amp) -> Vec<(String, Vec<u32>)> {
    bits_of(amp, |p| p.f32_value().unwrap())
}

/// Every store tensor's working value (the model's own, half at O2 and O3), by name.
pub fn working_of(amp: &amp::Amp) -> Vec<(String, Vec<u32>)> {
    bits_of(amp, |p| p.working().clone())
}

pub fn assert_close(a: &Run, b: &Run, tol: f32, what: &str) {
    assert_eq!(a.state.len(), b.state.len());
    for ((na, va), (nb, vb)) in a.state.iter().zip(&b.state) {
        assert_eq!(na, nb);
        for (i, (x, y)) in va.iter().zip(vb).enumerate() {
            let (x, y) = (f32::from_bits(*x), f32::from_bits(*y));
            assert!((x - y).abs() <= tol * y.abs().max(1.0), "{what}: {na}[{i}] {x} vs {y}");
        }
    }
}
