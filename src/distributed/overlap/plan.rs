//! The bucket plan of an overlapped run: which parameters share a bucket, in the order their
//! gradients become ready (PyTorch's reducer rebuilds its buckets from the order observed in
//! the first backward). Plain data, the same on every rank: rank 0's observed order is sent
//! to the others once.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// One parameter of the plan: its name, how many pieces of gradient reach it during the
/// backward through the library's layers (0: it is ready only when candle's backward
/// returns), and its size in values.
///
/// The order and sizes are rank 0's, the same everywhere (they make the buckets); `count`
/// and `absent` are this rank's own, from its own learning backward (a rank whose graph
/// differs, e.g. a head only rank 0 uses, waits for the pieces it really gets, not rank
/// 0's).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Entry {
    pub name: String,
    pub count: usize,
    pub size: usize,
    /// This rank's backward gave it no gradient at all: its share (the master gradient so
    /// far, or zeros) is written when the backward starts, so its bucket need not wait for
    /// the end of the backward. Never sent: each rank learns its own.
    #[serde(skip)]
    pub absent: bool,
}

/// One bucket: a run of the plan's parameters, summed in one collective.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Bucket {
    /// Indices into [`Plan::entries`].
    pub params: std::ops::Range<usize>,
    /// Gradient values (the buffer holds [`HEADER`] more).
    pub len: usize,
}

/// Values after a bucket's gradients that say which bucket this is (see `Overlap::check`).
pub(crate) const HEADER: usize = 2;

/// The buckets of an overlapped run.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Plan {
    pub entries: Vec<Entry>,
    pub buckets: Vec<Bucket>,
    /// Per entry: its bucket and offset there.
    pub slot: Vec<(usize, usize)>,
    by_name: HashMap<String, usize>,
}

impl Plan {
    /// Buckets over `entries` in their order: the first of at most `first_cap` values (a
    /// small first bucket starts the first transfer early; PyTorch's 1 MiB), the others of
    /// at most `cap` values; a parameter larger than the cap has a bucket of its own.
    pub(crate) fn new(entries: Vec<Entry>, first_cap: usize, cap: usize) -> Self {
        let mut buckets: Vec<Bucket> = Vec::new();
        let mut slot = Vec::with_capacity(entries.len());
        let mut start = 0;
        let mut len = 0;
        for (i, e) in entries.iter().enumerate() {
            let limit = if buckets.is_empty() { first_cap } else { cap };
            if i > start && len + e.size > limit {
                buckets.push(Bucket { params: start..i, len });
                start = i;
                len = 0;
            }
            slot.push((buckets.len(), len));
            len += e.size;
        }
        if start < entries.len() {
            buckets.push(Bucket {
                params: start..entries.len(),
                len,
            });
        }
        let by_name = entries.iter().enumerate().map(|(i, e)| (e.name.clone(), i)).collect();
        Self {
            entries,
            buckets,
            slot,
            by_name,
        }
    }

    /// The index of parameter `name`.
    pub(crate) fn index(&self, name: &str) -> Option<usize> {
        self.by_name.get(name).copied()
    }

    /// Takes this rank's own `count` and `absent` from `mine` (its learned order), by name;
    /// entries it has not learned keep rank 0's count.
    pub(crate) fn localize(&mut self, mine: &[Entry]) {
        let by_name: HashMap<&str, &Entry> = mine.iter().map(|e| (e.name.as_str(), e)).collect();
        for e in &mut self.entries {
            if let Some(m) = by_name.get(e.name.as_str()) {
                e.count = m.count;
                e.absent = m.absent;
            }
        }
    }

    /// Whether the plan covers exactly the parameters `names` (any order).
    pub(crate) fn covers_exactly<'a>(&self, names: impl ExactSizeIterator<Item = &'a str>) -> bool {
        let n = names.len();
        n == self.entries.len() && {
            let mut seen = vec![false; n];
            names.into_iter().all(|name| match self.index(name) {
                Some(i) if !seen[i] => {
                    seen[i] = true;
                    true
                }
                _ => false,
            })
        }
    }

    /// What rank 0 sends the others.
    pub(crate) fn encode(entries: &[Entry]) -> Vec<u8> {
        serde_json::to_vec(entries).expect("plain data serialises")
    }

    /// What the others read (`None`: not a plan).
    pub(crate) fn decode(bytes: &[u8]) -> Option<Vec<Entry>> {
        serde_json::from_slice(bytes).ok()
    }

    /// Bucket `b`'s parameter names, for messages: the first and the last.
    pub(crate) fn describe(&self, b: usize) -> String {
        let Some(bucket) = self.buckets.get(b) else {
            return format!("bucket {b}");
        };
        let first = &self.entries[bucket.params.start].name;
        let last = &self.entries[bucket.params.end - 1].name;
        let what = if bucket.params.len() == 1 {
            format!("`{first}`")
        } else {
            format!("{} parameters, `{first}` to `{last}`", bucket.params.len())
        };
        format!("bucket {} of {} ({what}, {} values)", b, self.buckets.len(), bucket.len)
    }
}

/// The plan's order from one observed backward: the parameters whose gradients arrived
/// piece by piece, in the order of their last piece (when they became complete), then the
/// others (ready when candle's backward returns) in reverse name order. `present`: whether
/// each got any gradient at all.
pub(crate) fn observed_order(
    params: &[(String, usize)],
    counts: &[usize],
    last: &[u64],
    present: &[bool],
) -> Vec<Entry> {
    let mut seen: Vec<usize> = (0..params.len()).filter(|&i| counts[i] > 0).collect();
    seen.sort_by_key(|&i| last[i]);
    let mut rest: Vec<usize> = (0..params.len()).filter(|&i| counts[i] == 0).collect();
    rest.sort_by(|&a, &b| params[b].0.cmp(&params[a].0));
    seen.into_iter()
        .chain(rest)
        .map(|i| Entry {
            name: params[i].0.clone(),
            count: counts[i],
            size: params[i].1,
            absent: counts[i] == 0 && !present[i],
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(name: &str, count: usize, size: usize) -> Entry {
        Entry {
            name: name.into(),
            count,
            size,
            absent: false,
        }
    }

    #[test]
    fn buckets_fill_in_order_with_a_small_first_one() {
        let p = Plan::new(
            vec![e("a", 1, 3), e("b", 1, 3), e("c", 2, 10), e("d", 0, 2), e("e", 0, 2)],
            4,
            13,
        );
        let ranges: Vec<_> = p.buckets.iter().map(|b| (b.params.clone(), b.len)).collect();
        assert_eq!(ranges, vec![(0..1, 3), (1..3, 13), (3..5, 4)]);
        assert_eq!(p.slot, vec![(0, 0), (1, 0), (1, 3), (2, 0), (2, 2)]);
        assert!(p.covers_exactly(["e", "d", "c", "b", "a"].into_iter()));
        assert!(!p.covers_exactly(["e", "d", "c", "b", "b"].into_iter()));
        assert!(!p.covers_exactly(["e", "d", "c", "b"].into_iter()));
        assert_eq!(p.describe(1), "bucket 1 of 3 (2 parameters, `b` to `c`, 13 values)");
    }

    #[test]
    fn the_observed_order_puts_candles_own_parameters_last() {
        let params = vec![("a".to_string(), 1), ("b".into(), 2), ("c".into(), 3), ("d".into(), 4)];
        let order = observed_order(&params, &[1, 0, 2, 0], &[9, 0, 4, 0], &[true, true, true, false]);
        let names: Vec<_> = order.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["c", "a", "d", "b"]);
        let absent: Vec<_> = order.iter().map(|e| e.absent).collect();
        assert_eq!(absent, [false, false, true, false]);
        // What a rank learned of its own stays its own: not sent.
        let back = Plan::decode(&Plan::encode(&order)).unwrap();
        assert!(back.iter().all(|e| !e.absent));
        let mut plan = Plan::new(back, 4, 12);
        plan.localize(&[
            e("d", 0, 4),
            Entry {
                absent: true,
                ..e("b", 0, 2)
            },
        ]);
        let local: Vec<_> = plan.entries.iter().map(|e| (e.count, e.absent)).collect();
        assert_eq!(local, [(2, false), (1, false), (0, false), (0, true)]);
        assert!(Plan::decode(b"not a plan").is_none());
    }

    #[test]
    fn an_empty_plan_has_no_buckets() {
        let p = Plan::new(Vec::new(), 4, 12);
        assert!(p.buckets.is_empty());
        // A zero-sized parameter still belongs to a bucket.
        let p = Plan::new(vec![e("z", 0, 0)], 4, 12);
        assert_eq!(p.buckets.len(), 1);
        assert_eq!(p.buckets[0].len, 0);
    }
}
