//! The `internal` counter, end to end: an internal error passes the packet and is counted.
//!
//! The XDP program's reachable internal error is a state the agent never writes: a prefix of the
//! rule set in force whose candidates name a rule id without a record (past the rule map). (Its
//! other internal errors, failed lookups of one-entry arrays, cannot happen once it is loaded.)
//! The test plants one in the pinned prefix trie of a running agent (as memory corruption or
//! another writer of the pins would): a /32 under the rule's /24 naming rule id 16,384. Every
//! real packet from that address then passes, counted as `internal` exactly and not as the
//! rule's; other sources stay limited; the agent's next reload sees that the counter moved,
//! rewrites every record and prefix (the planted one goes), and the address is limited again.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::Duration;

use ratelimit::maps::PinnedMaps;
use ratelimit_common::{prefix_generation, verdict, MAX_RULES, PREFIX_KEY_HEADER_BITS};
use ratelimit_testbed::agent_proc::{global_counter, rule_packets};
use ratelimit_testbed::{
    add_addr, assert_none_left, neigh_to_peer, require_root, send_udp_from, veth_pair,
    AgentProcess, Netns, Receiver,
};
use serde_json::Value;

const SRC: &str = "198.18.0.1";
/// The address the planted prefix covers.
const PLANTED: &str = "198.18.0.2";
const DST: &str = "198.18.0.254";
const RATE: u64 = 10;
const BURST: u64 = 5;
/// Packets per flood: 200 in 1 s, far over `BURST + RATE x 1 s` (15).
const PPS: u64 = 200;

fn stats(agent: &AgentProcess) -> Value {
    agent.cli_json(&["stats"])
}

/// Sends `PPS` for 1 s from `src` to a fresh receiver; (sent, received).
fn flood(tx: &Netns, rx: &Netns, src: &str) -> (u64, u64) {
    let receiver = Receiver::bind(rx, SocketAddr::new(DST.parse().unwrap(), 0)).unwrap();
    let sent = send_udp_from(
        tx,
        SocketAddr::new(src.parse().unwrap(), 0),
        receiver.local_addr(),
        PPS,
        Duration::from_secs(1),
        64,
    )
    .unwrap();
    receiver.wait_idle(Duration::from_millis(200), Duration::from_secs(5));
    let report = receiver.stop().unwrap();
    assert_eq!(report.socket_drops, Some(0), "receiver socket overflowed");
    let ip: IpAddr = src.parse().unwrap();
    (sent.sent, report.counts().get(&ip).copied().unwrap_or(0))
}

/// The rule's packets of every verdict.
fn rule_total(stats: &Value) -> u64 {
    verdict::NAMES
        .iter()
        .map(|v| rule_packets(stats, "flood", v))
        .sum()
}

/// Checks a flood got at most `burst + rate x t` (one more second of refill for the sender's and
/// receiver's slack) and at least the burst; returns what was sent.
fn limited(what: &str, (sent, got): (u64, u64)) -> u64 {
    println!("{what}: sent {sent}, received {got}");
    assert!(
        (BURST..=BURST + 2 * RATE).contains(&got),
        "{what}: received {got} of {sent}"
    );
    sent
}

#[test]
fn a_prefix_naming_a_missing_rule_passes_its_packets_counted_internal_until_the_next_reload() {
    require_root();
    let tx = Netns::new("rl-int-tx").unwrap();
    let rx = Netns::new("rl-int-rx").unwrap();
    let (tx_if, rx_if) = veth_pair(&tx, &rx, "int").unwrap();
    add_addr(&tx, &tx_if, &format!("{SRC}/24")).unwrap();
    add_addr(&tx, &tx_if, &format!("{PLANTED}/24")).unwrap();
    add_addr(&rx, &rx_if, &format!("{DST}/24")).unwrap();
    neigh_to_peer(&tx, &tx_if, DST.parse().unwrap(), &rx, &rx_if).unwrap();
    let config = format!(
        r#"[agent]
interfaces = ["{rx_if}"]
mode = "skb"

[[rule]]
name = "flood"
source = "198.18.0.0/24"
protocol = "udp"
rate = {RATE}
burst = {BURST}
"#
    );
    let agent = AgentProcess::start(&rx, &config, &[]).unwrap();

    limited("enforced", flood(&tx, &rx, SRC));
    let before = stats(&agent);
    assert_eq!(global_counter(&before, "internal"), 0);

    // Planted: a /32 in the generation in force, naming a rule id past the rule map.
    let mut maps = PinnedMaps::open(agent.pin_path()).unwrap();
    let generation = prefix_generation(maps.config().unwrap().generation);
    let (mut key, len, mut set) = maps
        .prefixes()
        .unwrap()
        .into_iter()
        .find(|(k, len, _)| k.generation == generation && *len == PREFIX_KEY_HEADER_BITS + 24)
        .expect("the rule's /24 in the generation in force");
    let planted: Ipv4Addr = PLANTED.parse().unwrap();
    key.addr[..4].copy_from_slice(&planted.octets());
    set.rules[0] = MAX_RULES;
    maps.insert_prefix(key, len + 8, set).unwrap();

    // Every packet from the planted address passes, each counted as internal, none as the
    // rule's; the others are limited as before.
    let (sent, got) = flood(&tx, &rx, PLANTED);
    let during = stats(&agent);
    let internal = global_counter(&during, "internal");
    println!("planted: sent {sent}, received {got}, internal {internal}");
    assert_eq!(got, sent, "an internal error must pass the packet");
    assert_eq!(internal, sent, "each packet counted as internal, once");
    assert_eq!(
        rule_total(&during),
        rule_total(&before),
        "nor counted as the rule's"
    );
    let others = limited("another source meanwhile", flood(&tx, &rx, SRC));
    assert_eq!(global_counter(&stats(&agent), "internal"), internal);

    // The next reload repairs it (the file did not change): the planted prefix is gone.
    agent.cli_ok(&["rules", "reload"]);
    assert!(
        !maps
            .prefixes()
            .unwrap()
            .iter()
            .any(|(k, _, _)| k.addr[..4] == planted.octets()),
        "not repaired"
    );
    assert!(
        agent
            .log()
            .contains("counted internal errors since the last install"),
        "{}",
        agent.log()
    );
    let sent = limited(
        "the planted address after the reload",
        flood(&tx, &rx, PLANTED),
    );
    let after = stats(&agent);
    assert_eq!(global_counter(&after, "internal"), internal);
    assert_eq!(rule_total(&after) - rule_total(&before), others + sent);
    // A further reload with nothing counted since writes only what changed (no warning again).
    agent.cli_ok(&["rules", "reload"]);
    assert_eq!(
        agent
            .log()
            .matches("counted internal errors since the last install")
            .count(),
        1
    );

    drop(maps);
    assert!(agent.stop().unwrap().success());
    drop((tx, rx));
    assert_none_left("rl-int-");
}
