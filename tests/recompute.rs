//! Gradient checkpointing and chunked feed-forward against the plain forward at every opt
//! level: gradients, weights, dropout masks, the loss scale's trajectory with overflows
//! inside checkpointed segments, batch norm's running statistics, `GradScaler`, and bad
//! arguments.
//!
//! On `common::device()`: a recomputation runs the same kernels as the forward it replays,
//! so the bit-for-bit comparisons hold on any device.

mod common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

use candle_amp::nn::{BatchNorm, Dropout, LayerNorm, Linear, batch_norm, layer_norm, linear};
use candle_amp::optim::{Sgd, SgdConfig};
use candle_amp::recompute::{Recompute, chunked_forward};
use candle_amp::{self as amp, AmpConfig, AmpError, DynamicParams, GradScaler, HalfType, OptLevel};
use candle_core::{DType, Module, Tensor};
use candle_nn::{ModuleT, VarBuilder};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const D: usize = 8;
const T: usize = 6;
const BATCH: usize = 3;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Plain,
    /// `checkpoint_sequential` with this many segments.
    Sequential(usize),
    /// `checkpoint` around every block.
    EveryBlock,
    /// The feed-forward in slices of this many positions, recomputed per slice.
    Chunked(usize),
    /// Both: two segments, and chunks inside the blocks.
    Both,
}

/// The position-wise feed-forward of a block.
#[derive(Clone)]
struct Ffn {
    ln: LayerNorm,
    up: Linear,
    down: Linear,
}

impl Module for Ffn {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.down
            .forward(&amp::ops::gelu(&self.up.forward(&self.ln.forward(x)?)?)?)
    }
}

/// A pre-norm residual block: `x + dropout(ffn(x)) * gain`, where `gain` (1 unless a test
/// injects an overflow) multiplies inside the block.
#[derive(Clone)]
struct Block {
    ffn: Ffn,
    drop: Dropout,
    rc: Recompute,
    chunk: Option<usize>,
    gain: Arc<AtomicU32>,
}

impl ModuleT for Block {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let h = match self.chunk {
            Some(c) => self.rc.chunked_forward(&self.ffn, c, 1, x, train)?,
            None => self.ffn.forward(x)?,
        };
        let gain = f32::from_bits(self.gain.load(Ordering::Relaxed)) as f64;
        let h = (self.drop.forward_t(&h, train)? * gain)?;
        amp::ops::add(x, &h)
    }
}

struct Net {
    inp: Linear,
    blocks: Vec<Block>,
    ln: LayerNorm,
    head: Linear,
    rc: Recompute,
    mode: Mode,
}

impl Net {
    fn new(
        vb: VarBuilder,
        amp: &amp::Amp,
        rc: &Recompute,
        mode: Mode,
        gain: &Arc<AtomicU32>,
    ) -> candle_core::Result<Self> {
        let chunk = match mode {
            Mode::Chunked(c) => Some(c),
            Mode::Both => Some(4),
            _ => None,
        };
        let drop = amp.generator("dropout");
        Ok(Self {
            inp: linear(5, D, vb.pp("inp"))?,
            blocks: (0..4)
                .map(|i| {
                    let vb = vb.pp(format!("b{i}"));
                    Ok(Block {
                        ffn: Ffn {
                            ln: layer_norm(D, 1e-5, vb.pp("ln"))?,
                            up: linear(D, 4 * D, vb.pp("up"))?,
                            down: linear(4 * D, D, vb.pp("down"))?,
                        },
                        drop: Dropout::new(0.2, drop.clone())?,
                        rc: rc.clone(),
                        chunk,
                        gain: gain.clone(),
                    })
                })
                .collect::<candle_core::Result<_>>()?,
            ln: layer_norm(D, 1e-5, vb.pp("ln"))?,
            head: linear(D, 2, vb.pp("head"))?,
            rc: rc.clone(),
            mode,
        })
    }
}

impl ModuleT for Net {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        let mut h = self.inp.forward(x)?;
        match self.mode {
            Mode::Sequential(s) => h = self.rc.checkpoint_sequential(&self.blocks, s, &h, train)?,
            Mode::Both => h = self.rc.checkpoint_sequential(&self.blocks, 2, &h, train)?,
            Mode::EveryBlock => {
                for b in &self.blocks {
                    h = self.rc.checkpoint(b, &h, train)?;
                }
            }
            Mode::Plain | Mode::Chunked(_) => {
                for b in &self.blocks {
                    h = b.forward_t(&h, train)?;
                }
            }
        }
        self.head.forward(&self.ln.forward(&h)?)
    }
}

fn batch(step: usize) -> (Tensor, Tensor) {
    let mut r = ChaCha8Rng::seed_from_u64(100 + step as u64);
    let x: Vec<f32> = (0..BATCH * T * 5).map(|_| r.random_range(-1.0..1.0)).collect();
    let y: Vec<f32> = (0..BATCH * T * 2).map(|_| r.random_range(-1.0..1.0)).collect();
    (
        Tensor::from_vec(x, (BATCH, T, 5), &common::device()).unwrap(),
        Tensor::from_vec(y, (BATCH, T, 2), &common::device()).unwrap(),
    )
}

/// What a run ends with.
#[derive(Debug, PartialEq)]
struct Outcome {
    /// The last step's master gradients, as bits.
    grads: BTreeMap<String, Vec<u32>>,
    /// Every parameter after the steps, as bits.
    weights: BTreeMap<String, Vec<u32>>,
    /// The loss scale after each step.
    scales: Vec<f32>,
    skipped: u64,
    /// The dropout generator's state at the end.
    rng: ChaCha8Rng,
}

fn bits(t: &Tensor) -> Vec<u32> {
    common::flat(t).into_iter().map(f32::to_bits).collect()
}

/// `steps` steps with the guard; `gain_at`: the steps at which the blocks' gain is huge.
fn run(
    level: OptLevel,
    half: HalfType,
    mode: Mode,
    cfg: impl Fn(AmpConfig) -> AmpConfig,
    steps: usize,
    gain_at: &[usize],
) -> Outcome {
    let amp = amp::Amp::new(
        cfg(AmpConfig::new(level).half(half).seed(7).verbosity(0)),
        &common::device(),
    )
    .unwrap();
    let rc = Recompute::new(&amp);
    let gain = Arc::new(AtomicU32::new(1f32.to_bits()));
    let model = amp.model(|vb| Net::new(vb, &amp, &rc, mode, &gain)).unwrap();
    let mut opt = amp.optimizer(Sgd::new(SgdConfig::new(0.02)).unwrap()).unwrap();
    let mut out = Outcome {
        grads: BTreeMap::new(),
        weights: BTreeMap::new(),
        scales: Vec::new(),
        skipped: 0,
        rng: amp.generator("dropout").snapshot(),
    };
    for step in 0..steps {
        let g = if gain_at.contains(&step) { 6e4f32 } else { 1.0 };
        gain.store(g.to_bits(), Ordering::Relaxed);
        let (x, y) = batch(step);
        let pred = model.forward(&x).unwrap().to_dtype(DType::F32).unwrap();
        let loss = amp::ops::mse(&pred, &y).unwrap();
        let guard = amp.scale_loss(&loss, &mut opt).unwrap();
        // The guard's plain backward also takes the recomputed segments' gradients (the
        // stages collect them); `Sequential(4)` runs that way.
        if matches!(mode, Mode::Plain | Mode::Sequential(4)) {
            guard.backward().unwrap();
        } else {
            guard.backward_with(|l| rc.backward(l)).unwrap();
        }
        out.grads = opt.master_grads().iter().map(|(k, v)| (k.clone(), bits(v))).collect();
        let o = opt.step().unwrap();
        out.scales.push(o.loss_scale());
        opt.zero_grad();
    }
    out.skipped = opt.skipped_steps();
    out.weights = common::f32_bits(amp.store());
    out.rng = amp.generator("dropout").snapshot();
    out
}

fn assert_close(a: &BTreeMap<String, Vec<u32>>, b: &BTreeMap<String, Vec<u32>>, tol: f32, what: &str) {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>(), "{what}");
    for (k, va) in a {
        let scale = b[k]
            .iter()
            .map(|v| f32::from_bits(*v).abs())
            .fold(0f32, f32::max)
            .max(1e-3);
        for (i, (x, y)) in va.iter().zip(&b[k]).enumerate() {
            let (x, y) = (f32::from_bits(*x), f32::from_bits(*y));
            assert!(x.is_finite() && y.is_finite(), "{what}: {k}[{i}] {x} vs {y}");
            assert!(
                (x - y).abs() <= tol * scale,
                "{what}: {k}[{i}] {x} vs {y} (max |.| {scale})"
            );
        }
    }
}

/// A starting scale low enough that these small models' gradients do not overflow.
fn small_scale(c: AmpConfig) -> AmpConfig {
    c.dynamic(DynamicParams {
        init_scale: 256.0,
        ..Default::default()
    })
}

const LEVELS: [(OptLevel, HalfType); 5] = [
    (OptLevel::O0, HalfType::F16),
    (OptLevel::O1, HalfType::F16),
    (OptLevel::O2, HalfType::F16),
    (OptLevel::O2, HalfType::Bf16),
    (OptLevel::O3, HalfType::F16),
];

#[test]
fn checkpointed_gradients_equal_the_plain_ones_bit_for_bit_dropout_included() {
    // A stack of blocks, each used in one segment: the recomputation repeats the forward's
    // operations in the same order, with the same dropout masks, so gradients, weights and
    // the generator's final state are bit-identical at every level.
    for (level, half) in LEVELS {
        let plain = run(level, half, Mode::Plain, small_scale, 3, &[]);
        assert_eq!(plain.skipped, 0, "{level} {half}");
        assert!(
            plain.grads.values().all(|g| g.iter().any(|&b| b != 0)),
            "dropout kept something"
        );
        for mode in [Mode::Sequential(2), Mode::Sequential(4), Mode::EveryBlock] {
            let ck = run(level, half, mode, small_scale, 3, &[]);
            assert_eq!(ck, plain, "{level} {half} {mode:?}");
        }
    }
}

#[test]
fn chunked_feed_forward_equals_the_plain_one_at_every_level() {
    // Slices change how the weight gradients' partial sums are added: equal up to rounding.
    for (level, half) in LEVELS {
        let plain = run(level, half, Mode::Plain, small_scale, 3, &[]);
        assert_eq!(plain.skipped, 0, "{level} {half}");
        // Half-precision rounding in a different place (slices' sums, gradients kept in f32),
        // compounded over three steps: a few units in the last place of the largest value.
        let tol = match (level, half) {
            (OptLevel::O0, _) => 1e-5,
            (_, HalfType::F16) => 1e-2,
            _ => 6e-2,
        };
        for mode in [Mode::Chunked(1), Mode::Chunked(4), Mode::Chunked(T), Mode::Both] {
            let ck = run(level, half, mode, small_scale, 3, &[]);
            let what = format!("{level} {half} {mode:?}");
            assert_close(&ck.grads, &plain.grads, tol, &what);
            assert_close(&ck.weights, &plain.weights, tol, &what);
            assert_eq!(ck.rng, plain.rng, "{what}: dropout draws");
            assert_eq!(ck.scales, plain.scales, "{what}");
        }
    }
}

#[test]
fn an_overflow_inside_a_checkpointed_segment_skips_the_step_like_any_other() {
    // At O2 f16 a gain of 6e4 inside the blocks overflows the half activations at steps 1
    // and 3; with a starting scale of 2^24 the first steps' gradients overflow too. The
    // checkpointed run skips exactly the plain run's steps and follows its scale.
    let cfg = |c: AmpConfig| {
        c.dynamic(DynamicParams {
            init_scale: 2f32.powi(24),
            growth_interval: 2,
            ..Default::default()
        })
    };
    let plain = run(OptLevel::O2, HalfType::F16, Mode::Plain, cfg, 6, &[1, 3]);
    assert!(plain.skipped >= 2, "the injected overflows skip: {plain:?}");
    for mode in [Mode::Sequential(2), Mode::EveryBlock, Mode::Both] {
        let ck = run(OptLevel::O2, HalfType::F16, mode, cfg, 6, &[1, 3]);
        assert_eq!(ck.scales, plain.scales, "{mode:?}");
        assert_eq!(ck.skipped, plain.skipped, "{mode:?}");
        if mode != Mode::Both {
            assert_eq!(ck.weights, plain.weights, "{mode:?}");
        }
    }
    // Only the overflowing step: weights after it are bit-identical to before it.
    let before = run(OptLevel::O2, HalfType::F16, Mode::Sequential(2), small_scale, 1, &[]);
    let after = run(OptLevel::O2, HalfType::F16, Mode::Sequential(2), small_scale, 2, &[1]);
    assert_eq!(after.skipped, 1);
    assert_eq!(after.weights, before.weights);
}

#[test]
fn checkpointing_works_with_grad_scaler() {
    let go = |ck: bool| {
        let amp = amp::Amp::new(AmpConfig::new(OptLevel::O2).seed(7).verbosity(0), &common::device()).unwrap();
        let rc = Recompute::new(&amp);
        let gain = Arc::new(AtomicU32::new(1f32.to_bits()));
        let mode = if ck { Mode::Sequential(2) } else { Mode::Plain };
        let model = amp.model(|vb| Net::new(vb, &amp, &rc, mode, &gain)).unwrap();
        let mut opt = amp.optimizer(Sgd::new(SgdConfig::new(0.02)).unwrap()).unwrap();
        let mut scaler = GradScaler::new();
        for step in 0..3 {
            let (x, y) = batch(step);
            let loss = amp::ops::mse(&model.forward(&x).unwrap().to_dtype(DType::F32).unwrap(), &y).unwrap();
            let scaled = scaler.scale(&loss).unwrap();
            let grads = if ck {
                rc.backward(&scaled).unwrap()
            } else {
                scaled.backward().unwrap()
            };
            scaler.step(&mut opt, &grads).unwrap();
            scaler.update(None).unwrap();
            opt.zero_grad();
        }
        common::f32_bits(amp.store())
    };
    assert_eq!(go(true), go(false));
}

/// A block with batch norm over the channels of `(batch, channels)` input.
#[derive(Clone)]
struct BnBlock {
    fc: Linear,
    bn: BatchNorm,
}

impl ModuleT for BnBlock {
    fn forward_t(&self, x: &Tensor, train: bool) -> candle_core::Result<Tensor> {
        amp::ops::relu(&self.bn.forward_t(&self.fc.forward(x)?, train)?)
    }
}

#[test]
fn batch_norm_in_a_recomputed_segment_updates_its_running_statistics_once() {
    let go = |segments: usize| {
        let amp = amp::Amp::new(AmpConfig::new(OptLevel::O2).seed(3).verbosity(0), &common::device()).unwrap();
        let rc = Recompute::new(&amp);
        let model = amp
            .model(|vb| {
                (0..2)
                    .map(|i| {
                        Ok(BnBlock {
                            fc: linear(4, 4, vb.pp(format!("fc{i}")))?,
                            bn: batch_norm(4, 1e-5, vb.pp(format!("bn{i}")))?,
                        })
                    })
                    .collect::<candle_core::Result<Vec<_>>>()
            })
            .unwrap();
        let mut opt = amp.optimizer(Sgd::new(SgdConfig::new(0.02)).unwrap()).unwrap();
        for step in 0..2 {
            let x = batch(step).0.flatten_to(1).unwrap().narrow(1, 0, 4).unwrap();
            let h = rc
                .checkpoint_sequential(model.inner(), segments, &x.to_dtype(DType::F16).unwrap(), true)
                .unwrap();
            let loss = h.to_dtype(DType::F32).unwrap().sqr().unwrap().mean_all().unwrap();
            amp.scale_loss(&loss, &mut opt)
                .unwrap()
                .backward_with(|l| rc.backward(l))
                .unwrap();
            opt.step().unwrap();
            opt.zero_grad();
        }
        common::f32_bits(amp.store())
    };
    let plain = go(1);
    assert!(plain.contains_key("bn0.running_mean"));
    assert_eq!(go(2), plain);
}

#[test]
fn forward_values_equal_the_plain_model_in_training_and_evaluation() {
    let out = |mode: Mode, train: bool| {
        let amp = amp::Amp::new(AmpConfig::new(OptLevel::O2).seed(7), &common::device()).unwrap();
        let rc = Recompute::new(&amp);
        let gain = Arc::new(AtomicU32::new(1f32.to_bits()));
        let model = amp.model(|vb| Net::new(vb, &amp, &rc, mode, &gain)).unwrap();
        if !train {
            model.eval();
        }
        bits(&model.forward(&batch(0).0).unwrap())
    };
    for train in [true, false] {
        let plain = out(Mode::Plain, train);
        // Checkpointing runs the same operations: the same bits.
        for mode in [Mode::Sequential(4), Mode::EveryBlock] {
            assert_eq!(out(mode, train), plain, "{mode:?} train={train}");
        }
        // Slices are products of other shapes, rounded in half on their own.
        for mode in [Mode::Chunked(4), Mode::Both] {
            let got = out(mode, train);
            let max = plain.iter().map(|b| f32::from_bits(*b).abs()).fold(0f32, f32::max);
            for (a, b) in got.iter().zip(&plain) {
                let (a, b) = (f32::from_bits(*a), f32::from_bits(*b));
                assert!((a - b).abs() <= 1e-2 * max, "{mode:?} train={train}: {a} vs {b}");
            }
        }
    }
}

#[test]
fn bad_arguments_are_typed_errors() {
    let amp = amp::Amp::new(AmpConfig::new(OptLevel::O0), &common::device()).unwrap();
    let rc = Recompute::new(&amp);
    let blocks = amp
        .model(|vb| {
            (0..3)
                .map(|i| linear(4, 4, vb.pp(format!("l{i}"))))
                .collect::<candle_core::Result<Vec<_>>>()
        })
        .unwrap();
    let x = Tensor::ones((2, 4), DType::F32, &common::device()).unwrap();
    for segments in [0, 4] {
        match rc.checkpoint_sequential(blocks.inner(), segments, &x, true) {
            Err(AmpError::InvalidArgument { argument, .. }) => assert_eq!(argument, "segments"),
            other => panic!("{segments} segments: {other:?}"),
        }
    }
    let f = |x: &Tensor| x.relu();
    match chunked_forward(&f, 0, 1, &x) {
        Err(AmpError::InvalidArgument { argument, .. }) => assert_eq!(argument, "chunk_size"),
        other => panic!("{other:?}"),
    }
    match rc.chunked_forward(&f, 2, 2, &x, true) {
        Err(AmpError::InvalidArgument { argument, .. }) => assert_eq!(argument, "dim"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn chunked_inference_equals_the_whole_layer() {
    let amp = amp::Amp::new(AmpConfig::new(OptLevel::O0).seed(2), &common::device()).unwrap();
    let ffn = amp
        .model(|vb| {
            Ok(Ffn {
                ln: layer_norm(D, 1e-5, vb.pp("ln"))?,
                up: linear(D, 4 * D, vb.pp("up"))?,
                down: linear(4 * D, D, vb.pp("down"))?,
            })
        })
        .unwrap();
    let x = Tensor::randn(0f32, 1.0, (2, 7, D), &common::device()).unwrap();
    let whole = ffn.inner().forward(&x).unwrap();
    for c in [1, 3, 7, 20] {
        let sliced = chunked_forward(ffn.inner(), c, 1, &x).unwrap();
        let d = (&whole - &sliced).unwrap().abs().unwrap().max_all().unwrap();
        assert!(d.to_scalar::<f32>().unwrap() < 1e-5, "chunk {c}");
    }
}

#[test]
fn segments_on_input_data_get_their_gradients() {
    // The input is outside any graph: the segment node hangs off a variable of its own.
    let grads = |how: u8| {
        let amp = amp::Amp::new(AmpConfig::new(OptLevel::O0).seed(4), &common::device()).unwrap();
        let rc = Recompute::new(&amp);
        let model = amp.model(|vb| linear(5, 3, vb.pp("fc"))).unwrap();
        let mut opt = amp.optimizer(Sgd::new(SgdConfig::new(0.1)).unwrap()).unwrap();
        let (x, _) = batch(0);
        let y = match how {
            0 => model.inner().forward(&x).unwrap(),
            1 => rc.chunked_forward(model.inner(), 2, 1, &x, true).unwrap(),
            _ => rc.checkpoint(model.inner(), &x, true).unwrap(),
        };
        let loss = y.sqr().unwrap().mean_all().unwrap();
        amp.scale_loss(&loss, &mut opt)
            .unwrap()
            .backward_with(|l| rc.backward(l))
            .unwrap();
        opt.master_grads()
            .iter()
            .map(|(k, v)| (k.clone(), bits(v)))
            .collect::<BTreeMap<_, _>>()
    };
    let plain = grads(0);
    assert_eq!(plain.len(), 2);
    assert_close(&grads(1), &plain, 1e-6, "chunked");
    assert_eq!(grads(2), plain, "checkpointed");
}

/// A run with one checkpointed segment (a layer and dropout, drawing from "dropout") while a
/// loader thread draws from "data": the four "data" draws (before the forward, between the
/// forward and the backward, on the loader thread while the backward recomputes the
/// segment, after the backward), the gradients and the dropout stream's end state. Without
/// checkpointing nothing recomputes, and the loader draws at the same point of the stream.
fn draws_around_a_recompute(checkpointed: bool) -> (Vec<u64>, BTreeMap<String, Vec<u32>>, ChaCha8Rng) {
    use std::sync::Mutex;
    use std::sync::atomic::AtomicUsize;
    use std::sync::mpsc;

    let amp = amp::Amp::new(AmpConfig::new(OptLevel::O0).seed(9).verbosity(0), &common::device()).unwrap();
    let rc = Recompute::new(&amp);
    let model = amp.model(|vb| linear(5, 5, vb.pp("fc"))).unwrap();
    let mut opt = amp.optimizer(Sgd::new(SgdConfig::new(0.1)).unwrap()).unwrap();
    let drop = Dropout::new(0.5, amp.generator("dropout")).unwrap();
    let data = amp.generator("data");
    // The prefetching loader: one draw from "data" per request, on its own thread (it ends
    // when the last sender is dropped).
    let (requests, inbox) = mpsc::channel::<mpsc::Sender<u64>>();
    {
        let data = data.clone();
        std::thread::spawn(move || {
            for reply in inbox {
                reply.send(data.lock().random::<u64>()).unwrap();
            }
        });
    }
    let draws = Arc::new(Mutex::new(vec![data.lock().random::<u64>()]));
    let loader_draw = {
        let (requests, draws) = (Mutex::new(requests), draws.clone());
        Arc::new(move || {
            let (reply, answer) = mpsc::channel();
            requests.lock().unwrap().send(reply).unwrap();
            draws.lock().unwrap().push(answer.recv().unwrap());
        })
    };
    let calls = Arc::new(AtomicUsize::new(0));
    let segment = {
        let (fc, drop, calls, loader_draw) = (model.inner().clone(), drop.clone(), calls.clone(), loader_draw.clone());
        move |x: &Tensor| {
            // The second call is the recomputation: the loader draws while it runs.
            if calls.fetch_add(1, Ordering::SeqCst) == 1 {
                loader_draw();
            }
            drop.forward_t(&fc.forward(x)?, true)
        }
    };
    let (x, _) = batch(0);
    let x = x.reshape((BATCH * T, 5)).unwrap();
    let y = if checkpointed {
        rc.checkpoint_fn(segment, &x, true).unwrap()
    } else {
        segment(&x).unwrap()
    };
    draws.lock().unwrap().push(data.lock().random::<u64>());
    let loss = y.sqr().unwrap().mean_all().unwrap();
    amp.scale_loss(&loss, &mut opt)
        .unwrap()
        .backward_with(|l| rc.backward(l))
        .unwrap();
    assert_eq!(calls.load(Ordering::SeqCst), 1 + checkpointed as usize);
    if !checkpointed {
        loader_draw();
    }
    draws.lock().unwrap().push(data.lock().random::<u64>());
    let grads = opt.master_grads().iter().map(|(k, v)| (k.clone(), bits(v))).collect();
    let out = draws.lock().unwrap().clone();
    (out, grads, amp.generator("dropout").snapshot())
}

#[test]
fn a_recompute_replays_only_its_own_streams_and_hides_them_from_other_threads() {
    let (plain_draws, plain_grads, plain_dropout) = draws_around_a_recompute(false);
    let (draws, grads, dropout) = draws_around_a_recompute(true);
    // "data", which the segment never drew from, gives the draws it gives without
    // checkpointing: no repeat while the backward recomputes, no lag after it.
    let mut fresh = amp::Amp::new(AmpConfig::new(OptLevel::O0).seed(9).verbosity(0), &common::device())
        .unwrap()
        .generator("data")
        .snapshot();
    let expected: Vec<u64> = (0..4).map(|_| fresh.random::<u64>()).collect();
    assert_eq!(plain_draws, expected);
    assert_eq!(
        draws, expected,
        "the loader's stream while and after a segment is recomputed"
    );
    // "dropout", which it did draw from, replays exactly: the same masks, the same gradients,
    // and the stream ends where the plain run's does.
    assert_eq!(grads.len(), 2);
    assert_eq!(grads, plain_grads);
    assert_eq!(dropout, plain_dropout);
}
