//! The cluster's counters and peer states, end to end, with exact expectations where the figure
//! is known: two real agents in their own namespaces sharing a `scope = "cluster"` rule.
//! - what one host withholds from its buckets for a peer's share (`charged_packets`/
//!   `charged_bytes`, per peer and in total, in `status`, `peers` and the metrics) agrees
//!   exactly everywhere, and is at most the bucket's refill (until shares followed demand, it
//!   was exactly what the peer admitted);
//! - `cluster_bytes` out is exactly what left the gossip link (its own link, no other traffic);
//! - datagrams crafted by the test are counted by reason, exactly (`rejected{malformed,stale,
//!   auth}`); sends into a link that is down are `send_errors`;
//! - a peer cut off is shown `silent` after max(3 s, 10 x `sync_interval_ms`), then `dead`, in
//!   `peers` and the metrics; a restarted agent is a new incarnation: the old one is shown dead,
//!   the new one counted, and nothing is charged twice; it clears the share words the old one
//!   left (a bucket it does not track would otherwise hold its old, small share again).
//!
//! ```text
//!   sw namespace: bridge "rlbd" (data, 198.18.0.0/24), bridge "rlbg" (gossip, 198.18.1.0/24)
//!   tx --data-- rlbd --data-- h0 h1
//!               rlbg --gossip-- h0 h1
//! ```

use std::net::{IpAddr, Ipv4Addr, SocketAddr, UdpSocket};
use std::thread;
use std::time::Duration;

use ratelimit_testbed::agent_proc::rule_packets;
use ratelimit_testbed::cluster::{cluster, counter, peers, scrape, stop_agents, wait_for};
use ratelimit_testbed::cluster_net::{data_ip, gossip_addr, gossip_ip, ClusterNet};
use ratelimit_testbed::{bind_udp, require_root, send_udp, AgentProcess, Netns, Receiver};
use serde_json::Value;

mod counted;
mod incarnations;

const METRICS: &str = "127.0.0.1:9477";
const PAYLOAD: usize = 64;
const FLOOD: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 100);
/// A second source, after [`FLOOD`] in key order.
const FLOOD2: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 101);
/// A third source.
const FLOOD3: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 102);
const CLUSTER_ID: &str = "e2e-counters";
/// Ethernet (14), IPv4 (20) and UDP (8) headers around every gossip datagram on the link.
const FRAME_OVERHEAD: u64 = 42;

/// The network of `n` hosts (`rl-cc-{tag}`), the sender with [`FLOOD`], [`FLOOD2`] and
/// [`FLOOD3`], static neighbours between the hosts' gossip links (nothing but gossip ever leaves
/// them: their byte counters can be compared with the agents' exactly).
fn net(tag: &str, n: usize) -> ClusterNet {
    require_root();
    let net = ClusterNet::new(&format!("rl-cc-{tag}"), n).unwrap();
    for source in [FLOOD, FLOOD2, FLOOD3] {
        net.add_source(source).unwrap();
    }
    net.pin_gossip_neighbours().unwrap();
    net
}

/// A host's config: the cluster rule (rate 1000, burst 1000: the test's floods stay under it, so
/// every packet is admitted and the charges are known exactly), metrics on loopback.
fn config(net: &ClusterNet, i: usize, n: usize, sync_ms: u64, max_keys: usize) -> String {
    let seeds: Vec<String> = (0..n)
        .filter(|&j| j != i)
        .map(|j| gossip_addr(j).to_string())
        .collect();
    format!(
        r#"[agent]
interfaces = ["{}"]
metrics = "{METRICS}"

[[rule]]
name = "cl"
source = "198.18.0.0/24"
rate = 1000
burst = 1000
scope = "cluster"

[cluster]
listen = "{}"
seeds = {seeds:?}
key_file = "{}"
sync_interval_ms = {sync_ms}
cluster_id = "{CLUSTER_ID}"
max_keys = {max_keys}
"#,
        net.hosts[i].data_if,
        gossip_addr(i),
        net.key_file.display()
    )
}

/// [`config`] for an agent started on the pins `pins` an earlier agent kept (to adopt them).
fn config_on_pins(
    net: &ClusterNet,
    i: usize,
    n: usize,
    sync_ms: u64,
    max_keys: usize,
    pins: &std::path::Path,
) -> String {
    config(net, i, n, sync_ms, max_keys).replacen(
        "[agent]\n",
        &format!("[agent]\npin_path = \"{}\"\n", pins.display()),
        1,
    )
}

/// The peer entries with gossip address `addr`.
fn peer_at(cluster: &Value, addr: SocketAddr) -> Vec<Value> {
    let addr = addr.to_string();
    peers(cluster)
        .into_iter()
        .filter(|p| p["addr"] == addr.as_str())
        .collect()
}

/// The value of the metric sample `series` (name and labels as encoded).
fn metric(body: &str, series: &str) -> u64 {
    body.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
        .unwrap_or_else(|| panic!("no sample {series} in:\n{body}"))
}

fn tx_bytes(ns: &Netns, ifname: &str) -> u64 {
    let out = ns.ip(&["-s", "-j", "link", "show", "dev", ifname]).unwrap();
    let link: Value = serde_json::from_str(&out).unwrap();
    link[0]["stats64"]["tx"]["bytes"].as_u64().unwrap()
}

fn start_agents(net: &ClusterNet, n: usize, sync_ms: u64, max_keys: usize) -> Vec<AgentProcess> {
    let agents: Vec<AgentProcess> = (0..n)
        .map(|i| {
            AgentProcess::start(&net.hosts[i].ns, &config(net, i, n, sync_ms, max_keys), &[])
                .unwrap_or_else(|e| panic!("agent h{i}: {e:#}"))
        })
        .collect();
    wait_for("the cluster to form", Duration::from_secs(20), || {
        agents
            .iter()
            .all(|a| {
                let c = cluster(a);
                peers(&c).iter().filter(|p| p["counted"] == true).count() == n - 1
            })
            .then_some(())
    });
    agents
}

/// Sends `pps` x `duration` from the flood source to host `i`; every datagram must arrive (the
/// floods stay under the rule's budget). Returns the count.
fn flood(net: &ClusterNet, i: usize, pps: u64, duration: Duration) -> u64 {
    flood_from(net, FLOOD, i, pps, duration)
}

fn flood_from(net: &ClusterNet, src: Ipv4Addr, i: usize, pps: u64, duration: Duration) -> u64 {
    let receiver =
        Receiver::bind(&net.hosts[i].ns, SocketAddr::new(IpAddr::V4(data_ip(i)), 0)).unwrap();
    let sock = bind_udp(&net.tx, SocketAddr::new(IpAddr::V4(src), 0)).unwrap();
    let sent = send_udp(&sock, receiver.local_addr(), pps, duration, PAYLOAD).unwrap();
    receiver.wait_idle(Duration::from_millis(200), Duration::from_secs(5));
    let got = receiver.stop().unwrap().counts()[&IpAddr::V4(src)];
    assert_eq!(got, sent.sent, "the flood (under the budget) lost packets");
    got
}

/// Sends `pps` x `duration` from the flood source to host `i`, over the budget: returns what
/// was sent and what arrived.
fn flood_over(net: &ClusterNet, i: usize, pps: u64, duration: Duration) -> (u64, u64) {
    flood_over_from(net, FLOOD, i, pps, duration)
}

fn flood_over_from(
    net: &ClusterNet,
    src: Ipv4Addr,
    i: usize,
    pps: u64,
    duration: Duration,
) -> (u64, u64) {
    let receiver =
        Receiver::bind(&net.hosts[i].ns, SocketAddr::new(IpAddr::V4(data_ip(i)), 0)).unwrap();
    let sock = bind_udp(&net.tx, SocketAddr::new(IpAddr::V4(src), 0)).unwrap();
    let sent = send_udp(&sock, receiver.local_addr(), pps, duration, PAYLOAD).unwrap();
    receiver.wait_idle(Duration::from_millis(200), Duration::from_secs(5));
    let got = receiver
        .stop()
        .unwrap()
        .counts()
        .get(&IpAddr::V4(src))
        .copied()
        .unwrap_or(0);
    (sent.sent, got)
}

/// The rule's passed packets and bytes on an agent.
fn passed(agent: &AgentProcess) -> (u64, u64) {
    let stats = agent.stats();
    let rule = stats["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "cl")
        .unwrap()
        .clone();
    (
        rule_packets(&stats, "cl", "passed"),
        rule["bytes"]["passed"].as_u64().unwrap(),
    )
}

/// A socket in h1's namespace on h1's gossip address (another port than its agent's), for
/// datagrams crafted by the test.
fn crafter(net: &ClusterNet) -> UdpSocket {
    bind_udp(
        &net.hosts[1].ns,
        SocketAddr::new(IpAddr::V4(gossip_ip(1)), 0),
    )
    .unwrap()
}

/// `max_keys` caps what is read from each peer: h0 (max_keys 1) reads one of the two keys h1
/// publishes (the first in key order): a source sending to both hosts under the other key gets
/// its whole refill at h0 (h1's demand for it is not read: nothing withheld), one under the key
/// read gets its share; h0 counts the key left out in `keys_dropped` (status and metrics), and
/// stores no more than that key and h1's sync key (`stored_keys`).
#[test]
fn keys_beyond_max_keys_are_dropped_counted_and_not_charged() {
    let net = net("kd", 2);
    let agents: Vec<AgentProcess> = [1, 1000]
        .iter()
        .enumerate()
        .map(|(i, &max_keys)| {
            AgentProcess::start(&net.hosts[i].ns, &config(&net, i, 2, 100, max_keys), &[]).unwrap()
        })
        .collect();
    let (h0, h1) = (&agents[0], &agents[1]);
    wait_for("the cluster to form", Duration::from_secs(20), || {
        agents
            .iter()
            .all(|a| peers(&cluster(a)).iter().any(|p| p["counted"] == true))
            .then_some(())
    });
    assert_eq!(counter(&cluster(h0), "keys_dropped"), 0);
    // Both keys published by h1; the second one's source also at h0. The second only once h1
    // publishes the first: h0 reads a peer's first `max_keys` keys in key order, so a round of
    // h1's that published the second key alone would have h0 read it and withhold its refill.
    let (first, second, second0) = thread::scope(|s| {
        let a = s.spawn(|| flood_from(&net, FLOOD, 1, 200, Duration::from_secs(2)));
        wait_for(
            "h1 publishing the first key",
            Duration::from_secs(10),
            || (counter(&cluster(h1), "keys_published") >= 1).then_some(()),
        );
        let b = s.spawn(|| flood_from(&net, FLOOD2, 1, 300, Duration::from_secs(2)));
        let c = s.spawn(|| flood_from(&net, FLOOD2, 0, 300, Duration::from_secs(2)));
        (a.join().unwrap(), b.join().unwrap(), c.join().unwrap())
    });
    assert_eq!(passed(h1).0, first + second);
    wait_for("h1 publishing both keys", Duration::from_secs(10), || {
        (counter(&cluster(h1), "keys_published") == 2).then_some(())
    });
    thread::sleep(Duration::from_millis(500));
    let c = cluster(h0);
    println!(
        "h1 admitted {first} from {FLOOD} and {second} from {FLOOD2}, h0 {second0} from \
         {FLOOD2}; h0 (max_keys 1) withheld {}, keys_dropped {}",
        counter(&c, "charged_pkts"),
        counter(&c, "keys_dropped")
    );
    assert_eq!(
        counter(&c, "charged_pkts"),
        0,
        "refill withheld for a key beyond max_keys: {c}"
    );
    // The key read: its source at both hosts gets its share at h0.
    thread::scope(|s| {
        let a = s.spawn(|| flood_from(&net, FLOOD, 1, 200, Duration::from_secs(2)));
        let b = s.spawn(|| flood_from(&net, FLOOD, 0, 200, Duration::from_secs(2)));
        (a.join().unwrap(), b.join().unwrap())
    });
    let c2 = wait_for(
        "h0 to withhold refill for the key read",
        Duration::from_secs(10),
        || {
            let c = cluster(h0);
            (counter(&c, "charged_pkts") > 0).then_some(c)
        },
    );
    let dropped = counter(&c2, "keys_dropped");
    assert!(dropped > 0, "{c2}");
    // Stored, not only read: h0 holds h1's first key and its sync key, not the second key.
    let stored: Vec<u64> = peers(&c2)
        .iter()
        .filter(|p| p["counted"] == true)
        .map(|p| p["stored_keys"].as_u64().expect("stored_keys"))
        .collect();
    assert_eq!(stored, [2], "h1's keys stored at h0 (max_keys 1): {c2}");
    let body = scrape(&net.hosts[0].ns);
    let scraped = metric(&body, "ratelimit_cluster_keys_dropped_total");
    assert!(
        (dropped..=counter(&cluster(h0), "keys_dropped")).contains(&scraped),
        "metric keys_dropped {scraped}, status {dropped}"
    );
    stop_agents(agents);
}

/// The share word of `src`'s bucket in the maps pinned at `dir` (0: none, the whole rate).
fn share_of(dir: &std::path::Path, src: Ipv4Addr) -> Option<u16> {
    let maps = ratelimit::maps::PinnedMaps::open(dir).unwrap();
    let mut share = None;
    maps.for_each_bucket(|_, b| {
        if b.family != 0 && b.addr[..4] == src.octets() {
            share = Some(b.share());
        }
    })
    .unwrap();
    share
}

/// A restarted agent clears the share words an earlier one left in the buckets it adopts, before
/// its first round renews the shares. Its rounds rewrite the words of the keys it reads (with
/// `max_keys` 1, the heaviest source's and the next candidate's), but not of the others: the
/// lightest of three sources' bucket keeps the old word unless cleared. Without the clearing, the old word
/// (a small share, from when another host took most of the budget) would hold again under the
/// new agent's rounds, and the source, back at this host alone, would find its bucket at that
/// share of its burst.
#[test]
fn a_restarted_agent_clears_the_share_words_an_earlier_one_left() {
    const SYNC_MS: u64 = 200;
    let net = net("shw", 2);
    let mut agents = start_agents(&net, 2, SYNC_MS, 1000);
    // h1 takes most of each source's budget (1000/s), h0 a little: h0's buckets get small share
    // words. FLOOD3 is the lightest at h0. h0's agent is killed (SIGKILL) while they flow, its
    // words in force: they stay in the pinned buckets (its XDP program too, pinned, and the
    // words lapse with `shares_until`, so the floods keep passing).
    let pins = agents[0].pin_path().to_path_buf();
    let n = &net;
    thread::scope(|s| {
        let mut t = Vec::new();
        for (src, pps) in [(FLOOD, 50), (FLOOD2, 35), (FLOOD3, 20)] {
            t.push(s.spawn(move || flood_from(n, src, 0, pps, Duration::from_secs(4))));
            t.push(s.spawn(move || flood_from(n, src, 1, 800, Duration::from_secs(4))));
        }
        thread::sleep(Duration::from_millis(2500));
        assert!(!agents[0].crash().unwrap().success());
        for t in t {
            t.join().unwrap();
        }
    });
    let before = share_of(&pins, FLOOD3).expect("h0 has a bucket for the third source");
    println!(
        "h0's share word for {FLOOD3} when its agent was killed: {before} of {}",
        ratelimit_common::SHARE_ONE
    );
    assert!(
        before != 0 && u64::from(before) < ratelimit_common::SHARE_ONE / 4,
        "h0's share word {before}: expected a small share"
    );

    let old = agents.remove(0);
    let (_, kept) = old.stop_keeping_pins().unwrap();
    let cfg = config_on_pins(&net, 0, 2, SYNC_MS, 1, kept.path());
    let restarted = AgentProcess::start(&net.hosts[0].ns, &cfg, &[]).unwrap();
    assert!(restarted.log().contains("adopted"), "{}", restarted.log());
    wait_for(
        "h1 counted at the new agent",
        Duration::from_secs(20),
        || {
            peers(&cluster(&restarted))
                .iter()
                .any(|p| p["counted"] == true)
                .then_some(())
        },
    );
    // Rounds of the new agent: its shares are in force (renewed every round).
    thread::sleep(Duration::from_millis(10 * SYNC_MS));
    let after = share_of(kept.path(), FLOOD3).expect("the adopted bucket is still there");
    println!("h0's share word for {FLOOD3} after the restart: {after}");
    assert_eq!(after, 0, "the earlier agent's word is still in the bucket");
    // The source back at h0 alone: its bucket's whole burst (1000), not a share of it.
    let (sent, got) = flood_over_from(&net, FLOOD3, 0, 4000, Duration::from_millis(150));
    println!("{FLOOD3} back at h0 alone: {got} of {sent} admitted");
    assert!(sent >= 300, "the burst sent only {sent}");
    assert_eq!(
        got, sent,
        "the source's bucket was not whole after the restart"
    );

    assert!(restarted.stop().unwrap().success());
    drop(kept);
    let h1 = agents.pop().unwrap();
    assert!(h1.stop().unwrap().success());
}
