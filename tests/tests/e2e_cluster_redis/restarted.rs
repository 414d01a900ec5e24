//! Redis killed, started again empty, and restarted empty mid-run, under three agents sharing
//! one budget through it:
//! 1. Redis up: the cluster admits one budget (docs/cluster.md's accuracy of one budget, 0.95-1.05
//!    x over a 5 s window, as `e2e_cluster`). Without the exchange each host would admit its own
//!    rate: 2,500 pps here.
//! 2. Redis killed: every agent shows the store `down` with the error, and fails open: each host
//!    admits up to the whole rate (2,500 pps in all, at least 2 budgets asserted).
//! 3. Redis started again (empty): every agent reconnects by itself (within its backoff, 5 s at
//!    most) and the budget holds again (0.95-1.05 x).
//! 4. Redis restarted empty mid-run (killed and started at once): what the cluster admits over
//!    the 10 s around it stays within docs/cluster.md's bound, `rate x T + (2 x hosts - 1) x
//!    burst + (hosts - 1) x rate x lag` (lag 4 sync intervals), and the budget holds again
//!    from 4 s after.

use std::time::Instant;

use ratelimit_testbed::{
    cluster_net::{cluster_counter, status, Samples, Sent},
    require_root, AgentProcess,
};
use serde_json::Value;

use crate::{
    all_connected, flood, serial, store, within, Bed, ACCURACY, BURST, FLOOD_PPS, HOSTS, LAG_SECS,
    RATE, SAMPLE, SKEW_SECS, SPLIT, SYNC_MS,
};

/// The phases (seconds after the flood starts).
const STOP_AT: f64 = 9.0;
const START_AT: f64 = 15.0;
/// By when every agent must have reconnected: the restart, the longest reconnection backoff
/// (5 s) and a round.
const RECONNECTED_BY: f64 = START_AT + 5.5;
const RESTART_AT: f64 = 27.0;
const END: f64 = 35.0;

#[test]
fn hosts_share_one_budget_through_redis_fail_open_without_it_and_recover_when_it_restarts_empty() {
    require_root();
    let _serial = serial();
    let mut bed = Bed::start("rl-credis", "", |agents| {
        for (i, a) in agents.iter().enumerate() {
            let st = status(a).unwrap();
            assert_eq!(st["cluster"]["backend"], "redis", "h{i}: {}", st["cluster"]);
            assert_eq!(store(&st)["state"], "connected", "h{i}: {}", st["cluster"]);
            assert_eq!(store(&st)["mode"], "standalone", "h{i}: {}", st["cluster"]);
        }
    });
    let seen = flood_while_the_store_goes_and_comes_back(&mut bed);
    let fig = figures(&bed, &seen);
    assert_one_budget_through_redis(&fig, &seen);
    assert_failed_open_visibly(&fig, &seen);
    assert_reconnected_and_one_budget_again(&fig);
    assert_connected_and_logged_once_per_change(&bed.agents, &seen.after);

    bed.teardown("rl-credis");
}

/// What [`flood_while_the_store_goes_and_comes_back`] saw.
struct Seen {
    samples: Samples,
    sent: Sent,
    /// The keys in the store just before it was killed.
    keys_in_store: String,
    /// Each agent's status 3 s after the kill (empty if none was taken).
    down_views: Vec<Value>,
    /// When every agent was connected again and counted the others, after the store came back.
    reconnected: Option<f64>,
    /// Each agent's status at the end.
    after: Vec<Value>,
}

/// The flood for [`END`] s, sampled every [`SAMPLE`]: the store killed at [`STOP_AT`] (its keys
/// read first), every agent's status read 3 s later, the store started again (empty) at
/// [`START_AT`], watched until every agent is back, then restarted empty at [`RESTART_AT`].
/// Asserts nothing: the figures come first.
fn flood_while_the_store_goes_and_comes_back(bed: &mut Bed) -> Seen {
    let Bed {
        receivers,
        agents,
        redis,
        net,
        ..
    } = bed;
    let start = Instant::now();
    let sender = flood(net, END, start);
    let mut samples = Samples::default();
    let mut down_views: Vec<Value> = Vec::new();
    let mut reconnected: Option<f64> = None;
    let (mut stopped, mut started, mut restarted) = (false, false, false);
    let mut keys_in_store = String::new();
    loop {
        samples.take(receivers, start);
        let t = start.elapsed().as_secs_f64();
        if t >= END {
            break;
        }
        if !stopped && t >= STOP_AT {
            keys_in_store = redis
                .cli(&["--scan", "--pattern", "{rl:*"])
                .unwrap_or_default();
            redis.stop();
            stopped = true;
        }
        if stopped && !started && down_views.is_empty() && t >= STOP_AT + 3.0 {
            down_views = agents.iter().map(|a| status(a).unwrap()).collect();
        }
        if !started && t >= START_AT {
            redis.restart().unwrap();
            started = true;
        }
        if started && reconnected.is_none() && !restarted && all_connected(agents) {
            reconnected = Some(start.elapsed().as_secs_f64());
        }
        if !restarted && t >= RESTART_AT {
            redis.restart().unwrap();
            restarted = true;
        }
        std::thread::sleep(SAMPLE);
    }
    let sent = sender.join().unwrap();
    let after: Vec<Value> = agents.iter().map(|a| status(a).unwrap()).collect();
    Seen {
        samples,
        sent,
        keys_in_store,
        down_views,
        reconnected,
        after,
    }
}

/// The figures the assertions check, in budgets where a rate.
struct Figures {
    up: f64,
    down: f64,
    /// When every agent was back (NaN if never).
    rec: f64,
    back: f64,
    /// The window around the empty restart, and what the cluster admitted over it.
    w1: f64,
    w2: f64,
    around: f64,
    /// docs/cluster.md's bound over that window.
    bound: f64,
    again: f64,
}

/// Prints the figures of each phase, each host's store while down and at the end, and returns
/// those the assertions check: all printed before any assertion, so a failing run shows them.
fn figures(bed: &Bed, seen: &Seen) -> Figures {
    let Seen {
        samples,
        sent,
        keys_in_store,
        down_views,
        reconnected,
        after,
    } = seen;
    let url = &bed.url;
    let phase = |name: &str, t1: f64, t2: f64| {
        let r = samples.rate(t1, t2);
        println!(
            "{name} ({t1:.1}-{t2:.1} s): {r:.0} pps = {:.3} budgets; per host [{}]",
            r / RATE,
            (0..HOSTS)
                .map(|h| format!("{:.0}", samples.host_rate(h, t1, t2)))
                .collect::<Vec<_>>()
                .join(" ")
        );
        r / RATE
    };
    println!(
        "\n{HOSTS} hosts through Redis at {url}; rate {RATE}, burst {BURST}, sync {SYNC_MS} ms; \
         flood {FLOOD_PPS} pps split {SPLIT:?} (sent {:?})",
        sent.per_host
    );
    println!(
        "keys in the store before it stopped: {}",
        keys_in_store
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
    );
    let up = phase("Redis up", 4.0, STOP_AT);
    let down = phase("Redis down", STOP_AT + 2.0, START_AT);
    let rec = reconnected.unwrap_or(f64::NAN);
    println!(
        "every agent reconnected {:.1} s after Redis came back",
        rec - START_AT
    );
    let back = phase("Redis back (empty)", rec + 1.5, RESTART_AT);
    let (w1, w2) = (RESTART_AT - 2.0, END);
    let around: f64 = (0..HOSTS).map(|h| samples.packets(h, w1, w2)).sum();
    #[expect(clippy::cast_precision_loss, reason = "small counts")]
    let bound = RATE * (w2 - w1 + 2.0 * SKEW_SECS)
        + (2.0 * HOSTS as f64 - 1.0) * BURST as f64
        + (HOSTS as f64 - 1.0) * RATE * LAG_SECS;
    println!(
        "Redis restarted empty at {RESTART_AT} s: {around:.0} packets over {w1}-{w2} s, \
         {:.0} over rate x T (the bound allows {:.0} over it)",
        around - RATE * (w2 - w1),
        bound - RATE * (w2 - w1)
    );
    let again = phase("after the empty restart", RESTART_AT + 4.0, END);
    for (i, st) in down_views.iter().enumerate() {
        println!("h{i} while Redis was down: store {}", store(st));
    }
    for (i, st) in after.iter().enumerate() {
        println!(
            "h{i} at the end: store {}, readings refused {}, rounds late {}",
            store(st),
            cluster_counter(st, "readings_refused"),
            cluster_counter(st, "rounds_late")
        );
    }
    Figures {
        up,
        down,
        rec,
        back,
        w1,
        w2,
        around,
        bound,
        again,
    }
}

/// With Redis up the cluster admits one budget ([`ACCURACY`]), where each host alone would
/// admit its own rate (2.5 budgets here): the agents share it through the store, which holds
/// the flood's key.
fn assert_one_budget_through_redis(fig: &Figures, seen: &Seen) {
    let (up, keys_in_store) = (fig.up, &seen.keys_in_store);
    assert!(
        within(up, ACCURACY),
        "with Redis up the cluster admitted {up:.3} budgets, want {ACCURACY:?}: the agents do not \
         share the budget through Redis"
    );
    assert!(
        keys_in_store.contains("{rl:e2e-cluster-net:cluster-flood:0:198.18.0.250}"),
        "the flood's key is not in the store: {keys_in_store:?}"
    );
}

/// With Redis killed the hosts fail open, visibly: the cluster admits at least 2 budgets, h0
/// and h1 (sent 3,500 and 1,000 pps) each its whole rate, and every agent's status shows the
/// store `down`, with an error counted and named.
fn assert_failed_open_visibly(fig: &Figures, seen: &Seen) {
    let (down, samples, down_views) = (fig.down, &seen.samples, &seen.down_views);
    assert!(
        down >= 2.0,
        "with Redis down the cluster admitted {down:.3} budgets: the hosts did not fail open \
         (each to the whole rate, 2.5 budgets here)"
    );
    for h in 0..2 {
        let r = samples.host_rate(h, STOP_AT + 2.0, START_AT);
        assert!(
            r >= 0.9 * RATE,
            "h{h} admitted {r:.0} pps with Redis down, want its whole rate ({RATE})"
        );
    }
    assert_eq!(
        down_views.len(),
        HOSTS,
        "no status taken while Redis was down"
    );
    for (i, st) in down_views.iter().enumerate() {
        let s = store(st);
        assert_eq!(s["state"], "down", "h{i}: {s}");
        assert!(
            s["last_error"].as_str().is_some_and(|e| !e.is_empty())
                && s["errors"].as_u64() > Some(0),
            "h{i} shows no error: {s}"
        );
    }
}

/// Redis started again, empty: every agent reconnects by itself by [`RECONNECTED_BY`] (the
/// longest backoff and a round) and the budget holds again. Redis restarted empty mid-run: the
/// cluster admits no more than docs/cluster.md's bound over the 10 s around it, and one budget
/// again from 4 s after.
fn assert_reconnected_and_one_budget_again(fig: &Figures) {
    let Figures {
        rec,
        back,
        w1,
        w2,
        around,
        bound,
        again,
        ..
    } = *fig;
    assert!(
        rec <= RECONNECTED_BY,
        "the agents reconnected only {:.1} s after Redis came back (want within {:.1} s)",
        rec - START_AT,
        RECONNECTED_BY - START_AT
    );
    assert!(
        within(back, ACCURACY),
        "once Redis was back the cluster admitted {back:.3} budgets, want {ACCURACY:?}"
    );
    assert!(
        around <= bound,
        "Redis restarting empty: {around:.0} packets over {w1}-{w2} s, above docs/cluster.md's \
         bound {bound:.0}"
    );
    assert!(
        within(again, ACCURACY),
        "after Redis restarted empty the cluster admitted {again:.3} budgets, want {ACCURACY:?}"
    );
}

/// At the end every agent is connected, after more than 100 round trips, and has logged the
/// store lost and reached once per change of its state, not once per failed round.
fn assert_connected_and_logged_once_per_change(agents: &[AgentProcess], after: &[Value]) {
    for (i, st) in after.iter().enumerate() {
        let s = store(st);
        assert_eq!(s["state"], "connected", "h{i}: {s}");
        assert!(s["round_trips"].as_u64() > Some(100), "h{i}: {s}");
    }
    // One log line per change of the store's state, not one per failed round: Redis went away
    // twice (killed, and restarted empty), and each agent failed dozens of rounds.
    for (i, a) in agents.iter().enumerate() {
        let log = a.log();
        let (lost, reached) = (
            log.matches("cluster store unreachable").count(),
            log.matches("cluster store reached").count(),
        );
        println!("h{i} logged the store lost {lost} times, reached {reached} times");
        assert!(
            (1..=3).contains(&lost) && (2..=4).contains(&reached),
            "h{i} logged the store lost {lost} and reached {reached} times:\n{log}"
        );
    }
}
