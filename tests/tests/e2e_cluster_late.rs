//! An agent stalled past its shares' lag allowance says so: two real agents share a cluster
//! budget (sync 100 ms, so the shares a round writes hold for 300 ms); one source sends to both
//! hosts while host 0's agent is stopped (SIGSTOP) for 700 ms and continued. Its status then
//! shows the round that renewed the shares as late (`cluster.late_rounds`, `late_ms` at least
//! the stop less a round) with the shares lapsed for the stop less the 300 ms allowance
//! (`lapsed_ms`),
//! and `rounds_late` counted it; the other agent, never stopped, shows no lapse. These are what
//! the convergence and accuracy tests read to tell a stalled machine from the limiter.

use std::time::{Duration, Instant};

use ratelimit_testbed::cluster::stop_agents;
use ratelimit_testbed::{
    assert_none_left,
    cluster_net::{status, ClusterNet, Split},
    require_root,
};

const STOP: Duration = Duration::from_millis(700);
/// The shares' lag allowance: 3 sync intervals of 100 ms.
const ALLOWANCE_MS: u64 = 300;

#[test]
fn a_stopped_agent_reports_its_late_round_and_how_long_its_shares_lapsed() {
    require_root();
    let net = ClusterNet::new("rl-clate", 2).unwrap();
    let agents = net
        .start_agents(1000, 100, 100, Duration::from_secs(30))
        .unwrap();
    let _receivers = net.receivers().unwrap();
    let start = Instant::now();
    let sender = net
        .flood(
            vec![Split {
                end: 4.0,
                pps: 200.0,
                weights: vec![0.8, 0.2],
            }],
            start,
        )
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let pid = agents[0].pid().expect("agent h0 runs");
    // SAFETY: signals to a child process of this test.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    std::thread::sleep(STOP);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    let _ = sender.join().unwrap();

    let s0 = status(&agents[0]).unwrap();
    let s1 = status(&agents[1]).unwrap();
    let rounds = s0["cluster"]["late_rounds"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    println!("h0 late rounds: {rounds:?}");
    let stop_ms = u64::try_from(STOP.as_millis()).unwrap();
    let worst = rounds
        .iter()
        .max_by_key(|r| r["late_ms"].as_u64().unwrap_or(0))
        .unwrap_or_else(|| panic!("h0 reports no late round: {}", s0["cluster"]));
    let late = worst["late_ms"].as_u64().unwrap();
    let lapsed = worst["lapsed_ms"].as_u64().unwrap();
    assert!(
        late >= stop_ms - 100,
        "h0's worst round was {late} ms late, stopped {stop_ms} ms"
    );
    assert!(
        lapsed >= stop_ms - ALLOWANCE_MS - 100 && lapsed <= late,
        "h0's shares lapsed for {lapsed} ms, stopped {stop_ms} ms with a {ALLOWANCE_MS} ms allowance"
    );
    assert!(s0["cluster"]["counters"]["rounds_late"].as_u64().unwrap() >= 1);
    assert!(
        s0["cluster"]["counters"]["charges_clamped"]
            .as_u64()
            .unwrap()
            >= 1,
        "the round after the stop ran later than the allowance"
    );
    let lapsed_h1: Vec<_> = s1["cluster"]["late_rounds"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .into_iter()
        .filter(|r| r["lapsed_ms"].as_u64().unwrap_or(0) > 0)
        .collect();
    assert!(lapsed_h1.is_empty(), "h1 was never stopped: {lapsed_h1:?}");

    drop(_receivers);
    stop_agents(agents);
    drop(net);
    assert_none_left("rl-clate-");
}
