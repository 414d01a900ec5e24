//! A cluster member holding the key, turned against the cluster, end to end: two real agents (h0,
//! h1) share a `scope = "cluster"` rule; an attacker in its own namespace on the gossip link
//! speaks the real sealed protocol (chitchat over the agent's own transport, see
//! `ratelimit_testbed::cluster::Attacker`) and
//! - claims a victim source's consumption at 100x the rule's rate, from five identities of its
//!   own (each at an address it sends from: ports of its own) and from forged ones: an id at an
//!   address nobody sends from, an id at h1's address (a newer "incarnation" of h1) and an older
//!   incarnation at its own address;
//! - publishes five times `max_keys` keys.
//!
//! What must hold (docs/cluster.md, "What a peer with the key can do", "Which members count", "What a
//! peer can store here"): the claims take at most the victim's refill at h0, `rate x (T + 3 x
//! sync_interval_ms)` over the attack's span T whatever the number of identities, nothing is cut
//! (`charges_clamped` does not move: demand is not bounded, its effect is), and the victim,
//! sending under its budget at h0, loses no more than that plus its burst; after the attacker
//! stops it is admitted in full again within 1 s (10 sync intervals; the charging of claimed
//! admissions of before needed the debt cap's `counted peers x (burst / rate + 3 x sync)`, here
//! 6 x 0.8 s); no forged id is counted and h1 stays counted; no agent stores more than `max_keys` keys and the sync key of any member. Then a datagram that h0
//! sealed for the attacker, replayed to h1 from h0's address, is rejected (`rejected{auth}`).
//!
//! A forged reading dated ahead (a sync key 10^12 ms in the future, the victim's key at the
//! largest epoch and demand) is refused and does not keep the victim blocked.
//!
//! And a gossip socket error (EMFILE: h0's agent runs out of file descriptors, lowered with
//! prlimit while it runs, when a new peer address sends it an authentic datagram) ends the
//! gossip loop: `status` shows `restarting` and the error, the loop is restarted once the limit
//! is back, h1 is counted again, and `gossip_restarts` (status, metrics) counts it.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::thread;
use std::time::{Duration, Instant};

use chitchat::ChitchatId;
use ratelimit::cluster::key::ClusterKey;
use ratelimit::cluster::wire::Codec;
use ratelimit_testbed::cluster::{
    cli, cluster, counted, counter, metric, peers, scrape, stop_agents, unix_ms, wait_for,
    Attacker, Identity, METRICS,
};
use ratelimit_testbed::cluster_net::{data_ip, gossip_addr, ClusterNet, GOSSIP_PORT, SECRET};
use ratelimit_testbed::{
    bind_udp, bind_udp_transparent, require_root, send_udp, AgentProcess, Receiver,
};
use serde_json::Value;

const CLUSTER_ID: &str = "e2e-attack";
const RATE: u64 = 1000;
const BURST: u64 = 500;
const SYNC_MS: u64 = 100;
/// docs/cluster.md's lag allowance: 3 sync intervals.
const LAG_SECS: f64 = 3.0 * SYNC_MS as f64 / 1000.0;
const MAX_KEYS: usize = 20;
const VICTIM: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 100);
/// The victim's rate at h0: half the budget, all of it admitted while nobody lies.
const VICTIM_PPS: u64 = 500;
const PAYLOAD: usize = 64;
const ATTACKER_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 9);
/// Identities of the attacker's own beyond its first, each at a port of its own.
const EXTRA_SENDERS: u16 = 4;

fn config(net: &ClusterNet, i: usize, extra_seeds: &[SocketAddr]) -> String {
    let mut seeds: Vec<String> = (0..2)
        .filter(|&j| j != i)
        .map(|j| gossip_addr(j).to_string())
        .collect();
    seeds.extend(extra_seeds.iter().map(ToString::to_string));
    format!(
        r#"[agent]
interfaces = ["{}"]
metrics = "{METRICS}"

[[rule]]
name = "cl"
source = "198.18.0.0/24"
rate = {RATE}
burst = {BURST}
scope = "cluster"

[cluster]
listen = "{}"
seeds = {seeds:?}
key_file = "{}"
sync_interval_ms = {SYNC_MS}
cluster_id = "{CLUSTER_ID}"
max_keys = {MAX_KEYS}
"#,
        net.hosts[i].data_if,
        gossip_addr(i),
        net.key_file.display()
    )
}

fn start(net: &ClusterNet, extra_seeds: &[SocketAddr]) -> Vec<AgentProcess> {
    let agents: Vec<AgentProcess> = (0..2)
        .map(|i| {
            AgentProcess::start(&net.hosts[i].ns, &config(net, i, extra_seeds), &[])
                .unwrap_or_else(|e| panic!("agent h{i}: {e:#}"))
        })
        .collect();
    wait_for("the cluster to form", Duration::from_secs(20), || {
        agents
            .iter()
            .all(|a| counted(&cluster(a)).len() == 1)
            .then_some(())
    });
    agents
}

/// Sends the victim's traffic to h0 for `secs`: (sent, received).
fn victim(net: &ClusterNet, secs: f64) -> (u64, u64) {
    let dst = SocketAddr::new(IpAddr::V4(data_ip(0)), 9000);
    let receiver = Receiver::bind(&net.hosts[0].ns, dst).unwrap();
    let sock = bind_udp(&net.tx, SocketAddr::new(IpAddr::V4(VICTIM), 0)).unwrap();
    let sent = send_udp(
        &sock,
        dst,
        VICTIM_PPS,
        Duration::from_secs_f64(secs),
        PAYLOAD,
    )
    .unwrap();
    receiver.wait_idle(Duration::from_millis(200), Duration::from_secs(5));
    let got = receiver
        .stop()
        .unwrap()
        .counts()
        .get(&IpAddr::V4(VICTIM))
        .copied()
        .unwrap_or(0);
    (sent.sent, got)
}

/// The network: two hosts, the victim on the sender, and a gossip-only namespace `{tag}-x` at
/// [`ATTACKER_IP`] for the attacker.
fn net(tag: &str) -> (ClusterNet, ratelimit_testbed::Netns) {
    require_root();
    let net = ClusterNet::new(tag, 2).unwrap();
    net.add_source(VICTIM).unwrap();
    let (ans, _) = net.gossip_only(&format!("{tag}-x"), ATTACKER_IP).unwrap();
    (net, ans)
}

fn peer_named<'a>(c: &'a [Value], name: &str) -> Vec<&'a Value> {
    c.iter().filter(|p| p["node_id"] == name).collect()
}

/// The scenario of the module's documentation, in order: nobody lies, the attack and its
/// bound, no forged id counted, the victim whole again once the attacker stops, a replay refused.
#[test]
fn a_key_holding_attacker_is_bounded_by_its_own_bucket_forges_nobody_and_stores_max_keys() {
    let (net, ans) = net("rl-ca");
    // A plain socket at the attacker's, named as a seed by h0: it receives genuine datagrams
    // sealed by h0 for it (chitchat sends Syns to seeds), to replay elsewhere.
    let capture = bind_udp(&ans, SocketAddr::new(IpAddr::V4(ATTACKER_IP), 7999)).unwrap();
    let agents = start(&net, &[capture.local_addr().unwrap()]);
    let (h0, h1) = (&agents[0], &agents[1]);

    // Nobody lies yet: the victim, at half the budget, loses nothing.
    let (sent, got) = victim(&net, 2.0);
    println!("before the attack: victim sent {sent}, h0 admitted {got}");
    assert_eq!(got, sent, "the victim lost packets before any attack");

    let h1_generation = peers(&cluster(h0))
        .iter()
        .find(|p| p["counted"] == true)
        .and_then(|p| p["generation"].as_u64())
        .expect("h1's generation at h0");
    let attacker = Attacker::start(
        &ans,
        CLUSTER_ID,
        &[gossip_addr(0), gossip_addr(1)],
        identities(h1_generation),
    );
    attacker.claims(|c| {
        c.keys = vec![(("cl".to_string(), IpAddr::V4(VICTIM)), 0)];
        c.junk = 5 * MAX_KEYS;
    });
    every_identity_known_and_its_own_counted(h0);
    let during = claims_take_at_most_the_victims_refill(&net, h0, &attacker, h1_generation);
    no_forged_id_counted_and_max_keys_stored(&agents, &during, h1_generation);
    the_victim_is_whole_again_once_the_attacker_stops(&net, attacker);
    a_replayed_datagram_fails_authentication(&net, &ans, &capture, h1);

    drop(ans);
    stop_agents(agents);
}

/// The attacker's address.
fn me() -> SocketAddr {
    SocketAddr::new(IpAddr::V4(ATTACKER_IP), GOSSIP_PORT)
}

/// Identities named by the forged ones' prefixes.
const FORGED: [&str; 2] = ["ghost", "impostor"];

/// The attacker's identities: its own, forged ones (at an address nobody sends from, a newer
/// incarnation of h1 at h1's address, an older one at its own address) and
/// [`EXTRA_SENDERS`] more of its own.
fn identities(h1_generation: u64) -> Vec<Identity> {
    let me = me();
    let at = |port: u16| SocketAddr::new(IpAddr::V4(ATTACKER_IP), port);
    let generation = unix_ms();
    let nobody = SocketAddr::new(IpAddr::V4(Ipv4Addr::new(198, 18, 1, 200)), GOSSIP_PORT);
    let ids = vec![
        Identity {
            id: ChitchatId::new(format!("attacker/{me}"), generation, me),
            bind: me,
        },
        // Named at an address that never sends anything.
        Identity {
            id: ChitchatId::new(format!("ghost/{nobody}"), generation, nobody),
            bind: at(7947),
        },
        // A "newer incarnation" of h1, at h1's address.
        Identity {
            id: ChitchatId::new(
                format!("impostor/{}", gossip_addr(1)),
                h1_generation + 1_000_000,
                gossip_addr(1),
            ),
            bind: at(7948),
        },
        // An older incarnation at the attacker's own address.
        Identity {
            id: ChitchatId::new(format!("attacker/{me}"), generation - 1_000, me),
            bind: at(7949),
        },
    ];
    // And more identities of its own, each at an address it sends from (another port): these
    // are members like any other (docs/cluster.md says so), each with an allowance of its own, and
    // the debt cap must hold whatever their number.
    let mut ids = ids;
    ids.extend((0..EXTRA_SENDERS).map(|k| {
        let a = at(7950 + k);
        Identity {
            id: ChitchatId::new(format!("sender{k}/{a}"), generation, a),
            bind: a,
        }
    }));
    ids
}

/// Identities of the attacker's own, each at an address it sends from.
fn senders() -> usize {
    1 + usize::from(EXTRA_SENDERS)
}

/// Heard and counted (its claims so far, zero, are its baseline), the identities all known.
fn every_identity_known_and_its_own_counted(h0: &AgentProcess) {
    let (me, senders, forged) = (me(), senders(), FORGED);
    wait_for("h0 to count the attacker", Duration::from_secs(20), || {
        let c = peers(&cluster(h0));
        let named = |prefix: &str| {
            c.iter()
                .any(|p| p["node_id"].as_str().is_some_and(|n| n.starts_with(prefix)))
        };
        let counted_senders = c
            .iter()
            .filter(|p| {
                p["counted"] == true
                    && p["node_id"]
                        .as_str()
                        .is_some_and(|n| n.starts_with("attacker/") || n.starts_with("sender"))
            })
            .count();
        (peer_named(&c, &format!("attacker/{me}"))
            .iter()
            .any(|p| p["counted"] == true)
            && counted_senders == senders
            && forged.iter().all(|f| named(f)))
        .then_some(())
    });
}

/// The attack: 100x the rule's rate claimed for the victim, every round, by every identity,
/// while the victim sends at half the budget. What the claims can take: the victim's refill at
/// h0 over the span (and the lag allowance a late round may take back), whatever the number of
/// identities; the victim can lose that and its burst, and nothing is cut. Returns h0's status
/// during the attack.
fn claims_take_at_most_the_victims_refill(
    net: &ClusterNet,
    h0: &AgentProcess,
    attacker: &Attacker,
    h1_generation: u64,
) -> Value {
    let senders = senders();
    let c0 = cluster(h0);
    let charged_before = counter(&c0, "charged_pkts");
    let clamped_before = counter(&c0, "charges_clamped");
    attacker.claims(|c| c.per_round = 100 * RATE / 10);
    let began = Instant::now();
    let (sent, got) = victim(net, 4.0);
    let during = cluster(h0);
    attacker.claims(|c| c.per_round = 0);
    let span = began.elapsed().as_secs_f64();
    let lost = sent - got;
    let ps = peers(&during);
    // Every member but the real h1 is one of the attacker's identities.
    let is_h1 = |p: &Value| p["generation"].as_u64() == Some(h1_generation);
    let charged_by_attackers: u64 = ps
        .iter()
        .filter(|p| !is_h1(p))
        .map(|p| p["charged_pkts"].as_u64().unwrap_or(0))
        .sum();
    let counted_attackers = ps
        .iter()
        .filter(|p| p["counted"] == true && !is_h1(p))
        .count();
    // What the claims can take: the victim's refill at h0 over the span (and the lag allowance
    // a late round may take back), whatever the number of identities; the victim can lose that
    // and its burst.
    #[expect(clippy::cast_precision_loss, reason = "small counts")]
    let bound = RATE as f64 * (span + LAG_SECS);
    #[expect(clippy::cast_precision_loss, reason = "small counts")]
    let lost_bound = bound + BURST as f64;
    println!(
        "attack over {span:.2} s: victim sent {sent}, h0 admitted {got} (lost {lost}); h0 charged \
         the attacker identities {charged_by_attackers} packets of refill (bound {bound:.0}, \
         {counted_attackers} counted), clamped {} times; peers at h0: {:#}",
        counter(&during, "charges_clamped") - clamped_before,
        Value::Array(ps.clone())
    );
    assert!(
        counter(&during, "charged_pkts") > charged_before,
        "h0 charged nothing for the attacker's claims: the test did not attack"
    );
    assert_eq!(
        counter(&during, "charges_clamped"),
        clamped_before,
        "a round ran late, or claims were cut: neither should happen here"
    );
    assert_eq!(
        counted_attackers, senders,
        "forged identities counted (or senders not): {during:#}"
    );
    #[expect(clippy::cast_precision_loss, reason = "small counts")]
    {
        assert!(
            charged_by_attackers as f64 <= bound,
            "h0 withheld {charged_by_attackers} packets of refill for the attacker, more than \
             the victim's refill rate x (T + 3 x sync) = {bound:.0}"
        );
        assert!(
            lost as f64 <= lost_bound,
            "the victim lost {lost} packets, more than its refill and burst {lost_bound:.0}"
        );
    }
    during
}

/// No forged id counted, at either agent; h1 still counted at h0, as itself.
fn no_forged_id_counted_and_max_keys_stored(
    agents: &[AgentProcess],
    during: &Value,
    h1_generation: u64,
) {
    let forged = FORGED;
    for (i, a) in agents.iter().enumerate() {
        let c = cluster(a);
        for p in peers(&c) {
            let name = p["node_id"].as_str().unwrap_or("");
            if forged.iter().any(|f| name.starts_with(f)) {
                assert_eq!(p["counted"], false, "h{i} counts the forged id {p}");
                assert_eq!(p["charged_pkts"], 0, "h{i} charged the forged id {p}");
            }
            // Stored: at most max_keys and the sync key of anyone, whatever they publish.
            let stored = p["stored_keys"].as_u64().unwrap();
            assert!(
                stored <= MAX_KEYS as u64 + 1,
                "h{i} stores {stored} keys of {name} (max_keys {MAX_KEYS})"
            );
        }
        assert!(counter(&c, "keys_dropped") > 0, "h{i}: {c}");
    }
    let h1_at_h0: Vec<Value> = peers(during)
        .into_iter()
        .filter(|p| p["generation"].as_u64() == Some(h1_generation))
        .collect();
    assert!(
        h1_at_h0.len() == 1 && h1_at_h0[0]["counted"] == true,
        "h1 is no longer counted at h0: {during:#}"
    );
}

/// The attacker stops: the victim is admitted in full again within 1 s (the claims'
/// demand leaves the figures within a few rounds, and a bucket owes at most one round).
fn the_victim_is_whole_again_once_the_attacker_stops(net: &ClusterNet, attacker: Attacker) {
    attacker.stop();
    let stopped = Instant::now();
    thread::sleep(Duration::from_secs(1));
    let (sent, got) = victim(net, 2.0);
    println!(
        "{:.1} s after the attacker stopped: victim sent {sent}, h0 admitted {got}",
        stopped.elapsed().as_secs_f64()
    );
    assert_eq!(
        got, sent,
        "the victim still loses packets 1 s after the attack"
    );
}

/// Replay: a datagram h0 sealed for the attacker's capture socket, sent to h1 from h0's
/// gossip address, fails authentication there.
fn a_replayed_datagram_fails_authentication(
    net: &ClusterNet,
    ans: &ratelimit_testbed::Netns,
    capture: &std::net::UdpSocket,
    h1: &AgentProcess,
) {
    // What queued up since the start may be older than the 30 s a datagram is accepted for:
    // drop it, and take the next one h0 sends.
    let mut buf = vec![0; 65_536];
    capture.set_nonblocking(true).unwrap();
    while capture.recv_from(&mut buf).is_ok() {}
    capture.set_nonblocking(false).unwrap();
    capture
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    // h1 may gossip to the capture socket too: take h0's next datagram.
    let (len, from) = loop {
        let (len, from) = capture.recv_from(&mut buf).expect("h0 gossips to its seed");
        if from == gossip_addr(0) {
            break (len, from);
        }
    };
    let key = ClusterKey::from_secret(format!("{SECRET}\n").as_bytes(), CLUSTER_ID).unwrap();
    let opened = Codec::new(&key, CLUSTER_ID, capture.local_addr().unwrap()).open(
        &buf[..len],
        from,
        unix_ms(),
    );
    assert!(
        matches!(opened, Ok(Some(_))),
        "the captured datagram is genuine and sealed for the capture socket: {opened:?}"
    );
    let spoof = bind_udp_transparent(ans, gossip_addr(0)).unwrap();
    let before = counter(&cluster(h1), "rejected_auth");
    spoof.send_to(&buf[..len], gossip_addr(1)).unwrap();
    let after = wait_for("h1 to reject the replay", Duration::from_secs(5), || {
        let n = counter(&cluster(h1), "rejected_auth");
        (n > before).then_some(n)
    });
    thread::sleep(Duration::from_millis(300));
    assert_eq!(
        counter(&cluster(h1), "rejected_auth"),
        before + 1,
        "one replayed datagram, one rejection"
    );
    println!("replayed to h1 from h0's address: rejected_auth {before} -> {after}");
    assert!(
        metric(
            &scrape(&net.hosts[1].ns),
            r#"ratelimit_cluster_rejected_total{reason="auth"}"#
        ) >= (before + 1) as f64
    );
}

/// A key-holding member publishes once (and holds for half a second) a sync key dated 10^12 ms
/// ahead with the largest epoch, and the victim's key at the largest epoch and demand
/// (`u64::MAX:0:0:u64::MAX`), then goes on publishing as before (its claims gaining nothing).
/// Were that reading kept as the newest, every real one after it would look older, the
/// victim's demand at the attacker would read ~1.8e10 pps for as long as the attacker's sync
/// key moved, and the victim, under its budget at h0, would be starved. The reading is refused
/// (`readings_refused`), and the victim is admitted in full within 1 s of it while the attacker
/// goes on gossiping.
#[test]
fn a_forged_reading_dated_ahead_does_not_keep_a_source_blocked() {
    let (net, ans) = net("rl-cf");
    let agents = start(&net, &[]);
    let h0 = &agents[0];
    let me = SocketAddr::new(IpAddr::V4(ATTACKER_IP), GOSSIP_PORT);
    let attacker = Attacker::start(
        &ans,
        CLUSTER_ID,
        &[gossip_addr(0), gossip_addr(1)],
        vec![Identity {
            id: ChitchatId::new(format!("attacker/{me}"), unix_ms(), me),
            bind: me,
        }],
    );
    attacker.claims(|c| c.keys = vec![(("cl".to_string(), IpAddr::V4(VICTIM)), 0)]);
    wait_for("h0 to count the attacker", Duration::from_secs(20), || {
        let c = peers(&cluster(h0));
        peer_named(&c, &format!("attacker/{me}"))
            .iter()
            .any(|p| p["counted"] == true)
            .then_some(())
    });
    let (sent, got) = victim(&net, 1.0);
    assert_eq!(got, sent, "the victim lost packets before any attack");
    let refused_before = counter(&cluster(h0), "readings_refused");

    // Held for half a second (5 rounds), so that h0 surely reads it.
    attacker.claims(|c| c.forge_future = 5);
    thread::sleep(Duration::from_secs(1));
    // The attacker goes on gossiping (its sync key moves on, its claims gain nothing).
    let (sent, got) = victim(&net, 3.0);
    let c = cluster(h0);
    println!(
        "after the forged reading: victim sent {sent}, h0 admitted {got}; readings_refused {} -> \
         {}; peers at h0: {:#}",
        refused_before,
        counter(&c, "readings_refused"),
        Value::Array(peers(&c))
    );
    assert_eq!(
        got, sent,
        "the victim is still blocked after a forged reading dated ahead"
    );
    assert!(
        counter(&c, "readings_refused") > refused_before,
        "h0 refused no reading: the test did not forge"
    );
    assert!(
        peer_named(&peers(&c), &format!("attacker/{me}"))
            .iter()
            .any(|p| p["counted"] == true),
        "the attacker is no longer counted: the victim's admission proves nothing"
    );
    attacker.stop();
    drop(ans);
    stop_agents(agents);
}

/// The lowest file descriptor number not open in `pid`.
fn lowest_free_fd(pid: libc::pid_t) -> u64 {
    let open: std::collections::HashSet<u64> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    (0..).find(|n| !open.contains(n)).unwrap()
}

/// Sets the soft `RLIMIT_NOFILE` of `pid` (its hard limit unchanged); returns the old soft one.
fn set_nofile(pid: libc::pid_t, soft: u64) -> u64 {
    let mut old = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid pointer to an rlimit struct for the call's duration; no new limit.
    let rc = unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, std::ptr::null(), &mut old) };
    assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
    let new = libc::rlimit {
        rlim_cur: soft,
        rlim_max: old.rlim_max,
    };
    // SAFETY: as above.
    let rc = unsafe { libc::prlimit(pid, libc::RLIMIT_NOFILE, &new, std::ptr::null_mut()) };
    assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());
    old.rlim_cur
}

/// A well-formed chitchat message (magic 45,139, protocol V1, `BadCluster`): authentic datagrams
/// must carry one to get past the agent's check (`cluster::inspect`) to chitchat's socket.
const CHITCHAT_BAD_CLUSTER: &[u8] = &[0x53, 0xB0, 1, 3];

#[test]
fn a_gossip_socket_error_is_survived_shown_and_counted() {
    let (net, ans) = net("rl-cg");
    let agents = start(&net, &[]);
    let (h0, h1) = (&agents[0], &agents[1]);
    let pid = h0.pid().expect("h0's pid");
    assert_eq!(counter(&cluster(h0), "gossip_restarts"), 0);
    let generation = cluster(h0)["generation"].as_u64().unwrap();

    // Out of file descriptors: no new one can be opened. A new address sending an authentic
    // datagram needs a relay socket: EMFILE ends chitchat's loop.
    // The agent opens and closes descriptors of its own meanwhile (API connections, map
    // walks): one closed below the limit after it was set would let the relay socket open. So
    // each attempt sets the limit at the lowest free descriptor again and sends from a new
    // address (port), which needs a new relay socket.
    let key = ClusterKey::from_secret(format!("{SECRET}\n").as_bytes(), CLUSTER_ID).unwrap();
    let mut soft = None;
    let deadline = Instant::now() + Duration::from_secs(20);
    while !h0.log().contains("cluster gossip stopped") {
        assert!(
            Instant::now() < deadline,
            "h0's gossip loop did not stop within 20 s of attempts:\n{}",
            h0.log()
        );
        let free = lowest_free_fd(pid);
        let old = set_nofile(pid, free);
        soft.get_or_insert(old);
        let sock = bind_udp(&ans, SocketAddr::new(IpAddr::V4(ATTACKER_IP), 0)).unwrap();
        let mut codec = Codec::new(&key, CLUSTER_ID, sock.local_addr().unwrap());
        let sealed = codec
            .seal(CHITCHAT_BAD_CLUSTER, gossip_addr(0), unix_ms())
            .unwrap()
            .remove(0);
        sock.send_to(&sealed, gossip_addr(0)).unwrap();
        let sent = Instant::now();
        while sent.elapsed() < Duration::from_millis(500)
            && !h0.log().contains("cluster gossip stopped")
        {
            thread::sleep(Duration::from_millis(20));
        }
    }
    let soft = soft.expect("at least one attempt");
    // Its sockets are closed with it: the status can be read (its descriptors are free), and
    // says so until the restart (1 s later).
    let down = cluster(h0);
    println!(
        "h0 while gossip is down: gossip {} ({}), restarts {}",
        down["gossip"],
        down["gossip_error"],
        counter(&down, "gossip_restarts")
    );
    assert_eq!(down["gossip"], "restarting", "{down:#}");
    assert!(
        down["gossip_error"]
            .as_str()
            .is_some_and(|e| e.contains("Too many open files") || e.contains("os error 24")),
        "{down:#}"
    );
    let table = cli(h0, &["peers"]);
    assert!(table.contains("RESTARTING"), "{table}");
    let body = scrape(&net.hosts[0].ns);
    assert!((metric(&body, "ratelimit_cluster_gossip_up") - 0.0).abs() < f64::EPSILON);

    // The limit back: the loop is restarted (a new generation), h1 is counted again, and h1
    // counts h0's new generation.
    set_nofile(pid, soft);
    let back = wait_for("h0's gossip to come back", Duration::from_secs(30), || {
        let c = cluster(h0);
        (c["gossip"] == "running" && counted(&c).len() == 1).then_some(c)
    });
    let restarts = counter(&back, "gossip_restarts");
    assert!(restarts >= 1, "{back:#}");
    let new_generation = back["generation"].as_u64().unwrap_or(generation);
    wait_for("h1 to count h0 again", Duration::from_secs(20), || {
        peers(&cluster(h1))
            .iter()
            .any(|p| p["counted"] == true && p["addr"] == gossip_addr(0).to_string().as_str())
            .then_some(())
    });
    let body = scrape(&net.hosts[0].ns);
    assert!(metric(&body, "ratelimit_cluster_gossip_restarts_total") >= 1.0);
    assert!((metric(&body, "ratelimit_cluster_gossip_up") - 1.0).abs() < f64::EPSILON);
    let table = cli(h0, &["peers"]);
    assert!(table.contains("restarts"), "{table}");
    println!(
        "h0's gossip restarted {restarts} time(s); generation {generation} -> {new_generation}"
    );
    drop(ans);
    stop_agents(agents);
}
