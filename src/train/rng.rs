//! Seeded random generators owned by a run.
//!
//! candle's CPU generator cannot be seeded, so everything random that a run depends on
//! (parameter initialisation, data order, dropout masks) draws from generators that the run
//! owns and checkpoints. Each is a ChaCha8 stream derived from the run's seed and the
//! generator's name, so adding a generator never changes another's stream.
//!
//! Gradient checkpointing replays a segment's draws: while a segment's first forward runs,
//! [`recording_draws`] notes each stream it draws from with its state before the first draw;
//! while the backward recomputes the segment, [`replaying`] gives the recomputing thread a
//! private copy of each of those streams, seen by no other thread. A loader drawing from
//! another stream, or from the same one on another thread, never sees a rewound state.

use std::cell::RefCell;
use std::ops::{Deref, DerefMut};
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

/// The streams a segment's first forward drew from, each with its state before its first
/// draw (clones of the generators, so a stream is recognised by identity, not by name: two
/// runs may both have a "dropout").
#[derive(Debug, Default)]
pub(crate) struct DrawLog(Vec<(Generator, ChaCha8Rng)>);

/// A private copy of a stream during a replay; `None` while a guard has it out. Boxed so
/// that a guard moves a pointer, not the generator's block buffer.
type ReplaySlot = (Generator, Option<Box<ChaCha8Rng>>);

thread_local! {
    /// The draws being recorded on this thread, while a segment's first forward runs.
    static RECORDING: RefCell<Option<DrawLog>> = const { RefCell::new(None) };
    /// The private copies a recomputation on this thread draws from.
    static REPLAY: RefCell<Option<Vec<ReplaySlot>>> = const { RefCell::new(None) };
}

/// What [`Generator::lock`] gives: the shared stream, locked, or (on a thread recomputing a
/// checkpointed segment that drew from this stream) the thread's private copy, which goes
/// back to the replay when the guard is dropped. Dereferences to the stream.
pub struct GeneratorGuard<'a> {
    inner: GuardInner<'a>,
}

enum GuardInner<'a> {
    Shared(MutexGuard<'a, ChaCha8Rng>),
    /// The private copy (always `Some` until the guard is dropped) and its stream.
    Replay(&'a Generator, Option<Box<ChaCha8Rng>>),
}

impl Deref for GeneratorGuard<'_> {
    type Target = ChaCha8Rng;

    fn deref(&self) -> &ChaCha8Rng {
        match &self.inner {
            GuardInner::Shared(g) => g,
            GuardInner::Replay(_, rng) => rng.as_ref().expect("held until the guard drops"),
        }
    }
}

impl DerefMut for GeneratorGuard<'_> {
    fn deref_mut(&mut self) -> &mut ChaCha8Rng {
        match &mut self.inner {
            GuardInner::Shared(g) => g,
            GuardInner::Replay(_, rng) => rng.as_mut().expect("held until the guard drops"),
        }
    }
}

impl Drop for GeneratorGuard<'_> {
    fn drop(&mut self) {
        if let GuardInner::Replay(g, rng) = &mut self.inner {
            let rng = rng.take();
            REPLAY.with_borrow_mut(|slots| {
                if let Some(slot) = slots.iter_mut().flatten().find(|(s, _)| s.same_stream(g)) {
                    slot.1 = rng;
                }
            });
        }
    }
}

impl std::fmt::Debug for GeneratorGuard<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let private = matches!(self.inner, GuardInner::Replay(..));
        f.debug_struct("GeneratorGuard").field("replay", &private).finish()
    }
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

    /// Whether two handles share one stream.
    fn same_stream(&self, other: &Generator) -> bool {
        Arc::ptr_eq(&self.rng, &other.rng)
    }

    fn shared(&self) -> MutexGuard<'_, ChaCha8Rng> {
        self.rng.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Locks the stream for drawing. On a thread that is recomputing a checkpointed segment
    /// which drew from this stream, it is the thread's private replay of the segment's
    /// draws instead; other threads keep drawing from the shared stream meanwhile.
    pub fn lock(&self) -> GeneratorGuard<'_> {
        if let Some(rng) = self.take_replay() {
            return GeneratorGuard {
                inner: GuardInner::Replay(self, Some(rng)),
            };
        }
        let guard = self.shared();
        self.note_first_draw(&guard);
        GeneratorGuard {
            inner: GuardInner::Shared(guard),
        }
    }

    /// This thread's private copy of the stream, if it is replaying it. A copy already out
    /// (the stream locked twice at once, which deadlocks on the shared stream) is not given
    /// twice: the second lock gets the shared stream.
    fn take_replay(&self) -> Option<Box<ChaCha8Rng>> {
        REPLAY.with_borrow_mut(|slots| {
            slots
                .iter_mut()
                .flatten()
                .find(|(g, _)| g.same_stream(self))
                .and_then(|(_, rng)| rng.take())
        })
    }

    /// While this thread records a segment's forward: the stream's state before its first
    /// draw there (taken under the stream's lock, so it is the state the draws start from).
    fn note_first_draw(&self, state: &ChaCha8Rng) {
        RECORDING.with_borrow_mut(|log| {
            if let Some(DrawLog(streams)) = log
                && !streams.iter().any(|(g, _)| g.same_stream(self))
            {
                streams.push((self.clone(), state.clone()));
            }
        });
    }

    /// A copy of the stream's state (for checkpoints, or to replay the same draws).
    pub fn snapshot(&self) -> ChaCha8Rng {
        self.shared().clone()
    }

    /// Replaces the stream's state.
    pub fn restore(&self, state: ChaCha8Rng) {
        *self.shared() = state;
    }
}

/// Puts a thread-local back as it was when dropped (also when `f` panics or fails).
struct Reinstate<T: 'static> {
    key: &'static std::thread::LocalKey<RefCell<Option<T>>>,
    previous: Option<Option<T>>,
}

impl<T: 'static> Reinstate<T> {
    /// Sets `key` to `value`, keeping what it held.
    fn set(key: &'static std::thread::LocalKey<RefCell<Option<T>>>, value: T) -> Self {
        let previous = key.with_borrow_mut(|v| v.replace(value));
        Self {
            key,
            previous: Some(previous),
        }
    }

    /// What `key` holds now, and the previous value back in it.
    fn finish(mut self) -> Option<T> {
        let previous = self.previous.take().flatten();
        self.key.with_borrow_mut(|v| std::mem::replace(v, previous))
    }
}

impl<T: 'static> Drop for Reinstate<T> {
    fn drop(&mut self) {
        if let Some(previous) = self.previous.take() {
            self.key.with_borrow_mut(|v| *v = previous);
        }
    }
}

/// Runs `f` (a segment's first forward) on this thread and returns what it returns with the
/// streams it drew from on this thread, each at its state before its first draw.
pub(crate) fn recording_draws<T>(f: impl FnOnce() -> T) -> (T, DrawLog) {
    let recording = Reinstate::set(&RECORDING, DrawLog::default());
    let out = f();
    (out, recording.finish().unwrap_or_default())
}

/// Runs `f` (a segment's recomputation) with a private copy of each stream in `log`, at its
/// logged state, that only this thread draws from; the shared streams are never touched.
/// Streams the log does not hold are drawn from as usual.
pub(crate) fn replaying<T>(log: &DrawLog, f: impl FnOnce() -> T) -> T {
    let slots = log
        .0
        .iter()
        .map(|(g, s)| (g.clone(), Some(Box::new(s.clone()))))
        .collect();
    let _replay = Reinstate::set(&REPLAY, slots);
    f()
}

#[cfg(test)]
mod tests {
    use rand::Rng;

    use super::*;

    #[test]
    fn a_replay_repeats_the_recorded_draws_on_its_thread_only() {
        let (used, other) = (Generator::new(1, "dropout"), Generator::new(1, "data"));
        let (first, log) = recording_draws(|| used.lock().random::<u64>());
        assert_eq!(log.0.len(), 1, "only the stream drawn from is logged");
        let after = used.snapshot();
        let (again, elsewhere) = replaying(&log, || {
            let again = used.lock().random::<u64>();
            let used = used.clone();
            let elsewhere = std::thread::spawn(move || used.snapshot()).join().unwrap();
            (again, elsewhere)
        });
        assert_eq!(again, first, "the replay repeats the draw");
        assert_eq!(elsewhere, after, "other threads never see the rewound state");
        assert_eq!(used.snapshot(), after, "the shared stream was not touched");
        assert_eq!(other.snapshot(), Generator::new(1, "data").snapshot());
    }
}
