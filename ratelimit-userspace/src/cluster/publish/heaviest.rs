//! The candidates for the published set: their weight, and the heaviest kept in bounded
//! memory while a full scan streams the buckets.

use super::{BucketObs, KeyName};

/// A candidate's weight for the published set: its lifetime average demand (packets that
/// reached it, admitted or dropped; all there is without history), at `now`.
#[must_use]
pub fn candidate_rate(now: u64, b: &BucketObs) -> f64 {
    #[expect(clippy::cast_precision_loss, reason = "a rate estimate")]
    let age = (now.saturating_sub(b.created_ns) as f64 / 1e9).max(1.0);
    #[expect(clippy::cast_precision_loss, reason = "a rate estimate")]
    let rate = b.demand() as f64 / age;
    rate
}

/// The `k` heaviest candidates of a full scan, in bounded memory: the scan offers every bucket
/// that is not published, and only those [`LocalTracker::update`] could take are kept (it takes at
/// most `max_keys` candidates, heaviest first, ties by key).
///
/// [`LocalTracker::update`]: super::LocalTracker::update
pub struct Heaviest {
    k: usize,
    heap: std::collections::BinaryHeap<Ranked>,
}

/// A candidate in [`Heaviest`]: ordered heaviest first (less), then by key.
pub(super) struct Ranked(pub(super) f64, pub(super) KeyName, pub(super) BucketObs);

impl PartialEq for Ranked {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == std::cmp::Ordering::Equal
    }
}
impl Eq for Ranked {}
impl PartialOrd for Ranked {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Ranked {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other
            .0
            .total_cmp(&self.0)
            .then_with(|| self.1.cmp(&other.1))
    }
}

impl Heaviest {
    /// Keeps the `k` heaviest.
    #[must_use]
    pub fn new(k: usize) -> Self {
        Self {
            k,
            heap: std::collections::BinaryHeap::new(),
        }
    }

    /// Offers a candidate of weight `rate`.
    pub fn offer(&mut self, rate: f64, key: KeyName, b: BucketObs) {
        let r = Ranked(rate, key, b);
        if self.heap.len() < self.k {
            self.heap.push(r);
        } else if self.heap.peek().is_some_and(|worst| r < *worst) {
            self.heap.pop();
            self.heap.push(r);
        }
    }

    /// The candidates kept.
    pub fn into_candidates(self) -> impl Iterator<Item = (KeyName, BucketObs)> {
        self.heap.into_iter().map(|Ranked(_, k, b)| (k, b))
    }
}
