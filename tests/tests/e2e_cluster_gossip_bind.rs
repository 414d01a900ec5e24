//! A gossip address taken by another process (any local user can bind an unprivileged UDP port
//! first), end to end: the agent must start and enforce anyway, alone (fail open, as when its
//! peers are silent), say so loudly (log, `status --json`, the `ratelimit_cluster_gossip_up`
//! gauge), and join the cluster once the address is free. It used to exit after attaching,
//! removing every attachment and pin (including state adopted from a previous agent).

use std::net::{IpAddr, SocketAddr};
use std::thread;
use std::time::{Duration, Instant};

use ratelimit_testbed::{
    bind_udp,
    cluster_net::{counted_peers, data_ip, gossip_addr, status, ClusterNet, FLOOD},
    in_netns, require_root, send_udp, AgentProcess, Receiver,
};

const RATE: u64 = 10;
const BURST: u64 = 100;
const SYNC_MS: u64 = 100;

#[test]
#[expect(
    clippy::cast_possible_truncation,
    clippy::cast_sign_loss,
    reason = "small positive times"
)]
fn a_taken_gossip_address_leaves_the_host_enforcing_alone_until_it_binds() {
    require_root();
    let net = ClusterNet::new("rl-gb", 2).unwrap();
    let h0_gossip = gossip_addr(0);
    // Another process holds h0's gossip address.
    let holder = in_netns(&net.hosts[0].ns, || std::net::UdpSocket::bind(h0_gossip)).unwrap();

    let mut h0 =
        AgentProcess::start(&net.hosts[0].ns, &net.config(0, RATE, BURST, SYNC_MS), &[]).unwrap();
    thread::sleep(Duration::from_millis(500));
    assert!(
        h0.is_running(),
        "the agent exited with its gossip address taken; log:\n{}",
        h0.log()
    );
    let log = h0.log();
    let line = log
        .lines()
        .find(|l| l.contains("cluster gossip NOT running") && l.contains(&h0_gossip.to_string()))
        .unwrap_or_else(|| panic!("no error naming {h0_gossip} in the log:\n{log}"));
    assert!(line.to_ascii_lowercase().contains("in use"), "{line}");
    let s = status(&h0).unwrap();
    let cluster = &s["cluster"];
    println!("h0 cluster status while the address is taken: {cluster}");
    assert_eq!(cluster["gossip"], "restarting", "{cluster}");
    let error = cluster["gossip_error"].as_str().unwrap_or_default();
    assert!(
        error.contains(&h0_gossip.to_string()) && error.to_ascii_lowercase().contains("in use"),
        "{error:?}"
    );
    assert_eq!(cluster["budget_share"], 1.0, "alone: the whole budget");

    // Enforcing alone: 300 packets in 100 ms against a burst of 100.
    let receiver =
        Receiver::bind(&net.hosts[0].ns, SocketAddr::new(IpAddr::V4(data_ip(0)), 0)).unwrap();
    let sock = bind_udp(&net.tx, SocketAddr::new(IpAddr::V4(FLOOD), 0)).unwrap();
    let sent = send_udp(
        &sock,
        receiver.local_addr(),
        3000,
        Duration::from_millis(100),
        64,
    )
    .unwrap();
    receiver.wait_idle(Duration::from_millis(300), Duration::from_secs(5));
    let got = receiver.stop().unwrap().counts()[&IpAddr::V4(FLOOD)];
    let t = (sent.last - sent.first).as_secs_f64();
    println!("sent {} in {t:.3} s, received {got}", sent.sent);
    assert!(sent.sent >= 200, "sent only {}", sent.sent);
    let refill = 2 + (t * RATE as f64).ceil() as u64;
    assert!(
        (BURST..=BURST + refill).contains(&got),
        "received {got} of {}: want the burst of {BURST} (+ {refill}): not enforcing",
        sent.sent
    );

    // The peer starts; the address is freed: h0 binds it (retried with backoff) and the two
    // count each other.
    let h1 =
        AgentProcess::start(&net.hosts[1].ns, &net.config(1, RATE, BURST, SYNC_MS), &[]).unwrap();
    drop(holder);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (s0, s1) = (status(&h0).unwrap(), status(&h1).unwrap());
        if s0["cluster"]["gossip"] == "running"
            && counted_peers(&s0) == [gossip_addr(1).to_string()]
            && counted_peers(&s1) == [h0_gossip.to_string()]
        {
            assert_eq!(s0["cluster"]["gossip_error"], serde_json::Value::Null);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "h0 never joined after its gossip address was freed: {}\nh0 log:\n{}",
            s0["cluster"],
            h0.log()
        );
        thread::sleep(Duration::from_millis(200));
    }
    for agent in [h1, h0] {
        let status = agent.stop().unwrap();
        assert!(status.success(), "agent exited with {status}");
    }
}
