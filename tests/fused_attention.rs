//! `nn::SelfAttention`: everything from the three projections to the output projection as
//! one node gives the same output and the same parameter gradients, bit for bit, as the
//! unfused layers (`split_heads`, `scaled_dot_product_attention`, `merge_heads`), at every
//! level, in f16 and bf16, causal or not, on every instruction-set tier the CPU has, on the
//! CPU and the forced device path. The input's gradient, summed in f32 and rounded once, is
//! checked against an f64 reference of the same function on the values the layers computed
//! with: at least as close as the unfused graph's, which rounds each partial sum to half.
//! And the fusion takes effect: the loss's graph has only the node's output as a half
//! tensor between the input and the loss.

mod common;

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use candle_amp::nn::{Linear, SelfAttention, linear, merge_heads, scaled_dot_product_attention, split_heads};
use candle_amp::optim::{Sgd, SgdConfig};
use candle_amp::{self as amp, AmpConfig, HalfType, OptLevel};
use candle_core::{D, DType, Device, Module, Tensor, Var};
use common::{backward_capturing, each_tier, f64_bits as bits, grid, half_nodes, vals};

/// `force_isa` is process-wide: the tests of this file run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

const B: usize = 3;
const T: usize = 6;
const DM: usize = 16;
const HEADS: usize = 2;

/// The fused module, and the same projections run unfused as a user would write them.
struct Attn {
    attn: SelfAttention,
    fused: AtomicBool,
}

impl Attn {
    fn unfused(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let [q, k, v, o] = self.attn.projections();
        let split = |l: &Linear| split_heads(&l.forward(x)?, HEADS);
        let a = scaled_dot_product_attention(&split(q)?, &split(k)?, &split(v)?, None, self.attn.causal(), None)?;
        o.forward(&merge_heads(&a)?)
    }
}

impl Module for Attn {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if self.fused.load(Ordering::Relaxed) {
            self.attn.forward(x)
        } else {
            self.unfused(x)
        }
    }
}

/// What one forward and backward leaves: output, input gradient (of the scaled loss), the
/// master gradients, the loss scale, the half graph nodes.
type Seen = (Vec<u64>, Option<Tensor>, BTreeMap<String, Vec<u64>>, f64, usize);

fn check(level: OptLevel, half: HalfType, causal: bool, device_path: bool, data: bool, what: &str) {
    let cfg = AmpConfig::new(level)
        .half(half)
        .device_path(device_path)
        .verbosity(0)
        // A scale the products' half range holds at these sizes (the default 2^16 overflows
        // the probabilities' gradient, fused or not, and skips the step).
        .loss_scale(amp::LossScaleSpec::Static(64.0))
        .seed(11);
    let (model, mut opt, amp) = amp::initialize(
        |vb| {
            let l = |n: &str| linear(DM, DM, vb.pp(n));
            Ok(Attn {
                attn: SelfAttention::new(l("q")?, l("k")?, l("v")?, l("o")?, HEADS, causal)?,
                fused: AtomicBool::new(true),
            })
        },
        Sgd::new(SgdConfig::new(0.5)).unwrap(),
        cfg,
    )
    .unwrap();
    let dev = Device::Cpu;
    let x = Var::from_tensor(&Tensor::from_vec(grid(B * T * DM, 0.125, 16, 5), (B, T, DM), &dev).unwrap()).unwrap();
    let r = Tensor::from_vec(grid(B * T * DM, 1.0 / 64.0, 8, 6), (B, T, DM), &dev).unwrap();
    let mut once = |fused: bool| -> Seen {
        model.inner().fused.store(fused, Ordering::Relaxed);
        let input = if data {
            x.as_tensor().detach()
        } else {
            x.as_tensor().affine(1.0, 0.0).unwrap()
        };
        let y = model.forward(&input).unwrap();
        let loss = (y.to_dtype(DType::F32).unwrap() * &r).unwrap().sum_all().unwrap();
        let nodes = half_nodes(&loss);
        let (report, gx) = backward_capturing(&amp, &loss, &mut opt, x.as_tensor());
        assert!(!report.found_inf, "{what} fused={fused}");
        let grads = opt.master_grads().iter().map(|(k, v)| (k.clone(), bits(v))).collect();
        opt.zero_grad();
        (bits(&y), gx, grads, report.loss_scale as f64, nodes)
    };
    let fused = once(true);
    let plain = once(false);
    assert_eq!(fused.0, plain.0, "{what}: output");
    assert_eq!(fused.2.len(), 8, "{what}: parameter gradients");
    assert_eq!(fused.2, plain.2, "{what}: parameter gradients");
    assert_eq!(fused.1.is_some(), !data, "{what}: input gradient present");
    // The point of the fusion: nothing between the input and the output is a half tensor of
    // the graph (O2/O3: the input's half copy and the output; O1 or an input without a
    // gradient: the output alone), where
    // the unfused graph has the projections, their splits, the transposed keys, the scores,
    // the probabilities' half copy, the heads' outputs and their merge.
    if level == OptLevel::O0 {
        assert_eq!(fused.4, plain.4, "{what}: O0 runs unfused");
        assert_eq!(fused.1.as_ref().map(bits), plain.1.as_ref().map(bits), "{what}");
        return;
    }
    let want = if level == OptLevel::O1 || data { 1 } else { 2 };
    assert_eq!(fused.4, want, "{what}: half graph nodes (unfused {})", plain.4);
    assert!(plain.4 >= want + 10, "{what}: unfused half nodes {}", plain.4);
    if data {
        return;
    }
    // The input gradient against f64: the same function on the values the layers computed
    // with (parameters and input rounded to the half type).
    let dt = half.dtype();
    let m = model.inner();
    let r64 = |t: &Tensor| t.to_dtype(dt).unwrap().to_dtype(DType::F64).unwrap();
    let x64 = Var::from_tensor(&r64(x.as_tensor())).unwrap();
    let [pq, pk, pv, po] = m.attn.projections();
    let lin = |l: &Linear, h: &Tensor| {
        let w = r64(l.weight());
        let b = r64(l.bias().unwrap());
        h.broadcast_matmul(&w.t().unwrap()).unwrap().broadcast_add(&b).unwrap()
    };
    let split = |h: Tensor| {
        h.reshape((B, T, HEADS, DM / HEADS))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
    };
    let (q, k, v) = (
        split(lin(pq, x64.as_tensor())),
        split(lin(pk, x64.as_tensor())),
        split(lin(pv, x64.as_tensor())),
    );
    let mut s = (q.matmul(&k.t().unwrap().contiguous().unwrap()).unwrap() / ((DM / HEADS) as f64).sqrt()).unwrap();
    if causal {
        let mask: Vec<f64> = (0..T * T)
            .map(|i| if i % T > i / T { f64::NEG_INFINITY } else { 0.0 })
            .collect();
        s = s.broadcast_add(&Tensor::from_vec(mask, (T, T), &dev).unwrap()).unwrap();
    }
    let p = candle_nn::ops::softmax(&s, D::Minus1).unwrap();
    let a = p
        .matmul(&v)
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap()
        .reshape((B, T, DM))
        .unwrap();
    let y = lin(po, &a);
    let loss = (y * r.to_dtype(DType::F64).unwrap()).unwrap().sum_all().unwrap();
    let want = vals(loss.backward().unwrap().get(x64.as_tensor()).unwrap());
    let err = |g: &Tensor, scale: f64| {
        let got = vals(g);
        let top = want.iter().fold(0f64, |a, v| a.max(v.abs())).max(1e-30);
        got.iter()
            .zip(&want)
            .fold(0f64, |a, (g, w)| a.max((g / scale - w).abs()))
            / top
    };
    let (ef, ep) = (
        err(fused.1.as_ref().unwrap(), fused.3),
        err(plain.1.as_ref().unwrap(), plain.3),
    );
    let bound = if dt == DType::BF16 { 4e-2 } else { 6e-3 };
    assert!(ef < bound, "{what}: fused input gradient vs f64 {ef} (unfused {ep})");
    // Both errors are dominated by the half products inside; summing in f32 must not make
    // the input's gradient measurably worse.
    assert!(
        ef <= ep * 1.5 + 1e-4,
        "{what}: fused input gradient vs f64 {ef}, unfused {ep}"
    );
}

#[test]
fn fused_self_attention_matches_the_unfused_layers_everywhere() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    each_tier(|isa| {
        for level in [OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3] {
            for half in [HalfType::F16, HalfType::Bf16] {
                for causal in [true, false] {
                    for device_path in [false, true] {
                        for data in [false, true] {
                            let what = format!(
                                "{level:?} {half:?} causal={causal} {isa:?} device_path={device_path} data={data}"
                            );
                            check(level, half, causal, device_path, data, &what);
                        }
                    }
                }
            }
        }
    });
}

/// Outside a run the module is the unfused function; bad shapes are refused when built; an
/// empty batch gives an empty result.
#[test]
fn outside_a_run_and_edge_cases() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let dev = Device::Cpu;
    let w = |r: usize, c: usize, seed: u64| Tensor::from_vec(grid(r * c, 0.0625, 8, seed), (r, c), &dev).unwrap();
    let l = |r: usize, c: usize, seed: u64| Linear::new(w(r, c, seed), None);
    let attn = SelfAttention::new(l(8, 8, 1), l(8, 8, 2), l(8, 8, 3), l(8, 8, 4), 2, true).unwrap();
    let x = Tensor::from_vec(grid(2 * 5 * 8, 0.125, 8, 9), (2, 5, 8), &dev).unwrap();
    let m = Attn {
        attn: attn.clone(),
        fused: AtomicBool::new(false),
    };
    assert_eq!(bits(&attn.forward(&x).unwrap()), bits(&m.unfused(&x).unwrap()));
    let empty = Tensor::zeros((0, 5, 8), DType::F32, &dev).unwrap();
    assert_eq!(attn.forward(&empty).unwrap().dims(), [0, 5, 8]);
    // 3 heads do not divide 8; o must take v's width; no activations.
    assert!(SelfAttention::new(l(8, 8, 1), l(8, 8, 2), l(8, 8, 3), l(8, 8, 4), 3, true).is_err());
    assert!(SelfAttention::new(l(8, 8, 1), l(8, 8, 2), l(8, 8, 3), l(8, 4, 4), 2, true).is_err());
    assert!(SelfAttention::new(l(8, 8, 1), l(6, 8, 2), l(8, 8, 3), l(8, 8, 4), 2, true).is_err());
    let relu = l(8, 8, 1).with_activation(candle_amp::nn::Activation::Relu);
    assert!(SelfAttention::new(relu, l(8, 8, 2), l(8, 8, 3), l(8, 8, 4), 2, true).is_err());
    assert_eq!(attn.heads(), 2);
}

/// A residual attention block for the checkpointing test.
#[derive(Clone)]
struct Blk(SelfAttention);

impl candle_nn::ModuleT for Blk {
    fn forward_t(&self, x: &Tensor, _train: bool) -> candle_core::Result<Tensor> {
        amp::ops::add(x, &self.0.forward(x)?)
    }
}

struct Stack {
    blocks: Vec<Blk>,
    rc: candle_amp::recompute::Recompute,
    checkpointed: bool,
}

impl Module for Stack {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        if self.checkpointed {
            return Ok(self.rc.checkpoint_sequential(&self.blocks, 2, x, true)?);
        }
        self.blocks
            .iter()
            .try_fold(x.clone(), |h, b| candle_nn::ModuleT::forward_t(b, &h, true))
    }
}

/// Gradient checkpointing replays the fused node in the backward: the parameter gradients
/// are the same, bit for bit, as without it, at every level.
#[test]
fn checkpointed_fused_attention_gives_the_same_gradients() {
    let _s = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    for level in [OptLevel::O1, OptLevel::O2, OptLevel::O3] {
        for half in [HalfType::F16, HalfType::Bf16] {
            let run = |checkpointed: bool| {
                let cfg = AmpConfig::new(level)
                    .half(half)
                    .seed(3)
                    .verbosity(0)
                    .loss_scale(amp::LossScaleSpec::Static(64.0));
                let amp = amp::Amp::new(cfg, &Device::Cpu).unwrap();
                let rc = candle_amp::recompute::Recompute::new(&amp);
                let model = amp
                    .model(|vb| {
                        Ok(Stack {
                            blocks: (0..4)
                                .map(|i| {
                                    Ok(Blk(candle_amp::nn::self_attention(
                                        DM,
                                        HEADS,
                                        true,
                                        vb.pp(format!("b{i}")),
                                    )?))
                                })
                                .collect::<candle_core::Result<_>>()?,
                            rc: rc.clone(),
                            checkpointed,
                        })
                    })
                    .unwrap();
                let mut opt = amp.optimizer(Sgd::new(SgdConfig::new(0.1)).unwrap()).unwrap();
                let x = Tensor::from_vec(grid(B * T * DM, 0.125, 16, 8), (B, T, DM), &Device::Cpu).unwrap();
                let r = Tensor::from_vec(grid(B * T * DM, 1.0 / 64.0, 8, 9), (B, T, DM), &Device::Cpu).unwrap();
                let y = model.forward(&x).unwrap().to_dtype(DType::F32).unwrap();
                let loss = (y * &r).unwrap().sum_all().unwrap();
                let guard = amp.scale_loss(&loss, &mut opt).unwrap();
                guard.backward_with(|l| rc.backward(l)).unwrap();
                let grads: BTreeMap<String, Vec<u64>> =
                    opt.master_grads().iter().map(|(k, v)| (k.clone(), bits(v))).collect();
                grads
            };
            let (plain, ck) = (run(false), run(true));
            assert_eq!(plain.len(), 32, "{level:?} {half:?}");
            assert!(plain.values().all(|g| g.iter().any(|&b| f64::from_bits(b) != 0.0)));
            assert_eq!(ck, plain, "{level:?} {half:?}: checkpointed gradients");
        }
    }
}
