//! From a learned distribution to a proposed limit: `rate` at the quantile asked of the 10 s
//! peak rates, times the headroom; `burst` at that quantile of the bursts, times the headroom,
//! and for TCP at least [`TCP_BURST_SECS`] of the rate; and what that limit would have done to
//! the traffic observed, naming the heaviest sources it would have limited.

use serde::Serialize;
use sketches_ddsketch::DDSketch;

use super::{heavy::Heavy, history::Dist};

/// The burst a TCP flow needs, in seconds of the rate (the config's, which `check` warns by).
pub use crate::config::TCP_BURST_SECS;
/// Bins of the histogram.
const HISTOGRAM_BINS: usize = 10;
/// Points of the quantile grid the effect is integrated over.
const GRID: u32 = 200;

/// What `suggest` is asked.
#[derive(Clone, Debug, PartialEq)]
pub struct Query {
    /// Only this rule.
    pub rule: Option<String>,
    /// The quantile of the sources the limit should let through, in (0, 1].
    pub quantile: f64,
    /// Factor over the observed quantile, at least 1.
    pub headroom: f64,
    /// How far back, seconds (at most a day).
    pub since_secs: u64,
}

impl Query {
    /// Whether its values are in range (the API's handler checks them; the test harness checks
    /// that it did).
    ///
    /// # Errors
    /// What is out of range.
    pub fn check(&self) -> Result<(), String> {
        let ok = self.quantile > 0.0
            && self.quantile <= 1.0
            && (1.0..=1000.0).contains(&self.headroom)
            && (1..=super::history::DAY_SECS).contains(&self.since_secs);
        if ok {
            Ok(())
        } else {
            Err(format!("suggest asked with {self:?}"))
        }
    }
}

/// Checks what `suggest --apply` sets: `limit` 1 to [`ratelimit_common::MAX_LIMITS`], `rate` 1
/// to [`crate::config::MAX_RATE`], `burst` at least 1.
///
/// # Errors
/// What is out of range, naming it.
pub fn check_apply((limit, rate, burst): (usize, u64, u64)) -> Result<(), String> {
    use ratelimit_common::MAX_LIMITS;
    if !(1..=MAX_LIMITS).contains(&limit) {
        return Err(format!("limit: {limit} is not between 1 and {MAX_LIMITS}"));
    }
    if !(1..=crate::config::MAX_RATE).contains(&rate) || burst == 0 {
        return Err(format!(
            "rate {rate} and burst {burst}: the rate must be 1 to {}, the burst at least 1",
            crate::config::MAX_RATE
        ));
    }
    Ok(())
}

/// Default quantile, headroom and history of `suggest`.
pub const DEFAULTS: (f64, f64, u64) = (0.99, 1.5, 3600);

/// Some quantiles of a distribution.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Quantiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub p999: f64,
    pub max: f64,
    /// At the quantile asked.
    pub q: f64,
}

/// The observed distributions.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Observed {
    /// Peak rates over 1 s, packets/s.
    pub peak_1s: Quantiles,
    /// Peak rates over 10 s, packets/s.
    pub peak_10s: Quantiles,
    /// Largest bursts, packets.
    pub burst: Quantiles,
}

/// The proposed limit.
#[derive(Clone, Copy, Debug, Serialize, PartialEq, Eq)]
pub struct Proposed {
    pub rate: u64,
    pub burst: u64,
}

/// What the proposed limit would have done to the observed traffic.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Effect {
    /// Sources whose 10 s peak exceeds the rate (estimated from the sketch).
    pub limited_sources: u64,
    /// Share of the observed peak traffic above the rate, 0 to 1.
    pub limited_share: f64,
    /// The heaviest sources it would have limited, heaviest first by 1 s peak: of the
    /// [`super::heavy::HEAVY_K`] heaviest kept per slot, those whose 10 s peak exceeds the rate or
    /// whose 1 s peak exceeds the rate and the burst together (more in their busiest second than
    /// the bucket lets through in one).
    pub limited_heaviest: Vec<Heavy>,
}

/// Of `dist`'s heaviest buckets, those `p` would have limited, heaviest first.
#[expect(clippy::cast_precision_loss, reason = "a rate and a burst")]
fn limited_heaviest(dist: &Dist, p: Proposed) -> Vec<Heavy> {
    let (rate, burst) = (p.rate as f64, p.burst as f64);
    dist.heavy
        .entries()
        .iter()
        .filter(|h| h.peak_10s > rate || h.peak_1s > rate + burst)
        .copied()
        .collect()
}

/// One bin of the histogram of the 10 s peak rates (log-spaced).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Bin {
    /// Upper bound, packets/s.
    pub up_to: f64,
    pub sources: u64,
}

/// The suggestion for one limit of a rule.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Suggestion {
    pub rule: String,
    /// 1 the rule's own limit, 2.. its `[[rule.limit]]`s.
    pub limit: usize,
    /// Sources observed (a source counts once per 5-minute slot it sent in; scaled up by the
    /// sample when the store holds more buckets than are followed).
    pub sources: u64,
    pub observed: Observed,
    pub proposed: Proposed,
    /// The limit in force: (rate, burst), if it has a packet rate.
    pub current: Option<Proposed>,
    /// Whether the rule's traffic is TCP (its protocol).
    pub tcp: bool,
    /// Why the proposal is what it is, in words.
    pub reasons: Vec<String>,
    pub effect: Effect,
    pub histogram: Vec<Bin>,
}

fn q(s: &DDSketch, x: f64) -> f64 {
    s.quantile(x.clamp(0.0, 1.0)).ok().flatten().unwrap_or(0.0)
}

fn quantiles(s: &DDSketch, at: f64) -> Quantiles {
    Quantiles {
        p50: q(s, 0.5),
        p90: q(s, 0.9),
        p99: q(s, 0.99),
        p999: q(s, 0.999),
        max: q(s, 1.0),
        q: q(s, at),
    }
}

/// The share of the observations at or below `x`. The sketch's quantile at `r` is its
/// observation of (0-based) rank `floor(r (n - 1))`, so the largest `r` whose quantile is at
/// most `x` (found by bisection) is `k / (n - 1)` for the `k` observations at or below `x`:
/// the share is `k / n`. (Taking `r` itself for the share missed the largest observation: a
/// rate between the two largest of 20 sources' peaks limited "0 sources".)
#[expect(clippy::cast_precision_loss, reason = "a count of observations")]
fn rank(s: &DDSketch, x: f64) -> f64 {
    let n = s.count() as f64;
    if n == 0.0 || x >= q(s, 1.0) {
        return 1.0;
    }
    if x < q(s, 0.0) {
        return 0.0;
    }
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    for _ in 0..40 {
        let mid = f64::midpoint(lo, hi);
        if q(s, mid) <= x {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    ((lo * (n - 1.0)).round() / n).min(1.0)
}

#[expect(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "rates and counts, rounded up and clamped"
)]
fn up(x: f64) -> u64 {
    if x.is_finite() {
        x.ceil().clamp(1.0, 1e9) as u64
    } else {
        1
    }
}

/// The histogram of `s` in [`HISTOGRAM_BINS`] log-spaced bins from its least positive value to
/// its largest.
#[expect(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_precision_loss,
    reason = "counts from ranks"
)]
fn histogram(s: &DDSketch, scale: f64) -> Vec<Bin> {
    let n = s.count() as f64;
    let (lo, hi) = (q(s, 0.0).max(0.01), q(s, 1.0));
    if n == 0.0 || hi <= 0.0 {
        return Vec::new();
    }
    let ratio = (hi / lo).max(1.0 + 1e-9).powf(1.0 / HISTOGRAM_BINS as f64);
    let mut below = 0.0;
    (1..=HISTOGRAM_BINS)
        .map(|i| {
            let up_to = if i == HISTOGRAM_BINS {
                hi
            } else {
                lo * ratio.powi(i32::try_from(i).unwrap_or(0))
            };
            let at = rank(s, up_to);
            let sources = ((at - below).max(0.0) * n * scale).round() as u64;
            below = at.max(below);
            Bin { up_to, sources }
        })
        .collect()
}

/// The suggestion for `rule`'s limit `limit` from what was observed (`dist`), `scale` the
/// inverse of the share of buckets followed, `tcp` whether the rule's traffic is TCP.
#[must_use]
#[expect(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_precision_loss,
    reason = "counts and rates, rounded"
)]
pub fn suggest(
    (rule, limit): (&str, usize),
    dist: &Dist,
    query: &Query,
    (scale, tcp, current): (f64, bool, Option<Proposed>),
) -> Suggestion {
    let at = query.quantile;
    let observed = Observed {
        peak_1s: quantiles(&dist.peak_1s, at),
        peak_10s: quantiles(&dist.peak_10s, at),
        burst: quantiles(&dist.burst, at),
    };
    let rate = up(observed.peak_10s.q * query.headroom);
    let mut reasons = vec![format!(
        "rate: the {} quantile of the sources' 10 s peak rates ({:.1}/s) x {} headroom",
        at, observed.peak_10s.q, query.headroom
    )];
    let mut burst = up(observed.burst.q * query.headroom);
    reasons.push(format!(
        "burst: the {} quantile of the sources' bursts ({:.1}) x {} headroom",
        at, observed.burst.q, query.headroom
    ));
    let tcp_floor = up(rate as f64 * TCP_BURST_SECS);
    if tcp && burst < tcp_floor {
        burst = tcp_floor;
        reasons.push(format!(
            "burst raised to rate x {TCP_BURST_SECS} s = {tcp_floor}: the rule's traffic is TCP, \
             and a flow whose burst is cut waits out TCP's 200 ms minimum RTO, its goodput \
             falling to about burst x 5 per second"
        ));
    } else if tcp {
        reasons.push(format!(
            "burst is at least rate x {TCP_BURST_SECS} s = {tcp_floor}, as the rule's TCP traffic needs"
        ));
    }
    let n = dist.count() as f64;
    let rate_f = rate as f64;
    let limited_sources = ((1.0 - rank(&dist.peak_10s, rate_f)) * n * scale).round() as u64;
    let (mut excess, mut total) = (0.0, 0.0);
    for i in 0..GRID {
        let v = q(&dist.peak_10s, (f64::from(i) + 0.5) / f64::from(GRID));
        excess += (v - rate_f).max(0.0);
        total += v;
    }
    let proposed = Proposed { rate, burst };
    Suggestion {
        rule: rule.to_owned(),
        limit,
        sources: (n * scale).round() as u64,
        observed,
        proposed,
        current,
        tcp,
        reasons,
        effect: Effect {
            limited_sources,
            limited_share: if total > 0.0 { excess / total } else { 0.0 },
            limited_heaviest: limited_heaviest(dist, proposed),
        },
        histogram: histogram(&dist.peak_10s, scale),
    }
}

/// Seconds of a duration written as numbers with units, `90s`, `30m`, `1h`, `1h30m`, `1d`; at
/// least a second, at most a day.
///
/// # Errors
/// What is wrong with it.
pub fn parse_since(s: &str) -> Result<u64, String> {
    let bad = || format!("{s:?} is not a duration such as 30m, 1h or 1d");
    let mut total: u64 = 0;
    let mut digits = String::new();
    for c in s.trim().chars() {
        if c.is_ascii_digit() {
            digits.push(c);
            continue;
        }
        let unit = match c {
            's' => 1,
            'm' => 60,
            'h' => 3600,
            'd' => 86_400,
            _ => return Err(bad()),
        };
        let n: u64 = digits.parse().map_err(|_| bad())?;
        digits.clear();
        total = n
            .checked_mul(unit)
            .and_then(|v| total.checked_add(v))
            .ok_or_else(bad)?;
    }
    if !digits.is_empty() || total == 0 {
        return Err(bad());
    }
    if total > super::history::DAY_SECS {
        return Err(format!("{s:?} is longer than a day (the history kept)"));
    }
    Ok(total)
}
