//! Measuring a run of a [`ClusterNet`](super::ClusterNet): [`Samples`] of what each host
//! delivered, the cluster's admitted rate over any window, and whether it converged
//! ([`Convergence`]), excusing only the windows that a [`Stall`] of the test's own threads skews.
//! Its own room because it is pure arithmetic over the samples, tested without namespaces or
//! root, while the rest of `cluster_net` builds and drives the testbed.

use std::net::IpAddr;
use std::thread;
use std::time::{Duration, Instant};

use super::{Sent, FLOOD};
use crate::Receiver;

/// Whose thread a [`Stall`] was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stalled {
    /// The flood sender ([`send_split`](super::send_split)).
    Sender,
    /// The receiving thread of host `N` (see [`Receiver::stalls`]).
    Receiver(usize),
}

impl std::fmt::Display for Stalled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Stalled::Sender => f.write_str("sender"),
            Stalled::Receiver(h) => write!(f, "receiver h{h}"),
        }
    }
}

/// A time one of the test's own threads did not run: the flood sender, or the receiving thread
/// of a host (see [`Receiver::stalls`]). Such a pause changes what a rate over a window measures
/// without the limiter doing anything different: see [`Stall::skews`].
#[derive(Clone, Debug, PartialEq)]
pub struct Stall {
    /// Whose.
    pub who: Stalled,
    /// When it began, seconds after the start.
    pub at: f64,
    /// How long it lasted, seconds.
    pub secs: f64,
}

impl Stall {
    /// Seconds after the start between which a sample's count is not what the limiter admitted
    /// by then at the paced load, because of this stall (and a sample in them can end a window
    /// that reads low or high for that reason alone):
    /// - a receiver's: the stall itself (what arrived in it was counted when the thread ran
    ///   again), and one sampling period after it;
    /// - the sender's: the stall, and as long again after it: a bucket refills while the flood
    ///   is paused, and the flood (at least twice the limit wherever these tests measure) spends
    ///   what refilled within that time. Admitting it is the limiter's contract (`burst + rate x
    ///   t`), and a window that holds it but not the pause reads high.
    #[must_use]
    pub fn skews(&self) -> (f64, f64) {
        let after = match self.who {
            Stalled::Sender => self.secs,
            Stalled::Receiver(_) => 0.0,
        };
        (self.at, self.at + self.secs + after + STALL_SLACK)
    }
}

/// One sampling period and a little (the tests sample every 50 ms): see [`Stall::skews`].
const STALL_SLACK: f64 = 0.06;

/// The stalls of the flood sender that sent `sent` and of every receiver in `receivers` (host
/// `i`'s is [`Stalled::Receiver`]`(i)`), seconds after `start`, in the order they began.
#[must_use]
pub fn stalls(sent: &Sent, receivers: &[Receiver], start: Instant) -> Vec<Stall> {
    let mut all = sent.stalls.clone();
    all.extend(receivers.iter().enumerate().flat_map(|(i, r)| {
        r.stalls().into_iter().map(move |(at, len)| Stall {
            who: Stalled::Receiver(i),
            at: at.saturating_duration_since(start).as_secs_f64(),
            secs: len.as_secs_f64(),
        })
    }));
    all.sort_by(|a, b| a.at.total_cmp(&b.at));
    all
}

/// What [`Samples::lowest_window`] found.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LowestWindow {
    /// The lowest rate of a window no stall explains, pps, and the window's start.
    pub lowest: Option<(f64, f64)>,
    /// The windows below the floor that stalls explain: their start and rate, pps.
    pub excused: Vec<(f64, f64)>,
}

/// What [`Samples::convergence`] found over a phase.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Convergence {
    /// Seconds after the change from which on every window is within (or excused); `None` if
    /// even the last window is neither.
    pub after: Option<f64>,
    /// Windows that start in the phase (at a sample time) and end in it.
    pub windows: usize,
    /// Of those, the ones within the tolerance.
    pub within: usize,
    /// Windows outside the tolerance but measured from a sample taken in a stall's skew: their
    /// start (seconds after the start) and their rate relative to the target.
    pub excused: Vec<(f64, f64)>,
}

/// What every host delivered from the flood source, `t` seconds after the start.
#[derive(Clone, Debug)]
pub struct Sample {
    /// Seconds after the start.
    pub t: f64,
    /// Flood packets delivered at each host so far.
    pub counts: Vec<u64>,
}

/// Samples taken through a run.
#[derive(Clone, Debug, Default)]
pub struct Samples(pub Vec<Sample>);

impl Samples {
    /// Reads every receiver's count of [`FLOOD`] now.
    pub fn take(&mut self, receivers: &[Receiver], start: Instant) {
        self.take_of(receivers, start, &[IpAddr::V4(FLOOD)]);
    }

    /// Reads every receiver's count of the datagrams from `sources` (together) now.
    pub fn take_of(&mut self, receivers: &[Receiver], start: Instant, sources: &[IpAddr]) {
        let t = start.elapsed().as_secs_f64();
        let counts = receivers
            .iter()
            .map(|r| {
                let counts = r.counts();
                sources
                    .iter()
                    .map(|s| counts.get(s).copied().unwrap_or(0))
                    .sum()
            })
            .collect();
        self.0.push(Sample { t, counts });
    }

    /// Samples every `every` until `start + until`.
    pub fn take_until(
        &mut self,
        receivers: &[Receiver],
        start: Instant,
        until: f64,
        every: Duration,
    ) {
        loop {
            self.take(receivers, start);
            let t = start.elapsed().as_secs_f64();
            if t >= until {
                return;
            }
            thread::sleep(every.min(Duration::from_secs_f64(until - t)));
        }
    }

    fn at_or_after(&self, t: f64) -> Option<&Sample> {
        self.0.iter().find(|s| s.t >= t)
    }

    fn at_or_before(&self, t: f64) -> Option<&Sample> {
        self.0.iter().rev().find(|s| s.t <= t)
    }

    /// Packets per second the whole cluster (every host) admitted between the samples nearest
    /// inside `[t1, t2]`.
    #[must_use]
    pub fn rate(&self, t1: f64, t2: f64) -> f64 {
        let (Some(a), Some(b)) = (self.at_or_after(t1), self.at_or_before(t2)) else {
            return f64::NAN;
        };
        if b.t <= a.t {
            return f64::NAN;
        }
        let sum = |s: &Sample| s.counts.iter().sum::<u64>();
        #[expect(clippy::cast_precision_loss, reason = "small counts")]
        let n = (sum(b) - sum(a)) as f64;
        n / (b.t - a.t)
    }

    /// The largest excess over `rate x T` of the whole cluster's admissions in any window `T`
    /// between two samples, and that window's ends (seconds).
    #[must_use]
    pub fn worst_excess(&self, rate: f64) -> (f64, (f64, f64)) {
        let total = |s: &Sample| s.counts.iter().sum::<u64>();
        let mut excess = f64::MIN;
        let mut worst = (0.0, 0.0);
        for (i, a) in self.0.iter().enumerate() {
            for b in &self.0[i + 1..] {
                #[expect(clippy::cast_precision_loss, reason = "small counts")]
                let e = total(b).saturating_sub(total(a)) as f64 - rate * (b.t - a.t);
                if e > excess {
                    excess = e;
                    worst = (a.t, b.t);
                }
            }
        }
        (excess, worst)
    }

    /// Packets per second host `h` admitted between the samples nearest inside `[t1, t2]`.
    #[must_use]
    pub fn host_rate(&self, h: usize, t1: f64, t2: f64) -> f64 {
        let (Some(a), Some(b)) = (self.at_or_after(t1), self.at_or_before(t2)) else {
            return f64::NAN;
        };
        #[expect(clippy::cast_precision_loss, reason = "small counts")]
        let n = (b.counts[h] - a.counts[h]) as f64;
        n / (b.t - a.t)
    }

    /// Packets host `h` admitted between the samples nearest inside `[t1, t2]` (0 if there are
    /// none).
    #[must_use]
    pub fn packets(&self, h: usize, t1: f64, t2: f64) -> f64 {
        let (Some(a), Some(b)) = (self.at_or_after(t1), self.at_or_before(t2)) else {
            return 0.0;
        };
        #[expect(clippy::cast_precision_loss, reason = "small counts")]
        let n = b.counts[h].saturating_sub(a.counts[h]) as f64;
        n
    }

    /// Seconds after `t0` (a change) from which on every `window`-long window ending by `t1`
    /// admitted within `tolerance` of `want` (relative): the first sample time `s >= t0` such
    /// that all windows `[u, u + window]` with `u >= s` (sample times) are within. `None` if
    /// even the last window is not.
    #[must_use]
    pub fn converged_after(
        &self,
        t0: f64,
        t1: f64,
        window: f64,
        want: f64,
        tolerance: f64,
    ) -> Option<f64> {
        self.convergence(t0, t1, window, want, tolerance, &[], &[])
            .after
    }

    /// [`Samples::converged_after`], where a window outside `tolerance` is excused, not counted
    /// against the convergence, if the samples it is measured between (at its start and at its
    /// end) were taken during [`Stall::skews`] of `stalls` long enough to explain it: a stall of
    /// `d` seconds moves a count by at most `d` seconds of traffic, so the window's distance from
    /// `want` beyond `tolerance` must be at most their `d`s over the window. Any other window
    /// outside still counts, wherever the stalls were; and the caller sees how many windows were
    /// within on their own.
    ///
    /// A window above `tolerance` is excused too by the `lapses` in it: spans `(from, to)`
    /// (seconds after the start) during which one host's shares had lapsed because its agent
    /// did not run a round in time (fail open: that host's buckets refilled at the whole rate,
    /// `want`), as docs/cluster.md's bound counts them: its excess beyond `tolerance` must be at
    /// most `want` times the lapsed seconds inside it.
    #[must_use]
    #[expect(
        clippy::too_many_arguments,
        reason = "a window, a target and what excuses it"
    )]
    pub fn convergence(
        &self,
        t0: f64,
        t1: f64,
        window: f64,
        want: f64,
        tolerance: f64,
        stalls: &[Stall],
        lapses: &[(f64, f64)],
    ) -> Convergence {
        let starts: Vec<f64> = self
            .0
            .iter()
            .map(|s| s.t)
            .filter(|&t| t >= t0 && t + window <= t1)
            .collect();
        // Seconds of stall whose skew holds a sample taken at `t`.
        let stalled = |t: f64| -> f64 {
            stalls
                .iter()
                .filter(|s| {
                    let (a, b) = s.skews();
                    t >= a && t <= b
                })
                .map(|s| s.secs)
                .sum()
        };
        let mut c = Convergence {
            windows: starts.len(),
            ..Convergence::default()
        };
        let mut converged = true;
        for &u in starts.iter().rev() {
            let r = self.rate(u, u + window) / want;
            let off = (r - 1.0).abs();
            let within = off <= tolerance;
            // Outside: excused if the stalls at its samples cover the seconds of traffic it is
            // off by beyond the tolerance.
            let lapsed: f64 = lapses
                .iter()
                .map(|&(a, b)| (b.min(u + window) - a.max(u)).max(0.0))
                .sum();
            let excused = !within
                && (match (self.at_or_after(u), self.at_or_before(u + window)) {
                    (Some(a), Some(b)) => (off - tolerance) * window <= stalled(a.t) + stalled(b.t),
                    _ => false,
                } || (r > 1.0 && (off - tolerance) * window <= lapsed));
            if within {
                c.within += 1;
            } else if excused {
                c.excused.push((u, r));
            }
            converged &= within || excused;
            if converged {
                c.after = Some(u - t0);
            }
        }
        c.excused.reverse();
        c
    }

    /// The most the cluster admitted over `rate x T` between any two samples (`T` the time
    /// between them), as `(excess, from, to)`: what docs/cluster.md's bound over any interval
    /// holds. 0 if it never admitted more than the rate.
    #[must_use]
    pub fn largest_excess(&self, rate: f64) -> (f64, f64, f64) {
        // excess(i, j) = (C_j - rate t_j) - (C_i - rate t_i): keep the smallest left term.
        let mut best = (0.0, 0.0, 0.0);
        let mut min: Option<(f64, f64)> = None;
        for s in &self.0 {
            #[expect(clippy::cast_precision_loss, reason = "small counts")]
            let here = s.counts.iter().sum::<u64>() as f64 - rate * s.t;
            if min.is_none_or(|(m, _)| here < m) {
                min = Some((here, s.t));
            }
            let (m, from) = min.expect("set above");
            if here - m > best.0 {
                best = (here - m, from, s.t);
            }
        }
        best
    }

    /// The lowest of the cluster's rates over `window`-long windows starting at a sample time in
    /// `[t0, t1 - window]`, among the windows a stall does not explain, and the windows below
    /// `floor` (pps) that stalls explain. A window below
    /// `floor` is explained, as in [`Samples::convergence`], when the samples it is measured
    /// between were taken during [`Stall::skews`] of stalls whose seconds cover its shortfall
    /// (`(floor - pps) / floor x window`).
    #[must_use]
    pub fn lowest_window(
        &self,
        t0: f64,
        t1: f64,
        window: f64,
        floor: f64,
        stalls: &[Stall],
    ) -> LowestWindow {
        let stalled = |t: f64| -> f64 {
            stalls
                .iter()
                .filter(|s| {
                    let (a, b) = s.skews();
                    t >= a && t <= b
                })
                .map(|s| s.secs)
                .sum()
        };
        let mut lowest: Option<(f64, f64)> = None;
        let mut excused = Vec::new();
        for u in self
            .0
            .iter()
            .map(|s| s.t)
            .filter(|&t| t >= t0 && t + window <= t1)
        {
            let r = self.rate(u, u + window);
            if !r.is_finite() {
                continue;
            }
            if r < floor {
                if let (Some(a), Some(b)) = (self.at_or_after(u), self.at_or_before(u + window)) {
                    if (floor - r) / floor * window <= stalled(a.t) + stalled(b.t) {
                        excused.push((u, r));
                        continue;
                    }
                }
            }
            if lowest.is_none_or(|(l, _)| r < l) {
                lowest = Some((r, u));
            }
        }
        LowestWindow { lowest, excused }
    }

    /// The cluster's admitted rate over `window`-long windows ending at each sample time in
    /// `[t0, t1]`, as `(t, pps)`: for charts and traces.
    #[must_use]
    pub fn trailing_rates(&self, t0: f64, t1: f64, window: f64) -> Vec<(f64, f64)> {
        self.0
            .iter()
            .filter(|s| s.t >= t0 + window && s.t <= t1)
            .map(|s| (s.t, self.rate(s.t - window, s.t)))
            .filter(|(_, r)| r.is_finite())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::{Sample, Samples, Stall, Stalled};

    const EVERY: f64 = 0.05;

    /// One host admitting `admitted(t)` packets by `t` (seconds), read every 50 ms for 10 s, the
    /// count read at `t` being `read(t)` of what was admitted.
    fn samples(admitted: impl Fn(f64) -> f64, read: impl Fn(f64) -> f64) -> Samples {
        let mut s = Samples::default();
        for i in 0..=200 {
            let t = f64::from(i) * EVERY;
            #[expect(
                clippy::cast_possible_truncation,
                clippy::cast_sign_loss,
                reason = "small"
            )]
            s.0.push(Sample {
                t,
                counts: vec![admitted(read(t)).round() as u64],
            });
        }
        s
    }

    fn steady(t: f64) -> f64 {
        1000.0 * t
    }

    fn now(t: f64) -> f64 {
        t
    }

    fn receiver(at: f64, secs: f64) -> Stall {
        Stall {
            who: Stalled::Receiver(0),
            at,
            secs,
        }
    }

    /// The receiving thread paused 115 ms from 5.0 s: what arrived meanwhile is counted at
    /// 5.115 s, so the samples read during the pause are stale.
    fn late_reader(t: f64) -> f64 {
        if t > 5.0 && t < 5.115 {
            5.0
        } else {
            t
        }
    }

    /// The lowest 1 s window: a stale read in a receiver's stall is excused by it, a real dip
    /// (nothing admitted for 300 ms) is not, and without the stall the stale read counts.
    #[test]
    fn the_lowest_window_excuses_only_what_a_stall_explains() {
        let s = samples(steady, late_reader);
        let stall = [receiver(5.0, 0.115)];
        let low = s.lowest_window(1.0, 10.0, 1.0, 950.0, &stall);
        let (r, _) = low.lowest.unwrap();
        assert!(r >= 950.0, "{low:?}");
        assert!(!low.excused.is_empty(), "{low:?}");
        let (r, _) = s.lowest_window(1.0, 10.0, 1.0, 950.0, &[]).lowest.unwrap();
        assert!(r < 950.0, "{r}");
        let dip = samples(
            |t| {
                if t < 6.0 {
                    1000.0 * t
                } else {
                    1000.0 * (t - 0.3).max(6.0)
                }
            },
            now,
        );
        let low = dip.lowest_window(1.0, 10.0, 1.0, 950.0, &stall);
        let (r, u) = low.lowest.unwrap();
        assert!(r < 800.0 && (5.3..=6.0).contains(&u), "{low:?}");
    }

    /// 400 packets more than the rate at 5 s: the largest excess is theirs, up to the sample
    /// that first counts them.
    #[test]
    fn the_largest_excess_is_the_densest_interval() {
        let s = samples(|t| 1000.0 * t + if t >= 5.0 { 400.0 } else { 0.0 }, now);
        let (e, from, to) = s.largest_excess(1000.0);
        assert!((e - 400.0).abs() < 1.0, "{e}");
        // Any interval that holds them at the rate otherwise: its start is one of the ties.
        assert!(from < 5.0 && (5.0..5.06).contains(&to), "{from} {to}");
        assert!(samples(steady, now).largest_excess(1000.0).0 < 1.0);
    }

    #[test]
    fn steady_windows_converge_at_once() {
        let s = samples(steady, now);
        let c = s.convergence(2.0, 10.0, 1.0, 1000.0, 0.10, &[], &[]);
        assert_eq!(c.after, Some(0.0));
        assert_eq!(c.within, c.windows);
        assert!(c.excused.is_empty());
        assert_eq!(s.converged_after(2.0, 10.0, 1.0, 1000.0, 0.10), Some(0.0));
    }

    /// What the failed run looked like (1 s windows 0.887-1.116 from one pause), and that the
    /// pause the receiver reports excuses exactly those windows.
    #[test]
    fn a_receiver_stall_skews_windows_and_excuses_only_them() {
        let s = samples(steady, late_reader);
        let lone = s.convergence(2.0, 10.0, 1.0, 1000.0, 0.10, &[], &[]);
        assert!(
            lone.after.is_some_and(|a| a > 3.0),
            "without the stall the pause reads as a late convergence: {lone:?}"
        );
        let c = s.convergence(2.0, 10.0, 1.0, 1000.0, 0.10, &[receiver(5.0, 0.115)], &[]);
        assert_eq!(c.after, Some(0.0), "{c:?}");
        assert!(!c.excused.is_empty());
        for &(u, r) in &c.excused {
            assert!((r - 1.0).abs() > 0.10 && (r - 1.0).abs() < 0.13, "{u}: {r}");
        }
        assert_eq!(c.within + c.excused.len(), c.windows);
    }

    /// A window that admits too much for a reason other than a stall still counts, though a
    /// stall happened elsewhere in the phase: 150 packets too many at 7.5 s.
    #[test]
    fn an_excess_away_from_the_stalls_still_fails_the_convergence() {
        let over = |t: f64| steady(t) + if t >= 7.5 { 150.0 } else { 0.0 };
        let s = samples(over, late_reader);
        let c = s.convergence(2.0, 10.0, 1.0, 1000.0, 0.10, &[receiver(5.0, 0.115)], &[]);
        assert!(c.after.is_some_and(|a| a > 5.0), "{c:?}");
        // The same excess inside a stall's skew is excused only there: a window whose samples
        // are both outside it is not.
        let s = samples(over, now);
        let c = s.convergence(2.0, 10.0, 1.0, 1000.0, 0.10, &[receiver(7.45, 0.1)], &[]);
        assert!(c.after.is_some_and(|a| a > 5.0), "{c:?}");
        // Nor does a stall too short to explain the excess excuse a window it touches: 30 ms
        // cannot account for 150 packets over a 1,000 pps budget (0.05 beyond the 10%).
        let c = s.convergence(2.0, 10.0, 1.0, 1000.0, 0.10, &[receiver(7.47, 0.03)], &[]);
        assert!(c.after.is_some_and(|a| a > 5.0), "{c:?}");
        assert!(c.excused.is_empty(), "{c:?}");
    }

    /// One host's shares lapsed for 100 ms at 7.5 s (its agent did not run a round in time):
    /// that host at the whole rate meanwhile, 100 packets over the budget. The lapse excuses the
    /// windows that hold it, and only them; a shorter one does not cover the excess, and a
    /// window short of the budget is never excused by a lapse (fail open admits more, not less).
    #[test]
    fn a_lapse_excuses_the_excess_it_allows_and_no_more() {
        let over = |t: f64| steady(t) + 1000.0 * (t - 7.5).clamp(0.0, 0.1);
        let s = samples(over, now);
        let lone = s.convergence(2.0, 10.0, 1.0, 1000.0, 0.05, &[], &[]);
        assert!(lone.after.is_some_and(|a| a > 4.0), "{lone:?}");
        let c = s.convergence(2.0, 10.0, 1.0, 1000.0, 0.05, &[], &[(7.5, 7.6)]);
        assert_eq!(c.after, Some(0.0), "{c:?}");
        assert!(
            !c.excused.is_empty() && c.excused.iter().all(|&(_, r)| r > 1.0),
            "{c:?}"
        );
        let c = s.convergence(2.0, 10.0, 1.0, 1000.0, 0.05, &[], &[(7.5, 7.52)]);
        assert!(c.after.is_some_and(|a| a > 4.0), "{c:?}");
        let under = |t: f64| steady(t) - 1000.0 * (t - 7.5).clamp(0.0, 0.1);
        let c = samples(under, now).convergence(2.0, 10.0, 1.0, 1000.0, 0.05, &[], &[(7.5, 7.6)]);
        assert!(c.after.is_some_and(|a| a > 4.0), "{c:?}");
    }

    /// The sender paused 115 ms from 5.0 s: nothing arrived, then the refilled tokens went at
    /// once (115 packets in the next 40 ms). The limiter's contract, not a miss; the sender's
    /// stall covers the windows that read high for it.
    #[test]
    fn a_sender_stall_excuses_the_refill_spent_after_it() {
        let paused = |t: f64| {
            if t <= 5.0 {
                steady(t)
            } else if t <= 5.115 {
                steady(5.0)
            } else if t <= 5.155 {
                steady(5.0) + 115.0 * (t - 5.115) / 0.04 + 1000.0 * (t - 5.115)
            } else {
                steady(t)
            }
        };
        let s = samples(paused, now);
        let lone = s.convergence(2.0, 10.0, 1.0, 1000.0, 0.10, &[], &[]);
        assert!(lone.after.is_some_and(|a| a > 3.0), "{lone:?}");
        let sender = Stall {
            who: Stalled::Sender,
            at: 5.0,
            secs: 0.115,
        };
        let c = s.convergence(
            2.0,
            10.0,
            1.0,
            1000.0,
            0.10,
            std::slice::from_ref(&sender),
            &[],
        );
        assert_eq!(c.after, Some(0.0), "{c:?}");
        assert_eq!(c.excused.len() + c.within, c.windows);
        // The sender's stall skews the samples for as long again after it (the refill spent),
        // a receiver's only for one sampling period after it.
        let (a, b) = sender.skews();
        assert!(
            (a - 5.0).abs() < 1e-9 && (b - (5.0 + 0.23 + 0.06)).abs() < 1e-9,
            "{a} {b}"
        );
        let (a, b) = receiver(5.0, 0.115).skews();
        assert!(
            (a - 5.0).abs() < 1e-9 && (b - (5.0 + 0.115 + 0.06)).abs() < 1e-9,
            "{a} {b}"
        );
    }
}
