//! `top`: the busiest buckets over an interval, in bounded memory however large the store.
//!
//! A bucket's use over the interval is the growth of its counters between two reads of its
//! record. The store is an array, so the first read keeps, per live record, only its index, the
//! low half of its creation time (which tells a new life of the record from the old one) and its
//! two packet counters: 16 bytes, in index order. The second read walks the same records and
//! keeps only the `n` busiest in a heap. Neither read holds the agent's lock.
//!
//! The first read keeps at most [`BASELINE_BUDGET`] records (16 MiB). A store tracking more is
//! measured in *windows*: the first window covers the records up to the budget's worth of live
//! ones, is read twice `interval_ms` apart, then the next window the same way, and so on. Every
//! bucket is measured over an interval of the asked length, but the windows follow each other,
//! so the call takes `interval_ms` times the number of windows (reported as `windows`), and the
//! rates of buckets in different windows are of successive intervals, not the same one.

use std::{cmp::Ordering, collections::BinaryHeap, ops::ControlFlow, sync::Arc, time::Duration};

use ratelimit_common::Bucket;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::{
    compile::CompiledRuleSet,
    maps::{
        bucket::{key_source, monotonic_ns, BucketView},
        MapsError, PinnedMaps,
    },
};

/// Most records the first read of a window keeps (16 bytes each).
pub const BASELINE_BUDGET: usize = 1 << 20;

/// `GET /v1/top`'s answer.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TopReport {
    /// Time between the two reads of each bucket.
    pub interval_ms: u64,
    /// Buckets tracked at the second reads.
    pub buckets_tracked: usize,
    /// Buckets that saw packets in the interval.
    pub active: usize,
    /// Windows the store was measured in (1 unless it tracks more than [`BASELINE_BUDGET`]
    /// buckets; see the module docs).
    #[serde(default = "one")]
    pub windows: usize,
    /// The busiest of them, busiest first.
    pub top: Vec<TopEntry>,
}

fn one() -> usize {
    1
}

/// One bucket's use over `top`'s interval.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TopEntry {
    /// Rule name.
    pub rule: String,
    /// Rule id.
    pub rule_id: u32,
    /// Which limit of the rule the bucket is for: 1 its own, 2.. its `[[rule.limit]]`s in order.
    pub limit: usize,
    /// The bucket's source: the address masked to the limit's `per`, as a prefix.
    pub source: String,
    /// Packets passed per second.
    pub pps: f64,
    /// Packets dropped (or counted as dry-run drops) per second.
    pub drops_per_sec: f64,
    /// Packet tokens left now (negative: in debt); `None` without a packet limit.
    pub tokens: Option<f64>,
    /// Byte tokens left now; `None` without a byte limit.
    pub byte_tokens: Option<f64>,
    /// Packets passed since the bucket was created.
    pub passed: u64,
    /// Packets dropped since the bucket was created.
    pub dropped: u64,
}

/// What the second read compares a record with.
#[derive(Clone, Copy, Debug)]
struct Mark {
    index: u32,
    /// Bits 16..48 of `created_ns()` (its low 16 are zero): a record holding a bucket created
    /// since is a new life.
    created: u32,
    passed: u32,
    dropped: u32,
}

/// The first read of a window: per live record, in index order, its creation time and counters.
#[derive(Default)]
pub struct TopBaseline(Vec<Mark>);

impl TopBaseline {
    /// Adds record `index` holding `b` (indices must come in increasing order).
    pub fn push(&mut self, index: u32, b: &Bucket) {
        debug_assert!(self.0.last().is_none_or(|m| m.index < index));
        self.0.push(Mark {
            index,
            created: life(b),
            passed: b.passed_pkts,
            dropped: b.dropped_pkts,
        });
    }

    /// Records kept.
    #[must_use]
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether nothing is kept.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The counters of record `index` at the first read, if it held the same life of a bucket.
    fn counters(&self, index: u32, b: &Bucket) -> Option<(u32, u32)> {
        let i = self.0.binary_search_by_key(&index, |m| m.index).ok()?;
        let m = &self.0[i];
        (m.created == life(b)).then_some((m.passed, m.dropped))
    }
}

/// What tells one life of a record from the next: bits 16..48 of the bucket's creation time (its
/// low 16 hold the share word).
#[expect(clippy::cast_possible_truncation, reason = "32 bits of it, on purpose")]
fn life(b: &Bucket) -> u32 {
    (b.created_ns() >> ratelimit_common::SHARE_BITS) as u32
}

/// A bucket that saw packets, as the heap keeps it.
struct Candidate {
    /// Packets (passed and dropped) in the interval.
    total: u64,
    pps: f64,
    drops_per_sec: f64,
    /// When it was offered, after the second read took it (`CLOCK_MONOTONIC` ns): its tokens
    /// are as of then.
    read_ns: u64,
    key: (u32, u8, [u8; 16]),
    bucket: Bucket,
}

impl PartialEq for Candidate {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Candidate {}
impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Candidate {
    /// Busiest first (less): by rate (packets passed and dropped per second, so that buckets
    /// measured in windows of different lengths compare fairly), then by packets, ties by rule,
    /// then address.
    fn cmp(&self, other: &Self) -> Ordering {
        (other.pps + other.drops_per_sec)
            .total_cmp(&(self.pps + self.drops_per_sec))
            .then_with(|| other.total.cmp(&self.total))
            .then_with(|| self.key.cmp(&other.key))
    }
}

/// Ranks the buckets of the second reads, keeping the `n` busiest (a heap whose top is the least
/// busy kept) and a count of the rest.
pub struct TopRanker {
    n: usize,
    /// Only buckets of this limit of their rule (1: its own), if set.
    limit: Option<usize>,
    heap: BinaryHeap<Candidate>,
    active: usize,
    tracked: usize,
    /// The time tokens are computed at, if fixed (see [`TopRanker::tokens_at`]).
    tokens_at: Option<u64>,
}

impl TopRanker {
    /// Keeps the `n` busiest.
    #[must_use]
    pub fn new(n: usize) -> Self {
        Self::of_limit(n, None)
    }

    /// Keeps the `n` busiest buckets of limit `limit` of their rules (1: the rule's own; 2..:
    /// its `[[rule.limit]]`s), or of any limit (`None`): `top --limit 2` ranks the /24s of a
    /// rule whose second limit is `per = "/24"`.
    #[must_use]
    pub fn of_limit(n: usize, limit: Option<usize>) -> Self {
        Self {
            n,
            limit,
            heap: BinaryHeap::new(),
            active: 0,
            tracked: 0,
            tokens_at: None,
        }
    }

    /// Computes every bucket's tokens as of `t` (`CLOCK_MONOTONIC` ns) instead of the clock
    /// when it is offered: for buckets made up at a time of their own (tests). A bucket read
    /// before `t` moved by a packet after `t` shows fewer tokens than it holds (below zero).
    #[must_use]
    pub fn tokens_at(mut self, t: u64) -> Self {
        self.tokens_at = Some(t);
        self
    }

    /// Offers record `index` holding `b`, read in the walk that began at `t1`, against `first`
    /// (read at `t0`): its rates are over `t1 - t0`, its tokens as of now (the clock is read
    /// here, after the bucket: every packet that moved it came before, so a bucket not in debt
    /// never shows fewer than zero tokens; `t1`, taken before the walk, may precede them). A
    /// bucket absent from `first`, or created anew since (evicted meanwhile), counts from zero.
    /// Buckets of rules not in `set` are counted as tracked only.
    pub fn offer(
        &mut self,
        first: &TopBaseline,
        t0: u64,
        index: u32,
        b: &Bucket,
        t1: u64,
        set: &CompiledRuleSet,
    ) {
        self.tracked += 1;
        let (id, limit) = ratelimit_common::split_bucket_rule(u32::from(b.rule));
        if set.rule(id).is_none() || self.limit.is_some_and(|l| l != limit + 1) {
            return;
        }
        let (p0, d0) = first.counters(index, b).unwrap_or((0, 0));
        // The bucket's packet counters are 32 bits, wrapping, and may step back a little (see
        // `counter_advance`): that is no packet.
        let dp = u64::from(ratelimit_common::counter_advance(b.passed_pkts, p0).unwrap_or(0));
        let dd = u64::from(ratelimit_common::counter_advance(b.dropped_pkts, d0).unwrap_or(0));
        if dp == 0 && dd == 0 {
            return;
        }
        self.active += 1;
        #[expect(
            clippy::cast_precision_loss,
            reason = "nanoseconds and packet counts, display only"
        )]
        let (pps, drops_per_sec) = {
            let secs = t1.saturating_sub(t0).max(1) as f64 / 1e9;
            (dp as f64 / secs, dd as f64 / secs)
        };
        let key = b.key();
        let candidate = Candidate {
            total: dp.saturating_add(dd),
            pps,
            drops_per_sec,
            read_ns: self.tokens_at.unwrap_or_else(monotonic_ns),
            key: (key.rule, key.family, key.addr),
            bucket: *b,
        };
        if self.heap.len() < self.n {
            self.heap.push(candidate);
        } else if self.heap.peek().is_some_and(|worst| candidate < *worst) {
            self.heap.pop();
            self.heap.push(candidate);
        }
    }

    /// (buckets tracked, buckets active, the busiest rendered under `set`, busiest first).
    #[must_use]
    pub fn finish(self, set: &CompiledRuleSet) -> (usize, usize, Vec<TopEntry>) {
        let entries = self
            .heap
            .into_sorted_vec()
            .into_iter()
            .filter_map(|c| {
                let b = &c.bucket;
                let (id, limit) = ratelimit_common::split_bucket_rule(u32::from(b.rule));
                let rule = set.rule(id)?;
                let view = BucketView::new(b, &rule.rule, c.read_ns);
                Some(TopEntry {
                    rule: rule.name.clone(),
                    rule_id: rule.id,
                    limit: limit + 1,
                    source: key_source(
                        &b.key(),
                        &rule
                            .rule
                            .limit(ratelimit_common::split_bucket_rule(b.key().rule).1)
                            .unwrap_or_default()
                            .src_mask,
                    ),
                    pps: c.pps,
                    drops_per_sec: c.drops_per_sec,
                    tokens: view.tokens,
                    byte_tokens: view.byte_tokens,
                    passed: u64::from(b.passed_pkts),
                    dropped: u64::from(b.dropped_pkts),
                })
            })
            .collect();
        (self.tracked, self.active, entries)
    }
}

/// How many buckets of `second` (records with their index, read at `t1`, `CLOCK_MONOTONIC` ns)
/// saw packets since `first` (read at `t0`), and the `n` busiest of them, busiest first (ties:
/// by rule, then address), their tokens as of `t1`. See [`TopRanker::offer`].
#[must_use]
pub fn top_entries(
    first: &TopBaseline,
    t0: u64,
    second: &[(u32, Bucket)],
    t1: u64,
    set: &CompiledRuleSet,
    n: usize,
) -> (usize, Vec<TopEntry>) {
    let mut ranker = TopRanker::new(n).tokens_at(t1);
    for (i, b) in second {
        ranker.offer(first, t0, *i, b, t1, set);
    }
    let (_, active, entries) = ranker.finish(set);
    (active, entries)
}

/// Measures the store behind `maps` over `interval`, window by window (see the module docs), and
/// ranks its buckets under the rules in force.
pub async fn measure(
    maps: Arc<PinnedMaps>,
    rules: watch::Receiver<Arc<CompiledRuleSet>>,
    (n, limit): (usize, Option<usize>),
    interval: Duration,
    budget: usize,
) -> Result<TopReport, MapsError> {
    let records = maps.store().records();
    let mut ranker = TopRanker::of_limit(n, limit);
    let mut start = 0u32;
    let mut windows = 0;
    loop {
        let m = maps.clone();
        let (t0, first, end) = blocking(move || {
            let t0 = monotonic_ns();
            let mut first = TopBaseline::default();
            let end = m.for_each_bucket_in(start..records, |i, b| {
                if first.len() >= budget {
                    return ControlFlow::Break(());
                }
                first.push(i, b);
                ControlFlow::Continue(())
            })?;
            Ok((t0, first, end))
        })
        .await?;
        tokio::time::sleep(interval).await;
        let set = rules.borrow().clone();
        let m = maps.clone();
        ranker = blocking(move || {
            let t1 = monotonic_ns();
            m.for_each_bucket_in(start..end, |i, b| {
                ranker.offer(&first, t0, i, b, t1, &set);
                ControlFlow::Continue(())
            })?;
            Ok(ranker)
        })
        .await?;
        windows += 1;
        if end >= records {
            break;
        }
        start = end;
    }
    let set = rules.borrow().clone();
    let (tracked, active, top) = ranker.finish(&set);
    Ok(TopReport {
        interval_ms: u64::try_from(interval.as_millis()).unwrap_or(u64::MAX),
        buckets_tracked: tracked,
        active,
        windows,
        top,
    })
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, MapsError> + Send + 'static,
) -> Result<T, MapsError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| MapsError::Op {
            map: ratelimit_common::map_names::BUCKETS,
            reason: format!("the walk of the bucket store failed: {e}"),
        })?
}
