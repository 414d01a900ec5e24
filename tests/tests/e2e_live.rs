//! What changes while the agent runs, and what survives it, end to end: `interfaces` added to and
//! removed from the config file attach and detach the program (as the kernel reports it, and as
//! real packets see it); `ebpf_log` turns the XDP program's per-packet records on and off; an
//! agent killed with SIGKILL leaves its buckets to the next one, which adopts them with no gap in
//! enforcement; and `mode = "auto"` falls back to generic XDP on a device without native XDP.

use std::fs;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use ratelimit_testbed::agent_proc::{rule_packets, xdp_attachment};
use ratelimit_testbed::{
    add_addr, assert_limited, neigh_to_peer, require_root, send_udp_from, veth_pair, AgentProcess,
    Netns, ReceiveReport, Receiver, SendReport,
};
use serde_json::Value;

const PAYLOAD: usize = 64;

/// `tx` and `rx` joined by two veth pairs: link `a` carries 198.18.0.0/24 (sender .1, receiver
/// .254), link `b` 198.18.1.0/24 (sender .1, receiver .254). The agent runs in `rx`.
struct Bed {
    tx: Netns,
    rx: Netns,
    rx_a: String,
    rx_b: String,
}

const SRC_A: &str = "198.18.0.1";
const DST_A: &str = "198.18.0.254";
const SRC_B: &str = "198.18.1.1";
const DST_B: &str = "198.18.1.254";

fn bed(tag: &str) -> Bed {
    require_root();
    let tx = Netns::new(&format!("rl-live-{tag}-tx")).unwrap();
    let rx = Netns::new(&format!("rl-live-{tag}-rx")).unwrap();
    let (tx_a, rx_a) = veth_pair(&tx, &rx, "lva").unwrap();
    let (tx_b, rx_b) = veth_pair(&tx, &rx, "lvb").unwrap();
    for (tx_if, rx_if, src, dst) in [(&tx_a, &rx_a, SRC_A, DST_A), (&tx_b, &rx_b, SRC_B, DST_B)] {
        add_addr(&tx, tx_if, &format!("{src}/24")).unwrap();
        add_addr(&rx, rx_if, &format!("{dst}/24")).unwrap();
        neigh_to_peer(&tx, tx_if, dst.parse().unwrap(), &rx, rx_if).unwrap();
    }
    Bed { tx, rx, rx_a, rx_b }
}

impl Bed {
    /// Sends `pps` x `duration` datagrams from `src` to a fresh receiver at `dst`; returns what
    /// was sent and how many arrived.
    fn flood(&self, src: &str, dst: &str, pps: u64, duration: Duration) -> (SendReport, u64) {
        let receiver = Receiver::bind(&self.rx, SocketAddr::new(dst.parse().unwrap(), 0)).unwrap();
        let sent = send_udp_from(
            &self.tx,
            SocketAddr::new(src.parse().unwrap(), 0),
            receiver.local_addr(),
            pps,
            duration,
            PAYLOAD,
        )
        .unwrap();
        let report = finish(receiver);
        (sent, received(&report, src))
    }

    fn xdp(&self, iface: &str) -> Option<(String, String)> {
        xdp_attachment(&self.rx, iface).unwrap()
    }
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

/// `ratelimit --socket SOCKET args...`, asserted to succeed; its stdout.
fn assert_unlimited(what: &str, sent: &SendReport, got: u64) {
    println!("{what}: sent {}, received {got}", sent.sent);
    assert!(sent.sent > 0, "{what}: nothing sent");
    assert_eq!(got, sent.sent, "{what}: packets were dropped");
}

/// Replaces the config file whole (a new file renamed over it, as editors and config managers
/// do), so that the agent's watcher never reads half of it.
fn replace_config(path: &Path, text: &str) {
    let tmp = path.with_extension("new");
    fs::write(&tmp, text).unwrap();
    fs::rename(&tmp, path).unwrap();
}

/// The interfaces `status --json` lists, with their mode and state.
fn status_interfaces(agent: &AgentProcess) -> Vec<(String, String, String)> {
    let status = agent.cli_json(&["status"]);
    status["interfaces"]
        .as_array()
        .unwrap_or_else(|| panic!("no interfaces in status: {status}"))
        .iter()
        .map(|i| {
            let s = |k: &str| i[k].as_str().unwrap_or_default().to_owned();
            (s("iface"), s("mode"), s("state"))
        })
        .collect()
}

/// Polls `f` every 20 ms until it gives a value; fails after `timeout` (a hang guard).
fn wait_for<T>(what: &str, timeout: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: not within {timeout:?}");
        thread::sleep(Duration::from_millis(20));
    }
}

const RULE: &str = "[[rule]]\nname = \"r\"\nsource = \"198.18.0.0/15\"\nrate = 10\nburst = 5\n";

fn config_with(interfaces: &[&str], extra: &str) -> String {
    format!("[agent]\ninterfaces = {interfaces:?}\nmode = \"auto\"\n{extra}\n{RULE}")
}

/// `interfaces` changes live: an interface added to the config file gets the program (native,
/// as `ip link` shows it) and its packets are limited from the reload on; one removed from it
/// loses the program and its packets flow unlimited; the one left keeps enforcing throughout.
#[test]
fn interfaces_added_and_removed_in_the_config_attach_and_detach_live() {
    let bed = bed("ifs");
    let (a, b) = (bed.rx_a.as_str(), bed.rx_b.as_str());
    let native = Some(("native".to_owned(), "ratelimit".to_owned()));
    let agent = AgentProcess::start(&bed.rx, &config_with(&[a], ""), &[]).unwrap();
    // `start` inserted pin_path and socket after `[agent]`: later configs keep them.
    let head = fs::read_to_string(agent.config_path()).unwrap();
    let own_paths: String = head
        .lines()
        .skip(1)
        .take(2)
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(
        own_paths.contains("pin_path") && own_paths.contains("socket"),
        "{head}"
    );
    let config = |ifs: &[&str]| config_with(ifs, &own_paths);
    let reload = |ifs: &[&str]| {
        replace_config(agent.config_path(), &config(ifs));
        let answer = agent.cli_json(&["rules", "reload"]);
        assert_eq!(answer["reloaded"], true, "{answer}");
        assert_eq!(answer["restart_needed"], serde_json::json!([]), "{answer}");
    };

    assert_eq!(bed.xdp(a), native, "started on {a}");
    assert_eq!(bed.xdp(b), None, "{b} is not in the config");
    let (sent, got) = bed.flood(SRC_B, DST_B, 2000, Duration::from_millis(100));
    assert_unlimited("b before it is added", &sent, got);
    let (sent, got) = bed.flood(SRC_A, DST_A, 2000, Duration::from_millis(100));
    assert_limited("a from the start", &sent, got, 10, 5);

    reload(&[a, b]);
    assert_eq!(bed.xdp(b), native, "{b} added to the config, not attached");
    assert_eq!(bed.xdp(a), native);
    let listed = status_interfaces(&agent);
    assert!(
        listed.iter().any(|(i, m, _)| i == b && m == "native"),
        "status does not list {b}: {listed:?}"
    );
    let (sent, got) = bed.flood(SRC_B, DST_B, 2000, Duration::from_millis(100));
    assert_limited("b after it was added", &sent, got, 10, 5);

    reload(&[b]);
    assert_eq!(
        bed.xdp(a),
        None,
        "{a} removed from the config, still attached"
    );
    assert_eq!(bed.xdp(b), native);
    let listed = status_interfaces(&agent);
    assert!(
        listed.iter().all(|(i, _, _)| i != a),
        "status still lists {a}: {listed:?}"
    );
    let (sent, got) = bed.flood(SRC_A, DST_A, 2000, Duration::from_millis(100));
    assert_unlimited("a after it was removed", &sent, got);
    // b's bucket is the one from before (spent; 5 s to refill): what passes now is the refill.
    let before = rule_packets(&agent.stats(), "r", "passed");
    let (sent, got) = bed.flood(SRC_B, DST_B, 2000, Duration::from_millis(100));
    let after = rule_packets(&agent.stats(), "r", "passed");
    println!("b still enforced: sent {}, received {got}", sent.sent);
    assert!(
        got < sent.sent / 10,
        "b no longer limited: {got} of {}",
        sent.sent
    );
    assert_eq!(
        after - before,
        got,
        "the rule's passed counter is what arrived"
    );

    assert!(agent.stop().unwrap().success());
    assert_eq!(bed.xdp(a), None);
    assert_eq!(bed.xdp(b), None, "left attached after stop");
}

/// The XDP program's per-packet records in the agent's log (aya-log, shown at `RUST_LOG=debug`):
/// `src 198.18.0.1 proto 17 rule 0 verdict N`.
fn ebpf_records(log: &str, src: &str) -> usize {
    let needle = format!("src {src} proto 17 rule");
    log.lines().filter(|l| l.contains(&needle)).count()
}

/// `ebpf_log` changes live, both ways: off at start, no record for a packet; on after a reload,
/// one record per packet the program saw; off again, none for the packets after that.
#[test]
fn ebpf_log_turns_the_programs_records_on_and_off_live() {
    const PACKETS: u64 = 20;
    let bed = bed("log");
    let a = bed.rx_a.as_str();
    let agent = AgentProcess::start_logging(
        &bed.rx,
        &config_with(&[a], "ebpf_log = false"),
        &[],
        "debug",
    )
    .unwrap();
    let head = fs::read_to_string(agent.config_path()).unwrap();
    let own_paths: String = head
        .lines()
        .skip(1)
        .take(2)
        .map(|l| format!("{l}\n"))
        .collect();
    let reload = |on: bool| {
        let extra = format!("{own_paths}ebpf_log = {on}");
        replace_config(agent.config_path(), &config_with(&[a], &extra));
        let answer = agent.cli_json(&["rules", "reload"]);
        assert_eq!(answer["reloaded"], true, "{answer}");
        assert_eq!(answer["restart_needed"], serde_json::json!([]), "{answer}");
    };
    // 20 packets at 100/s: within the burst of 5 plus 10/s, some pass and some are dropped;
    // every one of them is a record when the log is on.
    let send = || {
        bed.flood(SRC_A, DST_A, 100, Duration::from_millis(200))
            .0
            .sent
    };

    let sent = send();
    assert_eq!(sent, PACKETS);
    thread::sleep(Duration::from_millis(500));
    assert_eq!(
        ebpf_records(&agent.log(), SRC_A),
        0,
        "records while ebpf_log is off"
    );

    reload(true);
    let sent = send();
    let records = wait_for("one record per packet", Duration::from_secs(10), || {
        let n = ebpf_records(&agent.log(), SRC_A);
        (n as u64 >= sent).then_some(n)
    });
    thread::sleep(Duration::from_millis(500));
    assert_eq!(
        ebpf_records(&agent.log(), SRC_A),
        records,
        "more records than packets"
    );
    assert_eq!(records as u64, sent, "one record per packet");

    reload(false);
    let sent = send();
    assert_eq!(sent, PACKETS);
    thread::sleep(Duration::from_millis(500));
    assert_eq!(
        ebpf_records(&agent.log(), SRC_A),
        records,
        "records after ebpf_log was turned off"
    );
    assert!(agent.stop().unwrap().success());
}

/// The socket of [`shared_agent_table`].
fn shared_socket(pin: &Path) -> std::path::PathBuf {
    std::env::temp_dir().join(format!(
        "{}.sock",
        pin.file_name().unwrap().to_string_lossy()
    ))
}

/// Removes a file when dropped.
struct RemoveOnDrop(std::path::PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.0);
    }
}

/// An `[agent]` table with its own pin path and socket, so two agents started with it share
/// both: the second adopts what the first pinned.
fn shared_agent_table(interfaces: &[&str], pin: &Path) -> String {
    let sock = shared_socket(pin);
    format!(
        "[agent]\ninterfaces = {interfaces:?}\npin_path = \"{}\"\nsocket = \"{}\"\nmode = \"auto\"\n\n",
        pin.display(),
        sock.display()
    )
}

/// An agent killed with SIGKILL while a source floods: the pinned program goes on dropping its
/// excess with no agent, and the next agent adopts the link and the bucket store as they are.
/// Over the whole flood, across the kill and the restart, the source gets one bucket's worth,
/// `burst + rate x t`: a new agent that started the source's bucket full again would let one
/// more burst through (50 here, against a tolerance of 6), one that detached or replaced the
/// program for a moment would let that moment's 2000/s through. The kill is synchronised on the
/// bucket's state (the source in debt, its packets being dropped), not on a sleep.
#[test]
fn a_killed_agents_buckets_are_adopted_by_the_next_with_no_gap() {
    const RATE: u64 = 100;
    const BURST: u64 = 50;
    const PPS: u64 = 2000;
    let bed = bed("kill");
    let a = bed.rx_a.as_str();
    let pin = AgentProcess::unique_pin_path();
    let config = format!(
        "{}[[rule]]\nname = \"r\"\nsource = \"198.18.0.0/24\"\nrate = {RATE}\nburst = {BURST}\n",
        shared_agent_table(&[a], &pin)
    );
    // A killed agent leaves its socket: removed even if the test fails before the second agent
    // stops (which removes it).
    let _socket = RemoveOnDrop(shared_socket(&pin));
    let mut first = AgentProcess::start(&bed.rx, &config, &[]).unwrap();
    let receiver = Receiver::bind(&bed.rx, SocketAddr::new(DST_A.parse().unwrap(), 0)).unwrap();
    let dropped = |agent: &AgentProcess| rule_packets(&agent.stats(), "r", "dropped_rate");

    let (sent, kept, second) = thread::scope(|s| {
        let sender = s.spawn(|| {
            send_udp_from(
                &bed.tx,
                SocketAddr::new(SRC_A.parse().unwrap(), 0),
                receiver.local_addr(),
                PPS,
                Duration::from_secs(3),
                PAYLOAD,
            )
            .unwrap()
        });
        // The source has spent its burst and is being dropped: its bucket is empty.
        wait_for("the source's bucket empty", Duration::from_secs(10), || {
            let explain = first.cli_json(&["explain", SRC_A]);
            let tokens = explain["bucket"]["tokens"].as_f64()?;
            (tokens < 1.0 && dropped(&first) > 0).then_some(())
        });
        let status = first.crash().unwrap();
        assert!(!status.success(), "SIGKILL: {status}");
        // With no agent, the pinned program keeps dropping the source's excess.
        let d0 = dropped(&first);
        wait_for("drops with no agent", Duration::from_secs(10), || {
            (dropped(&first) > d0 + 100).then_some(())
        });
        assert_eq!(
            bed.xdp(a),
            Some(("native".to_owned(), "ratelimit".to_owned()))
        );
        let (_, kept) = first.stop_keeping_pins().unwrap();
        let second = AgentProcess::start(&bed.rx, &config, &[]).unwrap();
        assert!(
            second.log().contains("adopted"),
            "the second agent did not adopt the pinned link: {}",
            second.log()
        );
        let sent = sender.join().unwrap();
        assert!(
            sent.last - sent.first > Duration::from_secs(2),
            "the flood ended before the second agent was up"
        );
        (sent, kept, second)
    });
    let got = received(&finish(receiver), SRC_A);
    assert_limited(
        "one flood across a SIGKILL and a restart",
        &sent,
        got,
        RATE,
        BURST,
    );
    // The counters are pinned too: they cover the whole flood, through both agents.
    let stats = second.stats();
    assert_eq!(rule_packets(&stats, "r", "passed"), got, "{stats}");
    assert_eq!(
        rule_packets(&stats, "r", "dropped_rate"),
        sent.sent - got,
        "{stats}"
    );
    assert!(second.stop().unwrap().success());
    assert!(!pin.exists(), "{} left behind", pin.display());
    assert_eq!(bed.xdp(a), None);
    drop(kept);
}

/// `mode = "auto"` tries native XDP and falls back to generic (skb) where the driver has none.
/// Every veth takes native XDP, so the agent here runs on a macvlan on top of one: macvlan has
/// no native XDP (no `ndo_bpf`; `mode = "native"` is refused on it, checked first), and packets
/// reach it through the veth. With `auto` the program is attached in skb mode, as `ip link` and
/// `status` report, and limits the source.
#[test]
fn auto_mode_falls_back_to_skb_where_native_xdp_is_refused() {
    const SRC: &str = "198.18.2.1";
    const DST: &str = "198.18.2.254";
    let bed = bed("auto");
    // The veth ends are named `lva…` in both namespaces; find tx's by its address.
    let tx_if = {
        let out = bed
            .tx
            .ip(&["-j", "addr", "show", "to", "198.18.0.1/32"])
            .unwrap();
        let v: Value = serde_json::from_str(&out).unwrap();
        v[0]["ifname"].as_str().unwrap().to_owned()
    };
    let mv = "mvl0";
    bed.rx
        .ip(&[
            "link", "add", "link", &bed.rx_a, "name", mv, "type", "macvlan", "mode", "bridge",
        ])
        .unwrap();
    bed.rx.ip(&["link", "set", mv, "up"]).unwrap();
    add_addr(&bed.rx, mv, &format!("{DST}/24")).unwrap();
    add_addr(&bed.tx, &tx_if, &format!("{SRC}/24")).unwrap();
    neigh_to_peer(&bed.tx, &tx_if, DST.parse().unwrap(), &bed.rx, mv).unwrap();
    let rule = "[[rule]]\nname = \"r\"\nsource = \"198.18.2.0/24\"\nrate = 10\nburst = 5\n";

    // The control: native XDP really is refused on this device.
    let native = format!("[agent]\ninterfaces = [\"{mv}\"]\nmode = \"native\"\n\n{rule}");
    let refused = AgentProcess::spawn(&bed.rx, &native, &[]).unwrap();
    let (status, log) = refused.wait_exit(Duration::from_secs(20)).unwrap();
    assert!(!status.success(), "native XDP attached to a macvlan: {log}");
    assert!(log.contains(mv) && log.contains("native"), "{log}");
    assert_eq!(bed.xdp(mv), None);

    let auto = format!("[agent]\ninterfaces = [\"{mv}\"]\nmode = \"auto\"\n\n{rule}");
    let agent = AgentProcess::start(&bed.rx, &auto, &[]).unwrap();
    assert_eq!(
        bed.xdp(mv),
        Some(("skb".to_owned(), "ratelimit".to_owned())),
        "auto on a device without native XDP"
    );
    let listed = status_interfaces(&agent);
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_eq!(
        (listed[0].0.as_str(), listed[0].1.as_str()),
        (mv, "skb"),
        "{listed:?}"
    );
    let (sent, got) = bed.flood(SRC, DST, 2000, Duration::from_millis(100));
    assert_limited("through the macvlan in skb mode", &sent, got, 10, 5);
    let stats = agent.stats();
    assert_eq!(rule_packets(&stats, "r", "passed"), got);
    assert_eq!(rule_packets(&stats, "r", "dropped_rate"), sent.sent - got);
    assert!(agent.stop().unwrap().success());
    assert_eq!(bed.xdp(mv), None);
}
