//! The strided matrix view the products take: transposed and batched operands need no copy.

use super::simd::Elem;
use super::slices::{Vx, convert};

/// A strided matrix view: element `(i, j)` is `data[off + i*rs + j*cs]`.
#[derive(Clone, Copy)]
pub(crate) struct Mat<'a, T> {
    pub data: &'a [T],
    pub off: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a, T: Copy> Mat<'a, T> {
    #[inline(always)]
    pub(crate) fn at(&self, i: usize, j: usize) -> T {
        self.data[self.off + i * self.rs + j * self.cs]
    }

    /// Writes the view into `out` (`rows * cols` values) as row-major f32.
    pub(crate) fn widen_into(&self, rows: usize, cols: usize, out: &mut [f32])
    where
        T: Elem + Vx,
    {
        debug_assert_eq!(out.len(), rows * cols);
        if self.cs == 1 && (self.rs == cols || rows == 1) {
            convert(&self.data[self.off..self.off + rows * cols], out);
        } else if self.cs == 1 {
            for i in 0..rows {
                let s = self.off + i * self.rs;
                convert(&self.data[s..s + cols], &mut out[i * cols..(i + 1) * cols]);
            }
        } else {
            for i in 0..rows {
                for j in 0..cols {
                    out[i * cols + j] = self.at(i, j).to_f32();
                }
            }
        }
    }
}
