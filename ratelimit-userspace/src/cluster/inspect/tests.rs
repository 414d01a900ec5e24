use super::{craft::Op, *};

fn id(name: &str, port: u16) -> ChitchatId {
    ChitchatId::new(name.to_string(), 7, ([192, 0, 2, 1], port).into())
}

/// A delta about this host's own node is refused, and names the highest version it holds
/// of it (in an Ack or a `SynAck`, wherever it sits among the node deltas, a reset one
/// included), which the transport weighs against this host's own max version.
#[test]
fn a_delta_about_this_hosts_own_node_names_how_far_it_goes() {
    let me = id("me", 1);
    let other = id("other", 2);
    let is_me = |i: &ChitchatId| *i == me;
    let own_max = |msg: &[u8]| {
        let mut m = None;
        assert_eq!(check_own(msg, is_me, &mut m), Err(Unsafe::OwnState));
        m
    };
    let trimmed = craft::ack(&[Op::Node(&me, 40, 40), Op::SetMax(41)]);
    assert_eq!(own_max(&trimmed), Some(41));
    let forged = craft::syn_ack(
        &[(&other, 3, 9)],
        &[
            Op::Node(&other, 0, 0),
            Op::Kv("s", "1:1:1", 3),
            Op::Node(&me, MAX_VERSION - 3, 0),
            Op::Kv("zz", "forged", MAX_VERSION - 2),
            Op::SetMax(MAX_VERSION - 2),
            Op::Node(&id("empty", 3), 0, 0),
        ],
    );
    assert_eq!(own_max(&forged), Some(MAX_VERSION - 2));
    let keys_only = craft::ack(&[Op::Node(&me, 0, 40), Op::Kv("zz", "x", 1_000)]);
    assert_eq!(own_max(&keys_only), Some(1_000));
    // Another member's delta says nothing of this host's own state.
    let mut m = None;
    let theirs = craft::ack(&[Op::Node(&other, 0, 0), Op::Kv("s", "x", 9)]);
    assert!(check_own(&theirs, is_me, &mut m).is_ok());
    assert_eq!(m, None);
}

/// The crafted messages of the review are refused, each for its reason; the same messages
/// made consistent pass, and the digest's heartbeats are returned.
#[test]
fn crafted_deltas_that_would_crash_chitchat_are_refused() {
    let me = id("me", 1);
    let other = id("other", 2);
    let is_me = |i: &ChitchatId| *i == me;
    let ok = craft::ack(&[
        Op::Node(&other, 0, 0),
        Op::Kv("s", "1:1:1", 3),
        Op::Kv("t", "x", 4),
        Op::Node(&id("empty", 3), 0, 0),
        Op::SetMax(9),
    ]);
    assert_eq!(check(&ok, is_me), Ok(Vec::new()));
    // SetMaxVersion after a key of a higher version: chitchat's assertion.
    let below = craft::ack(&[
        Op::Node(&other, 0, 0),
        Op::Kv("s", "1:1:1", 10),
        Op::SetMax(5),
    ]);
    assert_eq!(check(&below, is_me), Err(Unsafe::MaxVersionBelowKeys));
    // A key of our own node at u64::MAX.
    let own = craft::ack(&[Op::Node(&me, 0, 0), Op::Kv("s", "x", 5)]);
    assert_eq!(check(&own, is_me), Err(Unsafe::OwnState));
    let huge = craft::ack(&[Op::Node(&other, 0, 0), Op::Kv("s", "x", u64::MAX)]);
    assert_eq!(check(&huge, is_me), Err(Unsafe::VersionTooLarge));
    // Digests: a heartbeat of u64::MAX for another member.
    let syn = craft::syn(&[(&other, 5, 3), (&me, 9, 9)], "c");
    assert_eq!(
        check(&syn, is_me),
        Ok(vec![(other.clone(), 5), (me.clone(), 9)])
    );
    let hb = craft::syn(&[(&other, u64::MAX, 3)], "c");
    assert_eq!(check(&hb, is_me), Err(Unsafe::HeartbeatTooLarge));
    let sa = craft::syn_ack(
        &[(&other, 5, 3)],
        &[Op::Node(&other, 0, 0), Op::Kv("k", "v", 1)],
    );
    assert_eq!(check(&sa, is_me), Ok(vec![(other.clone(), 5)]));
    // Truncated, junk, or a key before any node.
    assert_eq!(check(&ok[..ok.len() - 1], is_me), Err(Unsafe::Undecodable));
    assert_eq!(check(b"junk", is_me), Err(Unsafe::Undecodable));
    let orphan = craft::ack(&[Op::Kv("s", "x", 5)]);
    assert_eq!(check(&orphan, is_me), Err(Unsafe::Undecodable));
}

/// A member's heartbeat named by another sender far ahead of what the member itself last
/// reported is refused; one within the slack (and what it may have gained since) passes; a
/// member not heard directly is not judged; the sender's own report moves the mark.
#[test]
fn another_members_heartbeat_ahead_of_its_own_report_is_refused() {
    let (x, y) = (id("x", 1), id("y", 2));
    let mut h = Heartbeats::default();
    let from = |who: &ChitchatId| {
        let who = who.clone();
        move |i: &ChitchatId| *i == who
    };
    // Not heard from x yet: y may name any heartbeat for it.
    assert_eq!(
        h.check(&[(y.clone(), 5), (x.clone(), 1 << 40)], from(&y), 0),
        Ok(())
    );
    // x reports 100 itself.
    assert_eq!(h.check(&[(x.clone(), 100)], from(&x), 1_000), Ok(()));
    let ahead = 100 + HEARTBEAT_SLACK + 10 * HEARTBEATS_PER_MS;
    assert_eq!(h.check(&[(x.clone(), ahead)], from(&y), 1_010), Ok(()));
    assert_eq!(
        h.check(&[(x.clone(), ahead + 1)], from(&y), 1_010),
        Err(Unsafe::HeartbeatAhead)
    );
    assert_eq!(
        h.check(&[(x.clone(), u64::MAX)], from(&y), 1_010),
        Err(Unsafe::HeartbeatAhead)
    );
    // x itself may report any (it only concerns itself), and that moves the mark.
    assert_eq!(h.check(&[(x.clone(), 50_000)], from(&x), 2_000), Ok(()));
    assert_eq!(h.check(&[(x.clone(), 50_500)], from(&y), 2_000), Ok(()));
}

/// A node id longer than any agent's, in a digest or a delta, is refused (a Syn naming a few
/// of 60 KB made the receiver's own digest too large to send); the longest an agent builds
/// (`hostname/gossip address`, a 64-byte hostname and the longest IPv6 address) passes.
#[test]
fn node_ids_longer_than_an_agents_are_refused() {
    let me = id("me", 1);
    let is_me = |i: &ChitchatId| *i == me;
    let addr: std::net::SocketAddr = std::net::SocketAddrV6::new(
        "ffff:ffff:ffff:ffff:ffff:ffff:ffff:ffff".parse().unwrap(),
        65_535,
        0,
        u32::MAX,
    )
    .into();
    let longest = format!("{}/{addr}", "h".repeat(64));
    assert!(longest.len() <= MAX_NODE_ID_LEN, "{}", longest.len());
    let agent = ChitchatId::new(longest, u64::MAX, addr);
    let ok = craft::syn(&[(&agent, 5, 3)], "c");
    assert_eq!(check(&ok, is_me).map(|d| d.len()), Ok(1));
    let padded = ChitchatId::new("x".repeat(60_000), 1, addr);
    let just_over = ChitchatId::new("x".repeat(MAX_NODE_ID_LEN + 1), 1, addr);
    for long in [&padded, &just_over] {
        let syn = craft::syn(&[(&agent, 5, 3), (long, 1, 0)], "c");
        assert_eq!(check(&syn, is_me), Err(Unsafe::NodeIdTooLong));
        let sa = craft::syn_ack(&[(long, 1, 0)], &[]);
        assert_eq!(check(&sa, is_me), Err(Unsafe::NodeIdTooLong));
        let ack = craft::ack(&[Op::Node(long, 0, 0), Op::Kv("k", "v", 1)]);
        assert_eq!(check(&ack, is_me), Err(Unsafe::NodeIdTooLong));
    }
}

/// The ids one sender address may introduce, and all senders together, are bounded: the
/// rest are refused (to be stripped); the sender's own id and ids already known pass; an id
/// that speaks for itself frees its introducer's quota; ids no digest names are forgotten.
#[test]
fn ids_a_digest_may_introduce_are_bounded_per_sender_and_in_all() {
    let ip = |n: u8| std::net::IpAddr::from([192, 0, 2, n]);
    let me = id("me", 1);
    let is_me = |i: &ChitchatId| *i == me;
    let phantoms = |tag: &str, n: usize| -> Vec<(ChitchatId, u64)> {
        (0..n)
            .map(|i| {
                let [_, _, hi, lo] = u32::try_from(i).unwrap().to_be_bytes();
                let addr = ([198, 18, hi, lo], 7946).into();
                (ChitchatId::new(format!("{tag}{i}"), 1, addr), 1)
            })
            .collect()
    };
    let mut intro = Introductions::default();
    let evil = id("evil", 9);
    let from_evil = |i: &ChitchatId| *i == evil;
    let mut digest = vec![(evil.clone(), 1), (me.clone(), 1)];
    digest.extend(phantoms("p", 1_000));
    let refused = intro.admit(&digest, ip(9), from_evil, is_me, 0);
    assert_eq!(refused.len(), 1_000 - INTRODUCED_PER_IP);
    assert!(!refused.contains(&evil) && !refused.contains(&me));
    // The same digest again: what was admitted is known, the rest still refused.
    assert_eq!(intro.admit(&digest, ip(9), from_evil, is_me, 10), refused);
    // Other ids of the same address sending as themselves: at most OWN_IDS_PER_IP.
    let mut own_refused = 0;
    for g in 0..20u16 {
        let own = id("evil", 100 + g);
        let r = intro.admit(&[(own.clone(), 1)], ip(9), |i| *i == own, is_me, 20);
        own_refused += r.len();
    }
    assert_eq!(own_refused, 20 - (OWN_IDS_PER_IP - 1));
    // Other senders: together at most MAX_INTRODUCED introduced ids.
    let mut admitted = INTRODUCED_PER_IP;
    for n in 10..20u8 {
        let s = id("s", u16::from(n));
        let d = phantoms(&format!("q{n}-"), 100);
        let r = intro.admit(&d, ip(n), |i| *i == s, is_me, 30);
        admitted += 100 - r.len();
        assert!(100 - r.len() <= INTRODUCED_PER_IP);
    }
    assert_eq!(admitted, MAX_INTRODUCED);
    // A new member speaking for itself still gets in, full as the rest is.
    let newcomer = id("new", 77);
    assert!(intro
        .admit(
            &[(newcomer.clone(), 1)],
            ip(77),
            |i| *i == newcomer,
            is_me,
            40
        )
        .is_empty());
    // Introduced members that then speak for themselves free their introducer's quota.
    let honest = phantoms("p", INTRODUCED_PER_IP);
    for (h, _) in &honest {
        let r = intro.admit(
            &[(h.clone(), 1)],
            h.gossip_advertise_addr.ip(),
            |i| i == h,
            is_me,
            50,
        );
        assert!(r.is_empty());
    }
    let more = phantoms("r", 10);
    assert!(intro.admit(&more, ip(9), from_evil, is_me, 60).is_empty());
    // Ids no digest names for FORGET_MS are forgotten, and their quota freed.
    let later = 60 + FORGET_MS + 2_000;
    let fresh = phantoms("z", INTRODUCED_PER_IP);
    assert!(intro
        .admit(&fresh, ip(30), |_| false, is_me, later)
        .is_empty());
    // Senders at many addresses: at most MAX_OWN_IDS own ids in all.
    let mut own_admitted = 0;
    for n in 0..400u16 {
        let own = ChitchatId::new(format!("m{n}"), 1, ([198, 19, 1, 1], n).into());
        let from = std::net::IpAddr::from([198, 19, (n >> 8) as u8, n as u8]);
        let r = intro.admit(&[(own.clone(), 1)], from, |i| *i == own, is_me, later);
        own_admitted += 1 - r.len();
    }
    // (Beyond MAX_OWN_IDS, a sender's own id is taken as introduced: the room left there.)
    assert_eq!(
        own_admitted,
        MAX_OWN_IDS + MAX_INTRODUCED - INTRODUCED_PER_IP
    );
    // The worst case in this host's digest: every id at MAX_NODE_ID_LEN bytes, an IPv6
    // address, its heartbeat and versions; ours too.
    let entry = 2 + MAX_NODE_ID_LEN + 8 + 19 + 24;
    assert!((MAX_OWN_IDS + MAX_INTRODUCED + 1) * entry <= 47 * 1024);
}

/// [`strip`] removes the refused entries from a digest and leaves the rest of the message as
/// it was, in both protocol versions.
#[test]
fn strip_leaves_out_refused_digest_entries_only() {
    use chitchat::Serializable;
    let me = id("me", 1);
    let is_me = |i: &ChitchatId| *i == me;
    let (x, y, z) = (id("x", 2), id("y", 3), id("z", 4));
    let not_y = |i: &ChitchatId| *i != y;
    let syn = craft::syn(&[(&x, 5, 1), (&y, 6, 2), (&z, 7, 3)], "c");
    let stripped = strip(&syn, not_y).unwrap();
    assert_eq!(
        check(&stripped, is_me),
        Ok(vec![(x.clone(), 5), (z.clone(), 7)])
    );
    assert!(stripped.ends_with(&{
        let mut c = Vec::new();
        "c".serialize(&mut c);
        c
    }));
    let ops = [Op::Node(&x, 0, 0), Op::Kv("k", "v", 1), Op::SetMax(4)];
    let sa = craft::syn_ack(&[(&y, 6, 2), (&x, 5, 1)], &ops);
    let stripped = strip(&sa, not_y).unwrap();
    assert_eq!(check(&stripped, is_me), Ok(vec![(x.clone(), 5)]));
    // The delta, byte for byte.
    assert!(stripped.ends_with(&craft::ack(&ops)[4..]));
    let ack = craft::ack(&ops);
    assert_eq!(strip(&ack, not_y).unwrap(), ack);
    // A large digest is compressed again (no larger than chitchat's own encoding).
    let many: Vec<ChitchatId> = (0..2_000).map(|i| id(&format!("member-{i}"), 7)).collect();
    let entries: Vec<(&ChitchatId, u64, u64)> = many.iter().map(|i| (i, 1, 1)).collect();
    let big = craft::syn(&entries, "c");
    let stripped = strip(&big, |i| *i != many[0]).unwrap();
    assert!(
        stripped.len() < big.len() / 4,
        "{} {}",
        stripped.len(),
        big.len()
    );
    assert_eq!(check(&stripped, is_me).map(|d| d.len()), Ok(1_999));
    // Protocol V0: a count, then the entries.
    let v0 = |entries: &[(&ChitchatId, u64)]| {
        let mut out = Vec::new();
        MAGIC_NUMBER.serialize(&mut out);
        out.extend([0, 0]);
        u16::try_from(entries.len()).unwrap().serialize(&mut out);
        for (i, hb) in entries {
            i.serialize(&mut out);
            hb.serialize(&mut out);
            0u64.serialize(&mut out);
            0u64.serialize(&mut out);
        }
        "c".serialize(&mut out);
        out
    };
    let stripped = strip(&v0(&[(&x, 5), (&y, 6), (&z, 7)]), not_y).unwrap();
    assert_eq!(stripped, v0(&[(&x, 5), (&z, 7)]));
    assert_eq!(
        check(&stripped, is_me),
        Ok(vec![(x.clone(), 5), (z.clone(), 7)])
    );
}
