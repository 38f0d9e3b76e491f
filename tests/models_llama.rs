//! `models::llama` against candle-transformers' own Llama (code nobody here wrote): the same
//! weights give the same logits, our safetensors load there, gradients agree with the same
//! model in f64, and the model trains at every opt level.
//!
//! candle-transformers' forward is the reference and runs on the CPU; the runs through
//! `amp::initialize` (pretrained weights, training) use `common::device()`.

mod common;

use candle_amp::models::llama::{Config, ConfigError, Llama, RopeScaling};
use candle_amp::optim::{AdamW, AdamWConfig};
use candle_amp::{self as amp, AmpConfig, HalfType, LoadMode, OptLevel};
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use candle_transformers::models::llama as ct;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, StandardNormal};

fn tiny(kv_heads: usize, tied: bool) -> Config {
    Config {
        hidden_size: 32,
        intermediate_size: 48,
        vocab_size: 24,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: Some(kv_heads),
        rms_norm_eps: 1e-5,
        rope_theta: 10_000.0,
        rope_scaling: None,
        max_position_embeddings: 64,
        tie_word_embeddings: tied,
    }
}

/// candle-transformers' config for ours, through the JSON of a `config.json` (so the serde
/// names are checked too).
fn ct_config(cfg: &Config) -> ct::Config {
    let json = serde_json::to_value(cfg).unwrap();
    serde_json::from_value::<ct::LlamaConfig>(json)
        .unwrap()
        .into_config(false)
}

/// Our model in a fresh f32 VarMap, every parameter then set to seeded random values (norm
/// weights around 1, so that they matter).
fn ours(cfg: &Config, seed: u64) -> (Llama, VarMap) {
    let vm = VarMap::new();
    let model = Llama::load(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), cfg).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut vars: Vec<(String, Var)> = vm.data().lock().unwrap().clone().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, v) in &vars {
        let dims = v.dims().to_vec();
        let n = v.elem_count();
        let mut normal = || -> f32 { StandardNormal.sample(&mut rng) };
        let vals: Vec<f32> = if name.contains("norm") {
            (0..n).map(|_| 1.0 + 0.2 * normal()).collect()
        } else {
            let scale = 1.0 / (*dims.last().unwrap() as f32).sqrt();
            (0..n).map(|_| scale * normal()).collect()
        };
        v.set(&Tensor::from_vec(vals, dims, &Device::Cpu).unwrap()).unwrap();
    }
    (model, vm)
}

fn ids(batch: usize, t: usize, vocab: usize, seed: u64) -> Tensor {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let v: Vec<u32> = (0..batch * t).map(|_| rng.random_range(0..vocab as u32)).collect();
    Tensor::from_vec(v, (batch, t), &Device::Cpu).unwrap()
}

/// `|a - b| <= rel * max(|b|, 1)` element by element.
fn assert_rel(a: &Tensor, b: &Tensor, rel: f32, what: &str) {
    assert_eq!(a.dims(), b.dims(), "{what}: shapes");
    common::assert_close(&common::flat(a), &common::flat(b), rel, what);
}

/// candle-transformers' logits for every prefix of `ids` (its forward returns the last
/// position's), stacked to `(batch, t, vocab)`.
fn ct_logits(model: &ct::Llama, cfg: &ct::Config, ids: &Tensor) -> Tensor {
    let t = ids.dim(1).unwrap();
    let per: Vec<Tensor> = (1..=t)
        .map(|n| {
            let mut cache = ct::Cache::new(false, DType::F32, cfg, &Device::Cpu).unwrap();
            model.forward(&ids.narrow(1, 0, n).unwrap(), 0, &mut cache).unwrap()
        })
        .collect();
    Tensor::stack(&per, 1).unwrap()
}

fn matches_candle_transformers(cfg: &Config, seed: u64) {
    let (model, vm) = ours(cfg, seed);
    let names: Vec<String> = vm.data().lock().unwrap().keys().cloned().collect();
    assert_eq!(
        names.iter().any(|n| n == "lm_head.weight"),
        !cfg.tie_word_embeddings,
        "{names:?}"
    );
    let ctc = ct_config(cfg);
    let theirs = ct::Llama::load(VarBuilder::from_varmap(&vm, DType::F32, &Device::Cpu), &ctc).unwrap();
    // candle-transformers creates nothing: every name it reads is ours.
    assert_eq!(vm.data().lock().unwrap().len(), names.len());
    let x = ids(2, 12, cfg.vocab_size, seed + 1);
    let got = model.forward(&x).unwrap();
    assert_eq!(got.dims(), [2, 12, cfg.vocab_size]);
    assert_rel(
        &got,
        &ct_logits(&theirs, &ctc, &x),
        1e-5,
        "logits against candle-transformers",
    );
}

#[test]
fn logits_match_candle_transformers_with_gqa() {
    matches_candle_transformers(&tiny(2, false), 1);
}

#[test]
fn logits_match_candle_transformers_with_tied_embeddings() {
    matches_candle_transformers(&tiny(4, true), 2);
    matches_candle_transformers(&tiny(1, true), 3);
}

#[test]
fn logits_match_candle_transformers_with_llama3_rope_scaling() {
    // Head width 8: frequencies 1, 0.1, 0.01, 0.001, wavelengths 6.3 to 6283; an original
    // context of 64 with factors 1 and 4 keeps the first, smooths the second and divides the
    // last two: every branch of the scaling.
    let mut cfg = tiny(2, false);
    cfg.rope_scaling = Some(RopeScaling {
        rope_type: "llama3".into(),
        legacy_type: None,
        factor: Some(8.0),
        low_freq_factor: Some(1.0),
        high_freq_factor: Some(4.0),
        original_max_position_embeddings: Some(64),
    });
    matches_candle_transformers(&cfg, 4);
}

#[test]
fn config_reads_a_hugging_face_config_json_and_refuses_what_it_cannot_build() {
    let json = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "vocab_size": 100, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 128, "hidden_act": "silu",
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64, "rope_type": "llama3"}, "tie_word_embeddings": null}"#;
    let cfg: Config = serde_json::from_str(json).unwrap();
    assert_eq!(
        (cfg.rope_theta, cfg.tie_word_embeddings, cfg.num_key_value_heads()),
        (10_000.0, false, 2)
    );
    assert_eq!(cfg.validate(), Ok(()));
    let refused = |cfg: &Config| {
        let e = Llama::load(VarBuilder::zeros(DType::F32, &Device::Cpu), cfg).unwrap_err();
        match e {
            candle_core::Error::WrappedContext { wrapped, .. } => {
                wrapped.downcast_ref::<ConfigError>().cloned().unwrap()
            }
            e => panic!("not a ConfigError: {e}"),
        }
    };
    let mut linear = cfg.clone();
    linear.rope_scaling = serde_json::from_str(r#"{"type": "linear", "factor": 2.0}"#).unwrap();
    assert_eq!(refused(&linear), ConfigError::UnsupportedRopeScaling("linear".into()));
    let mut partial = cfg.clone();
    partial.rope_scaling.as_mut().unwrap().low_freq_factor = None;
    assert_eq!(refused(&partial), ConfigError::BadRopeScaling("needs low_freq_factor"));
    let mut heads = cfg.clone();
    heads.num_key_value_heads = Some(3);
    assert!(matches!(refused(&heads), ConfigError::Heads { kv_heads: 3, .. }));
    // Past the tables: an error, not a panic.
    let (model, _) = ours(&tiny(2, true), 5);
    assert!(model.forward(&ids(1, 65, 24, 0)).is_err());
}

#[test]
fn weights_saved_with_safetensors_load_into_candle_transformers_and_back() {
    let dir = std::env::temp_dir().join(format!("candle-amp-llama-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (i, cfg) in [tiny(2, false), tiny(4, true)].iter().enumerate() {
        let (model, vm) = ours(cfg, 10 + i as u64);
        let path = dir.join(format!("model{i}.safetensors"));
        vm.save(&path).unwrap();
        let ctc = ct_config(cfg);
        let vb = unsafe { VarBuilder::from_mmaped_safetensors(std::slice::from_ref(&path), DType::F32, &Device::Cpu) };
        let theirs = ct::Llama::load(vb.unwrap(), &ctc).unwrap();
        let x = ids(2, 10, cfg.vocab_size, 20 + i as u64);
        let ours_logits = model.forward(&x).unwrap();
        assert_rel(
            &ours_logits,
            &ct_logits(&theirs, &ctc, &x),
            1e-5,
            "saved weights in candle-transformers",
        );
        // And as a run's pretrained weights (every name present), at O0: the same logits.
        let (run, _opt, _amp) = common::initialize(
            |vb| Llama::load(vb, cfg),
            AdamW::new(Default::default()).unwrap(),
            AmpConfig::new(OptLevel::O0).pretrained(&path, LoadMode::Strict),
        )
        .unwrap();
        let got = run.forward(&x.to_device(&common::device()).unwrap()).unwrap();
        assert_rel(
            &got,
            &ours_logits,
            common::cross_tol(DType::F32),
            "pretrained into a run",
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn gradients_match_the_same_model_in_f64() {
    for cfg in [tiny(2, false), tiny(4, true)] {
        let (model, vm) = ours(&cfg, 30);
        let x = ids(2, 9, cfg.vocab_size, 31);
        let (inp, tgt) = (x.narrow(1, 0, 8).unwrap(), x.narrow(1, 1, 8).unwrap());
        let g32 = amp::ops::cross_entropy(&model.forward(&inp).unwrap(), &tgt)
            .unwrap()
            .backward()
            .unwrap();
        let vm64 = VarMap::new();
        {
            let mut data = vm64.data().lock().unwrap();
            for (k, v) in vm.data().lock().unwrap().iter() {
                data.insert(k.clone(), Var::from_tensor(&v.to_dtype(DType::F64).unwrap()).unwrap());
            }
        }
        let model64 = Llama::load(VarBuilder::from_varmap(&vm64, DType::F64, &Device::Cpu), &cfg).unwrap();
        let logits64 = model64.forward(&inp).unwrap();
        assert_eq!(logits64.dtype(), DType::F64);
        let g64 = amp::ops::cross_entropy(&logits64, &tgt).unwrap().backward().unwrap();
        let data64 = vm64.data().lock().unwrap();
        for (name, v) in vm.data().lock().unwrap().iter() {
            let a = common::vals(g32.get(v).unwrap_or_else(|| panic!("{name}: no gradient")));
            let b = common::vals(g64.get(&data64[name]).unwrap());
            let scale = b.iter().fold(0f64, |m, x| m.max(x.abs()));
            assert!(scale > 0.0, "{name}: a zero gradient");
            let err = a.iter().zip(&b).fold(0f64, |m, (x, y)| m.max((x - y).abs()));
            assert!(err <= 1e-4 * scale, "{name}: gradient off by {err} (largest {scale})");
        }
    }
}

/// The task: `x[t+1] = x[t] + 1 or + 2 (mod vocab)`, each with probability 1/2, so the best
/// loss is ln 2 and the model must learn the rule from the current token.
fn task(batch: usize, t: usize, vocab: u32, rng: &mut ChaCha8Rng) -> (Tensor, Tensor) {
    let mut v = Vec::with_capacity(batch * (t + 1));
    for _ in 0..batch {
        let mut x = rng.random_range(0..vocab);
        for _ in 0..=t {
            v.push(x);
            x = (x + 1 + rng.random_range(0..2)) % vocab;
        }
    }
    let all = Tensor::from_vec(v, (batch, t + 1), &common::device()).unwrap();
    (all.narrow(1, 0, t).unwrap(), all.narrow(1, 1, t).unwrap())
}

/// Trains `steps` steps at `cfg` and returns the training losses and the held-out loss.
fn train(level: OptLevel, half: HalfType, steps: usize) -> (Vec<f32>, f32) {
    let cfg = Config {
        vocab_size: 16,
        ..tiny(2, true)
    };
    let opt = AdamW::new(AdamWConfig {
        lr: 1e-2,
        ..Default::default()
    })
    .unwrap();
    let config = AmpConfig::new(level).half(half).seed(5);
    let (model, mut opt, amp) = common::initialize(|vb| Llama::load(vb, &cfg), opt, config).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(6);
    let held_out = task(16, 16, 16, &mut ChaCha8Rng::seed_from_u64(7));
    let mut losses = Vec::new();
    for _ in 0..steps {
        let (x, y) = task(8, 16, 16, &mut rng);
        let loss = amp::ops::cross_entropy(&model.forward(&x).unwrap(), &y).unwrap();
        losses.push(loss.to_scalar::<f32>().unwrap());
        let report = amp.scale_loss(&loss, &mut opt).unwrap().backward().unwrap();
        if level == OptLevel::O1 {
            assert!(report.autocast_ops.unwrap() > 0, "O1 runs the projections in half");
        }
        opt.step().unwrap();
        opt.zero_grad();
    }
    let eval = amp::ops::cross_entropy(&model.forward(&held_out.0).unwrap(), &held_out.1).unwrap();
    (losses, eval.to_scalar::<f32>().unwrap())
}

#[test]
fn trains_at_every_level_and_o2_ends_near_o0() {
    const STEPS: usize = 40;
    let (o0, o0_eval) = train(OptLevel::O0, HalfType::F16, STEPS);
    let runs = [
        (OptLevel::O1, HalfType::F16),
        (OptLevel::O1, HalfType::Bf16),
        (OptLevel::O2, HalfType::F16),
        (OptLevel::O2, HalfType::Bf16),
        (OptLevel::O3, HalfType::Bf16),
    ];
    let mut all = vec![("O0 f32".to_string(), o0, o0_eval)];
    for (level, half) in runs {
        let (l, e) = train(level, half, STEPS);
        all.push((format!("{level} {half}"), l, e));
    }
    for (name, losses, eval) in &all {
        let (first, last) = (losses[0], *losses.last().unwrap());
        eprintln!("{name}: loss {first:.4} -> {last:.4}, held out {eval:.4}");
        assert!(last.is_finite() && last < 0.6 * first, "{name}: {first} -> {last}");
        assert!(*eval < 0.6 * first, "{name}: held-out loss {eval}");
        if name.starts_with("O2") {
            let rel = (eval - o0_eval).abs() / o0_eval;
            assert!(
                rel < 0.02,
                "{name}: held-out loss {eval} vs O0's {o0_eval} ({rel:.4} apart)"
            );
        }
    }
}
