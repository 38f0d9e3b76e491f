//! A counting global allocator for the memory tests: the bytes the whole process holds.
//! A test binary installs it with
//! `#[global_allocator] static A: counting::Counting = counting::Counting;` and should hold
//! that one test only (the counter sees every thread).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

/// The system allocator, counting.
pub struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

/// Bytes allocated and not yet freed, by every thread of the process.
pub fn live() -> isize {
    LIVE.load(Ordering::SeqCst)
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE.fetch_add(new as isize - l.size() as isize, Ordering::Relaxed);
        unsafe { System.realloc(p, l, new) }
    }
}
