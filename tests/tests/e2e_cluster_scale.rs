//! The cluster budget at 8 hosts (and 3 through Redis), end to end: real agents, each in its own
//! namespace with the limiter attached, share one `scope = "cluster"` budget (1,000 pps, burst
//! 500, sync 100 ms). One source floods at 4x the budget, spread evenly over the eight hosts (a
//! start, not measured), then 95/5 over two of them, evenly, 95/5 over two others, evenly again
//! (three hosts: 70/20/10, its mirror, even). After each phase has settled (1 s), the cluster
//! admits the budget within 5%; after each change of split, every 1 s window that starts 8 sync
//! intervals (gossip, [`CONVERGE_ROUNDS`]) or 2 (Redis, [`CONVERGE_ROUNDS_REDIS`]) or more after
//! the change admits within 10% of the budget; and over the whole run, between any two samples,
//! within docs/cluster.md's bound.
//!
//! The first phase starts with fresh buckets: every host admits its burst at once (8 x 500
//! packets), which the cluster then pays back (one budget: `burst + rate x t` from the start,
//! see docs/cluster.md's burst bound), so that phase is not measured (the issue's "0.925 x the budget
//! with an even split" was a window that held part of that payback).
//!
//! Run with `--nocapture` for the figures, and `RL_CLUSTER_TRACE=1` for the rate every 100 ms.

use std::time::{Duration, Instant};

use ratelimit_testbed::cluster::stop_agents;
use ratelimit_testbed::{
    assert_none_left,
    cluster_net::{
        cluster_counter, save_agent_logs, stalls, status, ClusterNet, Convergence, Samples, Sent,
        Split, Stall,
    },
    late_rounds::{reading_through, unix_ms, Overdue},
    require_root, AgentProcess, Receiver,
};
use serde_json::Value;

const RATE: f64 = 1000.0;
const BURST: u64 = 500;
const SYNC_MS: u64 = 100;
/// The flood, in total: 4x the budget.
const FLOOD_PPS: f64 = 4000.0;
/// Each phase, after settling, admits within this of the budget (the 5%).
const ACCURACY: f64 = 0.05;
/// "Back within 10% of the budget" ...
const CONVERGED: f64 = 0.10;
/// ... over 1 s windows: over a shorter one, a host's admissions come in steps of one sync
/// (its bucket opens and closes as each round's charges land: up to a round of the budget,
/// 100 packets, on one side of a window), which alone is 10% of 1 s.
const WINDOW: f64 = 1.0;
/// ... from this many sync intervals after a change of split on. A host's demand is read over
/// 2 sync intervals (`DEMAND_ROUNDS`, so that bursty sources do not read 0 between bursts), so a
/// change reaches the shares in 2 rounds and the peers' shares a gossip later; and each host
/// whose demand stopped banked its falling share's refill meanwhile (its bucket holds the whole
/// burst at any share), which it spends when its demand returns: traced at the change from
/// 95/5 to even, about 30 packets at each of 6 hosts at once, then the hosts still at their old
/// shares under the budget for 2-3 rounds; and the host whose demand fell stays at its old share
/// until gossip brings the others' new demand (1-3 gossip rounds after their next round). All
/// are inside docs/cluster.md's bound; together they put the last 1 s window outside 10% at
/// 0.03-0.23 s after a change in quiet runs, 0.34-0.40 s on a loaded machine, and 0.67 s with
/// 0.17 s of rounds overdue in a clean-clone CI run (which failed a limit of 5 intervals).
const CONVERGE_ROUNDS: f64 = 8.0;
/// Through Redis: 2 sync intervals (issue #38). A host writes its demand and reads the others'
/// in one call of each key's script, so what it reads is at most one of their rounds old, not
/// 1-3 gossip rounds after it: measured 0.03-0.14 s after a change through a standalone Redis
/// and 0.03-0.20 s through a Redis Cluster of 3 masters and 3 replicas, at 3 and 8 hosts (0.20
/// s with a busy loop on one of the 2 cores, 0.18 s of it rounds overdue).
const CONVERGE_ROUNDS_REDIS: f64 = 2.0;
/// How often the agents' late rounds are read: each keeps its last 32, 3.2 s of rounds all late.
const READ_LATE_ROUNDS: Duration = Duration::from_secs(2);
/// The most the convergence limit moves for the agents' overdue rounds: however busy the
/// machine, a change of split is back within 10% by `CONVERGE_ROUNDS` intervals and this (the
/// limiter measured, not only the machine). A clean-clone CI run saw 1.06 s of overdue rounds
/// within one convergence (at 8 debug agents on 2 cores) that converged 0.16 s past the limit.
const MOST_OVERDUE: f64 = 1.0;
/// docs/cluster.md's lag: 4 sync intervals.
const LAG_SECS: f64 = 0.4;
/// How far a sample's time can be off what it counted, at either end of an interval.
const SKEW_SECS: f64 = 0.1;
/// How often the receivers are read.
const SAMPLE: Duration = Duration::from_millis(50);

struct Phase {
    name: &'static str,
    secs: f64,
    /// Each host's part of the flood (as many as there are hosts).
    weights: &'static [f64],
    /// Seconds into the phase after which its accuracy is measured.
    settle: f64,
}

const EVEN: [f64; 8] = [1.0; 8];

const PHASES: [Phase; 5] = [
    Phase {
        name: "start (even)",
        secs: 10.0,
        weights: &EVEN,
        // Not measured: every host admits its burst at once (8 x 500 packets) before the
        // shares are known, then the cluster pays the excess back.
        settle: f64::NAN,
    },
    Phase {
        name: "95/5 (h0/h1)",
        secs: 8.0,
        weights: &[95.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        settle: 1.0,
    },
    Phase {
        name: "even",
        secs: 8.0,
        weights: &EVEN,
        settle: 1.0,
    },
    Phase {
        name: "95/5 (h7/h6)",
        secs: 8.0,
        weights: &[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 5.0, 95.0],
        settle: 1.0,
    },
    Phase {
        name: "even again",
        secs: 8.0,
        weights: &EVEN,
        settle: 1.0,
    },
];

/// Three hosts: a start, not measured, then a 70/20/10 split, its mirror, and even.
const PHASES_3: [Phase; 4] = [
    Phase {
        name: "start (even)",
        secs: 8.0,
        weights: &[1.0; 3],
        settle: f64::NAN,
    },
    Phase {
        name: "70/20/10",
        secs: 8.0,
        weights: &[70.0, 20.0, 10.0],
        settle: 1.0,
    },
    Phase {
        name: "10/20/70",
        secs: 8.0,
        weights: &[10.0, 20.0, 70.0],
        settle: 1.0,
    },
    Phase {
        name: "even",
        secs: 8.0,
        weights: &[1.0; 3],
        settle: 1.0,
    },
];

/// Eight real agents (debug builds, as the suite runs them) on the 2-core VM: within 5% of the
/// budget over each phase's 7 s (above it, the rate over each lapse of an agent's shares), and
/// within 10% over every 1 s window from [`CONVERGE_ROUNDS`] sync intervals after each change of
/// split, plus the time the agents' own rounds were overdue.
/// What holds it steady: the program refills each bucket at its share (a share word in the
/// bucket scales each packet's cost), so a host whose round runs late keeps its last share, not
/// its whole demand; a cluster-scoped limit's drops are counted at once; and the agents gossip
/// twice per sync interval. Runs and their figures: tests/README.md and docs/cluster.md, Accuracy.
#[test]
fn eight_agents_admit_the_budget_for_even_and_95_5_splits_and_converge_within_8_sync_intervals() {
    agents("rl-cs", Store::Gossip, &PHASES);
}

/// [`eight_agents_admit_the_budget_for_even_and_95_5_splits_and_converge_within_8_sync_intervals`]
/// with the agents on `backend = "redis"`: their demand exchanged through a real standalone
/// `redis-server` ([`ClusterNet::start_redis`]), no gossip; the same share arithmetic, so the
/// same limits.
#[test]
fn eight_agents_through_redis_admit_the_budget_for_even_and_95_5_splits_and_converge_within_2_sync_intervals(
) {
    agents("rl-csr", Store::Redis, &PHASES);
}

/// The same through a Redis Cluster of 3 masters, each with a replica
/// ([`ClusterNet::start_redis_cluster`]): every key's hash on the shard its hash tag names, a
/// round's calls spread over the three.
#[test]
fn eight_agents_through_a_redis_cluster_admit_the_budget_for_even_and_95_5_splits_and_converge_within_2_sync_intervals(
) {
    agents("rl-csc", Store::RedisCluster, &PHASES);
}

/// Three agents through a standalone Redis, the split changing from 70/20/10 to its mirror and to
/// even: the same limits as eight.
#[test]
fn three_agents_through_redis_admit_the_budget_after_changes_of_split_and_converge_within_2_sync_intervals(
) {
    agents("rl-c3r", Store::Redis, &PHASES_3);
}

/// The same through a Redis Cluster of 3 masters.
#[test]
fn three_agents_through_a_redis_cluster_admit_the_budget_after_changes_of_split_and_converge_within_2_sync_intervals(
) {
    agents("rl-c3c", Store::RedisCluster, &PHASES_3);
}

/// Where the agents exchange their demand.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Store {
    Gossip,
    Redis,
    RedisCluster,
}

/// What keeps a store running for the test: dropped after the agents.
enum Running {
    None,
    Redis(ratelimit_testbed::redis::RedisServer),
    Cluster(ratelimit_testbed::redis::RedisCluster),
}

/// One scenario at a time: two runs of 8 agents and a 4,000 pps flood on 2 cores would measure
/// each other.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The scenario on gossip, or through Redis.
fn agents(tag: &str, store: Store, phases: &[Phase]) {
    require_root();
    let _alone = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let hosts = phases[0].weights.len();
    let net = ClusterNet::new(tag, hosts).unwrap();
    // Dropped after the agents (declared before them).
    let redis = start_the_store(&net, store);
    let agents = start_the_agents(&net, &redis);
    let receivers = net.receivers().unwrap();
    let seen = flood_phase_by_phase(tag, &net, &agents, &receivers, phases);
    let fig = figures(store, hosts, phases, &seen);
    assert_each_phase_admits_the_budget_and_converges(phases, &fig);
    assert_within_the_written_bound(&fig);
    assert_every_peer_still_counted(hosts, &seen);

    // --- Clean up. ---
    drop(receivers);
    stop_agents(agents);
    drop(redis);
    drop(net);
    assert_none_left(&format!("{tag}-"));
}

/// The store the agents exchange their demand through, started in `net`: none for gossip, a
/// standalone `redis-server`, or a Redis Cluster of 3 masters and their replicas.
fn start_the_store(net: &ClusterNet, store: Store) -> Running {
    match store {
        Store::Gossip => Running::None,
        Store::Redis => Running::Redis(net.start_redis().unwrap()),
        Store::RedisCluster => Running::Cluster(net.start_redis_cluster(3).unwrap()),
    }
}

/// An agent on each host of `net` sharing the budget through `redis` (gossip where none), each
/// started until it counts the others.
#[expect(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "1000"
)]
fn start_the_agents(net: &ClusterNet, redis: &Running) -> Vec<AgentProcess> {
    match redis {
        Running::None => net.start_agents(RATE as u64, BURST, SYNC_MS, Duration::from_secs(60)),
        Running::Redis(r) => net.start_agents_with(
            |i| net.redis_config(i, RATE as u64, BURST, SYNC_MS, &r.url()),
            Duration::from_secs(60),
        ),
        Running::Cluster(c) => {
            let urls = c.urls();
            net.start_agents_with(
                |i| net.redis_cluster_config(i, RATE as u64, BURST, SYNC_MS, &urls),
                Duration::from_secs(60),
            )
        }
    }
    .unwrap()
}

/// What [`flood_phase_by_phase`] saw.
struct Seen {
    samples: Samples,
    sent: Sent,
    /// Each phase's start and end, s, and the run's end.
    bounds: Vec<(f64, f64)>,
    end: f64,
    /// How long the run took, s.
    elapsed: f64,
    /// When the test's own threads did not run (a busy or paused machine): the samples around
    /// such a stall misstate the rate (see `Stall::skews`), and a window measured from them is
    /// not held against the convergence if it is outside (printed as excused).
    stalls: Vec<Stall>,
    /// Each agent's `bytes_out` before the flood, and its status after.
    before: Vec<u64>,
    statuses: Vec<Value>,
    /// When the agents' own rounds ran late (measured by each agent: `cluster.late_rounds`): a
    /// change of split reaches the buckets that much later, so the convergence limit moves by it.
    overdue: Overdue,
}

/// The flood of [`FLOOD_PPS`], split as each phase says in turn, sampled every [`SAMPLE`] while
/// the agents' late rounds are read every [`READ_LATE_ROUNDS`]; then each agent's status, and
/// its log saved where asked. Asserts nothing: the figures come first.
fn flood_phase_by_phase(
    tag: &str,
    net: &ClusterNet,
    agents: &[AgentProcess],
    receivers: &[Receiver],
    phases: &[Phase],
) -> Seen {
    let mut schedule = Vec::new();
    let mut t = 0.0;
    let mut bounds = Vec::new();
    for p in phases {
        bounds.push((t, t + p.secs));
        t += p.secs;
        schedule.push(Split {
            end: t,
            pps: FLOOD_PPS,
            weights: p.weights.to_vec(),
        });
    }
    let end = t;
    let before: Vec<u64> = agents
        .iter()
        .map(|a| cluster_counter(&status(a).unwrap(), "bytes_out"))
        .collect();
    let start = Instant::now();
    let start_unix_ms = unix_ms();
    let sender = net.flood(schedule, start).unwrap();
    let mut samples = Samples::default();
    // The agents' late rounds, read through the run (each keeps only its last 32).
    let ((), readings) = reading_through(
        agents,
        start + Duration::from_secs_f64(end),
        READ_LATE_ROUNDS,
        || samples.take_until(receivers, start, end, SAMPLE),
    );
    let sent = sender.join().unwrap();
    let elapsed = start.elapsed().as_secs_f64();
    let stalls = stalls(&sent, receivers, start);
    let statuses: Vec<_> = agents.iter().map(|a| status(a).unwrap()).collect();
    let overdue = Overdue::of(&readings, start_unix_ms);
    if save_agent_logs(tag, agents) {
        println!("start at unix ms {start_unix_ms}");
    }
    Seen {
        samples,
        sent,
        bounds,
        end,
        elapsed,
        stalls,
        before,
        statuses,
        overdue,
    }
}

/// A phase's figures: what it admitted after settling, pps (NaN where not measured); what the
/// lapses of the agents' shares that ended within that span allow above the budget, pps (the
/// whole rate over each: that host's buckets refilled at it, failing open); and after a change
/// of split its convergence and the deadline it is held to, s.
type PhaseFigures = (f64, f64, Option<(Convergence, f64)>);

/// What the assertions check.
struct Figures {
    /// Each phase's, in order.
    results: Vec<PhaseFigures>,
    /// The convergence limit: in sync intervals, and in s.
    rounds: f64,
    limit: f64,
    /// The largest excess over `rate x T` between two samples, from and to when, and
    /// docs/cluster.md's bound on it.
    excess: f64,
    from: f64,
    to: f64,
    bound: f64,
}

/// Prints the run, each phase's figures, the largest excess over `rate x T` and its bound, and
/// the agents' counters (and the rate every 0.5 s where `RL_CLUSTER_TRACE` is set), and returns
/// what the assertions check: all printed before any assertion, so a failing run shows them.
fn figures(store: Store, hosts: usize, phases: &[Phase], seen: &Seen) -> Figures {
    print_the_run(store, hosts, seen);
    let rounds = match store {
        Store::Gossip => CONVERGE_ROUNDS,
        Store::Redis | Store::RedisCluster => CONVERGE_ROUNDS_REDIS,
    };
    let limit = rounds * f64::from(u32::try_from(SYNC_MS).unwrap()) / 1000.0;
    let results = phase_figures(hosts, phases, seen, limit);
    let Seen {
        samples,
        end,
        overdue,
        ..
    } = seen;
    // docs/cluster.md's bound over any interval: `rate x T + (2 x hosts - 1) x burst + (hosts - 1)
    // x rate x lag`, plus the rate over the sampling's skew at both ends and over each lapse of
    // an agent's shares (a late round: that host at the whole rate meanwhile).
    let (excess, from, to) = samples.largest_excess(RATE);
    let lapses = overdue.lapsed_refill(RATE, 0.0, *end);
    #[expect(clippy::cast_precision_loss, reason = "small")]
    let bound = (2.0 * hosts as f64 - 1.0) * BURST as f64
        + (hosts as f64 - 1.0) * RATE * LAG_SECS
        + RATE * 2.0 * SKEW_SECS
        + lapses;
    println!(
        "largest excess over rate x T: {excess:.0} ({from:.2}-{to:.2} s), bound {bound:.0} \
         ({lapses:.0} of it for lapsed shares)"
    );
    print_the_agents_counters(seen);
    if std::env::var_os("RL_CLUSTER_TRACE").is_some() {
        for (t, r) in samples.trailing_rates(0.0, *end, 0.5) {
            println!("t {t:6.2} cluster rate over the last 0.5 s {r:6.0}");
        }
    }
    Figures {
        results,
        rounds,
        limit,
        excess,
        from,
        to,
        bound,
    }
}

/// Prints the hosts, the store, the budget and what the flood sent, the stalls of the test's
/// threads, and the agents' late rounds.
fn print_the_run(store: Store, hosts: usize, seen: &Seen) {
    let Seen {
        sent,
        stalls,
        overdue,
        ..
    } = seen;
    println!(
        "\n{hosts} hosts{}, budget {RATE} pps (burst {BURST}) cluster-wide, flood {FLOOD_PPS} pps, sync {SYNC_MS} ms; sent {:?}",
        match store {
            Store::Gossip => "",
            Store::Redis => " through Redis",
            Store::RedisCluster => " through a Redis Cluster",
        },
        sent.per_host
    );
    for s in stalls {
        println!(
            "stall: {} did not run for {:.0} ms from {:.2} s",
            s.who,
            s.secs * 1000.0,
            s.at
        );
    }
    for &(h, from, landed) in &overdue.spans {
        println!(
            "late round: h{h} set its shares at {landed:.2} s, {:.0} ms past a quarter sync interval after due",
            (landed - from) * 1000.0
        );
    }
    if !overdue.incomplete.is_empty() {
        println!("late rounds not all kept by h{:?}", overdue.incomplete);
    }
}

/// Prints each phase's figures (what it admitted after settling, in all, over its 1 s windows
/// and per host; after a change of split, from when every 1 s window was within 10% and what
/// was excused; the agents' rounds overdue meanwhile) and returns them, its convergence held
/// to `limit` s plus those overdue rounds (at most [`MOST_OVERDUE`]).
fn phase_figures(hosts: usize, phases: &[Phase], seen: &Seen, limit: f64) -> Vec<PhaseFigures> {
    let Seen {
        samples,
        bounds,
        stalls,
        overdue,
        ..
    } = seen;
    // A host whose agent did not run a round in time refilled at the whole rate until the
    // next (fail open): the windows that hold such a lapse may admit that much more.
    let lapsed: Vec<(f64, f64)> = overdue.lapses.iter().map(|l| (l.1 - l.2, l.1)).collect();
    let mut results = Vec::new();
    for (i, (p, &(t0, t1))) in phases.iter().zip(bounds).enumerate() {
        if p.settle.is_nan() {
            println!(
                "{:<14} {:>4.1}-{:>4.1} s: not measured (the first bursts and their payback)",
                p.name, t0, t1
            );
            results.push((f64::NAN, 0.0, None));
            continue;
        }
        let measured = samples.rate(t0 + p.settle, t1);
        let lapsed_pps = overdue.lapsed_refill(RATE, t0 + p.settle, t1) / (t1 - t0 - p.settle);
        let conv =
            (i > 0).then(|| samples.convergence(t0, t1, WINDOW, RATE, CONVERGED, stalls, &lapsed));
        let per_host: Vec<String> = (0..hosts)
            .map(|h| format!("{:.0}", samples.host_rate(h, t0 + p.settle, t1)))
            .collect();
        let worst = samples
            .trailing_rates(t0 + p.settle, t1, WINDOW)
            .iter()
            .map(|(_, r)| r / RATE)
            .fold((f64::MAX, f64::MIN), |(lo, hi), r| (lo.min(r), hi.max(r)));
        println!(
            "{:<14} measured {:>4.1}-{:>4.1} s: {:>6.0} pps = {:.3} x budget (1 s windows {:.3}-{:.3}); per host [{}]; {}",
            p.name,
            t0 + p.settle,
            t1,
            measured,
            measured / RATE,
            worst.0,
            worst.1,
            per_host.join(" "),
            match conv.as_ref().map(|c| c.after) {
                None => String::new(),
                Some(None) => "never within 10% over 1 s".to_string(),
                Some(Some(c)) => format!(
                    "within 10% over every 1 s window from {:.2} s ({:.1} sync intervals) after the change",
                    c,
                    c * 1000.0 / f64::from(u32::try_from(SYNC_MS).unwrap())
                ),
            }
        );
        if lapsed_pps > 0.0 {
            println!(
                "  agents' shares lapsed within the measured span: up to {lapsed_pps:.0} pps more allowed"
            );
        }
        if let Some(c) = &conv {
            for (u, r) in &c.excused {
                println!(
                    "  excused: the window from {u:.2} s, {r:.3} x the budget, measured from a sample taken in a stall or holding a lapse of shares"
                );
            }
        }
        let overdue_secs = overdue.deadline(t0, limit) - limit;
        let deadline = limit + overdue_secs.min(MOST_OVERDUE);
        if overdue_secs > 0.0 {
            println!(
                "  agents' rounds overdue within the convergence: {overdue_secs:.2} s; limit {limit:.2} s + {:.2} s",
                deadline - limit
            );
        }
        results.push((measured, lapsed_pps, conv.map(|c| (c, deadline))));
    }
    results
}

/// Prints what each agent gossiped per second over the run, the gossip it dropped unread for
/// waiting too long, and its charges clamped and debt capped.
fn print_the_agents_counters(seen: &Seen) {
    let Seen {
        elapsed,
        before,
        statuses,
        ..
    } = seen;
    #[expect(clippy::cast_precision_loss, reason = "small counts")]
    let gossip: Vec<String> = statuses
        .iter()
        .zip(before)
        .map(|(s, b)| {
            format!(
                "{:.0}",
                (cluster_counter(s, "bytes_out") - b) as f64 / elapsed
            )
        })
        .collect();
    println!("gossip sent per host, B/s: [{}]", gossip.join(" "));
    println!(
        "gossip datagrams dropped unread after waiting over a sync interval: {:?}",
        statuses
            .iter()
            .map(|s| cluster_counter(s, "rejected_late"))
            .collect::<Vec<_>>()
    );
    println!(
        "charges clamped: {:?}, debt capped: {:?}",
        statuses
            .iter()
            .map(|s| cluster_counter(s, "charges_clamped"))
            .collect::<Vec<_>>(),
        statuses
            .iter()
            .map(|s| cluster_counter(s, "debt_capped"))
            .collect::<Vec<_>>()
    );
}

/// Each measured phase admits the budget within [`ACCURACY`] after settling (above it, also the
/// whole rate over each lapse of an agent's shares that ended within the span, as the written
/// bound counts it); after each change of split, most 1 s windows are within 10% of it by
/// themselves (excusing windows measures nothing if most of them need it), and every 1 s window
/// is from the convergence limit on, moved by the agents' own overdue rounds.
fn assert_each_phase_admits_the_budget_and_converges(phases: &[Phase], fig: &Figures) {
    let Figures {
        results,
        rounds,
        limit,
        ..
    } = fig;
    let (rounds, limit) = (*rounds, *limit);
    for (p, (measured, lapsed, conv)) in phases.iter().zip(results) {
        if measured.is_nan() {
            continue;
        }
        let ratio = measured / RATE;
        let over = lapsed / RATE;
        assert!(
            1.0 - ratio <= ACCURACY && ratio - 1.0 <= ACCURACY + over,
            "{}: the cluster admitted {measured:.0} pps = {ratio:.3} x the budget after settling, want within {:.0}% (above it, {:.1}% more for the agents' lapsed shares)",
            p.name,
            ACCURACY * 100.0,
            over * 100.0
        );
        if let Some((conv, deadline)) = conv {
            let deadline = *deadline;
            // Excusing windows measures nothing if most of them need it: then the machine was too
            // busy for this test to say anything, which is a failure, not a pass.
            assert!(
                conv.within * 2 >= conv.windows,
                "{}: only {} of {} 1 s windows within 10% of the budget by themselves ({} excused by stalls of the test's threads or lapses of shares)",
                p.name,
                conv.within,
                conv.windows,
                conv.excused.len()
            );
            let c = conv.after.unwrap_or_else(|| {
                panic!("{}: never back within 10% of the budget over 1 s", p.name)
            });
            assert!(
                c <= deadline + 1e-9,
                "{}: within 10% of the budget over every 1 s window only from {c:.2} s after the change, want {limit:.1} s ({rounds} sync intervals) + {:.2} s of the agents' rounds overdue (at most {MOST_OVERDUE} s)",
                p.name,
                deadline - limit
            );
        }
    }
}

/// Over the whole run, between any two samples, the cluster admits no more over `rate x T` than
/// docs/cluster.md's bound (with the sampling's skew and the agents' lapsed shares).
fn assert_within_the_written_bound(fig: &Figures) {
    let Figures {
        excess,
        from,
        to,
        bound,
        ..
    } = *fig;
    assert!(
        excess <= bound,
        "the cluster admitted {excess:.0} over rate x T between {from:.2} and {to:.2} s, over \
         the written bound {bound:.0}"
    );
}

/// At the end every agent still counts every peer: the run measured one cluster throughout.
fn assert_every_peer_still_counted(hosts: usize, seen: &Seen) {
    for (i, s) in seen.statuses.iter().enumerate() {
        assert_eq!(
            ratelimit_testbed::cluster_net::counted_peers(s).len(),
            hosts - 1,
            "h{i} no longer counts every peer: {}",
            s["cluster"]
        );
    }
}
