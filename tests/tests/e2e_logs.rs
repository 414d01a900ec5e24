//! `--log-format json` (docs/operations.md, "Logs"): every line the agent writes to stderr is
//! one JSON object a log collector can parse, through start, reload, a refused reload and stop,
//! and when it refuses to start, the fatal error too.

use std::fs;
use std::thread;
use std::time::{Duration, Instant};

use ratelimit::dataplane::{ethtool_value, gro_enabled};
use ratelimit_testbed::{in_netns, require_root, veth_pair, AgentProcess, Netns};
use serde_json::Value;

const RULE: &str = "[[rule]]\nname = \"r\"\nsource = \"198.18.0.0/24\"\nrate = 100\n";

/// Parses every non-empty line of `log` as a JSON object with `level` and `fields.message`;
/// returns them.
fn records(log: &str) -> Vec<Value> {
    log.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let v: Value = serde_json::from_str(l)
                .unwrap_or_else(|e| panic!("a log line is not JSON ({e}): {l:?}\nlog:\n{log}"));
            assert!(
                v["level"].is_string() && v["fields"]["message"].is_string(),
                "a record without level or message: {l}"
            );
            v
        })
        .collect()
}

fn messages(log: &str) -> Vec<String> {
    records(log)
        .iter()
        .map(|r| r["fields"]["message"].as_str().unwrap().to_owned())
        .collect()
}

fn wait_for_message(agent: &AgentProcess, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !messages(&agent.log()).iter().any(|m| m.contains(what)) {
        assert!(
            Instant::now() < deadline,
            "no {what:?} in:\n{}",
            agent.log()
        );
        thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn every_line_of_a_json_log_is_a_json_record_from_start_to_stop() {
    require_root();
    let tx = Netns::new("rl-logs-tx").unwrap();
    let rx = Netns::new("rl-logs-rx").unwrap();
    let (_, rx_if) = veth_pair(&tx, &rx, "lg").unwrap();
    let config = format!("[agent]\ninterfaces = [\"{rx_if}\"]\n\n{RULE}");
    let agent = AgentProcess::spawn(&rx, &config, &["--log-format", "json"]).unwrap();
    wait_for_message(&agent, "running;");

    // A reload refused (invalid rule), then one applied.
    let text = fs::read_to_string(agent.config_path()).unwrap();
    let tmp = agent.config_path().with_extension("edit");
    fs::write(&tmp, text.replace("rate = 100", "rate = -1")).unwrap();
    fs::rename(&tmp, agent.config_path()).unwrap();
    wait_for_message(&agent, "reload refused");
    fs::write(&tmp, text.replace("rate = 100", "rate = 200")).unwrap();
    fs::rename(&tmp, agent.config_path()).unwrap();
    wait_for_message(&agent, "reloaded");

    let log_before_stop = agent.log();
    agent.stop().unwrap();
    let all = records(&log_before_stop);
    assert!(all.len() >= 5, "{log_before_stop}");
    assert!(
        all.iter().any(|r| r["level"] == "ERROR"),
        "{log_before_stop}"
    );
}

#[test]
fn a_refused_start_ends_with_a_json_error_record() {
    require_root();
    let tx = Netns::new("rl-logs2-tx").unwrap();
    let rx = Netns::new("rl-logs2-rx").unwrap();
    let (_, rx_if) = veth_pair(&tx, &rx, "lh").unwrap();
    let config = format!("[agent]\ninterfaces = [\"{rx_if}\", \"rl-nosuch9\"]\n\n{RULE}");
    let agent = AgentProcess::spawn(&rx, &config, &["--log-format", "json"]).unwrap();
    let (status, log) = agent.wait_exit(Duration::from_secs(20)).unwrap();
    assert!(!status.success(), "{log}");
    let all = records(&log);
    let last = all.last().expect("a record");
    assert_eq!(last["level"], "ERROR", "{log}");
    assert!(
        last["fields"]["error"]
            .as_str()
            .is_some_and(|e| e.contains("rl-nosuch9") && e.contains("does not exist")),
        "the fatal record does not say why: {last}"
    );
}

/// Turns GRO on `iface` (of the calling thread's namespace) on or off (`ETHTOOL_SGRO` of
/// linux/ethtool.h).
fn set_gro(iface: &str, on: bool) {
    const ETHTOOL_SGRO: u32 = 0x2c;
    if let Err(e) = ethtool_value(iface, ETHTOOL_SGRO, u32::from(on)) {
        panic!("ETHTOOL_SGRO {iface}: {e}");
    }
}

/// docs/design.md, Limitations: in skb (generic) mode the kernel runs the program after GRO, once per
/// merged buffer, so a packet limit counts what GRO merged as one packet. An attach in that mode
/// with GRO on says so in the log (it was silent); with GRO off it does not.
#[test]
fn an_skb_mode_attach_with_gro_on_warns_that_a_packet_limit_counts_merged_packets() {
    require_root();
    let tx = Netns::new("rl-logs3-tx").unwrap();
    let rx = Netns::new("rl-logs3-rx").unwrap();
    let (_, rx_if) = veth_pair(&tx, &rx, "lgr").unwrap();
    let config = format!("[agent]\ninterfaces = [\"{rx_if}\"]\nmode = \"skb\"\n\n{RULE}");
    let warned = |log: &str| messages(log).iter().any(|m| m.contains("GRO on"));

    in_netns(&rx, || set_gro(&rx_if, true));
    assert_eq!(in_netns(&rx, || gro_enabled(&rx_if)), Some(true));
    let agent = AgentProcess::spawn(&rx, &config, &["--log-format", "json"]).unwrap();
    wait_for_message(&agent, "running;");
    let log = agent.log();
    agent.stop().unwrap();
    assert!(
        warned(&log),
        "no GRO warning for an skb-mode attach with GRO on:\n{log}"
    );

    in_netns(&rx, || set_gro(&rx_if, false));
    assert_eq!(in_netns(&rx, || gro_enabled(&rx_if)), Some(false));
    let agent = AgentProcess::spawn(&rx, &config, &["--log-format", "json"]).unwrap();
    wait_for_message(&agent, "running;");
    let log = agent.log();
    agent.stop().unwrap();
    assert!(!warned(&log), "a GRO warning with GRO off:\n{log}");
}
