//! `[cluster] backend = "redis"` through a Redis Cluster of 3 masters and 3 replicas
//! ([`ClusterNet::start_redis_cluster`], node timeout 1 s), one shard failing over: three real
//! agents share one `scope = "cluster"` budget (one source at 5x, split 70/20/10), then the
//! master serving the flood's key is killed (SIGKILL). Until its replica is promoted the agents'
//! rounds fail; they fail open (no 1 s window of the run below [`FLOOR`] budgets but those a
//! stall of the test's own threads explains), pick up the new topology by themselves (each
//! connects again and reads the slot map afresh), and share one budget again, within
//! docs/cluster.md's bound from then on.

use std::time::Instant;

use ratelimit_testbed::{
    cluster_net::{stalls, status, ClusterNet, LowestWindow, Samples},
    redis::RedisCluster,
    require_root,
};
use serde_json::Value;

use crate::{
    all_connected, flood, serial, store, within, Bed, ACCURACY, BURST, HOSTS, LAG_SECS, RATE,
    SAMPLE, SKEW_SECS, SYNC_MS,
};

const TAG: &str = "rl-credisf";
/// The least a 1 s window of the cluster may admit, in budgets, while the store fails and comes
/// back (fail open: never below the budget). Not 1: 1 s windows of runs at load 6-12 read
/// 0.909-0.996 with no stall of the test's threads seen; a share stuck low (traffic cut) reads
/// far lower.
const FLOOR: f64 = 0.85;
const KILL_AT: f64 = 8.0;
const RUN: f64 = 26.0;
/// By when, after the replica's promotion, every agent must be back: the longest backoff (5 s),
/// an attempt and a round or two.
const BACK_WITHIN: f64 = 6.0;
/// By when, after the kill, the replica must be promoted: the node timeout (1 s) and an
/// election, with room for a loaded machine.
const PROMOTED_WITHIN: f64 = 5.0;
/// The flood's key in the store (`cluster::redis::key_name`).
const FLOOD_KEY: &str = "{rl:e2e-cluster-net:cluster-flood:0:198.18.0.250}";

/// The master serving the flood's key killed: fail open meanwhile, the new topology picked up by
/// every agent by itself, one budget again.
#[test]
fn a_shard_failing_over_keeps_one_budget_and_the_agents_follow_the_new_master() {
    require_root();
    let _serial = serial();
    let mut bed = start();
    let seen = flood_and_kill_the_keys_master(&mut bed);
    let fig = figures(&bed, &seen);
    assert_one_budget_before_the_kill(&fig, &seen);
    assert_failed_open_until_the_agents_came_back(&fig);
    assert_one_budget_again_within_the_bound(&fig, &seen);

    bed.teardown(TAG);
}

/// The network, a Redis Cluster of 3 masters and their replicas, an agent on each host sharing
/// the budget through it (each started until it counts the others, and asserted to see the
/// cluster's 3 shards), then the receivers.
fn start() -> Bed<RedisCluster> {
    let net = ClusterNet::new(TAG, HOSTS).unwrap();
    let redis = net.start_redis_cluster(3).unwrap();
    let urls = redis.urls();
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "small"
    )]
    let agents = net
        .start_agents_with(
            |i| net.redis_cluster_config(i, RATE as u64, BURST, SYNC_MS, &urls),
            std::time::Duration::from_secs(30),
        )
        .unwrap();
    for (i, a) in agents.iter().enumerate() {
        let st = status(a).unwrap();
        assert_eq!(
            mode_shards_state(&st),
            (Some("cluster"), Some(3), Some("connected")),
            "h{i}: {}",
            store(&st)
        );
    }
    let receivers = net.receivers().unwrap();
    Bed {
        receivers,
        agents,
        redis,
        net,
        url: urls.join(", "),
    }
}

/// A status's store: its mode, shards and state.
fn mode_shards_state(st: &Value) -> (Option<&str>, Option<u64>, Option<&str>) {
    let s = store(st);
    (
        s["mode"].as_str(),
        s["shards"].as_u64(),
        s["state"].as_str(),
    )
}

/// What [`flood_and_kill_the_keys_master`] saw.
struct Seen {
    samples: Samples,
    /// The windows of the test's own stalls (its sender's and receivers').
    low: LowestWindow,
    /// The killed master's and its replica's nodes.
    master: usize,
    replica: usize,
    /// Whether the killed master held the flood's key (`EXISTS`: "1").
    held: String,
    killed_at: f64,
    /// When the replica was seen a master (none if never).
    promoted: Option<f64>,
    /// When, after that, every agent was connected and counted the others (none if never).
    back: Option<f64>,
    /// Each agent's status at the end.
    after: Vec<Value>,
}

/// The flood for [`RUN`] s, sampled every [`SAMPLE`]: the master of the flood's key killed at
/// [`KILL_AT`], then watched until its replica is a master and every agent is back. Asserts
/// nothing: the figures come first.
fn flood_and_kill_the_keys_master(bed: &mut Bed<RedisCluster>) -> Seen {
    let Bed {
        receivers,
        agents,
        redis: cluster,
        net,
        ..
    } = bed;
    let (master, replica) = cluster.shard_of(FLOOD_KEY).unwrap();
    let start = Instant::now();
    let sender = flood(net, RUN, start);
    let mut samples = Samples::default();
    samples.take_until(receivers, start, KILL_AT, SAMPLE);
    let held = cluster.nodes[master].cli(&["EXISTS", FLOOD_KEY]).unwrap();
    cluster.nodes[master].stop();
    let killed_at = start.elapsed().as_secs_f64();
    let (mut promoted, mut back): (Option<f64>, Option<f64>) = (None, None);
    loop {
        samples.take(receivers, start);
        let t = start.elapsed().as_secs_f64();
        if t >= RUN {
            break;
        }
        if promoted.is_none() && cluster.is_master(replica) {
            promoted = Some(t);
        }
        if promoted.is_some() && back.is_none() && all_connected(agents) {
            back = Some(t);
        }
        std::thread::sleep(SAMPLE);
    }
    let sent = sender.join().unwrap();
    // The lowest 1 s window, but for those a stall of the test's own threads explains.
    let low = samples.lowest_window(
        2.0,
        RUN,
        1.0,
        FLOOR * RATE,
        &stalls(&sent, receivers, start),
    );
    Seen {
        samples,
        low,
        master,
        replica,
        held: held.trim().to_string(),
        killed_at,
        promoted,
        back,
        after: agents.iter().map(|a| status(a).unwrap()).collect(),
    }
}

/// What the assertions check, in budgets but where named.
struct Figures {
    /// Before the kill.
    up: f64,
    /// When the master was killed, the replica promoted and every agent back (NaN if never).
    killed_at: f64,
    promoted: f64,
    back: f64,
    /// From 1 s after the kill until the agents were back.
    between: f64,
    /// From 1.5 s after they were back to the end.
    again: f64,
    /// The lowest 1 s window no stall explains, pps, and its start.
    lowest: (f64, f64),
    /// Packets over `rate x T` from the agents' return to the end, and docs/cluster.md's bound.
    excess: f64,
    bound: f64,
}

/// Prints the figures of each phase and each host's store at the end, and returns those the
/// assertions check: all printed before any assertion, so a failing run shows them.
fn figures(bed: &Bed<RedisCluster>, seen: &Seen) -> Figures {
    let Seen {
        samples,
        low,
        killed_at,
        ..
    } = seen;
    let killed_at = *killed_at;
    let promoted = seen.promoted.unwrap_or(f64::NAN);
    let back = seen.back.unwrap_or(f64::NAN);
    let lowest = low.lowest.unwrap_or((f64::NAN, f64::NAN));
    for (u, r) in &low.excused {
        println!(
            "excused: the 1 s from {u:.1} s, {:.3} budgets, measured across a stall of the test",
            r / RATE
        );
    }
    #[expect(clippy::cast_precision_loss, reason = "small")]
    let fig = Figures {
        up: samples.rate(3.0, KILL_AT) / RATE,
        killed_at,
        promoted,
        back,
        between: samples.rate(killed_at + 1.0, back.max(killed_at + 1.5)) / RATE,
        again: samples.rate(back + 1.5, RUN) / RATE,
        lowest,
        excess: (0..HOSTS)
            .map(|h| samples.packets(h, back, RUN))
            .sum::<f64>()
            - RATE * (RUN - back),
        bound: RATE * 2.0 * SKEW_SECS
            + (2.0 * HOSTS as f64 - 1.0) * BURST as f64
            + (HOSTS as f64 - 1.0) * RATE * LAG_SECS,
    };
    let urls = bed.redis.urls();
    println!(
        "\n{HOSTS} hosts through a Redis Cluster of 3 masters + 3 replicas; the master of the \
         flood's key ({}, holding it: {}) killed at {killed_at:.1} s: up {:.3} budgets; its \
         replica ({}) promoted {:.1} s after; every agent back {:.1} s after the promotion; \
         {:.3} budgets from 1 s after the kill until then; then {:.3}; lowest 1 s window {:.3} \
         (from {:.1} s); from the reconnection {:.0} packets over rate x T (the bound allows \
         {:.0})",
        urls[seen.master],
        seen.held,
        fig.up,
        urls[seen.replica],
        promoted - killed_at,
        back - promoted,
        fig.between,
        fig.again,
        lowest.0 / RATE,
        lowest.1,
        fig.excess,
        fig.bound
    );
    for (i, st) in seen.after.iter().enumerate() {
        println!("h{i} at the end: store {}", store(st));
    }
    fig
}

/// Before the kill the cluster admits one budget ([`ACCURACY`]), and the master killed is the
/// one that held the flood's key.
fn assert_one_budget_before_the_kill(fig: &Figures, seen: &Seen) {
    assert!(
        within(fig.up, ACCURACY),
        "before the failover: {:.3} budgets, want {ACCURACY:?}",
        fig.up
    );
    assert_eq!(
        seen.held, "1",
        "the killed master did not hold the flood's key"
    );
}

/// The replica was promoted within [`PROMOTED_WITHIN`] of the kill, the hosts failed open
/// meanwhile (each to its whole rate, 2.5 budgets here; no 1 s window below [`FLOOR`] budgets),
/// and every agent was back within [`BACK_WITHIN`] of the promotion.
fn assert_failed_open_until_the_agents_came_back(fig: &Figures) {
    assert!(
        fig.promoted - fig.killed_at <= PROMOTED_WITHIN,
        "the replica was promoted {:.1} s after the kill, want within {PROMOTED_WITHIN} s",
        fig.promoted - fig.killed_at
    );
    assert!(
        fig.between >= 1.5,
        "between the kill and the agents' return the cluster admitted {:.3} budgets: the \
         hosts did not fail open (each to its whole rate, 2.5 budgets here)",
        fig.between
    );
    assert!(
        fig.lowest.0 >= FLOOR * RATE,
        "the cluster admitted {:.3} budgets over the 1 s from {:.1} s: the failover cut \
         traffic below the budget",
        fig.lowest.0 / RATE,
        fig.lowest.1
    );
    assert!(
        fig.back - fig.promoted <= BACK_WITHIN,
        "the agents were back {:.1} s after the promotion, want within {BACK_WITHIN} s",
        fig.back - fig.promoted
    );
}

/// From the agents' return the cluster admits one budget again ([`ACCURACY`]) and no more over
/// `rate x T` than docs/cluster.md's bound; every agent ends connected to the 3 shards, having
/// seen its rounds fail (fail open meanwhile).
fn assert_one_budget_again_within_the_bound(fig: &Figures, seen: &Seen) {
    assert!(
        within(fig.again, ACCURACY),
        "after the failover: {:.3} budgets, want {ACCURACY:?}",
        fig.again
    );
    assert!(
        fig.excess <= fig.bound,
        "from the reconnection: {:.0} packets over rate x T, above the bound's {:.0}",
        fig.excess,
        fig.bound
    );
    for (i, st) in seen.after.iter().enumerate() {
        assert_eq!(
            mode_shards_state(st),
            (Some("cluster"), Some(3), Some("connected")),
            "h{i} at the end: {}",
            store(st)
        );
        assert!(
            store(st)["errors"].as_u64() > Some(0),
            "h{i} saw no failed round: {}",
            store(st)
        );
    }
}
