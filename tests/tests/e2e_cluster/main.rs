//! Cluster-wide budget, end to end: three real agents, each in its own namespace with the limiter
//! attached, gossiping over their own addresses, share one `scope = "cluster"` budget. One sender
//! spreads a single source's flood across them unevenly at 5x the budget; the cluster as a whole
//! must admit the budget (0.95-1.05 x, as docs/design.md states; within its burst bound over any
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

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::unix::fs::PermissionsExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use ratelimit_testbed::{
    add_addr, agent_binary, bind_udp,
    late_rounds::{unix_ms, Overdue},
    leftover_check, mac, neigh_to_peer, require_root, veth_pair, AgentProcess, Netns, Receiver,
};
use serde_json::Value;

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
const GOSSIP_PORT: u16 = 7946;
const SYNC_MS: u64 = 100;
/// Allowed deviation of an admitted rate from what is expected where docs/design.md states no
/// figure (each side of a partition, a host whose agent is down), and what "back within" means
/// for the convergence time.
const TOLERANCE: f64 = 0.10;
/// docs/design.md's accuracy of one budget: 0.95-1.05 x the budget over 5-6 s windows. Measured on
/// the 2-core VM over the two phases of 11 runs: 0.974-1.020 (0.987, 0.992, 0.992, 0.993,
/// 1.012, 1.001, 1.005, 1.005, 1.006, 0.974 in earlier runs, the former ignore note; 1.020, 1.009, 1.010, 1.002, 1.004,
/// 1.001, 1.006, 1.000, 1.000, 1.001, 0.999, 1.007 at f9f2218). The admitted rate swings around
/// the budget with the sync lag, so a 5-6 s window is off by a few percent depending on where the
/// swings fall: the former 0.98-1.04 was missed in 1 window of 22.
const ACCURACY: (f64, f64) = (0.95, 1.05);
/// docs/design.md's "back within 10% within 3 s of a change of split" (the rate over the last second,
/// looked at every `SAMPLE`, 250 ms). Measured 1.1-2.6 s (1.92-2.07 with the whole suite running
/// beside it, 2.14-2.59 in a quiet CI run); issue #15 asks for 3 sync intervals (0.3 s), not met.
const CONVERGENCE_SECS: f64 = 3.0;
/// docs/design.md's gossip figure for 3 hosts at 100 ms, bytes per second per host: "about 22 KB/s"
/// since the agents gossip twice per sync interval (issue #15; 19.3 KB/s in the first run;
/// 18.4-21.3 KB/s in two quiet runs on 2026-11-29 and 21.0-26.7 in a clean-clone CI run the same
/// day, which failed the 26.0 of 20 KB/s + 30%; at once per interval: 9.4-11.2 KB/s measured with
/// the whole suite loading the machine, 13.0-13.9 KB/s on a quiet one).
const GOSSIP_BPS: f64 = 22_000.0;
/// ... "about": +-30% (earlier, with 8 bytes less a datagram: 9.5-11.7 KB/s per host in the
/// connected phases of 3 runs on the 2-core VM).
const GOSSIP_TOLERANCE: f64 = 0.30;
/// The largest sync lag at the default interval in this test (50-200 ms; docs/design.md's bound
/// allows up to 4 sync intervals).
const MAX_LAG_SECS: f64 = 0.2;
/// How far the sampling can misplace an admission in time (see the burst bound).
const SKEW_SECS: f64 = 0.05;
const FLOOD: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 100);
const POLITE: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 101);
const SAMPLE: Duration = Duration::from_millis(250);

fn data_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 0, 1 + u8::try_from(i).unwrap())
}

fn gossip_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 1, 1 + u8::try_from(i).unwrap())
}

struct Host {
    ns: Netns,
    data_if: String,
    gossip_if: String,
}

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

fn config(host: &Host, i: usize, key: &Path, cluster_hosts: usize) -> String {
    let seeds: Vec<String> = (0..cluster_hosts)
        .map(|j| format!("{}:{GOSSIP_PORT}", gossip_ip(j)))
        .collect();
    format!(
        r#"[agent]
interfaces = ["{}"]
mode = "auto"

[[rule]]
name = "cluster-flood"
source = "198.18.0.0/24"
rate = {RATE}
burst = {BURST}
per = "source"
scope = "cluster"

[cluster]
listen = "{}:{GOSSIP_PORT}"
seeds = {seeds:?}
key_file = "{}"
sync_interval_ms = {SYNC_MS}
cluster_id = "e2e-cluster"
"#,
        host.data_if,
        gossip_ip(i),
        key.display()
    )
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

/// Admitted packets per second from `hosts` between `t1` and `t2` (the samples nearest inside).
fn rate(samples: &[Sample], hosts: &[usize], t1: f64, t2: f64) -> f64 {
    let first = samples
        .iter()
        .find(|s| s.t >= t1)
        .expect("a sample after t1");
    let last = samples
        .iter()
        .rev()
        .find(|s| s.t <= t2)
        .expect("a sample before t2");
    let sum = |s: &Sample| hosts.iter().map(|&h| s.flood[h]).sum::<u64>();
    #[expect(clippy::cast_precision_loss, reason = "small counts")]
    let admitted = (sum(last) - sum(first)) as f64;
    admitted / (last.t - first.t)
}

/// Seconds after `t0` (a change) until the cluster's admitted rate over the last second is first
/// within the tolerance of `want` (0 if the change did not move it out; `None` if it never gets
/// there before `t1`). The windows reach back before `t0`, so right after a change they still
/// show the old regime. A first entry, not "stays within": over one second, the sampling (every
/// 250 ms) and the sync steps (every 100 ms) alone make the rate jitter by a few percent, and
/// whether it then stays is what each phase's measurement over several seconds asserts.
fn convergence(samples: &[Sample], t0: f64, t1: f64, want: f64) -> Option<f64> {
    samples
        .iter()
        .filter(|s| s.t >= t0 && s.t <= t1 && s.t >= 1.0)
        .find(|s| (rate(samples, &[0, 1, 2], s.t - 1.0, s.t) / want - 1.0).abs() <= TOLERANCE)
        .map(|s| (s.t - t0).max(0.0))
}

/// Sends `PAYLOAD`-byte datagrams from `sock` to `dst` following `schedule`, a list of (end in
/// seconds after `start`, packets per second), until its last end. Falls at most 16 packets
/// behind (after a preemption) rather than bursting to catch up. Returns the datagrams sent.
fn paced(
    sock: &std::net::UdpSocket,
    dst: SocketAddr,
    schedule: &[(f64, u64)],
    start: Instant,
) -> u64 {
    let payload = [0u8; PAYLOAD];
    let (mut sent, mut due, mut last) = (0u64, 0.0f64, start.elapsed().as_secs_f64());
    loop {
        let t = start.elapsed().as_secs_f64();
        let Some(&(_, pps)) = schedule.iter().find(|(end, _)| t < *end) else {
            return sent;
        };
        #[expect(clippy::cast_precision_loss, reason = "small counts")]
        let (pps, sent_f) = (pps as f64, sent as f64);
        due = (due + (t - last) * pps).min(sent_f + 16.0);
        last = t;
        while (sent as f64) < due {
            match sock.send_to(&payload, dst) {
                Ok(_) => sent += 1,
                Err(e) if matches!(e.raw_os_error(), Some(libc::ENOBUFS | libc::EAGAIN)) => {
                    due -= 1.0
                }
                Err(e) => panic!("sending to {dst}: {e}"),
            }
        }
        let wait = if pps > 0.0 {
            ((sent as f64 + 1.0 - due) / pps).clamp(0.0, 0.005)
        } else {
            0.005
        };
        thread::sleep(Duration::from_secs_f64(wait));
    }
}

/// A directory removed on drop, even when the test fails.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn write_key(dir: &Path, name: &str, secret: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, format!("{secret}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

/// docs/design.md's accuracy of one budget over a phase's 5-6 s window: 0.95-1.05 x the budget.
fn assert_accuracy(what: &str, got: f64) {
    let ratio = got / RATE;
    assert!(
        (ACCURACY.0..=ACCURACY.1).contains(&ratio),
        "{what}: {got:.0} pps = {ratio:.3} x the budget, docs/design.md says {}-{}",
        ACCURACY.0,
        ACCURACY.1
    );
}

fn assert_within(what: &str, got: f64, want: f64) {
    let dev = got / want - 1.0;
    assert!(
        dev.abs() <= TOLERANCE,
        "{what}: {got:.0} pps, expected {want:.0} +-{:.0}% (off by {:+.1}%)",
        TOLERANCE * 100.0,
        dev * 100.0
    );
}

#[test]
fn cluster_enforces_one_budget_fails_open_on_partition_and_ignores_a_wrong_key() {
    scenario();
}

/// The whole run; the one-budget phases 1 and 2 are held to docs/design.md's 0.95-1.05.
#[expect(clippy::too_many_lines, reason = "one scenario, told in order")]
fn scenario() {
    require_root();
    let keys = TempDir(std::env::temp_dir().join(format!("rl-cl-keys-{}", std::process::id())));
    std::fs::create_dir_all(&keys.0).unwrap();
    let good = write_key(
        &keys.0,
        "cluster.key",
        "k8Qx2v9Lm4Tz7Rb1Nc6Yh3Wd5Gf0Ps8Ju2Ea4Ko7Ui1",
    );
    let wrong = write_key(
        &keys.0,
        "wrong.key",
        "Zq1Xw2Ce3Rv4Tb5Yn6Um7Ii8Oo9Pp0Aa1Ss2Dd3Ff4G",
    );

    // --- Network: a switch namespace with two bridges, the sender, four hosts. ---
    let sw = Netns::new("rl-cl-sw").unwrap();
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
    let tx = Netns::new("rl-cl-tx").unwrap();
    let (tx_if, _) = plug(&tx, "ct", "rlbd");
    add_addr(&tx, &tx_if, &format!("{FLOOD}/24")).unwrap();
    add_addr(&tx, &tx_if, &format!("{POLITE}/24")).unwrap();
    let mut hosts = Vec::new();
    for i in 0..4 {
        let ns = Netns::new(&format!("rl-cl-h{i}")).unwrap();
        let (data_if, data_port) = plug(&ns, "cd", "rlbd");
        let (gossip_if, _) = plug(&ns, "cg", "rlbg");
        add_addr(&ns, &data_if, &format!("{}/24", data_ip(i))).unwrap();
        add_addr(&ns, &gossip_if, &format!("{}/24", gossip_ip(i))).unwrap();
        // The hosts never send on the data link, so the bridge would never learn where their
        // MACs are and would flood every frame to every host (whose XDP would count it): pin them.
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

    // --- Agents: h0..h2 with the cluster key, h3 with another, all seeded with h0..h2. ---
    let mut agents = Vec::new();
    for (i, host) in hosts.iter().enumerate() {
        let key = if i < 3 { &good } else { &wrong };
        let agent = AgentProcess::start(&host.ns, &config(host, i, key, 3), &[])
            .unwrap_or_else(|e| panic!("agent h{i}: {e:#}"));
        agents.push(agent);
    }
    let receivers: Vec<Receiver> = (0..4)
        .map(|i| {
            Receiver::bind(&hosts[i].ns, SocketAddr::new(IpAddr::V4(data_ip(i)), PORT)).unwrap()
        })
        .collect();

    // The cluster forms: each of h0..h2 counts the other two, and nobody counts h3.
    let formed = Instant::now();
    loop {
        let statuses: Vec<Value> = agents.iter().map(status).collect();
        let ok = (0..3).all(|i| counted_peers(&statuses[i]).len() == 2);
        if ok {
            println!("cluster formed in {:.1} s", formed.elapsed().as_secs_f64());
            // The operator's view: `ratelimit peers` (JSON and table) shows the two others as
            // alive and counted.
            let peers = cli(&agents[0], &["peers", "--json"]);
            let peers: Value = serde_json::from_str(&peers).expect("peers JSON");
            let alive = peers["peers"]
                .as_array()
                .expect("peers list")
                .iter()
                .filter(|p| p["state"] == "alive" && p["counted"] == true)
                .count();
            assert_eq!(alive, 2, "peers --json: {peers:#}");
            let table = cli(&agents[0], &["peers"]);
            assert!(
                table.contains("STATE") && table.matches("alive").count() >= 2,
                "peers table:\n{table}"
            );
            break;
        }
        assert!(
            formed.elapsed() < Duration::from_secs(20),
            "the cluster did not form within 20 s: {statuses:#?}\nh0 log:\n{}",
            agents[0].log()
        );
        thread::sleep(Duration::from_millis(200));
    }

    // --- Traffic: one paced sender per destination for the whole run, following the phases'
    // split without a gap; the main thread acts at the phase boundaries, a sampler thread
    // reads the receivers every 250 ms.
    let dst = |i: usize| SocketAddr::new(IpAddr::V4(data_ip(i)), PORT);
    let flood_ip = IpAddr::V4(FLOOD);
    let ends: Vec<f64> = PHASES
        .iter()
        .scan(0.0, |t, p| {
            *t += p.secs;
            Some(*t)
        })
        .collect();
    let mut phase_bounds = Vec::new();
    let mut gossip_bytes = Vec::new();
    let mut statuses_after = Vec::new();
    let mut down = [false; 4];
    let mut intruder_sent = 0;
    // The good agents' statuses while they hear each other, for their late rounds (each keeps
    // its last 32): `(agent, read at (Unix ms), status)`.
    let mut readings: Vec<(usize, u64, Value)> = Vec::new();
    let start = Instant::now();
    let start_unix_ms = unix_ms();
    let (polite_sent, samples): (Vec<u64>, Vec<Sample>) = thread::scope(|s| {
        let flood_sender = |i: usize, schedule: Vec<(f64, u64)>| {
            let sock = bind_udp(&tx, SocketAddr::new(flood_ip, 0)).unwrap();
            s.spawn(move || paced(&sock, dst(i), &schedule, start))
        };
        let mut flood: Vec<_> = (0..3)
            .map(|i| {
                flood_sender(
                    i,
                    PHASES
                        .iter()
                        .zip(&ends)
                        .map(|(p, &e)| (e, FLOOD_PPS * p.split[i] / 100))
                        .collect(),
                )
            })
            .collect();
        flood.push(flood_sender(3, vec![(ends[ends.len() - 1], INTRUDER_PPS)]));
        let polite: Vec<_> = (0..3)
            .map(|i| {
                let sock = bind_udp(&tx, SocketAddr::new(IpAddr::V4(POLITE), 0)).unwrap();
                let schedule = vec![(ends[ends.len() - 1], POLITE_PPS)];
                s.spawn(move || paced(&sock, dst(i), &schedule, start))
            })
            .collect();
        // The sampler has a thread of its own: the main thread's `status` calls at the phase
        // boundaries took up to 5 s on a loaded CI machine, and a sampler waiting for them left
        // a gap that read as slow convergence.
        let last_end = ends[ends.len() - 1];
        let receivers = &receivers;
        let sampler = s.spawn(move || {
            let mut samples = Vec::new();
            loop {
                let t = start.elapsed().as_secs_f64();
                if t >= last_end {
                    break samples;
                }
                let mut counts = [0; 4];
                for (c, r) in counts.iter_mut().zip(receivers) {
                    *c = r.counts().get(&flood_ip).copied().unwrap_or(0);
                }
                samples.push(Sample { t, flood: counts });
                thread::sleep(SAMPLE.min(Duration::from_secs_f64(last_end - t)));
            }
        });
        let mut begin = 0.0;
        for (phase, &end) in PHASES.iter().zip(&ends) {
            if let Some(up) = phase.h0_gossip {
                hosts[0]
                    .ns
                    .ip(&[
                        "link",
                        "set",
                        &hosts[0].gossip_if,
                        if up { "up" } else { "down" },
                    ])
                    .unwrap();
            }
            if phase.crash_h2 {
                agents[2].crash().unwrap();
                down[2] = true;
            }
            let before: Vec<(u64, u64)> = (0..3)
                .map(|i| {
                    let sent = if down[i] {
                        0
                    } else {
                        counter(&status(&agents[i]), "bytes_out")
                    };
                    (sent, tx_bytes(&hosts[i].ns, &hosts[i].gossip_if))
                })
                .collect();
            let t_before = start.elapsed().as_secs_f64();
            let connected = phase_bounds.len() < 2;
            loop {
                let left = end - start.elapsed().as_secs_f64();
                // While connected the late rounds are read every 2 s (a loaded machine may run
                // 32 late in a phase); not in the last 2.5 s, so that a slow read does not hold
                // up the next phase's action.
                if !connected || left < 2.5 {
                    thread::sleep(Duration::from_secs_f64(left.max(0.0)));
                    break;
                }
                thread::sleep(Duration::from_secs(2));
                readings.extend((0..3).map(|i| (i, unix_ms(), status(&agents[i]))));
            }
            let statuses: Vec<Value> = agents
                .iter()
                .zip(down)
                .map(|(a, d)| if d { Value::Null } else { status(a) })
                .collect();
            if connected {
                let at = unix_ms();
                readings.extend((0..3).map(|i| (i, at, statuses[i].clone())));
            }
            let t_after = start.elapsed().as_secs_f64();
            gossip_bytes.push(
                (0..3)
                    .map(|i| {
                        #[expect(clippy::cast_precision_loss, reason = "small counts")]
                        let per_sec = |n: u64| n as f64 / (t_after - t_before);
                        let sent = if down[i] {
                            0
                        } else {
                            counter(&statuses[i], "bytes_out") - before[i].0
                        };
                        (
                            per_sec(sent),
                            per_sec(tx_bytes(&hosts[i].ns, &hosts[i].gossip_if) - before[i].1),
                        )
                    })
                    .collect::<Vec<_>>(),
            );
            statuses_after.push(statuses);
            phase_bounds.push((begin, end));
            begin = end;
        }
        let samples = sampler.join().unwrap();
        let flood_sent: Vec<u64> = flood.into_iter().map(|h| h.join().unwrap()).collect();
        intruder_sent = flood_sent[3];
        let polite = polite.into_iter().map(|h| h.join().unwrap()).collect();
        (polite, samples)
    });
    for r in &receivers {
        r.wait_idle(Duration::from_millis(200), Duration::from_secs(5));
    }

    // --- Figures. ---
    println!("\nbudget {RATE} pps (burst {BURST}) per source, cluster-wide; flood {FLOOD_PPS} pps; sync {SYNC_MS} ms");
    let mut results = Vec::new();
    for (phase, &(t0, t1)) in PHASES.iter().zip(&phase_bounds) {
        let (m0, m1) = (t0 + phase.settle, t1);
        let per_host: Vec<f64> = (0..4).map(|h| rate(&samples, &[h], m0, m1)).collect();
        let cluster = rate(&samples, &[0, 1, 2], m0, m1);
        let conv = convergence(&samples, t0, t1, phase.expect * RATE);
        println!(
            "{:<28} measured {:>4.1}-{:>4.1} s: cluster (h0+h1+h2) {:>6.0} pps = {:.3} x budget; h0 {:>5.0} h1 {:>5.0} h2 {:>5.0} | h3 (wrong key) {:>4.0}; \
             rate over the last second within 10% {}",
            phase.name,
            m0,
            m1,
            cluster,
            cluster / RATE,
            per_host[0],
            per_host[1],
            per_host[2],
            per_host[3],
            conv.map_or_else(|| "never".to_string(), |c| format!("{c:.2} s after the change")),
        );
        results.push((per_host, cluster, conv));
    }
    for (i, bytes) in gossip_bytes.iter().enumerate() {
        let line: Vec<String> = bytes
            .iter()
            .enumerate()
            .map(|(h, (agent, link))| format!("h{h} {agent:.0} B/s (link {link:.0} B/s)"))
            .collect();
        println!(
            "gossip sent during {:<28} {}",
            PHASES[i].name,
            line.join(", ")
        );
    }
    if std::env::var_os("RL_CLUSTER_TRACE").is_some() {
        for s in samples.iter().filter(|s| s.t >= 1.0) {
            println!(
                "t {:5.2} cluster rate over the last second {:6.0}",
                s.t,
                rate(&samples, &[0, 1, 2], s.t - 1.0, s.t)
            );
        }
    }
    let gap = samples
        .windows(2)
        .map(|w| w[1].t - w[0].t)
        .fold(0.0, f64::max);
    println!("largest gap between samples: {gap:.2} s (every {SAMPLE:?} asked)");
    // Before h2's agent was killed (the end of the heal phase), and at the end.
    let healed = &statuses_after[3];
    let final_status = &statuses_after[PHASES.len() - 1];
    let rejected: Vec<u64> = healed.iter().map(|s| counter(s, "rejected_auth")).collect();
    println!(
        "datagrams rejected as not authentic: h0 {} h1 {} h2 {} h3 {}",
        rejected[0], rejected[1], rejected[2], rejected[3]
    );
    println!(
        "sync lag (ms) at the end of the heal phase: {:?}",
        healed[..3]
            .iter()
            .map(|s| counter(s, "sync_lag_ms"))
            .collect::<Vec<_>>()
    );

    // docs/design.md's burst bound: over any window T while the three hosts hear each other (from
    // the start, fresh buckets, to the end of phase 2), the cluster admits at most
    // `rate x T + (what the hosts' buckets hold) + (hosts - 1) x rate x lag`, lag at most 200 ms
    // (50-200 ms at the default sync in this test), plus `rate x SKEW` for the sampling (each
    // sample reads the receivers one after the other, and delivery lags the program's decision).
    // A bucket at share `s` of `hosts` holders holds the burst, or `hosts x s` bursts if that is
    // 1.5 or more (the written bound's `(2 x hosts - 1) x burst` at the worst split): for these
    // phases' splits, at most `sum(max(1, hosts x s))` bursts, 4.1 for 70/20/10. A round that
    // renewed shares which had lapsed (the agent starved of CPU past its lag allowance) left
    // that host refilling at the whole rate meanwhile (fail open): `rate x` each lapse more.
    let connected_end = phase_bounds[1].1;
    let mut excess: f64 = f64::MIN;
    for (i, a) in samples
        .iter()
        .enumerate()
        .filter(|(_, s)| s.t <= connected_end)
    {
        for b in samples[i + 1..].iter().filter(|s| s.t <= connected_end) {
            let sum = |s: &Sample| s.flood[..3].iter().sum::<u64>();
            #[expect(clippy::cast_precision_loss, reason = "small counts")]
            let admitted = (sum(b) - sum(a)) as f64;
            excess = excess.max(admitted - RATE * (b.t - a.t));
        }
    }
    #[expect(clippy::cast_precision_loss, reason = "small counts")]
    let held_bursts = PHASES[..2]
        .iter()
        .map(|p| {
            p.split
                .iter()
                .map(|&pct| (3.0 * pct as f64 / 100.0).max(1.0))
                .sum::<f64>()
        })
        .fold(0.0, f64::max);
    let overdue = Overdue::of(&readings, start_unix_ms);
    let lapses: f64 = overdue
        .lapses_within(0.0, connected_end)
        .fold(0.0, |sum, l| sum + (RATE * l.2).ceil());
    if !overdue.incomplete.is_empty() {
        println!("late rounds not all kept by h{:?}", overdue.incomplete);
    }
    #[expect(clippy::cast_precision_loss, reason = "small counts")]
    let burst_bound =
        held_bursts * BURST as f64 + 2.0 * RATE * MAX_LAG_SECS + RATE * SKEW_SECS + lapses;
    println!(
        "largest excess over rate x T of any window while connected: {excess:.0} packets \
         (bound {burst_bound:.0}, {lapses:.0} of it for lapsed shares)"
    );
    assert!(
        excess <= burst_bound,
        "a window admitted {excess:.0} packets over rate x T, more than docs/design.md's bound {burst_bound:.0}"
    );

    // --- Assertions. ---
    // 1. One budget for the cluster, whatever the split: docs/design.md's 0.95-1.05 x the budget
    //    over the phases' 5-6 s windows, back within 10% within 3 s of a change.
    for (phase, what) in [(0, "phase 1 (70/20/10)"), (1, "phase 2 (10/20/70)")] {
        assert_accuracy(
            &format!("{what}: cluster-wide admitted rate"),
            results[phase].1,
        );
    }
    // docs/design.md's 3 s is stated for the change of split; the cut, the heal and the
    // kill change the budget itself (and wait for the failure detector), so for them only that
    // the rate gets there.
    let conv = results[1]
        .2
        .expect("never back within 10% after the split changed");
    assert!(
        conv <= CONVERGENCE_SECS,
        "back within 10% only {conv:.2} s after the split changed (docs/design.md: within \
         {CONVERGENCE_SECS} s)"
    );
    assert!(
        results[2].2.is_some() && results[3].2.is_some() && results[4].2.is_some(),
        "no convergence after the cut, the heal or the kill"
    );
    // Gossip: about 22 KB/s per host for 3 hosts at 100 ms, while all three gossip.
    for &p in &[0, 1, 3] {
        for (h, (sent, _)) in gossip_bytes[p].iter().enumerate() {
            assert!(
                (GOSSIP_BPS * (1.0 - GOSSIP_TOLERANCE)..=GOSSIP_BPS * (1.0 + GOSSIP_TOLERANCE))
                    .contains(sent),
                "{}: h{h} sent {sent:.0} B/s of gossip, docs/design.md says about {GOSSIP_BPS:.0}",
                PHASES[p].name
            );
        }
    }
    // 2. Partition: each side enforces the budget on its own (fail open): h0 alone admits the
    //    budget, h1 and h2 share one.
    assert_within("phase 3 (h0 cut off): h0 alone", results[2].0[0], RATE);
    assert_within(
        "phase 3 (h0 cut off): h1 + h2",
        results[2].0[1] + results[2].0[2],
        RATE,
    );
    let during_cut = &statuses_after[2];
    assert!(
        counted_peers(&during_cut[0]).is_empty(),
        "h0 still counts peers while cut off: {}",
        during_cut[0]["cluster"]
    );
    for s in &during_cut[1..3] {
        assert_eq!(
            counted_peers(s).len(),
            1,
            "h1/h2 should count only each other during the cut: {}",
            s["cluster"]
        );
    }
    // 3. Healed: one budget again, without a blackout from the backlog.
    // docs/design.md's 0.95-1.05 is stated for the two splits (phases 1 and 2); after a heal, the
    // debt of the partition is still being settled: +-10% (measured 0.97-1.03).
    assert_within(
        "phase 4 (healed): cluster-wide admitted rate",
        results[3].1,
        RATE,
    );
    for (i, s) in healed.iter().take(3).enumerate() {
        assert_eq!(
            counted_peers(s).len(),
            2,
            "h{i} should count both peers after the heal: {}",
            s["cluster"]
        );
    }
    // 4. An agent down: its host keeps enforcing its local limit (the program and the buckets
    //    stay pinned), and the others stop counting it.
    assert_within(
        "phase 5 (h2's agent killed): h2 alone",
        results[4].0[2],
        RATE,
    );
    assert_within(
        "phase 5 (h2's agent killed): h0 + h1",
        results[4].0[0] + results[4].0[1],
        RATE,
    );
    for s in &final_status[..2] {
        assert_eq!(
            counted_peers(s).len(),
            1,
            "h0/h1 should count only each other once h2's agent is gone: {}",
            s["cluster"]
        );
    }
    // 5. The wrong key: rejected, never a peer, no effect (the cluster's figures above already
    //    exclude any charge for h3's traffic, which h3 admits in full under its own budget).
    assert!(
        rejected[..3].iter().sum::<u64>() > 0,
        "nobody rejected h3's gossip"
    );
    let h3 = format!("{}:{GOSSIP_PORT}", gossip_ip(3));
    for s in &healed[..3] {
        let peers = s["cluster"]["peers"].as_array().unwrap();
        assert!(
            peers.iter().all(|p| p["addr"] != h3.as_str()),
            "h3 became a peer: {}",
            s["cluster"]
        );
    }
    assert!(
        final_status[3]["cluster"]["peers"]
            .as_array()
            .unwrap()
            .is_empty(),
        "h3 joined: {}",
        final_status[3]["cluster"]
    );
    assert_eq!(
        counter(&final_status[3], "messages_in"),
        0,
        "h3 accepted gossip from the cluster"
    );
    // 6. The polite source lost nothing anywhere.
    let reports: Vec<_> = receivers.into_iter().map(|r| r.stop().unwrap()).collect();
    // h3 admitted every packet of its flood, under its own local budget: nothing of the
    // cluster's consumption was charged to it either.
    let h3_got = reports[3].counts().get(&flood_ip).copied().unwrap_or(0);
    assert_eq!(
        h3_got, intruder_sent,
        "h3 (wrong key) dropped part of its under-budget flood"
    );
    for i in 0..3 {
        let got = reports[i]
            .counts()
            .get(&IpAddr::V4(POLITE))
            .copied()
            .unwrap_or(0);
        assert_eq!(got, polite_sent[i], "h{i}: the polite source lost packets");
        assert_eq!(
            reports[i].socket_drops,
            Some(0),
            "h{i}: receiver overflowed"
        );
    }

    if std::env::var_os("RL_CLUSTER_TRACE").is_some() {
        for (i, a) in agents.iter().enumerate() {
            println!(
                "--- h{i} status ---\n{:#}\n--- h{i} log ---\n{}",
                healed[i]["cluster"],
                a.log()
            );
        }
    }

    // --- Clean up: agents detach and unpin; namespaces go. ---
    for (i, agent) in agents.into_iter().enumerate() {
        if down[i] {
            // Killed: its pins (and so the attached program) are removed by the drop.
            drop(agent);
        } else {
            agent
                .stop()
                .unwrap_or_else(|e| panic!("stopping h{i}: {e:#}"));
        }
    }
    drop(hosts);
    drop(tx);
    drop(sw);
    drop(keys);
    let ours = format!("-{}-", std::process::id());
    let left: Vec<String> = leftover_check("rl-cl-")
        .into_iter()
        .filter(|n| n.contains(&ours))
        .collect();
    assert!(left.is_empty(), "namespaces left behind: {left:?}");
}
