//! Switching communication overlap on and off, and `no_sync`.

use std::sync::Arc;

use candle_core::Var;
use candle_core::backprop::GradStore;

use super::{DataParallel, lock};
use crate::amp::Amp;
use crate::comm::Communicator;
use crate::error::{AmpError, DistErrorKind, Result};
use crate::train::reduce::BackwardStart;

use super::super::overlap::Overlap;
use super::super::overlap::thread::Serial;

/// A scope in which backwards send nothing (PyTorch's `DistributedDataParallel.no_sync`):
/// made by [`DataParallel::no_sync`], ends when dropped.
#[derive(Debug)]
#[must_use = "backwards send nothing only while the guard lives"]
pub struct NoSync<'a> {
    ddp: &'a DataParallel,
    overlap: Option<Arc<Overlap>>,
}

impl Drop for NoSync<'_> {
    fn drop(&mut self) {
        if let Some(o) = &self.overlap {
            o.leave_no_sync();
        }
        let _ = self.ddp;
    }
}

impl DataParallel {
    /// Switches communication overlap on (or off), on every rank (call it on every rank
    /// with the same `on`; ranks that disagree all fail with [`DistErrorKind::Mismatch`]).
    ///
    /// With overlap on, each backward through the `scale_loss` guard sends the gradients to
    /// the other ranks while it runs, as PyTorch's `DistributedDataParallel` does: the
    /// library's layers (`nn::linear`, `nn::mlp`, self-attention) hand over each parameter's
    /// f32 gradient as their backward finishes; once a bucket's parameters are all complete
    /// its all-reduce starts on a communication thread; parameters on candle's own path
    /// (batch norm, embeddings, a user's raw tensor maths) go when candle's backward returns.
    /// Buckets follow the order the gradients became ready in the first backward (which is
    /// reduced at the step, as without overlap, while the order is learned; rank 0's order
    /// is then used everywhere): a first bucket of at most 1 MiB, then buckets of
    /// [`DataParallelConfig::bucket_bytes`](super::DataParallelConfig::bucket_bytes). The
    /// step then only waits for what is still on its way.
    ///
    /// What the step applies does not change: each bucket carries the rank's share of its
    /// whole accumulated master gradient (`(master so far + unscaled gradient) / world`, the
    /// same arithmetic as the step's reduction, so the averages are the same bits), the
    /// averages are checked for inf/NaN as the step copies them out, and the overflow flags
    /// are agreed once per step. A step whose buckets do not hold every rank's whole step
    /// (the last backward ran under [`no_sync`](Self::no_sync) or through `GradScaler`, a
    /// gradient arrived after its bucket left because the graph changed, the backward failed)
    /// is reduced as without overlap on every rank, and a changed graph is learned again.
    ///
    /// Gradient accumulation: wrap the backwards of every micro-batch but the last in
    /// [`no_sync`](Self::no_sync) (PyTorch's pattern); without it each backward sends its
    /// buckets (correct, only more traffic). Costs: one f32 copy of the trained gradients
    /// per rank (the buckets), allocated once, and a thread.
    /// Refused with [`AmpError::InvalidArgument`], on every rank, under ZeRO stage 2 (its
    /// gradients are reduce-scattered at the step) and on the device path. While on,
    /// synchronised batch norm's sums, [`barrier`](Self::barrier),
    /// [`broadcast_buffers`](Self::broadcast_buffers) and
    /// [`save_checkpoint`](Self::save_checkpoint) take their turn on the same thread, so
    /// every rank runs its collectives in the same order; with synchronised batch norm on,
    /// the buckets leave when candle's backward returns rather than during it (its sums in
    /// the backward would otherwise fall between buckets at different places on ranks whose
    /// gradients become ready in different orders). Collectives of your own on the
    /// [`communicator`](Self::communicator) belong between a step and the next backward
    /// (where no bucket is on its way).
    pub fn set_overlap(&self, amp: &Amp, on: bool) -> Result<()> {
        // Refusals are agreed too, so that no rank goes on while another stopped.
        let stage2 = self.sharding == super::Sharding::Stage2;
        let device = amp.run().device_path();
        let refused = on && (stage2 || device);
        let flag = |b: bool| if b { 1.0f32 } else { 0.0 };
        let mut agree = [flag(on), flag(refused)];
        self.collective_comm().all_reduce_sum(&mut agree)?;
        if agree[0] != 0.0 && agree[0] != self.comm.world_size() as f32 {
            return Err(self.err(
                DistErrorKind::Mismatch,
                format!(
                    "set_overlap({on}) here but {} of {} ranks switched it on: call it on every rank with the same value",
                    agree[0],
                    self.comm.world_size()
                ),
            ));
        }
        if agree[1] > 0.0 {
            let reason = if stage2 {
                "ZeRO stage 2 reduce-scatters the gradients at the step, which does not overlap the backward: use \
                 Sharding::Stage1 (all-reduce, overlapped) or no overlap"
            } else if device {
                "the device path reduces device tensors at the step (NCCL enqueues them on the device): overlap is \
                 for the host path"
            } else {
                "another rank cannot overlap (ZeRO stage 2 or the device path there)"
            };
            return Err(AmpError::InvalidArgument {
                argument: "on",
                reason: reason.into(),
            });
        }
        let mut slot = lock(&self.overlap);
        match (on, slot.is_some()) {
            (true, false) => {
                let o = Arc::new(Overlap::start(self.comm.clone(), self.config.bucket_bytes)?);
                amp.run().stash().set_hook(Some(o.clone()));
                *slot = Some(o);
            }
            (false, true) => {
                amp.run().stash().set_hook(None);
                if let Some(o) = slot.take() {
                    // Takes the buckets still on their way back before the thread ends.
                    o.step_flags(&[])?;
                }
            }
            _ => {}
        }
        drop(slot);
        if self.sync_bn.load(std::sync::atomic::Ordering::SeqCst) {
            self.install_sync_bn(amp, true);
        }
        Ok(())
    }

    /// Whether communication overlap is on ([`set_overlap`](Self::set_overlap)).
    pub fn overlaps(&self) -> bool {
        lock(&self.overlap).is_some()
    }

    /// A scope whose backwards send nothing (PyTorch's `no_sync`): with overlap on, wrap
    /// the backwards of every micro-batch but the last of a step in it, on every rank; the
    /// last backward then sends the whole accumulated gradient. Without overlap it changes
    /// nothing: the gradients are reduced once per step anyway.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use candle_amp::distributed::{Communicator, DataParallel, LocalGroup};
    /// # use candle_amp::{self as amp, OptLevel};
    /// # fn main() -> anyhow::Result<()> {
    /// # let comm: Arc<dyn Communicator> = Arc::new(LocalGroup::new(1).remove(0));
    /// # let (model, mut opt, amp) = amp::initialize(
    /// #     |vb| amp::nn::linear(4, 1, vb.pp("fc")),
    /// #     amp::optim::Sgd::new(amp::optim::SgdConfig::new(0.1))?,
    /// #     OptLevel::O2,
    /// # )?;
    /// let ddp = DataParallel::new(&amp, comm, Default::default())?;
    /// ddp.set_overlap(&amp, true)?;
    /// let x = candle_core::Tensor::ones((4, 4), candle_core::DType::F32, &candle_core::Device::Cpu)?;
    /// for step in 0..3 {
    ///     {
    ///         let _local = ddp.no_sync(); // the first micro-batch stays local
    ///         let loss = amp::ops::mse(&model.forward(&x.narrow(0, 0, 2)?)?, &x.narrow(0, 0, 2)?.narrow(1, 0, 1)?)?;
    ///         amp.scale_loss(&loss, &mut opt)?.backward()?;
    ///     }
    ///     // The last one sends the accumulated gradients while its backward runs.
    ///     let loss = amp::ops::mse(&model.forward(&x.narrow(0, 2, 2)?)?, &x.narrow(0, 2, 2)?.narrow(1, 0, 1)?)?;
    ///     amp.scale_loss(&loss, &mut opt)?.backward()?;
    ///     opt.step()?;
    ///     opt.zero_grad();
    /// }
    /// // The first step learned the order; the next two sent their buckets during the backward.
    /// assert_eq!(ddp.overlapped_steps(), 2);
    /// # Ok(()) }
    /// ```
    pub fn no_sync(&self) -> NoSync<'_> {
        let overlap = lock(&self.overlap).clone();
        if let Some(o) = &overlap {
            o.enter_no_sync();
        }
        NoSync { ddp: self, overlap }
    }

    /// Steps whose reduction used the buckets sent during the backward (with overlap on).
    pub fn overlapped_steps(&self) -> u64 {
        lock(&self.stats).overlapped
    }

    /// Buckets whose all-reduce started while candle's backward was still running (with
    /// overlap on; the others left when it returned).
    pub fn early_buckets(&self) -> u64 {
        lock(&self.overlap).as_ref().map_or(0, |o| o.early_buckets())
    }

    /// The buckets of the overlap's plan (0 before the first step with overlap on).
    pub fn overlap_buckets(&self) -> usize {
        lock(&self.overlap).as_ref().map_or(0, |o| o.buckets())
    }

    /// The communicator for calls that must take their turn with the buckets: the
    /// communication thread's while overlap is on.
    pub(super) fn collective_comm(&self) -> Arc<dyn Communicator> {
        match lock(&self.overlap).as_ref() {
            Some(o) => Arc::new(Serial(o.thread().clone())),
            None => self.comm.clone(),
        }
    }

    pub(super) fn overlap(&self) -> Option<Arc<Overlap>> {
        lock(&self.overlap).clone()
    }

    pub(super) fn begin_overlap(&self, start: BackwardStart<'_>) -> Result<()> {
        let Some(o) = self.overlap() else { return Ok(()) };
        let host = self.run.upgrade().is_some_and(|r| !r.device_path());
        o.begin(&start, host)
    }

    pub(super) fn flush_overlap(&self, grads: &GradStore, params: &[(String, Var)]) -> Result<()> {
        match self.overlap() {
            Some(o) => o.flush(grads, params),
            None => Ok(()),
        }
    }

    pub(super) fn end_overlap(&self, committed: bool) {
        if let Some(o) = self.overlap() {
            o.end(committed);
        }
    }
}
