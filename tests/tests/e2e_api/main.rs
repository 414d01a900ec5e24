//! The control API through its client, end to end: the real agent in a fresh namespace, the real
//! `ratelimit` CLI talking to it over its Unix socket, and real UDP over a veth pair. A rule added
//! with `ratelimit rules add` must limit packets as soon as the command returns, show in `rules
//! list` and in the config file, and stop limiting once removed; a refused change must name the
//! field at fault and leave the rules (and the packets) exactly as they were; `status`, `explain`
//! and `top` must describe what the packets see; `detach` must take XDP off the interface, also
//! for an agent that was killed; and a CLI with no agent to talk to must say how to start one.

use std::fs;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::thread;
use std::time::Duration;

use ratelimit_testbed::agent_proc::xdp_attachment;
use ratelimit_testbed::{
    add_addr, assert_limited, neigh_to_peer, require_root, send_udp_from, veth_pair, AgentProcess,
    Netns, ReceiveReport, Receiver, SendReport,
};
use serde_json::Value;

mod lifecycle;
mod outputs;

const PAYLOAD: usize = 64;
const RECEIVER: &str = "198.18.0.254";
const FLOODER: &str = "198.18.0.1";
const POLITE: &str = "198.18.0.2";
/// How long a refused agent may take to exit (a hang guard, not a speed test).
const EXIT_TIMEOUT: Duration = Duration::from_secs(10);

/// Two namespaces joined by a veth pair: `tx` holds 198.18.0.1 and .2, `rx` the receiver
/// 198.18.0.254 and the agent.
struct Bed {
    tx: Netns,
    rx: Netns,
    rx_if: String,
}

fn bed(tag: &str) -> Bed {
    require_root();
    let tx = Netns::new(&format!("rl-api-{tag}-tx")).unwrap();
    let rx = Netns::new(&format!("rl-api-{tag}-rx")).unwrap();
    let (tx_if, rx_if) = veth_pair(&tx, &rx, "api").unwrap();
    for src in [FLOODER, POLITE] {
        add_addr(&tx, &tx_if, &format!("{src}/24")).unwrap();
    }
    add_addr(&rx, &rx_if, &format!("{RECEIVER}/24")).unwrap();
    neigh_to_peer(&tx, &tx_if, RECEIVER.parse().unwrap(), &rx, &rx_if).unwrap();
    Bed { tx, rx, rx_if }
}

impl Bed {
    fn receiver(&self) -> Receiver {
        Receiver::bind(&self.rx, SocketAddr::new(RECEIVER.parse().unwrap(), 0)).unwrap()
    }

    /// Sends `pps` x `duration` datagrams from `src` to a fresh receiver; returns what was sent
    /// and how many arrived.
    fn flood(&self, src: &str, pps: u64, duration: Duration) -> (SendReport, u64) {
        let receiver = self.receiver();
        let sent = send(&self.tx, src, &receiver, pps, duration);
        let report = finish(receiver);
        (sent, received(&report, src))
    }

    fn xdp(&self) -> Option<(String, String)> {
        xdp_attachment(&self.rx, &self.rx_if).unwrap()
    }
}

fn send(tx: &Netns, src: &str, receiver: &Receiver, pps: u64, duration: Duration) -> SendReport {
    let src = SocketAddr::new(src.parse().unwrap(), 0);
    send_udp_from(tx, src, receiver.local_addr(), pps, duration, PAYLOAD).unwrap()
}

/// Waits for stragglers, stops the receiver and checks it dropped nothing itself.
fn finish(receiver: Receiver) -> ReceiveReport {
    receiver.wait_idle(Duration::from_millis(200), Duration::from_secs(5));
    let report = receiver.stop().unwrap();
    assert_eq!(report.socket_drops, Some(0), "receiver socket overflowed");
    report
}

fn received(report: &ReceiveReport, src: &str) -> u64 {
    let ip: IpAddr = src.parse().unwrap();
    report.counts().get(&ip).copied().unwrap_or(0)
}

/// Runs the CLI, asserts it failed and printed nothing on stdout, returns its stderr.
fn refused(agent: &AgentProcess, args: &[&str]) -> String {
    let out = agent.cli_refused(args);
    assert!(
        out.stdout.is_empty(),
        "a refused command printed {:?}",
        out.stdout
    );
    out.stderr
}

fn config(rx_if: &str, rules: &str) -> String {
    format!("[agent]\ninterfaces = [\"{rx_if}\"]\nmode = \"auto\"\n\n{rules}")
}

/// An unrelated rule, so that the rule set is never empty.
const OTHER_RULE: &str = "[[rule]]\nname = \"other\"\nsource = \"2001:db8::/32\"\nrate = 1000\n";

fn rule_names(list: &Value) -> Vec<String> {
    list["rules"]
        .as_array()
        .expect("rules array")
        .iter()
        .map(|r| r["name"].as_str().unwrap().to_owned())
        .collect()
}

fn assert_unlimited(what: &str, sent: &SendReport, got: u64) {
    println!("{what}: sent {}, received {got}", sent.sent);
    assert_eq!(got, sent.sent, "{what}: packets were dropped");
}

/// Removes a directory tree on drop (the socket directory a test made the agent create).
pub(crate) struct RemoveDir(pub(crate) PathBuf);

impl Drop for RemoveDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn rules_in_file(agent: &AgentProcess) -> Vec<ratelimit::config::RuleConfig> {
    ratelimit::config::Config::load(agent.config_path())
        .unwrap_or_else(|e| panic!("config file after the change: {e}"))
        .rules
}

#[test]
fn rules_added_are_enforced_listed_and_written_refused_ones_change_nothing_removed_ones_lift() {
    let bed = bed("rules");
    let agent = AgentProcess::start(&bed.rx, &config(&bed.rx_if, OTHER_RULE), &[]).unwrap();
    let second = Duration::from_millis(1500);

    let (sent, got) = bed.flood(FLOODER, 2000, second);
    assert_unlimited("before any rule", &sent, got);

    let out = agent.cli_ok(&[
        "rules",
        "add",
        "--name",
        "flood",
        "--source",
        "198.18.0.0/24",
        "--rate",
        "200",
        "--burst",
        "50",
    ]);
    assert_eq!(out, "added rule \"flood\" (2 rules in force)\n");
    // In force as soon as the command returns.
    let (sent, got) = bed.flood(FLOODER, 2000, second);
    assert_limited("after rules add", &sent, got, 200, 50);
    // Every packet the flooder sent under the rule and did not arrive was dropped for its rate.
    let mut dropped_sent = sent.sent - got;

    let list = agent.cli_json(&["rules", "list"]);
    let flood = list["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == "flood")
        .cloned();
    assert_eq!(
        flood,
        Some(serde_json::json!({
            "name": "flood", "source": "198.18.0.0/24", "action": "limit", "rate": 200, "burst": 50,
            "per": "source", "protocol": "any", "scope": "local", "dry_run": false,
        })),
        "{list}"
    );
    let in_file = rules_in_file(&agent);
    let names: Vec<&str> = in_file.iter().map(|r| r.name.as_str()).collect();
    assert_eq!(
        names,
        ["other", "flood"],
        "rules in {}",
        agent.config_path().display()
    );
    assert_eq!((in_file[1].rate, in_file[1].burst), (Some(200), Some(50)));
    let human = agent.cli_ok(&["rules", "list"]);
    assert!(
        human
            .lines()
            .any(|l| l.starts_with("flood ") && l.contains("198.18.0.0/24")),
        "{human}"
    );

    // Refused changes: the message names the field, the exit status is non-zero, and the rules
    // in force, the file and the packets stay as they were.
    let file_before = fs::read_to_string(agent.config_path()).unwrap();
    let cases: [(&[&str], &str); 7] = [
        (
            &["--name", "dns", "--source", "198.18.0.0/25", "--rate", "5", "--dst-port", "53"],
            "error: rule \"dns\": field `dst_port`: only valid with protocol tcp or udp (this rule has protocol any)",
        ),
        (
            &["--name", "bad", "--source", "198.18.0.300/24", "--rate", "5"],
            "error: rule \"bad\": field `source`: \"198.18.0.300/24\" is not an IPv4 or IPv6 CIDR",
        ),
        (&["--name", "bad", "--source", "198.18.0.0/24", "--rate", "5", "--per", "/40"], "error: rule \"bad\": field `per`: /40 is longer than an IPv4 address"),
        (&["--name", "flood", "--source", "198.18.1.0/24", "--rate", "5"], "error: a rule named \"flood\" already exists"),
        (&["--name", "twin", "--source", "198.18.0.0/24", "--rate", "5"], "both match source 198.18.0.0/24, protocol any: one of them would never apply"),
        // A cluster budget, on the rule or on one of its limits, in an agent without [cluster]:
        // the file it would be written to would be invalid.
        (&["--name", "shared", "--source", "198.18.1.0/24", "--rate", "5", "--scope", "cluster"], "rule \"shared\": field `scope`: scope = \"cluster\" needs a [cluster] table"),
        (&["--name", "shared", "--source", "198.18.1.0/24", "--rate", "5", "--limit", "per=/28,rate=20", "--limit", "per=rule,rate=50,scope=cluster"], "rule \"shared\" limit 3 ([[rule.limit]] #2): field `scope`: scope = \"cluster\" needs a [cluster] table"),
    ];
    for (args, want) in cases {
        let mut full = vec!["rules", "add"];
        full.extend_from_slice(args);
        let stderr = refused(&agent, &full);
        assert!(
            stderr.contains(want),
            "`{}`: stderr {stderr:?}, want {want:?}",
            full.join(" ")
        );
        println!("refused as expected: {}", stderr.trim());
    }
    assert_eq!(
        agent.cli_json(&["rules", "list"]),
        list,
        "a refused change altered the rules in force"
    );
    assert_eq!(
        fs::read_to_string(agent.config_path()).unwrap(),
        file_before,
        "a refused change altered the file"
    );
    let (sent, got) = bed.flood(FLOODER, 2000, second);
    assert_limited("after the refused changes", &sent, got, 200, 50);
    dropped_sent += sent.sent - got;

    // The API's counters saw the drops, as the pinned maps did.
    let stats = agent.cli_json(&["stats"]);
    let dropped = |s: &Value| {
        s["rules"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == "flood")
            .unwrap()["packets"]["dropped_rate"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(dropped(&stats), dropped_sent, "{stats}");
    assert_eq!(
        dropped(&stats),
        dropped(&agent.stats()),
        "API and pinned maps disagree"
    );

    assert_eq!(
        agent.cli_ok(&["rules", "remove", "flood"]),
        "removed rule \"flood\" (1 rule in force)\n"
    );
    assert_eq!(rule_names(&agent.cli_json(&["rules", "list"])), ["other"]);
    let names: Vec<String> = rules_in_file(&agent).into_iter().map(|r| r.name).collect();
    assert_eq!(names, ["other"]);
    let (sent, got) = bed.flood(FLOODER, 2000, second);
    assert_unlimited("after rules remove", &sent, got);
    let stderr = refused(&agent, &["rules", "remove", "flood"]);
    assert_eq!(stderr, "error: no rule named \"flood\"\n");

    let status = agent.stop().unwrap();
    assert!(status.success(), "agent exited with {status}");
    assert_eq!(bed.xdp(), None);
}

#[test]
fn status_explain_and_top_describe_what_the_packets_see() {
    let bed = bed("info");
    let rules = "[[rule]]\nname = \"flood\"\nsource = \"198.18.0.0/24\"\nrate = 300\nburst = 100\n\n\
                 [[rule]]\nname = \"dns\"\nsource = \"198.18.0.0/16\"\nprotocol = \"udp\"\ndst_port = 53\nrate = 50\n";
    let agent = AgentProcess::start(&bed.rx, &config(&bed.rx_if, rules), &[]).unwrap();

    let status = agent.cli_json(&["status"]);
    println!("status: {status}");
    assert_eq!(
        status["interfaces"],
        serde_json::json!([{"iface": bed.rx_if, "mode": "native", "state": "attached"}])
    );
    assert_eq!(
        (status["rules"].as_u64(), status["prefixes"].as_u64()),
        (Some(2), Some(2))
    );
    assert_eq!(
        status["socket"].as_str().map(PathBuf::from).as_deref(),
        Some(agent.socket_path())
    );
    assert_eq!(
        status["pin_path"].as_str().map(PathBuf::from).as_deref(),
        Some(agent.pin_path())
    );
    assert_eq!(
        status["config"].as_str().map(PathBuf::from).as_deref(),
        Some(agent.config_path())
    );
    assert_eq!(status["version"], env!("CARGO_PKG_VERSION"));
    assert!(status["pid"].as_u64().is_some_and(|p| p > 1), "{status}");
    assert_eq!(status["dry_run"], false);
    assert_eq!(status["buckets_tracked"], 0);
    assert!(status["buckets_capacity"].as_u64().is_some_and(|c| c > 0));
    assert_eq!(status["reloads"]["failed"], 0);
    assert!(status["uptime_secs"].is_u64() && status["generation"].is_u64());
    let human = agent.cli_ok(&["status"]);
    assert!(
        human.contains(&format!("{} (native)", bed.rx_if)),
        "{human}"
    );

    // Explain: the longest prefix wins; a /16 UDP rule matches outside the /24; nothing matches
    // outside both.
    let e = agent.cli_json(&["explain", FLOODER, "--protocol", "udp", "--dst-port", "53"]);
    assert_eq!(
        (e["rule"]["name"].as_str(), e["prefix"].as_str()),
        (Some("flood"), Some("198.18.0.0/24")),
        "{e}"
    );
    assert_eq!(e["bucket"], Value::Null, "no packet yet: {e}");
    let e = agent.cli_json(&[
        "explain",
        "198.18.7.7",
        "--protocol",
        "udp",
        "--dst-port",
        "53",
    ]);
    assert_eq!(
        (e["rule"]["name"].as_str(), e["prefix"].as_str()),
        (Some("dns"), Some("198.18.0.0/16")),
        "{e}"
    );
    assert_eq!(e["rule"]["config"]["dst_port"], 53);
    let e = agent.cli_json(&["explain", "198.18.7.7", "--protocol", "tcp"]);
    assert_eq!(e["rule"], Value::Null, "{e}");
    assert_eq!(e["candidates"], serde_json::json!(["dns"]));
    assert!(
        e["why"].as_str().unwrap().contains("none of which matches"),
        "{e}"
    );
    let e = agent.cli_json(&["explain", "203.0.113.9"]);
    assert_eq!(
        (e["rule"].clone(), e["prefix"].clone()),
        (Value::Null, Value::Null),
        "{e}"
    );
    let human = agent.cli_ok(&["explain", "203.0.113.9"]);
    assert!(
        human.contains("rule        none: the packet passes"),
        "{human}"
    );
    let stderr = refused(&agent, &["explain", "198.18.0.300"]);
    assert!(
        stderr.contains("ip: \"198.18.0.300\" is not an IPv4 or IPv6 address"),
        "{stderr}"
    );

    // Top and explain while one source floods at 10x its rate and another stays polite.
    let receiver = bed.receiver();
    let (top, top_human, explained, (flood, polite)) = thread::scope(|s| {
        let flood = s.spawn(|| send(&bed.tx, FLOODER, &receiver, 3000, Duration::from_secs(3)));
        let polite = s.spawn(|| send(&bed.tx, POLITE, &receiver, 50, Duration::from_secs(3)));
        thread::sleep(Duration::from_millis(700));
        let top = agent.cli_json(&["top", "-n", "5"]);
        let top_human = agent.cli_ok(&["top", "--interval-ms", "300"]);
        let explained = agent.cli_json(&["explain", FLOODER]);
        (
            top,
            top_human,
            explained,
            (flood.join().unwrap(), polite.join().unwrap()),
        )
    });
    let report = finish(receiver);
    println!(
        "top: {top}\n{top_human}flooder sent {} ({:.0} pps)",
        flood.sent,
        flood.achieved_pps()
    );
    assert_eq!(
        received(&report, POLITE),
        polite.sent,
        "the polite source lost packets"
    );
    assert!(
        flood.achieved_pps() > 1000.0,
        "the flooder managed only {:.0} pps",
        flood.achieved_pps()
    );
    assert_eq!(top["interval_ms"], 1000);
    let entries = top["top"].as_array().unwrap();
    assert_eq!(entries.len(), 2, "{top}");
    let first = &entries[0];
    assert_eq!(
        (first["rule"].as_str(), first["source"].as_str()),
        (Some("flood"), Some("198.18.0.1/32")),
        "{top}"
    );
    let pps = first["pps"].as_f64().unwrap();
    assert!(
        (225.0..=375.0).contains(&pps),
        "flooder passed {pps} pps, its rate is 300: {top}"
    );
    assert!(first["drops_per_sec"].as_f64().unwrap() > 300.0, "{top}");
    // The flood (3000 pps) takes each token within 1/3000 s of its refill (300/s): tokens pile
    // up only while the flooder is stalled; allowing a 100 ms stall, fewer than 1 + 30 (a bucket
    // that was not charged would show its burst, 100). `top` reads its clock before walking the
    // whole store, so its level can look up to (walk time x rate) below zero: no lower bound.
    assert!(first["tokens"].as_f64().unwrap() < 31.0, "{top}");
    assert!(first["dropped"].as_u64().unwrap() > 0);
    assert_eq!(entries[1]["source"], "198.18.0.2/32");
    assert_eq!(entries[1]["drops_per_sec"], 0.0, "{top}");
    assert!(
        top_human
            .lines()
            .nth(1)
            .is_some_and(|l| l.starts_with("flood  198.18.0.1/32")),
        "{top_human}"
    );

    assert_eq!(explained["rule"]["name"], "flood");
    let bucket = &explained["bucket"];
    assert!(
        bucket["dropped"].as_u64().unwrap() > 0 && bucket["passed"].as_u64().unwrap() > 0,
        "{explained}"
    );
    // As in `top`; `explain` reads its clock after the bucket, so the level is at most one
    // coarse-clock tick (4 ms x 300/s = 1.2 tokens) below what it was, never overdrawn beyond.
    assert!(
        (-1.2..31.0).contains(&bucket["tokens"].as_f64().unwrap()),
        "{explained}"
    );

    let status = agent.stop().unwrap();
    assert!(status.success(), "agent exited with {status}");
}
