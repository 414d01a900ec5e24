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
use std::os::unix::fs::PermissionsExt as _;
use std::path::PathBuf;
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use ratelimit::cluster::key::ClusterKey;
use ratelimit::cluster::wire::Codec;
use ratelimit_testbed::agent_proc::rule_packets;
use ratelimit_testbed::{
    add_addr, agent_binary, bind_udp, mac, neigh_to_peer, require_root, send_udp, veth_pair,
    AgentProcess, Netns, Receiver,
};
use serde_json::{json, Value};

const GOSSIP_PORT: u16 = 7946;
const METRICS: &str = "127.0.0.1:9477";
const PAYLOAD: usize = 64;
const FLOOD: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 100);
/// A second source, after [`FLOOD`] in key order.
const FLOOD2: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 101);
/// A third source.
const FLOOD3: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 102);
const CLUSTER_ID: &str = "e2e-counters";
const SECRET: &str = "k8Qx2v9Lm4Tz7Rb1Nc6Yh3Wd5Gf0Ps8Ju2Ea4Ko7Ui1";
/// Ethernet (14), IPv4 (20) and UDP (8) headers around every gossip datagram on the link.
const FRAME_OVERHEAD: u64 = 42;

fn data_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 0, 1 + u8::try_from(i).unwrap())
}

fn gossip_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 1, 1 + u8::try_from(i).unwrap())
}

fn gossip_addr(i: usize) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(gossip_ip(i)), GOSSIP_PORT)
}

struct Host {
    ns: Netns,
    data_if: String,
    gossip_if: String,
}

/// The test network; dropped last (after the agents).
struct Net {
    hosts: Vec<Host>,
    tx: Netns,
    _sw: Netns,
    keys: PathBuf,
}

impl Drop for Net {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.keys);
    }
}

fn net(tag: &str, n: usize) -> Net {
    require_root();
    let keys = std::env::temp_dir().join(format!("rl-cc-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&keys).unwrap();
    let sw = Netns::new(&format!("rl-cc-{tag}-sw")).unwrap();
    for br in ["rlbd", "rlbg"] {
        sw.ip(&["link", "add", "name", br, "type", "bridge"])
            .unwrap();
        sw.ip(&["link", "set", br, "up"]).unwrap();
    }
    let plug = |ns: &Netns, prefix: &str, bridge: &str| -> (String, String) {
        let (inside, port) = veth_pair(ns, &sw, prefix).unwrap();
        sw.ip(&["link", "set", &port, "master", bridge]).unwrap();
        (inside, port)
    };
    let tx = Netns::new(&format!("rl-cc-{tag}-tx")).unwrap();
    let (tx_if, _) = plug(&tx, "kt", "rlbd");
    add_addr(&tx, &tx_if, &format!("{FLOOD}/24")).unwrap();
    add_addr(&tx, &tx_if, &format!("{FLOOD2}/24")).unwrap();
    add_addr(&tx, &tx_if, &format!("{FLOOD3}/24")).unwrap();
    let mut hosts = Vec::new();
    for i in 0..n {
        let ns = Netns::new(&format!("rl-cc-{tag}-h{i}")).unwrap();
        let (data_if, data_port) = plug(&ns, "kd", "rlbd");
        let (gossip_if, _) = plug(&ns, "kg", "rlbg");
        add_addr(&ns, &data_if, &format!("{}/24", data_ip(i))).unwrap();
        add_addr(&ns, &gossip_if, &format!("{}/24", gossip_ip(i))).unwrap();
        // The hosts never send on the data link: pin their MACs in the bridge, or it floods
        // every frame to every host.
        sw.run(&[
            "bridge",
            "fdb",
            "replace",
            &mac(&ns, &data_if).unwrap(),
            "dev",
            &data_port,
            "master",
            "static",
        ])
        .unwrap();
        neigh_to_peer(&tx, &tx_if, IpAddr::V4(data_ip(i)), &ns, &data_if).unwrap();
        hosts.push(Host {
            ns,
            data_if,
            gossip_if,
        });
    }
    // Static neighbours on the gossip link: nothing but gossip ever leaves it (no ARP), so its
    // byte counter can be compared with the agent's exactly.
    for i in 0..n {
        for j in 0..n {
            if i != j {
                let (a, b) = (&hosts[i], &hosts[j]);
                neigh_to_peer(
                    &a.ns,
                    &a.gossip_if,
                    IpAddr::V4(gossip_ip(j)),
                    &b.ns,
                    &b.gossip_if,
                )
                .unwrap();
            }
        }
    }
    let key = keys.join("cluster.key");
    std::fs::write(&key, format!("{SECRET}\n")).unwrap();
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    Net {
        hosts,
        tx,
        _sw: sw,
        keys,
    }
}

/// A host's config: the cluster rule (rate 1000, burst 1000: the test's floods stay under it, so
/// every packet is admitted and the charges are known exactly), metrics on loopback.
fn config(net: &Net, i: usize, n: usize, sync_ms: u64, max_keys: usize) -> String {
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
        net.keys.join("cluster.key").display()
    )
}

/// [`config`] for an agent started on the pins `pins` an earlier agent kept (to adopt them).
fn config_on_pins(
    net: &Net,
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

fn cli(agent: &AgentProcess, args: &[&str]) -> String {
    let out = Command::new(agent_binary())
        .arg("--socket")
        .arg(agent.socket_path())
        .args(args)
        .output()
        .expect("running ratelimit");
    assert!(
        out.status.success(),
        "ratelimit {args:?} failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        agent.log()
    );
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

/// `status --json`'s `cluster` object.
fn cluster(agent: &AgentProcess) -> Value {
    let status: Value = serde_json::from_str(&cli(agent, &["status", "--json"])).unwrap();
    status["cluster"].clone()
}

fn counter(cluster: &Value, name: &str) -> u64 {
    cluster["counters"][name]
        .as_u64()
        .unwrap_or_else(|| panic!("no cluster counter {name}: {cluster}"))
}

fn peers(cluster: &Value) -> Vec<Value> {
    cluster["peers"].as_array().cloned().unwrap_or_default()
}

/// The peer entries with gossip address `addr`.
fn peer_at(cluster: &Value, addr: SocketAddr) -> Vec<Value> {
    let addr = addr.to_string();
    peers(cluster)
        .into_iter()
        .filter(|p| p["addr"] == addr.as_str())
        .collect()
}

use ratelimit_testbed::cluster::scrape;

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

fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: not within {timeout:?}");
        thread::sleep(Duration::from_millis(50));
    }
}

fn start_agents(net: &Net, n: usize, sync_ms: u64, max_keys: usize) -> Vec<AgentProcess> {
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
fn flood(net: &Net, i: usize, pps: u64, duration: Duration) -> u64 {
    flood_from(net, FLOOD, i, pps, duration)
}

fn flood_from(net: &Net, src: Ipv4Addr, i: usize, pps: u64, duration: Duration) -> u64 {
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
fn flood_over(net: &Net, i: usize, pps: u64, duration: Duration) -> (u64, u64) {
    flood_over_from(net, FLOOD, i, pps, duration)
}

fn flood_over_from(net: &Net, src: Ipv4Addr, i: usize, pps: u64, duration: Duration) -> (u64, u64) {
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

fn unix_ms() -> u64 {
    u64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}

/// A socket in h1's namespace on h1's gossip address (another port than its agent's), for
/// datagrams crafted by the test.
fn crafter(net: &Net) -> UdpSocket {
    bind_udp(
        &net.hosts[1].ns,
        SocketAddr::new(IpAddr::V4(gossip_ip(1)), 0),
    )
    .unwrap()
}

#[test]
#[expect(clippy::too_many_lines, reason = "one scenario, told in order")]
fn charges_gossip_bytes_and_rejections_are_counted_exactly() {
    let net = net("cnt", 2);
    let agents = start_agents(&net, 2, 100, 1000);
    let (h0, h1) = (&agents[0], &agents[1]);

    // --- cluster_bytes: what h0 says it sent is what left its gossip link. A snapshot of the
    // agent's counters is taken only if the link counter did not move across it.
    let snapshot = || {
        wait_for(
            "a still moment on the gossip link",
            Duration::from_secs(10),
            || {
                let before = tx_bytes(&net.hosts[0].ns, &net.hosts[0].gossip_if);
                let c = cluster(h0);
                let after = tx_bytes(&net.hosts[0].ns, &net.hosts[0].gossip_if);
                (before == after)
                    .then(|| (after, counter(&c, "bytes_out"), counter(&c, "messages_out")))
            },
        )
    };
    let (l0, b0, m0) = snapshot();
    let t0 = Instant::now();
    thread::sleep(Duration::from_secs(3));
    let (l1, b1, m1) = snapshot();
    let secs = t0.elapsed().as_secs_f64();
    println!(
        "gossip out of h0 (2 hosts, 100 ms, idle): {} datagrams, {} B in {secs:.1} s = {:.0} B/s; \
         link {} B",
        m1 - m0,
        b1 - b0,
        (b1 - b0) as f64 / secs,
        l1 - l0
    );
    assert!(m1 > m0, "h0 sent no gossip");
    assert_eq!(
        l1 - l0,
        (b1 - b0) + FRAME_OVERHEAD * (m1 - m0),
        "gossip link bytes vs the agent's bytes_out and messages_out"
    );
    let before = counter(&cluster(h0), "bytes_out");
    let body = scrape(&net.hosts[0].ns);
    let after = counter(&cluster(h0), "bytes_out");
    let scraped = metric(&body, r#"ratelimit_cluster_bytes_total{direction="out"}"#);
    assert!(
        (before..=after).contains(&scraped),
        "metric cluster_bytes out {scraped} not between the status reads {before}..{after}"
    );

    // --- Charges: one source floods both hosts (1,500 pps each, 3 x the budget): h0 gives its
    // bucket its share and withholds the rest of its refill for h1's; the total, h1's part (its
    // only peer: all of it), and the metric agree exactly; no byte limit, no bytes withheld.
    let c0 = cluster(h0);
    assert_eq!(counter(&c0, "charged_pkts"), 0, "{c0}");
    let began = Instant::now();
    let flood_key = format!("{FLOOD}/32");
    let (((sent0, admitted0), (sent1, admitted1)), (shown, key, table, body)) =
        thread::scope(|s| {
            let a = s.spawn(|| flood_over(&net, 0, 1500, Duration::from_secs(2)));
            let b = s.spawn(|| flood_over(&net, 1, 1500, Duration::from_secs(2)));
            // While both hosts flood: h0's `peers --json` once it names both holders of the
            // source's key, with the table and the metrics of that moment.
            let shown = wait_for(
                "h0's peers to name both holders of the flooded key",
                Duration::from_millis(1900),
                || {
                    let v: Value = serde_json::from_str(&cli(h0, &["peers", "--json"])).unwrap();
                    let key = v["keys"]
                        .as_array()?
                        .iter()
                        .find(|k| k["rule"] == "cl" && k["key"] == flood_key.as_str())?
                        .clone();
                    (key["holders"].as_array()?.len() == 2).then(|| {
                        let table = cli(h0, &["peers"]);
                        (v, key, table, scrape(&net.hosts[0].ns))
                    })
                },
            );
            ((a.join().unwrap(), b.join().unwrap()), shown)
        });
    // Why the source is limited: h0's `peers` shows its key held by both hosts, each with its
    // demand and share (h0 first), the shares adding up to the whole budget; the table and the
    // metrics show the same.
    println!("h0's peers while the source floods both hosts: {key:#}\n{table}");
    let holders = key["holders"].as_array().unwrap();
    let h1_id = &peer_at(&shown, gossip_addr(1))[0];
    assert_eq!(
        (
            &key["limit"],
            &key["hosts"],
            &holders[0]["node_id"],
            &holders[0]["generation"]
        ),
        (
            &json!(1),
            &json!(2),
            &shown["node_id"],
            &shown["generation"]
        ),
        "{key:#}"
    );
    assert_eq!(
        (&holders[1]["node_id"], &holders[1]["generation"]),
        (&h1_id["node_id"], &h1_id["generation"]),
        "{key:#}"
    );
    let figure = |h: &Value, f: &str| h[f].as_f64().unwrap_or_else(|| panic!("{f}: {key:#}"));
    assert!(figure(&holders[0], "demand_pps") > 0.0, "{key:#}");
    let total: f64 = holders.iter().map(|h| figure(h, "share")).sum();
    assert!(
        (total - 1.0).abs() <= 0.1,
        "the holders' shares add up to {total}: {key:#}"
    );
    let demand: f64 = holders.iter().map(|h| figure(h, "demand_pps")).sum();
    assert!(
        (figure(&key, "demand_pps") - demand).abs() < 1e-6,
        "the cluster's demand is the holders': {key:#}"
    );
    let me = shown["node_id"].as_str().unwrap();
    assert!(
        table.contains(&flood_key) && table.contains(&format!("{me} (this host)")),
        "peers table does not show the key's holders:\n{table}"
    );
    for holder in [me, h1_id["node_id"].as_str().unwrap()] {
        let series = format!(
            "ratelimit_cluster_key_share{{rule=\"cl\",limit=\"1\",key=\"{flood_key}\",holder=\"{holder}\"}} "
        );
        assert!(body.contains(&series), "no {series} in:\n{body}");
    }
    // Once neither host has demand, nothing more is withheld.
    let c = wait_for("h0's withholding to stop", Duration::from_secs(10), || {
        let c = cluster(h0);
        thread::sleep(Duration::from_millis(500));
        (counter(&cluster(h0), "charged_pkts") == counter(&c, "charged_pkts")).then_some(c)
    });
    let span = began.elapsed().as_secs_f64();
    let pkts = counter(&c, "charged_pkts");
    println!(
        "sent {sent0} to h0, {sent1} to h1; admitted {admitted0} at h0, {admitted1} at h1; h0 \
         withheld {pkts} packets of refill over {span:.1} s"
    );
    assert!(pkts > 0, "h0 withheld nothing for h1's share: {c}");
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "a few thousand"
    )]
    let most = (1000.0 * span) as u64;
    assert!(
        pkts <= most,
        "h0 withheld {pkts} packets, more than its whole refill over {span:.1} s ({most})"
    );
    assert!(
        admitted0 + admitted1 < sent0 + sent1,
        "nothing was limited: the test did not load the budget"
    );
    assert_eq!(counter(&c, "charged_bytes"), 0, "no byte limit: {c}");
    assert_eq!(counter(&c, "charges_clamped"), 0, "a round ran late: {c}");
    let p = peer_at(&c, gossip_addr(1));
    assert_eq!(p.len(), 1, "{c}");
    assert_eq!(
        (
            p[0]["charged_pkts"].as_u64(),
            p[0]["charged_bytes"].as_u64()
        ),
        (Some(pkts), Some(0))
    );
    let body = scrape(&net.hosts[0].ns);
    assert_eq!(
        metric(&body, "ratelimit_cluster_charged_packets_total"),
        pkts
    );
    assert_eq!(metric(&body, "ratelimit_cluster_charged_bytes_total"), 0);
    assert_eq!(metric(&body, "ratelimit_cluster_charges_clamped_total"), 0);
    let c1 = cluster(h1);
    assert_eq!(counter(&c1, "keys_published"), 1, "{c1}");
    assert_eq!(
        metric(
            &scrape(&net.hosts[1].ns),
            "ratelimit_cluster_keys_published"
        ),
        1
    );
    let table = cli(h0, &["peers"]);
    assert!(
        table.contains(&pkts.to_string()),
        "peers table does not show the charge:\n{table}"
    );

    // --- Rejections, by reason, exactly: junk (malformed), sealed with the cluster key but a
    // minute old or ahead, or replayed (stale), sealed with another key, sealed for another host
    // (h1) or sealed from another source address than it came from (auth).
    let key = ClusterKey::from_secret(format!("{SECRET}\n").as_bytes(), CLUSTER_ID).unwrap();
    let wrong = ClusterKey::from_secret(b"Zq1Xw2Ce3Rv4Tb5Yn6Um7Ii8Oo9Pp0Aa1Ss2Dd3Ff4G", CLUSTER_ID)
        .unwrap();
    let sock = crafter(&net);
    let here = sock.local_addr().unwrap();
    let to = gossip_addr(0);
    let mut codec = Codec::new(&key, CLUSTER_ID, here);
    let mut wrong_codec = Codec::new(&wrong, CLUSTER_ID, here);
    let seal =
        |c: &mut Codec, at: u64| c.seal(b"not a chitchat message", to, at).unwrap().remove(0);
    let r0 = cluster(h0);
    let count = |c: &Value| {
        [
            "rejected_malformed",
            "rejected_stale",
            "rejected_auth",
            "messages_in",
        ]
        .map(|k| counter(c, k))
    };
    let before = count(&r0);
    for junk in [&b"hello"[..], &[0u8; 100][..], b"RLC2\x11short"] {
        sock.send_to(junk, to).unwrap();
    }
    let now = unix_ms();
    for at in [now - 60_000, now - 31_000, now + 60_000] {
        sock.send_to(&seal(&mut codec, at), to).unwrap();
    }
    for _ in 0..2 {
        sock.send_to(&seal(&mut wrong_codec, unix_ms()), to)
            .unwrap();
    }
    // Recorded on its way to h1 (a peer's genuine datagram), replayed to h0.
    let for_h1 = codec
        .seal(b"not a chitchat message", gossip_addr(1), unix_ms())
        .unwrap()
        .remove(0);
    sock.send_to(&for_h1, to).unwrap();
    // Sealed by h1's address, sent from ours (a spoofed source, to reflect a reply).
    let from_h1 = Codec::new(&key, CLUSTER_ID, gossip_addr(1))
        .seal(b"not a chitchat message", to, unix_ms())
        .unwrap()
        .remove(0);
    sock.send_to(&from_h1, to).unwrap();
    let fresh = seal(&mut codec, unix_ms());
    sock.send_to(&fresh, to).unwrap();
    sock.send_to(&fresh, to).unwrap();
    let want = [before[0] + 3, before[1] + 4, before[2] + 4];
    let got = wait_for(
        "h0 to count the crafted datagrams",
        Duration::from_secs(10),
        || {
            let c = count(&cluster(h0));
            (c.iter().zip(&want).all(|(c, w)| c >= w)).then_some(c)
        },
    );
    thread::sleep(Duration::from_millis(300));
    let after = count(&cluster(h0));
    println!(
        "rejected (malformed, stale, auth) before {:?} after {:?}",
        &before[..3],
        &after[..3]
    );
    assert_eq!(after[..3], want[..], "rejections by reason");
    assert_eq!(got[..3], after[..3]);
    let body = scrape(&net.hosts[0].ns);
    for (reason, v) in [
        ("malformed", after[0]),
        ("stale", after[1]),
        ("auth", after[2]),
    ] {
        assert_eq!(
            metric(
                &body,
                &format!("ratelimit_cluster_rejected_total{{reason=\"{reason}\"}}")
            ),
            v
        );
    }
    // Nothing of it reached the cluster's state: h0 still counts h1 alone, nothing charged.
    let c = cluster(h0);
    assert_eq!(peers(&c).len(), 1, "{c}");
    assert_eq!(counter(&c, "charged_pkts"), pkts);

    // --- send_errors: h0's gossip link down, its sends fail (no route) and are counted.
    let e0 = counter(&cluster(h0), "send_errors");
    assert_eq!(e0, 0, "send errors on a healthy link");
    assert_eq!(counter(&cluster(h1), "send_errors"), 0);
    net.hosts[0]
        .ns
        .ip(&["link", "set", &net.hosts[0].gossip_if, "down"])
        .unwrap();
    let errors = wait_for(
        "send errors with the link down",
        Duration::from_secs(10),
        || {
            let n = counter(&cluster(h0), "send_errors");
            (n > 0).then_some(n)
        },
    );
    net.hosts[0]
        .ns
        .ip(&["link", "set", &net.hosts[0].gossip_if, "up"])
        .unwrap();
    let body = scrape(&net.hosts[0].ns);
    assert!(metric(&body, "ratelimit_cluster_send_errors_total") >= errors);
    // The agent carried on: h1 is counted again once the link is back.
    wait_for("h1 counted again", Duration::from_secs(20), || {
        peer_at(&cluster(h0), gossip_addr(1))
            .iter()
            .any(|p| p["counted"] == true)
            .then_some(())
    });

    for a in agents {
        assert!(a.stop().unwrap().success());
    }
}

/// The peer entries of h1 at h0 (one per incarnation).
fn h1_at_h0(h0: &AgentProcess) -> Vec<Value> {
    peer_at(&cluster(h0), gossip_addr(1))
}

fn charged_by(h0: &AgentProcess, generation: u64) -> u64 {
    h1_at_h0(h0)
        .iter()
        .find(|p| p["generation"].as_u64() == Some(generation))
        .and_then(|p| p["charged_pkts"].as_u64())
        .unwrap_or_else(|| panic!("no peer of generation {generation} at h0: {}", cluster(h0)))
}

/// A peer cut off stops being counted within max(3 s, 10 x `sync_interval_ms`) (here 10 x 400
/// ms = 4 s; chitchat's failure detector declares it dead after 2 to 2.4 timeouts, and `peers`,
/// `status` and the metrics show it dead); while cut off it takes no share (nothing is withheld
/// for it, then or when it is heard again), and after it is heard again it takes one again. Then its agent is killed and started again (it
/// adopts the pinned buckets): the new incarnation is a peer of its own, counted, the old one is
/// shown dead, and what the new one charges is at most what it admitted (its adopted buckets'
/// past is not published again).
#[test]
#[expect(clippy::too_many_lines, reason = "one scenario, told in order")]
fn a_cut_off_peer_stops_counting_rejoins_without_late_charges_and_restarts_as_a_new_incarnation() {
    const SYNC_MS: u64 = 400;
    const TIMEOUT: f64 = 4.0;
    let net = net("inc", 2);
    let mut agents = start_agents(&net, 2, SYNC_MS, 1000);
    assert_eq!(cluster(&agents[0])["peer_timeout_ms"], 4000);
    let generation = |a: &AgentProcess| cluster(a)["generation"].as_u64().unwrap();
    let g1 = generation(&agents[1]);

    // The source at both hosts (300 pps each, all admitted: each host's share is half the
    // budget): h0 withholds half of its bucket's refill for h1's share while connected.
    let both = |net: &Net| {
        thread::scope(|s| {
            let a = s.spawn(|| flood(net, 0, 300, Duration::from_secs(1)));
            let b = s.spawn(|| flood(net, 1, 300, Duration::from_secs(1)));
            a.join().unwrap() + b.join().unwrap()
        })
    };
    both(&net);
    wait_for("h0 withholding for h1", Duration::from_secs(10), || {
        (charged_by(&agents[0], g1) > 0).then_some(())
    });
    // Once the traffic stopped, h1's demand reads 0 after `DEMAND_HISTORY` of its syncs (its
    // window reaches that far back for a few packets), and nothing is withheld for it after.
    // On a busy machine their rounds and gossip run late, so wait until the count has not moved
    // for as long again: a cut while h0 still reads a demand of h1 freezes that reading, and h0
    // withholds for it until it goes stale (`STALE_ROUNDS`), after the count taken here.
    let settled =
        Duration::from_millis((ratelimit::cluster::remote::DEMAND_HISTORY as u64 + 3) * SYNC_MS);
    let settle = |what: &str| {
        thread::sleep(settled);
        let mut last = charged_by(&agents[0], g1);
        wait_for(what, Duration::from_secs(10), || {
            thread::sleep(settled);
            let now = charged_by(&agents[0], g1);
            let still = now == last;
            last = now;
            still.then_some(now)
        })
    };
    let first = settle("the refill withheld for h1 settling before the cut");

    // Cut: not counted within the timeout (plus a sync round and a poll: when the status is
    // refreshed), shown dead.
    net.hosts[1]
        .ns
        .ip(&["link", "set", &net.hosts[1].gossip_if, "down"])
        .unwrap();
    let cut = Instant::now();
    let uncounted = wait_for("h1 no longer counted", Duration::from_secs(20), || {
        let p = h1_at_h0(&agents[0]);
        p.iter()
            .all(|p| p["counted"] == false)
            .then(|| cut.elapsed().as_secs_f64())
    });
    let dead = wait_for("h1 shown dead", Duration::from_secs(30), || {
        h1_at_h0(&agents[0])
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
    let table = cli(&agents[0], &["peers"]);
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

    // While cut off h1 takes no share: nothing is withheld for it, then or when it is heard
    // again.
    let during = both(&net);
    net.hosts[1]
        .ns
        .ip(&["link", "set", &net.hosts[1].gossip_if, "up"])
        .unwrap();
    wait_for("h1 counted again", Duration::from_secs(30), || {
        h1_at_h0(&agents[0])
            .iter()
            .any(|p| p["counted"] == true && p["state"] == "alive")
            .then_some(())
    });
    thread::sleep(Duration::from_millis(4 * SYNC_MS));
    if charged_by(&agents[0], g1) != first {
        eprintln!("H0 LOG:\n{}\nH1 LOG:\n{}", agents[0].log(), agents[1].log());
    }
    assert_eq!(
        charged_by(&agents[0], g1),
        first,
        "refill withheld for h1 while it was cut off ({during} packets sent meanwhile)"
    );
    assert_eq!(counter(&cluster(&agents[0]), "charged_pkts"), first);
    both(&net);
    wait_for(
        "h0 withholding for h1 after the rejoin",
        Duration::from_secs(10),
        || (charged_by(&agents[0], g1) > first).then_some(()),
    );
    // As above: once the traffic stopped, nothing more is withheld for h1.
    let after = settle("the refill withheld for h1 settling after the rejoin") - first;

    // Restart: SIGKILL, and a new agent adopting the pins.
    let status = agents[1].crash().unwrap();
    assert!(!status.success());
    let old = agents.pop().unwrap();
    let (_, kept) = old.stop_keeping_pins().unwrap();
    // The restarted agent needs its own pins to adopt: the same config names no pin_path, so
    // start it on the kept directory.
    let cfg = config_on_pins(&net, 1, 2, SYNC_MS, 1000, kept.path());
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
    let (passed_before, _) = passed(&restarted);
    let fourth = thread::scope(|s| {
        let a = s.spawn(|| flood(&net, 0, 300, Duration::from_secs(2)));
        let b = s.spawn(|| flood(&net, 1, 300, Duration::from_secs(2)));
        a.join().unwrap();
        b.join().unwrap()
    });
    let (passed_after, _) = passed(&restarted);
    assert_eq!(
        passed_after - passed_before,
        fourth,
        "the adopted counters go on"
    );
    thread::sleep(Duration::from_millis(
        (ratelimit::cluster::remote::DEMAND_HISTORY as u64 + 3) * SYNC_MS,
    ));
    let charged_new = charged_by(&agents[0], g2);
    let total = counter(&cluster(&agents[0]), "charged_pkts");
    println!(
        "withheld at h0 for h1: {first} connected, 0 while cut off ({during} sent), {after} after \
         the rejoin, {charged_new} for the new incarnation ({total} in all)"
    );
    assert!(charged_new > 0, "nothing withheld for the new incarnation");
    assert_eq!(
        charged_by(&agents[0], g1),
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

    assert!(restarted.stop().unwrap().success());
    drop(kept);
    let h0 = agents.pop().unwrap();
    assert!(h0.stop().unwrap().success());
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
    // Both keys published by h1; the second one's source also at h0.
    let (first, second, second0) = thread::scope(|s| {
        let a = s.spawn(|| flood_from(&net, FLOOD, 1, 200, Duration::from_secs(2)));
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
    for a in agents {
        assert!(a.stop().unwrap().success());
    }
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
