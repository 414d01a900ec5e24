//! An on/off source against a cluster budget, end to end: three real agents share one
//! `scope = "cluster"` budget (1,000 pps, burst 500, sync 100 ms). One source sends `hosts x
//! burst` and more, spread evenly over the three hosts within one sync interval, then stays
//! silent for its tolerance (0.5 s) and five sync intervals, ten times over. Over any window T of
//! the run the cluster must admit at most docs/cluster.md's bound, `rate x T + hosts x burst +
//! (hosts - 1) x rate x lag` (lag 400 ms, docs/cluster.md's allowance at this interval, plus 50 ms of
//! `rate` for the sampling, as `e2e_cluster/` allows): the first bursts once, not at every
//! cycle.
//!
//! An idle key keeps its even part at each host holding it (a third of the rate and of the
//! burst here), so the buckets together hold one burst. Were it to go back to the whole rate at
//! every host a round or two after its demand stopped, each host's bucket would refill to its
//! whole burst in the silence and every cycle would admit `hosts x burst` (measured so: about
//! 1,800 packets a cycle here, against a budget of 1,100 over the cycle).
//!
//! Run with `--nocapture` for the figures.

use std::time::{Duration, Instant};

use ratelimit_testbed::cluster::stop_agents;
use ratelimit_testbed::{
    assert_none_left,
    cluster_net::{stalls, ClusterNet, Samples, Sent, Split, Stall},
    require_root, Receiver,
};

const HOSTS: usize = 3;
const RATE: f64 = 1000.0;
const BURST: u64 = 500;
const SYNC_MS: u64 = 100;
/// Each burst: this many packets per second for [`ON_SECS`], spread evenly: 900 a host, more
/// than a host's whole burst and what its bucket refills meanwhile at the whole rate.
const ON_PPS: f64 = 27_000.0;
/// Within one sync interval.
const ON_SECS: f64 = 0.1;
/// The silence after each burst: the tolerance (`burst / rate`, 0.5 s) and five sync intervals,
/// long enough for every bucket to refill whatever its share, and for shares that went back to
/// the whole rate when demand stopped to have done so.
const OFF_SECS: f64 = 1.0;
const CYCLES: usize = 10;
/// One cycle: a burst and its silence.
const CYCLE: f64 = ON_SECS + OFF_SECS;
/// docs/cluster.md's lag allowance: 4 sync intervals (a key's demand is known at the first round
/// after its bucket's creation, peers read it a round later, a round more when gossip lost it
/// once, and a round to spare for late rounds).
const MAX_LAG_SECS: f64 = 0.4;
/// How far the sampling can misplace an admission in time (each sample reads the receivers one
/// after the other, and delivery lags the program's decision), as in `e2e_cluster/`.
const SKEW_SECS: f64 = 0.05;
const SAMPLE: Duration = Duration::from_millis(50);

#[test]
fn an_on_off_source_gets_one_budget_not_a_burst_per_host_at_every_cycle() {
    require_root();
    let net = ClusterNet::new("rl-coo", HOSTS).unwrap();
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "1000"
    )]
    let agents = net
        .start_agents(RATE as u64, BURST, SYNC_MS, Duration::from_secs(60))
        .unwrap();
    let receivers = net.receivers().unwrap();
    let seen = flood_on_and_off(&net, &receivers);
    let fig = figures(&seen);
    assert_the_receivers_missed_nothing(&seen);
    assert_no_window_beyond_the_bound(&fig);
    assert_the_later_cycles_not_starved(&fig);

    // --- Clean up. ---
    drop(receivers);
    stop_agents(agents);
    drop(net);
    assert_none_left("rl-coo-");
}

/// What [`flood_on_and_off`] saw.
struct Seen {
    samples: Samples,
    sent: Sent,
    /// When the test's own threads did not run.
    stalls: Vec<Stall>,
    /// Each receiver's socket drops at the end.
    drops: Vec<u64>,
    /// How long the run was, s.
    end: f64,
}

/// The on/off flood, [`CYCLES`] cycles of [`ON_SECS`] at [`ON_PPS`] spread evenly and
/// [`OFF_SECS`] silent, sampled every [`SAMPLE`] until it ends; then the receivers' socket drops.
/// Asserts nothing: the figures come first.
fn flood_on_and_off(net: &ClusterNet, receivers: &[Receiver]) -> Seen {
    let mut schedule = Vec::new();
    for c in 0..CYCLES {
        #[expect(clippy::cast_precision_loss, reason = "a few cycles")]
        let t0 = c as f64 * CYCLE;
        schedule.push(Split {
            end: t0 + ON_SECS,
            pps: ON_PPS,
            weights: vec![1.0; HOSTS],
        });
        schedule.push(Split {
            end: t0 + CYCLE,
            pps: 0.0,
            weights: vec![1.0; HOSTS],
        });
    }
    #[expect(clippy::cast_precision_loss, reason = "a few cycles")]
    let end = CYCLES as f64 * CYCLE;
    let start = Instant::now();
    let sender = net.flood(schedule, start).unwrap();
    let mut samples = Samples::default();
    samples.take_until(receivers, start, end, SAMPLE);
    let sent = sender.join().unwrap();
    let stalls = stalls(&sent, receivers, start);
    let drops: Vec<u64> = receivers
        .iter()
        .map(|r| r.socket_drops().unwrap())
        .collect();
    Seen {
        samples,
        sent,
        stalls,
        drops,
        end,
    }
}

/// What the assertions check.
struct Figures {
    /// What the cluster admitted each cycle.
    per_cycle: Vec<f64>,
    /// The largest excess over `rate x T` of any window between two samples, and that window.
    excess: f64,
    worst: (f64, f64),
    /// docs/cluster.md's bound on it, with the rate over the sampling's skew.
    bound: f64,
}

/// Prints what each cycle admitted, the largest excess over `rate x T` and its bound, and the
/// stalls of the test's threads, and returns what the assertions check: all printed before any
/// assertion, so a failing run shows them.
fn figures(seen: &Seen) -> Figures {
    let Seen {
        samples,
        sent,
        stalls,
        end,
        ..
    } = seen;
    let end = *end;
    let total = |s: &ratelimit_testbed::cluster_net::Sample| s.counts.iter().sum::<u64>();
    // Per cycle: between the samples nearest its start and the next cycle's (both in silence,
    // a sample period before the burst).
    let per_cycle: Vec<f64> = (0..CYCLES)
        .map(|c| {
            #[expect(clippy::cast_precision_loss, reason = "a few cycles")]
            let (t1, t2) = (
                (c as f64 * CYCLE - 0.05).max(0.0),
                (c + 1) as f64 * CYCLE - 0.05,
            );
            (0..HOSTS).map(|h| samples.packets(h, t1, t2)).sum()
        })
        .collect();
    let admitted = samples.0.last().map_or(0, total);
    // The largest excess over `rate x T` of any window between two samples.
    let (excess, worst) = samples.worst_excess(RATE);
    #[expect(clippy::cast_precision_loss, reason = "small counts")]
    let bound =
        HOSTS as f64 * BURST as f64 + (HOSTS - 1) as f64 * RATE * MAX_LAG_SECS + RATE * SKEW_SECS;
    println!(
        "\n{HOSTS} hosts, budget {RATE} pps (burst {BURST}) cluster-wide, sync {SYNC_MS} ms; \
         {CYCLES} cycles of {ON_SECS} s at {ON_PPS} pps then {OFF_SECS} s silent; sent {:?}",
        sent.per_host
    );
    println!(
        "admitted per cycle: {:?}",
        per_cycle.iter().map(|n| n.round()).collect::<Vec<_>>()
    );
    println!(
        "admitted {admitted} in {end:.1} s (rate x T = {:.0}); largest excess over rate x T: \
         {excess:.0} packets, window {:.2}-{:.2} s (bound {bound:.0})",
        RATE * end,
        worst.0,
        worst.1
    );
    for s in stalls {
        println!(
            "stall: {} did not run for {:.0} ms from {:.2} s",
            s.who,
            s.secs * 1000.0,
            s.at
        );
    }
    Figures {
        per_cycle,
        excess,
        worst,
        bound,
    }
}

/// No receiver's socket overran: the samples count every packet the hosts admitted, so the
/// figures below are the cluster's, not the receivers'.
fn assert_the_receivers_missed_nothing(seen: &Seen) {
    assert_eq!(
        seen.drops,
        vec![0; HOSTS],
        "receivers overrun: the counts miss what the hosts admitted"
    );
}

/// No window of the run admits more over `rate x T` than docs/cluster.md's bound: the hosts'
/// bursts once and the lag, not a burst per host at every cycle (an idle key keeps its even
/// part at each host holding it, so the buckets together hold one burst).
fn assert_no_window_beyond_the_bound(fig: &Figures) {
    let Figures {
        per_cycle,
        excess,
        worst,
        bound,
    } = fig;
    let (excess, bound) = (*excess, *bound);
    assert!(
        excess <= bound,
        "a window ({:.2}-{:.2} s) admitted {excess:.0} packets over rate x T, more than the \
         docs/cluster.md's bound {bound:.0} (hosts x burst once, and the lag): per cycle {per_cycle:?}",
        worst.0,
        worst.1
    );
}

/// Not by starving the source: after the first cycle, each still admits a good part of one
/// burst (every host's bucket holds its third of it; a stall of the sender can cut a burst
/// short, hence only half).
fn assert_the_later_cycles_not_starved(fig: &Figures) {
    let per_cycle = &fig.per_cycle;
    let later: f64 = per_cycle[1..].iter().sum();
    #[expect(clippy::cast_precision_loss, reason = "small counts")]
    let least = 0.5 * (CYCLES - 1) as f64 * BURST as f64;
    assert!(
        later >= least,
        "cycles 2-{CYCLES} admitted {later:.0} in all, less than {least:.0}: {per_cycle:?}"
    );
}
