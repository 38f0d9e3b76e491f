//! Stochastic gradient descent with momentum, Nesterov momentum and weight decay
//! (PyTorch's `torch.optim.SGD` update rule), in f32, fused: one pass per parameter over its
//! f32 value, gradient and momentum buffer (owned by the optimizer), then the half copy.

use std::collections::BTreeMap;

use candle_core::Tensor;

use super::fused::{self, Slots, Target};
use super::{GroupHyper, Optimizer, OptimizerState, ParamBuffers, ParamUpdate};
use crate::error::{AmpError, Result};
use crate::kernels::slices::{ParamSlice, SgdConsts, sgd_param};

/// SGD settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdConfig {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0 = plain SGD).
    pub momentum: f64,
    /// Dampening of the momentum.
    pub dampening: f64,
    /// L2 weight decay added to the gradient.
    pub weight_decay: f64,
    /// Nesterov momentum (needs momentum > 0 and dampening 0).
    pub nesterov: bool,
    /// Run the fused one-pass update (`true`, the default): on the CPU per parameter, on CUDA
    /// one kernel launch over all parameters (with the `cuda` feature); `false` runs the same
    /// arithmetic as tensor ops (what other devices always do).
    pub fused: bool,
}

impl SgdConfig {
    /// Plain SGD with this learning rate.
    pub fn new(lr: f64) -> Self {
        Self {
            lr,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
            fused: true,
        }
    }
}

const BUF: [&str; 1] = ["momentum_buffer"];

/// SGD. For each parameter `p` with gradient `g`:
/// `d = g + wd*p`; with momentum `buf = momentum*buf + (1-dampening)*d` (`buf = d` at the
/// first step) and `d = d + momentum*buf` (Nesterov) or `d = buf`; then `p -= lr*d`.
#[derive(Debug, Clone)]
pub struct Sgd {
    config: SgdConfig,
    /// Per parameter: steps, and the momentum buffer when momentum is on.
    state: BTreeMap<String, Slots>,
}

impl Sgd {
    /// A new SGD; state is created per parameter at its first update.
    pub fn new(config: SgdConfig) -> Result<Self> {
        if config.nesterov && (config.momentum <= 0.0 || config.dampening != 0.0) {
            return Err(AmpError::OptimizerState(
                "Nesterov momentum needs momentum > 0 and dampening 0".into(),
            ));
        }
        let bad = |v: f64| v.is_nan() || v < 0.0;
        if bad(config.lr) || bad(config.momentum) || bad(config.weight_decay) {
            return Err(AmpError::OptimizerState(format!(
                "SGD needs lr, momentum and weight_decay >= 0, got {config:?}"
            )));
        }
        Ok(Self {
            config,
            state: BTreeMap::new(),
        })
    }

    /// The parameter's slots, and whether its momentum buffer starts now (PyTorch: a missing
    /// buffer starts as the step's direction). The buffer exists only with momentum.
    fn slots(&mut self, p: &ParamUpdate<'_>) -> (&mut Slots, bool) {
        let momentum = self.config.momentum != 0.0;
        let st = self
            .state
            .entry(p.name.to_string())
            .or_insert_with(|| Slots::zeros(p.var.dims(), &[]));
        let first = st.bufs.is_empty();
        if momentum && first {
            st.shape = p.var.dims().to_vec();
            st.bufs.push((BUF[0], fused::Buf::Host(vec![0f32; p.var.elem_count()])));
        }
        (st, first)
    }

    /// The whole step in one launch of the multi-tensor kernel (CUDA, every parameter f32,
    /// see `kernels::cuda::multi_tensor`): the same arithmetic as
    /// [`update`](Optimizer::update), the parameters and working copies written in place and
    /// the momentum buffers replaced by new ones (a snapshot taken before keeps the old ones).
    /// `false` where it does not apply: nothing was changed and the tensor path runs.
    #[cfg(feature = "cuda")]
    fn cuda_step(&mut self, params: &[ParamUpdate<'_>]) -> Result<bool> {
        use crate::kernels::cuda::multi_tensor::{MtSgd, StepItem, sgd_step};
        let c = self.config;
        let momentum = c.momentum != 0.0;
        if params.is_empty() || !params.iter().all(|p| p.var.device().is_cuda()) {
            return Ok(false);
        }
        // Read without changing the state (`slots` would start buffers): the tensor path
        // must find it as it was if the kernel does not apply.
        let mut bufs = Vec::with_capacity(params.len());
        for p in params {
            let b = match self.state.get_mut(p.name) {
                Some(st) if momentum && !st.bufs.is_empty() => {
                    if st.shape.as_slice() != p.var.dims() {
                        return Ok(false);
                    }
                    let shape = st.shape.clone();
                    Some(st.bufs[0].1.tensor(&shape, p.var.device())?)
                }
                _ => None,
            };
            bufs.push(b);
        }
        let consts: Vec<MtSgd> = params
            .iter()
            .map(|p| MtSgd::new(p.hyper.lr, p.hyper.weight_decay, c.momentum, c.dampening, c.nesterov))
            .collect();
        let items: Vec<StepItem<'_>> = params
            .iter()
            .zip(&bufs)
            .map(|(p, b)| StepItem {
                param: p.var.as_tensor(),
                grad: p.grad,
                state_in: if momentum { vec![b.as_ref()] } else { Vec::new() },
                working: p.working.map(|w| w.as_tensor()),
            })
            .collect();
        let Some(new) = sgd_step(&items, &consts, momentum)? else {
            return Ok(false);
        };
        for (p, mut out) in params.iter().zip(new) {
            let st = self
                .state
                .entry(p.name.to_string())
                .or_insert_with(|| Slots::zeros(p.var.dims(), &[]));
            if let Some(b) = out.pop() {
                st.shape = p.var.dims().to_vec();
                st.bufs = vec![(BUF[0], fused::Buf::Device(b))];
            }
            st.step += 1;
        }
        Ok(true)
    }

    fn consts(&self, hyper: GroupHyper, first: bool) -> SgdConsts {
        let c = self.config;
        SgdConsts {
            lr: hyper.lr as f32,
            weight_decay: hyper.weight_decay as f32,
            momentum: c.momentum as f32,
            one_minus_dampening: (1.0 - c.dampening) as f32,
            nesterov: c.nesterov,
            first,
        }
    }
}

impl Optimizer for Sgd {
    fn name(&self) -> &'static str {
        "sgd"
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
        let param = p.var.as_tensor();
        let dev = param.device().clone();
        let mut d = p.grad.clone();
        if p.hyper.weight_decay != 0.0 {
            d = (d + (param * p.hyper.weight_decay)?)?;
        }
        let (st, first) = self.slots(p);
        let mut new_buf = None;
        if c.momentum != 0.0 {
            let buf = if first {
                d.clone()
            } else {
                // The momentum stays on the parameter's device between steps.
                let shape = st.shape.clone();
                let b = st.bufs[0].1.tensor(&shape, &dev)?;
                ((b * c.momentum)? + (&d * (1.0 - c.dampening))?)?
            };
            d = if c.nesterov {
                (d + (&buf * c.momentum)?)?
            } else {
                buf.clone()
            };
            // At the first step `buf` is the gradient itself (no weight decay), which the
            // next backward overwrites in place: kept apart from it (PyTorch: `buf = g_1`).
            new_buf = Some(fused::Buf::kept(&buf, p)?);
        }
        let next = param.sub(&(d * p.hyper.lr)?)?.detach();
        // The state is written only after every value above exists.
        let (st, _) = self.slots(p);
        if let Some(b) = new_buf {
            st.bufs[0].1 = b;
        }
        st.step += 1;
        Ok(next)
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
            let first = self.slots(p).1;
            let c = self.consts(hyper, first);
            let (st, _) = self.slots(p);
            st.step += 1;
            let buf = match st.bufs.first_mut() {
                Some((_, b)) => Some(&mut b.host_mut()?[..]),
                None => None,
            };
            fused::apply(p, move |t, g| match t {
                Target::F32(pv) => sgd_param::<half::f16>(ParamSlice::F32(pv, None), g, buf, &c),
                Target::F16(pv) => sgd_param(ParamSlice::Half(pv), g, buf, &c),
                Target::Bf16(pv) => sgd_param(ParamSlice::Half(pv), g, buf, &c),
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

    fn load_state_dict(&mut self, state: &OptimizerState) -> Result<()> {
        state.expect_kind(self.name())?;
        let mut new = BTreeMap::new();
        for (name, ps) in &state.params {
            // Saved without momentum the buffer is absent, and starts afresh at the next step
            // (PyTorch's rule for a missing buffer).
            let names: &[&'static str] = if ps.buffers.contains_key(BUF[0]) { &BUF } else { &[] };
            new.insert(name.clone(), Slots::from_state(ps, names, name)?);
        }
        self.state = new;
        Ok(())
    }

    fn load_state(&mut self, mut state: OptimizerState) -> Result<()> {
        self.check_state(&state)?;
        let mut new = BTreeMap::new();
        // Each saved buffer is freed as soon as its copy is taken.
        for (name, ps) in std::mem::take(&mut state.params) {
            let names: &[&'static str] = if ps.buffers.contains_key(BUF[0]) { &BUF } else { &[] };
            let slots = Slots::from_state(&ps, names, &name)?;
            drop(ps);
            new.insert(name, slots);
        }
        self.state = new;
        Ok(())
    }
}
