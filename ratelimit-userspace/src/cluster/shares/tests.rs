use super::*;
use ratelimit_common::{share_cost, Bucket, SHARE_ONE};

use crate::cluster::{
    remote::DemandWindow,
    sim::{charge_batch, rewrite},
};

const MS: u64 = 1_000_000;
const S: u64 = 1_000 * MS;
/// Three 100 ms sync intervals.
const LAG: u64 = 300 * MS;

/// 1000 pps, burst 500.
fn limit() -> Limit {
    Limit {
        flags: rule_flags::PKT_LIMIT | rule_flags::CLUSTER,
        pkt_interval_ns: MS,
        pkt_tolerance_ns: 500 * MS,
        ..Limit::default()
    }
}

#[test]
fn the_share_is_the_demand_over_the_clusters_and_fails_open() {
    let r = Some(1000.0);
    // Steady state: 8 hosts of 500 pps each, 4 x the rate.
    assert!((share(500.0, 3500.0, 1.0, r, 8.0) - 0.125).abs() < 1e-12);
    // 95/5.
    assert!((share(3800.0, 200.0, 1.0, r, 2.0) - 0.95).abs() < 1e-12);
    // No counted peer holds the key (none counted, silent, uncounted, or none publishes it):
    // the whole budget, whatever the demand here.
    for local in [0.0, 500.0, 5000.0, f64::NAN] {
        assert_eq!(share(local, 0.0, 1.0, r, 1.0), 1.0);
        assert_eq!(share(local, 0.0, 1.0, None, 1.0), 1.0);
    }
    assert_eq!(share(500.0, f64::NAN, 1.0, r, 1.0), 1.0);
    // Idle everywhere, two hosts holding the key: half each (with or without a packet rate),
    // not the whole budget at both.
    assert_eq!(share(0.0, 0.0, 1.0, r, 2.0), 0.5);
    assert_eq!(share(0.0, 0.0, 1.0, None, 2.0), 0.5);
    assert_eq!(share(f64::NAN, f64::NAN, 1.0, r, 2.0), 0.5);
    // Demand here alone, the other holder idle: at or over the rate, all of it; under, its
    // demand and half the slack (the other has the other half).
    assert_eq!(share(1500.0, 0.0, 1.0, r, 2.0), 1.0);
    assert_eq!(share(100.0, 0.0, 1.0, None, 2.0), 1.0);
    assert!((share(200.0, 0.0, 1.0, r, 2.0) - 0.6).abs() < 1e-12);
    assert!((share(0.0, 200.0, 1.0, r, 2.0) - 0.4).abs() < 1e-12);
    // At or over the rate, no demand here while peers have some: none of the refill.
    assert_eq!(share(0.0, 1000.0, 1.0, r, 2.0), 0.0);
    // Under the rate: its own demand and an even part of the slack, so nobody is limited
    // (a host whose demand has just begun has its part: 450 of the 900 left).
    assert!((share(0.0, 100.0, 1.0, r, 2.0) - 0.45).abs() < 1e-12);
    assert!((share(300.0, 300.0, 1.0, r, 2.0) - 0.5).abs() < 1e-12);
    assert!((share(100.0, 500.0, 1.0, r, 3.0) - (100.0 + 400.0 / 3.0) / 1000.0).abs() < 1e-12);
    // The parts add up to 1 (three hosts at 100, 200 and 300).
    let sum: f64 = [(100.0, 500.0), (200.0, 400.0), (300.0, 300.0)]
        .iter()
        .map(|&(l, p)| share(l, p, 1.0, r, 3.0))
        .sum();
    assert!((sum - 1.0).abs() < 1e-12, "{sum}");
    // Continuous at the rate; without a packet rate (a byte limit alone), by demand only.
    assert!((share(500.0, 500.0, 1.0, r, 2.0) - 0.5).abs() < 1e-12);
    assert_eq!(share(0.0, 100.0, 1.0, None, 2.0), 0.0);
    // on_partition = "share": a lone host of three.
    assert!((share(500.0, 0.0, 1.0 / 3.0, r, 1.0) - 1.0 / 3.0).abs() < 1e-12);
    assert!((share(0.0, 0.0, 1.0 / 3.0, r, 1.0) - 1.0 / 3.0).abs() < 1e-12);
    assert!((share(500.0, 500.0, 2.0 / 3.0, r, 2.0) - 1.0 / 3.0).abs() < 1e-12);
    // A peer claiming any demand takes the share towards nothing, never below.
    assert!(share(1.0, 1e300, 1.0, r, 2.0) >= 0.0);
    assert_eq!(share(1.0, f64::INFINITY, 1.0, r, 2.0), 0.0);
}

#[test]
fn a_share_word_scales_the_cost_so_the_bucket_refills_at_its_share() {
    // The whole rate is no share at all (0), and so is anything that rounds to it.
    assert_eq!(share_word(1.0), 0);
    assert_eq!(share_word(1.0 - 1e-6), 0);
    assert_eq!(share_cost(MS, 0), MS);
    // An eighth: each packet costs 8 intervals, so the bucket refills at 1/8 of the rate.
    assert_eq!(u64::from(share_word(0.125)), SHARE_ONE / 8);
    assert_eq!(share_cost(MS, u64::from(share_word(0.125))), 8 * MS);
    // 95%: to within the word's resolution (1 / 65,536).
    let c = share_cost(MS, u64::from(share_word(0.95)));
    assert!((c as f64 / MS as f64 - 1.0 / 0.95).abs() < 1e-4, "{c}");
    // No share (a claim took it all, or no demand here): next to nothing, never a division by
    // zero and never the whole rate.
    assert_eq!(share_word(0.0), 1);
    assert_eq!(share_word(f64::NAN.max(0.0)), 1);
    assert_eq!(share_cost(MS, 1), MS * SHARE_ONE);
    // Costs too large to scale (39 hours a packet and more) stay as they are.
    assert_eq!(share_cost(1 << 50, 1), 1 << 50);
    // The creation time beside the word and the holders keeps 4.2 ms of resolution.
    let b = Bucket {
        created_share: Bucket::created_at(123_456_789)
            | ratelimit_common::share::field(u64::from(share_word(0.5)), 5),
        ..Bucket::default()
    };
    assert_eq!(b.created_ns(), 123_456_789 & !0x3f_ffff);
    assert_eq!(u64::from(b.share()), SHARE_ONE / 2);
    assert_eq!(b.holders(), 5);
}

/// A bucket whose share changes keeps its tokens, at most what the new share holds: a share
/// that grows gives room, not tokens.
#[test]
fn a_bucket_whose_share_changes_keeps_its_tokens_and_no_more() {
    use ratelimit_common::share::{field, tokens};
    let (now, l) = (1_000 * S, limit());
    let tol = l.pkt_tolerance_ns;
    // Four holders: a quarter holds one burst (500), a half two.
    let f = |w: u16| field(u64::from(w), 4);
    let held = |tat: u64, w: u16| tokens(tat, now, tol, MS as f64, f(w));
    // 250 tokens at the whole rate (TAT 250 ms ahead) to a quarter: 250 tokens still.
    let q = share_word(0.25);
    let t = rewrite(now + 250 * MS, now, 0, f(q), &l);
    assert!((held(t, q) - 250.0).abs() < 0.01, "{}", held(t, q));
    // A quarter to a half (room for 1000): 250 still, not 750; and back.
    let h = share_word(0.5);
    let t2 = rewrite(t, now, f(q), f(h), &l);
    assert!((held(t2, h) - 250.0).abs() < 0.01, "{}", held(t2, h));
    let t3 = rewrite(t2, now, f(h), f(q), &l);
    assert!((held(t3, q) - 250.0).abs() < 0.01);
    // Full at a half (1000 tokens) to a quarter: what a quarter holds, 500.
    let full = rewrite(now - S, now, f(h), f(q), &l);
    assert!((held(full, q) - 500.0).abs() < 0.01, "{}", held(full, q));
    // No change: nothing moves.
    assert_eq!(rewrite(t3, now, f(q), f(q), &l), t3);
}

#[test]
fn a_round_counts_the_rest_of_its_refill_as_withheld_and_no_more_than_the_lag() {
    assert_eq!(advance_ns(0.125, 100 * MS, LAG), 87_500_000);
    assert_eq!(advance_ns(1.0, 100 * MS, LAG), 0);
    assert_eq!(advance_ns(0.0, 100 * MS, LAG), 100 * MS);
    // A round that ran late takes back no more than the lag allowance.
    assert_eq!(advance_ns(0.0, 5 * S, LAG), LAG);
    assert_eq!(
        withheld(&limit(), 87_500_000, 0),
        (87, 0),
        "in packets of the rate"
    );
}

/// Hosts sharing one budget in a simulation of the XDP program's bucket (GCRA, one packet a
/// time) and of the rounds: every 100 ms each host divides by the demand every host published
/// one round earlier (gossip lag; its own figure too, as the agent does; each over the last
/// [`DEMAND_ROUNDS`](crate::cluster::remote::DEMAND_ROUNDS) rounds), and gives its bucket its
/// share word ([`share_word`]), which the program's charge scales each packet's cost by
/// ([`share_cost`]): between rounds too, the bucket refills at its share.
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
    /// The bucket's share word (0: the whole rate).
    word: u16,
    /// The hosts holding the key as the word was computed.
    holders: u64,
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
                    let n = charge_batch(
                        &mut h.tat,
                        self.now,
                        1,
                        &l,
                        ratelimit_common::share::field(u64::from(h.word), h.holders),
                    );
                    h.admitted += n;
                    admitted += n;
                }
            }
            if (self.now / MS).is_multiple_of(100) {
                let fresh: Vec<f64> = self
                    .hosts
                    .iter_mut()
                    .map(|h| {
                        h.window.push(self.now, h.demand);
                        h.window.rate(
                            1e9,
                            crate::cluster::timing::Timing::new(100).demand_span_ns(),
                        )
                    })
                    .collect();
                let all: f64 = self.published.iter().sum::<f64>() + self.claim;
                #[expect(clippy::cast_precision_loss, reason = "a few hosts")]
                let hosts = self.hosts.len() as f64;
                for (i, h) in self.hosts.iter_mut().enumerate() {
                    let peers = all - self.published[i];
                    // Its own figure as the others read it: published last round.
                    let word =
                        share_word(share(self.published[i], peers, 1.0, Some(1000.0), hosts));
                    // As `MappedStore::set_share`: a bucket whose share changes keeps its tokens.
                    #[expect(
                        clippy::cast_possible_truncation,
                        clippy::cast_sign_loss,
                        reason = "a few hosts"
                    )]
                    let holders = hosts as u64;
                    let (from, to) = (
                        ratelimit_common::share::field(u64::from(h.word), h.holders),
                        ratelimit_common::share::field(u64::from(word), holders),
                    );
                    h.tat = rewrite(h.tat, self.now, from, to, &l);
                    h.word = word;
                    h.holders = holders;
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

/// A source that sends `hosts x burst` spread evenly over three hosts within one sync interval,
/// then idles for its tolerance and four intervals, eight times over: the cluster admits at most
/// the tighter of docs/cluster.md's bounds for an even split over the whole run, `rate x T + hosts
/// x burst + (hosts - 1) x rate x lag` (each host at a third holds one burst), and each cycle
/// after the first what the buckets refilled at their shares over the silence: `min(hosts x
/// burst, rate x off)` and the rate while on (each host refills at its third of the rate): 1,797 then 999 a cycle, 8,790 against a bound of 9,900.
/// One bucket would admit 500 a cycle: the price of letting each host bank its own share's
/// refill over its gaps (see docs/cluster.md's per-cycle bound). Before idle keys kept their even
/// part, an idle key went back to the whole rate at every host: 1,797 every cycle, 14,376 in
/// all, over the bound.
#[test]
fn an_on_off_source_gets_one_budget_not_one_per_host() {
    let mut c = Cluster::new(3);
    let l = limit();
    let burst = l.pkt_tolerance_ns / l.pkt_interval_ns;
    // 3 x 600 packets in 100 ms: more than every host's whole burst (500).
    let (on_ms, off_ms, pps) = (100, 900, 18_000.0);
    let mut cycles = Vec::new();
    for _ in 0..8 {
        let on: u64 = c.run(on_ms, pps, &[1.0, 1.0, 1.0]).iter().sum();
        let off: u64 = c.run(off_ms, 0.0, &[1.0, 1.0, 1.0]).iter().sum();
        assert_eq!(off, 0);
        cycles.push(on);
    }
    let total: u64 = cycles.iter().sum();
    println!("on/off: admitted {total} ({cycles:?} a cycle)");
    let secs = (8 * (on_ms + off_ms)) as f64 / 1000.0;
    // The lag: a round and the gossip (the simulation's figures are a round old), 200 ms.
    let bound = 1000.0 * secs + 3.0 * burst as f64 + 2.0 * 1000.0 * 0.2;
    assert!(
        (total as f64) <= bound,
        "admitted {total} over {secs} s ({cycles:?} a cycle), more than the bound {bound}"
    );
    // Each cycle after the first: at most what the shares refilled over the silence (the whole
    // rate together, each host up to the whole burst) and the rate while on; at least one burst.
    let per_cycle = (3 * burst).min(off_ms) + on_ms + 10;
    for (i, &n) in cycles.iter().enumerate().skip(1) {
        assert!(
            (450..=per_cycle).contains(&n),
            "cycle {i} admitted {n} ({cycles:?}), want one burst to {per_cycle}"
        );
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
/// charging did), but leaves no debt (a share only makes packets cost more, it never moves the
/// arrival time on by itself), and the victim is admitted in full again from the second round
/// after the claims stop (the debt cap of the old charging needed `(identities + 1) x 0.8 s`).
#[test]
fn a_claiming_peer_leaves_no_debt_and_the_source_recovers_a_round_after() {
    let mut c = Cluster::new(2);
    c.run(2_000, 500.0, &[1.0, 1.0]);
    c.claim = 1e12;
    let during = c.run(60_000, 500.0, &[1.0, 1.0]);
    let l = limit();
    // No debt: at most an empty bucket, in the time of its word.
    for h in &c.hosts {
        let left = ratelimit_common::share::tokens(
            h.tat,
            c.now,
            l.pkt_tolerance_ns,
            l.pkt_interval_ns as f64,
            ratelimit_common::share::field(u64::from(h.word), h.holders),
        );
        assert!(left >= -1e-6, "debt: {left} tokens");
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

fn named(addr: &str) -> crate::cluster::publish::KeyName {
    crate::cluster::publish::KeyName {
        rule: "web".into(),
        limit: 0,
        addr: addr.parse().unwrap(),
    }
}

/// A host's own figure is taken as of its oldest counted peer's sync: the figures of its sync
/// nearest that time (the earlier on a tie), the first before them and this round's after them;
/// without counted peers the one it published last.
#[test]
fn a_hosts_own_figure_is_taken_as_of_its_oldest_peers_sync() {
    let (a, b) = (named("198.18.0.1"), named("198.18.0.2"));
    let mut own = OwnFigures::default();
    assert!(own.as_of(Some(1_000)).is_empty() && own.as_of(None).is_empty());
    own.push(1_000, [(a.clone(), 100.0)].into());
    own.push(1_100, [(a.clone(), 300.0), (b.clone(), 40.0)].into());
    own.push(1_200, [(a.clone(), 500.0), (b.clone(), 80.0)].into());
    let at = own.as_of(Some(1_040));
    assert_eq!(
        (at.len(), at[&a]),
        (1, 100.0),
        "the nearer sync's keys: {at:?}"
    );
    assert_eq!(own.as_of(Some(1_050))[&a], 100.0, "a tie: the earlier");
    let at = own.as_of(Some(1_080));
    assert_eq!((at[&a], at[&b]), (300.0, 40.0));
    assert_eq!(
        own.as_of(Some(900))[&a],
        100.0,
        "before the first: the first"
    );
    assert_eq!(
        own.as_of(Some(1_300))[&a],
        500.0,
        "after the last: this round's"
    );
    assert_eq!(own.as_of(None)[&a], 300.0, "no peers: the last published");
    // This round's figures recorded, divided by as of the oldest peer; a key new this round
    // takes its fresh figure.
    let c = named("198.18.0.3");
    let this = own.to_divide_by(
        1_300,
        [(a.clone(), 700.0), (c.clone(), 9.0)].into(),
        Some(1_180),
    );
    assert_eq!((this[&a], this[&b], this[&c]), (500.0, 80.0, 9.0));
    assert_eq!(own.as_of(Some(1_300))[&a], 700.0, "recorded");
    for t in 0..10 {
        own.push(1_300 + t * 100, std::collections::HashMap::new());
    }
    assert!(own.as_of(Some(1_080)).is_empty(), "5 syncs kept");
}
