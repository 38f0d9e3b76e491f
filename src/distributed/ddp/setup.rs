//! Setting a data-parallel run up: the same model on every rank, rank 0's values everywhere.

use candle_core::{DType, Tensor};

use super::super::zero;
use super::DataParallel;
use crate::amp::Amp;
use crate::error::{DistErrorKind, Result};
use crate::precision::store::ParamKind;

/// The overlap's first bucket, in bytes, for `bucket_bytes` (PyTorch's 1 MiB first bucket;
/// the overlap makes its buckets from the same numbers).
fn first_bucket_bytes(bucket_bytes: usize) -> usize {
    (bucket_bytes / 4).clamp(1, (1 << 20) / 4) * 4
}

fn flag(b: bool) -> f32 {
    if b { 1.0 } else { 0.0 }
}

impl DataParallel {
    /// Everything that shapes the run's sequence of collectives, as `(name, value)`: ranks
    /// that differ in any of these would call different collectives, or the same with
    /// different lengths, from the first step on. Overlap and synchronised batch norm are
    /// switched on later, each by a call that agrees on its own value
    /// ([`set_overlap`](Self::set_overlap), [`sync_batch_norm`](Self::sync_batch_norm)).
    fn options(&self, amp: &Amp) -> Vec<(&'static str, String)> {
        let props = amp.properties();
        // The types the all-gathers of a sharded run move (each parameter's working type).
        let mut gathers: Vec<String> = zero::trainable_sizes(amp.store())
            .iter()
            .filter_map(|(n, _)| amp.store().param(n))
            .map(|p| format!("{:?}", p.working().dtype()))
            .collect();
        gathers.sort();
        gathers.dedup();
        vec![
            // Another build may order its collectives differently.
            ("candle-amp version", env!("CARGO_PKG_VERSION").to_string()),
            ("opt level", props.opt_level.to_string()),
            ("half type", props.half.to_string()),
            ("sharding", self.sharding.to_string()),
            ("bucket_bytes", self.config.bucket_bytes.to_string()),
            (
                "first bucket bytes",
                first_bucket_bytes(self.config.bucket_bytes).to_string(),
            ),
            ("device path", amp.run().device_path().to_string()),
            ("gather types", format!("[{}]", gathers.join(", "))),
        ]
    }

    /// Fails on every rank unless every rank describes the same run: the same
    /// [`options`](Self::options) and the same parameters. Every rank's error names each
    /// option the group disagrees on (the ranks sum which lines differ from rank 0's), and a
    /// rank that differs also says how.
    pub(super) fn check_same_model(&self, amp: &Amp) -> Result<()> {
        let options = self.options(amp);
        let mut lines: Vec<String> = options.iter().map(|(k, v)| format!("{k} {v}")).collect();
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
        let r: Vec<&str> = root.lines().collect();
        let m: Vec<&str> = mine.lines().collect();
        let k = options.len();
        // One flag per option, then one for the parameters: summed, so that every rank
        // (rank 0 included) learns what the group disagrees on, and every rank fails.
        let mut bad: Vec<f32> = (0..k).map(|i| flag(r.get(i) != m.get(i))).collect();
        bad.push(flag(r.get(k..) != m.get(k..)));
        self.comm.all_reduce_sum(&mut bad)?;
        if bad.iter().all(|b| *b == 0.0) {
            return Ok(());
        }
        let names: Vec<String> = options
            .iter()
            .map(|(name, _)| *name)
            .chain(["parameters"])
            .zip(&bad)
            .filter(|(_, b)| **b > 0.0)
            .map(|(name, _)| format!("`{name}`"))
            .collect();
        let first = (0..r.len().max(m.len())).find(|&i| r.get(i) != m.get(i));
        let how = match first {
            Some(i) => format!(
                "rank 0 has `{}`, this rank has `{}`",
                r.get(i).unwrap_or(&"nothing more"),
                m.get(i).unwrap_or(&"nothing more")
            ),
            None => {
                let most = bad.iter().fold(0.0f32, |a, b| a.max(*b)) as usize;
                format!("{most} rank(s) differ from rank 0, which has what this rank has")
            }
        };
        Err(self.err(
            DistErrorKind::Mismatch,
            format!(
                "the ranks disagree on {} ({how}): build the same model, with the same opt level, half type, \
                 DataParallelConfig, sharding and device path, on every rank",
                names.join(", ")
            ),
        ))
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
