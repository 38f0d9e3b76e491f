//! `Recompute`: checkpointed segments as nodes of candle's graph whose backward recomputes
//! them.

use std::sync::{Arc, Mutex, Once};

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CustomOp1, Layout, Shape, Tensor, Var};
use candle_nn::ModuleT;

use crate::amp::Amp;
use crate::error::{AmpError, Result};
use crate::precision::autocast::{self, AutocastPolicy, Phase};
use crate::train::rng::{DrawLog, recording_draws, replaying};
use crate::train::run::{RunState, merge_grads};

use super::chunk::{check_chunking, map_slices, map_slices_detached, pieces};
use super::seed::backward_from;

/// A segment's computation, run again during the backward.
type SegmentFn = Arc<dyn Fn(&Tensor) -> candle_core::Result<Tensor> + Send + Sync>;

/// What the backward needs to run a segment again as its first forward ran it.
struct Recording {
    run: Arc<RunState>,
    f: SegmentFn,
    /// `Some((dim, size))`: the segment ran on slices of its input (chunked forward).
    split: Option<(usize, usize)>,
    /// The autocast scopes open during the forward, oldest first.
    scopes: Vec<AutocastPolicy>,
    /// The streams the forward drew from (on its thread), each at its state before its
    /// first draw: only these are replayed, and privately (see `crate::train::rng`).
    rng: DrawLog,
}

/// The graph node of a checkpointed segment: its argument is the segment's input, its value
/// the segment's output (computed before, without keeping the segment's graph), and its
/// backward recomputes the segment, hands the parameter gradients to the run for the
/// guard's stages and returns the input's gradient to candle's backward, which goes on
/// through the rest of the graph in the same pass.
struct Boundary {
    rec: Recording,
    /// The output, until the forward copies it into the node.
    out: Mutex<Option<Tensor>>,
}

/// A copy of a contiguous CPU tensor's values as owned storage.
fn owned_storage(t: &Tensor) -> candle_core::Result<CpuStorage> {
    let t = t.contiguous()?;
    let (st, layout) = t.storage_and_layout();
    let (a, b) = layout
        .contiguous_offsets()
        .ok_or_else(|| candle_core::Error::Msg("recompute: non-contiguous output".into()))?;
    let candle_core::Storage::Cpu(cpu) = &*st else {
        candle_core::bail!("recompute: checkpointing keeps CPU tensors only")
    };
    Ok(match cpu {
        CpuStorage::U8(v) => CpuStorage::U8(v[a..b].to_vec()),
        CpuStorage::U32(v) => CpuStorage::U32(v[a..b].to_vec()),
        CpuStorage::I64(v) => CpuStorage::I64(v[a..b].to_vec()),
        CpuStorage::BF16(v) => CpuStorage::BF16(v[a..b].to_vec()),
        CpuStorage::F16(v) => CpuStorage::F16(v[a..b].to_vec()),
        CpuStorage::F32(v) => CpuStorage::F32(v[a..b].to_vec()),
        CpuStorage::F64(v) => CpuStorage::F64(v[a..b].to_vec()),
        _ => candle_core::bail!("recompute: a segment output of an unsupported type"),
    })
}

impl Boundary {
    /// The segment's output, which the node's forward takes exactly once.
    fn take_out(&self) -> candle_core::Result<Tensor> {
        self.out
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .ok_or_else(|| candle_core::Error::Msg("recompute: a checkpoint node ran its forward twice".into()))
    }
}

impl CustomOp1 for Boundary {
    fn name(&self) -> &'static str {
        "candle-amp-checkpoint"
    }

    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let out = self.take_out()?;
        Ok((owned_storage(&out)?, out.shape().clone()))
    }

    /// The segment's output (computed on the device) copied into the node's own buffer, as
    /// on the CPU.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _s: &candle_core::CudaStorage,
        _l: &Layout,
    ) -> candle_core::Result<(candle_core::CudaStorage, Shape)> {
        crate::kernels::cuda_owned_copy(&self.take_out()?, "recompute: the segment's output")
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> candle_core::Result<Option<Tensor>> {
        let (gx, params) = self.rec.replay(arg, grad)?;
        self.rec.run.stash_recomputed(params)?;
        gx.map(crate::kernels::graph_grad::for_candle).transpose()
    }
}

impl Recording {
    /// Runs the segment again on `x` (its input) and backpropagates `g` (the gradient at
    /// its output) through it: the input's gradient and the variables' gradients.
    fn replay(&self, x: &Tensor, g: &Tensor) -> candle_core::Result<(Option<Tensor>, GradStore)> {
        // The forward's random draws again, from private copies of the streams it used: a
        // loader drawing on another thread meanwhile never sees a rewound stream, and streams
        // the segment did not use are not touched at all.
        replaying(&self.rng, || self.replay_unseeded(x, g))
    }

    /// [`replay`](Self::replay) once the segment's streams are in place.
    fn replay_unseeded(&self, x: &Tensor, g: &Tensor) -> candle_core::Result<(Option<Tensor>, GradStore)> {
        let _scopes: Vec<_> = self.scopes.iter().map(|p| p.enter()).collect();
        let _phase = autocast::enter_phase(Phase::Recompute);
        let x = x.detach();
        let parts = match self.split {
            None => vec![(x.clone(), g.clone())],
            Some((dim, size)) => pieces(&x, dim, size)?.into_iter().zip(pieces(g, dim, size)?).collect(),
        };
        let mut params = GradStore::default();
        let mut input_grads = Vec::with_capacity(parts.len());
        for (xi, gi) in parts {
            // A fresh variable: the recomputed graph ends at it.
            let var = Var::from_tensor(&xi)?;
            let out = (self.f)(var.as_tensor())?;
            if out.shape() != gi.shape() || out.dtype() != gi.dtype() {
                candle_core::bail!(
                    "recompute: the segment gave {:?} {:?} when recomputed and {:?} {:?} in its forward; \
                     a checkpointed block must compute the same thing from the same input",
                    out.dims(),
                    out.dtype(),
                    gi.dims(),
                    gi.dtype()
                )
            }
            if !out.track_op() {
                input_grads.push(None);
                continue;
            }
            let mut sg = backward_from(&out, &gi)?;
            drop(out);
            input_grads.push(sg.remove(var.as_tensor()));
            // Slices' parameter gradients are summed in f32: in half, every partial sum
            // would round (the plain backward sums all positions inside one product).
            merge_grads(&mut params, sg, self.split.is_some())?;
        }
        // The input's gradient; slices without one (independent of their input) are zeros.
        let gx = match self.split {
            None => input_grads.pop().flatten(),
            Some(_) if input_grads.iter().all(Option::is_none) => None,
            Some((dim, size)) => {
                let filled = input_grads
                    .into_iter()
                    .zip(pieces(&x, dim, size)?)
                    .map(|(gi, xi)| gi.map_or_else(|| xi.zeros_like(), Ok))
                    .collect::<candle_core::Result<Vec<_>>>()?;
                Some(Tensor::cat(&filled, dim)?)
            }
        };
        Ok((gx, params))
    }
}

/// Gradient checkpointing (Chen et al. 2016) and chunked position-wise layers for one run:
/// segments of the forward that keep only their input, recomputed during the backward.
///
/// * [`checkpoint`](Self::checkpoint) runs a block keeping only its input;
///   [`checkpoint_sequential`](Self::checkpoint_sequential) runs a sequence of blocks in
///   segments, keeping only the segments' inputs (PyTorch's `checkpoint_sequential`: the
///   last segment runs normally); [`chunked_forward`](Self::chunked_forward) applies a
///   position-wise layer to slices of its input, recomputing each slice in the backward, so
///   only one slice's intermediates exist at a time.
/// * Each segment becomes one node of candle's graph. Its backward recomputes the segment
///   from its input (a fresh variable) under the autocast scopes and with the random
///   streams its first forward drew from (dropout) replayed from where that forward found
///   them, backpropagates the incoming
///   gradient through it, returns the input's gradient to the running backward and hands
///   the parameter gradients to the run, where the guard's stages (reduction, unscale and
///   overflow check) take them like any others: an overflow inside a segment skips the step
///   as usual. [`backward`](Self::backward) is the driver to give
///   [`ScaleLoss::backward_with`](crate::ScaleLoss::backward_with), or to call on
///   [`GradScaler::scale`](crate::GradScaler::scale)'s output: it returns every gradient,
///   the recomputed ones included. A plain `backward()` of the guard or of the scaled loss
///   given to `GradScaler` works too (the stages collect the recomputed gradients of the
///   optimizers they step).
///
/// Gradients equal the plain ones: bit for bit where the order of operations is unchanged
/// (each parameter used in one segment, as in a stack of blocks), up to rounding where
/// partial sums are added in another order (chunks, shared parameters). The gradients of
/// parameters used in a chunked layer are summed over the slices in f32 and reach the
/// stages in f32. The price is one more forward of every checkpointed segment.
///
/// Segments are recorded only when `train` is true: in evaluation the blocks run plainly.
/// Checkpoints inside a checkpointed segment run plainly. Randomness must come from the
/// run's generators ([`crate::Generator`], which `nn::Dropout` uses): candle's own random
/// ops cannot be replayed. The replay draws from a private copy of each stream the segment
/// drew from, seen only by the recomputing thread: the shared streams are never rewound, so
/// a loader drawing from `amp.generator("data")` on another thread during a backward gets
/// the draws it would get without checkpointing. Draws a segment makes on threads of its
/// own are not replayed. Batch norm inside a segment updates its running statistics once,
/// in the first forward. On devices other than the CPU and CUDA (feature `cuda`) the blocks
/// run without checkpointing (logged once).
///
/// ```
/// use candle_amp::{self as amp, recompute::Recompute, AmpConfig, LossScaleSpec, OptLevel};
/// use candle_core::{DType, Device, Tensor};
/// # fn main() -> anyhow::Result<()> {
/// let (model, mut opt, amp) = amp::initialize(
///     |vb| {
///         (0..4)
///             .map(|i| amp::nn::linear(8, 8, vb.pp(format!("l{i}"))))
///             .collect::<candle_core::Result<Vec<_>>>()
///     },
///     amp::optim::Sgd::new(amp::optim::SgdConfig::new(0.1))?,
///     AmpConfig::new(OptLevel::O2).loss_scale(LossScaleSpec::Static(128.0)),
/// )?;
/// let rc = Recompute::new(&amp);
/// let x = Tensor::ones((2, 8), DType::F16, &Device::Cpu)?;
/// // Four layers in two segments: the first keeps only its input, the last runs plainly.
/// let y = rc.checkpoint_sequential(model.inner(), 2, &x, true)?;
/// let loss = amp::ops::mse(&y.to_dtype(DType::F32)?, &x.to_dtype(DType::F32)?)?;
/// let report = amp.scale_loss(&loss, &mut opt)?.backward_with(|l| rc.backward(l))?;
/// assert!(!report.found_inf);
/// assert_eq!(opt.master_grads().len(), 8); // every weight and bias got its gradient
/// opt.step()?;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Recompute {
    run: Arc<RunState>,
}

impl std::fmt::Debug for Recompute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recompute").finish_non_exhaustive()
    }
}

static OFF_CPU: Once = Once::new();

impl Recompute {
    /// Checkpointing for `amp`'s run (clones are the same: give one to the model, keep one
    /// for the backward).
    pub fn new(amp: &Amp) -> Self {
        Self { run: amp.run().clone() }
    }

    /// Whether a call with `train` on `x` records a segment: in training, on the CPU (or CUDA), not
    /// inside another checkpointed segment.
    fn records(train: bool, x: &Tensor) -> bool {
        if !train || autocast::phase() != Phase::Normal {
            return false;
        }
        // On CUDA the node's forward copies the output on the device (`cuda_fwd`); the
        // recomputation is candle ops there.
        if !(x.device().is_cpu() || x.device().is_cuda()) {
            OFF_CPU.call_once(|| {
                log::warn!(
                    "candle-amp: gradient checkpointing runs on the CPU and CUDA (feature `cuda`) only; blocks on other devices run plainly"
                )
            });
            return false;
        }
        true
    }

    /// Runs `block` on `x` keeping only `x` for the backward (PyTorch's `checkpoint`). With
    /// `train` false, or inside another checkpointed segment, it is `block.forward_t(x,
    /// train)`.
    pub fn checkpoint<M>(&self, block: &M, x: &Tensor, train: bool) -> Result<Tensor>
    where
        M: ModuleT + Clone + Send + Sync + 'static,
    {
        if !Self::records(train, x) {
            return Ok(block.forward_t(x, train)?);
        }
        let block = block.clone();
        self.record(Arc::new(move |x: &Tensor| block.forward_t(x, true)), x, None)
    }

    /// Runs the function `f` on `x` keeping only `x` (see [`checkpoint`](Self::checkpoint)).
    /// `f` runs again in the backward, so it must compute the same thing from the same input
    /// (randomness from the run's generators only).
    pub fn checkpoint_fn<F>(&self, f: F, x: &Tensor, train: bool) -> Result<Tensor>
    where
        F: Fn(&Tensor) -> candle_core::Result<Tensor> + Send + Sync + 'static,
    {
        if !Self::records(train, x) {
            return Ok(f(x)?);
        }
        self.record(Arc::new(f), x, None)
    }

    /// Runs `blocks` one after the other on `x` in `segments` segments of
    /// `blocks.len() / segments` blocks (PyTorch's `checkpoint_sequential`): every segment
    /// but the last keeps only its input; the last, which takes the remainder, runs
    /// normally since the backward needs its activations at once. Activation memory falls
    /// from all blocks' to about `segments` inputs plus one segment's.
    ///
    /// `segments` must be between 1 (no checkpoint) and `blocks.len()`, else
    /// [`AmpError::InvalidArgument`].
    pub fn checkpoint_sequential<M>(&self, blocks: &[M], segments: usize, x: &Tensor, train: bool) -> Result<Tensor>
    where
        M: ModuleT + Clone + Send + Sync + 'static,
    {
        if segments == 0 || segments > blocks.len().max(1) {
            return Err(AmpError::InvalidArgument {
                argument: "segments",
                reason: format!(
                    "{segments} segments for {} blocks: use 1 to {}",
                    blocks.len(),
                    blocks.len().max(1)
                ),
            });
        }
        let size = blocks.len() / segments;
        let plain_from = size * (segments - 1);
        let mut x = x.clone();
        if Self::records(train, &x) {
            for start in (0..plain_from).step_by(size.max(1)) {
                let seg: Vec<M> = blocks[start..start + size].to_vec();
                x = self.record(
                    Arc::new(move |x: &Tensor| {
                        let mut x = x.clone();
                        for b in &seg {
                            x = b.forward_t(&x, true)?;
                        }
                        Ok(x)
                    }),
                    &x,
                    None,
                )?;
            }
        } else {
            for b in &blocks[..plain_from] {
                x = b.forward_t(&x, train)?;
            }
        }
        for b in &blocks[plain_from..] {
            x = b.forward_t(&x, train)?;
        }
        Ok(x)
    }

    /// Applies `module` to slices of `x` of `chunk_size` along `dim` and concatenates the
    /// results (the Reformer's chunked feed-forward). In training it keeps only `x` and
    /// recomputes one slice at a time in the backward, so only one slice's intermediates
    /// exist at once; in evaluation (`train` false) it is
    /// [`chunked_forward`](super::chunked_forward) (outside the graph). `module` must be
    /// position-wise along `dim` (each output slice depends only on its input slice), or
    /// the result is not `module`'s.
    pub fn chunked_forward<M>(
        &self,
        module: &M,
        chunk_size: usize,
        dim: usize,
        x: &Tensor,
        train: bool,
    ) -> Result<Tensor>
    where
        M: ModuleT + Clone + Send + Sync + 'static,
    {
        check_chunking(x, chunk_size, dim)?;
        if !Self::records(train, x) {
            return Ok(if train {
                // Inside a checkpointed segment (or off the CPU): slices in the graph.
                map_slices(x, dim, chunk_size, |p| module.forward_t(p, true))?
            } else {
                map_slices_detached(x, dim, chunk_size, |p| module.forward_t(p, false))?
            });
        }
        let module = module.clone();
        self.record(
            Arc::new(move |x: &Tensor| module.forward_t(x, true)),
            x,
            Some((dim, chunk_size)),
        )
    }

    /// The first forward of a segment: runs it on a detached input (its graph is dropped
    /// as soon as it returns) and puts one node in the caller's graph in its place.
    fn record(&self, f: SegmentFn, x: &Tensor, split: Option<(usize, usize)>) -> Result<Tensor> {
        let scopes = autocast::open_scopes();
        // Whether the segment's output depends on a variable (its parameters).
        let tracked = std::cell::Cell::new(false);
        let (out, rng) = recording_draws(|| {
            let _phase = autocast::enter_phase(Phase::SegmentForward);
            let run = |p: &Tensor| {
                let o = f(p)?;
                tracked.set(tracked.get() || o.track_op());
                Ok(o)
            };
            match split {
                None => run(&x.detach()),
                // Each slice's graph is dropped before the next slice runs.
                Some((dim, size)) => map_slices_detached(x, dim, size, run),
            }
        });
        let out = out?;
        if !tracked.get() && !x.track_op() {
            // Nothing in the segment needs a gradient: nothing to recompute.
            return Ok(out);
        }
        // The node hangs off the input; an input outside any graph (data) gets a variable
        // of its own so that the node is part of the graph.
        let anchor = if x.track_op() {
            x.clone()
        } else {
            Var::from_tensor(x)?.as_tensor().clone()
        };
        let node = Boundary {
            rec: Recording {
                run: self.run.clone(),
                f,
                split,
                scopes,
                rng,
            },
            out: Mutex::new(Some(out.detach())),
        };
        drop(out);
        Ok(anchor.apply_op1(node)?)
    }

    /// The backward driver: the gradients of `loss` (a scalar; with the guard, the scaled
    /// loss it passes) for every variable, those of the checkpointed segments included
    /// (recomputed as the backward reaches them). Use it as
    /// `guard.backward_with(|l| rc.backward(l))`, or `rc.backward(&scaler.scale(&loss)?)`
    /// with [`GradScaler`](crate::GradScaler).
    pub fn backward(&self, loss: &Tensor) -> candle_core::Result<GradStore> {
        // Marked, so that exactly this backward's stashed gradients join its store (a
        // scaled loss's own marker, inside, names the same backward).
        let mut grads = crate::precision::stash::mark(loss)?.backward()?;
        let stashed = self.run.stash().take(&grads, None)?;
        merge_grads(&mut grads, stashed, false)?;
        Ok(grads)
    }
}
