//! What the fused kernels share on a candle CUDA device: their CUDA C compiled by NVRTC once
//! per compute capability (with `prelude.cuh` spliced in where the source includes it), loaded
//! into candle's context once per device, and a failure logged once per device, after which
//! the callers keep the composed ops.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::cuda_backend::cudarc::nvrtc::{CompileOptions, compile_ptx_with_opts};
use candle_core::cuda_backend::{CudaDevice, DeviceId};

/// The kernels' shared CUDA C (half types, conversions, reductions), which each `.cu` includes.
const PRELUDE: &str = include_str!("prelude.cuh");
/// The line by which a `.cu` includes the prelude (nvcc and the emulator's g++ resolve it).
const INCLUDE: &str = "#include \"prelude.cuh\"\n";

/// A module's PTX, or why NVRTC could not make it.
type Compiled = std::result::Result<Arc<str>, String>;

/// One `.cu`'s kernels: its source, its name in candle's per-device cache of custom modules,
/// and its own caches of PTX (per compute capability) and of load results (per device).
pub(crate) struct Kernels {
    /// The module's name in candle's per-device cache of custom modules.
    pub(crate) module: &'static str,
    source: &'static str,
    /// A kernel the first load looks up, so that a module that loads but lacks it counts as failed.
    probe: &'static str,
    /// The kernels, as the warning names them ("softmax" in "the CUDA softmax kernels").
    what: &'static str,
    /// What runs instead, as the warning says it ("attention's softmax runs").
    fallback: &'static str,
    ptx: OnceLock<Mutex<HashMap<(i32, i32), Compiled>>>,
    loaded: OnceLock<Mutex<HashMap<DeviceId, bool>>>,
}

impl Kernels {
    pub(crate) const fn new(
        module: &'static str,
        source: &'static str,
        probe: &'static str,
        what: &'static str,
        fallback: &'static str,
    ) -> Self {
        Self {
            module,
            source,
            probe,
            what,
            fallback,
            ptx: OnceLock::new(),
            loaded: OnceLock::new(),
        }
    }

    /// The source NVRTC compiles: the `.cu` with its include line replaced by the prelude, as
    /// the preprocessor would (NVRTC then needs no header).
    fn source(&self) -> String {
        debug_assert!(self.source.contains(INCLUDE), "{}: no prelude include", self.module);
        self.source.replacen(INCLUDE, PRELUDE, 1)
    }

    /// PTX per compute capability (NVRTC runs once per architecture per process), or why not.
    pub(crate) fn ptx(&self, dev: &CudaDevice) -> Compiled {
        let cc = dev
            .cuda_stream()
            .context()
            .compute_capability()
            .map_err(|e| format!("compute capability: {e}"))?;
        let mut cache = self
            .ptx
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        cache
            .entry(cc)
            .or_insert_with(|| {
                let opts = CompileOptions {
                    // The device's own virtual architecture: its driver JIT-compiles the PTX
                    // once at load. No fused multiply-add, so the arithmetic rounds as the CPU
                    // kernels' does (the kernels are memory-bound: FMA would save nothing).
                    options: vec![
                        format!("--gpu-architecture=compute_{}{}", cc.0, cc.1),
                        "--fmad=false".into(),
                    ],
                    name: Some(format!("{}.cu", self.module)),
                    ..Default::default()
                };
                compile_ptx_with_opts(self.source(), opts)
                    .map(|p| Arc::from(p.to_src()))
                    .map_err(|e| format!("NVRTC: {e}"))
            })
            .clone()
    }

    /// Whether the kernels are loaded on `dev` (compiling and loading them on first use). A
    /// failure is logged once per device; the callers then keep the composed ops.
    pub(crate) fn available(&self, dev: &CudaDevice) -> bool {
        let mut loaded = self
            .loaded
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        *loaded.entry(dev.id()).or_insert_with(|| {
            let r = self.ptx(dev).and_then(|ptx| {
                dev.get_or_load_custom_func(self.probe, self.module, &ptx)
                    .map(|_| ())
                    .map_err(|e| format!("loading the module: {e}"))
            });
            if let Err(e) = &r {
                log::warn!(
                    "candle-amp: the CUDA {} kernels are unavailable ({e}); {} as composed candle ops",
                    self.what,
                    self.fallback
                );
            }
            r.is_ok()
        })
    }
}
