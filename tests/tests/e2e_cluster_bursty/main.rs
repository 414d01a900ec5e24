//! The cluster budget against bursty senders, end to end (issue #34): real agents share one
//! `scope = "cluster"` budget (sync 100 ms) while one source sends each host bursts back to back
//! (`testbed::bursty`), as real clients do, instead of the round-robin pacing of `send_split`
//! that the other cluster tests use. What the hosts' receivers got of those datagrams is compared
//! with what one GCRA bucket of the same rate and burst would have admitted of the very same
//! datagrams (their recorded send times merged): the budget is one bucket's, however the source
//! spreads and times its traffic.
//!
//! The comparison is over a measured window after a warm-up (`warm_up`: at least [`WARM_SECS`]):
//! at the start every host holds its own full burst (docs/cluster.md's `hosts x burst` once),
//! which one bucket would not, and spends it at the excess of what is sent over the rate; the
//! whole run is held to the written bound instead (`within_the_bound`). Each datagram carries
//! its sequence number, so both counts are over the datagrams *sent* in the window, exactly,
//! with no sampling at the window's edges; a sender held up by a busy machine sends later, and
//! the reference sees the same late datagrams.
//!
//! The agent binary is `$RATELIMIT_BIN`, else `target/debug/ratelimit` (what `cargo xtask test`
//! builds): run the file twice, the second time with
//! `RATELIMIT_BIN=target/release/ratelimit` (`cargo xtask build --release`), for both.
//!
//! Run with `--nocapture` for the figures: per host sent and admitted, the cluster's total, the
//! one-bucket reference and their ratio.
//!
//! Every test here fails on the share design of before issue #34 (figures in tests/README.md):
//! a host's bucket refills at its share of the rate but may hold only its share of the burst
//! (the cost is scaled, the tolerance is not), so a host whose bursts come further apart than
//! `burst / rate` loses the rest of each gap's refill, and a share of a burst of 1 holds less
//! than one packet.

use std::thread;
use std::time::Duration;

use ratelimit_testbed::{
    bursty::{BurstLog, Plan},
    cluster_net::FLOOD,
    late_rounds::Overdue,
};

mod harness;
mod onoff;

use crate::harness::{
    plain, plain_on, run, run_on, within_one_bucket, within_one_bucket_on, within_the_bound,
    Backend,
};

const SYNC_MS: u64 = 100;
/// Not measured, at least: the first bursts at every host and the shares settling (see
/// [`warm_up`]).
const WARM_SECS: f64 = 3.0;
/// docs/cluster.md's lag allowance: 4 sync intervals (a key's demand is known at the first round
/// after its bucket's creation, peers read it a round later, a round more when gossip lost it
/// once, and a round to spare for late rounds).
const MAX_LAG_SECS: f64 = 0.4;
/// How far a datagram's send time can be from the program's decision on it (queueing between
/// the socket and the hosts' programs), as `e2e_cluster/` allows for its sampling.
const SKEW_SECS: f64 = 0.05;
/// Measured after the warm-up.
const MEASURE_SECS: f64 = 8.0;
/// The cluster admits within this of one bucket over the measured window (the 5%).
const ACCURACY: f64 = 0.05;

/// One scenario at a time in this file: each compares the cluster with one bucket within 5%,
/// which needs the agents' rounds run about on time (the rounds late and the share lapses they
/// report are printed). With a second scenario's 3-8 agents beside them on the 2-core machine,
/// the 8-host 95/5 row read 1.016-1.022 (its flooded host's rounds up to 190 ms late); alone
/// 0.999-1.000, and 0.999 beside two busy loops.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// What one scenario's run gave.
struct Outcome {
    log: BurstLog,
    /// Per datagram: whether it arrived.
    admitted: Vec<bool>,
    /// Per datagram: whether one bucket would have admitted it.
    reference: Vec<bool>,
    hosts: usize,
    /// When the agents' own rounds ran late and their shares lapsed (each agent's
    /// `cluster.late_rounds`).
    overdue: Overdue,
    /// The cluster's rate.
    rate: f64,
}

impl Outcome {
    /// Prints per host sent and admitted over `[t1, t2)`, the cluster's total, the reference and
    /// the ratio; returns (cluster, reference, per host admitted).
    fn report(&self, what: &str, t1: f64, t2: f64) -> (u64, u64, Vec<u64>) {
        let sent = self.log.per_host(self.hosts, t1, t2);
        let got = self.log.count_per_host(&self.admitted, self.hosts, t1, t2);
        let reference: u64 = self
            .log
            .count_per_host(&self.reference, self.hosts, t1, t2)
            .iter()
            .sum();
        let cluster: u64 = got.iter().sum();
        #[expect(clippy::cast_precision_loss, reason = "small counts")]
        let ratio = cluster as f64 / reference.max(1) as f64;
        println!(
            "{what}: datagrams sent {t1:.1}-{t2:.1} s: per host sent {sent:?}, admitted {got:?}; \
             cluster admitted {cluster}, one bucket {reference}, ratio {ratio:.3}"
        );
        (cluster, reference, got)
    }

    /// How far from one bucket's `reference` admissions over `[t1, t2)` the cluster may be:
    /// [`ACCURACY`], and for every lapse of an agent's shares within the window (its round ran
    /// more than the lag allowance after the one before: the machine stalled it) `rate` times
    /// the lapse: meanwhile that host's bucket refilled at the whole rate (fail open, within
    /// docs/cluster.md's written bound), its debt kept. 0 on a machine that runs the agents on
    /// time.
    fn tolerance(&self, t1: f64, t2: f64, reference: u64) -> f64 {
        let lapses: Vec<_> = self.overdue.lapses_within(t1, t2).collect();
        let allowed = self.overdue.lapsed_refill(self.rate, t1, t2);
        #[expect(clippy::cast_precision_loss, reason = "small counts")]
        let lag = allowed / reference.max(1) as f64;
        for (h, at, secs) in &lapses {
            println!(
                "  h{h}'s shares lapsed for {:.0} ms until {at:.2} s (its rounds stalled): \
                 tolerance + {:.0} datagrams",
                secs * 1000.0,
                (self.rate * secs).ceil()
            );
        }
        if !self.overdue.incomplete.is_empty() {
            println!(
                "  late rounds not all kept by h{:?}",
                self.overdue.incomplete
            );
        }
        ACCURACY + lag
    }

    /// Cluster and one-bucket admissions per second of send time, for the trace.
    fn per_second(&self, end: f64) {
        let mut line = String::new();
        let mut t = 0.0;
        while t < end {
            let c: u64 = self
                .log
                .count_per_host(&self.admitted, self.hosts, t, t + 1.0)
                .iter()
                .sum();
            let r: u64 = self
                .log
                .count_per_host(&self.reference, self.hosts, t, t + 1.0)
                .iter()
                .sum();
            line.push_str(&format!(" {c}/{r}"));
            t += 1.0;
        }
        println!("per second, cluster/one bucket:{line}");
    }
}

/// The bursty case: two hosts, one source sending 150 datagrams back to back every
/// 250 ms to each (host B a half period after host A), 1.2 x the budget in all. One bucket
/// refills 125 tokens between consecutive bursts and admits 125 of each; the cluster must too.
#[test]
fn two_hosts_with_interleaved_bursts_admit_what_one_bucket_would() {
    within_one_bucket("rl-cb2", 2, 1000.0, 500.0, 1200.0, interleaved);
}

/// The plan of [`two_hosts_with_interleaved_bursts_admit_what_one_bucket_would`].
fn interleaved(end: f64) -> Plan {
    Plan::default()
        .periodic(0, 150, 0.25, 0.0, end, |_| true)
        .periodic(1, 150, 0.25, 0.125, end, |_| true)
}

/// [`two_hosts_with_interleaved_bursts_admit_what_one_bucket_would`] with the agents on
/// `backend = "redis"` (a real `redis-server`, no gossip): the same share arithmetic over the
/// demand exchanged through the store, so the same figures.
#[test]
fn two_hosts_with_interleaved_bursts_through_redis_admit_what_one_bucket_would() {
    within_one_bucket_on(
        Backend::Redis,
        "rl-cbr2",
        2,
        1000.0,
        500.0,
        1200.0,
        interleaved,
    );
}

/// Eight hosts, 500 pps to each in bursts of 125 back to back every 250 ms, the hosts' phases
/// spread over the period (a burst somewhere every 31 ms): 4 x the budget, evenly split. One
/// bucket refills 31 tokens between consecutive bursts and admits them: the budget. A host's
/// bucket gets a burst only every 250 ms, longer than the tolerance (`burst / rate`, 100 ms): a
/// host that may hold only its share of the burst (12.5 packets at 1/8) loses the refill of the
/// rest of the period. (Bursts of 25 every 50 ms fall within the tolerance and do not show it:
/// hosts holding only their share of the burst admitted 1.023 x one bucket's of those.)
#[test]
fn eight_hosts_with_even_bursts_admit_what_one_bucket_would() {
    const HOSTS: usize = 8;
    within_one_bucket("rl-cb8e", HOSTS, 1000.0, 100.0, 4000.0, |end| {
        let mut plan = Plan::default();
        for h in 0..HOSTS {
            #[expect(clippy::cast_precision_loss, reason = "8 hosts")]
            let offset = 0.25 * h as f64 / HOSTS as f64;
            plan = plan.periodic(h, 125, 0.25, offset, end, |_| true);
        }
        plan
    });
}

/// Of its proportional share (demand x budget / total demand), what each small host of the 95/5
/// split admits at least.
const SMALL_FLOOR: f64 = 0.5;

/// Eight hosts, 4,000 pps in all, 95% to h0 (190 back to back every 50 ms) and the other seven
/// about 29 pps each (the smallest bursts: one datagram every 35 ms, phases spread; with 2
/// every 70 ms, hosts holding only their share of the burst admitted 25-44 of 57 and 6-26 in
/// other runs, too close to the floor to fail every time). Within 5% of one bucket, and every
/// small host admits some of its traffic: with shares in proportion to demand each would
/// get about its demand x budget / total demand (7 pps, 57 over the window); each must get at
/// least half of that ([`SMALL_FLOOR`]), whatever else a design gives them.
#[test]
fn eight_hosts_95_5_with_bursts_admit_what_one_bucket_would_and_small_hosts_get_some() {
    eight_hosts_95_5(Backend::Gossip, "rl-cb8s");
}

/// [`eight_hosts_95_5_with_bursts_admit_what_one_bucket_would_and_small_hosts_get_some`] on
/// `backend = "redis"` (a real standalone `redis-server`, no gossip).
#[test]
fn eight_hosts_95_5_with_bursts_through_redis_admit_what_one_bucket_would() {
    eight_hosts_95_5(Backend::Redis, "rl-cbr8s");
}

/// The same through a Redis Cluster of 3 masters: each key's script on the shard its hash tag
/// names.
#[test]
fn eight_hosts_95_5_with_bursts_through_a_redis_cluster_admit_what_one_bucket_would() {
    eight_hosts_95_5(Backend::RedisCluster, "rl-cbc8s");
}

/// The 95/5 scenario of eight hosts on `backend`.
fn eight_hosts_95_5(backend: Backend, tag: &str) {
    const HOSTS: usize = 8;
    // Longer than the others' warm-up: each small host starts full at the whole burst (100) and
    // sends only ~22 pps more than its share refills (7), so it spends that first burst over
    // ~4.5 s (docs/cluster.md's `hosts x burst`, once: 1,150 admitted a second for the first 4 s,
    // then 1,000).
    let warm = 6.0;
    let end = warm + MEASURE_SECS;
    let mut plan = Plan::default().periodic(0, 190, 0.05, 0.0, end, |_| true);
    for h in 1..HOSTS {
        #[expect(clippy::cast_precision_loss, reason = "8 hosts")]
        let offset = 0.035 * h as f64 / HOSTS as f64;
        plan = plan.periodic(h, 1, 0.035, offset, end, |_| true);
    }
    let (o, per_host) = {
        // Not `within_one_bucket`: the ratio and the small hosts are asserted together below, so
        // a ratio outside does not hide which small hosts were starved.
        let o = run_on(
            backend,
            tag,
            HOSTS,
            1000.0,
            100.0,
            plain_on(backend, 1000.0, 100.0),
            |_| {},
            plan,
            |_, _, _| {},
        );
        o.report("whole run", 0.0, end);
        let (_, _, per_host) = o.report("measured", warm, end);
        o.per_second(end);
        (o, per_host)
    };
    let sent = o.log.per_host(HOSTS, warm, end);
    let total: u64 = sent.iter().sum();
    #[expect(clippy::cast_precision_loss, reason = "small counts")]
    let fair: Vec<String> = sent
        .iter()
        .map(|&s| {
            format!(
                "{:.0}",
                s as f64 * 1000.0 * MEASURE_SECS / total.max(1) as f64
            )
        })
        .collect();
    println!(
        "proportional share of the window's budget per host: [{}]",
        fair.join(" ")
    );
    let cluster: u64 = per_host.iter().sum();
    let reference: u64 = o
        .log
        .count_per_host(&o.reference, HOSTS, warm, end)
        .iter()
        .sum();
    #[expect(clippy::cast_precision_loss, reason = "small counts")]
    let ratio = cluster as f64 / reference.max(1) as f64;
    #[expect(clippy::cast_precision_loss, reason = "small counts")]
    let floor = |h: usize| SMALL_FLOOR * sent[h] as f64 * 1000.0 * MEASURE_SECS / total as f64;
    #[expect(clippy::cast_precision_loss, reason = "small counts")]
    let starved: Vec<usize> = (1..HOSTS)
        .filter(|&h| per_host[h] == 0 || (per_host[h] as f64) < floor(h))
        .collect();
    let tolerance = o.tolerance(warm, end, reference);
    within_the_bound(&o, HOSTS, 100.0);
    assert!(
        (ratio - 1.0).abs() <= tolerance && starved.is_empty(),
        "over the datagrams sent {warm}-{end} s the cluster admitted {cluster}, one bucket \
         {reference}: {ratio:.3} x (want within {:.1}%: {:.0}% and the agents' overdue rounds); \
         small hosts that admitted less than half their proportional share (or nothing): \
         {starved:?} (per host {per_host:?}, proportional [{}])",
        tolerance * 100.0,
        ACCURACY * 100.0,
        fair.join(" ")
    );
}

/// Three hosts, 70/20/10 of 5 x the budget (3,500 / 1,000 / 500 pps) in bursts every 200 ms
/// (700, 200 and 100 back to back), phases a third of the period apart: one bucket refills 67
/// tokens between consecutive bursts, under its burst of 100, and admits the budget; each host
/// sees a burst only every 200 ms, twice the tolerance. The heavy host's share refills 140
/// packets over its own gap, more than one burst: its bucket holds `holders x share` bursts
/// (2.1), so it banks them (holding one burst at any share, the cluster admitted 0.81-0.82).
#[test]
fn three_hosts_70_20_10_with_bursts_admit_what_one_bucket_would() {
    within_one_bucket("rl-cb3", 3, 1000.0, 100.0, 5000.0, uneven);
}

/// The plan of [`three_hosts_70_20_10_with_bursts_admit_what_one_bucket_would`].
fn uneven(end: f64) -> Plan {
    const PERIOD: f64 = 0.2;
    Plan::default()
        .periodic(0, 700, PERIOD, 0.0, end, |_| true)
        .periodic(1, 200, PERIOD, PERIOD / 3.0, end, |_| true)
        .periodic(2, 100, PERIOD, 2.0 * PERIOD / 3.0, end, |_| true)
}

/// [`three_hosts_70_20_10_with_bursts_admit_what_one_bucket_would`] on `backend = "redis"`.
#[test]
fn three_hosts_70_20_10_with_bursts_through_redis_admit_what_one_bucket_would() {
    within_one_bucket_on(Backend::Redis, "rl-cbr3", 3, 1000.0, 100.0, 5000.0, uneven);
}

/// The same through a Redis Cluster of 3 masters.
#[test]
fn three_hosts_70_20_10_with_bursts_through_a_redis_cluster_admit_what_one_bucket_would() {
    within_one_bucket_on(
        Backend::RedisCluster,
        "rl-cbc3",
        3,
        1000.0,
        100.0,
        5000.0,
        uneven,
    );
}

/// Rate 10, burst 1, two hosts. One spoofed frame from the source reaches h1 (so h1 holds the
/// source's key, with one packet of demand); a few sync rounds later the source itself sends
/// 2 pps to h0 for 10 s, a fifth of the budget: nobody is limited under the budget, so every
/// datagram arrives (one bucket would admit them all). A share of a burst of 1 must not round
/// to nothing.
#[test]
fn burst_1_with_a_spoofed_second_holder_admits_everything_under_the_budget() {
    const HOSTS: usize = 2;
    const RATE: f64 = 10.0;
    /// Rounds for h1's key to reach h0 and both to settle on it.
    const HOLD_SECS: f64 = 1.0;
    let plan = Plan::default().periodic(0, 1, 0.5, 0.0, 10.0, |_| true);
    let o = run(
        "rl-cb1",
        HOSTS,
        RATE,
        1.0,
        plain(RATE, 1.0),
        |net| {
            net.spoof(FLOOD, 1).unwrap();
            thread::sleep(Duration::from_secs_f64(HOLD_SECS));
        },
        plan,
        |_, _, _| {},
    );
    let (cluster, reference, _) = o.report("whole run", 0.0, 11.0);
    let sent = o.log.sent.len() as u64;
    let missing: Vec<String> = o
        .log
        .sent
        .iter()
        .zip(&o.admitted)
        .filter(|(_, &a)| !a)
        .map(|(d, _)| format!("{:.1}", d.t))
        .collect();
    println!("sent {sent}, admitted {cluster}, one bucket {reference}; not admitted (send times, s): [{}]", missing.join(" "));
    assert_eq!(
        reference, sent,
        "the reference admits everything at this pace"
    );
    assert_eq!(
        cluster,
        sent,
        "{sent} datagrams at 2 pps under a budget of {RATE} pps: {cluster} arrived (the ones sent \
         at [{}] s did not)",
        missing.join(" ")
    );
}
