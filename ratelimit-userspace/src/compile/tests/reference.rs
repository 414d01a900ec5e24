//! The compiled classification against a reference walk of the rules, over random rule sets, and
//! at scale (thousands of rules, a hundred thousand prefixes).

use super::*;

/// Deterministic xorshift, so the tests need no extra crate.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

#[test]
fn thousands_of_rules() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut rules = vec![
        limit("default", "0.0.0.0/0", 1000),
        proto(limit("dns", "0.0.0.0/0", 100), Protocol::Udp, Some(53)),
    ];
    let mut seen = HashSet::new();
    while rules.len() < MAX_RULES as usize {
        let len = if rng.below(2) == 0 { 24 } else { 32 };
        let p = IpNet::V4(
            Ipv4Net::new(Ipv4Addr::from(rng.next() as u32), len)
                .unwrap()
                .trunc(),
        );
        if seen.insert(p) {
            rules.push(RuleConfig {
                action: Action::Deny,
                ..RuleConfig::new(format!("block{}", rules.len()), p)
            });
        }
    }
    let set = build(&rules);
    assert_eq!(set.prefixes.len(), rules.len() - 1); // "default" and "dns" share 0.0.0.0/0
    let ids: HashSet<u32> = set.rules.iter().map(|r| r.id).collect();
    assert_eq!(ids.len(), rules.len());
    for r in rules.iter().skip(2).take(500) {
        assert_eq!(
            set.classify(r.sources[0].network(), UDP, Some(53), 0)
                .unwrap()
                .rule
                .action,
            action::DENY
        );
    }
}

/// 100 000 deny-listed /32 and /24 prefixes in one rule (a `source_file` list) under a few broad
/// rules. Prints how long `compile` takes (run with `--release --nocapture` to measure); asserts
/// only correctness.
#[test]
fn hundred_thousand_prefixes() {
    let mut rules = vec![
        limit("default", "0.0.0.0/0", 1000),
        proto(limit("dns", "0.0.0.0/0", 100), Protocol::Udp, Some(53)),
        proto(limit("ten-tcp", "10.0.0.0/8", 100), Protocol::Tcp, None),
        with_action("office", "192.168.0.0/16", Action::Allow),
        with_action("upper", "128.0.0.0/1", Action::Deny),
    ];
    let deny_list = rules.len();
    let mut rng = Rng(42);
    let mut listed = HashSet::new();
    let mut list = Vec::new();
    while listed.len() < 100_000 {
        let len = if rng.below(2) == 0 { 24 } else { 32 };
        let p = IpNet::V4(
            Ipv4Net::new(Ipv4Addr::from(rng.next() as u32), len)
                .unwrap()
                .trunc(),
        );
        if listed.insert(p) {
            list.push(p);
        }
    }
    rules.push(proto(
        RuleConfig {
            action: Action::Deny,
            ..RuleConfig::with_sources("deny-list", list)
        },
        Protocol::Udp,
        None,
    ));
    let start = std::time::Instant::now();
    let set = build(&rules);
    println!(
        "compile: {} rules, {} prefixes in {:?}",
        set.rules.len(),
        set.prefixes.len(),
        start.elapsed()
    );
    // Every listed prefix, plus 0.0.0.0/0, 10.0.0.0/8, 192.168.0.0/16 and 128.0.0.0/1 unless
    // listed too.
    let broad_nets: HashSet<IpNet> = rules[..deny_list].iter().map(|r| r.sources[0]).collect();
    assert_eq!(
        set.prefixes.len(),
        listed.len() + broad_nets.difference(&listed).count()
    );
    assert_eq!(
        set.rule(set.rules[deny_list].id).unwrap().sources.len(),
        100_000
    );

    // Reference: the deny list (UDP only) wins inside a listed prefix, else the broad rules.
    let broad = &rules[..deny_list];
    let check = |src: Ipv4Addr, protocol: u8, port: Option<u16>| {
        let s32 = IpNet::V4(Ipv4Net::new(src, 32).unwrap());
        let s24 = IpNet::V4(Ipv4Net::new(src, 24).unwrap().trunc());
        let expected = if protocol == UDP && (listed.contains(&s32) || listed.contains(&s24)) {
            Some("deny-list")
        } else {
            reference(broad, IpAddr::V4(src), protocol, port, 0)
        };
        assert_eq!(
            set.classify(IpAddr::V4(src), protocol, port, 0)
                .map(|r| r.name.as_str()),
            expected,
            "{src}"
        );
    };
    for p in listed.iter().take(2000) {
        let IpNet::V4(p) = p else { unreachable!() };
        check(p.network(), UDP, Some(53));
        check(p.network(), TCP, Some(80));
        check(p.broadcast(), UDP, None);
    }
    for _ in 0..20_000 {
        let src = Ipv4Addr::from(rng.next() as u32);
        check(src, UDP, Some(53));
        check(src, TCP, Some(22));
        check(src, ICMP, None);
    }
}

/// The reference semantics, written independently of the candidate lists: among the rules with
/// a source prefix containing the address and whose protocol/port match the packet, the one
/// with the longest such prefix wins, then the most specific (a port outranks TCP flags, which
/// outrank the protocol alone).
fn reference(
    rules: &[RuleConfig],
    src: IpAddr,
    protocol: u8,
    port: Option<u16>,
    tcp_flags: u8,
) -> Option<&str> {
    rules
        .iter()
        .filter_map(|r| {
            let len = r
                .sources
                .iter()
                .filter(|s| s.contains(&src))
                .map(IpNet::prefix_len)
                .max()?;
            let rec = rule_record(r);
            let syn = tcp_flags & 0x12 == 0x02;
            ((rec.protocol == 0 || rec.protocol == protocol)
                && (rec.dst_port == 0 || Some(rec.dst_port) == port)
                && (r.tcp_flags.is_none() || syn))
                .then_some((len, r))
        })
        .max_by_key(|&(len, r)| {
            (
                len,
                r.dst_port.is_some(),
                r.tcp_flags.is_some(),
                r.protocol != Protocol::Any,
            )
        })
        .map(|(_, r)| r.name.as_str())
}

#[test]
fn classify_matches_reference_semantics() {
    let mut rng = Rng(7);
    let protocols = [Protocol::Any, Protocol::Tcp, Protocol::Udp, Protocol::Icmp];
    let bases = ["10.0.0.0", "10.1.0.0", "10.1.2.0", "10.1.2.3", "192.0.2.0"];
    for round in 0..200 {
        let mut rules = Vec::new();
        let mut taken = HashSet::new();
        for i in 0..rng.below(12) + 1 {
            let base: Ipv4Addr = bases[rng.below(bases.len() as u64) as usize]
                .parse()
                .unwrap();
            let len = [0, 8, 16, 24, 32][rng.below(5) as usize];
            let source = IpNet::V4(Ipv4Net::new(base, len).unwrap().trunc());
            let protocol = protocols[rng.below(4) as usize];
            let port = match protocol {
                Protocol::Tcp | Protocol::Udp if rng.below(2) == 0 => {
                    Some(53 + rng.below(2) as u16)
                }
                _ => None,
            };
            let flags = (protocol == Protocol::Tcp && rng.below(2) == 0).then_some(TcpFlags::Syn);
            if !taken.insert((source, protocol, port, flags)) {
                continue;
            }
            let action = [Action::Limit, Action::Allow, Action::Deny][rng.below(3) as usize];
            let r = match action {
                Action::Limit => limit(&format!("r{i}"), &source.to_string(), 1 + rng.below(5)),
                a => with_action(&format!("r{i}"), &source.to_string(), a),
            };
            let mut r = proto(r, protocol, port);
            r.tcp_flags = flags;
            rules.push(r);
        }
        let set = match compile(&rules, &RuleIds::new()) {
            Ok(set) => set,
            Err(CompileError::TooManyCandidates { .. }) => continue,
            Err(e) => panic!("round {round}: {e}"),
        };
        for _ in 0..50 {
            let src = IpAddr::V4(Ipv4Addr::from(
                u32::from(bases[rng.below(5) as usize].parse::<Ipv4Addr>().unwrap())
                    + rng.below(4) as u32,
            ));
            // TCP packets with no flag, SYN, SYN-ACK or ACK (flags only where the header was read).
            let flags = [0, 0x02, 0x12, 0x10][rng.below(4) as usize];
            let (protocol, port) = match rng.below(6) {
                0 | 5 => (TCP, Some(53 + rng.below(3) as u16)),
                1 => (UDP, Some(53 + rng.below(3) as u16)),
                2 => (UDP, None),
                3 => (ICMP, None),
                _ => (47, None),
            };
            let flags = if protocol == TCP && port.is_some() {
                flags
            } else {
                0
            };
            assert_eq!(
                set.classify(src, protocol, port, flags)
                    .map(|r| r.name.as_str()),
                reference(&rules, src, protocol, port, flags),
                "round {round}: {src} {protocol} {port:?} flags {flags:#x} with {rules:#?}"
            );
        }
    }
}

/// Random rule sets with many prefixes per rule (nested, shared between rules, both families)
/// against the brute-force reference.
#[test]
fn classify_matches_reference_with_prefix_lists() {
    let mut rng = Rng(0x5eed);
    // A pool of nested prefixes, so that rules overlap a lot.
    let mut pool: Vec<IpNet> = Vec::new();
    for _ in 0..120 {
        let region = [0x0a00_0000u32, 0x0a01_0000, 0xc000_0200][rng.below(3) as usize];
        let addr = region | (rng.below(1 << 12) as u32);
        let len = [0, 8, 12, 16, 20, 24, 28, 30, 32][rng.below(9) as usize];
        pool.push(IpNet::V4(
            Ipv4Net::new(Ipv4Addr::from(addr), len).unwrap().trunc(),
        ));
    }
    for _ in 0..60 {
        let region: u128 =
            [0x2001_0db8 << 96, (0x2001_0db8 << 96) | (1 << 80)][rng.below(2) as usize];
        let addr = region | u128::from(rng.below(1 << 12));
        let len = [0, 16, 32, 48, 64, 120, 124, 128][rng.below(8) as usize];
        pool.push(IpNet::V6(
            Ipv6Net::new(Ipv6Addr::from(addr), len).unwrap().trunc(),
        ));
    }
    let combos = [
        (Protocol::Any, None),
        (Protocol::Tcp, None),
        (Protocol::Udp, None),
        (Protocol::Icmp, None),
        (Protocol::Tcp, Some(80)),
        (Protocol::Udp, Some(53)),
        (Protocol::Tcp, Some(443)),
        // SYN rules: see below.
        (Protocol::Tcp, None),
        (Protocol::Tcp, Some(80)),
    ];
    let (mut checked, mut conflicts) = (0, 0);
    for round in 0..300 {
        let mut rules = Vec::new();
        for i in 0..rng.below(8) + 1 {
            let count = rng.below(40) as usize + 1;
            // Duplicates within a rule are fine: they are merged.
            let sources: Vec<IpNet> = (0..count)
                .map(|_| pool[rng.below(pool.len() as u64) as usize])
                .collect();
            let combo = rng.below(combos.len() as u64) as usize;
            let (mut protocol, port) = combos[combo];
            let r = RuleConfig::with_sources(format!("r{i}"), sources);
            if protocol == Protocol::Icmp && r.families() == (true, true) {
                protocol = Protocol::Any;
            }
            let action = [Action::Limit, Action::Allow, Action::Deny][rng.below(3) as usize];
            let mut r = RuleConfig { action, ..r };
            if action == Action::Limit {
                r.rate = Some(1);
                r.burst = Some(1);
            }
            let mut r = proto(r, protocol, port);
            r.tcp_flags = (combo >= 7).then_some(TcpFlags::Syn);
            rules.push(r);
        }
        // Brute force: two rules sharing a prefix with the same protocol, port and flags
        // conflict.
        let expect_conflict = rules.iter().enumerate().any(|(i, a)| {
            rules[i + 1..].iter().any(|b| {
                (a.protocol, a.dst_port, a.tcp_flags) == (b.protocol, b.dst_port, b.tcp_flags)
                    && a.sources.iter().any(|s| b.sources.contains(s))
            })
        });
        let set = match compile(&rules, &RuleIds::new()) {
            Ok(set) => set,
            Err(CompileError::Conflict { .. }) if expect_conflict => {
                conflicts += 1;
                continue;
            }
            Err(CompileError::TooManyCandidates { .. }) if !expect_conflict => continue,
            Err(e) => panic!("round {round}: {e}"),
        };
        assert!(!expect_conflict, "round {round}: conflict not detected");
        checked += 1;
        let used: Vec<IpNet> = rules.iter().flat_map(|r| r.sources.clone()).collect();
        for _ in 0..200 {
            let src = match used[rng.below(used.len() as u64) as usize] {
                IpNet::V4(p) => {
                    let host = (rng.next() as u32) & !u32::from(p.netmask());
                    IpAddr::V4(Ipv4Addr::from(u32::from(p.network()) | host))
                }
                IpNet::V6(p) => {
                    let host = u128::from(rng.next()) & !u128::from(p.netmask());
                    IpAddr::V6(Ipv6Addr::from(u128::from(p.network()) | host))
                }
            };
            let flags = [0, 0x02, 0x12, 0x10][rng.below(4) as usize];
            let (protocol, port) = match rng.below(7) {
                0 => (TCP, Some(80)),
                1 => (TCP, Some(443 + rng.below(2) as u16)),
                2 => (UDP, Some(53)),
                3 => (UDP, None),
                4 => (ICMP, None),
                5 => (ICMPV6, None),
                _ => (47, None),
            };
            let flags = if protocol == TCP { flags } else { 0 };
            assert_eq!(
                set.classify(src, protocol, port, flags)
                    .map(|r| r.name.as_str()),
                reference(&rules, src, protocol, port, flags),
                "round {round}: {src} {protocol} {port:?} flags {flags:#x}"
            );
        }
    }
    // The generator must exercise both outcomes.
    assert!(
        checked >= 100 && conflicts >= 10,
        "{checked} checked, {conflicts} conflicts"
    );
}
