//! Data-parallel training across processes: one process per device, each with the whole
//! model and a shard of every batch, gradients averaged once per step (PyTorch's
//! `DistributedDataParallel` with `DistributedSampler` and `SyncBatchNorm`).
//!
//! * [`Communicator`]: what a process group provides; `MpiComm` (feature `mpi`, launched
//!   with `mpirun -np N`), `NcclComm` (feature `nccl`, CUDA; compiled and linted in CI,
//!   never run on a GPU yet) and [`LocalGroup`] (threads of one process: the test double);
//! * [`DataParallel`]: checks that every rank runs the same model, copies rank 0's weights
//!   to every rank, averages the accumulated f32 gradients once per optimizer step in
//!   buckets, combines overflow flags so every rank skips the same steps, and switches
//!   synchronised batch norm on; with [`Sharding`] each rank keeps and steps a shard of the
//!   f32 master weights and optimizer state (ZeRO stage 1, and stage 2 which also
//!   reduce-scatters the gradients);
//! * [`DistributedSampler`]: disjoint per-rank shards, reshuffled per epoch from a shared
//!   seed.
//!
//! `examples/ddp` trains the digits MLP this way; `docs/distributed.md` shows how
//! to launch it on one machine and on several.

mod counted;
mod ddp;
#[cfg(feature = "mpi")]
mod mpi;
#[cfg(feature = "nccl")]
mod nccl;
mod overlap;
mod sampler;
mod zero;

pub use crate::comm::{Communicator, DEFAULT_TIMEOUT, LocalComm, LocalGroup};
pub use crate::train::reduce::{StepGrads, StepReducer};
pub use ddp::{DataParallel, DataParallelConfig, NoSync};
#[cfg(feature = "mpi")]
pub use mpi::MpiComm;
#[cfg(feature = "nccl")]
pub use nccl::{NcclComm, NcclId};
pub use sampler::DistributedSampler;
pub use zero::Sharding;
