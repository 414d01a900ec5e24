use super::*;
use crate::{cluster::remote::DemandWindow, maps::store::withhold_tat};

const MS: u64 = 1_000_000;
const S: u64 = 1_000 * MS;
/// Three 100 ms sync intervals.
const LAG: u64 = 300 * MS;

/// 1000 pps, burst 500.
fn limit() -> Limit {
    Limit {
        flags: rule_flags::PKT_LIMIT,
        pkt_interval_ns: MS,
        pkt_tolerance_ns: 500 * MS,
        ..Limit::default()
    }
}

#[test]
fn the_share_is_the_demand_over_the_clusters_and_fails_open() {
    // Steady state: 8 hosts of 500 pps each.
    assert!((share(500.0, 3500.0, 1.0) - 0.125).abs() < 1e-12);
    // 95/5.
    assert!((share(3800.0, 200.0, 1.0) - 0.95).abs() < 1e-12);
    // No counted peer has demand (none counted, silent, uncounted): the whole budget.
    assert_eq!(share(500.0, 0.0, 1.0), 1.0);
    assert_eq!(share(0.0, 0.0, 1.0), 1.0);
    assert_eq!(share(500.0, f64::NAN, 1.0), 1.0);
    // No demand here while peers have some: none of the refill.
    assert_eq!(share(0.0, 100.0, 1.0), 0.0);
    // on_partition = "share": a lone host of three.
    assert!((share(500.0, 0.0, 1.0 / 3.0) - 1.0 / 3.0).abs() < 1e-12);
    assert!((share(500.0, 500.0, 2.0 / 3.0) - 1.0 / 3.0).abs() < 1e-12);
    // A peer claiming any demand takes the share towards nothing, never below.
    assert!(share(1.0, 1e300, 1.0) >= 0.0);
    assert_eq!(share(1.0, f64::INFINITY, 1.0), 0.0);
}

#[test]
fn a_round_withholds_the_rest_of_its_refill_and_no_more_than_the_lag() {
    assert_eq!(advance_ns(0.125, 100 * MS, LAG), 87_500_000);
    assert_eq!(advance_ns(1.0, 100 * MS, LAG), 0);
    assert_eq!(advance_ns(0.0, 100 * MS, LAG), 100 * MS);
    // A round that ran late takes back no more than the lag allowance.
    assert_eq!(advance_ns(0.0, 5 * S, LAG), LAG);
    // A full bucket (TAT at or before now) moves from now, one not full from its TAT; no
    // advance passes the ceiling.
    let now = 1_000 * S;
    assert_eq!(
        withhold_tat(now - 5, now, 50 * MS, u64::MAX),
        (now + 50 * MS, false)
    );
    assert_eq!(
        withhold_tat(now + 10 * MS, now, 50 * MS, u64::MAX),
        (now + 60 * MS, false)
    );
    let (c, _) = ceilings(&limit(), LAG, now);
    assert_eq!(c, now + 800 * MS);
    assert_eq!(
        withhold_tat(now + 600 * MS, now, 300 * MS, c),
        (now + 800 * MS, true)
    );
    assert_eq!(
        withheld(&limit(), 87_500_000, 0),
        (87, 0),
        "in packets of the rate"
    );
}

/// Hosts sharing one budget in a simulation of the XDP program's bucket (GCRA, one packet a
/// time) and of the rounds: every 100 ms each host divides by the demand every host published
/// one round earlier (gossip lag; its own figure too, as the agent does; each over the last
/// [`DEMAND_ROUNDS`](crate::cluster::remote::DEMAND_ROUNDS) rounds), and slows its bucket to its
/// share.
struct Cluster {
    hosts: Vec<Host>,
    /// What each host published last round (packets/s), as the others read it now.
    published: Vec<f64>,
    /// Extra demand a peer with the key claims (packets/s), read by every host.
    claim: f64,
    now: u64,
}

#[derive(Clone, Default)]
struct Host {
    tat: u64,
    demand: u64,
    window: DemandWindow,
    admitted: u64,
    /// Fractional packets of the flood still to send.
    carry: f64,
}

impl Cluster {
    fn new(n: usize) -> Self {
        Self {
            hosts: vec![Host::default(); n],
            published: vec![0.0; n],
            claim: 0.0,
            now: 1_000 * S,
        }
    }

    /// Runs `ms` milliseconds of a flood of `pps` split by `weights`; returns the packets the
    /// cluster admitted in each 100 ms.
    fn run(&mut self, ms: u64, pps: f64, weights: &[f64]) -> Vec<u64> {
        let l = limit();
        let total: f64 = weights.iter().sum();
        let mut per_round = Vec::new();
        let mut admitted = 0;
        for _ in 0..ms {
            self.now += MS;
            for (h, w) in self.hosts.iter_mut().zip(weights) {
                h.carry += pps * w / total / 1000.0;
                while h.carry >= 1.0 {
                    h.carry -= 1.0;
                    h.demand += 1;
                    let next = h.tat.max(self.now) + l.pkt_interval_ns;
                    if next - self.now <= l.pkt_tolerance_ns {
                        h.tat = next;
                        h.admitted += 1;
                        admitted += 1;
                    }
                }
            }
            if (self.now / MS).is_multiple_of(100) {
                let fresh: Vec<f64> = self
                    .hosts
                    .iter_mut()
                    .map(|h| {
                        h.window.push(self.now, h.demand);
                        h.window.rate(1e9)
                    })
                    .collect();
                let all: f64 = self.published.iter().sum::<f64>() + self.claim;
                for (i, h) in self.hosts.iter_mut().enumerate() {
                    let peers = all - self.published[i];
                    // Its own figure as the others read it: published last round.
                    let s = share(self.published[i], peers, 1.0);
                    let a = advance_ns(s, 100 * MS, LAG);
                    let c = ceilings(&l, LAG, self.now).0;
                    h.tat = withhold_tat(h.tat, self.now, a, c).0;
                }
                self.published = fresh;
                per_round.push(admitted);
                admitted = 0;
            }
        }
        per_round
    }
}

/// The packets admitted in each 1 s window starting at every round from `from` on, over the
/// budget (1000).
fn windows(rounds: &[u64], from: usize) -> Vec<f64> {
    (from..=rounds.len().saturating_sub(10))
        .map(|i| rounds[i..i + 10].iter().sum::<u64>() as f64 / 1000.0)
        .collect()
}

/// Eight hosts, a flood at 4x the budget: even, 95/5, even, 95/5 elsewhere. After each change
/// of split, every 1 s window from 3 sync intervals on admits within 10% of the budget, and
/// each phase after a second within 5% (the old charging of admissions swung 0.5-1.6x over
/// 1 s windows with an even split, and took 3-7 s to converge).
#[test]
fn eight_hosts_admit_the_budget_and_converge_within_three_rounds_of_a_change() {
    let mut c = Cluster::new(8);
    let even = [1.0; 8];
    let h0h1 = [95.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
    let h7h6 = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 95.0];
    // The start: every bucket spends its burst once (8 x 500), not measured.
    c.run(10_000, 4000.0, &even);
    for (name, w) in [
        ("95/5", &h0h1),
        ("even", &even),
        ("95/5 elsewhere", &h7h6),
        ("even", &even),
    ] {
        let rounds = c.run(8_000, 4000.0, w);
        for (i, r) in windows(&rounds, 3).iter().enumerate() {
            assert!(
                (r - 1.0).abs() <= 0.10,
                "{name}: the 1 s window from round {} admitted {r:.3} x the budget",
                i + 3
            );
        }
        let settled = rounds[10..].iter().sum::<u64>() as f64 / 7_000.0;
        assert!(
            (settled - 1.0).abs() <= 0.05,
            "{name}: {settled:.3} x the budget after settling"
        );
        for (i, r) in windows(&rounds, 10).iter().enumerate() {
            assert!(
                (r - 1.0).abs() <= 0.05,
                "{name}: the 1 s window from round {} admitted {r:.3}",
                i + 10
            );
        }
    }
}

/// Demand below the budget: nobody is limited, whatever the split.
#[test]
fn demand_under_the_budget_is_not_limited() {
    let mut c = Cluster::new(4);
    c.run(5_000, 800.0, &[1.0, 2.0, 3.0, 4.0]);
    let before: Vec<u64> = c.hosts.iter().map(|h| h.demand - h.admitted).collect();
    c.run(5_000, 800.0, &[1.0, 2.0, 3.0, 4.0]);
    let after: Vec<u64> = c.hosts.iter().map(|h| h.demand - h.admitted).collect();
    assert_eq!(before, after, "packets dropped under the budget");
}

/// A peer with the key claims a huge demand for a victim source for 60 s while the victim sends
/// at half the budget through two hosts: the claim takes the victim's refill here (as the old
/// charging did), but leaves no more than one round of debt, and the victim is admitted in full
/// again from the second round after the claims stop (the debt cap of the old charging needed
/// `(identities + 1) x 0.8 s`).
#[test]
fn a_claiming_peer_leaves_no_debt_and_the_source_recovers_a_round_after() {
    let mut c = Cluster::new(2);
    c.run(2_000, 500.0, &[1.0, 1.0]);
    c.claim = 1e12;
    let during = c.run(60_000, 500.0, &[1.0, 1.0]);
    let l = limit();
    for h in &c.hosts {
        assert!(
            h.tat <= c.now + l.pkt_tolerance_ns + 100 * MS,
            "debt beyond one round: {} ms",
            (h.tat - c.now) / MS
        );
    }
    // The claim starved the victim once the buckets, full when it began (demand was under the
    // budget), had spent what they held.
    assert!(
        during[..40].iter().sum::<u64>() <= 2 * 500 + 2 * 50,
        "{:?}",
        &during[..40]
    );
    assert_eq!(during[40..].iter().sum::<u64>(), 0, "{:?}", &during[35..50]);
    c.claim = 0.0;
    let after = c.run(5_000, 500.0, &[1.0, 1.0]);
    // The round after the claims stop still reads the claim (one round of gossip lag); from
    // the next on, demand under the budget is admitted in full, its burst refilling first.
    assert!(
        after[3..].iter().all(|&r| r == 50),
        "admitted per round after the claims stopped: {:?}",
        &after[..10]
    );
}
