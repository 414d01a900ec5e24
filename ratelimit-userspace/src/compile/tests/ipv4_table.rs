//! The IPv4 table: a /16's word holds the trie's outcome only where it is one for the whole /16,
//! and agrees with the walk.

use super::*;

/// The IPv4 table's word of the /16 holding `addr`.
fn table_word(table: &[u32], addr: &str) -> u32 {
    let a: Ipv4Addr = addr.parse().unwrap();
    let [x, y, _, _] = a.octets();
    table[v4_table::index(0, [x, y]) as usize]
}

/// The IPv4 table holds an outcome only where the trie's lookup and walk give one for the whole
/// /16, and it is the one the walk gives: the longest covering prefix of /16 or shorter, when
/// its first candidate looks at no protocol, port or flag and no longer prefix lies inside.
#[test]
fn the_ipv4_table_holds_a_16s_outcome_only_where_it_is_one() {
    let mut syn = proto(limit("syn", "10.3.0.0/16", 5), Protocol::Tcp, None);
    syn.tcp_flags = Some(TcpFlags::Syn);
    let set = build(&[
        limit("all", "0.0.0.0/0", 1),
        limit("ten", "10.0.0.0/8", 2),
        limit("ten-one", "10.1.0.0/16", 3),
        limit("ten-one-two", "10.1.2.0/24", 4),
        proto(limit("web", "10.2.0.0/16", 6), Protocol::Tcp, Some(80)),
        syn,
        limit("v6", "::/0", 7),
    ]);
    let table = set.v4_table();
    assert_eq!(table.len(), v4_table::SLOTS as usize);
    let direct = |name: &str| v4_table::direct(Some(set.by_name(name).unwrap().id));
    // Covered by /0 only; by /8; by /16 (its own, longest).
    assert_eq!(table_word(&table, "192.0.2.1"), direct("all"));
    assert_eq!(table_word(&table, "10.200.0.1"), direct("ten"));
    assert_eq!(
        table_word(&table, "10.1.200.1"),
        v4_table::TRIE,
        "a /24 inside"
    );
    // A first candidate with a port or TCP flags: the outcome depends on the packet.
    assert_eq!(table_word(&table, "10.2.0.1"), v4_table::TRIE);
    assert_eq!(table_word(&table, "10.3.0.1"), v4_table::TRIE);
    // Without a /0, an uncovered /16 holds "no rule"; IPv6 prefixes write nothing.
    let bare = build(&[limit("ten", "10.0.0.0/8", 2), limit("v6", "::/0", 7)]);
    let t = bare.v4_table();
    assert_eq!(table_word(&t, "192.0.2.1"), v4_table::direct(None));
    assert_eq!(
        table_word(&t, "10.9.0.1"),
        v4_table::direct(Some(bare.by_name("ten").unwrap().id))
    );
    assert_eq!(
        build(&[]).v4_table(),
        vec![v4_table::direct(None); v4_table::SLOTS as usize]
    );
}

/// Over random rule sets (nested prefixes of every length, some with protocols, ports or TCP
/// flags), every address of every /16 the table holds an outcome for classifies to that outcome
/// in the reference walk, whatever the packet's protocol, port and flags.
#[test]
fn the_ipv4_tables_outcomes_agree_with_the_walk() {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let mut direct_words = 0usize;
    for round in 0..40 {
        let mut rules = Vec::new();
        for n in 0..(4 + next() % 12) {
            // Addresses in 10.0.0.0/14, so prefixes nest and overlap often.
            let addr = 0x0a00_0000u32 | (next() as u32 & 0x0003_ffff);
            let len = [0u8, 8, 12, 14, 15, 16, 16, 17, 20, 24, 32][next() as usize % 11];
            let base = u32::from(Ipv4Addr::from(addr))
                & u32::MAX.checked_shl(32 - u32::from(len)).unwrap_or(0);
            let source = format!("{}/{len}", Ipv4Addr::from(base));
            let mut r = limit(&format!("r{round}-{n}"), &source, 1 + n);
            match next() % 4 {
                0 => r = proto(r, Protocol::Udp, Some(53)),
                1 => {
                    r = proto(r, Protocol::Tcp, None);
                    if next() % 2 == 0 {
                        r.tcp_flags = Some(TcpFlags::Syn);
                    }
                }
                _ => {}
            }
            rules.push(r);
        }
        let Ok(set) = compile(&rules, &RuleIds::new()) else {
            continue;
        };
        let table = set.v4_table();
        for (slot, &word) in table.iter().enumerate() {
            let Some(want) = v4_table::outcome(word) else {
                continue;
            };
            // Only the /16s of 10.0.0.0/14 and two others: the rest hold the /0's outcome.
            if !(0x0a00..0x0a04).contains(&slot) && slot != 0 && slot != 0xc000 {
                continue;
            }
            direct_words += 1;
            for _ in 0..8 {
                let addr = (slot as u32) << 16 | (next() as u32 & 0xffff);
                for (protocol, port, flags) in [
                    (UDP, Some(53), 0),
                    (TCP, Some(80), 0x02),
                    (TCP, Some(80), 0x10),
                    (ICMP, None, 0),
                ] {
                    let got = set
                        .classify(IpAddr::V4(addr.into()), protocol, port, flags)
                        .map(|r| r.id);
                    assert_eq!(
                        got,
                        want,
                        "round {round}: {} under {rules:?}",
                        Ipv4Addr::from(addr)
                    );
                }
            }
        }
    }
    assert!(
        direct_words > 40,
        "the table held too few outcomes to test ({direct_words})"
    );
}
