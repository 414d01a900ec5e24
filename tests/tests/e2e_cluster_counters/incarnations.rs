//! A peer cut off, heard again and restarted: silent, then dead, then counted again, and a new
//! incarnation that charges nothing twice.

use std::thread;
use std::time::{Duration, Instant};

use crate::{config_on_pins, flood, metric, net, passed, peer_at, start_agents};
use ratelimit_testbed::agent_proc::KeptPins;
use ratelimit_testbed::cluster::{cli, cluster, counter, scrape, wait_for};
use ratelimit_testbed::cluster_net::{gossip_addr, ClusterNet};
use ratelimit_testbed::AgentProcess;
use serde_json::Value;

const SYNC_MS: u64 = 400;
/// The peer timeout: max(3 s, 10 x `SYNC_MS`).
const TIMEOUT: f64 = 4.0;

/// The peer entries of h1 at h0 (one per incarnation).
pub(crate) fn h1_at_h0(h0: &AgentProcess) -> Vec<Value> {
    peer_at(&cluster(h0), gossip_addr(1))
}

pub(crate) fn charged_by(h0: &AgentProcess, generation: u64) -> u64 {
    charged_in(&cluster(h0), generation)
}

/// What one reading of h0's status shows withheld for h1's incarnation `generation`.
fn charged_in(status: &Value, generation: u64) -> u64 {
    peer_at(status, gossip_addr(1))
        .iter()
        .find(|p| p["generation"].as_u64() == Some(generation))
        .and_then(|p| p["charged_pkts"].as_u64())
        .unwrap_or_else(|| panic!("no peer of generation {generation} at h0: {status}"))
}

fn generation(agent: &AgentProcess) -> u64 {
    cluster(agent)["generation"].as_u64().unwrap()
}

/// A peer cut off stops being counted within max(3 s, 10 x `sync_interval_ms`) (here 10 x 400
/// ms = 4 s; chitchat's failure detector declares it dead after 2 to 2.4 timeouts, and `peers`,
/// `status` and the metrics show it dead); while cut off it takes no share (nothing is withheld
/// for it, then or when it is heard again), and after it is heard again it takes one again.
/// Then its agent is killed and started again (it adopts the pinned buckets): the new
/// incarnation is a peer of its own, counted, the old one is shown dead, and what the new one
/// charges is at most what it admitted (its adopted buckets' past is not published again).
#[test]
fn a_cut_off_peer_stops_counting_rejoins_without_late_charges_and_restarts_as_a_new_incarnation() {
    let net = net("inc", 2);
    let mut agents = start_agents(&net, 2, SYNC_MS, 1000);
    assert_eq!(cluster(&agents[0])["peer_timeout_ms"], 4000);
    let g1 = generation(&agents[1]);

    let first = withheld_while_connected(&net, &agents[0], g1);
    cut_off_is_uncounted_then_dead(&net, &agents[0]);
    let during = nothing_withheld_while_cut_off(&net, &agents, g1, first);
    let after = withheld_after_the_rejoin(&net, &agents[0], g1, first);
    let (restarted, kept, g2) = restart_adopting_the_pins(&net, &mut agents, g1);
    the_new_incarnation_charges_its_own(
        &net,
        &agents[0],
        &restarted,
        [g1, g2],
        [first, after],
        during,
    );

    assert!(restarted.stop().unwrap().success());
    drop(kept);
    let h0 = agents.pop().unwrap();
    assert!(h0.stop().unwrap().success());
}

/// The source at both hosts for `secs` (300 pps each, all admitted: each host's share is half
/// the budget): h0 withholds half of its bucket's refill for h1's share while connected. Returns
/// the packets sent.
fn flood_both(net: &ClusterNet, secs: u64) -> u64 {
    thread::scope(|s| {
        let a = s.spawn(|| flood(net, 0, 300, Duration::from_secs(secs)));
        let b = s.spawn(|| flood(net, 1, 300, Duration::from_secs(secs)));
        a.join().unwrap() + b.join().unwrap()
    })
}

/// What h0 withheld for incarnation `g` once the count stopped moving. Once the traffic
/// stopped, h1's demand reads 0 after `DEMAND_HISTORY` of its syncs (its window reaches that far
/// back for a few packets), and nothing is withheld for it after. On a busy machine their rounds
/// and gossip run late, so this waits until the count has not moved for as long again: a cut
/// while h0 still reads a demand of h1 freezes that reading, and h0 withholds for it until it
/// goes stale (`STALE_ROUNDS`), after the count taken here.
fn settled(h0: &AgentProcess, g: u64, what: &str) -> u64 {
    let quiet =
        Duration::from_millis((ratelimit::cluster::remote::DEMAND_HISTORY as u64 + 3) * SYNC_MS);
    thread::sleep(quiet);
    let mut last = charged_by(h0, g);
    wait_for(what, Duration::from_secs(10), || {
        thread::sleep(quiet);
        let now = charged_by(h0, g);
        let still = now == last;
        last = now;
        still.then_some(now)
    })
}

fn withheld_while_connected(net: &ClusterNet, h0: &AgentProcess, g1: u64) -> u64 {
    flood_both(net, 1);
    wait_for("h0 withholding for h1", Duration::from_secs(10), || {
        (charged_by(h0, g1) > 0).then_some(())
    });
    settled(h0, g1, "the refill withheld for h1 settling before the cut")
}

/// Cut: not counted within the timeout (plus a sync round and a poll: when the status is
/// refreshed), shown dead in `peers` and the metrics.
fn cut_off_is_uncounted_then_dead(net: &ClusterNet, h0: &AgentProcess) {
    net.set_gossip(1, false).unwrap();
    let cut = Instant::now();
    let uncounted = wait_for("h1 no longer counted", Duration::from_secs(20), || {
        let p = h1_at_h0(h0);
        p.iter()
            .all(|p| p["counted"] == false)
            .then(|| cut.elapsed().as_secs_f64())
    });
    let dead = wait_for("h1 shown dead", Duration::from_secs(30), || {
        h1_at_h0(h0)
            .iter()
            .any(|p| p["state"] == "dead")
            .then(|| cut.elapsed().as_secs_f64())
    });
    println!("h1 cut off: uncounted after {uncounted:.2} s, dead after {dead:.2} s (timeout {TIMEOUT} s)");
    #[expect(clippy::cast_precision_loss, reason = "small numbers")]
    let bound = TIMEOUT + 2.0 * SYNC_MS as f64 / 1000.0 + 0.1;
    assert!(
        uncounted <= bound,
        "still counted {uncounted:.2} s after the cut (bound {bound:.2} s)"
    );
    let table = cli(h0, &["peers"]);
    assert!(table.contains("dead"), "peers table:\n{table}");
    let body = scrape(&net.hosts[0].ns);
    assert_eq!(
        metric(&body, r#"ratelimit_cluster_peers{state="dead"}"#),
        1,
        "{body}"
    );
    assert_eq!(
        metric(&body, r#"ratelimit_cluster_peers{state="alive"}"#),
        0,
        "{body}"
    );
}

/// While cut off h1 takes no share: nothing is withheld for it, then or when it is heard again.
/// Returns the packets sent while it was cut off.
fn nothing_withheld_while_cut_off(
    net: &ClusterNet,
    agents: &[AgentProcess],
    g1: u64,
    first: u64,
) -> u64 {
    let h0 = &agents[0];
    let during = flood_both(net, 1);
    net.set_gossip(1, true).unwrap();
    wait_for("h1 counted again", Duration::from_secs(30), || {
        h1_at_h0(h0)
            .iter()
            .any(|p| p["counted"] == true && p["state"] == "alive")
            .then_some(())
    });
    thread::sleep(Duration::from_millis(4 * SYNC_MS));
    if charged_by(h0, g1) != first {
        eprintln!("H0 LOG:\n{}\nH1 LOG:\n{}", h0.log(), agents[1].log());
    }
    assert_eq!(
        charged_by(h0, g1),
        first,
        "refill withheld for h1 while it was cut off ({during} packets sent meanwhile)"
    );
    assert_eq!(counter(&cluster(h0), "charged_pkts"), first);
    during
}

/// Heard again, h1 takes a share again; returns what was withheld for it since the rejoin.
fn withheld_after_the_rejoin(net: &ClusterNet, h0: &AgentProcess, g1: u64, first: u64) -> u64 {
    flood_both(net, 1);
    wait_for(
        "h0 withholding for h1 after the rejoin",
        Duration::from_secs(10),
        || (charged_by(h0, g1) > first).then_some(()),
    );
    settled(
        h0,
        g1,
        "the refill withheld for h1 settling after the rejoin",
    ) - first
}

/// Restart: SIGKILL, and a new agent adopting the pins; the new incarnation is counted and the
/// old one shown dead. Returns the new agent, the pins it adopted and its generation.
fn restart_adopting_the_pins(
    net: &ClusterNet,
    agents: &mut Vec<AgentProcess>,
    g1: u64,
) -> (AgentProcess, KeptPins, u64) {
    let status = agents[1].crash().unwrap();
    assert!(!status.success());
    let old = agents.pop().unwrap();
    let (_, kept) = old.stop_keeping_pins().unwrap();
    // The restarted agent needs its own pins to adopt: the same config names no pin_path, so
    // start it on the kept directory.
    let cfg = config_on_pins(net, 1, 2, SYNC_MS, 1000, kept.path());
    let restarted = AgentProcess::start(&net.hosts[1].ns, &cfg, &[]).unwrap();
    assert!(restarted.log().contains("adopted"), "{}", restarted.log());
    let g2 = generation(&restarted);
    assert_ne!(g2, g1, "a restarted agent keeps its incarnation");
    let entries = wait_for(
        "the new incarnation counted, the old one dead",
        Duration::from_secs(30),
        || {
            let e = h1_at_h0(&agents[0]);
            let new = e
                .iter()
                .any(|p| p["generation"].as_u64() == Some(g2) && p["counted"] == true);
            let gone = e
                .iter()
                .all(|p| p["generation"].as_u64() != Some(g1) || p["state"] == "dead");
            (new && gone).then_some(e)
        },
    );
    println!("h1 at h0 after the restart: {entries:#?}");
    (restarted, kept, g2)
}

/// The restarted agent's adopted counters go on; h0 withholds for the new incarnation, nothing
/// more for the old one, and its total is the sum of its parts per incarnation, compared once
/// nothing more is withheld, in one reading of h0's status.
fn the_new_incarnation_charges_its_own(
    net: &ClusterNet,
    h0: &AgentProcess,
    restarted: &AgentProcess,
    [g1, g2]: [u64; 2],
    [first, after]: [u64; 2],
    during: u64,
) {
    let (passed_before, _) = passed(restarted);
    let fourth = thread::scope(|s| {
        let a = s.spawn(|| flood(net, 0, 300, Duration::from_secs(2)));
        let b = s.spawn(|| flood(net, 1, 300, Duration::from_secs(2)));
        a.join().unwrap();
        b.join().unwrap()
    });
    let (passed_after, _) = passed(restarted);
    assert_eq!(
        passed_after - passed_before,
        fourth,
        "the adopted counters go on"
    );
    settled(
        h0,
        g2,
        "the refill withheld for the new incarnation settling",
    );
    let status = cluster(h0);
    let charged_new = charged_in(&status, g2);
    let total = counter(&status, "charged_pkts");
    println!(
        "withheld at h0 for h1: {first} connected, 0 while cut off ({during} sent), {after} after \
         the rejoin, {charged_new} for the new incarnation ({total} in all)"
    );
    assert!(charged_new > 0, "nothing withheld for the new incarnation");
    assert_eq!(
        charged_in(&status, g1),
        first + after,
        "withheld for the old incarnation after the restart"
    );
    // Each round's withheld refill goes to the one peer with demand (its part is all of it);
    // a round in which both incarnations had demand would split it with rounding.
    let parts = first + after + charged_new;
    assert!(
        total.abs_diff(parts) <= 2,
        "h0's total {total} against its parts per incarnation {parts}"
    );
}
