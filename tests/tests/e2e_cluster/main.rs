//! Cluster-wide budget, end to end: three real agents, each in its own namespace with the limiter
//! attached, gossiping over their own addresses, share one `scope = "cluster"` budget. One sender
//! spreads a single source's flood across them unevenly at 5x the budget; the cluster as a whole
//! must admit the budget (0.95-1.05 x, as docs/cluster.md states; within its burst bound over any
//! window; back within 10% within 3 s after the split changes; about 12 KB/s of gossip per host).
//! Then the split changes; one host is cut off (each side of
//! the partition then enforces the budget on its own: fail open); the cut is healed (one budget
//! again); one host's agent is killed (that host keeps enforcing its local limit, the others stop
//! counting it). A fourth agent with the wrong key gossips at the others all along and must change
//! nothing. A polite source loses nothing throughout.
//!
//! ```text
//!         sw namespace: bridge "rlbd" (data, 198.18.0.0/24), bridge "rlbg" (gossip, 198.18.1.0/24)
//!   tx --data-- rlbd --data-- h0 h1 h2 (cluster, key A)   h3 (key B)
//!               rlbg --gossip-- h0 h1 h2 h3
//! ```
//! Gossip has a link of its own so that a partition is one `ip link set down`, cutting gossip
//! while the host keeps receiving its share of the flood.
//!
//! The measured figures (admitted/budget per phase, time to converge after each change, gossip
//! bytes per second per host) are printed; run with `--nocapture` to see them, and with
//! `RL_CLUSTER_TRACE=1` for the rate second by second, the agents' cluster status and logs.
//!
//! The scenario is told as its steps, one function each, in the order they run: `net.rs` builds
//! the network and starts the agents (and takes them down at the end), `run.rs` plays the five
//! phases while the senders flood and a sampler reads the receivers, `figures.rs` prints what
//! was measured, and `phases.rs` asserts what each phase must show.

use std::net::Ipv4Addr;
use std::process::Command;
use std::time::{Duration, Instant};

use ratelimit_testbed::cluster_net::{ClusterNet, GOSSIP_PORT};
use ratelimit_testbed::{agent_binary, require_root, AgentProcess, Netns, Receiver};
use serde_json::Value;

mod figures;
mod net;
mod phases;
mod run;

/// The cluster rule: one source may send this many packets per second cluster-wide...
const RATE: f64 = 1000.0;
/// ... after a burst of this many.
const BURST: u64 = 500;
/// The flood: 5x the budget, in total.
const FLOOD_PPS: u64 = 5000;
/// The polite source, to each of the three hosts (300 pps cluster-wide, under the budget).
const POLITE_PPS: u64 = 100;
/// The wrong-key host's share of the flood: under its own (local) budget, so it admits all of it.
const INTRUDER_PPS: u64 = 800;
const PAYLOAD: usize = 64;
const PORT: u16 = 9000;
const SYNC_MS: u64 = 100;
/// Allowed deviation of an admitted rate from what is expected where docs/cluster.md states no
/// figure (each side of a partition, a host whose agent is down), and what "back within" means
/// for the convergence time.
const TOLERANCE: f64 = 0.10;
/// docs/cluster.md's accuracy of one budget: 0.95-1.05 x the budget over 5-6 s windows. Measured on
/// the 2-core VM over the two phases of 11 runs: 0.974-1.020 (0.987, 0.992, 0.992, 0.993,
/// 1.012, 1.001, 1.005, 1.005, 1.006, 0.974 in earlier runs, the former ignore note; 1.020, 1.009, 1.010, 1.002, 1.004,
/// 1.001, 1.006, 1.000, 1.000, 1.001, 0.999, 1.007 at f9f2218). The admitted rate swings around
/// the budget with the sync lag, so a 5-6 s window is off by a few percent depending on where the
/// swings fall: the former 0.98-1.04 was missed in 1 window of 22.
const ACCURACY: (f64, f64) = (0.95, 1.05);
/// docs/cluster.md's "back within 10% within 3 s of a change of split" (the rate over the last second,
/// looked at every `SAMPLE`, 250 ms). Measured 1.1-2.6 s (1.92-2.07 with the whole suite running
/// beside it, 2.14-2.59 in a quiet CI run); issue #15 asks for 3 sync intervals (0.3 s), not met.
const CONVERGENCE_SECS: f64 = 3.0;
/// docs/cluster.md's gossip figure for 3 hosts at 100 ms, bytes per second per host: "about 22 KB/s"
/// since the agents gossip twice per sync interval (issue #15; 19.3 KB/s in the first run;
/// 18.4-21.3 KB/s in two quiet runs on 2026-11-29 and 21.0-26.7 in a clean-clone CI run the same
/// day, which failed the 26.0 of 20 KB/s + 30%; at once per interval: 9.4-11.2 KB/s measured with
/// the whole suite loading the machine, 13.0-13.9 KB/s on a quiet one).
const GOSSIP_BPS: f64 = 22_000.0;
/// ... "about": +-30% (earlier, with 8 bytes less a datagram: 9.5-11.7 KB/s per host in the
/// connected phases of 3 runs on the 2-core VM).
const GOSSIP_TOLERANCE: f64 = 0.30;
/// The largest sync lag at the default interval in this test (50-200 ms; docs/cluster.md's bound
/// allows up to 4 sync intervals).
const MAX_LAG_SECS: f64 = 0.2;
/// How far the sampling can misplace an admission in time (see the burst bound).
const SKEW_SECS: f64 = 0.05;
const FLOOD: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 100);
const POLITE: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 101);
const SAMPLE: Duration = Duration::from_millis(250);

/// One phase of the run: how long, how the flood is split over h0..h2 (percent), and what
/// happens to h0's gossip link at its start.
struct Phase {
    name: &'static str,
    secs: f64,
    split: [u64; 3],
    h0_gossip: Option<bool>,
    /// Seconds into the phase after which it is measured.
    settle: f64,
    /// What h0..h2 together should admit, in budgets: 1, or 2 while the cluster is split in two.
    expect: f64,
    /// Kill h2's agent (SIGKILL, as a crash) at the start of the phase.
    crash_h2: bool,
}

const PHASES: [Phase; 5] = [
    Phase {
        name: "70/20/10",
        secs: 8.0,
        split: [70, 20, 10],
        h0_gossip: None,
        settle: 2.0,
        expect: 1.0,
        crash_h2: false,
    },
    Phase {
        name: "split changed to 10/20/70",
        secs: 7.0,
        split: [10, 20, 70],
        h0_gossip: None,
        settle: 2.0,
        expect: 1.0,
        crash_h2: false,
    },
    Phase {
        name: "h0 cut off (70/20/10)",
        secs: 8.0,
        split: [70, 20, 10],
        h0_gossip: Some(false),
        settle: 3.0,
        expect: 2.0,
        crash_h2: false,
    },
    Phase {
        name: "cut healed (70/20/10)",
        secs: 7.0,
        split: [70, 20, 10],
        h0_gossip: Some(true),
        settle: 3.0,
        expect: 1.0,
        crash_h2: false,
    },
    Phase {
        name: "h2's agent killed (10/20/70)",
        secs: 7.0,
        split: [10, 20, 70],
        h0_gossip: None,
        settle: 3.5,
        expect: 2.0,
        crash_h2: true,
    },
];

/// Counts of the flood source at h0..h3, `t` seconds after the flood started.
#[derive(Clone, Copy, Debug)]
struct Sample {
    t: f64,
    flood: [u64; 4],
}

/// What the steps share: the network, the agents in it and the receivers of the flood. The
/// fields drop in order, also on a panic: the receivers and the agents (which detach and unpin
/// on drop) before the namespaces they run in, the key directory last.
struct Cluster {
    receivers: Vec<Receiver>,
    agents: Vec<AgentProcess>,
    /// Which agents are down (killed): they are not asked for their status, and their drop,
    /// not a stop, removes their pins.
    down: [bool; 4],
    net: ClusterNet,
}

/// What the phases recorded, for the figures and the assertions.
struct Run {
    /// When the flood started: `t` 0 of the samples and of the phases' bounds.
    start: Instant,
    /// The same moment in Unix milliseconds, for the agents' late rounds.
    start_unix_ms: u64,
    /// The receivers' counts of the flood source, every `SAMPLE`.
    samples: Vec<Sample>,
    /// Each phase's start and end, in seconds after `start`.
    phase_bounds: Vec<(f64, f64)>,
    /// Per phase, per host h0..h2: the gossip it sent, in bytes per second, as the agent counts
    /// it (0 while down) and as its gossip link counts it.
    gossip_bytes: Vec<Vec<(f64, f64)>>,
    /// Per phase, h0..h3's status at its end (`Null` for an agent down).
    statuses_after: Vec<Vec<Value>>,
    /// The good agents' statuses while they hear each other, for their late rounds (each keeps
    /// its last 32): `(agent, read at (Unix ms), status)`.
    readings: Vec<(usize, u64, Value)>,
    /// The polite source's datagrams sent to h0..h2.
    polite_sent: Vec<u64>,
    /// The flood's datagrams sent to h3 (the wrong key).
    intruder_sent: u64,
}

impl Run {
    /// The statuses before h2's agent was killed (the end of the heal phase).
    fn healed(&self) -> &[Value] {
        &self.statuses_after[3]
    }

    /// The statuses at the end.
    fn final_status(&self) -> &[Value] {
        &self.statuses_after[PHASES.len() - 1]
    }
}

/// What was measured of each phase, printed and then asserted.
struct Figures {
    /// Per phase: the admitted rate at h0..h3 and at h0..h2 together over its measured window,
    /// and how long after its start the cluster's rate was first within the tolerance of what
    /// the phase expects.
    results: Vec<(Vec<f64>, f64, Option<f64>)>,
    /// The datagrams each of h0..h3 rejected as not authentic by the end of the heal phase.
    rejected: Vec<u64>,
}

/// Runs `ratelimit --socket S ARGS` and returns its standard output (failing on an error).
fn cli(agent: &AgentProcess, args: &[&str]) -> String {
    let out = std::process::Command::new(agent_binary())
        .arg("--socket")
        .arg(agent.socket_path())
        .args(args)
        .output()
        .expect("running ratelimit");
    assert!(
        out.status.success(),
        "ratelimit {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

/// `ratelimit --socket S status --json`, parsed.
fn status(agent: &AgentProcess) -> Value {
    let out = Command::new(agent_binary())
        .arg("--socket")
        .arg(agent.socket_path())
        .args(["status", "--json"])
        .output()
        .expect("running ratelimit status");
    assert!(
        out.status.success(),
        "status failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        agent.log()
    );
    serde_json::from_slice(&out.stdout).expect("status JSON")
}

fn counted_peers(status: &Value) -> Vec<String> {
    status["cluster"]["peers"]
        .as_array()
        .map(|ps| {
            ps.iter()
                .filter(|p| p["counted"] == true)
                .map(|p| p["addr"].as_str().unwrap_or("").to_string())
                .collect()
        })
        .unwrap_or_default()
}

fn counter(status: &Value, name: &str) -> u64 {
    status["cluster"]["counters"][name]
        .as_u64()
        .unwrap_or_else(|| panic!("no cluster counter {name}: {status}"))
}

fn tx_bytes(ns: &Netns, ifname: &str) -> u64 {
    let out = ns.ip(&["-s", "-j", "link", "show", "dev", ifname]).unwrap();
    let link: Value = serde_json::from_str(&out).unwrap();
    link[0]["stats64"]["tx"]["bytes"].as_u64().unwrap_or(0)
}

#[test]
fn cluster_enforces_one_budget_fails_open_on_partition_and_ignores_a_wrong_key() {
    scenario();
}

/// The whole run, step by step; the one-budget phases 1 and 2 are held to docs/cluster.md's
/// 0.95-1.05.
fn scenario() {
    require_root();
    let mut cluster = Cluster::start();
    phases::the_cluster_forms(&cluster);
    let run = run::play_the_phases(&mut cluster);
    let figures = figures::print(&run);
    phases::every_window_while_connected_is_within_the_burst_bound(&run);
    phases::one_budget_whatever_the_split(&run, &figures);
    phases::gossip_is_about_22_kb_a_second_per_host(&run);
    phases::a_partition_fails_open(&run, &figures);
    phases::healed_it_is_one_budget_again(&run, &figures);
    phases::a_host_whose_agent_is_down_keeps_its_local_limit(&run, &figures);
    phases::the_wrong_key_changes_nothing(&run, &figures);
    phases::the_polite_source_loses_nothing(std::mem::take(&mut cluster.receivers), &run);
    phases::trace_the_agents(&cluster, &run);
    cluster.clean_up();
}
