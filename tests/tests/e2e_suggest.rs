//! `ratelimit suggest` against a real agent: a population of sources of known rates (log-normal,
//! with a few heavy hitters), sent as raw UDP from as many source addresses, and the limit the
//! agent learns from what its buckets counted, with the heavy hitters named by address; the
//! history kept across a restart; a refused state file.
//!
//! The population's rule is in dry run: nothing is dropped, so what each source sends is what it
//! was given, and the suggestion is measured against the quantile of those rates.

use std::{
    collections::BTreeSet,
    net::Ipv4Addr,
    thread,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use ratelimit_testbed::{
    add_addr, ifindex, mac_bytes, packet::eth, require_root, veth_pair, AgentProcess, Netns,
    RawSocket,
};
use serde_json::Value;

/// Sending time: one full 10 s window of every source and a little more.
const SEND: Duration = Duration::from_secs(13);
const DST: Ipv4Addr = Ipv4Addr::new(198, 18, 40, 254);
/// `suggest` for the population's rule at the 0.9 quantile with no headroom: the proposal the
/// tests compare with the true quantile.
const ASK_POP: [&str; 7] = [
    "suggest",
    "--rule",
    "pop",
    "--quantile",
    "0.9",
    "--headroom",
    "1",
];

struct Bed {
    tx: Netns,
    rx: Netns,
    tx_if: String,
    rx_if: String,
}

fn bed(tag: &str) -> Bed {
    let tx = Netns::new(&format!("rl-e2e-sg{tag}-tx")).unwrap();
    let rx = Netns::new(&format!("rl-e2e-sg{tag}-rx")).unwrap();
    let (tx_if, rx_if) = veth_pair(&tx, &rx, &format!("g{tag}")).unwrap();
    add_addr(&tx, &tx_if, "198.18.40.1/24").unwrap();
    add_addr(&rx, &rx_if, "198.18.40.254/24").unwrap();
    Bed {
        tx,
        rx,
        tx_if,
        rx_if,
    }
}

fn config(iface: &str) -> String {
    format!(
        "[agent]\ninterfaces = [\"{iface}\"]\nmax_buckets = 4096\n\n\
         [[rule]]\nname = \"pop\"\nsource = \"198.19.0.0/16\"\nprotocol = \"udp\"\n\
         rate = 100000\ndry_run = true\n"
    )
}

/// Source `i`'s address in 198.19.0.0/16.
fn source(i: usize) -> Ipv4Addr {
    let i = u16::try_from(i + 1).unwrap();
    let [a, b] = i.to_be_bytes();
    Ipv4Addr::new(198, 19, a, b)
}

/// Rates of `n` sources, log-normal (median `median` packets/s, sigma 0.7, drawn from a fixed
/// seed), at least 1/s, and `heavy` heavy hitters at 300/s.
fn population(n: usize, median: f64, heavy: usize) -> Vec<u64> {
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut uniform = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        #[expect(clippy::cast_precision_loss, reason = "a uniform draw")]
        let u = (x >> 11) as f64 / (1u64 << 53) as f64;
        u.max(1e-12)
    };
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "rates"
    )]
    let mut rates: Vec<u64> = (0..n)
        .map(|_| {
            let (u1, u2) = (uniform(), uniform());
            let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
            (median * (0.7 * z).exp()).round().max(1.0) as u64
        })
        .collect();
    rates.extend(std::iter::repeat_n(300, heavy));
    rates
}

/// One second of the population: source `i` `rates[i]` times, spread evenly over the second;
/// sent round-robin at the sum of the rates, each source sends its rate.
fn schedule(rates: &[u64], macs: ([u8; 6], [u8; 6])) -> Vec<Vec<u8>> {
    let mut events: Vec<(u64, usize)> = Vec::new();
    for (i, &r) in rates.iter().enumerate() {
        // The k-th of r packets at (k + 1/2) / r of the second, in units of 1/(2 x 10^6).
        events.extend((0..r).map(|k| ((2 * k + 1) * 1_000_000 / r, i)));
    }
    events.sort_unstable();
    events
        .into_iter()
        .map(|(_, i)| {
            eth()
                .macs(macs.0, macs.1)
                .ipv4(source(i), DST)
                .udp(40000, 9)
                .data(&[0x5a; 18])
                .ipv4_checksum()
                .build()
        })
        .collect()
}

/// Sends `rates` from their sources for [`SEND`]; the share of the planned packets sent (the
/// sender may fall behind on a busy machine: every source then sent that share of its rate).
#[expect(clippy::cast_precision_loss, reason = "packet counts")]
fn send(bed: &Bed, rates: &[u64]) -> f64 {
    let macs = (
        mac_bytes(&bed.tx, &bed.tx_if).unwrap(),
        mac_bytes(&bed.rx, &bed.rx_if).unwrap(),
    );
    let raw = RawSocket::open_in(&bed.tx, ifindex(&bed.tx, &bed.tx_if).unwrap(), macs.1).unwrap();
    let frames = schedule(rates, macs);
    let pps = rates.iter().sum::<u64>();
    let report = raw.send_paced(&frames, pps, SEND).unwrap();
    let planned = pps as f64 * SEND.as_secs_f64();
    eprintln!(
        "sent {} of {planned} planned packets ({} errors) from {} sources",
        report.sent,
        report.errors,
        rates.len()
    );
    (report.sent as f64 / planned).min(1.0)
}

/// The `q` quantile of `rates` (nearest rank).
#[expect(
    clippy::cast_precision_loss,
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "a quantile's index and rates"
)]
fn quantile(rates: &[u64], q: f64) -> f64 {
    let mut sorted = rates.to_vec();
    sorted.sort_unstable();
    sorted[(q * (sorted.len() - 1) as f64).round() as usize] as f64
}

/// Waits, if a 5-minute slot of the learner ends within the next `secs`, for the next one to
/// begin: one source is then one observation.
fn clear_of_slot_end(secs: u64) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let left = 300 - now % 300;
    if left <= secs {
        thread::sleep(Duration::from_secs(left + 1));
    }
}

/// A directory removed on drop, pass or fail.
struct StateDir(std::path::PathBuf);

impl Drop for StateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The `/32` keys of the last `heavy` of `rates`' sources: the heavy hitters of [`population`].
fn heavy_keys(rates: &[u64], heavy: usize) -> BTreeSet<String> {
    (rates.len() - heavy..rates.len())
        .map(|i| format!("{}/32", source(i)))
        .collect()
}

/// The sources `s` names as the heaviest it would have limited.
fn named(s: &Value) -> Vec<&Value> {
    s["effect"]["limited_heaviest"]
        .as_array()
        .unwrap_or_else(|| panic!("no effect.limited_heaviest in {s}"))
        .iter()
        .collect()
}

fn the_pop(v: &Value) -> &Value {
    v.as_array()
        .and_then(|a| a.iter().find(|s| s["rule"] == "pop" && s["limit"] == 1))
        .unwrap_or_else(|| panic!("no suggestion for pop: {v}"))
}

/// The suggested rate at Q = 0.9 (headroom 1) is within 10% of the true 0.9 quantile of the
/// sources' rates, `suggest --json` has the documented shape, and the heaviest sources it would
/// have limited are the four heavy hitters, named by address (in `--json` and in the table).
/// Without the learner there is no `suggest` (the command, the route) and no figure to compare;
/// without the heaviest lists no address is named.
#[test]
fn the_suggested_rate_is_the_quantile_of_the_sources_rates() {
    require_root();
    let bed = bed("q");
    let metrics: std::net::SocketAddr = "127.0.0.1:9187".parse().unwrap();
    let with_metrics = config(&bed.rx_if).replacen(
        "[agent]\n",
        &format!("[agent]\nmetrics = \"{metrics}\"\n"),
        1,
    );
    let agent = AgentProcess::start(&bed.rx, &with_metrics, &[]).unwrap();
    let rates = population(400, 12.0, 4);
    clear_of_slot_end(SEND.as_secs() + 10);
    let share = send(&bed, &rates);
    // The learner's walk after the last packet.
    thread::sleep(Duration::from_millis(1500));
    let v = agent.cli_json(&ASK_POP);
    let s = the_pop(&v);
    let truth = quantile(&rates, 0.9) * share;
    #[expect(clippy::cast_precision_loss, reason = "a rate")]
    let got = s["proposed"]["rate"].as_u64().unwrap() as f64;
    eprintln!("suggested rate {got}, true 0.9 quantile {truth:.1}: {s}");
    assert!(
        (got - truth).abs() <= 0.1 * truth,
        "suggested rate {got}, true 0.9 quantile {truth:.1}"
    );
    let sources = s["sources"].as_u64().unwrap();
    assert!(
        (rates.len() as u64 - 4..=rates.len() as u64).contains(&sources),
        "{sources} sources seen of {}",
        rates.len()
    );
    // The shape of `--json`: a list; per rule and limit its name, number, sources, observed
    // quantiles and the proposal.
    for key in ["rule", "limit", "sources", "observed", "proposed"] {
        assert!(!s[key].is_null(), "no {key} in {s}");
    }
    for d in ["peak_1s", "peak_10s", "burst"] {
        for q in ["p50", "p90", "p99", "p999", "max"] {
            assert!(s["observed"][d][q].is_number(), "observed.{d}.{q} in {s}");
        }
    }
    assert!(s["proposed"]["burst"].as_u64().unwrap() >= 1);
    let heavy = s["observed"]["peak_10s"]["max"].as_f64().unwrap();
    assert!(heavy > 250.0 * share, "the heavy hitters' peak: {heavy}");
    // The heaviest it would have limited: the four heavy hitters first (300/s, the rest at most
    // about 100/s), then the heaviest of the rest, every one above the rate.
    let names = named(s);
    let first: BTreeSet<String> = names
        .iter()
        .take(4)
        .map(|h| h["source"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(first, heavy_keys(&rates, 4), "{s}");
    for h in &names[..4] {
        let peak = h["peak_10s"].as_f64().unwrap();
        assert!(peak > 250.0 * share, "{h}");
        assert!(h["peak_1s"].as_f64().unwrap() >= peak, "{h}");
        assert!(h["burst"].is_number(), "{h}");
    }
    assert!((5..=16).contains(&names.len()), "{} named", names.len());
    for h in &names[4..] {
        let peak = h["peak_10s"].as_f64().unwrap();
        assert!(peak > got || h["peak_1s"].as_f64().unwrap() > got, "{h}");
        assert!(peak < 250.0 * share, "a fifth heavy hitter: {h}");
    }
    // The metrics carry the same quantile (bounded labels: rule, limit, window, quantile).
    let text = ratelimit_testbed::metrics::get(&bed.rx, metrics).unwrap();
    let gauge = text
        .lines()
        .find_map(|l| {
            l.strip_prefix(
                r#"ratelimit_learned_peak_rate{rule="pop",limit="1",window="10s",quantile="0.9"} "#,
            )
        })
        .unwrap_or_else(|| panic!("no learned gauge in:\n{text}"))
        .parse::<f64>()
        .unwrap();
    assert!(
        (gauge - truth).abs() <= 0.1 * truth,
        "gauge {gauge}, true 0.9 quantile {truth:.1}"
    );
    // The table prints the same proposal and its TOML.
    let text = agent.cli_ok(&["suggest", "--quantile", "0.9", "--headroom", "1"]);
    assert!(text.contains(&format!("rate = {}", got)), "{text}");
    assert!(
        text.contains("the heaviest sources it would have limited:"),
        "{text}"
    );
    for key in heavy_keys(&rates, 4) {
        assert!(text.contains(&key), "{key} not named in\n{text}");
    }
    // Arguments are checked before anything is asked.
    for (args, words) in [
        (&["--quantile", "0"][..], "quantile"),
        (&["--quantile", "1.5"][..], "quantile"),
        (&["--headroom", "0.5"][..], "headroom"),
        (&["--since", "2d"][..], "since"),
        (&["--rule", "nope"][..], "nope"),
    ] {
        let out = agent.cli_refused(&[&["suggest"][..], args].concat());
        assert!(out.stderr.contains(words), "{args:?}: {}", out.stderr);
    }
    // --apply sets the proposal as `rules add` would: in force and in the file.
    let applied = agent.cli_ok(&[&ASK_POP[..], &["--apply"]].concat());
    let rules = agent.cli_json(&["rules", "list"]);
    let pop = rules
        .as_array()
        .or_else(|| rules["rules"].as_array())
        .and_then(|r| r.iter().find(|r| r["name"] == "pop"))
        .unwrap_or_else(|| panic!("{rules}"))
        .clone();
    let rate = pop["rate"].as_u64().unwrap();
    assert!(
        (rate as f64 - got).abs() <= 0.02 * got + 1.0,
        "applied rate {rate}, proposed {got}: {applied}"
    );
    let file = std::fs::read_to_string(agent.config_path()).unwrap();
    assert!(file.contains(&format!("rate = {rate}")), "{file}");
    agent.stop().unwrap();
}

/// Live, the learner sees what the sources send, not what passes: under a rule enforcing 10/s
/// per source, a population with a 0.9 quantile near 30/s (most of it dropped) is still learned
/// at that quantile, within 10%. A learner that read only the passed counter would see at most
/// about 10/s.
#[test]
fn live_the_learner_sees_what_sources_send_not_what_passes() {
    require_root();
    let bed = bed("l");
    let live =
        config(&bed.rx_if).replace("rate = 100000\ndry_run = true\n", "rate = 10\nburst = 10\n");
    let agent = AgentProcess::start(&bed.rx, &live, &[]).unwrap();
    let rates = population(120, 12.0, 0);
    clear_of_slot_end(SEND.as_secs() + 10);
    let share = send(&bed, &rates);
    thread::sleep(Duration::from_millis(1500));
    let dropped =
        ratelimit_testbed::agent_proc::rule_packets(&agent.stats(), "pop", "dropped_rate");
    assert!(
        dropped > 1000,
        "the rule enforced nothing: {dropped} dropped"
    );
    let v = agent.cli_json(&ASK_POP);
    let s = the_pop(&v);
    let truth = quantile(&rates, 0.9) * share;
    #[expect(clippy::cast_precision_loss, reason = "a rate")]
    let got = s["proposed"]["rate"].as_u64().unwrap() as f64;
    eprintln!("live: suggested rate {got}, true 0.9 quantile {truth:.1}, {dropped} dropped");
    assert!(
        (got - truth).abs() <= 0.1 * truth,
        "suggested rate {got}, true 0.9 quantile {truth:.1}"
    );
    agent.stop().unwrap();
}

/// The history outlives the agent: a second agent on the same state directory suggests from
/// what the first one learned, with no new traffic, naming the same heaviest sources (the two
/// heavy hitters first); a state file of an unknown version is refused with a message naming
/// it, and the agent starts with none.
#[test]
fn a_restart_keeps_what_was_learned_and_a_bad_file_is_refused() {
    require_root();
    let bed = bed("r");
    let state = StateDir(std::env::temp_dir().join(format!("rl-e2e-sg-{}", std::process::id())));
    let dir = state.0.join("state");
    let dir_arg = dir.to_str().unwrap().to_owned();
    let args = ["--state-dir", dir_arg.as_str()];
    let agent = AgentProcess::start(&bed.rx, &config(&bed.rx_if), &args).unwrap();
    let rates = population(30, 20.0, 2);
    clear_of_slot_end(SEND.as_secs() + 10);
    send(&bed, &rates);
    thread::sleep(Duration::from_millis(1500));
    let before = agent.cli_json(&ASK_POP);
    let before = the_pop(&before).clone();
    let first: BTreeSet<String> = named(&before)
        .iter()
        .take(2)
        .map(|h| h["source"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(first, heavy_keys(&rates, 2), "{before}");
    agent.stop().unwrap();
    let file = dir.join("learned.json");
    assert!(file.exists(), "no state written at exit");

    let agent = AgentProcess::start(&bed.rx, &config(&bed.rx_if), &args).unwrap();
    let after = agent.cli_json(&ASK_POP);
    let after = the_pop(&after);
    assert_eq!(
        after["sources"], before["sources"],
        "{after}\nbefore: {before}"
    );
    assert_eq!(
        after["proposed"], before["proposed"],
        "{after}\nbefore: {before}"
    );
    // The same sources with the same figures (to the digits JSON keeps).
    let (a, b) = (named(after), named(&before));
    assert_eq!(a.len(), b.len(), "{after}\nbefore: {before}");
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x["source"], y["source"], "{after}\nbefore: {before}");
        for k in ["peak_1s", "peak_10s", "burst"] {
            let (x, y) = (x[k].as_f64().unwrap(), y[k].as_f64().unwrap());
            assert!(
                (x - y).abs() <= 1e-9 * y.max(1.0),
                "{k}: {x} after, {y} before"
            );
        }
    }
    agent.stop().unwrap();

    let text = std::fs::read_to_string(&file).unwrap();
    std::fs::write(&file, text.replacen("\"version\":2", "\"version\":99", 1)).unwrap();
    let agent = AgentProcess::start(&bed.rx, &config(&bed.rx_if), &args).unwrap();
    let none = agent.cli_json(&["suggest"]);
    assert_eq!(
        none,
        Value::Array(Vec::new()),
        "history from a refused file"
    );
    let log = agent.log();
    assert!(
        log.contains(&file.display().to_string()) && log.contains("version 99"),
        "{log}"
    );
    agent.stop().unwrap();
}

/// `[agent] learn = false` turns the learner off: `suggest` is refused, saying the agent is not
/// learning and naming the setting, and the agent writes no state file at exit (a learning
/// agent always writes one, empty or not: see the restart test). Fails if the setting is
/// ignored.
#[test]
fn learn_false_turns_the_learner_off() {
    require_root();
    let bed = bed("o");
    let state = StateDir(std::env::temp_dir().join(format!("rl-e2e-sgo-{}", std::process::id())));
    let dir = state.0.join("state");
    let dir_arg = dir.to_str().unwrap().to_owned();
    let off = config(&bed.rx_if).replacen("[agent]\n", "[agent]\nlearn = false\n", 1);
    let agent = AgentProcess::start(&bed.rx, &off, &["--state-dir", dir_arg.as_str()]).unwrap();
    let refused = agent.cli_refused(&["suggest", "--rule", "pop"]);
    assert!(
        refused.stderr.contains("not learning") && refused.stderr.contains("learn = false"),
        "{refused:?}"
    );
    agent.stop().unwrap();
    assert!(
        !dir.join("learned.json").exists(),
        "an agent told not to learn wrote {}",
        dir.join("learned.json").display()
    );
}

/// `ratelimit check` warns (on stderr, still exiting 0) about a TCP limit whose `burst` is
/// below `rate x 0.1 s` or whose `bytes_burst` is below `bytes_rate x 0.1 s` (half of the
/// 0.2 s a TCP flow needs), naming the rule, its limit and the figures; it says nothing of a
/// burst at that threshold exactly, nor of a UDP rule. Fails with the threshold anywhere else
/// than 0.1 s of the rate (99 warned, 100 not). Needs no root: `check` changes nothing.
#[test]
fn check_warns_of_a_tcp_burst_below_a_tenth_of_a_second_of_the_rate() {
    let dir = StateDir(std::env::temp_dir().join(format!("rl-sg-check-{}", std::process::id())));
    std::fs::create_dir_all(&dir.0).unwrap();
    let file = dir.0.join("ratelimit.toml");
    std::fs::write(
        &file,
        "[agent]\ninterfaces = [\"eth0\"]\n\n\
         [[rule]]\nname = \"web\"\nsource = \"198.18.0.0/24\"\nprotocol = \"tcp\"\n\
         rate = 1000\nburst = 99\n\
         [[rule.limit]]\nper = \"/24\"\nrate = 5000\nburst = 500\n\
         [[rule.limit]]\nper = \"rule\"\nbytes_rate = 5000000\nbytes_burst = 400000\n\n\
         [[rule]]\nname = \"ok\"\nsource = \"198.18.1.0/24\"\nprotocol = \"tcp\"\n\
         rate = 1000\nburst = 100\nbytes_rate = 5000000\nbytes_burst = 500000\n\n\
         [[rule]]\nname = \"dns\"\nsource = \"198.18.2.0/24\"\nprotocol = \"udp\"\n\
         rate = 1000\nburst = 1\n",
    )
    .unwrap();
    let out = std::process::Command::new(ratelimit_testbed::agent_binary())
        .arg("check")
        .arg("-c")
        .arg(&file)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{out:?}");
    let warnings: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("warning:"))
        .collect();
    assert_eq!(warnings.len(), 2, "{stderr}");
    assert!(
        warnings[0].contains(
            "rule \"web\", limit 1: burst 99 is below rate x 0.1 s = 100, half the 200 a TCP \
             flow needs"
        ),
        "{stderr}"
    );
    assert!(
        warnings[0].contains("burst x 5 = 495 packets/s"),
        "{stderr}"
    );
    assert!(
        warnings[1].contains(
            "rule \"web\", limit 3: bytes_burst 400000 is below bytes_rate x 0.1 s = 500000, half the \
             1000000 a TCP flow needs"
        ),
        "{stderr}"
    );
}
