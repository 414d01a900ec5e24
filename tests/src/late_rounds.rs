//! The agents' own stalls: sync rounds that set their shares late (`status --json`'s
//! `cluster.late_rounds`, see the agent's `LateRound`), as spans of seconds after a test's start.
//!
//! A change of split reaches a host's buckets at its next round; a round overdue by `L` (the
//! agent starved of CPU on a busy machine) brings it `L` later. A convergence measured in sync
//! intervals is therefore held to its limit plus the time within it during which some agent's
//! round was overdue: measured by the agents themselves, never assumed.

use std::time::{Duration, Instant};

use serde_json::Value;

use ratelimit::cluster::{status::LATE_ROUNDS_SHOWN as SHOWN, timing::Timing};

/// Now, Unix milliseconds (the agents' `late_rounds` are dated so).
pub use crate::cluster::unix_ms;
use crate::{cluster_net::status, AgentProcess};

/// Reads every agent's `status --json` every `every` until `until`, and once more then: the
/// readings [`Overdue::of`] takes (an agent keeps only its last [`SHOWN`] late rounds, which a
/// loaded machine fills in [`SHOWN`] sync intervals). A reading that fails is left out.
#[must_use]
pub fn read_until(
    agents: &[AgentProcess],
    until: Instant,
    every: Duration,
) -> Vec<(usize, u64, Value)> {
    let mut readings = Vec::new();
    loop {
        let now = Instant::now();
        let last = now >= until;
        if !last {
            std::thread::sleep(every.min(until - now));
        }
        for (i, a) in agents.iter().enumerate() {
            if let Ok(v) = status(a) {
                readings.push((i, unix_ms(), v));
            }
        }
        if last {
            return readings;
        }
    }
}

/// Runs `work` while another thread reads every agent's `status --json` as [`read_until`]
/// does; returns what `work` returned and the readings.
pub fn reading_through<R>(
    agents: &[AgentProcess],
    until: Instant,
    every: Duration,
    work: impl FnOnce() -> R,
) -> (R, Vec<(usize, u64, Value)>) {
    std::thread::scope(|sc| {
        let reader = sc.spawn(|| read_until(agents, until, every));
        let r = work();
        (r, reader.join().unwrap())
    })
}

/// The spans (from, to), seconds after a start, during which some agent's round was overdue.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Overdue {
    /// Each late round: `(agent, overdue from, landed)`, seconds after the start, in the order
    /// they began; overdue from a quarter sync interval after the round was due.
    pub spans: Vec<(usize, f64, f64)>,
    /// Agents whose status kept fewer late rounds than they had since the start (their list is
    /// full and its oldest is after the start): some of their stalls are not in `spans`, so a
    /// deadline from these is, if anything, too strict.
    pub incomplete: Vec<usize>,
    /// Each round that renewed shares which had lapsed (`lapsed_ms`): `(agent, renewed at,
    /// seconds lapsed)`. Meanwhile that host's buckets refilled at the whole rate (fail open):
    /// it may have admitted up to a burst and `rate` times the lapse beyond its share.
    pub lapses: Vec<(usize, f64, f64)>,
}

impl Overdue {
    /// The late rounds in `readings`, relative to a start at `start_unix_ms`: each reading is
    /// one agent's `status --json` (`(agent, read at, status)`, Unix ms), read as often as the
    /// run needs to keep every late round (an agent keeps its last [`SHOWN`]); a round read
    /// twice counts once.
    #[must_use]
    pub fn of(readings: &[(usize, u64, Value)], start_unix_ms: u64) -> Self {
        let mut o = Overdue::default();
        let mut seen = std::collections::HashSet::new();
        let mut last_read: std::collections::HashMap<usize, u64> = std::collections::HashMap::new();
        let mut readings: Vec<&(usize, u64, Value)> = readings.iter().collect();
        readings.sort_by_key(|r| r.1);
        for &&(i, read_at, ref s) in &readings {
            let rounds = s["cluster"]["late_rounds"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            let mut oldest = u64::MAX;
            for r in &rounds {
                let (Some(at), Some(late)) = (r["at_unix_ms"].as_u64(), r["late_ms"].as_u64())
                else {
                    continue;
                };
                oldest = oldest.min(at);
                if at <= start_unix_ms || !seen.insert((i, at, late)) {
                    continue;
                }
                #[expect(clippy::cast_precision_loss, reason = "milliseconds of a test run")]
                let landed = (at - start_unix_ms) as f64 / 1000.0;
                // Overdue from the agent's own threshold on (a quarter sync interval, which
                // a debug agent's round on a busy 2-core machine often nears by itself): the
                // limit a test holds convergence to already includes that much.
                let threshold = s["cluster"]["sync_interval_ms"]
                    .as_u64()
                    .map_or(0, |ms| Timing::new(ms).late_after_ns() / 1_000_000);
                #[expect(clippy::cast_precision_loss, reason = "milliseconds")]
                let overdue_from = landed - late.saturating_sub(threshold) as f64 / 1000.0;
                o.spans.push((i, overdue_from, landed));
                let lapsed = r["lapsed_ms"].as_u64().unwrap_or(0);
                if lapsed > 0 {
                    #[expect(clippy::cast_precision_loss, reason = "milliseconds")]
                    o.lapses.push((i, landed, lapsed as f64 / 1000.0));
                }
            }
            let before = last_read.insert(i, read_at).unwrap_or(start_unix_ms);
            if rounds.len() >= SHOWN && oldest > before && !o.incomplete.contains(&i) {
                o.incomplete.push(i);
            }
        }
        o.spans.sort_by(|a, b| a.1.total_cmp(&b.1));
        o.lapses.sort_by(|a, b| a.1.total_cmp(&b.1));
        o
    }

    /// Seconds within `[t0, t1]` during which some agent's round was overdue (the union of the
    /// spans, so agents stalled together count once).
    #[must_use]
    pub fn within(&self, t0: f64, t1: f64) -> f64 {
        let mut total = 0.0;
        let mut reached = t0;
        for &(_, a, b) in &self.spans {
            let (a, b) = (a.max(reached), b.min(t1));
            if b > a {
                total += b - a;
                reached = b;
            }
        }
        total
    }

    /// The lapses (agent, renewed at, seconds lapsed) that ended within `[t0, t1]`.
    pub fn lapses_within(&self, t0: f64, t1: f64) -> impl Iterator<Item = &(usize, f64, f64)> {
        self.lapses
            .iter()
            .filter(move |l| l.1 >= t0 && l.1 - l.2 <= t1)
    }

    /// What a host may admit beyond its share over the lapses that ended within `[t0, t1]`:
    /// `rate` times each lapse, rounded up (its buckets refilled at the whole rate meanwhile).
    #[must_use]
    pub fn lapsed_refill(&self, rate: f64, t0: f64, t1: f64) -> f64 {
        // Folded from 0.0: an empty `sum` of floats is -0.0, printed "-0".
        self.lapses_within(t0, t1)
            .fold(0.0, |sum, l| sum + (rate * l.2).ceil())
    }

    /// Seconds after `t0` by which something promised within `limit` seconds of `t0` must
    /// have happened: `limit`, extended by the overdue time within the extended period (to a
    /// fixed point, as a stall in the extension delays it too).
    #[must_use]
    pub fn deadline(&self, t0: f64, limit: f64) -> f64 {
        let mut d = limit;
        for _ in 0..64 {
            let next = limit + self.within(t0, t0 + d);
            if next <= d + 1e-9 {
                break;
            }
            d = next;
        }
        d
    }
}

#[cfg(test)]
mod tests {
    use super::Overdue;

    fn overdue(spans: &[(f64, f64)]) -> Overdue {
        Overdue {
            spans: spans.iter().map(|&(a, b)| (0, a, b)).collect(),
            incomplete: Vec::new(),
            lapses: Vec::new(),
        }
    }

    #[test]
    fn agents_stalled_together_count_once_and_only_within_the_period() {
        let o = overdue(&[(1.0, 1.2), (1.1, 1.3), (2.0, 2.5)]);
        assert!((o.within(0.0, 10.0) - 0.8).abs() < 1e-9);
        assert!((o.within(1.25, 2.1) - 0.15).abs() < 1e-9);
        assert!(o.within(3.0, 4.0).abs() < 1e-9);
    }

    #[test]
    fn a_deadline_moves_by_the_stalls_in_it_and_in_its_extension() {
        // Without stalls: the limit.
        assert!((overdue(&[]).deadline(5.0, 0.3) - 0.3).abs() < 1e-9);
        // 0.1 s overdue inside, then 0.05 s in the extension.
        let o = overdue(&[(5.1, 5.2), (5.35, 5.4)]);
        assert!((o.deadline(5.0, 0.3) - 0.45).abs() < 1e-9);
        // A stall before the change does not count.
        assert!((overdue(&[(4.0, 4.9)]).deadline(5.0, 0.3) - 0.3).abs() < 1e-9);
    }

    #[test]
    fn late_rounds_are_read_from_status_relative_to_the_start() {
        let s = serde_json::json!({"cluster": {"sync_interval_ms": 200, "late_rounds": [
            {"at_unix_ms": 1_000_500, "late_ms": 150, "lapsed_ms": 0},
            {"at_unix_ms": 1_002_000, "late_ms": 400, "lapsed_ms": 150},
            {"at_unix_ms": 999_000, "late_ms": 50}
        ]}});
        let o = Overdue::of(&[(0, 1_001_000, s)], 1_000_000);
        assert_eq!(
            o.spans.len(),
            2,
            "a round that landed before the start is not the run's"
        );
        assert!((o.spans[0].1 - 0.4).abs() < 1e-9 && (o.spans[0].2 - 0.5).abs() < 1e-9);
        assert!(o.incomplete.is_empty());
        assert_eq!(o.lapses, vec![(0, 2.0, 0.15)]);
        assert_eq!(o.lapses_within(2.1, 3.0).count(), 0);
        assert_eq!(o.lapses_within(1.0, 1.9).count(), 1, "lapsed from 1.85 s");
        assert!((o.lapsed_refill(1000.0, 1.0, 1.9) - 150.0).abs() < 1e-9);
        assert!(
            (o.lapsed_refill(333.0, 1.0, 1.9) - 50.0).abs() < 1e-9,
            "49.95 rounded up"
        );
        assert!(o.lapsed_refill(1000.0, 2.1, 3.0).to_bits() == 0.0f64.to_bits());
    }

    #[test]
    fn a_round_read_twice_counts_once_and_a_full_list_is_told() {
        let round = |at: u64| serde_json::json!({"at_unix_ms": at, "late_ms": 30});
        let full: Vec<_> = (0..32).map(|k| round(2_000_000 + k)).collect();
        let s = serde_json::json!({"cluster": {"late_rounds": full}});
        let o = Overdue::of(&[(1, 2_100_000, s.clone()), (1, 2_200_000, s)], 1_000_000);
        assert_eq!(o.spans.len(), 32);
        assert_eq!(
            o.incomplete,
            vec![1],
            "32 kept, the oldest after the start: some lost"
        );
    }
}
