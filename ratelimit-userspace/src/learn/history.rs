//! The learned distributions of one limit: three quantile sketches (a bucket's peak rate over
//! 1 s and over 10 s, and its largest burst) and its heaviest buckets ([`Top`]) per time slot, in
//! slots of [`SLOT_SECS`] for the last hour and of an hour for the last day.

use std::collections::VecDeque;

use sketches_ddsketch::{Config, DDSketch};

use super::{
    heavy::{clean, Heavy, Source, Top},
    track::Observation,
};

/// Relative accuracy of the sketches: a quantile is within 2% of a value of the data.
pub const ALPHA: f64 = 0.02;
/// The crate's bin limit and smallest value, which its decoder assumes (so a sketch read back
/// merges with ours).
const MAX_BINS: u32 = 2048;
const MIN_VALUE: f64 = 1e-9;
/// Length of a slot of the last hour, seconds.
pub const SLOT_SECS: u64 = 300;
/// An hour, seconds.
pub const HOUR_SECS: u64 = 3600;
/// A day, seconds: the longest history kept.
pub const DAY_SECS: u64 = 86_400;

/// A new, empty sketch of the accuracy above.
#[must_use]
pub fn sketch() -> DDSketch {
    DDSketch::new(Config::new(ALPHA, MAX_BINS, MIN_VALUE))
}

/// The three distributions of a set of observations, and their heaviest buckets.
#[derive(Clone)]
pub struct Dist {
    /// Peak rates over 1 s.
    pub peak_1s: DDSketch,
    /// Peak rates over 10 s.
    pub peak_10s: DDSketch,
    /// Largest bursts.
    pub burst: DDSketch,
    /// The heaviest buckets by 1 s peak.
    pub heavy: Top,
}

impl Default for Dist {
    fn default() -> Self {
        Self {
            peak_1s: sketch(),
            peak_10s: sketch(),
            burst: sketch(),
            heavy: Top::default(),
        }
    }
}

impl std::fmt::Debug for Dist {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Dist({} observations)", self.count())
    }
}

impl Dist {
    /// Adds the observation `o` of the bucket keyed `source`.
    pub fn add(&mut self, o: &Observation, source: Source) {
        self.peak_1s.add(clean(o.peak_1s));
        self.peak_10s.add(clean(o.peak_10s));
        self.burst.add(clean(o.burst));
        self.heavy.add(Heavy::of(source, o));
    }

    /// Adds every observation of `other` (sketches of the same accuracy merge exactly).
    pub fn merge(&mut self, other: &Dist) {
        // Same config by construction (and checked when read from a file): cannot fail.
        let _ = self.peak_1s.merge(&other.peak_1s);
        let _ = self.peak_10s.merge(&other.peak_10s);
        let _ = self.burst.merge(&other.burst);
        self.heavy.merge(&other.heavy);
    }

    /// Observations held.
    #[must_use]
    pub fn count(&self) -> u64 {
        self.peak_10s.count() as u64
    }

    /// Bins its three sketches hold (8 bytes each), whatever the number of observations.
    #[must_use]
    pub fn bins(&self) -> usize {
        self.peak_1s.length() + self.peak_10s.length() + self.burst.length()
    }
}

/// A slot: its start (Unix seconds) and what it holds.
#[derive(Clone, Debug)]
pub struct Slot {
    /// Unix seconds at its start (a multiple of its length).
    pub start: u64,
    /// Its observations.
    pub dist: Dist,
}

/// One limit's history: the slot being filled, the finished slots of the last hour, and the
/// hours of the last day (at most 1 + 12 + 24 slots).
#[derive(Clone, Debug, Default)]
pub struct History {
    /// The slot being filled ([`SLOT_SECS`] long).
    pub current: Option<Slot>,
    /// Finished [`SLOT_SECS`] slots of the last hour, oldest first.
    pub recent: VecDeque<Slot>,
    /// Hours older than that, of the last day, oldest first.
    pub hours: VecDeque<Slot>,
}

impl History {
    /// Adds `o` of the bucket keyed `source`, observed at `now` (Unix seconds), to the slot of
    /// `now`.
    pub fn add(&mut self, now: u64, o: &Observation, source: Source) {
        self.roll(now);
        let start = now - now % SLOT_SECS;
        self.current
            .get_or_insert_with(|| Slot {
                start,
                dist: Dist::default(),
            })
            .dist
            .add(o, source);
    }

    /// Moves finished slots along at `now`: the current one into the hour's list once `now` is
    /// past it, slots older than an hour into their hour, hours older than a day out.
    pub fn roll(&mut self, now: u64) {
        if let Some(cur) = self.current.take() {
            if cur.start + SLOT_SECS <= now {
                self.recent.push_back(cur);
            } else {
                self.current = Some(cur);
            }
        }
        while self
            .recent
            .front()
            .is_some_and(|s| s.start + SLOT_SECS + HOUR_SECS <= now)
        {
            let Some(old) = self.recent.pop_front() else {
                break;
            };
            let hour = old.start - old.start % HOUR_SECS;
            match self.hours.back_mut() {
                Some(h) if h.start == hour => h.dist.merge(&old.dist),
                _ => self.hours.push_back(Slot {
                    start: hour,
                    dist: old.dist,
                }),
            }
        }
        while self
            .hours
            .front()
            .is_some_and(|h| h.start + HOUR_SECS + DAY_SECS <= now)
        {
            self.hours.pop_front();
        }
    }

    /// Every observation of the slots that end after `now - since` (slot granularity: the
    /// last hour by [`SLOT_SECS`], the day before by the hour).
    #[must_use]
    pub fn since(&self, now: u64, since: u64) -> Dist {
        let from = now.saturating_sub(since);
        let mut all = Dist::default();
        let hours = self.hours.iter().filter(|h| h.start + HOUR_SECS > from);
        let recent = self.recent.iter().filter(|s| s.start + SLOT_SECS > from);
        for s in hours.chain(recent).chain(self.current.iter()) {
            all.merge(&s.dist);
        }
        all
    }

    /// Slots it holds, the bins of all their sketches, and the entries of all their lists of
    /// heaviest buckets.
    #[must_use]
    pub fn size(&self) -> (usize, usize, usize) {
        let slots = self.current.iter().chain(&self.recent).chain(&self.hours);
        slots.fold((0, 0, 0), |(n, bins, heavy), s| {
            (n + 1, bins + s.dist.bins(), heavy + s.dist.heavy.len())
        })
    }

    /// Whether it holds nothing.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.current.is_none() && self.recent.is_empty() && self.hours.is_empty()
    }
}
