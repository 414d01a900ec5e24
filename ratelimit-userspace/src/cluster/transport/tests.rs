use std::sync::atomic::Ordering::Relaxed;

use chitchat::{
    spawn_chitchat, ChitchatConfig, ChitchatHandle, ChitchatId, FailureDetectorConfig,
    ProtocolVersion,
};

use super::*;
use crate::cluster::unix_ms;

async fn node(
    port_hint: &str,
    secret: u8,
    seeds: &[SocketAddr],
) -> (ChitchatHandle, Arc<Shared>, SocketAddr) {
    // Bind port 0 first to find a free port, then give chitchat that address.
    let probe = std::net::UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let addr = probe.local_addr().unwrap();
    drop(probe);
    node_at(port_hint, secret, seeds, addr, 1).await
}

/// A node at `addr`, of incarnation `generation`.
async fn node_at(
    port_hint: &str,
    secret: u8,
    seeds: &[SocketAddr],
    addr: SocketAddr,
    generation: u64,
) -> (ChitchatHandle, Arc<Shared>, SocketAddr) {
    let shared = Arc::new(Shared::default());
    let key = ClusterKey::from_secret(&[secret; 32], "test").unwrap();
    let config = ChitchatConfig {
        chitchat_id: ChitchatId::new(format!("{port_hint}/{addr}"), generation, addr),
        cluster_id: "test".into(),
        gossip_interval: Duration::from_millis(50),
        listen_addr: addr,
        seed_nodes: seeds.iter().map(ToString::to_string).collect(),
        failure_detector_config: FailureDetectorConfig {
            initial_interval: Duration::from_millis(50),
            ..FailureDetectorConfig::default()
        },
        marked_for_deletion_grace_period: Duration::from_secs(60),
        catchup_callback: None,
        extra_liveness_predicate: None,
        protocol_version: ProtocolVersion::V1,
    };
    super::super::gossip::set_self_tag(&shared, &config.chitchat_id);
    let transport = SecureTransport::new(key, "test".into(), shared.clone());
    let handle = spawn_chitchat(config, vec![("hello".into(), port_hint.into())], &transport)
        .await
        .unwrap();
    (handle, shared, addr)
}

async fn sees(h: &ChitchatHandle, value: &str) -> bool {
    h.with_chitchat(|c| {
        c.node_states()
            .values()
            .any(|s| s.get("hello") == Some(value))
    })
    .await
}

/// Waits (10 s at most) until nodes `a` and `b` each see the other's `hello` key.
async fn exchanged(a: &ChitchatHandle, b: &ChitchatHandle) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(sees(a, "b").await && sees(b, "a").await) {
        assert!(Instant::now() < deadline, "a and b never exchanged state");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sealed_gossip_converges_and_a_wrong_key_is_kept_out() {
    let (a, a_shared, a_addr) = node("a", 1, &[]).await;
    let (b, b_shared, _) = node("b", 1, &[a_addr]).await;
    let (intruder, intruder_shared, _) = node("x", 2, &[a_addr]).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    exchanged(&a, &b).await;
    // Let the intruder try for a while.
    while a_shared.counters.rejected_auth.load(Relaxed) < 3 {
        assert!(
            Instant::now() < deadline,
            "the intruder's datagrams were never rejected"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        !sees(&a, "x").await && !sees(&b, "x").await,
        "the wrong key got into the cluster"
    );
    assert!(
        !sees(&intruder, "a").await,
        "the intruder learnt the cluster's state"
    );
    let (av, bv) = (a_shared.counters.values(), b_shared.counters.values());
    assert!(
        av.messages_in > 0 && av.messages_out > 0 && av.bytes_out > 0 && bv.messages_in > 0,
        "{av:?} {bv:?}"
    );
    assert_eq!(intruder_shared.counters.values().messages_in, 0);
    for h in [a, b, intruder] {
        h.shutdown().await.unwrap();
    }
}

/// Waits up to `wait` for a datagram on `socket`: its length, or `None`.
fn heard(socket: &std::net::UdpSocket, wait: Duration) -> Option<usize> {
    socket.set_read_timeout(Some(wait)).unwrap();
    let mut buf = vec![0; 65_536];
    socket.recv_from(&mut buf).ok().map(|(n, _)| n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_syn_gets_a_reply_only_at_the_address_that_sealed_it_for_this_host() {
    // `a` seeds on a socket of ours, so the first thing it sends us is a genuine Syn: its
    // plaintext is what a recorded datagram carries.
    let bind = || std::net::UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let (capture, sender, victim) = (bind(), bind(), bind());
    let key = ClusterKey::from_secret(&[1; 32], "test").unwrap();
    let (a, a_shared, a_addr) = node("a", 1, &[capture.local_addr().unwrap()]).await;
    let (b, b_shared, b_addr) = node("b", 1, &[]).await;
    let mut buf = vec![0; 65_536];
    capture
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let (len, from) = capture.recv_from(&mut buf).unwrap();
    let syn = Codec::new(&key, "test", capture.local_addr().unwrap())
        .open(&buf[..len], from, unix_ms())
        .unwrap()
        .unwrap();
    let mut codec = Codec::new(&key, "test", sender.local_addr().unwrap());
    let mut seal = |to| codec.seal(&syn, to, unix_ms()).unwrap().remove(0);
    let quiet = Duration::from_millis(1500);

    // Sealed by `sender` for `a`, sent to `a` with the victim's source address: dropped
    // unanswered.
    let to_a = seal(a_addr);
    victim.send_to(&to_a, a_addr).unwrap();
    assert_eq!(heard(&victim, quiet), None, "a reflected a reply");
    // Sealed for `a`, replayed to `b` (from the sealer's own address): dropped unanswered.
    sender.send_to(&to_a, b_addr).unwrap();
    assert_eq!(
        heard(&sender, quiet),
        None,
        "b answered a datagram sealed for a"
    );
    assert_eq!(a_shared.counters.rejected_auth.load(Relaxed), 1);
    assert_eq!(b_shared.counters.rejected_auth.load(Relaxed), 1);
    assert_eq!(b_shared.counters.values().messages_in, 0);

    // The same Syn, sealed for `a` and sent from the sealer's address, is answered there:
    // the drops above were the binding, not a Syn chitchat ignores.
    let request = to_a.len();
    sender.send_to(&to_a, a_addr).unwrap();
    let reply = heard(&sender, Duration::from_secs(10)).expect("a answers a genuine Syn");
    println!("a genuine Syn of {request} B got a reply of {reply} B");
    for h in [a, b] {
        h.shutdown().await.unwrap();
    }
}

/// A member with the key sends a real agent's gossip stack the review's crafted messages,
/// sealed with the cluster key from its own address: a `SetMaxVersion` below a key's version
/// for another member (chitchat's assertion: its gossip loop panicked), a key of the
/// receiver's own node at `u64::MAX` (its next `set` overflowed: the sync loop died), a
/// version no member can reach, a heartbeat of `u64::MAX` for another member and a real
/// member's heartbeat a million ahead of what it reported itself. Each is
/// refused before chitchat sees it and counted; the receiver keeps setting its own keys and
/// gossiping them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crafted_gossip_that_would_crash_chitchat_is_refused_and_gossip_goes_on() {
    use crate::cluster::inspect::craft::{self, Op};
    let (a, a_shared, a_addr) = node("a", 1, &[]).await;
    let (b, _, _) = node("b", 1, &[a_addr]).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    exchanged(&a, &b).await;
    let a_id = a.chitchat_id().clone();
    let b_id = b.chitchat_id().clone();
    let b_heartbeat = || async {
        a.with_chitchat(|c| c.node_state(&b_id).map(|s| u64::from(s.heartbeat())))
            .await
            .unwrap()
    };
    // b's heartbeat named far ahead (b's own reports to a are the mark).
    let forged_heartbeat = b_heartbeat().await + 1_000_000;
    let evil = std::net::UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let evil_addr = evil.local_addr().unwrap();
    let victim = ChitchatId::new("victim".to_string(), 1, evil_addr);
    let key = ClusterKey::from_secret(&[1; 32], "test").unwrap();
    let mut codec = Codec::new(&key, "test", evil_addr);
    codec.set_sender(super::super::wire::sender_tag("victim", 1));
    let crafted = [
        craft::syn_ack(
            &[(&victim, 5, 0)],
            &[Op::Node(&victim, 0, 0), Op::Kv("k", "v", 10), Op::SetMax(5)],
        ),
        craft::ack(&[Op::Node(&a_id, 0, 0), Op::Kv("x", "y", u64::MAX)]),
        craft::ack(&[Op::Node(&victim, 0, 0), Op::Kv("x", "y", u64::MAX - 1)]),
        craft::syn(&[(&victim, u64::MAX, 0)], "test"),
        craft::syn(&[(&victim, 5, 0), (&b_id, forged_heartbeat, 0)], "test"),
    ];
    for m in &crafted {
        for d in codec.seal(m, a_addr, unix_ms()).unwrap() {
            evil.send_to(&d, a_addr).unwrap();
        }
    }
    while a_shared.counters.rejected_unsafe.load(Relaxed) < 5 {
        assert!(
            Instant::now() < deadline,
            "the crafted messages were not refused: {:?}",
            a_shared.counters.values()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The sync loop's own writes still work, and reach b: gossip goes on.
    for i in 0..3 {
        a.with_chitchat(|c| c.self_node_state().set("hello", format!("a{i}")))
            .await;
    }
    while !sees(&b, "a2").await {
        assert!(Instant::now() < deadline, "a's gossip stopped");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        a.with_chitchat(|c| c.node_state(&victim).is_none()).await,
        "the crafted member got into a's state"
    );
    // Honest messages large enough for chitchat's zstd blocks are read and let through:
    // 2,000 keys (deltas beyond the 16 KiB block threshold) reach b, and a reads b's.
    for (h, name) in [(&a, "a"), (&b, "b")] {
        h.with_chitchat(|c| {
            for i in 0..2000 {
                c.self_node_state().set(
                    format!("c/rule/10.0.{}.{}", i / 256, i % 256),
                    "1:100:6400:180",
                );
            }
            c.self_node_state().set("done", name);
        })
        .await;
    }
    async fn full(h: &ChitchatHandle, other: &'static str) -> bool {
        h.with_chitchat(move |c| {
            c.node_states()
                .values()
                .any(|s| s.get("done") == Some(other) && s.iter_prefix("c/rule/").count() == 2000)
        })
        .await
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    while !(full(&b, "a").await && full(&a, "b").await) {
        assert!(Instant::now() < deadline, "the large deltas never arrived");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        a_shared.counters.rejected_unsafe.load(Relaxed),
        5,
        "an honest message was refused"
    );
    assert!(
        b_heartbeat().await < forged_heartbeat,
        "b's heartbeat at a was pushed ahead"
    );
    for h in [a, b] {
        h.shutdown().await.unwrap();
    }
}

/// A member with the key pads a real agent's digest: Syns naming ids of 50 KB (chitchat
/// creates a node state for each id a digest names and keeps it in its own digest for 5
/// minutes, so its own Syn outgrew a datagram and answering a Syn tripped chitchat's
/// `mtu >= 100` assertion: its gossip loop died), then
/// 2,000 short ids (its memory and digest grew with each). The long ids are refused, the
/// short ones beyond what one sender may introduce stripped; the receiver's state stays
/// bounded and it keeps gossiping with its honest peer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn padded_digests_neither_cut_the_receiver_off_nor_grow_its_state() {
    use crate::cluster::inspect::{craft, INTRODUCED_PER_IP, OWN_IDS_PER_IP};
    let (a, a_shared, a_addr) = node("a", 1, &[]).await;
    let (b, _, _) = node("b", 1, &[a_addr]).await;
    exchanged(&a, &b).await;
    let evil = std::net::UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let evil_addr = evil.local_addr().unwrap();
    let me = ChitchatId::new("evil".to_string(), 1, evil_addr);
    let key = ClusterKey::from_secret(&[1; 32], "test").unwrap();
    let mut codec = Codec::new(&key, "test", evil_addr);
    codec.set_sender(super::super::wire::sender_tag("evil", 1));
    let nowhere: SocketAddr = (Ipv4Addr::LOCALHOST, 9).into();
    let mut send = |m: Vec<u8>| {
        for d in codec.seal(&m, a_addr, unix_ms()).unwrap() {
            evil.send_to(&d, a_addr).unwrap();
        }
    };
    for i in 0..3u8 {
        // Random (incompressible: chitchat compresses its digests).
        let mut x = 0x9e37_79b9_7f4a_7c15_u64 ^ u64::from(i);
        let name: String = (0..50_000)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                char::from(b'!' + u8::try_from(x % 90).unwrap())
            })
            .collect();
        let long = ChitchatId::new(name, 1, nowhere);
        send(craft::syn(&[(&me, 1, 0), (&long, 1, 0)], "test"));
    }
    for round in 0..20u64 {
        let ids: Vec<ChitchatId> = (0..100u64)
            .map(|i| ChitchatId::new(format!("phantom-{round}-{i}"), i, nowhere))
            .collect();
        let mut entries = vec![(&me, 2 + round, 0)];
        entries.extend(ids.iter().map(|id| (id, 1, 0)));
        send(craft::syn(&entries, "test"));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Let a take them all in (and gossip a round or two with them).
    tokio::time::sleep(Duration::from_millis(500)).await;
    // a keeps gossiping with b: its new values reach b.
    let deadline = Instant::now() + Duration::from_secs(10);
    for i in 0..3 {
        a.with_chitchat(|c| c.self_node_state().set("hello", format!("a{i}")))
            .await;
    }
    while !sees(&b, "a2").await {
        assert!(
            Instant::now() < deadline,
            "a stopped gossiping: {:?}",
            a_shared.counters.values()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let held = a.with_chitchat(|c| c.node_states().len()).await;
    assert!(
        held <= 2 + OWN_IDS_PER_IP + INTRODUCED_PER_IP,
        "a holds {held} node states"
    );
    let v = a_shared.counters.values();
    assert_eq!(v.rejected_unsafe, 3, "{v:?}");
    assert!(
        v.digest_ids_stripped >= 2_000 - INTRODUCED_PER_IP as u64,
        "{v:?}"
    );
    for h in [a, b] {
        h.shutdown().await.unwrap();
    }
}

/// A message chitchat's socket cannot send (larger than a datagram: here every Syn, its
/// cluster id being 70 KB) is counted in `send_errors`, not dropped unseen.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_too_large_to_send_is_counted() {
    let probe = std::net::UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let addr = probe.local_addr().unwrap();
    drop(probe);
    let peer = std::net::UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let shared = Arc::new(Shared::default());
    let key = ClusterKey::from_secret(&[1; 32], "test").unwrap();
    let config = ChitchatConfig {
        chitchat_id: ChitchatId::new(format!("big/{addr}"), 1, addr),
        cluster_id: "x".repeat(70_000),
        gossip_interval: Duration::from_millis(50),
        listen_addr: addr,
        seed_nodes: vec![peer.local_addr().unwrap().to_string()],
        failure_detector_config: FailureDetectorConfig::default(),
        marked_for_deletion_grace_period: Duration::from_secs(60),
        catchup_callback: None,
        extra_liveness_predicate: None,
        protocol_version: ProtocolVersion::V1,
    };
    let transport = SecureTransport::new(key, "test".into(), shared.clone());
    let handle = spawn_chitchat(config, Vec::new(), &transport)
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while shared.counters.send_errors.load(Relaxed) < 3 {
        assert!(
            Instant::now() < deadline,
            "oversized messages not counted: {:?}",
            shared.counters.values()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(heard(&peer, Duration::from_millis(200)), None);
    handle.shutdown().await.unwrap();
}

async fn phantoms_alive(h: &ChitchatHandle) -> usize {
    h.with_chitchat(|c| {
        c.live_nodes()
            .filter(|id| id.node_id.starts_with("phantom"))
            .count()
    })
    .await
}

/// A member with the key names, in the digests it sends `a`, 60 ids at addresses of its
/// choice (a victim's), their heartbeats moving in every digest (10 a second), so chitchat at
/// `a` (and at `b`, which `a` tells of them) held them alive and gossiped with them. Before,
/// the two hosts sent those addresses 575 datagrams (269 KB) in 5 s, 115 a second, and the
/// ids took the gossip places of the real peer: 13 of 49 values `a` published reached `b`
/// within 100 ms (49 of 49 without them). Now each address that never answered gets a probe a
/// second at most, four a second in all (a burst of 8) per host, and once the ids have gone
/// [`UNPROVEN_GRACE`] without sealing a datagram of their own, digests no longer move their
/// heartbeats: they are declared dead, and `a`'s values reach `b` as without them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ids_at_addresses_that_never_answer_get_a_few_probes_not_a_stream() {
    use crate::cluster::inspect::craft;
    let (a, a_shared, a_addr) = node("a", 1, &[]).await;
    let (b, b_shared, _) = node("b", 1, &[a_addr]).await;
    exchanged(&a, &b).await;
    let evil = std::net::UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let evil_addr = evil.local_addr().unwrap();
    let me = ChitchatId::new("evil".to_string(), 1, evil_addr);
    let key = ClusterKey::from_secret(&[1; 32], "test").unwrap();
    let mut codec = Codec::new(&key, "test", evil_addr);
    codec.set_sender(super::super::wire::sender_tag("evil", 1));
    let sinks: Vec<std::net::UdpSocket> = (0..60)
        .map(|_| {
            let s = std::net::UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
            s.set_nonblocking(true).unwrap();
            s
        })
        .collect();
    let ids: Vec<ChitchatId> = sinks
        .iter()
        .enumerate()
        .map(|(i, s)| ChitchatId::new(format!("phantom-{i}"), 1, s.local_addr().unwrap()))
        .collect();
    let start = Instant::now();
    let mut hb = 1u64;
    let mut updates = 0u32;
    // Per second of the attack: values `a` published, and those `b` saw within 100 ms.
    let mut seen = vec![(0u32, 0u32); 13];
    let mut alive_early = 0;
    while start.elapsed() < Duration::from_secs(13) {
        hb += 1;
        let mut entries = vec![(&me, hb, 0)];
        entries.extend(ids.iter().map(|id| (id, hb, 0)));
        for d in codec
            .seal(&craft::syn(&entries, "test"), a_addr, unix_ms())
            .unwrap()
        {
            evil.send_to(&d, a_addr).unwrap();
        }
        updates += 1;
        let v = format!("a{updates}");
        a.with_chitchat(|c| c.self_node_state().set("hello", v.clone()))
            .await;
        let second = usize::try_from(start.elapsed().as_secs()).unwrap().min(12);
        tokio::time::sleep(Duration::from_millis(100)).await;
        seen[second].0 += 1;
        if sees(&b, &v).await {
            seen[second].1 += 1;
        }
        if second == 3 {
            alive_early = alive_early.max(phantoms_alive(&a).await);
        }
    }
    let (mut datagrams, mut bytes) = (0usize, 0usize);
    let mut buf = vec![0u8; 65_536];
    for s in &sinks {
        while let Ok(n) = s.recv(&mut buf) {
            datagrams += 1;
            bytes += n;
        }
    }
    let elapsed = start.elapsed().as_secs_f64();
    let alive_late = phantoms_alive(&a).await;
    println!(
        "phantoms alive at a: {alive_early} after 3 s, {alive_late} after 13 s; in \
         {elapsed:.1} s: {datagrams} datagrams, {bytes} bytes to their addresses; (published, \
         seen by b within 100 ms) each second: {seen:?}; withheld: a {}, b {}",
        a_shared.counters.values().probes_withheld,
        b_shared.counters.values().probes_withheld
    );
    assert!(
        alive_early > 0,
        "the phantoms were never alive: the test tests nothing"
    );
    let bound = 2.0 * (PROBE_BURST + PROBES_PER_S * elapsed);
    #[expect(clippy::cast_precision_loss, reason = "a count")]
    let sent = datagrams as f64;
    assert!(
        sent <= bound,
        "{datagrams} datagrams to addresses that never answered (bound {bound})"
    );
    assert!(a_shared.counters.values().probes_withheld > 0);
    assert_eq!(alive_late, 0, "ids that never spoke are still alive at a");
    // From 4 s after the grace on: gossip as without them (all within 100 ms on an idle
    // machine; 0-3 of 10 a second while the ids were alive; two thirds leaves room for a
    // loaded one).
    let (published, reached) = seen[9..]
        .iter()
        .fold((0, 0), |(p, r), &(pp, rr)| (p + pp, r + rr));
    assert!(
        reached * 3 >= published * 2,
        "{reached} of {published} of a's values reached b within 100 ms: {seen:?}"
    );
    for h in [a, b] {
        h.shutdown().await.unwrap();
    }
}

/// A member with the key sends `a` one delta under `b`'s id, pushing `b`'s state at `a`
/// near the largest version. Before, `a` took none of `b`'s updates again (they all look
/// older), and sent `b` its own node in every reply, which `b` refused whole (221
/// `rejected{unsafe}` in 5 s): neither saw the other's values for as long as `b` lived,
/// each enforcing alone. Now `b` ends its gossip loop on the first such reply (the
/// supervisor restarts it as a new incarnation, which `a` holds apart from the forged
/// one), and the new incarnation and `a` see each other's values again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_members_state_forged_ahead_at_a_peer_is_left_behind_by_a_new_incarnation() {
    use crate::cluster::inspect::craft::{self, Op};
    let (a, _, a_addr) = node("a", 1, &[]).await;
    let (b, b_shared, b_addr) = node("b", 1, &[a_addr]).await;
    exchanged(&a, &b).await;
    let b_id = b.chitchat_id().clone();
    // What the sync loop publishes after each round: b's own max version.
    let own = b.with_chitchat(|c| c.self_node_state().max_version()).await;
    b_shared.own_max_version.store(own, Relaxed);
    let evil = std::net::UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    let evil_addr = evil.local_addr().unwrap();
    let me = ChitchatId::new("evil".to_string(), 1, evil_addr);
    let key = ClusterKey::from_secret(&[1; 32], "test").unwrap();
    let mut codec = Codec::new(&key, "test", evil_addr);
    codec.set_sender(super::super::wire::sender_tag("evil", 1));
    let at_a = a
        .with_chitchat(|c| c.node_state(&b_id).unwrap().max_version())
        .await;
    let forged = crate::cluster::inspect::MAX_VERSION - 2;
    let msg = craft::syn_ack(
        &[(&me, 1, 0)],
        &[
            Op::Node(&b_id, 0, at_a),
            Op::Kv("zz", "forged", forged),
            Op::SetMax(forged),
        ],
    );
    for d in codec.seal(&msg, a_addr, unix_ms()).unwrap() {
        evil.send_to(&d, a_addr).unwrap();
    }
    let ended = tokio::time::timeout(Duration::from_secs(5), b.termination_watcher())
        .await
        .expect("b's gossip loop went on beside a peer holding its state forged ahead");
    let error = format!("{:#}", ended.expect_err("ended with an error"));
    assert!(error.contains("forged"), "{error}");
    drop(b);
    // The supervisor's restart: a new incarnation at the same address.
    let (b2, _, _) = node_at("b", 1, &[a_addr], b_addr, 2).await;
    for i in 0..3 {
        a.with_chitchat(|c| c.self_node_state().set("hello", format!("a{i}")))
            .await;
        b2.with_chitchat(|c| c.self_node_state().set("hello", format!("b{i}")))
            .await;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(sees(&a, "b2").await && sees(&b2, "a2").await) {
        assert!(
            Instant::now() < deadline,
            "the new incarnation and a never exchanged state"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for h in [a, b2] {
        h.shutdown().await.unwrap();
    }
}

/// Sends 5 datagrams to a transport's socket while nothing reads it, waits, sends one more, and
/// reads: what the socket did with each, as `(late, opened)` (opened: handed to the codec,
/// which refuses these as not authentic or malformed).
async fn late_and_opened(max_wait: Option<Duration>, wait: Duration) -> (u64, u64) {
    let shared = Arc::new(Shared::default());
    let key = ClusterKey::from_secret(&[1; 32], "test").unwrap();
    let mut transport = SecureTransport::new(key, "test".into(), shared.clone());
    if let Some(w) = max_wait {
        transport = transport.with_max_wait(w);
    }
    let mut socket = transport
        .open((Ipv4Addr::LOCALHOST, 0).into())
        .await
        .unwrap();
    let to = socket.local_addr().unwrap();
    // The kernel turns receive times on from a work item queued by the first request (a
    // global switch, `net_enable_timestamp`): datagrams before it carry none, and count as not
    // waiting at all.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let from = std::net::UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    for _ in 0..5 {
        from.send_to(&[7; 64], to).unwrap();
    }
    tokio::time::sleep(wait).await;
    from.send_to(&[7; 64], to).unwrap();
    // Nothing here is authentic, so `recv` never returns: it reads until the timeout.
    let _ = tokio::time::timeout(Duration::from_millis(300), socket.recv()).await;
    let c = shared.counters.values();
    (c.rejected_late, c.rejected_auth + c.rejected_malformed)
}

/// A datagram that waited in the socket longer than the transport's `max_wait` (an agent behind
/// its peers) is dropped unread, by the kernel's receive time; one that did not is opened as
/// ever, and without a `max_wait` every one is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn datagrams_that_waited_past_the_limit_are_dropped_unread() {
    let limit = Some(Duration::from_millis(100));
    assert_eq!(
        late_and_opened(limit, Duration::from_millis(250)).await,
        (5, 1)
    );
    assert_eq!(
        late_and_opened(limit, Duration::from_millis(0)).await,
        (0, 6)
    );
    assert_eq!(
        late_and_opened(None, Duration::from_millis(250)).await,
        (0, 6)
    );
}
