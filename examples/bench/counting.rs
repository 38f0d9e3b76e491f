//! The bench's global allocator: `std::alloc::System` with counters, so memory figures are
//! the bytes the program asked for (independent of how the C allocator pools them).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, AtomicU64, Ordering};

struct Counting;

/// Bytes allocated and not yet freed.
static LIVE: AtomicIsize = AtomicIsize::new(0);
/// The highest `LIVE` since the last [`reset_peak`].
static PEAK: AtomicIsize = AtomicIsize::new(0);
/// Bytes ever allocated (a realloc counts its new size): the allocation traffic of a step
/// is the difference across it, whatever was freed in between.
static TOTAL: AtomicU64 = AtomicU64::new(0);
/// Allocations of alignment 4 or less ever made: the storage vectors of candle's f32, f16,
/// bf16, u32 and u8 tensors (shapes, strides and `Arc`s are 8-aligned). On the CPU every op
/// writes its output into a fresh one, as each op on CUDA launches a kernel that writes a
/// fresh buffer, so the count across a step estimates the step's kernel launches.
static BUFFERS: AtomicU64 = AtomicU64::new(0);

fn count_buffer(l: Layout) {
    if l.align() <= 4 && l.size() > 0 {
        BUFFERS.fetch_add(1, Ordering::Relaxed);
    }
}

fn add(n: isize) {
    let now = LIVE.fetch_add(n, Ordering::Relaxed) + n;
    PEAK.fetch_max(now, Ordering::Relaxed);
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        count_buffer(l);
        add(l.size() as isize);
        TOTAL.fetch_add(l.size() as u64, Ordering::Relaxed);
        unsafe { System.alloc(l) }
    }
    // Forwarded rather than left to the default (alloc, then write zeros), so zeroed buffers
    // cost what they cost without this allocator (calloc can hand out fresh zero pages).
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        count_buffer(l);
        add(l.size() as isize);
        TOTAL.fetch_add(l.size() as u64, Ordering::Relaxed);
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        add(-(l.size() as isize));
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        add(new as isize - l.size() as isize);
        TOTAL.fetch_add(new as u64, Ordering::Relaxed);
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static A: Counting = Counting;

/// Bytes held now.
pub fn live() -> isize {
    LIVE.load(Ordering::Relaxed)
}

/// Starts a peak measurement from what is held now; returns that level.
pub fn reset_peak() -> isize {
    let now = live();
    PEAK.store(now, Ordering::Relaxed);
    now
}

/// The highest level held since the last [`reset_peak`].
pub fn peak() -> isize {
    PEAK.load(Ordering::Relaxed)
}

/// Bytes allocated since the start of the process.
pub fn allocated() -> u64 {
    TOTAL.load(Ordering::Relaxed)
}

/// Buffers of alignment 4 or less allocated since the start of the process (see `BUFFERS`).
pub fn buffers() -> u64 {
    BUFFERS.load(Ordering::Relaxed)
}
