//! The Prometheus endpoint of the real `ratelimit agent`, end to end: real packets over a veth
//! pair, then a plain HTTP scrape of `/metrics` from inside the agent's namespace (its
//! `127.0.0.1` is the namespace's own loopback). The scrape must show exactly what the receiver
//! saw and what `ratelimit stats` reports, count good and refused reloads, keep the rules working
//! after a refused reload; and a taken address must neither stop the agent nor its enforcement.

use std::fs;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::thread;
use std::time::{Duration, Instant};

use ratelimit_testbed::agent_proc::rule_packets;
use ratelimit_testbed::{
    add_addr, in_netns, neigh_to_peer, require_root, send_udp_from, veth_pair, AgentProcess, Netns,
    Receiver,
};

const SOURCE: &str = "198.18.0.1";
const RECEIVER: &str = "198.18.0.254";
/// The rule: packets per second and burst per source. One token a second, so the ~100 ms bursts
/// below get exactly `BURST` through (plus one token per second the test has been waiting).
const RATE: u64 = 1;
const BURST: u64 = 100;
const MAX_BUCKETS: u64 = 4096;
/// Each burst: 300 packets in 100 ms.
const BURST_PPS: u64 = 3000;
const BURST_TIME: Duration = Duration::from_millis(100);
const PAYLOAD: usize = 64;
/// How long the agent's 250 ms config watcher may take to notice a change.
const RELOAD_TIMEOUT: Duration = Duration::from_secs(5);
const RULE: &str = "metrics";
/// Where the test's control sockets live.
const SOCKET_DIR: &str = "/run/ratelimit-test";

/// Pin directory and control socket of one test, removed (if anything is left) on drop.
struct Paths {
    pin: PathBuf,
    socket: PathBuf,
}

impl Paths {
    fn new(tag: &str) -> Paths {
        fs::create_dir_all(SOCKET_DIR).unwrap();
        let pid = std::process::id();
        Paths {
            pin: PathBuf::from(format!("/sys/fs/bpf/rl-metrics-{pid}-{tag}")),
            socket: PathBuf::from(format!("{SOCKET_DIR}/metrics-{pid}-{tag}.sock")),
        }
    }
}

impl Drop for Paths {
    fn drop(&mut self) {
        if self.pin.exists() {
            let _ = ratelimit::dataplane::remove_pin_dir(&self.pin);
        }
        let _ = fs::remove_file(&self.socket);
        // Only if empty: another test may be using it.
        let _ = fs::remove_dir(SOCKET_DIR);
    }
}

fn config(paths: &Paths, iface: &str, metrics: SocketAddr) -> String {
    format!(
        r#"[agent]
interfaces = ["{iface}"]
mode = "auto"
pin_path = "{}"
socket = "{}"
metrics = "{metrics}"
max_buckets = {MAX_BUCKETS}

[[rule]]
name = "{RULE}"
source = "{SOURCE}/32"
rate = {RATE}
burst = {BURST}
per = "source"
"#,
        paths.pin.display(),
        paths.socket.display(),
    )
}

/// A port nothing listens on in `ns` (a fresh namespace: any, but ask the kernel anyway).
fn free_port(ns: &Netns) -> u16 {
    in_netns(ns, || {
        TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
    })
    .unwrap()
}

/// `GET /metrics` at `addr` in `ns` over plain HTTP/1.1; checks the status and content type and
/// returns the body.
/// Encoded after the call (see `ratelimit_testbed::metrics::fresh`).
fn scrape(ns: &Netns, addr: SocketAddr) -> String {
    let response = ratelimit_testbed::metrics::get(ns, addr)
        .unwrap_or_else(|e| panic!("scraping http://{addr}/metrics in {}: {e}", ns.name()));
    let (head, body) = response
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("not an HTTP response: {response:?}"));
    assert!(
        head.starts_with("HTTP/1.1 200"),
        "scrape failed:\n{response}"
    );
    assert!(
        head.lines().any(|l| {
            let l = l.to_ascii_lowercase();
            l.starts_with("content-type:") && l.contains("application/openmetrics-text")
        }),
        "unexpected content type:\n{head}"
    );
    assert!(body.ends_with("# EOF\n"), "truncated scrape:\n{body}");
    body.to_owned()
}

/// The value of the sample `series` (name with its labels as encoded, e.g.
/// `ratelimit_reloads_total{result="ok"}`) in a scrape.
fn sample(text: &str, series: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map(|v| {
            v.trim()
                .parse()
                .unwrap_or_else(|e| panic!("{series} = {v:?}: {e}"))
        })
}

/// [`sample`] that must be there.
fn value(text: &str, series: &str) -> u64 {
    sample(text, series).unwrap_or_else(|| panic!("no {series} in the scrape:\n{text}"))
}

fn rule_series(verdict: &str) -> String {
    format!(r#"ratelimit_rule_packets_total{{rule="{RULE}",verdict="{verdict}"}}"#)
}

/// Scrapes until `series` reaches `want` (the config watcher works on its own time).
fn wait_for(ns: &Netns, addr: SocketAddr, series: &str, want: u64, agent: &AgentProcess) -> String {
    let deadline = Instant::now() + RELOAD_TIMEOUT;
    loop {
        let text = scrape(ns, addr);
        if sample(&text, series) == Some(want) {
            return text;
        }
        assert!(
            Instant::now() < deadline,
            "{series} did not reach {want} within {RELOAD_TIMEOUT:?}; scrape:\n{text}\nagent log:\n{}",
            agent.log()
        );
        thread::sleep(Duration::from_millis(100));
    }
}

#[test]
#[expect(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "small positive times"
)]
fn scrape_matches_the_packets_sent() {
    require_root();
    let tx = Netns::new("rl-e2e-met-tx").unwrap();
    let rx = Netns::new("rl-e2e-met-rx").unwrap();
    let (tx_if, rx_if) = veth_pair(&tx, &rx, "mt").unwrap();
    add_addr(&tx, &tx_if, &format!("{SOURCE}/24")).unwrap();
    add_addr(&rx, &rx_if, &format!("{RECEIVER}/24")).unwrap();
    neigh_to_peer(&tx, &tx_if, RECEIVER.parse().unwrap(), &rx, &rx_if).unwrap();

    let paths = Paths::new("scrape");
    let addr = SocketAddr::from(([127, 0, 0, 1], free_port(&rx)));
    let agent = AgentProcess::start(&rx, &config(&paths, &rx_if, addr), &[]).unwrap();
    assert_eq!(agent.pin_path(), paths.pin);

    // Before any traffic: the endpoint is up, the rule is there with nothing counted.
    let text = scrape(&rx, addr);
    println!("first scrape:\n{text}");
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(
        value(
            &text,
            &format!(r#"ratelimit_build_info{{version="{version}"}}"#)
        ),
        1
    );
    assert_eq!(
        value(
            &text,
            &format!(r#"ratelimit_interface_attached{{interface="{rx_if}",mode="native"}}"#)
        ),
        1
    );
    assert_eq!(value(&text, &rule_series("passed")), 0);
    assert_eq!(value(&text, "ratelimit_buckets_capacity"), MAX_BUCKETS);
    assert_eq!(value(&text, r#"ratelimit_reloads_total{result="ok"}"#), 0);
    assert_eq!(
        value(&text, r#"ratelimit_reloads_total{result="failed"}"#),
        0
    );
    let rx_before = value(
        &text,
        &format!(r#"ratelimit_interface_rx_packets_total{{interface="{rx_if}"}}"#),
    );

    // 300 packets in 100 ms from one source against a burst of 100.
    let src = SocketAddr::new(SOURCE.parse().unwrap(), 0);
    let source: IpAddr = SOURCE.parse().unwrap();
    let receiver = Receiver::bind(&rx, SocketAddr::new(RECEIVER.parse().unwrap(), 0)).unwrap();
    let first_burst = Instant::now();
    let sent = send_udp_from(
        &tx,
        src,
        receiver.local_addr(),
        BURST_PPS,
        BURST_TIME,
        PAYLOAD,
    )
    .unwrap();
    receiver.wait_idle(Duration::from_millis(300), Duration::from_secs(5));
    let received = receiver.counts().get(&source).copied().unwrap_or(0);
    let text = scrape(&rx, addr);
    let stats = agent.stats();
    let (passed, dropped) = (
        value(&text, &rule_series("passed")),
        value(&text, &rule_series("dropped_rate")),
    );
    let t = (sent.last - sent.first).as_secs_f64();
    println!(
        "burst 1: sent {} in {t:.3} s ({} skipped, {} errors), received {received}; scrape: passed \
         {passed} dropped_rate {dropped}",
        sent.sent, sent.skipped, sent.errors
    );
    assert!(
        sent.sent >= 200,
        "sent only {} packets: too few to exceed the burst",
        sent.sent
    );
    assert_eq!(
        passed, received,
        "scrape's passed against what the receiver got"
    );
    assert_eq!(
        passed + dropped,
        sent.sent,
        "scrape's passed + dropped_rate against what was sent"
    );
    let refill = (t * RATE as f64).ceil() as u64;
    assert!(
        (BURST..=BURST + refill).contains(&passed),
        "passed {passed}: want the burst of {BURST} (+ {refill} refilled in {t:.3} s)"
    );
    // The same numbers `ratelimit stats` reads.
    assert_eq!(passed, rule_packets(&stats, RULE, "passed"));
    assert_eq!(dropped, rule_packets(&stats, RULE, "dropped_rate"));
    for verdict in ["allowed", "dropped_bytes", "denied", "dry_run", "no_bucket"] {
        assert_eq!(value(&text, &rule_series(verdict)), 0, "verdict {verdict}");
    }
    // Each datagram is one frame: Ethernet (14), IPv4 (20) and UDP (8) headers and the payload.
    let frame_len = (14 + 20 + 8 + PAYLOAD) as u64;
    for (verdict, packets) in [("passed", passed), ("dropped_rate", dropped)] {
        assert_eq!(
            value(
                &text,
                &format!(r#"ratelimit_rule_bytes_total{{rule="{RULE}",verdict="{verdict}"}}"#)
            ),
            packets * frame_len,
            "bytes {verdict}"
        );
    }
    // Every frame the program saw is counted once: unparsed (not IP, or a parse failure other
    // than truncated_l4, which is still classified), matching no rule (the interfaces' own IPv6
    // neighbour discovery), or under the one rule, which only the test's datagrams match.
    let unparsed: u64 = [
        "truncated_eth",
        "bad_vlan",
        "truncated_ipv4",
        "bad_ipv4",
        "bad_ipv6",
    ]
    .iter()
    .map(|r| {
        value(
            &text,
            &format!(r#"ratelimit_parse_failures_total{{reason="{r}"}}"#),
        )
    })
    .sum::<u64>()
        + value(&text, "ratelimit_non_ip_packets_total");
    assert_eq!(
        value(&text, "ratelimit_packets_total"),
        sent.sent
            + unparsed
            + value(&text, "ratelimit_unmatched_packets_total")
            + value(&text, "ratelimit_internal_errors_total"),
        "packets_total against its parts"
    );
    assert_eq!(value(&text, "ratelimit_internal_errors_total"), 0);
    assert_eq!(
        value(&text, "ratelimit_buckets_tracked"),
        1,
        "one source, one bucket"
    );
    assert_eq!(value(&text, "ratelimit_new_buckets_total"), 1);
    assert_eq!(
        value(
            &text,
            r#"ratelimit_parse_failures_total{reason="bad_ipv4"}"#
        ),
        0
    );
    let rx_after = value(
        &text,
        &format!(r#"ratelimit_interface_rx_packets_total{{interface="{rx_if}"}}"#),
    );
    assert!(
        rx_after >= rx_before + passed,
        "rx_packets {rx_before} -> {rx_after}, passed {passed}"
    );

    // A good reload (a comment added: the file changed, the rules did not) counts as ok.
    let config_path = agent.config_path().to_owned();
    let good = fs::read_to_string(&config_path).unwrap();
    fs::write(&config_path, format!("{good}\n# touched by the test\n")).unwrap();
    wait_for(
        &rx,
        addr,
        r#"ratelimit_reloads_total{result="ok"}"#,
        1,
        &agent,
    );

    // A refused one counts as failed; the rules in force stay.
    fs::write(&config_path, "this is [not toml\n").unwrap();
    let text = wait_for(
        &rx,
        addr,
        r#"ratelimit_reloads_total{result="failed"}"#,
        1,
        &agent,
    );
    assert_eq!(value(&text, r#"ratelimit_reloads_total{result="ok"}"#), 1);

    // The rule still limits: the bucket was spent by the first burst and has refilled one token
    // a second since.
    let sent2 = send_udp_from(
        &tx,
        src,
        receiver.local_addr(),
        BURST_PPS,
        BURST_TIME,
        PAYLOAD,
    )
    .unwrap();
    let waited = first_burst.elapsed().as_secs_f64();
    receiver.wait_idle(Duration::from_millis(300), Duration::from_secs(5));
    let received2 = receiver.counts().get(&source).copied().unwrap_or(0) - received;
    let text = scrape(&rx, addr);
    let passed2 = value(&text, &rule_series("passed")) - passed;
    let dropped2 = value(&text, &rule_series("dropped_rate")) - dropped;
    println!(
        "burst 2 (after a refused reload, {waited:.1} s after the first): sent {}, received \
         {received2}; scrape: passed +{passed2} dropped_rate +{dropped2}",
        sent2.sent
    );
    assert_eq!(passed2, received2);
    assert_eq!(passed2 + dropped2, sent2.sent);
    assert!(
        passed2 <= (waited * RATE as f64).ceil() as u64 + 1,
        "passed {passed2} after a refused reload: the rule no longer limits"
    );
    assert_eq!(
        value(&text, "ratelimit_new_buckets_total"),
        1,
        "the bucket was kept"
    );
    assert_eq!(
        value(&text, r#"ratelimit_reloads_total{result="failed"}"#),
        1
    );
    drop(receiver.stop().unwrap());

    let status = agent.stop().unwrap();
    assert!(status.success(), "agent exited with {status}");
    assert!(!paths.pin.exists(), "{} left behind", paths.pin.display());
}

/// A metrics address taken by another process (anyone can bind an unprivileged port first) must
/// neither keep the limiter from starting nor take down what it enforces: the agent starts and
/// enforces, says loudly (log, `status`, `status --json`) that the endpoint is not serving and
/// why, and serves once the address is free. (It used to exit, removing every attachment and
/// pin, including state adopted from a previous agent.)
#[test]
#[expect(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "small positive times"
)]
fn metrics_address_in_use_does_not_stop_enforcement() {
    require_root();
    let tx = Netns::new("rl-e2e-metb-tx").unwrap();
    let rx = Netns::new("rl-e2e-metb-rx").unwrap();
    let (tx_if, rx_if) = veth_pair(&tx, &rx, "mb").unwrap();
    add_addr(&tx, &tx_if, &format!("{SOURCE}/24")).unwrap();
    add_addr(&rx, &rx_if, &format!("{RECEIVER}/24")).unwrap();
    neigh_to_peer(&tx, &tx_if, RECEIVER.parse().unwrap(), &rx, &rx_if).unwrap();
    let paths = Paths::new("bind");
    // Something else already listens on the address (in the agent's namespace).
    let taken = in_netns(&rx, || TcpListener::bind("127.0.0.1:0")).unwrap();
    let addr = taken.local_addr().unwrap();

    let mut agent = AgentProcess::start(&rx, &config(&paths, &rx_if, addr), &[]).unwrap();
    let log = agent.log();
    let line = log
        .lines()
        .find(|l| l.contains("NOT serving") && l.contains(&addr.to_string()))
        .unwrap_or_else(|| panic!("no error naming {addr} in the log:\n{log}"));
    assert!(line.to_ascii_lowercase().contains("in use"), "{line}");

    // Still running a moment later, and says why it serves no metrics.
    thread::sleep(Duration::from_millis(500));
    assert!(
        agent.is_running(),
        "agent exited with its metrics address taken; log:\n{}",
        agent.log()
    );
    let status = agent.cli_json(&["status"]);
    let metrics = &status["metrics"];
    println!("status --json metrics: {metrics}");
    assert_eq!(metrics["state"], "unbound", "{status}");
    assert_eq!(metrics["listen"], addr.to_string(), "{status}");
    let error = metrics["error"].as_str().unwrap_or_default();
    assert!(
        error.contains(&addr.to_string()) && error.to_ascii_lowercase().contains("in use"),
        "{error:?}"
    );
    assert!(
        metrics["bind_failures"].as_u64().unwrap_or(0) >= 1,
        "{status}"
    );
    let text = agent.cli_ok(&["status"]);
    println!("status:\n{text}");
    assert!(
        text.lines().any(|l| l.starts_with("metrics")
            && l.contains("NOT SERVING")
            && l.contains(&addr.to_string())),
        "{text}"
    );

    // Enforcing meanwhile: 300 packets in 100 ms against a burst of 100.
    let src = SocketAddr::new(SOURCE.parse().unwrap(), 0);
    let source: IpAddr = SOURCE.parse().unwrap();
    let receiver = Receiver::bind(&rx, SocketAddr::new(RECEIVER.parse().unwrap(), 0)).unwrap();
    let sent = send_udp_from(
        &tx,
        src,
        receiver.local_addr(),
        BURST_PPS,
        BURST_TIME,
        PAYLOAD,
    )
    .unwrap();
    receiver.wait_idle(Duration::from_millis(300), Duration::from_secs(5));
    let received = receiver.counts().get(&source).copied().unwrap_or(0);
    let t = (sent.last - sent.first).as_secs_f64();
    println!(
        "sent {} in {t:.3} s, received {received} (metrics address taken)",
        sent.sent
    );
    assert!(sent.sent >= 200, "sent only {} packets", sent.sent);
    let refill = 2 + (t * RATE as f64).ceil() as u64;
    assert!(
        (BURST..=BURST + refill).contains(&received),
        "received {received} of {}: want the burst of {BURST} (+ {refill}): not enforcing",
        sent.sent
    );
    let stats = agent.stats();
    assert_eq!(rule_packets(&stats, RULE, "passed"), received);

    // The address is freed: the endpoint binds it (retried in the background) and serves.
    drop(taken);
    let deadline = Instant::now() + Duration::from_secs(30);
    let text = loop {
        if let Some(text) = try_scrape(&rx, addr) {
            break text;
        }
        assert!(
            Instant::now() < deadline,
            "metrics never came up after the address was freed; log:\n{}",
            agent.log()
        );
        thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(value(&text, &rule_series("passed")), received);
    let status = agent.cli_json(&["status"]);
    assert_eq!(status["metrics"]["state"], "serving", "{status}");
    assert_eq!(
        status["metrics"]["error"],
        serde_json::Value::Null,
        "{status}"
    );
    drop(receiver.stop().unwrap());

    let status = agent.stop().unwrap();
    assert!(status.success(), "agent exited with {status}");
    assert!(!paths.pin.exists(), "{} left behind", paths.pin.display());
}

/// [`scrape`] that returns `None` instead of panicking when nothing answers at `addr`.
fn try_scrape(ns: &Netns, addr: SocketAddr) -> Option<String> {
    let up = in_netns(ns, || {
        Ok::<_, std::io::Error>(TcpStream::connect_timeout(&addr, Duration::from_secs(1)).is_ok())
    })
    .unwrap();
    up.then(|| scrape(ns, addr))
}
