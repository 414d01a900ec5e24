//! What each bucket sends, walk after walk: per sampled record of the store, its counters at the
//! last walk and its peaks so far in the slot. A bucket's peaks become an [`Observation`] of its
//! rule and limit when the slot ends or when the bucket goes (evicted, expired, or its record
//! taken by another key).

use std::collections::HashMap;

use ratelimit_common::{counter_advance, split_bucket_rule, Bucket, BucketKey};

/// What one bucket did over a slot (or its life in the slot, if shorter).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Observation {
    /// Its highest rate over one walk interval (at least a second), packets/s.
    pub peak_1s: f64,
    /// Its highest rate over a 10 s window, packets/s.
    pub peak_10s: f64,
    /// Its largest burst: packets of its busiest second beyond its 10 s peak rate.
    pub burst: f64,
}

/// Most records followed at once. Beyond, records are sampled by a hash of their index (the
/// store places keys by a keyed hash, so this is a uniform sample of the buckets), the rate
/// halving before the followed set would grow past it. The table (std's, hashbrown) holds at
/// most 7/8 of its slots, and when the tombstones of removed entries fill it, it rehashes in
/// place if at most half of that is live, else doubles: at 28,672, half of 7/8 of 2^16, it
/// never passes 2^16 slots of 121 bytes (an entry and a control byte), 7.6 MiB, however many
/// sources come and go. (At 65,536 it reached 2^17 slots in one walk of a million sources, and
/// 2^18 under churn, 30 MiB.)
pub const MAX_TRACKED: usize = 28_672;
/// The window of the sustained rate.
pub const WINDOW_NS: u64 = 10_000_000_000;
/// Shortest walk interval a 1 s rate is measured over (walks closer together add up).
const MIN_INTERVAL_NS: u64 = 1_000_000_000;

/// One followed bucket.
#[derive(Clone, Debug)]
struct Tracked {
    /// Its key (rule word, family, address), and the life of its record (creation time): a
    /// record holding anything else is another bucket.
    key: BucketKey,
    created: u64,
    /// Packets (passed and dropped) at the last reading, and when (`CLOCK_MONOTONIC` ns).
    last: (u32, u32),
    last_ns: u64,
    /// Packets since `tick_ns` (the current 1 s interval).
    tick_count: u64,
    tick_ns: u64,
    /// Packets since `window_ns` (the current 10 s window).
    window_count: u64,
    window_ns: u64,
    peak_1s: f64,
    peak_10s: f64,
    /// Packets in the slot.
    sent: u64,
    /// The walk that last saw it.
    seen: u64,
}

#[expect(clippy::cast_precision_loss, reason = "packet counts and nanoseconds")]
fn rate(count: u64, ns: u64) -> f64 {
    count as f64 * 1e9 / ns.max(1) as f64
}

impl Tracked {
    fn new(b: &Bucket, now: u64, walk: u64) -> Self {
        Self {
            key: b.key(),
            created: b.created_ns(),
            last: (b.passed_pkts, b.dropped_pkts),
            last_ns: now,
            tick_count: 0,
            tick_ns: now,
            window_count: 0,
            window_ns: now,
            peak_1s: 0.0,
            peak_10s: 0.0,
            sent: 0,
            seen: walk,
        }
    }

    fn same(&self, b: &Bucket) -> bool {
        self.key == b.key() && self.created == b.created_ns()
    }

    fn read(&mut self, b: &Bucket, now: u64) {
        let dp = counter_advance(b.passed_pkts, self.last.0).unwrap_or(0);
        let dd = counter_advance(b.dropped_pkts, self.last.1).unwrap_or(0);
        let n = u64::from(dp) + u64::from(dd);
        self.last = (b.passed_pkts, b.dropped_pkts);
        self.last_ns = now;
        self.sent += n;
        self.tick_count += n;
        self.window_count += n;
        let tick = now.saturating_sub(self.tick_ns);
        if tick >= MIN_INTERVAL_NS {
            self.peak_1s = self.peak_1s.max(rate(self.tick_count, tick));
            self.tick_count = 0;
            self.tick_ns = now;
        }
        let window = now.saturating_sub(self.window_ns);
        if window >= WINDOW_NS {
            self.peak_10s = self.peak_10s.max(rate(self.window_count, window));
            self.window_count = 0;
            self.window_ns = now;
        }
    }

    /// Its observation so far in the slot, or `None` if it sent nothing. A window not yet
    /// complete counts as 10 s if the bucket is gone (it sent nothing more) and as what it
    /// lasted if it still lives but never completed one (a source younger than 10 s).
    fn observation(&self, gone: bool) -> Option<Observation> {
        if self.sent == 0 {
            return None;
        }
        let open = self.last_ns.saturating_sub(self.window_ns);
        let partial = if gone || self.peak_10s > 0.0 {
            rate(self.window_count, WINDOW_NS)
        } else if open >= MIN_INTERVAL_NS {
            rate(self.window_count, open)
        } else {
            0.0
        };
        let peak_10s = self.peak_10s.max(partial);
        let tick = self.last_ns.saturating_sub(self.tick_ns);
        let open_1s = if gone || tick >= MIN_INTERVAL_NS / 2 {
            rate(self.tick_count, tick.max(MIN_INTERVAL_NS))
        } else {
            0.0
        };
        let peak_1s = self.peak_1s.max(open_1s).max(peak_10s);
        Some(Observation {
            peak_1s,
            peak_10s,
            burst: peak_1s - peak_10s,
        })
    }

    /// Starts a new slot: its peaks and count go, its counters and windows stay.
    fn restart(&mut self) {
        self.peak_1s = 0.0;
        self.peak_10s = 0.0;
        self.sent = 0;
    }
}

/// The followed buckets.
#[derive(Debug, Default)]
pub struct Tracker {
    tracked: HashMap<u32, Tracked>,
    /// A record is followed if the hash of its index is below this (`u32::MAX`: all).
    threshold: u32,
    walk: u64,
}

/// The sample hash of record `index` (a 32-bit mix: uniform over indices).
fn sample_hash(index: u32) -> u32 {
    let mut x = index.wrapping_mul(0x9e37_79b9);
    x ^= x >> 16;
    x = x.wrapping_mul(0x85eb_ca6b);
    x ^ (x >> 13)
}

/// (rule id, limit index) of a bucket's key word.
#[must_use]
pub fn rule_of(rule: u32) -> (u32, usize) {
    split_bucket_rule(rule)
}

impl Tracker {
    /// A tracker that follows every record until [`MAX_TRACKED`].
    #[must_use]
    pub fn new() -> Self {
        Self {
            threshold: u32::MAX,
            ..Self::default()
        }
    }

    /// The share of the store's records followed (1: all).
    #[must_use]
    pub fn sampled(&self) -> f64 {
        f64::from(self.threshold) / f64::from(u32::MAX)
    }

    /// Buckets followed now.
    #[must_use]
    pub fn len(&self) -> usize {
        self.tracked.len()
    }

    /// Bytes its table holds now, whatever is in it: hashbrown's slots (a power of two at least
    /// 8/7 of the capacity), each an entry and a control byte.
    #[must_use]
    pub fn bytes(&self) -> usize {
        let slots = (self.tracked.capacity() * 8 / 7).next_power_of_two();
        slots * (std::mem::size_of::<(u32, Tracked)>() + 1)
    }

    /// Whether none is.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.tracked.is_empty()
    }

    /// Begins a walk.
    pub fn begin(&mut self) {
        self.walk += 1;
    }

    /// Reads record `index` holding `b` at `now` (`CLOCK_MONOTONIC` ns); `gone` receives the
    /// observation of a bucket whose record now holds another (its key first).
    pub fn read(
        &mut self,
        index: u32,
        b: &Bucket,
        now: u64,
        gone: &mut impl FnMut(&BucketKey, Observation),
    ) {
        if sample_hash(index) > self.threshold {
            return;
        }
        let walk = self.walk;
        match self.tracked.get_mut(&index) {
            Some(t) if t.same(b) => {
                t.read(b, now);
                t.seen = walk;
            }
            Some(t) => {
                if let Some(o) = t.observation(true) {
                    gone(&t.key, o);
                }
                *t = Tracked::new(b, now, walk);
            }
            None => {
                // Room first: the table never grows past the slots that hold MAX_TRACKED.
                if self.tracked.len() >= MAX_TRACKED {
                    self.thin(gone);
                    if sample_hash(index) > self.threshold {
                        return;
                    }
                }
                self.tracked.insert(index, Tracked::new(b, now, walk));
            }
        }
    }

    /// Halves the sample until the followed set has room for one more, giving up the
    /// observations of what it drops.
    fn thin(&mut self, gone: &mut impl FnMut(&BucketKey, Observation)) {
        while self.tracked.len() >= MAX_TRACKED && self.threshold > 0 {
            self.threshold /= 2;
            let threshold = self.threshold;
            self.tracked.retain(|&i, t| {
                let keep = sample_hash(i) <= threshold;
                if !keep {
                    if let Some(o) = t.observation(true) {
                        gone(&t.key, o);
                    }
                }
                keep
            });
        }
    }

    /// Ends a walk: buckets it did not see are gone, their observations to `gone`.
    pub fn end(&mut self, gone: &mut impl FnMut(&BucketKey, Observation)) {
        let walk = self.walk;
        self.tracked.retain(|_, t| {
            let keep = t.seen == walk;
            if !keep {
                if let Some(o) = t.observation(true) {
                    gone(&t.key, o);
                }
            }
            keep
        });
    }

    /// The observations so far of the live buckets (their keys first); with `restart`, their
    /// slot begins anew.
    pub fn live(&mut self, restart: bool, each: &mut impl FnMut(&BucketKey, Observation)) {
        for t in self.tracked.values_mut() {
            if let Some(o) = t.observation(false) {
                each(&t.key, o);
            }
            if restart {
                t.restart();
            }
        }
    }
}
