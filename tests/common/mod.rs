//! Shared test helpers: a small model, seeded data, and plain-candle controls.
#![allow(dead_code)]

use candle_amp as amp;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Linear, Module, VarBuilder, VarMap};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// PyTorch's scaling harness model: Linear(8, 8) -> Linear(8, 8).
pub struct TwoLinear {
    pub l1: Linear,
    pub l2: Linear,
}

impl TwoLinear {
    pub fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        Ok(Self {
            l1: candle_nn::linear(8, 8, vb.pp("l1"))?,
            l2: candle_nn::linear(8, 8, vb.pp("l2"))?,
        })
    }
}

impl Module for TwoLinear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.l2.forward(&self.l1.forward(x)?)
    }
}

/// The same model built from `candle_amp::nn`, so that O1 autocasts it.
pub struct AmpTwoLinear {
    pub l1: amp::nn::Linear,
    pub l2: amp::nn::Linear,
}

impl AmpTwoLinear {
    pub fn new(vb: VarBuilder) -> candle_core::Result<Self> {
        Ok(Self {
            l1: amp::nn::linear(8, 8, vb.pp("l1"))?,
            l2: amp::nn::linear(8, 8, vb.pp("l2"))?,
        })
    }
}

impl Module for AmpTwoLinear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.l2.forward(&self.l1.forward(x)?)
    }
}

/// `n` seeded batches of (input, target), each 16x8, in f32.
pub fn batches(n: usize, seed: u64) -> Vec<(Tensor, Tensor)> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let x: Vec<f32> = (0..128).map(|_| rng.random_range(-1.0..1.0)).collect();
            let y: Vec<f32> = (0..128).map(|_| rng.random_range(-1.0..1.0)).collect();
            (
                Tensor::from_vec(x, (16, 8), &Device::Cpu).unwrap(),
                Tensor::from_vec(y, (16, 8), &Device::Cpu).unwrap(),
            )
        })
        .collect()
}

/// A plain-candle f32 copy of the store's current parameters: a VarMap with the same names
/// and values, and a VarBuilder over it.
pub fn f32_copy(store: &amp::ParamStore) -> VarMap {
    let vm = VarMap::new();
    {
        let mut data = vm.data().lock().unwrap();
        for p in store.params() {
            let v = Var::from_tensor(&p.f32_value().unwrap().copy().unwrap()).unwrap();
            data.insert(p.name().to_string(), v);
        }
    }
    vm
}

pub fn vb_of(vm: &VarMap) -> VarBuilder<'static> {
    VarBuilder::from_varmap(vm, DType::F32, &Device::Cpu)
}

/// Values of a VarMap by name, as flat f32 vectors.
pub fn varmap_values(vm: &VarMap) -> std::collections::BTreeMap<String, Vec<f32>> {
    vm.data()
        .lock()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), flat(v.as_tensor())))
        .collect()
}

/// The store's f32 values by name.
pub fn store_values(store: &amp::ParamStore) -> std::collections::BTreeMap<String, Vec<f32>> {
    store
        .params()
        .into_iter()
        .map(|p| (p.name().to_string(), flat(&p.f32_value().unwrap())))
        .collect()
}

/// The store's f32 values (masters where there are) by name, as their raw bit patterns.
pub fn f32_bits(store: &amp::ParamStore) -> std::collections::BTreeMap<String, Vec<u32>> {
    store_values(store)
        .into_iter()
        .map(|(k, v)| (k, v.into_iter().map(f32::to_bits).collect()))
        .collect()
}

/// The store's working values by name, as their raw bit patterns (for bit-identity checks).
pub fn working_bits(store: &amp::ParamStore) -> std::collections::BTreeMap<String, Vec<u32>> {
    store
        .params()
        .into_iter()
        .map(|p| {
            let t = p.working().to_dtype(DType::F32).unwrap();
            (p.name().to_string(), flat(&t).into_iter().map(f32::to_bits).collect())
        })
        .collect()
}

pub fn flat(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}

/// Largest relative difference `|a-b| / max(|b|, floor)` over two maps of equal keys.
pub fn max_rel_diff(
    a: &std::collections::BTreeMap<String, Vec<f32>>,
    b: &std::collections::BTreeMap<String, Vec<f32>>,
    floor: f32,
) -> f32 {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    let mut m = 0f32;
    for (k, va) in a {
        let vb = &b[k];
        assert_eq!(va.len(), vb.len(), "{k}");
        for (x, y) in va.iter().zip(vb) {
            m = m.max((x - y).abs() / y.abs().max(floor));
        }
    }
    m
}

pub fn mse(model: &impl Module, x: &Tensor, y: &Tensor) -> Tensor {
    let out = model.forward(x).unwrap().to_dtype(DType::F32).unwrap();
    candle_nn::loss::mse(&out, y).unwrap()
}

/// Runs `f` on every rank of a local group of `n` whose collectives time out after
/// `timeout`, each rank on its own thread; results in rank order.
pub fn on_ranks<T: Send>(
    n: usize,
    timeout: std::time::Duration,
    f: impl Fn(std::sync::Arc<dyn amp::dist::Communicator>) -> T + Sync,
) -> Vec<T> {
    let comms = amp::dist::LocalGroup::with_timeout(n, timeout);
    std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let f = &f;
                s.spawn(move || f(std::sync::Arc::new(c)))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}
