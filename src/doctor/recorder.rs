//! The recorder the run's cast context calls: it computes each tensor's statistics on
//! observed steps and folds them into one bounded aggregate per tensor name, so memory does
//! not grow with the step count.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, Weak};

use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};

use super::DoctorConfig;
use super::stats::{self, BINADES, Measured, TensorStats};
use crate::precision::recording::{BackwardInfo, LossOf, Observer, TensorKind};
use crate::train::run::RunState;

/// The most records waiting on the device path before they are read anyway.
const MAX_PENDING: usize = 4096;

/// The most switch events kept (the oldest go first).
pub(crate) const MAX_EVENTS: usize = 256;

/// One switch of the automatic fallback.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SwitchEvent {
    /// The doctor's step at which it switched: backward passes since it was attached,
    /// counting from 1 (as the `train` example's progress lines).
    pub step: u64,
    /// The layer (its VarBuilder path).
    pub layer: String,
    /// `true`: to f32; `false`: back to the run's policy.
    pub to_f32: bool,
    /// Why, with the figures.
    pub reason: String,
}

/// The fallback's bookkeeping.
#[derive(Debug, Default)]
pub(crate) struct FallbackState {
    pub switched: BTreeSet<String>,
    pub events: VecDeque<SwitchEvent>,
}

/// The fallback's decision after an observed step: the switches to make, (layer, to f32).
pub(crate) type Decide = fn(&DoctorConfig, &mut State) -> Vec<(String, bool)>;

/// One observation of a tensor, as the fallback window keeps it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sample {
    /// Underflow fraction in the run's half type.
    pub underflow: f64,
    /// Overflow fraction in f16 (infinities included).
    pub overflow: f64,
    /// Whether it was the first non-finite activation of its step.
    pub root_nonfinite: bool,
}

/// Everything kept about one tensor name over the observed steps.
#[derive(Debug, Clone)]
pub(crate) struct Aggregate {
    pub kind: TensorKind,
    /// Whose gradients (gradients only; 0 otherwise, and for an outside `GradScaler`'s).
    pub loss: usize,
    /// When it was first recorded (forward order within a step).
    pub order: u64,
    pub dtype: DType,
    pub observations: u64,
    pub elements: u64,
    pub amax: f64,
    pub amin_nonzero: f64,
    pub sum_mean_abs: f64,
    pub sum_zero: f64,
    pub sum_under16: f64,
    pub sum_underbf: f64,
    pub sum_over16: f64,
    pub worst_over16: f64,
    pub nonfinite: u64,
    pub range: f64,
    /// Observations in which it was the first non-finite activation (or gradient, with a
    /// finite forward) of its step: a root cause, not a consequence.
    pub root_nonfinite: u64,
    /// The loss scale of its last observation.
    pub scale: f64,
    /// The largest finite unscaled magnitude (gradients: `amax / scale` of raw ones).
    pub amax_unscaled: f64,
    /// Nonzero finite magnitudes by binade, unscaled (gradients only).
    pub binades: Option<Vec<u64>>,
    /// Elements counted in `binades`.
    pub binade_elements: u64,
    /// Observations with the gradient's f32 value before rounding (gradients the library's
    /// products made), and its largest magnitude there (raw: at the loss scale).
    pub pre_round_observations: u64,
    pub pre_round_amax: f64,
    /// The last `window` observations.
    pub window: VecDeque<Sample>,
}

/// An aggregate's key: name, kind, loss scaler (gradients; 0 for the rest).
pub(crate) type Key = (String, TensorKind, usize);

/// One record whose statistics are on the device, not read yet.
#[derive(Debug)]
pub(crate) struct Pending {
    name: String,
    kind: TensorKind,
    loss: usize,
    dtype: DType,
    elements: u64,
    scale: f32,
    main: Measured,
    /// The f32 value before rounding (gradients), at the same multiplier.
    pre: Option<(Measured, u64)>,
}

/// One record's statistics, as [`Recorder::fold`] takes them.
struct Observed {
    stats: TensorStats,
    hist: Option<Vec<u64>>,
    /// The statistics of the f32 value before rounding (gradients), and its histogram.
    pre: Option<(TensorStats, Option<Vec<u64>>)>,
}

/// What the recorder knows.
#[derive(Debug, Default)]
pub(crate) struct State {
    /// Backward passes seen (the doctor's steps).
    pub step: u64,
    pub observed: u64,
    pub next_order: u64,
    pub op_calls: HashMap<String, u32>,
    /// By (name, kind, loss): gradients per loss scaler (see [`Aggregate::loss`]).
    pub tensors: BTreeMap<Key, Aggregate>,
    /// This backward's loss scaler.
    pub loss: usize,
    /// This backward's gradients in f32 before rounding, by parameter (from the raw
    /// gradient's record to the master gradient's).
    pub pre_round: HashMap<String, Tensor>,
    /// This backward's parameters whose raw gradient was not finite.
    pub raw_nonfinite: BTreeSet<String>,
    /// The device path: statistics computed on the device, read together at the end of the
    /// backward (one host transfer per observed step).
    pub pending: Vec<Pending>,
    /// This step: whether a forward tensor (or the loss) was not finite.
    pub forward_bad: bool,
    /// This step: whether a gradient was non-finite (root found).
    pub grad_bad: bool,
    /// Loss scale after each backward, thinned to stay bounded: (step counting from 1,
    /// scale, skipped).
    pub scales: Vec<(u64, f32, bool)>,
    pub scale_stride: u64,
    /// Parameters whose raw gradient was non-finite with a finite forward, by (loss,
    /// parameter): in how many observed backwards.
    pub overflowed_params: BTreeMap<(usize, String), u64>,
    pub skipped_steps: u64,
    pub fallback: FallbackState,
}

/// The doctor's recorder.
pub(crate) struct Recorder {
    pub cfg: DoctorConfig,
    pub half: DType,
    pub autocasts: bool,
    /// The run takes the device path: statistics stay on the device until the end of the
    /// backward.
    device_path: bool,
    recording: AtomicBool,
    state: Mutex<State>,
    /// The run, for the automatic fallback's switches (weak: the run holds the recorder).
    pub run: Weak<RunState>,
    /// The automatic fallback's rule.
    decide: Decide,
}

impl Recorder {
    pub(crate) fn new(
        cfg: DoctorConfig,
        half: DType,
        autocasts: bool,
        device_path: bool,
        run: Weak<RunState>,
        decide: Decide,
    ) -> Self {
        Self {
            cfg,
            half,
            autocasts,
            device_path,
            recording: AtomicBool::new(true),
            state: Mutex::new(State {
                scale_stride: 1,
                ..Default::default()
            }),
            run,
            decide,
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Measures `t` (and `pre`, its f32 value before rounding) and folds it in: at once on
    /// the CPU path, at the end of the backward on the device path.
    fn record_tensor(&self, name: String, kind: TensorKind, t: &Tensor, scale: f32, pre: Option<&Tensor>) {
        let grad = matches!(kind, TensorKind::Grad | TensorKind::MasterGrad);
        let loss = if grad { self.lock().loss } else { 0 };
        if self.device_path {
            let measure = |t: &Tensor| stats::check_scale(scale).and_then(|s| stats::device_vector(t, s, grad));
            let main = match measure(t) {
                Ok(m) => m,
                Err(e) => {
                    log::warn!("doctor: no statistics for {name}: {e}");
                    return;
                }
            };
            let pre = pre.and_then(|p| measure(p).ok().map(|m| (m, p.elem_count() as u64)));
            let many = {
                let mut g = self.lock();
                g.pending.push(Pending {
                    name,
                    kind,
                    loss,
                    dtype: t.dtype(),
                    elements: t.elem_count() as u64,
                    scale,
                    main,
                    pre,
                });
                g.pending.len() > MAX_PENDING
            };
            // Forwards without a backward (evaluation while a step is recorded) would keep
            // their statistics waiting: read them in one transfer once there are many.
            if many {
                self.flush();
            }
            return;
        }
        let (stats, hist) = match stats::compute(t, scale, grad) {
            Ok(s) => s,
            Err(e) => {
                log::warn!("doctor: no statistics for {name}: {e}");
                return;
            }
        };
        let pre = pre.and_then(|p| stats::compute(p, scale, grad).ok());
        self.fold(name, kind, loss, t.dtype(), scale, Observed { stats, hist, pre });
    }

    /// Reads every pending record's statistics in one host transfer (counted in the run's
    /// host syncs) and folds them in, in record order. Nothing to read: no transfer.
    pub(crate) fn flush(&self) {
        let pending = std::mem::take(&mut self.lock().pending);
        if pending.is_empty() {
            return;
        }
        let mut vectors = Vec::new();
        for p in &pending {
            for m in std::iter::once(&p.main).chain(p.pre.as_ref().map(|(m, _)| m)) {
                if let Measured::Pending(v) = m {
                    vectors.push(v.clone());
                }
            }
        }
        let values = if vectors.is_empty() {
            Ok(Vec::new())
        } else {
            Tensor::cat(&vectors, 0)
                .map_err(crate::AmpError::from)
                .and_then(|v| stats::read_vector(&v))
        };
        let values = match values {
            Ok(v) => v,
            Err(e) => {
                log::warn!("doctor: the step's statistics could not be read: {e}");
                return;
            }
        };
        if !vectors.is_empty()
            && let Some(run) = self.run.upgrade()
        {
            run.count_host_sync();
        }
        let mut at = 0usize;
        let grad_kind = |k: TensorKind| matches!(k, TensorKind::Grad | TensorKind::MasterGrad);
        let mut take = |m: Measured, dtype: DType, n: u64, scale: f64, hist: bool| match m {
            Measured::Known(s, h) => (s, h),
            Measured::Pending(v) => {
                let len = v.elem_count();
                let r = stats::from_vector(&values[at..at + len], dtype, n, scale, hist);
                at += len;
                r
            }
        };
        for p in pending {
            let hist = grad_kind(p.kind);
            let scale = p.scale as f64;
            let (stats, h) = take(p.main, p.dtype, p.elements, scale, hist);
            let pre = p.pre.map(|(m, n)| take(m, DType::F32, n, scale, hist));
            self.fold(
                p.name,
                p.kind,
                p.loss,
                p.dtype,
                p.scale,
                Observed { stats, hist: h, pre },
            );
        }
    }

    fn fold(&self, name: String, kind: TensorKind, loss: usize, dtype: DType, scale: f32, o: Observed) {
        let grad = matches!(kind, TensorKind::Grad | TensorKind::MasterGrad);
        let Observed {
            stats: mut st,
            hist,
            pre,
        } = o;
        // Underflow where the values still existed: in f32 before the rounding to half (a
        // value that rounded to an exact 0 is no zero of the gradient, it underflowed).
        let mut hist = hist;
        let mut pre_amax = None;
        if let Some((p, ph)) = pre {
            st.underflow_f16 = p.underflow_f16;
            st.underflow_bf16 = p.underflow_bf16;
            pre_amax = Some(p.amax);
            if kind == TensorKind::MasterGrad && st.nonfinite == 0 {
                hist = ph;
            }
        }
        let mut g = self.lock();
        let state = &mut *g;
        let forward = matches!(kind, TensorKind::Activation | TensorKind::Loss);
        let mut root = false;
        if st.nonfinite > 0 {
            if forward && !state.forward_bad {
                state.forward_bad = true;
                root = true;
            } else if grad && !state.forward_bad && kind == TensorKind::Grad {
                root = true;
                state.grad_bad = true;
                state.raw_nonfinite.insert(name.clone());
            }
        }
        let order = state.next_order;
        let agg = state.tensors.entry((name, kind, loss)).or_insert_with(|| Aggregate {
            kind,
            loss,
            order,
            dtype,
            observations: 0,
            elements: 0,
            amax: 0.0,
            amin_nonzero: f64::INFINITY,
            sum_mean_abs: 0.0,
            sum_zero: 0.0,
            sum_under16: 0.0,
            sum_underbf: 0.0,
            sum_over16: 0.0,
            worst_over16: 0.0,
            nonfinite: 0,
            range: 0.0,
            root_nonfinite: 0,
            scale: 1.0,
            amax_unscaled: 0.0,
            binades: None,
            binade_elements: 0,
            pre_round_observations: 0,
            pre_round_amax: 0.0,
            window: VecDeque::new(),
        });
        if agg.order == order {
            state.next_order += 1;
        }
        agg.dtype = dtype;
        agg.observations += 1;
        if let Some(a) = pre_amax {
            agg.pre_round_observations += 1;
            agg.pre_round_amax = agg.pre_round_amax.max(a);
        }
        agg.elements = st.elements;
        agg.amax = agg.amax.max(st.amax);
        if st.amin_nonzero > 0.0 {
            agg.amin_nonzero = agg.amin_nonzero.min(st.amin_nonzero);
        }
        agg.sum_mean_abs += st.mean_abs;
        agg.sum_zero += st.zero_frac;
        agg.sum_under16 += st.underflow_f16;
        agg.sum_underbf += st.underflow_bf16;
        agg.sum_over16 += st.overflow_f16;
        agg.worst_over16 = agg.worst_over16.max(st.overflow_f16);
        agg.nonfinite += st.nonfinite;
        agg.range = agg.range.max(st.range_binades);
        agg.root_nonfinite += root as u64;
        agg.scale = st.scale;
        if grad {
            // Raw gradients carry the scale: unscale their magnitudes.
            let div = if kind == TensorKind::Grad { scale as f64 } else { 1.0 };
            // Master gradients are the unscaled truth; raw ones are recorded at multiplier 1.
            if st.nonfinite == 0 && kind == TensorKind::MasterGrad {
                agg.amax_unscaled = agg.amax_unscaled.max(st.amax / div);
            }
            if kind == TensorKind::MasterGrad
                && st.nonfinite == 0
                && let Some(h) = hist
            {
                let acc = agg.binades.get_or_insert_with(|| vec![0; BINADES]);
                for (a, b) in acc.iter_mut().zip(h) {
                    *a += b;
                }
                agg.binade_elements += st.elements;
            }
        }
        let underflow = if self.half == DType::BF16 {
            st.underflow_bf16
        } else {
            st.underflow_f16
        };
        agg.window.push_back(Sample {
            underflow,
            overflow: st.overflow_f16,
            root_nonfinite: root,
        });
        while agg.window.len() > self.cfg.window {
            agg.window.pop_front();
        }
        drop(g);
    }

    /// Switch events so far.
    pub(crate) fn switches(&self) -> Vec<SwitchEvent> {
        self.lock().fallback.events.iter().cloned().collect()
    }
}

impl Observer for Recorder {
    fn recording(&self) -> bool {
        self.recording.load(Ordering::Relaxed)
    }

    fn record(&self, name: &str, kind: TensorKind, t: &Tensor, scale: f32) {
        if !t.dtype().is_float() {
            return;
        }
        // A master gradient is measured before rounding as its raw gradient was, unscaled.
        let pre = if kind == TensorKind::MasterGrad {
            let p = self.lock().pre_round.remove(name);
            p.and_then(|p| p.affine(1.0 / scale as f64, 0.0).ok())
        } else {
            None
        };
        self.record_tensor(name.to_string(), kind, t, scale, pre.as_ref());
    }

    fn begin_gradients(&self, loss: LossOf) {
        let mut g = self.lock();
        g.loss = loss.unwrap_or(0);
        g.pre_round.clear();
        g.raw_nonfinite.clear();
    }

    fn record_grad(&self, name: &str, raw: &Tensor, pre_round: Option<&Tensor>) {
        if !raw.dtype().is_float() {
            return;
        }
        let pre = pre_round.filter(|p| p.shape() == raw.shape());
        if let Some(p) = pre {
            self.lock().pre_round.insert(name.to_string(), p.clone());
        }
        self.record_tensor(name.to_string(), TensorKind::Grad, raw, 1.0, pre);
    }

    fn record_op(&self, op: &str, t: &Tensor) {
        if !t.dtype().is_float() {
            return;
        }
        let name = {
            let mut g = self.lock();
            let c = g.op_calls.entry(op.to_string()).or_insert(0);
            let name = format!("{op}#{c}");
            *c += 1;
            name
        };
        self.record_tensor(name, TensorKind::Activation, t, 1.0, None);
    }

    fn end_backward(&self, info: &BackwardInfo) {
        let was_recording = self.recording();
        if was_recording {
            self.flush();
        }
        let mut g = self.lock();
        let state = &mut *g;
        if was_recording {
            state.observed += 1;
            // The parameters whose own raw gradient was not finite, with a finite forward,
            // for this backward's loss scaler (an accumulated sum that overflowed with
            // another loss's gradient is not this loss's).
            if !state.forward_bad {
                let loss = state.loss;
                for p in std::mem::take(&mut state.raw_nonfinite) {
                    *state.overflowed_params.entry((loss, p)).or_insert(0) += 1;
                }
            }
            state.raw_nonfinite.clear();
            state.pre_round.clear();
            state.op_calls.clear();
        }
        state.skipped_steps += info.found_inf as u64;
        // The loss scale over the steps, thinned (every other point dropped, the stride
        // doubled) whenever it reaches the configured length.
        if state.step.is_multiple_of(state.scale_stride) || info.found_inf {
            state.scales.push((state.step + 1, info.scale, info.found_inf));
            if state.scales.len() >= self.cfg.history.max(2) {
                let mut kept: Vec<_> = state
                    .scales
                    .iter()
                    .enumerate()
                    .filter(|(i, p)| i % 2 == 0 || p.2)
                    .map(|(_, p)| *p)
                    .collect();
                // Mostly skips: keep the newer half.
                if kept.len() > self.cfg.history / 2 {
                    kept.drain(..kept.len() - self.cfg.history / 2);
                }
                state.scales = kept;
                state.scale_stride *= 2;
            }
        }
        if was_recording && self.cfg.auto_fallback && self.autocasts {
            let switches = (self.decide)(&self.cfg, state);
            if !switches.is_empty()
                && let Some(run) = self.run.upgrade()
            {
                for (layer, to_f32) in switches {
                    run.casts.set_f32_layer(&layer, to_f32.then_some("auto"));
                }
            }
        }
        state.forward_bad = false;
        state.grad_bad = false;
        state.step += 1;
        let next = state.step.is_multiple_of(self.cfg.every);
        drop(g);
        self.recording.store(next, Ordering::Relaxed);
    }
}
