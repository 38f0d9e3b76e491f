//! What precision each tensor has.
//!
//! * [`opt_level`]: the opt levels as a table of data, the user's overrides
//!   ([`crate::AmpConfig`]) and the resolved [`crate::Properties`] every other module reads;
//! * [`store`]: the parameter store, which builds each parameter in the type the properties
//!   ask for and keeps f32 masters at O2;
//! * [`cast_lists`] and [`autocast`]: O1's per-op casting, a thread-local policy with Apex's
//!   cast lists as data; [`cast_cache`]: its cache of parameter casts;
//! * [`ops`]: tensor operations that consult that policy;
//! * [`model`]: the model wrapper that casts inputs and outputs.
//!
//! This floor depends on [`crate::error`], [`crate::scaling`] (the loss-scale settings are
//! properties) and [`crate::kernels`] only.

pub mod autocast;
pub(crate) mod cast_cache;
pub(crate) mod cast_lists;
pub(crate) mod empty;
pub(crate) mod fused;
pub(crate) mod model;
pub(crate) mod observe;
pub mod ops;
pub(crate) mod opt_level;
pub(crate) mod recording;
pub(crate) mod stash;
pub(crate) mod store;
