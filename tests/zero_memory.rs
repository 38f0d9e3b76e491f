//! ZeRO's memory, measured. Per rank, the f32 master weights and the optimizer state of a
//! sharded run (the tensors the rank holds) come to at most `1/N + 5%` of the unsharded
//! run's, at N = 2 and 4, for stage 1 and stage 2; and a counting global allocator (so this
//! test binary holds this one test only) sees the process, all `LocalGroup` ranks together,
//! hold `N - 1` copies of the masters and state fewer than the unsharded ranks, measured
//! while every rank is at the same point after its steps. A long sharded run's memory does
//! not grow with the step count, nor does an overlapped run's (`DataParallel::set_overlap`:
//! its buckets and thread).
//!
//! The per-rank shares are measured on `common::device()`. The allocator counts host memory,
//! so the process-wide counts run on the CPU on every device (on a GPU the masters and state
//! would be device memory, which no global allocator sees).

mod common;
mod counting;

use std::time::Duration;

use candle_amp::distributed::{DataParallel, Sharding};
use candle_amp::optim::{AdamW, AdamWConfig};
use candle_amp::{self as amp, AmpConfig, OptLevel};
use candle_core::{DType, Device, Tensor};
use candle_nn::{Module, VarBuilder};

#[global_allocator]
static A: counting::Counting = counting::Counting;

const WIDTH: usize = 64;
const LAYERS: usize = 8;

/// Eight equal linear layers: a whole-parameter partition splits them evenly over 2 and 4
/// ranks (the partition balances within the largest parameter).
struct Stack(Vec<amp::nn::Linear>);

impl Stack {
    fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        let layers = (0..LAYERS)
            .map(|i| amp::nn::linear(WIDTH, WIDTH, vb.pp(format!("l{i}"))))
            .collect::<candle_core::Result<_>>()?;
        Ok(Self(layers))
    }
}

impl Module for Stack {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mut h = x.clone();
        for l in &self.0 {
            h = amp::ops::relu(&l.forward(&h)?)?;
        }
        Ok(h)
    }
}

/// What [`held_after_steps`] saw on one rank.
struct Held {
    /// Bytes of the masters and optimizer state this rank holds.
    mine: usize,
    /// Those of the unsharded run's.
    whole: usize,
    /// (rank 0) The process's live bytes while every rank is there.
    live: isize,
    /// Tensors each trained parameter's master and state take: the master, and on the
    /// device path the two moments (the host path keeps those in plain buffers).
    tensors_per_param: usize,
}

/// After three O2 AdamW steps on `dev` (the gradients freed): what this rank holds.
fn held_after_steps(c: std::sync::Arc<dyn amp::distributed::Communicator>, sharding: Sharding, dev: &Device) -> Held {
    let rank = c.rank();
    let cfg = AmpConfig::new(OptLevel::O2).seed(3).verbosity(0);
    let amp = amp::Amp::new(cfg, dev).unwrap();
    let model = amp.model(Stack::new).unwrap();
    let mut opt = amp.optimizer(AdamW::new(AdamWConfig::default()).unwrap()).unwrap();
    let ddp = DataParallel::sharded(&amp, c, Default::default(), sharding).unwrap();
    let x = Tensor::ones((4, WIDTH), DType::F32, dev).unwrap();
    for _ in 0..3 {
        let y = model.forward(&x).unwrap().to_dtype(DType::F32).unwrap();
        let loss = y.sqr().unwrap().mean_all().unwrap();
        amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        opt.step().unwrap();
        opt.zero_grad_set_to_none();
    }
    // What the unsharded run's masters and state take: f32 master + two f32 moments per
    // trained element (the sharded ranks count their own shard only).
    let elems: usize = amp.store().params().iter().map(|p| p.working().elem_count()).sum();
    let whole = elems * 4 * 3;
    let mine: usize = amp::testing::live_buffers(&amp, &[&opt])
        .unwrap()
        .iter()
        .filter(|(n, _)| n.starts_with("master.") || n.contains(".state."))
        .map(|(n, t)| {
            if sharding.is_sharded() {
                let param = match n.strip_prefix("master.") {
                    Some(p) => p,
                    None => n.split_once(".state.").unwrap().1.rsplit_once('.').unwrap().0,
                };
                assert_eq!(ddp.owner_of(param), Some(rank), "rank {rank} holds {n}");
            }
            t.elem_count() * 4
        })
        .sum();
    let tensors_per_param = if amp.device_path() { 3 } else { 1 };
    ddp.barrier().unwrap();
    let live = counting::live();
    ddp.barrier().unwrap();
    drop((model, opt, ddp, amp));
    Held {
        mine,
        whole,
        live,
        tensors_per_param,
    }
}

/// The host bytes one tensor takes beyond its values: candle's tensor and storage headers
/// and its shape and strides. They depend on the build: with the `cuda` feature candle's
/// `Device` and `Storage` enums hold CUDA variants (a device handle, a device slice), some
/// 170 bytes more per tensor than a CPU-only build.
fn tensor_header_bytes() -> isize {
    let before = counting::live();
    let t = Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap();
    let header = counting::live() - before - 4;
    drop(t);
    header
}

/// Live bytes of the process (all ranks) after `a` and after `b` steps on the test device,
/// sharded as `stage`, overlapped or not (rank 0 reads them while every rank waits at a
/// barrier). `None` for an overlapped run on the device path, which refuses overlap.
fn live_at(
    c: std::sync::Arc<dyn amp::distributed::Communicator>,
    (stage, overlap): (Sharding, bool),
    a: usize,
    b: usize,
) -> Option<(isize, isize)> {
    let dev = common::device();
    let cfg = AmpConfig::new(OptLevel::O2).seed(3).verbosity(0);
    let amp = amp::Amp::new(cfg, &dev).unwrap();
    let model = amp.model(Stack::new).unwrap();
    let mut opt = amp.optimizer(AdamW::new(AdamWConfig::default()).unwrap()).unwrap();
    // Buckets of 4 KiB: several, so that some leave during the backward.
    let config = amp::distributed::DataParallelConfig { bucket_bytes: 4096 };
    let ddp = DataParallel::sharded(&amp, c, config, stage).unwrap();
    if overlap && amp.device_path() {
        assert!(ddp.set_overlap(&amp, true).is_err(), "the device path refuses overlap");
        return None;
    }
    ddp.set_overlap(&amp, overlap).unwrap();
    let x = Tensor::ones((4, WIDTH), DType::F32, &dev).unwrap();
    let mut seen = Vec::new();
    for step in 1..=b {
        let y = model.forward(&x).unwrap().to_dtype(DType::F32).unwrap();
        let loss = y.sqr().unwrap().mean_all().unwrap();
        amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        opt.clip_grad_norm(1.0).unwrap();
        opt.step().unwrap();
        opt.zero_grad();
        if step == a || step == b {
            // The communicator's own barrier (between a step and the next backward, where
            // no bucket is on its way): an overlapped run's `ddp.barrier()` goes through its
            // thread, whose channels another rank may be using while this one counts.
            let comm = ddp.communicator();
            comm.barrier().unwrap();
            seen.push(counting::live());
            comm.barrier().unwrap();
        }
    }
    if overlap {
        assert_eq!(
            ddp.overlapped_steps(),
            b as u64 - 1,
            "every step after the first overlapped"
        );
        assert!(ddp.early_buckets() > 0);
    }
    Some((seen[0], seen[1]))
}

#[test]
fn each_rank_holds_its_share_of_the_masters_and_optimizer_state() {
    let header = tensor_header_bytes();
    // A long sharded or overlapped run holds no more after 400 steps than after 100 (one
    // test function: the allocator counts the whole process). The slack, 256 bytes, is below
    // what one byte more per step would add over the 300 steps between.
    for run in [
        (Sharding::Stage1, false),
        (Sharding::Stage2, false),
        (Sharding::None, true),
        (Sharding::Stage1, true),
    ] {
        let r = common::on_ranks(2, Duration::from_secs(60), |c| live_at(c, run, 100, 400));
        let what = format!("{}{}", run.0, if run.1 { ", overlapped" } else { "" });
        let Some((early, late)) = r[0] else {
            eprintln!("{what}: skipped (the device path refuses overlap)");
            continue;
        };
        eprintln!("{what}: {early} bytes live after 100 steps, {late} after 400");
        assert!(late <= early + 256, "{what}: memory grew from {early} to {late} bytes");
    }
    // The shares on the test device; the process's bytes on the CPU (see the module's note).
    let mut devices = vec![common::device()];
    if !common::on_cpu() {
        devices.push(Device::Cpu);
    }
    for dev in &devices {
        let counted = dev.is_cpu();
        for world in [2, 4] {
            let plain = common::on_ranks(world, Duration::from_secs(60), |c| {
                held_after_steps(c, Sharding::None, dev)
            });
            let whole = plain[0].whole;
            assert!(
                plain.iter().all(|r| r.mine == whole),
                "unsharded, every rank holds it all"
            );
            for stage in [Sharding::Stage1, Sharding::Stage2] {
                let sharded = common::on_ranks(world, Duration::from_secs(60), |c| held_after_steps(c, stage, dev));
                let limit = whole as f64 * (1.0 / world as f64 + 0.05);
                for (rank, h) in sharded.iter().enumerate() {
                    let mine = h.mine;
                    eprintln!(
                        "{dev:?} {stage}, {world} ranks, rank {rank}: masters and optimizer state {mine} of {whole} bytes ({:.3})",
                        mine as f64 / whole as f64
                    );
                    assert!(
                        mine as f64 <= limit,
                        "{stage} {world} ranks, rank {rank}: {mine} > {limit} bytes"
                    );
                }
                assert_eq!(
                    sharded.iter().map(|r| r.mine).sum::<usize>(),
                    whole,
                    "each byte on one rank"
                );
                if !counted {
                    continue;
                }
                // The process holds N - 1 copies fewer of the values, and of the headers of
                // the tensors that held them: `N - 1` copies of each trained parameter's
                // master (and, on the device path, moments) are gone, each tensor with its
                // headers, which the values' bytes do not count (16 parameters, and with the
                // `cuda` feature some 400 bytes each: more than the 5% left for allocator
                // slack and the ranks' other buffers).
                let saved = plain[0].live - sharded[0].live;
                let params = 2 * LAYERS;
                let headers = ((world - 1) * params * plain[0].tensors_per_param) as isize * header;
                let expect = ((world - 1) * whole) as isize + headers;
                eprintln!(
                    "{stage}, {world} ranks: the process holds {saved} bytes fewer (N - 1 copies: {} of values, \
                     {headers} of tensor headers at {header} bytes each)",
                    (world - 1) * whole
                );
                assert!(
                    (saved - expect).abs() as f64 <= 0.05 * whole as f64,
                    "{stage} {world} ranks: {saved} bytes saved, expected {expect}"
                );
            }
        }
    }
}
