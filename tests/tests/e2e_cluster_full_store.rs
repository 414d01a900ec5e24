//! A new key of a cluster budget on hosts whose bucket stores are full, end to end: two real
//! agents share one `scope = "cluster"` budget (1,000 pps, burst 100, sync 100 ms) and each
//! tracks a million other sources (written into its store from user space, as the program
//! would for a million sources of another rule: a busy server, or a spoofed flood). A source
//! new to both then sends at three times the budget, evenly over the two hosts.
//!
//! Over any window T the cluster must admit at most docs/cluster.md's bound, `rate x T + (2 x
//! hosts - 1) x burst + (hosts - 1) x rate x lag` (lag 400 ms at this interval, plus 50 ms of
//! `rate` for the sampling, as `e2e_cluster/` allows), however many buckets the hosts track.
//! The lag is 4 of the agents' own rounds: 4 sync intervals, or 4 of the slowest agent's
//! rounds where they took longer (a debug agent's round under the flood is most of an interval
//! of work on this 2-core machine; at most [`SLOWEST_ROUND`]), as its `syncs` counter shows;
//! a lapse of a host's shares adds the rate over it (fail open), as the agents report it in
//! `status --json` (`cluster.late_rounds`).
//!
//! New keys are found in the pages the program flags when it creates their buckets
//! (`RL_NEW_PAGES`), at the next round, however large the store; a walk of the whole store runs
//! a slice a round, so that it never holds up a round past the shares' lapse. Without the flags
//! the key was found only by the next walk of the store (paced to a tenth of a core: seconds
//! apart here), and both hosts admitted it at the whole rate until then: 3,780 over `rate x T`
//! in 4 s against a bound of 750.
//!
//! The attacker's answer, a flood of spoofed new keys of a cluster-scoped limit that flags
//! pages faster than an agent reads them, meets the grown slots: a key whose count passes a
//! power of two is read at the next round whatever the pages' pass (the two flood tests, the
//! heavy source in bursts).
//!
//! Run with `--nocapture` for the figures.

use std::{
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use ratelimit_testbed::{
    agent_proc::global_counter,
    bursty::Plan,
    cluster::stop_agents,
    cluster_net::{cluster_counter, flood_rule, status, ClusterNet, Samples, Split, FLOOD},
    fill::fill_store,
    late_rounds::{reading_through, unix_ms, Overdue},
    require_root,
};

const HOSTS: usize = 2;
const RATE: f64 = 1000.0;
const BURST: u64 = 100;
const SYNC_MS: u64 = 100;
/// Buckets of the other rule in each store: its whole capacity (the default `max_buckets`).
const OTHERS: u32 = 1 << 20;
/// The lag in rounds: a key's demand is known at the first round after its bucket's creation,
/// its peers read it a round later, a round more when gossip lost it once, and a round to spare.
const LAG_ROUNDS: f64 = 4.0;
/// The longest mean round the lag is reckoned from, seconds: twice the sync interval (agents
/// slower than that are held to it all the same).
const SLOWEST_ROUND: f64 = 0.2;
const SKEW_SECS: f64 = 0.05;
const SECS: f64 = 4.0;
/// The spoofed flood's frames a second at each host, every one from a new source ...
const SPOOFED_PPS: u64 = 20_000;
/// ... for this long before the heavy source starts, and on until it ends.
const FLOOD_LEAD: f64 = 1.0;
/// The heavy source's bursts in the flood test: this many back to back ...
const BURST_SIZE: u32 = 50;
/// ... to each host this often (1,500 a second each), the hosts' bursts half a period apart.
const BURST_PERIOD: f64 = 1.0 / 30.0;

/// One scenario at a time: each runs two agents over a million buckets, and the flood's
/// 40,000 frames a second beside the other scenario's agents would make its rounds late.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The bed's cluster-scoped rule, a second one for the spoofed flood's sources (100.64.0.0/10),
/// and a plain one the other sources' buckets are of.
fn rules() -> String {
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "1000"
    )]
    let rate = RATE as u64;
    format!(
        "{}\n[[rule]]\nname = \"others\"\nsource = \"10.0.0.0/8\"\nrate = 1000\nburst = 1000\n\
         \n[[rule]]\nname = \"spoofed\"\nsource = \"100.64.0.0/10\"\nrate = 1000\nburst = 100\n\
         per = \"source\"\nscope = \"cluster\"\n",
        flood_rule(rate, BURST)
    )
}

/// What one run of the bed measured.
struct Outcome {
    /// The largest excess over `rate x T`, and its window.
    excess: f64,
    worst: (f64, f64),
    /// Spoofed frames the sender got out, per host.
    spoofed_sent: Vec<u64>,
    /// Buckets each host's program created.
    new_buckets: Vec<u64>,
    /// Each agent's sync rounds whose shares landed late.
    rounds_late: Vec<u64>,
    /// Those rounds, read through the run (a lapse of a host's shares counts in the bound).
    overdue: Overdue,
    /// Each agent's sync rounds during the heavy source's [`SECS`].
    rounds: Vec<u64>,
}

impl Outcome {
    /// Bound of docs/cluster.md's written promise over any window, past `rate x T`: the lag
    /// ([`Outcome::lag`]) and the rate over each lapse of a host's shares.
    #[expect(clippy::cast_precision_loss, reason = "small counts")]
    fn bound(&self) -> f64 {
        (2 * HOSTS - 1) as f64 * BURST as f64
            + (HOSTS - 1) as f64 * RATE * self.lag()
            + RATE * SKEW_SECS
            + self.overdue.lapsed_refill(RATE, 0.0, SECS)
    }

    /// [`LAG_ROUNDS`] of the slowest agent's rounds: a sync interval each, or their mean
    /// length over the run where that was longer (at most [`SLOWEST_ROUND`]).
    #[expect(clippy::cast_precision_loss, reason = "a few dozen rounds")]
    fn lag(&self) -> f64 {
        let fewest = self.rounds.iter().copied().min().unwrap_or(0).max(1);
        let round = (SECS / fewest as f64).clamp(SYNC_MS as f64 / 1000.0, SLOWEST_ROUND);
        LAG_ROUNDS * round
    }

    /// Holds the run to [`Outcome::bound`]; `what` names the run in the message.
    fn assert_within_the_bound(&self, what: &str) {
        assert!(
            self.excess <= self.bound(),
            "{what} the cluster admitted {:.0} over rate x T ({:.2}-{:.2} s), over the bound {:.0} \
             (rounds late {:?}, rounds while it sent {:?}, lag {:.0} ms)",
            self.excess,
            self.worst.0,
            self.worst.1,
            self.bound(),
            self.rounds_late,
            self.rounds,
            self.lag() * 1000.0,
        );
    }
}

/// Starts the agents (bucket stores filled with [`OTHERS`]), then, if `spoofed_pps` is not 0,
/// a flood of spoofed sources new to every host, each of them a new key of a cluster-scoped
/// limit sent `copies` frames back to back, at `spoofed_pps` frames a second per host, and
/// after [`FLOOD_LEAD`] the source at three times the budget over the two hosts for [`SECS`]
/// (`bursty`: in bursts of [`BURST_SIZE`] every [`BURST_PERIOD`] to each host; else paced
/// evenly); returns what the cluster admitted of it.
fn run(tag: &str, spoofed_pps: u64, copies: u32, bursty: bool) -> Outcome {
    require_root();
    let _alone = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let net = ClusterNet::new(tag, HOSTS).unwrap();
    let agents = net
        .start_agents_with(
            |i| net.config_with(i, &rules(), SYNC_MS),
            Duration::from_secs(60),
        )
        .unwrap();
    for a in &agents {
        assert_eq!(
            fill_store(a.pin_path(), "others", OTHERS, 100).unwrap(),
            OTHERS
        );
    }
    // Let each agent's cluster scan meet the full store.
    std::thread::sleep(Duration::from_secs(3));
    let created = |agents: &[ratelimit_testbed::AgentProcess]| -> Vec<u64> {
        agents
            .iter()
            .map(|a| global_counter(&a.stats(), "new_buckets"))
            .collect()
    };
    let created_before = created(&agents);
    let flood = if spoofed_pps == 0 {
        Vec::new()
    } else {
        // Every `copies` frames from a source none of the hosts has seen: 100.64.0.0/10 in
        // order.
        #[expect(clippy::cast_possible_truncation, reason = "a few hundred thousand")]
        let n = (spoofed_pps as f64 * (FLOOD_LEAD + SECS + 1.0)) as u32;
        let sources: Vec<Ipv4Addr> = (0..n)
            .map(|k| Ipv4Addr::from(0x6440_0000 + k / copies))
            .collect();
        let threads = net
            .spoofed_flood(
                &sources,
                9001,
                spoofed_pps,
                Duration::from_secs_f64(FLOOD_LEAD + SECS),
            )
            .unwrap();
        std::thread::sleep(Duration::from_secs_f64(FLOOD_LEAD));
        threads
    };
    let receivers = net.receivers().unwrap();
    // Each agent's rounds so far, read before the start so as not to hold up the sampling.
    let syncs_before: Vec<u64> = agents
        .iter()
        .map(|a| cluster_counter(&status(a).unwrap(), "syncs"))
        .collect();
    let start = Instant::now();
    let start_unix_ms = unix_ms();
    // What the sender sent to each host, once it is done.
    let sender: Box<dyn FnOnce() -> Vec<u64>> = if bursty {
        // Back to back to each host in turn, 1,500 a second each.
        let mut plan = Plan::default();
        for h in 0..HOSTS {
            #[expect(clippy::cast_precision_loss, reason = "2 hosts")]
            let offset = BURST_PERIOD * h as f64 / HOSTS as f64;
            plan = plan.periodic(h, BURST_SIZE, BURST_PERIOD, offset, SECS, |_| true);
        }
        let bursts = net.bursts_from(FLOOD, plan, start).unwrap();
        Box::new(move || {
            let log = bursts.join().unwrap();
            (0..HOSTS)
                .map(|h| log.sent.iter().filter(|d| d.host == h).count() as u64)
                .collect()
        })
    } else {
        let steady = net
            .flood(
                vec![Split {
                    end: SECS,
                    pps: 3.0 * RATE,
                    weights: vec![1.0; HOSTS],
                }],
                start,
            )
            .unwrap();
        Box::new(move || steady.join().unwrap().per_host)
    };
    let mut samples = Samples::default();
    // The agents' late rounds, read through the run (each keeps only its last 32).
    let ((), readings) = reading_through(
        &agents,
        start + Duration::from_secs_f64(SECS),
        Duration::from_secs(1),
        || samples.take_until(&receivers, start, SECS, Duration::from_millis(50)),
    );
    // Each agent's counters once the source is done: its rounds since the start, its late ones.
    let after: Vec<serde_json::Value> = agents.iter().map(|a| status(a).unwrap()).collect();
    let rounds: Vec<u64> = after
        .iter()
        .zip(&syncs_before)
        .map(|(s, b)| cluster_counter(s, "syncs") - b)
        .collect();
    let rounds_late: Vec<u64> = after
        .iter()
        .map(|s| cluster_counter(s, "rounds_late"))
        .collect();
    let overdue = Overdue::of(&readings, start_unix_ms);
    let sent = sender();
    let spoofed_sent: Vec<u64> = flood
        .into_iter()
        .map(|t| t.join().unwrap().unwrap().sent)
        .collect();
    let total = |s: &ratelimit_testbed::cluster_net::Sample| s.counts.iter().sum::<u64>();
    let (excess, worst) = samples.worst_excess(RATE);
    let first: Vec<(f64, u64)> = samples.0.iter().take(30).map(|s| (s.t, total(s))).collect();
    let new_buckets: Vec<u64> = created(&agents)
        .iter()
        .zip(&created_before)
        .map(|(a, b)| a - b)
        .collect();
    drop(receivers);
    stop_agents(agents);
    let o = Outcome {
        excess,
        worst,
        spoofed_sent,
        new_buckets,
        rounds_late,
        overdue,
        rounds,
    };
    println!(
        "\nsent {sent:?}; spoofed frames sent {:?}, buckets created {:?}, rounds late {:?}, \
         rounds while it sent {:?} (lag {:.0} ms), shares lapsed {:?}\nadmitted over time {first:?}\n\
         largest excess over rate x T: {excess:.0} ({:.2}-{:.2} s), bound {:.0}",
        o.spoofed_sent,
        o.new_buckets,
        o.rounds_late,
        o.rounds,
        o.lag() * 1000.0,
        o.overdue.lapses,
        worst.0,
        worst.1,
        o.bound(),
    );
    o
}

#[test]
fn a_new_key_on_hosts_tracking_a_million_sources_stays_within_the_bound() {
    run("rl-cfs", 0, 1, false).assert_within_the_bound("with no flood");
}

/// The attacker's way around the new pages' flags: a flood of spoofed sources, each a new key
/// of a cluster-scoped limit, flags pages faster than an agent reads them (20,000 new keys a
/// second at each host: most of the 16,384 pages pending, a debug agent reading a few hundred
/// a round), and a heavy new key, sent in bursts, hides among them. The cluster must still hold
/// it to the bound. Before the grown slots the key waited for the pages' pass to come round to
/// its page: 3,459 over `rate x T` against the bound's 750, the cluster at 2,000 pps for the
/// whole 4 s.
#[test]
fn a_heavy_new_key_under_a_flood_of_new_keys_stays_within_the_bound() {
    flooded("rl-cfk", 1);
}

/// The attacker's way around the grown slots: spoofed sources of 2 packets each (10,000 new
/// keys a second at each host: more pages flagged a round than a debug agent reads, and each
/// key marking its grown slot) churn a quarter of the slots every round. A heavy key's marks
/// are heavier than theirs, and stay.
#[test]
fn a_heavy_new_key_under_a_flood_of_two_packet_keys_stays_within_the_bound() {
    flooded("rl-cfl", 2);
}

/// [`run`] with the spoofed flood of keys of `copies` packets and the heavy source in bursts,
/// held to the bound.
fn flooded(tag: &str, copies: u32) {
    let o = run(tag, SPOOFED_PPS, copies, true);
    // The flood was real: most of its keys made a bucket at each host.
    for (sent, made) in o.spoofed_sent.iter().zip(&o.new_buckets) {
        assert!(
            *made >= sent / u64::from(copies) / 2,
            "the spoofed flood made {made} buckets of {sent} frames ({copies} a source): {:?} / \
             {:?}",
            o.new_buckets,
            o.spoofed_sent
        );
    }
    o.assert_within_the_bound(&format!(
        "under a flood of new keys ({copies} packets each)"
    ));
}
