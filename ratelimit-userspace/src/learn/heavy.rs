//! The heaviest buckets of a limit: per slot, the [`HEAVY_K`] buckets of the highest 1 s peak,
//! each named by its key (the source, or the prefix of the limit's granularity) with its peaks and
//! its burst, so that `suggest` can name the heaviest sources a proposal would have limited.
//!
//! A list is a `Vec` kept sorted, heaviest first, one entry per source, at most [`HEAVY_K`]: a
//! few dozen bytes an entry, searched linearly (16 entries: cheaper than any index). Merging two
//! lists (slots into an hour, hours into a day) keeps each source's highest figures and the
//! [`HEAVY_K`] heaviest of the union, which is exact for the heaviest by 1 s peak: a source one
//! list dropped had [`HEAVY_K`] others above it there, so it is not among the union's heaviest.

use std::{fmt, str::FromStr};

use ipnet::IpNet;
use serde::{Serialize, Serializer};

use super::track::Observation;

/// Most buckets a list names.
pub const HEAVY_K: usize = 16;
/// Bytes of an entry: a key of 18 bytes and three figures, aligned.
pub const HEAVY_BYTES: usize = std::mem::size_of::<Heavy>();

/// A bucket's key as `top` shows it: the masked source as a prefix of its limit's granularity
/// (`198.18.1.0/24`, `198.18.1.7/32`), or `*` for a limit of one bucket per rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Source(pub Option<IpNet>);

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(n) => write!(f, "{n}"),
            None => f.write_str("*"),
        }
    }
}

impl FromStr for Source {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if s == "*" {
            return Ok(Self(None));
        }
        s.parse::<IpNet>()
            .map(|n| Self(Some(n.trunc())))
            .map_err(|_| format!("{s:?} is not a source prefix"))
    }
}

impl Serialize for Source {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// One heavy bucket: its key and its highest figures over the slots it was seen in.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Heavy {
    pub source: Source,
    /// Highest 1 s peak rate, packets/s.
    pub peak_1s: f64,
    /// Highest 10 s peak rate, packets/s.
    pub peak_10s: f64,
    /// Largest burst, packets.
    pub burst: f64,
}

/// The sketches keep values between these (below: as zero): a range of 10^11, about 640 bins of 2%, so
/// a sketch holds at most about 5 KiB of bins.
pub const RANGE: (f64, f64) = (0.01, 1e9);

/// A figure as the sketches keep it: finite, 0 below [`RANGE`]'s low end, capped at its high end.
#[must_use]
pub fn clean(v: f64) -> f64 {
    if v.is_finite() && v >= RANGE.0 {
        v.min(RANGE.1)
    } else {
        0.0
    }
}

impl Heavy {
    /// `o` of the bucket keyed `source`, its figures cleaned.
    #[must_use]
    pub fn of(source: Source, o: &Observation) -> Self {
        Self {
            source,
            peak_1s: clean(o.peak_1s),
            peak_10s: clean(o.peak_10s),
            burst: clean(o.burst),
        }
    }
}

/// The [`HEAVY_K`] heaviest buckets by 1 s peak, heaviest first, one entry per source.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Top(Vec<Heavy>);

impl Top {
    /// Adds `h`: a source already named keeps its highest figures; a new one enters if there is
    /// room or it is heavier than the lightest, which then goes. A bucket that sent nothing over a
    /// second (1 s peak 0) is not named.
    pub fn add(&mut self, h: Heavy) {
        if let Some(e) = self.0.iter_mut().find(|e| e.source == h.source) {
            e.peak_1s = e.peak_1s.max(h.peak_1s);
            e.peak_10s = e.peak_10s.max(h.peak_10s);
            e.burst = e.burst.max(h.burst);
        } else if h.peak_1s <= 0.0 {
            return;
        } else if self.0.len() < HEAVY_K {
            self.0.push(h);
        } else if self.0.last().is_some_and(|l| h.peak_1s > l.peak_1s) {
            let last = self.0.len() - 1;
            self.0[last] = h;
        } else {
            return;
        }
        // At most HEAVY_K entries, nearly sorted: a stable sort is a few comparisons.
        self.0.sort_by(|a, b| b.peak_1s.total_cmp(&a.peak_1s));
    }

    /// Adds every entry of `other`.
    pub fn merge(&mut self, other: &Top) {
        for h in &other.0 {
            self.add(*h);
        }
    }

    /// The entries, heaviest first.
    #[must_use]
    pub fn entries(&self) -> &[Heavy] {
        &self.0
    }

    /// Entries held.
    #[must_use]
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether it names none.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}
