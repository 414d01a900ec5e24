//! A peer that stops, end to end: two real agents sharing a `scope = "cluster"` rule (1,000 pps,
//! burst 500, sync 100 ms, so a peer timeout of max(3 s, 10 x 100 ms) = 3 s), on the cluster
//! testbed (`cluster_net`). h1's agent is stopped with SIGSTOP (its XDP program goes on
//! admitting; its gossip stops) while a flood under the budget reaches h1:
//! - stopped for less than the timeout, h1 stays `alive` and counted at h0 throughout, its key
//!   read;
//! - stopped for longer, h0 stops counting it at the timeout (not before, within a sync round
//!   and a gossip interval), shows it `silent` in `peers` and `peers --json` from then on, and
//!   `dead` only from 2 timeouts (at most 2.4) on; resumed, it is `alive` and counted again.
//!
//! The flood reaches h1 only: h0 has no bucket of the source, so h1's demand withholds nothing
//! there (`charged_pkts` stays 0 throughout). (Until shares followed demand, h0 charged what h1
//! admitted, and this test checked that exactly, silences and all; admissions are no longer
//! charged, see `e2e_cluster/` and `e2e_cluster_scale.rs` for what the shares do.)
//!
//! Run with `--nocapture` for the figures.

use std::net::{IpAddr, SocketAddr};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use ratelimit::cluster::{DEAD_AFTER, PHI_THRESHOLD};
use ratelimit_testbed::cluster::stop_agents;
use ratelimit_testbed::{
    agent_binary, assert_none_left, bind_udp,
    cluster_net::{data_ip, gossip_addr, ClusterNet, FLOOD},
    require_root, send_udp, AgentProcess, Receiver,
};
use serde_json::Value;

const RATE: u64 = 1000;
const BURST: u64 = 500;
const SYNC_MS: u64 = 100;
/// max(3 s, 10 x `SYNC_MS`).
const TIMEOUT: f64 = 3.0;
/// How much earlier than the timeout after the SIGSTOP h0 may stop counting h1: h1's last
/// heartbeat left it up to one gossip interval (100 ms) before the stop, and h0's sync round
/// notes it up to one round (100 ms) after it arrives (the silence is timed from that round),
/// so h0 can only stop counting later than `stop + timeout - 100 ms`; 50 ms more for the
/// status, which is refreshed each round.
const EARLY: f64 = 0.25;
/// How much later: h1's last heartbeat arrives at most a round before h0 notes it (100 ms),
/// the round that finds the silence over the timeout comes up to a round later (100 ms), and
/// the poll that reads it (a `ratelimit peers --json` run) ends after it; 300 ms for those
/// runs on a loaded host.
const LATE: f64 = 0.5;
/// The flood's rate at h1: under the budget, so h1 admits every packet.
const PPS: u64 = 300;

/// Sends `PPS` for `secs` from [`FLOOD`] to host `i`; every datagram must arrive (under the
/// budget). Returns the count.
fn flood(net: &ClusterNet, i: usize, secs: f64) -> u64 {
    let receiver =
        Receiver::bind(&net.hosts[i].ns, SocketAddr::new(IpAddr::V4(data_ip(i)), 0)).unwrap();
    let sock = bind_udp(&net.tx, SocketAddr::new(IpAddr::V4(FLOOD), 0)).unwrap();
    let sent = send_udp(
        &sock,
        receiver.local_addr(),
        PPS,
        Duration::from_secs_f64(secs),
        64,
    )
    .unwrap();
    receiver.wait_idle(Duration::from_millis(200), Duration::from_secs(5));
    let got = receiver.stop().unwrap().counts()[&IpAddr::V4(FLOOD)];
    assert_eq!(got, sent.sent, "the flood (under the budget) lost packets");
    got
}

fn cli(agent: &AgentProcess, args: &[&str]) -> String {
    let out = Command::new(agent_binary())
        .arg("--socket")
        .arg(agent.socket_path())
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "ratelimit {args:?}: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        agent.log()
    );
    String::from_utf8(out.stdout).unwrap()
}

/// h1 as h0 shows it in `peers --json` (one incarnation: h1 is never restarted here).
fn h1_at_h0(h0: &AgentProcess) -> Value {
    let peers: Value = serde_json::from_str(&cli(h0, &["peers", "--json"])).unwrap();
    let addr = gossip_addr(1).to_string();
    let h1: Vec<&Value> = peers["peers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["addr"] == addr.as_str())
        .collect();
    assert_eq!(h1.len(), 1, "{peers:#}");
    h1[0].clone()
}

fn charged(h1: &Value) -> u64 {
    h1["charged_pkts"].as_u64().unwrap()
}

/// One `peers --json` poll: when it started and ended (seconds after the stop), what it showed.
struct Poll {
    start: f64,
    end: f64,
    state: String,
    counted: bool,
}

/// Polls h1's entry at h0 every 20 ms for `secs` after `stop` (or until `until` holds).
fn watch(h0: &AgentProcess, stop: Instant, secs: f64, until: impl Fn(&Poll) -> bool) -> Vec<Poll> {
    let mut polls = Vec::new();
    while stop.elapsed().as_secs_f64() < secs {
        let start = stop.elapsed().as_secs_f64();
        let h1 = h1_at_h0(h0);
        let poll = Poll {
            start,
            end: stop.elapsed().as_secs_f64(),
            state: h1["state"].as_str().unwrap().to_string(),
            counted: h1["counted"] == true,
        };
        let done = until(&poll);
        polls.push(poll);
        if done {
            break;
        }
        thread::sleep(Duration::from_millis(20));
    }
    polls
}

/// Sends SIGCONT to a stopped agent when dropped (a failed assertion must not leave it stopped).
struct Stopped(libc::pid_t);

impl Stopped {
    fn new(agent: &AgentProcess) -> Self {
        let pid = agent.pid().unwrap();
        // SAFETY: kill has no memory-safety preconditions; `pid` is our unreaped child.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
        Self(pid)
    }
}

impl Drop for Stopped {
    fn drop(&mut self) {
        // SAFETY: as above.
        unsafe { libc::kill(self.0, libc::SIGCONT) };
    }
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

#[test]
fn a_stopped_peer_is_counted_until_the_timeout_then_silent_then_dead_and_counted_again_when_it_resumes(
) {
    require_root();
    let net = ClusterNet::new("rl-lv", 2).unwrap();
    let agents = net
        .start_agents(RATE, BURST, SYNC_MS, Duration::from_secs(30))
        .unwrap();
    let (h0, h1) = (&agents[0], &agents[1]);
    let timeout_ms = assert_the_peer_timeout(h0);
    // Connected: nothing is withheld at h0, which has no bucket of the source.
    let charged = flood_h1_until_h0_reads_its_key(&net, h0, "h1's key read at h0");
    assert_eq!(charged, 0);

    // 1. Stopped for 2 s, a second less than the timeout: counted and alive throughout.
    let short = TIMEOUT - 1.0;
    let polls = stop_h1_for(&net, h0, h1, short);
    assert_counted_alive_throughout(&polls, short);
    wait_until_h1_heard_again(h0);

    // 2. Stopped for longer: uncounted and silent at the timeout, dead from 2 timeouts on.
    let (stop, stopped) = stop_h1(h1);
    let polls = watch(h0, stop, 4.0 * TIMEOUT, |p| !p.counted);
    assert_uncounted_and_silent_at_the_timeout(&polls);
    assert_shown_silent(h0, timeout_ms);
    flood(&net, 1, 1.0);
    let polls = watch(h0, stop, 4.0 * TIMEOUT, |p| p.state == "dead");
    assert_silent_until_dead_within_two_timeouts(&polls);
    assert_shown_dead(h0);

    // Resumed: alive and counted again, its key read again.
    drop(stopped);
    wait_until_h1_counted_alive_again(h0);
    let charged = flood_h1_until_h0_reads_its_key(&net, h0, "h1's key read at h0 again");
    assert_eq!(charged, 0, "withheld at h0 without a bucket");

    stop_agents(agents);
    drop(net);
    assert_none_left("rl-lv-");
}

/// h0's peer timeout is [`TIMEOUT`], max(3 s, 10 x the sync interval), which every bound below
/// is drawn from. Returns it in ms.
fn assert_the_peer_timeout(h0: &AgentProcess) -> u64 {
    let status: Value = serde_json::from_str(&cli(h0, &["status", "--json"])).unwrap();
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "3000"
    )]
    let timeout_ms = (TIMEOUT * 1000.0) as u64;
    assert_eq!(status["cluster"]["peer_timeout_ms"], timeout_ms);
    timeout_ms
}

/// Floods h1 for 1 s and waits until h0 reads the key h1 publishes for the source (`what` names
/// the wait); returns what h0 shows h1 charged.
fn flood_h1_until_h0_reads_its_key(net: &ClusterNet, h0: &AgentProcess, what: &str) -> u64 {
    flood(net, 1, 1.0);
    wait_for(what, Duration::from_secs(10), || {
        (h1_at_h0(h0)["keys"].as_u64() >= Some(1)).then_some(())
    });
    charged(&h1_at_h0(h0))
}

/// Stops h1 (SIGSTOP: its XDP program goes on admitting, its gossip stops) until the guard it
/// returns is dropped; returns when it stopped too.
fn stop_h1(h1: &AgentProcess) -> (Instant, Stopped) {
    let stop = Instant::now();
    (stop, Stopped::new(h1))
}

/// Stops h1 for `secs` while 1.5 s of the flood reaches it, polling h1's entry at h0
/// meanwhile, then resumes it.
fn stop_h1_for(net: &ClusterNet, h0: &AgentProcess, h1: &AgentProcess, secs: f64) -> Vec<Poll> {
    let (stop, stopped) = stop_h1(h1);
    let (_, polls) = thread::scope(|s| {
        let sender = s.spawn(|| flood(net, 1, 1.5));
        let polls = watch(h0, stop, secs, |_| false);
        (sender.join().unwrap(), polls)
    });
    drop(stopped);
    polls
}

/// Stopped for `short` s, less than the timeout, h1 was counted and `alive` at h0 in every poll
/// (more than 10 of them): a peer is counted until its timeout.
fn assert_counted_alive_throughout(polls: &[Poll], short: f64) {
    let uncounted: Vec<String> = polls
        .iter()
        .filter(|p| !p.counted || p.state != "alive")
        .map(|p| {
            format!(
                "{:.2}-{:.2} s: {} counted {}",
                p.start, p.end, p.state, p.counted
            )
        })
        .take(5)
        .collect();
    assert!(
        uncounted.is_empty(),
        "stopped {short} s (timeout {TIMEOUT} s), h1 was not counted alive at h0: {uncounted:?}"
    );
    assert!(polls.len() > 10, "only {} polls", polls.len());
    println!(
        "stopped {short} s: counted alive in all {} polls",
        polls.len()
    );
}

/// Waits until h0 has heard h1 again (its heartbeat moved on), so that the next stop starts
/// from a peer just heard.
fn wait_until_h1_heard_again(h0: &AgentProcess) {
    wait_for("h1 heard again", Duration::from_secs(10), || {
        (h1_at_h0(h0)["last_heard_ms"].as_u64() < Some(2 * SYNC_MS)).then_some(())
    });
}

/// The last poll that showed h1 counted and the first that did not, printed (there must be
/// both: h1 counted right after the stop, uncounted by the end of the watch).
fn when_h1_went_uncounted(polls: &[Poll]) -> (&Poll, &Poll) {
    let first_uncounted = polls.iter().position(|p| !p.counted).unwrap_or_else(|| {
        panic!("h1 still counted {:.1} s after the stop", 4.0 * TIMEOUT);
    });
    assert!(first_uncounted > 0, "not counted right after the stop");
    let (last_counted, uncounted) = (&polls[first_uncounted - 1], &polls[first_uncounted]);
    println!(
        "stopped: last seen counted at {:.3} s, first seen uncounted ({}) at {:.3} s; timeout {TIMEOUT} s",
        last_counted.start, uncounted.state, uncounted.end
    );
    (last_counted, uncounted)
}

/// h0 stops counting h1 at the timeout: not [`EARLY`] or more before it, nor [`LATE`] after
/// (each derived from the sync round and gossip interval above), and shows it `silent` then.
fn assert_uncounted_and_silent_at_the_timeout(polls: &[Poll]) {
    let (last_counted, uncounted) = when_h1_went_uncounted(polls);
    assert!(
        last_counted.start >= TIMEOUT - EARLY,
        "h1 uncounted before {:.3} s, {EARLY} s or more before the timeout",
        last_counted.start
    );
    assert!(
        uncounted.end <= TIMEOUT + LATE,
        "h1 still counted until {:.3} s (timeout {TIMEOUT} s + {LATE} s)",
        uncounted.end
    );
    assert_eq!(
        uncounted.state, "silent",
        "uncounted at the timeout: silent"
    );
}

/// What a user sees meanwhile (the dead state is more than 2.5 s away): h1 `silent` in h0's
/// `peers` table, and in `peers --json` silent, uncounted, last heard a timeout or more ago.
fn assert_shown_silent(h0: &AgentProcess, timeout_ms: u64) {
    let table = cli(h0, &["peers"]);
    let row = table
        .lines()
        .find(|l| l.contains(&gossip_addr(1).to_string()))
        .unwrap_or_else(|| panic!("no row for h1:\n{table}"));
    assert!(row.contains("silent"), "peers table:\n{table}");
    let h1_json = h1_at_h0(h0);
    assert_eq!(
        (h1_json["state"].as_str(), &h1_json["counted"]),
        (Some("silent"), &Value::Bool(false)),
        "{h1_json:#}"
    );
    assert!(
        h1_json["last_heard_ms"].as_u64().unwrap() >= timeout_ms,
        "{h1_json:#}"
    );
}

/// The last poll that showed h1 not dead and the first that showed it dead, printed with the
/// span allowed (there must be both: h1 not dead when the silence was checked, dead by the end
/// of the watch).
fn when_h1_went_dead(polls: &[Poll]) -> (&Poll, &Poll) {
    let dead = polls
        .iter()
        .position(|p| p.state == "dead")
        .unwrap_or_else(|| panic!("h1 not dead {:.1} s after the stop", 4.0 * TIMEOUT));
    assert!(dead > 0, "dead already when the silence was checked");
    let (last_silent, dead) = (&polls[dead - 1], &polls[dead]);
    println!(
        "stopped: last seen {} at {:.3} s, first seen dead at {:.3} s; want {:.1}-{:.1} s",
        last_silent.state,
        last_silent.start,
        dead.end,
        DEAD_AFTER * TIMEOUT,
        PHI_THRESHOLD * TIMEOUT
    );
    (last_silent, dead)
}

/// h1 stays `silent` from the timeout until it is `dead`, which it is from [`DEAD_AFTER`]
/// timeouts on (less [`EARLY`]) and by [`PHI_THRESHOLD`] timeouts (plus [`LATE`] and a gossip
/// interval, as chitchat updates liveness every gossip interval).
fn assert_silent_until_dead_within_two_timeouts(polls: &[Poll]) {
    let (last_silent, dead) = when_h1_went_dead(polls);
    let states: Vec<&str> = polls.iter().map(|p| p.state.as_str()).collect();
    assert!(
        states[..polls.len() - 1].iter().all(|s| *s == "silent"),
        "between the timeout and the death: {states:?}"
    );
    assert!(
        last_silent.start >= DEAD_AFTER * TIMEOUT - EARLY,
        "dead before {:.3} s",
        last_silent.start
    );
    // chitchat updates liveness every gossip interval (100 ms) more.
    assert!(
        dead.end <= PHI_THRESHOLD * TIMEOUT + LATE + 0.1,
        "not dead until {:.3} s",
        dead.end
    );
}

/// h1 `dead` in h0's `peers` table, as a user sees it.
fn assert_shown_dead(h0: &AgentProcess) {
    let table = cli(h0, &["peers"]);
    assert!(
        table
            .lines()
            .any(|l| l.contains(&gossip_addr(1).to_string()) && l.contains("dead")),
        "peers table:\n{table}"
    );
}

/// Waits until h0 shows h1, just resumed, `alive` and counted again, and prints how long that
/// took.
fn wait_until_h1_counted_alive_again(h0: &AgentProcess) {
    let resumed = Instant::now();
    wait_for("h1 counted alive again", Duration::from_secs(10), || {
        let h1 = h1_at_h0(h0);
        (h1["state"] == "alive" && h1["counted"] == true).then_some(())
    });
    println!(
        "resumed: counted alive again after {:.2} s",
        resumed.elapsed().as_secs_f64()
    );
}
