//! Shared test helpers: the device the tests run on, dtype tolerances, a small model,
//! seeded data, and plain-candle controls.
#![allow(dead_code)]

use candle_amp as amp;
use candle_core::{DType, Device, Tensor, Var};
use candle_nn::{Linear, Module, VarBuilder, VarMap};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The variable that chooses the device the behaviour tests build their tensors and models on.
pub const DEVICE_VAR: &str = "CANDLE_AMP_TEST_DEVICE";

/// The device named by `CANDLE_AMP_TEST_DEVICE`: `cpu` (the default, also when unset or
/// empty) or `cuda` (GPU 0). Anything else, or `cuda` where candle has no CUDA, panics with a
/// message naming the variable: a run asked for a device must never quietly test the CPU.
///
/// The device is made once per test binary: candle gives every `Device::new_cuda` call its
/// own id, and tensors on two of them do not mix.
pub fn device() -> Device {
    static DEVICE: std::sync::OnceLock<Device> = std::sync::OnceLock::new();
    DEVICE
        .get_or_init(|| {
            let value = std::env::var(DEVICE_VAR).unwrap_or_default();
            match value.trim() {
                "" | "cpu" => Device::Cpu,
                "cuda" => Device::new_cuda(0).unwrap_or_else(|e| {
                    panic!("{DEVICE_VAR}={value:?}, but CUDA device 0 cannot be opened ({e}); build the tests with `--features cuda` on a machine with an NVIDIA GPU, or unset {DEVICE_VAR}")
                }),
                _ => panic!("{DEVICE_VAR}={value:?} is not a device; use `cpu` (the default) or `cuda`"),
            }
        })
        .clone()
}

/// Whether the tests run on the CPU.
pub fn on_cpu() -> bool {
    device().is_cpu()
}

/// Whether the CPU's fused kernels do the work, which makes comparisons with candle's ops
/// bit-exact: on the CPU unless `CANDLE_AMP_FORCE_DEVICE_PATH` (`1` or `true`) sends it down
/// the device path's tensor ops, which round apart as a GPU's do.
pub fn cpu_kernels() -> bool {
    let forced = std::env::var("CANDLE_AMP_FORCE_DEVICE_PATH").is_ok_and(|v| v == "1" || v == "true");
    on_cpu() && !forced
}

/// Relative tolerance for a value computed in `dtype` by kernels other than the CPU's
/// (another summation order, cuBLAS instead of gemm): a few units of the type's last place,
/// with room for a few steps of training to compound them.
pub fn tol(dtype: DType) -> f32 {
    match dtype {
        DType::F16 => 4e-3,
        DType::BF16 => 3e-2,
        DType::F64 => 1e-10,
        _ => 1e-4,
    }
}

/// The tolerance for a comparison that is bit-exact with the CPU kernels: 0 there (so the
/// CPU keeps its exact assertion), [`tol`] on any other device or path.
pub fn cross_tol(dtype: DType) -> f32 {
    if cpu_kernels() { 0.0 } else { tol(dtype) }
}

/// Transformer Engine's relative tolerances for one kernel's output against a reference
/// computed another way (fp32 1.3e-6, fp16 1e-3, bf16 1.6e-2): the guarantee a device's
/// kernels give for a single operation, where the CPU kernels are bit-exact.
pub fn te_rtol(dtype: DType) -> f32 {
    match dtype {
        DType::F16 => 1e-3,
        DType::BF16 => 1.6e-2,
        _ => 1.3e-6,
    }
}

/// 0 (bit for bit) with the CPU kernels, [`te_rtol`] on any other device or path: for one
/// operation's result compared with the same operation written out on the host.
pub fn exact_or_te(dtype: DType) -> f32 {
    if cpu_kernels() { 0.0 } else { te_rtol(dtype) }
}

/// A tolerance that is `cpu` with the CPU kernels and at least [`tol`] elsewhere: for
/// comparisons against a plain-candle control that the CPU kernels meet to within `cpu`.
pub fn cpu_or_tol(cpu: f32, dtype: DType) -> f32 {
    if cpu_kernels() { cpu } else { cpu.max(tol(dtype)) }
}

/// Asserts `a` and `b` are equal, or within `rel` relative (`|a-b| <= rel * max(|b|, 1)`)
/// where `rel` is not 0: for comparisons exact on the CPU, called with [`cross_tol`].
pub fn assert_close(a: &[f32], b: &[f32], rel: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    if rel == 0.0 {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(a), bits(b), "{what}: bit-identical on the CPU");
        return;
    }
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let close = (x.is_nan() && y.is_nan()) || x == y || (x - y).abs() <= rel * y.abs().max(1.0);
        assert!(close, "{what}: element {i}: {x} vs {y} (relative tolerance {rel})");
    }
}

/// [`assert_close`] over two maps of bit patterns (as [`f32_bits`] and [`working_bits`]
/// return), key by key.
pub fn assert_bits_close(
    a: &std::collections::BTreeMap<String, Vec<u32>>,
    b: &std::collections::BTreeMap<String, Vec<u32>>,
    rel: f32,
    what: &str,
) {
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "{what}: names"
    );
    let f = |v: &[u32]| v.iter().map(|b| f32::from_bits(*b)).collect::<Vec<_>>();
    for (k, va) in a {
        assert_close(&f(va), &f(&b[k]), rel, &format!("{what}: {k}"));
    }
}

/// [`assert_close`] over two maps of values (as [`store_values`] and [`varmap_values`]
/// return), key by key.
pub fn assert_values_close(
    a: &std::collections::BTreeMap<String, Vec<f32>>,
    b: &std::collections::BTreeMap<String, Vec<f32>>,
    rel: f32,
    what: &str,
) {
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "{what}: names"
    );
    for (k, va) in a {
        assert_close(va, &b[k], rel, &format!("{what}: {k}"));
    }
}

/// [`amp::initialize`] on the test device.
pub fn initialize<M>(
    build: impl FnOnce(VarBuilder<'static>) -> candle_core::Result<M>,
    optimizer: impl amp::optim::Optimizer + 'static,
    config: impl Into<amp::AmpConfig>,
) -> amp::Result<(amp::AmpModel<M>, amp::AmpOptimizer, amp::Amp)> {
    amp::initialize_on(build, optimizer, config, &device())
}

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

/// `n` seeded batches of (input, target), each 16x8, in f32, on the test device.
pub fn batches(n: usize, seed: u64) -> Vec<(Tensor, Tensor)> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..n)
        .map(|_| {
            let x: Vec<f32> = (0..128).map(|_| rng.random_range(-1.0..1.0)).collect();
            let y: Vec<f32> = (0..128).map(|_| rng.random_range(-1.0..1.0)).collect();
            (
                Tensor::from_vec(x, (16, 8), &device()).unwrap(),
                Tensor::from_vec(y, (16, 8), &device()).unwrap(),
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
    VarBuilder::from_varmap(vm, DType::F32, &device())
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

/// Values exact in f16 and bf16: multiples of `step` in `[-lim, lim]`, seeded.
pub fn grid(n: usize, step: f32, lim: i32, seed: u64) -> Vec<f32> {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    (0..n).map(|_| r.random_range(-lim..=lim) as f32 * step).collect()
}

/// `v` as a `rows x cols` f32 tensor on the CPU.
pub fn t2(v: &[f32], rows: usize, cols: usize) -> Tensor {
    Tensor::from_vec(v.to_vec(), (rows, cols), &Device::Cpu).unwrap()
}

/// A tensor's values in f64, flattened.
pub fn vals(t: &Tensor) -> Vec<f64> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1()
        .unwrap()
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
///
/// Each rank owns its communicator, so a rank that panics drops it while unwinding and its
/// peers' collectives fail at once (`DistErrorKind::PeerFailed`) instead of waiting out
/// `timeout`. The panic re-raised here is the one that started it, not a peer's failure
/// that followed.
pub fn on_ranks<T: Send>(
    n: usize,
    timeout: std::time::Duration,
    f: impl Fn(std::sync::Arc<dyn amp::distributed::Communicator>) -> T + Sync,
) -> Vec<T> {
    let comms = amp::distributed::LocalGroup::with_timeout(n, timeout);
    let joined: Vec<std::thread::Result<T>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .map(|c| {
                let f = &f;
                s.spawn(move || f(std::sync::Arc::new(c)))
            })
            .collect();
        hs.into_iter().map(|h| h.join()).collect()
    });
    let message = |p: &Box<dyn std::any::Any + Send>| {
        p.downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()
    };
    if joined.iter().any(|r| r.is_err()) {
        let mut panics: Vec<_> = joined.into_iter().filter_map(|r| r.err()).collect();
        let root = panics
            .iter()
            .position(|p| !message(p).contains("PeerFailed"))
            .unwrap_or(0);
        std::panic::resume_unwind(panics.swap_remove(root));
    }
    joined
        .into_iter()
        .map(|r| match r {
            Ok(t) => t,
            Err(_) => unreachable!("no rank panicked"),
        })
        .collect()
}

/// Asserts that no two of the run's live buffers (parameters, masters, cast cache, each
/// optimizer's master gradients, spare buffers and state: `amp::testing::live_buffers`)
/// share storage. candle's `clone`, `detach` and same-type `to_dtype` share it, and the
/// library writes most of these in place: two sharing one would change together. `what`
/// names the stage.
pub fn assert_no_shared_storage(amp: &amp::Amp, optimizers: &[&amp::AmpOptimizer], what: &str) {
    let mut seen: std::collections::HashMap<usize, String> = std::collections::HashMap::new();
    for (name, t) in amp::testing::live_buffers(amp, optimizers).unwrap() {
        if let Some(other) = seen.insert(amp::kernels::storage_key(&t), name.clone()) {
            panic!("{what}: `{name}` and `{other}` share storage");
        }
    }
}

/// Every value of `t` as the bits of its f64 value: a bit-for-bit comparison of any type.
pub fn f64_bits(t: &Tensor) -> Vec<u64> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
        .into_iter()
        .map(f64::to_bits)
        .collect()
}

/// The half tensors of the loss's graph: the edges whose gradients candle accumulates in half.
pub fn half_nodes(loss: &Tensor) -> usize {
    loss.sorted_nodes()
        .iter()
        .filter(|t| matches!(t.dtype(), DType::F16 | DType::BF16))
        .count()
}

/// Runs `f` on every instruction-set tier the CPU has, capped with `kernels::force_isa`, then
/// lifts the cap. `force_isa` is process-wide: call this under the test file's lock.
pub fn each_tier(mut f: impl FnMut(amp::kernels::Isa)) {
    use amp::kernels::{self, Isa};
    for isa in Isa::ALL.into_iter().filter(|i| *i <= kernels::detected_isa()) {
        kernels::force_isa(Some(isa));
        f(isa);
    }
    kernels::force_isa(None);
}

/// The backward of `loss` through `amp`'s guard into `opt`, with the gradient candle's
/// backward gave `x` (of the scaled loss; `None` if `x` took none).
pub fn backward_capturing(
    amp: &amp::Amp,
    loss: &Tensor,
    opt: &mut amp::AmpOptimizer,
    x: &Tensor,
) -> (amp::BackwardReport, Option<Tensor>) {
    let mut gx = None;
    let report = amp
        .scale_loss(loss, opt)
        .unwrap()
        .backward_with(|l| {
            let g = l.backward()?;
            gx = g.get(x).cloned();
            Ok(g)
        })
        .unwrap();
    (report, gx)
}
