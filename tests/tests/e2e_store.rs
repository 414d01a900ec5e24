//! The bucket store against colliding sources, end to end: the real agent on a veth in a fresh
//! namespace, real UDP from sources chosen (after reading the agent's seed from its pins, as an
//! attacker who had it would) to share both sets of the store, plus the pair that shared a slot of
//! the old first-seen table. Each is held to its own bucket; the program's counters and `status`
//! say what happened; the seed is never shown.

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    thread,
    time::Duration,
};

use ratelimit_testbed::{
    add_addr,
    agent_proc::global_counter,
    collide::{colliding_v4, old_first_seen_pair, store_params},
    neigh_to_peer, require_root, send_udp_from, veth_pair, AgentProcess, Netns, Receiver,
};

const RATE: u64 = 1;
const BURST: u64 = 5;
const RECEIVER: Ipv4Addr = Ipv4Addr::new(198, 19, 255, 254);

#[test]
#[expect(clippy::cast_precision_loss, reason = "small counts and seconds")]
fn colliding_sources_each_get_their_own_bucket_end_to_end() {
    require_root();
    let tx = Netns::new("rl-e2e-store-tx").unwrap();
    let rx = Netns::new("rl-e2e-store-rx").unwrap();
    let (tx_if, rx_if) = veth_pair(&tx, &rx, "st").unwrap();
    add_addr(&rx, &rx_if, &format!("{RECEIVER}/15")).unwrap();
    neigh_to_peer(&tx, &tx_if, IpAddr::V4(RECEIVER), &rx, &rx_if).unwrap();
    // A store of 64 records (16 sets), so that eight sources on one set pair are quick to find.
    let config = format!(
        "[agent]\ninterfaces = [\"{rx_if}\"]\nmax_buckets = 64\n\n\
         [[rule]]\nname = \"l\"\nsource = \"198.18.0.0/15\"\nrate = {RATE}\nburst = {BURST}\n"
    );
    let agent = AgentProcess::start(&rx, &config, &[]).unwrap();
    let (seed, sets) = store_params(agent.pin_path()).unwrap();
    assert_eq!(sets, 16);
    assert_ne!(seed, [0, 0], "no seed drawn");
    let rule = 0; // The only rule of a fresh agent.
    let base = Ipv4Addr::new(198, 18, 0, 0);
    let (a, b) = old_first_seen_pair(rule, base, 16).unwrap();
    let mut sources = colliding_v4(seed, sets, rule, base, 16, 8, &[a, b, RECEIVER]).unwrap();
    sources.extend([a, b]);
    for s in &sources {
        add_addr(&tx, &tx_if, &format!("{s}/15")).unwrap();
    }

    let receiver = Receiver::bind(&rx, SocketAddr::new(IpAddr::V4(RECEIVER), 0)).unwrap();
    let dst = receiver.local_addr();
    // Every source at 200 pps for 1 s, all at once: their packets interleave on the wire.
    let reports: Vec<_> = thread::scope(|s| {
        let tx = &tx;
        let handles: Vec<_> = sources
            .iter()
            .map(|&src| {
                s.spawn(move || {
                    send_udp_from(
                        tx,
                        SocketAddr::new(IpAddr::V4(src), 0),
                        dst,
                        200,
                        Duration::from_secs(1),
                        64,
                    )
                    .unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    receiver.wait_idle(Duration::from_millis(200), Duration::from_secs(5));
    let counts = receiver.stop().unwrap().counts();
    let first = reports.iter().map(|r| r.first).min().unwrap();
    let last = reports.iter().map(|r| r.last).max().unwrap();
    let secs = (last - first).as_secs_f64();
    let bound = BURST + (RATE as f64 * secs).ceil() as u64;
    for (src, r) in sources.iter().zip(&reports) {
        let got = counts.get(&IpAddr::V4(*src)).copied().unwrap_or(0);
        println!(
            "{src}: sent {}, received {got} (bound {bound} over {secs:.2} s)",
            r.sent
        );
        assert!(r.sent >= 100, "{src} sent only {}", r.sent);
        assert!(
            (BURST..=bound).contains(&got),
            "{src} got {got} through: its own bucket allows {BURST}..={bound}"
        );
    }

    let stats = agent.stats();
    assert_eq!(global_counter(&stats, "new_buckets"), sources.len() as u64);
    assert_eq!(global_counter(&stats, "evicted_lost"), 0);
    assert_eq!(global_counter(&stats, "evicted_full"), 0);
    let status = agent.cli_json(&["status"]);
    assert_eq!(status["buckets_tracked"], sources.len());
    assert_eq!(status["buckets_evicted"]["lost"], 0);
    assert_eq!(status["buckets_capacity"], 64);

    // The seed is a secret: no command output and no log line shows it.
    let mut shown = vec![agent.log()];
    for args in [
        &["status"][..],
        &["status", "--json"],
        &["stats"],
        &["stats", "--json"],
        &["top", "--json"],
        &["explain", "198.18.0.1", "--json"],
        &["rules", "list", "--json"],
    ] {
        shown.push(agent.cli_ok(args));
    }
    for text in &shown {
        for word in seed {
            for form in [
                word.to_string(),
                format!("{word:x}"),
                format!("{word:X}"),
                (word as i64).to_string(),
            ] {
                assert!(
                    !text.contains(&form),
                    "the seed word {form} is shown:\n{text}"
                );
            }
        }
    }
    assert!(agent.stop().unwrap().success());
}
