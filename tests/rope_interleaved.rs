//! `nn::SelfAttention::with_rope_interleaved`: candle's `rope_i` layout (pairs
//! `(x[2i], x[2i+1])`, tables `(max_positions, d_head / 2)`). Outside a run (the unfused
//! composition) the module's output equals one built on `candle_nn::rotary_emb::rope_i`
//! (code nobody here wrote) within f32 rounding; inside a run (the fused node at O1..O3, f16
//! and bf16; the composition at O0) output, input gradient and parameter gradients match an
//! f64 reference of the same function on the values the layers computed with, and the
//! fusion takes effect. A per-call table of half the head width selects the layout too.

mod common;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};

use candle_amp::nn::{Linear, RopeLayout, SelfAttention, linear};
use candle_amp::optim::{Sgd, SgdConfig};
use candle_amp::{self as amp, AmpConfig, HalfType, OptLevel};
use candle_core::{D, DType, Device, Module, Tensor, Var};
use common::{backward_capturing, grid, half_nodes, vals};

const B: usize = 2;
const T: usize = 5;
const DM: usize = 16;
const HEADS: usize = 2;
const HD: usize = DM / HEADS;

/// candle's `rope_i` tables `(T + 2, HD / 2)`: `cos(p θ_i)`, `sin(p θ_i)`.
fn tables(dev: &Device) -> (Tensor, Tensor) {
    let n = T + 2;
    let inv: Vec<f32> = (0..HD / 2)
        .map(|i| 1f32 / 10_000f32.powf(2.0 * i as f32 / HD as f32))
        .collect();
    let (mut c, mut s) = (Vec::new(), Vec::new());
    for p in 0..n {
        c.extend(inv.iter().map(|f| (p as f32 * f).cos()));
        s.extend(inv.iter().map(|f| (p as f32 * f).sin()));
    }
    (
        Tensor::from_vec(c, (n, HD / 2), dev).unwrap(),
        Tensor::from_vec(s, (n, HD / 2), dev).unwrap(),
    )
}

/// `(b, t, n * HD)` as `(b, n, t, HD)`.
fn split(h: &Tensor, n: usize) -> Tensor {
    let (b, t, _) = h.dims3().unwrap();
    h.reshape((b, t, n, HD))
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap()
}

/// The causal attention of `q`, `k`, `v` `(b, h, t, HD)` merged back to `(b, t, h * HD)`,
/// with an additive mask of `neg` above the diagonal.
fn attend(q: &Tensor, k: &Tensor, v: &Tensor, neg: f64) -> Tensor {
    let (b, h, t, d) = q.dims4().unwrap();
    let s = (q.matmul(&k.t().unwrap().contiguous().unwrap()).unwrap() / (d as f64).sqrt()).unwrap();
    let mask: Vec<f64> = (0..t * t).map(|i| if i % t > i / t { neg } else { 0.0 }).collect();
    let mask = Tensor::from_vec(mask, (t, t), q.device())
        .unwrap()
        .to_dtype(q.dtype())
        .unwrap();
    let p = candle_nn::ops::softmax(&s.broadcast_add(&mask).unwrap(), D::Minus1).unwrap();
    p.matmul(v)
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .contiguous()
        .unwrap()
        .reshape((b, t, h * d))
        .unwrap()
}

fn projections(dev: &Device) -> [Linear; 4] {
    [1u64, 2, 3, 4].map(|seed| {
        let w = Tensor::from_vec(grid(DM * DM, 1.0 / 32.0, 12, seed), (DM, DM), dev).unwrap();
        let b = Tensor::from_vec(grid(DM, 1.0 / 16.0, 6, seed + 10), DM, dev).unwrap();
        Linear::new(w, Some(b))
    })
}

#[test]
fn the_unfused_module_matches_candle_rope_i() {
    let dev = Device::Cpu;
    let [q, k, v, o] = projections(&dev);
    let (c, s) = tables(&dev);
    let attn = SelfAttention::new(q.clone(), k.clone(), v.clone(), o.clone(), HEADS, true)
        .unwrap()
        .with_rope_interleaved(&c, &s)
        .unwrap();
    assert_eq!(attn.rope_layout(), Some(RopeLayout::Interleaved));
    let x = Tensor::from_vec(grid(B * T * DM, 0.125, 16, 5), (B, T, DM), &dev).unwrap();
    let y = attn.forward(&x).unwrap();
    // The reference: candle's own layers and its `rope_i`.
    let lin = |l: &Linear, h: &Tensor| {
        candle_nn::Linear::new(l.weight().clone(), l.bias().cloned())
            .forward(h)
            .unwrap()
    };
    let (ct, st) = (c.narrow(0, 0, T).unwrap(), s.narrow(0, 0, T).unwrap());
    let rope = |h: &Tensor| candle_nn::rotary_emb::rope_i(h, &ct, &st).unwrap();
    let qh = rope(&split(&lin(&q, &x), HEADS));
    let kh = rope(&split(&lin(&k, &x), HEADS));
    let want = lin(&o, &attend(&qh, &kh, &split(&lin(&v, &x), HEADS), -1e30));
    let (got, want) = (vals(&y), vals(&want));
    let top = want.iter().fold(0f64, |a, v| a.max(v.abs()));
    let err = got.iter().zip(&want).fold(0f64, |a, (g, w)| a.max((g - w).abs()));
    assert!(err <= 1e-5 * top, "max diff {err:e} over {top:e}");
    // Without the rotation the output differs: the test sees the rotation.
    let plain = SelfAttention::new(q, k, v, o, HEADS, true)
        .unwrap()
        .forward(&x)
        .unwrap();
    let off = vals(&plain)
        .iter()
        .zip(&want)
        .fold(0f64, |a, (g, w)| a.max((g - w).abs()));
    assert!(off > 1e-2 * top, "the rotation changes the output ({off:e})");
    // The same tables given per call select the same layout.
    let [q, k, v, o] = projections(&dev);
    let bare = SelfAttention::new(q, k, v, o, HEADS, true).unwrap();
    let per_call = bare.forward_with(&x, Some((&c, &s)), None).unwrap();
    assert_eq!(vals(&per_call), got);
}

#[test]
fn bad_interleaved_tables_are_errors() {
    let dev = Device::Cpu;
    let [q, k, v, o] = projections(&dev);
    let attn = SelfAttention::new(q, k, v, o, HEADS, true).unwrap();
    let (c, s) = tables(&dev);
    // Full width is the halves layout's; widths must agree.
    assert!(
        attn.clone()
            .with_rope_interleaved(&Tensor::cat(&[&c, &c], 1).unwrap(), &s)
            .is_err()
    );
    assert!(
        attn.clone()
            .with_rope_interleaved(&c, &s.narrow(1, 0, 2).unwrap())
            .is_err()
    );
    let halves = Tensor::cat(&[&c, &c], 1).unwrap();
    let a = attn
        .clone()
        .with_rope(&halves, &Tensor::cat(&[&s, &s], 1).unwrap())
        .unwrap();
    assert_eq!(a.rope_layout(), Some(RopeLayout::Halves));
    assert_eq!(attn.rope_layout(), None);
}

struct Attn {
    attn: SelfAttention,
    fused: AtomicBool,
}

impl Module for Attn {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        assert!(self.fused.load(Ordering::Relaxed));
        self.attn.forward(x)
    }
}

/// Output, input gradient and parameter gradients of `sum(y * r)` in f64 on the values
/// rounded to `dt`, with the interleaved rotation composed of f64 ops.
fn reference(m: &SelfAttention, dt: DType, x: &Tensor, r: &Tensor) -> (Vec<f64>, Vec<f64>, BTreeMap<String, Vec<f64>>) {
    let r64 = |t: &Tensor| Var::from_tensor(&t.to_dtype(dt).unwrap().to_dtype(DType::F64).unwrap()).unwrap();
    let x64 = r64(x);
    let params: Vec<(Var, Var)> = m
        .projections()
        .iter()
        .map(|l| (r64(l.weight()), r64(l.bias().unwrap())))
        .collect();
    let lin = |i: usize, h: &Tensor| {
        let (w, b) = &params[i];
        h.broadcast_matmul(&w.t().unwrap()).unwrap().broadcast_add(b).unwrap()
    };
    let (c, s) = tables(&Device::Cpu);
    let c = c.narrow(0, 0, T).unwrap().to_dtype(DType::F64).unwrap();
    let s = s.narrow(0, 0, T).unwrap().to_dtype(DType::F64).unwrap();
    let rope = |h: &Tensor| {
        let p = h.reshape((B, HEADS, T, HD / 2, 2)).unwrap();
        let x0 = p.narrow(4, 0, 1).unwrap().squeeze(4).unwrap();
        let x1 = p.narrow(4, 1, 1).unwrap().squeeze(4).unwrap();
        let y0 = (x0.broadcast_mul(&c).unwrap() - x1.broadcast_mul(&s).unwrap()).unwrap();
        let y1 = (x0.broadcast_mul(&s).unwrap() + x1.broadcast_mul(&c).unwrap()).unwrap();
        Tensor::stack(&[&y0, &y1], 4)
            .unwrap()
            .reshape((B, HEADS, T, HD))
            .unwrap()
    };
    let q = rope(&split(&lin(0, x64.as_tensor()), HEADS));
    let k = rope(&split(&lin(1, x64.as_tensor()), HEADS));
    let v = split(&lin(2, x64.as_tensor()), HEADS);
    let y = lin(3, &attend(&q, &k, &v, -1e30));
    let loss = (&y * r.to_dtype(DType::F64).unwrap()).unwrap().sum_all().unwrap();
    let g = loss.backward().unwrap();
    let mut grads = BTreeMap::new();
    for (n, (w, b)) in ["q", "k", "v", "o"].iter().zip(&params) {
        grads.insert(format!("{n}.weight"), vals(g.get(w.as_tensor()).unwrap()));
        grads.insert(format!("{n}.bias"), vals(g.get(b.as_tensor()).unwrap()));
    }
    (vals(&y), vals(g.get(x64.as_tensor()).unwrap()), grads)
}

/// `max |got / scale - want|` over `max(max |want|, floor)`.
fn rel_err(got: &[f64], want: &[f64], scale: f64, floor: f64) -> f64 {
    let top = want.iter().fold(0f64, |a, v| a.max(v.abs())).max(floor);
    got.iter()
        .zip(want)
        .fold(0f64, |a, (g, w)| a.max((g / scale - w).abs()))
        / top
}

#[test]
fn in_a_run_output_and_gradients_match_f64_at_every_level() {
    for level in [OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3] {
        for half in [HalfType::F16, HalfType::Bf16] {
            let what = format!("{level:?} {half:?}");
            let cfg = AmpConfig::new(level)
                .half(half)
                .verbosity(0)
                .loss_scale(amp::LossScaleSpec::Static(64.0))
                .seed(11);
            let (model, mut opt, amp) = amp::initialize(
                |vb| {
                    let (c, s) = tables(vb.device());
                    let attn = SelfAttention::new(
                        linear(DM, DM, vb.pp("q"))?,
                        linear(DM, DM, vb.pp("k"))?,
                        linear(DM, DM, vb.pp("v"))?,
                        linear(DM, DM, vb.pp("o"))?,
                        HEADS,
                        true,
                    )?
                    .with_rope_interleaved(&c, &s)?;
                    Ok(Attn {
                        attn,
                        fused: AtomicBool::new(true),
                    })
                },
                Sgd::new(SgdConfig::new(0.5)).unwrap(),
                cfg,
            )
            .unwrap();
            let dev = Device::Cpu;
            let x =
                Var::from_tensor(&Tensor::from_vec(grid(B * T * DM, 0.125, 16, 5), (B, T, DM), &dev).unwrap()).unwrap();
            let r = Tensor::from_vec(grid(B * T * DM, 1.0 / 64.0, 8, 6), (B, T, DM), &dev).unwrap();
            let y = model.forward(&x.as_tensor().affine(1.0, 0.0).unwrap()).unwrap();
            let loss = (y.to_dtype(DType::F32).unwrap() * &r).unwrap().sum_all().unwrap();
            let nodes = half_nodes(&loss);
            let (report, gx) = backward_capturing(&amp, &loss, &mut opt, x.as_tensor());
            assert!(!report.found_inf, "{what}");
            let scale = report.loss_scale as f64;
            let grads: BTreeMap<String, Vec<f64>> =
                opt.master_grads().iter().map(|(k, v)| (k.clone(), vals(v))).collect();
            assert_eq!(grads.len(), 8, "{what}");
            // The fused node (O1..O3): the cast input and the node are the graph's only half
            // tensors (O1: the input stays f32).
            match level {
                OptLevel::O0 => assert_eq!(nodes, 0, "{what}"),
                OptLevel::O1 => assert_eq!(nodes, 1, "{what}"),
                _ => assert_eq!(nodes, 2, "{what}"),
            }
            let dt = if level == OptLevel::O0 {
                DType::F32
            } else {
                half.dtype()
            };
            let (y64, gx64, gp64) = reference(&model.inner().attn, dt, x.as_tensor(), &r);
            let bound = match dt {
                DType::F32 => 1e-5,
                DType::BF16 => 5e-2,
                _ => 8e-3,
            };
            let floor = 0.1 * gp64.values().flatten().fold(0f64, |a, v| a.max(v.abs()));
            assert!(rel_err(&vals(&y), &y64, 1.0, 1e-30) < bound, "{what}: output");
            assert!(
                rel_err(&vals(&gx.unwrap()), &gx64, scale, 1e-30) < bound,
                "{what}: input gradient"
            );
            for (k, g) in &gp64 {
                let e = rel_err(&grads[k], g, 1.0, floor);
                assert!(e < bound, "{what}: {k}: {e}");
            }
        }
    }
}
