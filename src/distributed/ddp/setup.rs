//! Setting a data-parallel run up: the same model on every rank, rank 0's values everywhere.

use candle_core::{DType, Tensor};

use super::DataParallel;
use crate::amp::Amp;
use crate::error::{DistErrorKind, Result};
use crate::precision::store::ParamKind;

impl DataParallel {
    /// Fails on every rank unless every rank describes the same run.
    pub(super) fn check_same_model(&self, amp: &Amp) -> Result<()> {
        let props = amp.properties();
        let mut lines = vec![format!(
            "opt level {}, half type {}, sharding {}",
            props.opt_level, props.half, self.sharding
        )];
        for p in amp.store().params() {
            lines.push(format!(
                "parameter `{}`: {:?}, shape {:?}, {:?}",
                p.name(),
                p.kind(),
                p.working().dims(),
                p.working().dtype()
            ));
        }
        let mine = lines.join("\n");
        let mut root = mine.clone().into_bytes();
        self.comm.broadcast_bytes(&mut root, 0)?;
        let root = String::from_utf8_lossy(&root).into_owned();
        let differs = root != mine;
        // Every rank learns how many differ, so every rank fails (none waits for the others).
        let mut bad = [if differs { 1.0f32 } else { 0.0 }];
        self.comm.all_reduce_sum(&mut bad)?;
        if bad[0] == 0.0 {
            return Ok(());
        }
        let detail = if differs {
            let (r, m): (Vec<&str>, Vec<&str>) = (root.lines().collect(), mine.lines().collect());
            let first = (0..r.len().max(m.len()))
                .find(|&i| r.get(i) != m.get(i))
                .map(|i| {
                    format!(
                        "rank 0 has `{}`, this rank has `{}`",
                        r.get(i).unwrap_or(&"nothing more"),
                        m.get(i).unwrap_or(&"nothing more")
                    )
                })
                .unwrap_or_default();
            format!(
                "this rank's model differs from rank 0's: {first}. Build the same model, opt level and half type on every rank, with the same sharding"
            )
        } else {
            format!(
                "{} rank(s) have a model that differs from rank 0's (opt level, half type, parameter names or shapes); build the same model on every rank",
                bad[0] as usize
            )
        };
        Err(self.err(DistErrorKind::Mismatch, detail))
    }

    pub(super) fn broadcast_params(&self, amp: &Amp) -> Result<()> {
        self.broadcast_kind(amp, None)
    }

    /// Broadcasts rank 0's f32 values of the store's parameters (of one kind, or all),
    /// bucketed, and writes them on the other ranks.
    pub(super) fn broadcast_kind(&self, amp: &Amp, kind: Option<ParamKind>) -> Result<()> {
        let mut params = amp.store().params();
        params.retain(|p| kind.is_none_or(|k| p.kind() == k) && p.working().dtype().is_float());
        params.sort_by(|a, b| a.name().cmp(b.name()));
        let mut flat = Vec::new();
        for p in &params {
            flat.extend(p.f32_value()?.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?);
        }
        let per = (self.config.bucket_bytes / 4).max(1);
        let comm = self.collective_comm();
        for chunk in flat.chunks_mut(per) {
            comm.broadcast(chunk, 0)?;
        }
        if self.is_main() {
            return Ok(());
        }
        let mut at = 0;
        for p in &params {
            let dims = p.working().dims().to_vec();
            let n: usize = dims.iter().product();
            let t = Tensor::from_slice(&flat[at..at + n], dims, p.working().device())?;
            amp.store().write_f32(p.name(), &t)?;
            at += n;
        }
        Ok(())
    }
}
