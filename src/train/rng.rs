//! Seeded random generators owned by a run.
//!
//! candle's CPU generator cannot be seeded, so everything random that a run depends on
//! (parameter initialisation, data order, dropout masks) draws from generators that the run
//! owns and checkpoints. Each is a ChaCha8 stream derived from the run's seed and the
//! generator's name, so adding a generator never changes another's stream.

use std::sync::{Arc, Mutex, MutexGuard};

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// A named, shared, seeded generator. Clones share the stream.
#[derive(Clone, Debug)]
pub struct Generator {
    name: String,
    rng: Arc<Mutex<ChaCha8Rng>>,
}

/// FNV-1a, to turn a generator's name into part of its seed.
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

impl Generator {
    /// The generator called `name` in a run seeded with `seed`.
    pub(crate) fn new(seed: u64, name: &str) -> Self {
        Self {
            name: name.to_string(),
            rng: Arc::new(Mutex::new(ChaCha8Rng::seed_from_u64(seed ^ fnv1a(name)))),
        }
    }

    /// The generator's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Locks the stream for drawing.
    pub fn lock(&self) -> MutexGuard<'_, ChaCha8Rng> {
        self.rng.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A copy of the stream's state (for checkpoints, or to replay the same draws).
    pub fn snapshot(&self) -> ChaCha8Rng {
        self.lock().clone()
    }

    /// Replaces the stream's state.
    pub fn restore(&self, state: ChaCha8Rng) {
        *self.lock() = state;
    }
}
