use super::*;
use crate::cluster::remote::DEMAND_HISTORY;

/// One drawn case of the property test.
#[derive(Clone, Debug)]
struct Case {
    seed: u64,
    hosts: usize,
    limit: Limit,
    sync_ms: u64,
    source: Source,
    /// Arrivals under half the budget: nobody may be limited.
    under: bool,
}

#[expect(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    clippy::cast_precision_loss,
    reason = "drawn parameters"
)]
fn draw(seed: u64) -> Case {
    let mut r = Rng::new(seed);
    let hosts = r.log_uniform(2.0, 64.0).round() as usize;
    let rate = r.log_uniform(1.0, 1e6).round().max(1.0);
    let burst = r.log_uniform(1.0, 10_000.0).round().max(1.0) as u64;
    let sync_ms = r.log_uniform(10.0, 1000.0).round() as u64;
    let weights: Vec<f64> = match r.next() % 4 {
        0 => vec![1.0; hosts],
        // 95/5: one host the most, the others the rest.
        1 => (0..hosts)
            .map(|h| {
                if h == 0 {
                    95.0
                } else {
                    5.0 / (hosts - 1) as f64
                }
            })
            .collect(),
        2 => (0..hosts).map(|_| r.unit() + 0.05).collect(),
        // A source at one host only.
        _ => (0..hosts).map(|h| if h == 0 { 1.0 } else { 0.0 }).collect(),
    };
    let under = r.next().is_multiple_of(4);
    // A burst period the one bucket can serve: each host's bursts of its share, the cluster's
    // bursts together within what one bucket refills (`burst / rate`), at least 2 ms.
    let period = ((burst as f64 / rate * 1e3 / 2.0) as u64).clamp(2, 250);
    let arrivals = if under {
        Arrivals::Smooth
    } else {
        match r.next() % 6 {
            0 => Arrivals::Smooth,
            1 => Arrivals::Periodic { period_ms: period },
            2 => Arrivals::OnOff {
                on_ms: 200,
                off_ms: 300,
            },
            3 => Arrivals::Poisson,
            4 => Arrivals::HeavyTailed {
                mean_burst: (burst as f64 / 4.0).max(1.0),
            },
            _ => Arrivals::Ramp,
        }
    };
    let pps = if under { rate * 0.5 } else { rate * 3.0 };
    Case {
        seed,
        hosts,
        limit: Limit { rate, burst },
        sync_ms,
        source: Source {
            pps,
            weights,
            arrivals,
        },
        under,
    }
}

/// What one case found.
#[derive(Debug)]
struct Found {
    /// Worst excess over `rate x T` in any window, and the bound.
    excess: f64,
    bound: f64,
    /// Cluster and one bucket admitted over the last 7 s.
    cluster: u64,
    one: u64,
    /// Drops in the last 7 s with arrivals under the budget: arrivals that one bucket of the
    /// rate and burst admits whole (0 otherwise: in steps of 1 ms, a high rate's arrivals come
    /// in batches that a small burst cannot take, and one bucket drops them too).
    dropped_under: u64,
}

/// How the hosts read one another's demand: the rates they publish (the Redis store), or their
/// demand counters as gossip brings them, 30% of the publications lost.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Store,
    Gossip,
}

fn run(c: &Case, mode: Mode) -> Found {
    let warm_ms = (10 * c.sync_ms).max(2_000);
    let measured_ms = 7_000;
    let steps = warm_ms + measured_ms;
    // Each host's rounds at their own point of the interval, up to 5% of it (at least 1 ms)
    // late, and one in 20 up to 2.5 intervals more: agents' timers on a loaded machine.
    let mut r = Rng::new(c.seed ^ 0x1234);
    let phases: Vec<u64> = (0..c.hosts).map(|_| r.next() % c.sync_ms).collect();
    let mut sim = Sim::new(c.hosts, c.limit, c.sync_ms, c.seed).with_phases(&phases);
    if mode == Mode::Gossip {
        sim.counters = true;
        sim.loss = 0.3;
    }
    sim.jitter = Some(Jitter {
        max_ns: c.sync_ms * MS / 20 + MS,
        late_one_in: 20,
        late_max_ns: c.sync_ms * MS * 5 / 2,
    });
    let mut driver = Driver::new(c.source.clone(), steps, c.seed ^ 0xabcd);
    let mut dropped_at_warm = 0;
    for i in 0..steps {
        if i == warm_ms {
            dropped_at_warm = sim.dropped;
        }
        let a = driver.next();
        sim.step(&a);
    }
    let from = usize::try_from(warm_ms).unwrap_or(usize::MAX);
    let (cluster, one, arrived) = sim.totals(from, sim.steps.len());
    // Windows of 0.1 s, 1 s, 7 s and the whole run: what a change of demand adds must not
    // add up over the cycles of an on/off source.
    let excess = [100usize, 1_000, 7_000, sim.steps.len()]
        .iter()
        .map(|&w| sim.worst_excess(w))
        .fold(f64::MIN, f64::max);
    Found {
        excess,
        bound: sim.bound(),
        cluster,
        one,
        dropped_under: if c.under && one == arrived {
            sim.dropped - dropped_at_warm
        } else {
            0
        },
    }
}

/// What the drawn cases broke, a line per case: `(promises, short)`, the promises the bound
/// over every window and nobody limited under the budget, `short` under 95% of one bucket
/// over 7 s where the design claims it: at least 20 packets, and no host holding the key sees
/// its bursts more than [`DEMAND_HISTORY`] sync intervals apart (such a host reads about 0
/// between them, docs/cluster.md, "How the budget is shared").
fn failures(cases: u64, mode: Mode) -> (Vec<String>, Vec<String>) {
    let (mut broken, mut short) = (Vec::new(), Vec::new());
    for seed in 0..cases {
        let c = draw(seed);
        let f = run(&c, mode);
        #[expect(clippy::cast_precision_loss, reason = "packets")]
        let ratio = f.cluster as f64 / (f.one as f64).max(1.0);
        let ok_bound = f.excess <= f.bound;
        let gaps = sparsest_gap(&c);
        #[expect(clippy::cast_precision_loss, reason = "small")]
        let sparse = gaps > DEMAND_HISTORY as f64;
        let ok_accuracy = f.one < 20 || sparse || ratio >= 0.95;
        let ok_under = f.dropped_under == 0;
        let line = format!(
            "seed {seed}: hosts {} rate {} burst {} sync {} ms {:?} gaps {:.1} intervals split {} under {}: excess {:.0} (bound {:.0}), cluster {} / one bucket {} = {ratio:.3}, dropped under the budget {}",
            c.hosts,
            c.limit.rate,
            c.limit.burst,
            c.sync_ms,
            c.source.arrivals,
            gaps,
            if c.source.weights.iter().filter(|w| **w > 0.0).count() == 1 { "one host" } else { "spread" },
            c.under,
            f.excess,
            f.bound,
            f.cluster,
            f.one,
            f.dropped_under
        );
        if !(ok_bound && ok_under) {
            broken.push(line);
        } else if !ok_accuracy {
            short.push(line);
        }
    }
    (broken, short)
}

/// The longest mean gap between the bursts (or packets) one host holding the key receives, in
/// sync intervals.
#[expect(clippy::cast_precision_loss, reason = "a rate")]
fn sparsest_gap(c: &Case) -> f64 {
    let total: f64 = c.source.weights.iter().sum();
    c.source
        .weights
        .iter()
        .filter(|w| **w > 0.0)
        .map(|w| {
            let pps = c.source.pps * w / total;
            let gap_s = match c.source.arrivals {
                Arrivals::Smooth | Arrivals::Ramp | Arrivals::Poisson => 1.0 / pps,
                Arrivals::Periodic { period_ms } => period_ms as f64 / 1e3,
                Arrivals::OnOff { off_ms, .. } => (off_ms as f64 / 1e3).max(1.0 / pps),
                Arrivals::HeavyTailed { mean_burst } => mean_burst / pps,
            };
            gap_s * 1e3 / c.sync_ms as f64
        })
        .fold(0.0, f64::max)
}

fn cases() -> u64 {
    std::env::var("RL_SIM_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300)
}

/// The whole property of issue #34, over every drawn configuration and arrival process, the
/// hosts' rounds at their own times and now and then late, reading one another through the
/// store: no window of the run admits more than docs/cluster.md's bound
/// (`rate x T + (2 x hosts - 1) x burst + (hosts - 1) x rate x lag`), nobody is limited under
/// the budget, and the cluster admits 95% of one bucket over 7 s. Of 4,000 drawn cases none
/// breaks the bound and, besides those where a host sees its bursts more than 6 sync intervals
/// apart (not judged), 10 fall short of 95% (0.82-0.95; `RL_SIM_CASES=4000` lists them): bursts
/// of 1 to 3 packets, sync intervals of 0.8-0.9 s at 10 packets a second, heavy-tailed bursts,
/// and 7 hosts with 200 ms bursts 300 ms apart at 53 ms (seed 1247, 0.94). With a bursty key
/// read over its readings rather than a span of time, 10 did too, seed 1247 at 0.83 and seed
/// 2822 (2 hosts, the same bursts at 58 ms) at 0.83. With a
/// holder holding `share x burst` (nothing below `1 / burst`), 23 of the first 60 cases fell
/// short; with one packet at least, 16.
#[test]
fn the_cluster_admits_what_one_bucket_would() {
    holds(Mode::Store);
}

/// Runs the drawn cases in `mode` and fails on any that broke a promise or fell short.
fn holds(mode: Mode) {
    let (broken, short) = failures(cases(), mode);
    assert!(
        broken.is_empty() && short.is_empty(),
        "{} broke a promise, {} short of 95% of one bucket:\n{}",
        broken.len(),
        short.len(),
        broken
            .iter()
            .chain(&short)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// [`the_cluster_admits_what_one_bucket_would`] through gossip: each host reads its peers'
/// demand counters as gossip brings them, 30% of the publications lost, a new key's first
/// reading read as demand since the host's sync before (as the agents do). Of 4,000 drawn
/// cases none breaks the bound or limits a source under the budget, and 10 fall short of 95%
/// of one bucket (0.82-0.95), none an on/off source. Reading a bursty key over the readings
/// gossip brought (a span of 8.5 intervals with 30% lost, against the host's 6), 17 did, among
/// them 16 hosts each seeing 200 ms bursts 300 ms apart at a sync interval of 62 ms (seed 259,
/// 0.73: the shares added up to 0.43-0.89 while the source sent; 1.08 now) and 6 hosts at 60 ms
/// (seed 2400, 0.60).
#[test]
fn the_cluster_through_gossip_admits_what_one_bucket_would() {
    holds(Mode::Gossip);
}

/// Rate 10, burst 1, two hosts: one spoofed frame makes host B a holder, then the source sends
/// 2 packets/s to host A for 10 s, far under the budget. Every packet arrives (before a holder
/// held at least one packet: A's share of a packet's cost exceeded the tolerance, and A admitted
/// nothing after its first).
#[test]
fn a_spoofed_second_holder_does_not_block_a_source_under_the_budget() {
    let limit = Limit {
        rate: 10.0,
        burst: 1,
    };
    let mut sim = Sim::new(2, limit, 100, 7);
    sim.loss = 0.0;
    sim.step(&[0, 1]);
    for _ in 0..1_000 {
        sim.step(&[0, 0]);
    }
    let before = sim.dropped;
    let mut sent = 0;
    for i in 0..10_000u64 {
        let a = u64::from(i % 500 == 0);
        sent += a;
        sim.step(&[a, 0]);
    }
    assert_eq!(sent, 20);
    assert_eq!(sim.dropped - before, 0, "packets dropped under the budget");
}

/// 8 hosts, 4x a budget of 1,000 packets/s with burst 100, split 95/5 (the seven small hosts
/// at about 29 packets/s each): every small host admits some of its packets, and the cluster
/// the budget within 5% (before: the small hosts' share of a packet's cost exceeded the
/// tolerance, and they admitted nothing).
#[test]
fn the_small_hosts_of_a_95_5_split_admit_their_part() {
    let limit = Limit {
        rate: 1000.0,
        burst: 100,
    };
    let mut sim = Sim::new(8, limit, 100, 3);
    sim.loss = 0.0;
    let mut weights = vec![5.0 / 7.0; 8];
    weights[0] = 95.0;
    let source = Source {
        pps: 4000.0,
        weights,
        arrivals: Arrivals::Smooth,
    };
    let mut d = Driver::new(source, 12_000, 3);
    let mut settled = Vec::new();
    for i in 0..12_000 {
        if i == 5_000 {
            settled = sim.hosts.iter().map(|h| h.admitted).collect();
        }
        let a = d.next();
        sim.step(&a);
    }
    // Over the last 7 s, once the shares are set.
    let small: u64 = sim.hosts[1..]
        .iter()
        .zip(&settled[1..])
        .map(|(h, s)| h.admitted - s)
        .sum();
    for (i, h) in sim.hosts.iter().enumerate().skip(1) {
        assert!(
            h.admitted > settled[i],
            "host {i} admitted nothing of its packets once the shares were set"
        );
    }
    let (cluster, one, _) = sim.totals(5_000, 12_000);
    #[expect(clippy::cast_precision_loss, reason = "packets")]
    let ratio = cluster as f64 / one as f64;
    assert!(
        (0.95..=1.05).contains(&ratio),
        "{cluster} / {one}; small hosts {small}"
    );
}

/// An on/off source over three hosts (rate 1,000, burst 500, sync 100 ms: 0.1 s on at 27,000
/// packets/s spread evenly, 1 s off), thirty cycles, each host's view of the others its own:
/// what a change of demand adds (shares from figures of different ages) must not add up over
/// the cycles. No window of the run exceeds the bound.
#[test]
fn an_on_off_source_gains_no_more_over_many_cycles() {
    let limit = Limit {
        rate: 1000.0,
        burst: 500,
    };
    let mut sim = Sim::new(3, limit, 100, 11);
    sim.loss = 0.2;
    let mut cycles = Vec::new();
    for _ in 0..30 {
        let before = sim.steps.len();
        for i in 0..1_100u64 {
            let a = if i < 100 { [9, 9, 9] } else { [0, 0, 0] };
            sim.step(&a);
        }
        cycles.push(sim.totals(before, sim.steps.len()).0);
    }
    let excess = sim.worst_excess(sim.steps.len());
    println!(
        "per cycle {cycles:?}; worst excess {excess:.0}, bound {:.0}",
        sim.bound()
    );
    assert!(
        excess <= sim.bound(),
        "{excess} over the bound {}",
        sim.bound()
    );
}

/// Three hosts, 70/20/10 of 5 x the budget in bursts 200 ms apart at each host (700, 200 and
/// 100 back to back, phases a third of the period apart): one bucket sees a burst every 67 ms
/// and wastes no refill; the heavy host's share refills 140 packets over its own 200 ms gap,
/// more than one burst (100). Its bucket holds `holders x share` bursts (2.1), so the cluster
/// admits what one bucket would (holding one burst at any share, it admitted 0.8).
#[test]
fn three_hosts_70_20_10_in_bursts_200_ms_apart_admit_what_one_bucket_would() {
    let limit = Limit {
        rate: 1000.0,
        burst: 100,
    };
    let mut sim = Sim::new(3, limit, 100, 11);
    for t in 0..11_000u64 {
        let at = |phase: u64, n: u64| if t % 200 == phase { n } else { 0 };
        sim.step(&[at(0, 700), at(67, 200), at(133, 100)]);
    }
    let (cluster, one, _) = sim.totals(3_000, 11_000);
    #[expect(clippy::cast_precision_loss, reason = "packets")]
    let ratio = cluster as f64 / one as f64;
    assert!(
        (0.95..=1.05).contains(&ratio),
        "the cluster admitted {cluster}, one bucket {one}: {ratio:.3}"
    );
}

/// Issue #34's bursty case at every phase: two hosts, each sent a burst back to back every
/// `period` (1.2 x the budget in all, host 1 half a period after host 0), their rounds at any
/// point of the interval and one in 20 run up to 250 ms late (an agent's timer on a loaded
/// machine), each reading the other's figure (the store) or its counter at the syncs gossip
/// brought, 30% of them skipped. Over every 8 s the cluster admits what one bucket would,
/// within 5%: 0.97-1.03. Read over the last two intervals and reaching back only until the
/// window held the burst's last 4 packets (about 20 pps between bursts), the shares swung
/// between 0.03 and 0.97 with the rounds' timing: 0.86-1.05; reaching back whole intervals
/// until it held 4, 0.97-1.10 (a host read its own counter at every sync, above its rate,
/// and its peer's at fewer: the shares added up to more than 1).
#[test]
fn interleaved_bursts_admit_what_one_bucket_would_whatever_the_rounds_timing() {
    let limit = Limit {
        rate: 1000.0,
        burst: 500,
    };
    let mut worst = (f64::MAX, f64::MIN, String::new(), String::new());
    for counters in [false, true] {
        for period in [250u64, 350, 500] {
            let n = 150 * period / 250;
            for phase in [0u64, 25, 50, 75] {
                for (offset, round) in [0u64, 30, 60, 125]
                    .into_iter()
                    .flat_map(|o| (0..3).map(move |r| (o, r)))
                {
                    let seed = period * 100_000 + phase * 1_000 + offset * 3 + round;
                    let mut sim = Sim::new(2, limit, 100, seed).with_phases(&[0, phase]);
                    sim.counters = counters;
                    sim.loss = if counters { 0.3 } else { 0.05 };
                    sim.jitter = Some(Jitter {
                        max_ns: 5 * MS,
                        late_one_in: 20,
                        late_max_ns: 250 * MS,
                    });
                    for t in 0..13_500u64 {
                        let at = |p: u64| if t % period == p % period { n } else { 0 };
                        sim.step(&[at(offset), at(offset + period / 2)]);
                    }
                    let (cluster, one, _) = sim.totals(5_500, 13_500);
                    #[expect(clippy::cast_precision_loss, reason = "packets")]
                    let ratio = cluster as f64 / one as f64;
                    let case = format!(
                        "{}, period {period} ms, phase {phase} ms, offset {offset} ms, seed {seed}",
                        if counters { "gossip" } else { "store" }
                    );
                    if ratio < worst.0 {
                        worst.0 = ratio;
                        worst.2.clone_from(&case);
                    }
                    if ratio > worst.1 {
                        worst.1 = ratio;
                        worst.3 = case;
                    }
                }
            }
        }
    }
    println!(
        "lowest {:.3} ({}), highest {:.3} ({})",
        worst.0, worst.2, worst.1, worst.3
    );
    assert!(
        worst.0 >= 0.95 && worst.1 <= 1.05,
        "the cluster admitted {:.3} of one bucket ({}) to {:.3} ({}), want within 5%",
        worst.0,
        worst.2,
        worst.1,
        worst.3
    );
}

/// Eight hosts, each sent 125 back to back every 250 ms (phases spread, 4 x the budget, burst
/// 100), each reading the others' demand counters at the syncs gossip brought, 30% of them
/// skipped: every host divides by figures read the same way on average, so the cluster admits
/// what one bucket would within 3% (0.997-1.005). Reading a burst between readings over the
/// time since its interval began read each host's own counter (every sync) 17% above its rate
/// and its peers' (fewer syncs) at it: 1.05-1.07, as the agents did end to end (1.054).
#[test]
fn eight_hosts_bursts_read_through_gossip_admit_what_one_bucket_would() {
    let limit = Limit {
        rate: 1000.0,
        burst: 100,
    };
    let mut ratios = Vec::new();
    for seed in 0..12u64 {
        let mut r = Rng::new(seed);
        let phases: Vec<u64> = (0..8).map(|_| r.next() % 100).collect();
        let mut sim = Sim::new(8, limit, 100, seed).with_phases(&phases);
        sim.counters = true;
        sim.loss = 0.3;
        sim.jitter = Some(Jitter {
            max_ns: 5 * MS,
            late_one_in: 20,
            late_max_ns: 250 * MS,
        });
        for t in 0..11_000u64 {
            let a: Vec<u64> = (0..8u64)
                .map(|h| if t % 250 == h * 250 / 8 { 125 } else { 0 })
                .collect();
            sim.step(&a);
        }
        let (cluster, one, _) = sim.totals(3_000, 11_000);
        #[expect(clippy::cast_precision_loss, reason = "packets")]
        ratios.push(cluster as f64 / one as f64);
    }
    let (lo, hi) = ratios
        .iter()
        .fold((f64::MAX, f64::MIN), |(l, h), &r| (l.min(r), h.max(r)));
    println!("{lo:.3}-{hi:.3} of one bucket");
    assert!(
        lo >= 0.97 && hi <= 1.03,
        "the cluster admitted {lo:.3}-{hi:.3} of one bucket, want within 3%"
    );
}
