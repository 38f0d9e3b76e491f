//! The gated MLP (each activation, bias on and off) and self-attention with its options
//! (grouped key/value heads, rotary embedding, key lengths, causal) on any batch and
//! sequence length, zero included, and inputs laid out any way, at each level's types,
//! against references written here from candle's f32 ops: the gate as its formula, the heads
//! reshaped by hand, the rotation as `[x1 cos - x2 sin, x2 cos + x1 sin]`, the key/value
//! groups as an index over the heads and the masks as an additive -1e9.

use super::*;
use candle_nn::Module;

/// [`layer_pair`] with every parameter set to seeded values that f16 and bf16 hold exactly
/// (`k/32`, `|k| <= 16`): the half layer's weights equal the reference's, and the products'
/// sums are exact in f32, so a pre-activation's sign (ReLU's gradient) is the same on both
/// sides. The case is then reproducible too (candle-nn's initialisation is not seeded).
fn exact_pair<A, B>(
    dtype: DType,
    seed: u64,
    amp_layer: impl FnOnce(candle_nn::VarBuilder) -> candle_core::Result<A>,
    nn_layer: impl FnOnce(candle_nn::VarBuilder) -> candle_core::Result<B>,
) -> (A, B) {
    let vm = candle_nn::VarMap::new();
    let b = nn_layer(candle_nn::VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu).pp("l")).unwrap();
    let data = vm.data().lock().unwrap();
    let mut names: Vec<&String> = data.keys().collect();
    names.sort();
    let mut converted = std::collections::HashMap::new();
    for (i, name) in names.into_iter().enumerate() {
        let var = &data[name];
        let v: Vec<f32> = values(var.elem_count(), seed ^ (0x5EED + i as u64))
            .iter()
            .map(|x| x / 4.0)
            .collect();
        var.set(&Tensor::from_vec(v, var.shape(), &Device::Cpu).unwrap())
            .unwrap();
        let t = var.as_tensor().to_dtype(dtype).unwrap().to_device(&dev()).unwrap();
        converted.insert(name.clone(), t);
    }
    drop(data);
    let a = amp_layer(candle_nn::VarBuilder::from_tensors(converted, dtype, &dev()).pp("l")).unwrap();
    (a, b)
}

/// `down(act(gate(x)) * up(x))` in f32, by candle's ops.
fn gated_ref(x: &Tensor, l: &[candle_nn::Linear; 3], act: ann::GateActivation) -> candle_core::Result<Tensor> {
    let lin = |l: &candle_nn::Linear, x: &Tensor| kernels::linear(x, l.weight(), l.bias());
    let g = lin(&l[0], x)?;
    let g = match act {
        ann::GateActivation::Silu => (&g * candle_nn::ops::sigmoid(&g)?)?,
        ann::GateActivation::Gelu => g.gelu_erf()?,
        // PyTorch's gradient at 0 (0, as `ops::relu` documents; candle's `relu` passes it).
        ann::GateActivation::Relu => (&g * g.gt(0.0)?.to_dtype(DType::F32)?)?,
        other => candle_core::bail!("no reference for {other:?}"),
    };
    lin(&l[2], &(g * lin(&l[1], x)?)?)
}

/// Self-attention's shape: heads, key/value heads, head width, and the per-call options.
#[derive(Debug, Clone)]
struct Attn {
    heads: usize,
    kv_heads: usize,
    dk: usize,
    causal: bool,
    rope: Option<(Tensor, Tensor)>,
    lengths: Option<Vec<usize>>,
}

/// f32 rotary tables `(positions, dk)`, each row's halves equal.
fn rope_tables(positions: usize, dk: usize) -> (Tensor, Tensor) {
    let mut angles = Vec::with_capacity(positions * dk);
    for p in 0..positions {
        for _ in 0..2 {
            angles.extend((0..dk / 2).map(|i| p as f32 * 0.7 / (1 + i) as f32));
        }
    }
    let a = Tensor::from_vec(angles, (positions, dk), &Device::Cpu).unwrap();
    (a.cos().unwrap(), a.sin().unwrap())
}

/// The attention of `x` `(b, t, width)` through the projections `l` (q, k, v, o), by hand.
fn attention_options_ref(x: &Tensor, l: &[candle_nn::Linear; 4], a: &Attn) -> candle_core::Result<Tensor> {
    let (b, t, _) = x.dims3()?;
    let dk = a.dk;
    let heads_of = |i: usize, n: usize| -> candle_core::Result<Tensor> {
        kernels::linear(x, l[i].weight(), l[i].bias())?
            .reshape((b, t, n, dk))?
            .transpose(1, 2)?
            .contiguous()
    };
    let (mut q, mut k, v) = (
        heads_of(0, a.heads)?,
        heads_of(1, a.kv_heads)?,
        heads_of(2, a.kv_heads)?,
    );
    if let Some((c, s)) = &a.rope {
        let h = dk / 2;
        let (c, s) = (c.narrow(0, 0, t)?.narrow(1, 0, h)?, s.narrow(0, 0, t)?.narrow(1, 0, h)?);
        let rotate = |x: &Tensor| -> candle_core::Result<Tensor> {
            let (x1, x2) = (x.narrow(3, 0, h)?, x.narrow(3, h, h)?);
            let r1 = (x1.broadcast_mul(&c)? - x2.broadcast_mul(&s)?)?;
            let r2 = (x2.broadcast_mul(&c)? + x1.broadcast_mul(&s)?)?;
            Tensor::cat(&[&r1, &r2], 3)
        };
        (q, k) = (rotate(&q)?, rotate(&k)?);
    }
    // Query head j reads key/value head j / (heads / kv_heads).
    let group = a.heads / a.kv_heads;
    let idx: Vec<u32> = (0..a.heads).map(|j| (j / group) as u32).collect();
    let idx = Tensor::new(idx.as_slice(), &Device::Cpu)?;
    let (k, v) = (
        k.contiguous()?.index_select(&idx, 1)?,
        v.contiguous()?.index_select(&idx, 1)?,
    );
    let scores = (q.matmul(&k.t()?)? * (1.0 / (dk as f64).sqrt()))?;
    let mut mask = vec![0f32; b * t * t];
    for bi in 0..b {
        for i in 0..t {
            for j in 0..t {
                let past_len = a.lengths.as_ref().is_some_and(|l| j >= l[bi]);
                if (a.causal && j > i) || past_len {
                    mask[(bi * t + i) * t + j] = -1e9;
                }
            }
        }
    }
    let mask = Tensor::from_vec(mask, (b, 1, t, t), &Device::Cpu)?;
    let mut o = softmax_ref(&scores.broadcast_add(&mask)?)?.matmul(&v)?;
    if let Some(lengths) = &a.lengths {
        // A sequence with no live key gives zeros (the documented behaviour).
        let keep: Vec<f32> = lengths.iter().map(|&n| if n == 0 { 0.0 } else { 1.0 }).collect();
        o = o.broadcast_mul(&Tensor::from_vec(keep, (b, 1, 1, 1), &Device::Cpu)?)?;
    }
    let merged = o.transpose(1, 2)?.reshape((b, t, a.heads * dk))?;
    kernels::linear(&merged, l[3].weight(), l[3].bias())
}

/// A gate activation.
fn gate() -> impl Strategy<Value = ann::GateActivation> {
    prop_oneof![
        Just(ann::GateActivation::Silu),
        Just(ann::GateActivation::Gelu),
        Just(ann::GateActivation::Relu)
    ]
}

/// `nn::GatedMlp` (SwiGLU, GeGLU, ReGLU; with and without biases) on `(n, t, width)` inputs.
#[test]
fn gated_mlp_any_batch_activation_and_bias() {
    on_test_device();
    let before = CASES.with(|c| c.get());
    let strat = (
        setting(),
        dim(),
        dim(),
        1usize..5,
        1usize..6,
        gate(),
        any::<bool>(),
        view(),
        any::<u32>(),
    );
    runner()
        .run(&strat, |(s, n, t, c, hidden, act, bias, v, seed)| {
            let lin = |i, o, vb: candle_nn::VarBuilder| {
                if bias {
                    candle_nn::linear(i, o, vb)
                } else {
                    candle_nn::linear_no_bias(i, o, vb)
                }
            };
            let (ours, reference) = exact_pair(
                s.input_dtype(),
                seed as u64,
                |vb| ann::gated_mlp(c, hidden, act, bias, vb),
                |vb| {
                    Ok([
                        lin(c, hidden, vb.pp("gate_proj"))?,
                        lin(c, hidden, vb.pp("up_proj"))?,
                        lin(hidden, c, vb.pp("down_proj"))?,
                    ])
                },
            );
            check(
                &format!("nn::GatedMlp {act:?} bias={bias}"),
                s,
                &[(vec![n, t, c], v)],
                seed as u64,
                |x| ours.forward(&x[0]),
                |x| gated_ref(&x[0], &reference, act),
            )
        })
        .unwrap();
    report("gated MLP", before);
}

/// `nn::SelfAttention` with grouped key/value heads, rotary tables per call, key lengths
/// (zero and past the sequence included), causal or not, bias on or off.
#[test]
fn self_attention_options_any_sequence_length() {
    on_test_device();
    let before = CASES.with(|c| c.get());
    let heads = prop_oneof![
        Just((1usize, 1usize)),
        Just((2, 1)),
        Just((2, 2)),
        Just((4, 1)),
        Just((4, 2))
    ];
    let strat = (
        setting(),
        (dim(), dim(), 1usize..5),
        heads,
        prop_oneof![Just(2usize), Just(4)],
        (any::<bool>(), any::<bool>(), any::<bool>(), any::<bool>()),
        proptest::collection::vec(0usize..6, 0..5),
        view(),
        any::<u32>(),
    );
    runner()
        .run(&strat, |(s, (b, t, c), (heads, kv_heads), dk, (causal, rope, masked, bias), lens, v, seed)| {
            let lengths = masked.then(|| (0..b).map(|i| lens.get(i).copied().unwrap_or(t).min(t + 1)).collect());
            let a = Attn {
                heads,
                kv_heads,
                dk,
                causal,
                rope: rope.then(|| rope_tables(t + 1, dk)),
                lengths,
            };
            let lin = |i, o, vb: candle_nn::VarBuilder| {
                if bias {
                    candle_nn::linear(i, o, vb)
                } else {
                    candle_nn::linear_no_bias(i, o, vb)
                }
            };
            let alin = |i, o, vb: candle_nn::VarBuilder| {
                if bias {
                    ann::linear(i, o, vb)
                } else {
                    ann::linear_no_bias(i, o, vb)
                }
            };
            let (ours, reference) = exact_pair(
                s.input_dtype(),
                seed as u64,
                |vb| {
                    ann::SelfAttention::new(
                        alin(c, heads * dk, vb.pp("q"))?,
                        alin(c, kv_heads * dk, vb.pp("k"))?,
                        alin(c, kv_heads * dk, vb.pp("v"))?,
                        alin(heads * dk, c, vb.pp("o"))?,
                        heads,
                        causal,
                    )?
                    .with_kv_heads(kv_heads)
                },
                |vb| {
                    Ok([
                        lin(c, heads * dk, vb.pp("q"))?,
                        lin(c, kv_heads * dk, vb.pp("k"))?,
                        lin(c, kv_heads * dk, vb.pp("v"))?,
                        lin(heads * dk, c, vb.pp("o"))?,
                    ])
                },
            );
            let tables = a.rope.as_ref().map(|(c, s)| (c.to_device(&dev()).unwrap(), s.to_device(&dev()).unwrap()));
            let what = format!(
                "nn::SelfAttention heads={heads} kv_heads={kv_heads} dk={dk} causal={causal} rope={rope} lengths={:?} bias={bias}",
                a.lengths
            );
            check(
                &what,
                s,
                &[(vec![b, t, c], v)],
                seed as u64,
                |x| ours.forward_with(&x[0], tables.as_ref().map(|(c, s)| (c, s)), a.lengths.as_deref()),
                |x| attention_options_ref(&x[0], &reference, &a),
            )
        })
        .unwrap();
    report("self-attention options", before);
}
