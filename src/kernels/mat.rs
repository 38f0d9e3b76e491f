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

    /// The view as a contiguous row-major f32 copy.
    pub(crate) fn widened_copy(&self, rows: usize, cols: usize) -> Vec<f32>
    where
        T: Elem + Vx,
    {
        let mut out = vec![0f32; rows * cols];
        if self.cs == 1 && (self.rs == cols || rows == 1) {
            convert(&self.data[self.off..self.off + rows * cols], &mut out);
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
        out
    }
}
