//! f32 working buffers reused across calls on a thread.
//!
//! A product over half operands accumulates in f32 and then rounds into the half result;
//! the f32 buffer lives for one call. Allocated fresh each time, a buffer of a few MiB is
//! mapped by glibc, faulted in and zeroed by the kernel page by page, and unmapped again on
//! free: measured on an AMD Zen 4, that paging was 4-19% of a transformer step. Kept here,
//! such a buffer is paged in once per thread. It is held until the thread ends, at the
//! size of the largest request (so memory does not grow with the step count).

use std::cell::RefCell;

/// At most this many buffers are kept per thread (a call nests at most two).
const KEEP: usize = 4;

thread_local! {
    static POOL: RefCell<Vec<Vec<f32>>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on a buffer of `len` f32 values of this thread's pool. The values are
/// arbitrary (left from an earlier use): `f` must write every value it reads.
pub(crate) fn with_f32<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    let mut buf = POOL.with(|p| p.borrow_mut().pop()).unwrap_or_default();
    if buf.len() < len {
        // Grown, not cleared: the contents are documented as arbitrary.
        buf.resize(len, 0.0);
    }
    let r = f(&mut buf[..len]);
    POOL.with(|p| {
        let mut p = p.borrow_mut();
        if p.len() < KEEP {
            p.push(buf);
        }
    });
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_calls_get_distinct_buffers_of_the_asked_length() {
        with_f32(8, |a| {
            a.fill(1.0);
            with_f32(3, |b| {
                assert_eq!(b.len(), 3);
                b.fill(2.0);
            });
            assert!(a.iter().all(|&v| v == 1.0), "the inner buffer is another one");
        });
        // Reused: the same allocation serves a later call.
        let p1 = with_f32(16, |a| a.as_ptr() as usize);
        let p2 = with_f32(16, |a| a.as_ptr() as usize);
        assert_eq!(p1, p2);
    }
}
