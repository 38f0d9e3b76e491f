//! An embedding lookup as one node whose backward sums the rows' gradients in f32.
//!
//! Through candle's graph, `index_select`'s backward adds the gradient of every looked-up row
//! into a `zeros_like` of the table in the table's type: at O2 and O3 a half table, so a token
//! that occurs many times in a batch has its gradients summed in f16 or bf16 (bf16 keeps 8
//! bits: a few hundred occurrences already lose the small ones), and the sum then runs in
//! candle's slow half element-wise code. Here the node keeps the row indices, and its
//! backward adds each row's gradient, widened, into an f32 table gradient in the order of
//! the rows (the same sum on every run), which goes to the run's [`GradSink`] as the linear
//! layers' weight gradients do (Transformer Engine and Apex keep embedding gradients in the
//! main gradient's type the same way). The ids get no gradient.

use std::sync::{Arc, Mutex};

use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Storage, Tensor};

use super::chain::hand_over;
use super::simd::Elem;
use super::slices::{Unscale, Vx, unscale};
use super::wgrad::{GradSink, apply_node};

/// The node: the row indices it looked up and the table their gradients are for.
struct Lookup {
    /// Row of the table for each id, in the ids' order.
    rows: Arc<[u32]>,
    /// The table's rows and width.
    vocab: usize,
    width: usize,
    /// The table parameter, whose gradient the sink receives.
    key: Tensor,
    sink: Arc<dyn GradSink>,
    /// The looked-up rows until the forward hands them to candle.
    result: Mutex<Option<Tensor>>,
}

impl Lookup {
    /// Each row's gradient (`g`: one row of `width` per id) added into an f32 table.
    fn table_grad(&self, g: &Tensor) -> Result<Tensor> {
        let g = super::dense(g)?;
        let mut sum = vec![0f32; self.vocab * self.width];
        let (s, l) = g.storage_and_layout();
        let Storage::Cpu(c) = &*s else {
            candle_core::bail!("amp-embedding: the gradient is not on the CPU")
        };
        let Some((a, b)) = l.contiguous_offsets() else {
            candle_core::bail!("amp-embedding: the gradient is not dense")
        };
        if b - a != self.rows.len() * self.width {
            candle_core::bail!(
                "amp-embedding: a gradient of {} values for {} rows of {}",
                b - a,
                self.rows.len(),
                self.width
            )
        }
        fn add<S: Elem + Vx>(g: &[S], rows: &[u32], w: usize, sum: &mut [f32]) {
            if w == 0 {
                return;
            }
            for (gr, &r) in g.chunks_exact(w).zip(rows) {
                let r = r as usize;
                // Accumulate: inf or NaN pass into the sum, where the run's finite check
                // finds them (the returned flag is that check's, not this one's).
                unscale(gr, &mut sum[r * w..(r + 1) * w], Unscale::Identity, true);
            }
        }
        match c {
            CpuStorage::F16(v) => add(&v[a..b], &self.rows, self.width, &mut sum),
            CpuStorage::BF16(v) => add(&v[a..b], &self.rows, self.width, &mut sum),
            CpuStorage::F32(v) => add(&v[a..b], &self.rows, self.width, &mut sum),
            _ => candle_core::bail!("amp-embedding: a gradient of type {:?}", g.dtype()),
        }
        drop(s);
        Tensor::from_vec(sum, (self.vocab, self.width), g.device())
    }

    fn bwd(&self, g: &Tensor) -> Result<()> {
        let grad = self.table_grad(g)?;
        self.sink.add(&self.key, grad)
    }
}

impl CustomOp1 for Lookup {
    fn name(&self) -> &'static str {
        "amp-embedding"
    }

    fn cpu_fwd(&self, _s: &CpuStorage, _l: &Layout) -> Result<(CpuStorage, Shape)> {
        hand_over(&self.result, "amp-embedding")
    }

    fn bwd(&self, _ids: &Tensor, _res: &Tensor, g: &Tensor) -> Result<Option<Tensor>> {
        self.bwd(g)?;
        Ok(None)
    }
}

/// Over `(ids, anchor)`: ids never take a gradient, so the anchor is what makes candle's
/// backward reach the node (see `wgrad::apply_node`).
impl CustomOp2 for Lookup {
    fn name(&self) -> &'static str {
        "amp-embedding"
    }

    fn cpu_fwd(&self, _s1: &CpuStorage, _l1: &Layout, _s2: &CpuStorage, _l2: &Layout) -> Result<(CpuStorage, Shape)> {
        hand_over(&self.result, "amp-embedding")
    }

    fn bwd(
        &self,
        _ids: &Tensor,
        _anchor: &Tensor,
        _res: &Tensor,
        g: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        self.bwd(g)?;
        Ok((None, None))
    }
}

/// The rows of `table` (`vocab x width`, f16 or bf16 on the CPU) at `rows` (checked by the
/// caller: each below `vocab`), shaped `ids`' dimensions + `width`, as one node whose
/// backward sends the table's gradient to `sink` under `key` in f32. `None` where it does not
/// apply (the kernels off, another device or type, no ids): the caller runs `index_select`.
pub(crate) fn lookup(
    ids: &Tensor,
    rows: Arc<[u32]>,
    table: &Tensor,
    key: &Tensor,
    sink: Arc<dyn GradSink>,
) -> Result<Option<Tensor>> {
    let fits = super::enabled()
        && ids.device().is_cpu()
        && table.device().is_cpu()
        && matches!(table.dtype(), DType::F16 | DType::BF16)
        && table.rank() == 2
        && ids.elem_count() > 0
        && rows.len() == ids.elem_count();
    if !fits {
        return Ok(None);
    }
    let (vocab, width) = table.dims2()?;
    let index = Tensor::from_slice(&rows, rows.len(), ids.device())?;
    let mut shape = ids.dims().to_vec();
    shape.push(width);
    // A fresh buffer (the select writes one), reshaped in place.
    let out = table.detach().index_select(&index, 0)?.reshape(shape)?;
    let node = Lookup {
        rows,
        vocab,
        width,
        key: key.clone(),
        sink,
        result: Mutex::new(Some(out)),
    };
    Ok(Some(apply_node(&ids.detach(), node, true)?))
}
