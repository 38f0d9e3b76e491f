//! AdamW (decoupled weight decay), in f32, fused: one pass per parameter over its f32 value,
//! gradient and two moments (buffers the optimizer owns), then the half working copy.

use std::collections::BTreeMap;

use candle_core::Tensor;

use super::fused::{self, Slots, Target};
use super::{GroupHyper, Optimizer, OptimizerState, ParamBuffers, ParamUpdate};
use crate::error::{AmpError, Result};
use crate::kernels::slices::{AdamWConsts, AdamWStep, ParamSlice, adamw_param};

/// AdamW settings (candle-nn's and PyTorch's defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// Learning rate (1e-3).
    pub lr: f64,
    /// First-moment decay (0.9).
    pub beta1: f64,
    /// Second-moment decay (0.999).
    pub beta2: f64,
    /// Denominator epsilon (1e-8; fine in f32, where the arithmetic happens).
    pub eps: f64,
    /// Decoupled weight decay (0.01).
    pub weight_decay: f64,
    /// Run the fused one-pass update (`true`, the default): on the CPU per parameter, on CUDA
    /// one kernel launch over all parameters (with the `cuda` feature); `false` runs the same
    /// arithmetic as tensor ops (what other devices always do).
    pub fused: bool,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            fused: true,
        }
    }
}

const BUFS: [&str; 2] = ["exp_avg", "exp_avg_sq"];

/// AdamW. Per parameter, with its own step counter `t` (parameters that got no gradient do
/// not advance, as in PyTorch):
/// `m = b1*m + (1-b1)*g`, `v = b2*v + (1-b2)*g^2`,
/// `p = p*(1 - lr*wd) - lr * (m/(1-b1^t)) / (sqrt(v/(1-b2^t)) + eps)`,
/// the same operations in the same order as candle-nn's `AdamW`, so the fused and the tensor
/// paths agree with it bit for bit on f32 parameters.
pub struct AdamW {
    config: AdamWConfig,
    state: BTreeMap<String, Slots>,
}

impl std::fmt::Debug for AdamW {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdamW")
            .field("config", &self.config)
            .field("params", &self.state.len())
            .finish()
    }
}

impl AdamW {
    /// A new AdamW; moments are created per parameter at its first update.
    pub fn new(config: AdamWConfig) -> Result<Self> {
        let c = config;
        let ok = c.lr >= 0.0
            && (0.0..1.0).contains(&c.beta1)
            && (0.0..1.0).contains(&c.beta2)
            && c.eps > 0.0
            && c.weight_decay >= 0.0;
        if !ok {
            return Err(AmpError::OptimizerState(format!(
                "AdamW needs lr >= 0, betas in [0, 1), eps > 0 and weight_decay >= 0, got {c:?}"
            )));
        }
        Ok(Self {
            config,
            state: BTreeMap::new(),
        })
    }

    fn step_consts(&self, hyper: GroupHyper, step: u64) -> AdamWStep {
        AdamWStep {
            lr: hyper.lr,
            beta1: self.config.beta1,
            beta2: self.config.beta2,
            eps: self.config.eps,
            weight_decay: hyper.weight_decay,
            step,
        }
    }

    /// The whole step in one launch of the multi-tensor kernel (CUDA, every parameter f32
    /// with f32 state, see `kernels::cuda::multi_tensor`): the same arithmetic as
    /// [`update`](Optimizer::update), the masters and working copies written in place and the
    /// moments replaced by new buffers (a snapshot taken before keeps the old ones). `false`
    /// where it does not apply: nothing was changed and the tensor path runs.
    #[cfg(feature = "cuda")]
    fn cuda_step(&mut self, params: &[ParamUpdate<'_>]) -> Result<bool> {
        use crate::kernels::cuda::multi_tensor::{MtAdamW, StepItem, adamw_step};
        let c = self.config;
        if params.is_empty() || !params.iter().all(|p| p.var.device().is_cuda()) {
            return Ok(false);
        }
        // The moments as device tensors (uploaded once if they were loaded on the host);
        // none yet: zeros, read as such by the kernel (no upload).
        let mut moments = Vec::with_capacity(params.len());
        let mut consts = Vec::with_capacity(params.len());
        for p in params {
            let (m, step) = match self.state.get_mut(p.name) {
                Some(st) if st.shape.as_slice() == p.var.dims() => {
                    let shape = st.shape.clone();
                    let dev = p.var.device();
                    let m = st.bufs[0].1.tensor(&shape, dev)?;
                    let v = st.bufs[1].1.tensor(&shape, dev)?;
                    (Some([m, v]), st.step)
                }
                Some(_) => return Ok(false),
                None => (None, 0),
            };
            moments.push(m);
            consts.push(MtAdamW::new(
                p.hyper.lr,
                c.beta1,
                c.beta2,
                c.eps,
                p.hyper.weight_decay,
                step + 1,
            ));
        }
        let items: Vec<StepItem<'_>> = params
            .iter()
            .zip(&moments)
            .map(|(p, m)| StepItem {
                param: p.var.as_tensor(),
                grad: p.grad,
                state_in: match m {
                    Some([m, v]) => vec![Some(m), Some(v)],
                    None => vec![None, None],
                },
                working: p.working.map(|w| w.as_tensor()),
            })
            .collect();
        let Some(new) = adamw_step(&items, &consts)? else {
            return Ok(false);
        };
        for (p, mut bufs) in params.iter().zip(new) {
            let (Some(v), Some(m)) = (bufs.pop(), bufs.pop()) else {
                continue;
            };
            let st = self
                .state
                .entry(p.name.to_string())
                .or_insert_with(|| Slots::zeros(&[], &[]));
            st.shape = p.var.dims().to_vec();
            st.bufs = vec![(BUFS[0], fused::Buf::Device(m)), (BUFS[1], fused::Buf::Device(v))];
            st.step += 1;
        }
        Ok(true)
    }

    fn slots(&mut self, p: &ParamUpdate<'_>) -> &mut Slots {
        self.state
            .entry(p.name.to_string())
            .or_insert_with(|| Slots::zeros(p.var.dims(), &BUFS))
    }
}

impl Optimizer for AdamW {
    fn name(&self) -> &'static str {
        "adamw"
    }

    fn defaults(&self) -> GroupHyper {
        GroupHyper {
            lr: self.config.lr,
            weight_decay: self.config.weight_decay,
        }
    }

    /// The tensor-op path (other devices, or `fused: false`).
    fn update(&mut self, p: &ParamUpdate<'_>) -> Result<Tensor> {
        let c = self.config;
        let theta = p.var.as_tensor();
        let g = p.grad;
        let dev = theta.device().clone();
        let st = self.slots(p);
        // The moments stay on the parameter's device between steps.
        let shape = st.shape.clone();
        let m = st.bufs[0].1.tensor(&shape, &dev)?;
        let v = st.bufs[1].1.tensor(&shape, &dev)?;
        let t = (st.step + 1) as f64;
        let (lr, wd) = (p.hyper.lr, p.hyper.weight_decay);
        let next_m = ((&m * c.beta1)? + (g * (1.0 - c.beta1))?)?;
        let next_v = ((&v * c.beta2)? + (g.sqr()? * (1.0 - c.beta2))?)?;
        let m_hat = (&next_m * (1.0 / (1.0 - c.beta1.powf(t))))?;
        let v_hat = (&next_v * (1.0 / (1.0 - c.beta2.powf(t))))?;
        let next_theta = (theta * (1f64 - lr * wd))?;
        let adjusted = (m_hat / (v_hat.sqrt()? + c.eps)?)?;
        let next_theta = (next_theta - (adjusted * lr)?)?;
        // The state is written only after every value above exists.
        let (nm, nv) = (fused::Buf::kept(&next_m, p)?, fused::Buf::kept(&next_v, p)?);
        let st = self.slots(p);
        st.bufs[0].1 = nm;
        st.bufs[1].1 = nv;
        st.step += 1;
        Ok(next_theta.detach())
    }

    fn reads_f32_copies(&self, params: &[ParamUpdate<'_>]) -> bool {
        !(self.config.fused && fused::fusable(params))
    }

    /// None for the fused pass, which checks every parameter before writing any (and
    /// writes in place, so a copy of the state could not undo it anyway); the tensor path's
    /// state is device tensors that a step replaces, so its snapshot shares them.
    fn step_snapshot(&self, params: &[ParamUpdate<'_>]) -> Option<OptimizerState> {
        if self.config.fused && fused::fusable(params) {
            return None;
        }
        self.state_dict().ok()
    }

    fn step(&mut self, params: &[ParamUpdate<'_>]) -> Result<()> {
        #[cfg(feature = "cuda")]
        if self.config.fused && crate::kernels::enabled() && self.cuda_step(params)? {
            fused::invalidate_all_of(params);
            return Ok(());
        }
        if !(self.config.fused && fused::fusable(params)) {
            let stepped = super::default_step(self, params);
            // `Var::set` keeps the ids: autocast must not serve casts of the old values.
            fused::invalidate_all_of(params);
            return stepped;
        }
        for p in params {
            let hyper = p.hyper;
            let step = self.slots(p).step + 1;
            let c = AdamWConsts::new(&self.step_consts(hyper, step));
            let st = self.slots(p);
            st.step = step;
            let (m, rest) = st.bufs.split_at_mut(1);
            let (m, v) = (&mut m[0].1.host_mut()?[..], &mut rest[0].1.host_mut()?[..]);
            fused::apply(p, move |t, g| match t {
                Target::F32(pv) => adamw_param::<half::f16>(ParamSlice::F32(pv, None), g, m, v, &c),
                Target::F16(pv) => adamw_param(ParamSlice::Half(pv), g, m, v, &c),
                Target::Bf16(pv) => adamw_param(ParamSlice::Half(pv), g, m, v, &c),
            })?;
        }
        Ok(())
    }

    fn state_dict(&self) -> Result<OptimizerState> {
        let mut params = BTreeMap::new();
        for (name, st) in &self.state {
            params.insert(name.clone(), st.to_state()?);
        }
        Ok(OptimizerState {
            kind: self.name().into(),
            params,
        })
    }

    fn buffers(&self) -> Result<Vec<ParamBuffers<'_>>> {
        super::slot_buffers(&self.state)
    }

    fn check_state(&self, state: &OptimizerState) -> Result<()> {
        state.expect_kind(self.name())?;
        for (name, ps) in &state.params {
            for k in BUFS {
                if !ps.buffers.contains_key(k) {
                    return Err(AmpError::OptimizerState(format!(
                        "parameter `{name}` has no `{k}` buffer"
                    )));
                }
            }
        }
        Ok(())
    }

    fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()> {
        self.check_state(state)?;
        let mut new = BTreeMap::new();
        for (name, ps) in &state.params {
            new.insert(name.clone(), Slots::from_state(ps, &BUFS, name)?);
        }
        self.state = new;
        Ok(())
    }

    fn load_state(&mut self, mut state: OptimizerState) -> Result<()> {
        self.check_state(&state)?;
        let mut new = BTreeMap::new();
        // Each saved buffer is freed as soon as its copy is taken.
        for (name, ps) in std::mem::take(&mut state.params) {
            let slots = Slots::from_state(&ps, &BUFS, &name)?;
            drop(ps);
            new.insert(name, slots);
        }
        self.state = new;
        Ok(())
    }
}
