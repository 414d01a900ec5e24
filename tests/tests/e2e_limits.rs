//! Several limits per rule, end to end: the real agent on a veth, real traffic.
//!
//! - Five sources of one /24 at 2,000 pps each, under a per-source limit of 1,000 pps and a
//!   per-/24 limit of 3,000 pps: no source gets more than its own bucket, and the /24 together
//!   gets exactly the /24's bucket (burst + 3,000/s x t, within the testbed's timing tolerances,
//!   and within 5%); the counters say the /24's limit dropped the excess.
//! - A spoofed flood, every packet from a new random source, under a per-source limit (which
//!   such a flood walks past: every source has a full bucket) and a per-rule limit: the flood
//!   together gets exactly the rule's bucket, while a polite known source under another rule
//!   loses nothing.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    thread,
    time::Duration,
};

use ratelimit_testbed::{
    add_addr,
    agent_proc::rule_packets,
    assert_limited, ifindex, mac_bytes, neigh_to_peer,
    packet::{eth, from_hex, PINNED_MACS},
    require_root, send_udp_from, veth_pair, AgentProcess, Netns, RawSocket, Receiver, SendReport,
};
use serde_json::Value;

const DURATION: Duration = Duration::from_secs(3);
const PAYLOAD: usize = 64;

/// The per-limit report (`limits[k]`, 1-based `limit` k + 1) of rule `name` in `stats --json`.
fn limit_dropped(stats: &Value, name: &str, limit: usize) -> u64 {
    let rule = stats["rules"]
        .as_array()
        .and_then(|rules| rules.iter().find(|r| r["name"] == name))
        .unwrap_or_else(|| panic!("no rule {name:?} in {stats}"));
    let l = &rule["limits"][limit - 1];
    assert_eq!(l["limit"], limit, "{rule}");
    l["dropped_rate"]
        .as_u64()
        .unwrap_or_else(|| panic!("{rule}"))
}

/// The sends of several senders as one (first to last packet of any of them).
fn combined(reports: &[SendReport]) -> SendReport {
    SendReport {
        sent: reports.iter().map(|r| r.sent).sum(),
        skipped: reports.iter().map(|r| r.skipped).sum(),
        errors: reports.iter().map(|r| r.errors).sum(),
        sender: 0,
        first: reports.iter().map(|r| r.first).min().unwrap(),
        last: reports.iter().map(|r| r.last).max().unwrap(),
    }
}

#[test]
#[expect(clippy::cast_precision_loss, reason = "packet counts far below 2^52")]
fn five_sources_of_a_24_get_their_own_limit_and_together_the_24s() {
    const SRC_RATE: u64 = 1000;
    const SRC_BURST: u64 = 100;
    const NET_RATE: u64 = 3000;
    const NET_BURST: u64 = 300;
    const PPS: u64 = 2000;
    require_root();
    let tx = Netns::new("rl-e2e-lim24-tx").unwrap();
    let rx = Netns::new("rl-e2e-lim24-rx").unwrap();
    let (tx_if, rx_if) = veth_pair(&tx, &rx, "l4").unwrap();
    let sources: Vec<IpAddr> = (1..=5)
        .map(|i| format!("198.18.20.{i}").parse().unwrap())
        .collect();
    for s in &sources {
        add_addr(&tx, &tx_if, &format!("{s}/24")).unwrap();
    }
    let dst_ip: IpAddr = "198.18.20.254".parse().unwrap();
    add_addr(&rx, &rx_if, "198.18.20.254/24").unwrap();
    neigh_to_peer(&tx, &tx_if, dst_ip, &rx, &rx_if).unwrap();
    let config = format!(
        "[agent]\ninterfaces = [\"{rx_if}\"]\n\n\
         [[rule]]\nname = \"web\"\nsource = \"198.18.20.0/24\"\nrate = {SRC_RATE}\nburst = {SRC_BURST}\n\
         [[rule.limit]]\nper = \"/24\"\nrate = {NET_RATE}\nburst = {NET_BURST}\n"
    );
    let agent = AgentProcess::start(&rx, &config, &[]).unwrap();
    let receiver = Receiver::bind(&rx, SocketAddr::new(dst_ip, 0)).unwrap();
    let dst = receiver.local_addr();
    let reports: Vec<SendReport> = thread::scope(|s| {
        let handles: Vec<_> = sources
            .iter()
            .map(|&src| {
                let tx = &tx;
                s.spawn(move || {
                    send_udp_from(tx, SocketAddr::new(src, 0), dst, PPS, DURATION, PAYLOAD).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    receiver.wait_idle(Duration::from_millis(300), Duration::from_secs(5));
    let stats = agent.stats();
    let got = receiver.stop().unwrap();
    assert_eq!(
        got.socket_drops,
        Some(0),
        "the receiver's socket overflowed"
    );
    let counts = got.counts();
    let mut total = 0;
    for (src, sent) in sources.iter().zip(&reports) {
        let n = counts.get(src).copied().unwrap_or(0);
        total += n;
        // Each source: at most its own bucket (the /24 keeps it well below).
        let t = (sent.last - sent.first).as_secs_f64();
        let own = SRC_BURST as f64 + SRC_RATE as f64 * (t + ratelimit_testbed::SKEW_SECS) + 1.0;
        println!(
            "{src}: sent {} ({:.0} pps), received {n} (its own bucket admits at most {own:.0})",
            sent.sent,
            sent.achieved_pps()
        );
        assert!(
            n as f64 <= own,
            "{src} got {n}, more than its own bucket {own:.0}"
        );
        assert!(n > 0, "{src} got nothing");
    }
    // The /24 together: exactly its bucket, and within 5% of burst + 3,000/s x t.
    let all = combined(&reports);
    assert_limited("the /24", &all, total, NET_RATE, NET_BURST);
    let t = (all.last - all.first).as_secs_f64();
    let want = NET_BURST as f64 + NET_RATE as f64 * t;
    let ratio = total as f64 / want;
    println!(
        "the /24: {total} of {want:.0} ({ratio:.4}); per second {:.0}",
        total as f64 / t
    );
    assert!(
        (0.95..=1.05).contains(&ratio),
        "the /24 got {ratio:.4} of its bucket"
    );
    // The agent's counters: the per-limit drops add up to the rule's; the /24's limit dropped
    // most (together the sources send 3.3 times its rate), and a source's own limit dropped at
    // most what that source sent beyond its own bucket. The /24's tokens go to whichever packet
    // comes first once each is due, so how they split between the sources depends on how their
    // paced sends interleave: one source can take up to its own limit's worth (and its own limit
    // then drops the rest of its packets) while another gets a few hundred.
    let passed = rule_packets(&stats, "web", "passed");
    let dropped = rule_packets(&stats, "web", "dropped_rate");
    let (by_own, by_net) = (
        limit_dropped(&stats, "web", 1),
        limit_dropped(&stats, "web", 2),
    );
    println!("agent: passed {passed}, dropped {dropped} (own limit {by_own}, the /24's {by_net})");
    assert_eq!(by_own + by_net, dropped);
    assert!(
        by_net > dropped / 2,
        "the /24's limit dropped only {by_net} of {dropped}"
    );
    let beyond_own: f64 = reports
        .iter()
        .map(|r| {
            let t = (r.last - r.first).as_secs_f64();
            let own = SRC_BURST as f64 + SRC_RATE as f64 * (t - ratelimit_testbed::SKEW_SECS);
            (r.sent as f64 - own).max(0.0)
        })
        .sum();
    assert!(
        by_own as f64 <= beyond_own,
        "own limits dropped {by_own}, more than the {beyond_own:.0} sent beyond them"
    );
    assert!(
        passed >= total,
        "agent passed {passed}, receiver got {total}"
    );
    assert_eq!(
        passed + dropped,
        all.sent,
        "the rule saw every datagram once"
    );
    assert!(agent.stop().unwrap().success());
}

/// An Ethernet frame with a UDP datagram from `src` to `dst`:9 (no UDP checksum, which IPv4
/// allows).
fn udp_frame(macs: ([u8; 6], [u8; 6]), src: Ipv4Addr, dst: Ipv4Addr) -> Vec<u8> {
    eth()
        .macs(macs.0, macs.1)
        .ipv4(src, dst)
        .udp(40000, 9)
        .data(&[0x5a; 32])
        .ipv4_checksum()
        .build()
}

/// `udp_frame` gives the bytes the function it replaced built by hand (at fa91d4f, for the first
/// and the last source of the flood): the test puts the same packets on the wire.
#[test]
fn udp_frames_are_the_bytes_they_were_built_by_hand() {
    let dst = Ipv4Addr::new(198, 18, 21, 254);
    assert_eq!(
        udp_frame(PINNED_MACS, Ipv4Addr::new(10, 99, 0, 1), dst),
        from_hex(concat!(
            "0266778899aa02112233445508004500003c000000004011943d0a630001c61215fe",
            "9c400009002800005a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a"
        ))
    );
    assert_eq!(
        udp_frame(PINNED_MACS, Ipv4Addr::new(10, 99, 255, 254), dst),
        from_hex(concat!(
            "0266778899aa02112233445508004500003c000000004011943f0a63fffec61215fe",
            "9c400009002800005a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a"
        ))
    );
}

#[test]
fn a_spoofed_flood_gets_the_rules_aggregate_while_a_polite_source_loses_nothing() {
    const RULE_RATE: u64 = 2000;
    const RULE_BURST: u64 = 200;
    const FLOOD_PPS: u64 = 10_000;
    const POLITE_PPS: u64 = 500;
    require_root();
    let tx = Netns::new("rl-e2e-limsp-tx").unwrap();
    let rx = Netns::new("rl-e2e-limsp-rx").unwrap();
    let (tx_if, rx_if) = veth_pair(&tx, &rx, "ls").unwrap();
    let polite: IpAddr = "198.18.21.1".parse().unwrap();
    let dst_ip: IpAddr = "198.18.21.254".parse().unwrap();
    add_addr(&tx, &tx_if, "198.18.21.1/24").unwrap();
    add_addr(&rx, &rx_if, "198.18.21.254/24").unwrap();
    neigh_to_peer(&tx, &tx_if, dst_ip, &rx, &rx_if).unwrap();
    // Per source 10 pps (a spoofed flood's sources each send a packet or two: never limited by
    // it), and the whole rule 2,000 pps.
    let config = format!(
        "[agent]\ninterfaces = [\"{rx_if}\"]\n\n\
         [[rule]]\nname = \"flood\"\nsource = \"10.99.0.0/16\"\nrate = 10\nburst = 10\n\
         [[rule.limit]]\nper = \"rule\"\nrate = {RULE_RATE}\nburst = {RULE_BURST}\n\n\
         [[rule]]\nname = \"polite\"\nsource = \"198.18.21.0/24\"\nrate = 1000\nburst = 1000\n"
    );
    let agent = AgentProcess::start(&rx, &config, &[]).unwrap();
    let receiver = Receiver::bind(&rx, SocketAddr::new(dst_ip, 0)).unwrap();
    let dst = receiver.local_addr();
    let macs = (
        mac_bytes(&tx, &tx_if).unwrap(),
        mac_bytes(&rx, &rx_if).unwrap(),
    );
    let raw = RawSocket::open_in(&tx, ifindex(&tx, &tx_if).unwrap(), macs.1).unwrap();
    // 65,536 frames, each from its own source of 10.99.0.0/16, in a shuffled order.
    let mut x = 0x9e37_79b9u32;
    let mut order: Vec<u16> = (0..=u16::MAX).collect();
    for i in (1..order.len()).rev() {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        order.swap(i, usize::try_from(x).unwrap() % (i + 1));
    }
    let frames: Vec<Vec<u8>> = order
        .iter()
        .map(|&i| {
            let [a, b] = i.to_be_bytes();
            udp_frame(
                macs,
                Ipv4Addr::new(10, 99, a, b),
                Ipv4Addr::new(198, 18, 21, 254),
            )
        })
        .collect();
    let (spoofed, nice) = thread::scope(|s| {
        let f = s.spawn(|| raw.send_paced(&frames, FLOOD_PPS, DURATION).unwrap());
        let p = s.spawn(|| {
            send_udp_from(
                &tx,
                SocketAddr::new(polite, 0),
                dst,
                POLITE_PPS,
                DURATION,
                PAYLOAD,
            )
            .unwrap()
        });
        (f.join().unwrap(), p.join().unwrap())
    });
    receiver.wait_idle(Duration::from_millis(300), Duration::from_secs(5));
    let stats = agent.stats();
    let got = receiver.stop().unwrap();
    let polite_got = got.counts().get(&polite).copied().unwrap_or(0);
    let passed = rule_packets(&stats, "flood", "passed");
    let dropped = rule_packets(&stats, "flood", "dropped_rate");
    println!(
        "spoofed flood: sent {} ({:.0} pps, {} errors) from {} sources; the rule passed {passed}, \
         dropped {dropped} (own limit {}, the rule's {}); polite sent {}, received {polite_got}",
        spoofed.sent,
        spoofed.achieved_pps(),
        spoofed.errors,
        frames.len(),
        limit_dropped(&stats, "flood", 1),
        limit_dropped(&stats, "flood", 2),
        nice.sent
    );
    assert_eq!(
        passed + dropped,
        spoofed.sent,
        "the rule saw every spoofed frame once"
    );
    // The flood together: exactly the rule's aggregate bucket.
    assert_limited("the spoofed flood", &spoofed, passed, RULE_RATE, RULE_BURST);
    assert_eq!(
        limit_dropped(&stats, "flood", 1),
        0,
        "a spoofed source hit its own limit"
    );
    assert_eq!(limit_dropped(&stats, "flood", 2), dropped);
    // The polite source, under another rule, lost nothing.
    assert_eq!(
        got.socket_drops,
        Some(0),
        "the receiver's socket overflowed"
    );
    assert_eq!(polite_got, nice.sent, "the polite source lost packets");
    assert_eq!(rule_packets(&stats, "polite", "dropped_rate"), 0);
    assert!(agent.stop().unwrap().success());
}

/// `rules add --limit` (written back, listed, a bad limit refused naming the key), then traffic:
/// `explain` shows the source's bucket under every limit, `top --limit 2` ranks the /24s,
/// `stats` says the /24's limit dropped the excess.
#[test]
fn limits_through_the_cli_add_list_explain_top_and_stats() {
    require_root();
    let tx = Netns::new("rl-e2e-limcli-tx").unwrap();
    let rx = Netns::new("rl-e2e-limcli-rx").unwrap();
    let (tx_if, rx_if) = veth_pair(&tx, &rx, "lc").unwrap();
    let sources: Vec<IpAddr> = (1..=3)
        .map(|i| format!("198.18.22.{i}").parse().unwrap())
        .collect();
    for s in &sources {
        add_addr(&tx, &tx_if, &format!("{s}/24")).unwrap();
    }
    let dst_ip: IpAddr = "198.18.22.254".parse().unwrap();
    add_addr(&rx, &rx_if, "198.18.22.254/24").unwrap();
    neigh_to_peer(&tx, &tx_if, dst_ip, &rx, &rx_if).unwrap();
    let config = format!(
        "[agent]\ninterfaces = [\"{rx_if}\"]\n\n\
         [[rule]]\nname = \"other\"\nsource = \"198.18.23.0/24\"\nrate = 10\n"
    );
    let agent = AgentProcess::start(&rx, &config, &[]).unwrap();
    // A limit without `per` is refused.
    let err = agent
        .cli_refused(&[
            "rules",
            "add",
            "--name",
            "bad",
            "--source",
            "10.0.0.0/8",
            "--rate",
            "1",
            "--limit",
            "rate=5",
        ])
        .stderr;
    assert!(err.contains("limit 2") && err.contains("per"), "{err}");
    // Each source's own limit (300/s, burst 300: 900 in the 2 s below) is above anything the /24
    // (150/s, burst 150: 450 in all) can let one source through, however unevenly the three
    // share it, so only the /24's limit can drop (with 100/s, a source that won most of the /24's
    // tokens was dropped by its own limit too: 2-26 packets in 4 of 8 runs).
    agent.cli_ok(&[
        "rules",
        "add",
        "--name",
        "web",
        "--source",
        "198.18.22.0/24",
        "--rate",
        "300",
        "--limit",
        "per=/24,rate=150,burst=150",
    ]);
    let file = std::fs::read_to_string(agent.config_path()).unwrap();
    assert!(
        file.contains("[[rule.limit]]\nper = \"/24\"\nrate = 150\n"),
        "{file}"
    );
    let list = agent.cli_json(&["rules", "list"]);
    let web = list["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "web")
        .unwrap_or_else(|| panic!("{list}"));
    assert_eq!(web["limit"][0]["per"], "/24", "{list}");

    let receiver = Receiver::bind(&rx, SocketAddr::new(dst_ip, 0)).unwrap();
    let dst = receiver.local_addr();
    let top = thread::scope(|s| {
        for &src in &sources {
            let tx = &tx;
            s.spawn(move || {
                send_udp_from(
                    tx,
                    SocketAddr::new(src, 0),
                    dst,
                    200,
                    Duration::from_secs(2),
                    PAYLOAD,
                )
                .unwrap()
            });
        }
        thread::sleep(Duration::from_millis(500));
        agent.cli_json(&["top", "-n", "5", "--interval-ms", "500", "--limit", "2"])
    });
    let entries = top["top"].as_array().unwrap();
    assert_eq!(entries.len(), 1, "one /24 bucket: {top}");
    assert_eq!(entries[0]["limit"], 2, "{top}");
    assert_eq!(entries[0]["source"], "198.18.22.0/24", "{top}");
    assert_eq!(entries[0]["rule"], "web", "{top}");
    let all = agent.cli_json(&["top", "-n", "10", "--interval-ms", "200"]);
    println!("top --limit 2: {top}\ntop: {all}");

    let explain = agent.cli_json(&["explain", "198.18.22.1"]);
    let limits = explain["limits"].as_array().unwrap();
    assert_eq!(limits.len(), 2, "{explain}");
    assert_eq!(limits[0]["per"], "source");
    assert_eq!(limits[0]["key"], "198.18.22.1/32");
    assert_eq!(limits[1]["per"], "/24");
    assert_eq!(limits[1]["key"], "198.18.22.0/24");
    assert!(
        limits[0]["bucket"]["passed"].as_u64().unwrap() > 0,
        "{explain}"
    );
    assert!(
        limits[1]["bucket"]["passed"].as_u64().unwrap()
            > limits[0]["bucket"]["passed"].as_u64().unwrap(),
        "the /24's bucket counts all three sources: {explain}"
    );
    let table = agent.cli_ok(&["explain", "198.18.22.1"]);
    assert!(
        table.contains("limit 2 (per /24, bucket 198.18.22.0/24)"),
        "{table}"
    );
    let stats = agent.stats();
    assert!(limit_dropped(&stats, "web", 2) > 0, "{stats}");
    assert_eq!(limit_dropped(&stats, "web", 1), 0, "{stats}");
    drop(receiver);
    assert!(agent.stop().unwrap().success());
}
