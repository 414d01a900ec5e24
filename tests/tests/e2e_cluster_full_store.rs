//! A new key of a cluster budget on hosts whose bucket stores are full, end to end: two real
//! agents share one `scope = "cluster"` budget (1,000 pps, burst 100, sync 100 ms) and each
//! tracks a million other sources (written into its store from user space, as the program
//! would for a million sources of another rule: a busy server, or a spoofed flood). A source
//! new to both then sends at three times the budget, evenly over the two hosts.
//!
//! Over any window T the cluster must admit at most docs/design.md's bound, `rate x T + (2 x
//! hosts - 1) x burst + (hosts - 1) x rate x lag` (lag 400 ms at this interval, plus 50 ms of
//! `rate` for the sampling, as `e2e_cluster.rs` allows), however many buckets the hosts track.
//!
//! New keys are found in the pages the program flags when it creates their buckets
//! (`RL_NEW_PAGES`), at the next round, however large the store; a walk of the whole store runs
//! a slice a round, so that it never holds up a round past the shares' lapse. Without the flags
//! the key was found only by the next walk of the store (paced to a tenth of a core: seconds
//! apart here), and both hosts admitted it at the whole rate until then: 3,780 over `rate x T`
//! in 4 s against a bound of 750.
//!
//! Run with `--nocapture` for the figures.

use std::time::{Duration, Instant};

use ratelimit_testbed::{
    cluster_net::{flood_rule, stalls, ClusterNet, Samples, Split},
    fill::fill_store,
    require_root,
};

const HOSTS: usize = 2;
const RATE: f64 = 1000.0;
const BURST: u64 = 100;
const SYNC_MS: u64 = 100;
/// Buckets of the other rule in each store: its whole capacity (the default `max_buckets`).
const OTHERS: u32 = 1 << 20;
const MAX_LAG_SECS: f64 = 0.4;
const SKEW_SECS: f64 = 0.05;
const SECS: f64 = 4.0;

/// The bed's cluster-scoped rule, and a plain one the other sources' buckets are of.
fn rules() -> String {
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "1000"
    )]
    let rate = RATE as u64;
    format!(
        "{}\n[[rule]]\nname = \"others\"\nsource = \"10.0.0.0/8\"\nrate = 1000\nburst = 1000\n",
        flood_rule(rate, BURST)
    )
}

#[test]
fn a_new_key_on_hosts_tracking_a_million_sources_stays_within_the_bound() {
    require_root();
    let net = ClusterNet::new("rl-cfs", HOSTS).unwrap();
    let agents = net
        .start_agents_with(
            |i| net.config_with(i, &rules(), SYNC_MS),
            Duration::from_secs(60),
        )
        .unwrap();
    for a in &agents {
        assert_eq!(fill_store(a.pin_path(), "others", OTHERS).unwrap(), OTHERS);
    }
    // Let each agent's cluster scan meet the full store.
    std::thread::sleep(Duration::from_secs(3));
    let receivers = net.receivers().unwrap();
    let start = Instant::now();
    let sender = net
        .flood(
            vec![Split {
                end: SECS,
                pps: 3.0 * RATE,
                weights: vec![1.0; HOSTS],
            }],
            start,
        )
        .unwrap();
    let mut samples = Samples::default();
    samples.take_until(&receivers, start, SECS, Duration::from_millis(50));
    let sent = sender.join().unwrap();
    let stalls = stalls(&sent, &receivers, start);
    let total = |s: &ratelimit_testbed::cluster_net::Sample| s.counts.iter().sum::<u64>();
    let (excess, worst) = samples.worst_excess(RATE);
    #[expect(clippy::cast_precision_loss, reason = "small counts")]
    let bound = (2 * HOSTS - 1) as f64 * BURST as f64
        + (HOSTS - 1) as f64 * RATE * MAX_LAG_SECS
        + RATE * SKEW_SECS;
    let first: Vec<(f64, u64)> = samples.0.iter().take(30).map(|s| (s.t, total(s))).collect();
    println!(
        "\nsent {:?}; admitted over time {first:?}\nlargest excess over rate x T: {excess:.0} \
         ({:.2}-{:.2} s), bound {bound:.0}; stalls {}",
        sent.per_host,
        worst.0,
        worst.1,
        stalls.len()
    );
    drop(receivers);
    for a in agents {
        a.stop().unwrap();
    }
    assert!(
        excess <= bound,
        "the cluster admitted {excess:.0} over rate x T ({:.2}-{:.2} s), over the bound {bound:.0}",
        worst.0,
        worst.1
    );
}
