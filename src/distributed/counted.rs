//! A communicator that counts the host reads of its tensor sums in a run's
//! [`crate::Amp::host_syncs`]: what synchronised batch norm reduces over, so the layer (which
//! knows no run) needs no counter of its own.

use std::sync::{Arc, Weak};

use candle_core::Tensor;

use crate::comm::Communicator;
use crate::error::Result;
use crate::train::run::RunState;

/// `inner`, with one host read counted in `run` per
/// [`all_reduce_sum_tensor`](Communicator::all_reduce_sum_tensor) when `inner` does not
/// reduce in device memory (the default implementation reads the tensor on the host once).
#[derive(Debug)]
pub(crate) struct Counted {
    inner: Arc<dyn Communicator>,
    /// Weak: the run holds this communicator (through its cast context).
    run: Weak<RunState>,
}

impl Counted {
    pub(crate) fn new(inner: Arc<dyn Communicator>, run: Weak<RunState>) -> Self {
        Self { inner, run }
    }
}

impl Communicator for Counted {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        self.inner.all_reduce_sum(buf)
    }

    fn all_reduce_sum_buckets(&self, bufs: &mut [&mut [f32]]) -> Result<()> {
        self.inner.all_reduce_sum_buckets(bufs)
    }

    fn all_reduce_sum_tensor(&self, t: &Tensor) -> Result<Tensor> {
        let sum = self.inner.all_reduce_sum_tensor(t)?;
        if !self.inner.reduces_in_device_memory()
            && let Some(run) = self.run.upgrade()
        {
            run.count_host_sync();
        }
        Ok(sum)
    }

    fn reduces_in_device_memory(&self) -> bool {
        self.inner.reduces_in_device_memory()
    }

    fn broadcast(&self, buf: &mut [f32], root: usize) -> Result<()> {
        self.inner.broadcast(buf, root)
    }

    fn broadcast_bytes(&self, buf: &mut Vec<u8>, root: usize) -> Result<()> {
        self.inner.broadcast_bytes(buf, root)
    }

    fn barrier(&self) -> Result<()> {
        self.inner.barrier()
    }

    fn reduce_scatter_sum(&self, send: &[f32], recv: &mut [f32]) -> Result<()> {
        self.inner.reduce_scatter_sum(send, recv)
    }

    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8]) -> Result<()> {
        self.inner.all_gather_bytes(send, recv)
    }
}
