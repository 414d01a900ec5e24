//! A scenario's run (the network, the agents and their store, the bursty sender, the teardown)
//! and what its outcome is held to: one bucket's admissions over the measured window, the written
//! bound over the whole run.

use std::time::{Duration, Instant};

use crate::{
    Outcome, ACCURACY, MAX_LAG_SECS, MEASURE_SECS, ONE_AT_A_TIME, SKEW_SECS, SYNC_MS, WARM_SECS,
};
use ratelimit_testbed::cluster::stop_agents;
use ratelimit_testbed::{
    assert_none_left,
    bursty::{one_bucket, worst_excess, Plan},
    cluster_net::{save_agent_logs, ClusterNet, FLOOD, REDIS_ADDR},
    late_rounds::{reading_through, unix_ms, Overdue},
    require_root, AgentProcess, Receiver,
};

/// Builds the network, starts the agents with `config(net, i)`, runs `before` (after the
/// receivers are up), sends `plan` from [`FLOOD`], waits for the last datagrams, and tears
/// everything down; `during` runs on the test's thread while the plan is sent and gets the start.
#[expect(
    clippy::too_many_arguments,
    reason = "one scenario's settings and its three hooks"
)]
pub(crate) fn run(
    tag: &str,
    hosts: usize,
    rate: f64,
    burst: f64,
    config: impl Fn(&ClusterNet, usize) -> String,
    before: impl FnOnce(&ClusterNet),
    plan: Plan,
    during: impl FnOnce(&ClusterNet, &[AgentProcess], Instant),
) -> Outcome {
    run_on(
        Backend::Gossip,
        tag,
        hosts,
        rate,
        burst,
        config,
        before,
        plan,
        during,
    )
}

/// How the agents exchange their demand (`[cluster] backend`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Backend {
    Gossip,
    /// Through a `redis-server` the run starts ([`ClusterNet::start_redis`]) before the agents.
    Redis,
    /// Through a Redis Cluster of 3 masters and 3 replicas the run starts
    /// ([`ClusterNet::start_redis_cluster`]), every master a seed.
    RedisCluster,
}

/// What keeps the store running for a run: dropped after the agents.
#[expect(dead_code, reason = "held only to be dropped after the agents")]
pub(crate) enum Store {
    Redis(ratelimit_testbed::redis::RedisServer),
    Cluster(ratelimit_testbed::redis::RedisCluster),
}

/// The masters of the Redis Cluster of [`Backend::RedisCluster`].
pub(crate) const CLUSTER_MASTERS: u16 = 3;

/// [`run`] on `backend`.
#[expect(
    clippy::too_many_arguments,
    reason = "one scenario's settings and its three hooks"
)]
pub(crate) fn run_on(
    backend: Backend,
    tag: &str,
    hosts: usize,
    rate: f64,
    burst: f64,
    config: impl Fn(&ClusterNet, usize) -> String,
    before: impl FnOnce(&ClusterNet),
    plan: Plan,
    during: impl FnOnce(&ClusterNet, &[AgentProcess], Instant),
) -> Outcome {
    require_root();
    let _alone = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let net = ClusterNet::new(tag, hosts).unwrap();
    // Dropped after the agents (declared after it, below).
    let redis = match backend {
        Backend::Gossip => None,
        Backend::Redis => Some(Store::Redis(net.start_redis().unwrap())),
        Backend::RedisCluster => Some(Store::Cluster(
            net.start_redis_cluster(usize::from(CLUSTER_MASTERS))
                .unwrap(),
        )),
    };
    let agents = net
        .start_agents_with(|i| config(&net, i), Duration::from_secs(60))
        .unwrap();
    let receivers = net.receivers().unwrap();
    before(&net);
    let planned = plan.per_host(hosts);
    let plan_end = plan.end();
    let start = Instant::now();
    let start_unix_ms = unix_ms();
    let sender = net.bursts_from(FLOOD, plan, start).unwrap();
    // The agents' late rounds, read through the run (each keeps only its last 32).
    let ((), readings) = reading_through(
        &agents,
        start + Duration::from_secs_f64(plan_end),
        Duration::from_secs(2),
        || during(&net, &agents, start),
    );
    let overdue = Overdue::of(&readings, start_unix_ms);
    save_agent_logs(tag, &agents);
    print_views(&readings, hosts, start_unix_ms);
    // Each agent's view at the end: why a host admitted what it did.
    for (i, _, v) in readings.iter().rev().take(hosts).rev() {
        let c = &v["cluster"]["counters"];
        let shares: Vec<String> = v["cluster"]["keys"][0]["holders"]
            .as_array()
            .map(|hs| {
                hs.iter()
                    .map(|h| {
                        format!(
                            "{:.0}/{:.3}",
                            h["demand_pps"].as_f64().unwrap_or(0.0),
                            h["share"].as_f64().unwrap_or(0.0)
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        println!(
            "  h{i} at the end: rounds late {}, clamped {}, readings refused {}; demand/share of the holders: {}",
            c["rounds_late"], c["charges_clamped"], c["readings_refused"], shares.join(" ")
        );
    }
    let log = sender.join().unwrap();
    for r in &receivers {
        r.wait_idle(Duration::from_millis(200), Duration::from_secs(3));
    }
    let admitted = log.admitted(&receivers);
    let times: Vec<f64> = log.sent.iter().map(|d| d.t).collect();
    let reference = one_bucket(&times, rate, burst);
    let drops: Vec<u64> = receivers
        .iter()
        .map(|r| r.socket_drops().unwrap())
        .collect();
    // What each host's program saw of the source (passed + dropped): a datagram lost on the
    // way (a full queue) would be missing from the cluster's count for no fault of the limiter.
    let seen: Vec<u64> = agents
        .iter()
        .map(|a| {
            let s = a.stats();
            ["passed", "dropped_rate"]
                .iter()
                .map(|v| ratelimit_testbed::agent_proc::rule_packets(&s, "cluster-flood", v))
                .sum()
        })
        .collect();
    println!(
        "\n[{tag}] {hosts} hosts, rate {rate} burst {burst}, sync {SYNC_MS} ms, agent {}: \
         planned {planned:?}, sent {:?} ({} refused), seen by the hosts' programs {seen:?}; \
         longest burst {:.2} ms; bursts late by 30 ms or more: {}",
        ratelimit_testbed::agent_binary().display(),
        log.per_host(hosts, 0.0, f64::MAX),
        log.errors,
        log.longest_burst * 1000.0,
        log.late.len()
    );
    for (due, late) in log.late.iter().take(10) {
        println!(
            "  burst due at {due:.3} s sent {:.0} ms late",
            late * 1000.0
        );
    }
    assert_eq!(
        drops,
        vec![0; hosts],
        "receivers overran: their counts miss what the hosts admitted"
    );
    teardown(tag, net, agents, receivers, redis);
    Outcome {
        log,
        admitted,
        reference,
        hosts,
        overdue,
        rate,
    }
}

/// Prints each host's view of the heaviest key at each reading through the run: its own share,
/// the hosts it counted as holding the key, and the cluster's demand it read (pps). A share far
/// above the host's part of the demand, or fewer holders than hosts sending, says why a host
/// admitted more than its part (a peer not counted fails open at that host).
fn print_views(readings: &[(usize, u64, serde_json::Value)], hosts: usize, start_unix_ms: u64) {
    for h in 0..hosts {
        let views: Vec<String> = readings
            .iter()
            .filter(|(i, _, _)| *i == h)
            .map(|(_, at, v)| {
                let key = &v["cluster"]["keys"][0];
                #[expect(clippy::cast_precision_loss, reason = "ms since the start")]
                let t = at.saturating_sub(start_unix_ms) as f64 / 1000.0;
                format!(
                    "{t:.1}: {:.3}/{}/{:.0}",
                    key["holders"][0]["share"].as_f64().unwrap_or(0.0),
                    key["hosts"].as_u64().unwrap_or(0),
                    key["demand_pps"].as_f64().unwrap_or(0.0)
                )
            })
            .collect();
        println!(
            "  h{h} through the run (s: own share/holders counted/cluster demand pps): {}",
            views.join(" ")
        );
    }
}

pub(crate) fn teardown(
    tag: &str,
    net: ClusterNet,
    agents: Vec<AgentProcess>,
    receivers: Vec<Receiver>,
    redis: Option<Store>,
) {
    drop(receivers);
    stop_agents(agents);
    drop(redis);
    drop(net);
    assert_none_left(&format!("{tag}-"));
}

/// The plain cluster config of every host: one rule `cluster-flood` over 198.18.0.0/24.
pub(crate) fn plain(rate: f64, burst: f64) -> impl Fn(&ClusterNet, usize) -> String {
    plain_on(Backend::Gossip, rate, burst)
}

/// [`plain`] on `backend`.
pub(crate) fn plain_on(
    backend: Backend,
    rate: f64,
    burst: f64,
) -> impl Fn(&ClusterNet, usize) -> String {
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "small settings"
    )]
    move |net: &ClusterNet, i| match backend {
        Backend::Gossip => net.config(i, rate as u64, burst as u64, SYNC_MS),
        Backend::Redis => net.redis_config(
            i,
            rate as u64,
            burst as u64,
            SYNC_MS,
            &format!("redis://{REDIS_ADDR}"),
        ),
        Backend::RedisCluster => net.redis_cluster_config(
            i,
            rate as u64,
            burst as u64,
            SYNC_MS,
            &ClusterNet::redis_cluster_masters(CLUSTER_MASTERS),
        ),
    }
}

/// How long a scenario runs before its measured window: until what the design lets the cluster
/// hold beyond one bucket is spent. Every host's bucket starts full at the whole burst
/// (docs/cluster.md, Accuracy: the holders hold `hosts` bursts with an even split), so the
/// cluster holds `hosts x burst` where one bucket holds one, and spends it at the excess of what
/// is sent over the rate; then the convergence allowance (5 sync intervals). At least
/// [`WARM_SECS`]. (2 hosts, burst 500, 1,200 pps sent: 5.5 s; measured from 3 s, the row read
/// 1.015-1.064 as the second burst drained, in 0.8-2 s.)
pub(crate) fn warm_up(hosts: usize, rate: f64, burst: f64, sent_pps: f64) -> f64 {
    #[expect(clippy::cast_precision_loss, reason = "a few hosts")]
    let held = hosts as f64 * burst;
    let spend = held / (sent_pps - rate).max(1.0);
    (spend + 5.0 * SYNC_MS as f64 / 1000.0).max(WARM_SECS)
}

/// Asserts that the datagrams `o` admitted, over every interval of the run, stay within
/// docs/cluster.md's bound for `hosts` hosts: `rate x T + (2 x hosts - 1) x burst + (hosts - 1)
/// x rate x lag`, plus the rate over the skew ([`SKEW_SECS`]) and over each lapse an agent
/// reported.
pub(crate) fn within_the_bound(o: &Outcome, hosts: usize, burst: f64) {
    let times: Vec<f64> = o
        .log
        .sent
        .iter()
        .zip(&o.admitted)
        .filter(|(_, &a)| a)
        .map(|(d, _)| d.t)
        .collect();
    let (excess, from, to) = worst_excess(&times, o.rate);
    #[expect(clippy::cast_precision_loss, reason = "a few hosts")]
    let h = hosts as f64;
    let lapses = o.overdue.lapsed_refill(o.rate, 0.0, f64::MAX);
    let bound =
        (2.0 * h - 1.0) * burst + (h - 1.0) * o.rate * MAX_LAG_SECS + o.rate * SKEW_SECS + lapses;
    println!(
        "largest excess over rate x T: {excess:.0} (datagrams sent {from:.2}-{to:.2} s), bound \
         {bound:.0}"
    );
    assert!(
        excess <= bound,
        "the cluster admitted {excess:.0} over rate x T between {from:.2} and {to:.2} s, over \
         the written bound {bound:.0}"
    );
}

/// Runs `plan` (`sent_pps` in all) for its [`warm_up`] + [`MEASURE_SECS`] against `hosts`
/// agents and asserts the cluster admitted within [`ACCURACY`] of one bucket over the measured
/// window, and within the written bound over the whole run. Returns the outcome and per host
/// admitted in the window.
pub(crate) fn within_one_bucket(
    tag: &str,
    hosts: usize,
    rate: f64,
    burst: f64,
    sent_pps: f64,
    plan: impl FnOnce(f64) -> Plan,
) -> (Outcome, Vec<u64>) {
    within_one_bucket_on(Backend::Gossip, tag, hosts, rate, burst, sent_pps, plan)
}

/// [`within_one_bucket`] on `backend`.
pub(crate) fn within_one_bucket_on(
    backend: Backend,
    tag: &str,
    hosts: usize,
    rate: f64,
    burst: f64,
    sent_pps: f64,
    plan: impl FnOnce(f64) -> Plan,
) -> (Outcome, Vec<u64>) {
    let warm = warm_up(hosts, rate, burst, sent_pps);
    let end = warm + MEASURE_SECS;
    let plan = plan(end);
    let o = run_on(
        backend,
        tag,
        hosts,
        rate,
        burst,
        plain_on(backend, rate, burst),
        |_| {},
        plan,
        |_, _, _| {},
    );
    o.report("whole run", 0.0, end);
    let (cluster, reference, per_host) = o.report("measured", warm, end);
    o.per_second(end);
    #[expect(clippy::cast_precision_loss, reason = "small counts")]
    let ratio = cluster as f64 / reference.max(1) as f64;
    let tolerance = o.tolerance(warm, end, reference);
    within_the_bound(&o, hosts, burst);
    assert!(
        (ratio - 1.0).abs() <= tolerance,
        "over the datagrams sent {warm:.1}-{end:.1} s the cluster admitted {cluster}, one bucket \
         {reference}: {ratio:.3} x, want within {:.1}% ({:.0}% and the agents' overdue rounds)",
        tolerance * 100.0,
        ACCURACY * 100.0
    );
    (o, per_host)
}
