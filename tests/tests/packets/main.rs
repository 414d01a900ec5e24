//! Every parser branch and malformed shape, run through the real XDP program with
//! BPF_PROG_TEST_RUN: each case names the frame, the expected verdict and the counters that must
//! move (a rule verdict, global parse counters, or both). Cases run in order on one data plane, so
//! the fragments of one datagram (one identification) are consecutive cases, tried as an attacker
//! would cut them: tiny first fragments, both orders, overlapping first fragments, long IPv6
//! header chains.

use std::net::{Ipv4Addr, Ipv6Addr};

use ratelimit_common::{global, verdict};
use ratelimit_testbed::{
    packet::{eth, Frame},
    require_root,
    xdp::{XDP_DROP, XDP_PASS},
    TestDataplane,
};

/// Deny UDP/53 and IPv6 TCP/80 from the test prefixes; allow everything else from them.
const RULES: &str = r#"
[[rule]]
name = "v4-dns"
source = "198.18.0.0/16"
protocol = "udp"
dst_port = 53
action = "deny"

[[rule]]
name = "v4-all"
source = "198.18.0.0/16"
action = "allow"

[[rule]]
name = "v6-web"
source = "2001:db8::/32"
protocol = "tcp"
dst_port = 80
action = "deny"

[[rule]]
name = "v6-all"
source = "2001:db8::/32"
action = "allow"

# Prefixes where no rule looks at the protocol or port.
[[rule]]
name = "v4-any"
source = "198.19.1.0/24"
action = "allow"

[[rule]]
name = "v6-any"
source = "2001:db7::/32"
action = "allow"
"#;

const ALL_RULES: [&str; 6] = ["v4-dns", "v4-all", "v6-web", "v6-all", "v4-any", "v6-any"];

/// The counter a case must move by one.
#[derive(Clone, Copy, Debug)]
enum Moves {
    /// Rule (by name) and verdict index.
    Rule(&'static str, usize),
    /// Global counter index, with no rule counter moving.
    Global(usize),
    /// A global parse counter *and* a rule verdict (packets classified without ports).
    Both(usize, &'static str, usize),
    /// Several global counters, and a rule verdict if any.
    Many(&'static [usize], Option<(&'static str, usize)>),
}

fn v4(last: u8) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 0, last)
}
fn v6(last: u16) -> Ipv6Addr {
    Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, last)
}
fn dst4() -> Ipv4Addr {
    Ipv4Addr::new(198, 18, 0, 254)
}
fn dst6() -> Ipv6Addr {
    v6(0xfe)
}

fn v4o(last: u8) -> Ipv4Addr {
    Ipv4Addr::new(198, 19, 1, last)
}
fn v6o(last: u16) -> Ipv6Addr {
    Ipv6Addr::new(0x2001, 0xdb7, 0, 0, 0, 0, 0, last)
}

/// The most VLAN tags the program walks (see `parse::MAX_VLAN_TAGS`).
const MAX_TAGS: usize = 8;

/// A frame with `n` VLAN tags of id `vid` (the outer one 802.1ad, the rest 802.1Q).
fn tags(n: usize, vid: u16) -> Frame {
    let mut f = eth().qinq(vid);
    for _ in 1..n {
        f = f.vlan(vid);
    }
    f
}

/// A destination-options header (8 bytes) followed by a TCP SYN header to `port`: the bytes a
/// crafted IPv6 frame carries past its payload length, or a later fragment's data.
fn dstopts_then_tcp(port: u16) -> Vec<u8> {
    let mut b = vec![6, 0, 0, 0, 0, 0, 0, 0];
    let mut tcp = [0u8; 20];
    tcp[0..2].copy_from_slice(&1000u16.to_be_bytes());
    tcp[2..4].copy_from_slice(&port.to_be_bytes());
    tcp[12] = 5 << 4;
    tcp[13] = 0x02;
    b.extend_from_slice(&tcp);
    b
}

/// An IPv6 TCP/80 packet behind `n` destination-options headers, optionally after a first
/// fragment header (identification `id`).
fn chain6(n: usize, frag: Option<u32>) -> Frame {
    let mut f = eth().ipv6(v6(1), dst6());
    if let Some(id) = frag {
        f = f.frag6(0, true).ident(id);
    }
    for _ in 0..n {
        f = f.ext(60, 0);
    }
    f.tcp(1000, 80)
}

mod cases;
mod syn;

use cases::cases;

#[test]
fn every_parser_branch_has_its_verdict_and_counter() {
    require_root();
    let mut dp = TestDataplane::new("packets", 1024).expect("load");
    let set = dp.install_toml(RULES).expect("install");
    let id = |name: &str| set.by_name(name).expect("rule").id;
    let all_rules = ALL_RULES;
    let mut failures = Vec::new();
    for (desc, frame, want_action, moves) in cases() {
        let bytes = frame.build();
        let g0 = dp.global();
        let r0: Vec<_> = all_rules.iter().map(|n| dp.rule(id(n))).collect();
        let action = dp.run(&bytes);
        let g1 = dp.global();
        let r1: Vec<_> = all_rules.iter().map(|n| dp.rule(id(n))).collect();

        let mut want_global = [0u64; global::COUNT];
        want_global[global::PACKETS] = 1;
        let mut want_rule: Vec<[u64; verdict::COUNT]> = vec![[0; verdict::COUNT]; all_rules.len()];
        match moves {
            Moves::Rule(name, v) => {
                want_rule[all_rules.iter().position(|n| *n == name).unwrap()][v] = 1
            }
            Moves::Global(g) => want_global[g] += 1,
            Moves::Both(g, name, v) => {
                want_global[g] += 1;
                want_rule[all_rules.iter().position(|n| *n == name).unwrap()][v] = 1;
            }
            Moves::Many(gs, rule) => {
                for &g in gs {
                    want_global[g] += 1;
                }
                if let Some((name, v)) = rule {
                    want_rule[all_rules.iter().position(|n| *n == name).unwrap()][v] = 1;
                }
            }
        }
        let got_global: Vec<u64> = (0..global::COUNT)
            .map(|i| g1.counters[i] - g0.counters[i])
            .collect();
        let got_rule: Vec<[u64; verdict::COUNT]> = r0
            .iter()
            .zip(&r1)
            .map(|(a, b)| std::array::from_fn(|v| b.pkts[v] - a.pkts[v]))
            .collect();
        if action != want_action || got_global != want_global || got_rule != want_rule {
            failures.push(format!(
                "{desc}: action {action} (want {want_action}), global delta {got_global:?} (want {want_global:?}), rule deltas {got_rule:?} (want {want_rule:?})"
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} case(s) failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn bytes_counted_per_rule_are_the_frame_lengths() {
    require_root();
    let mut dp = TestDataplane::new("pktbytes", 1024).expect("load");
    let set = dp.install_toml(RULES).expect("install");
    let allow = set.by_name("v4-all").unwrap().id;
    let frame = eth().ipv4(v4(9), dst4()).udp(1, 9).pad_to(300).build();
    for _ in 0..3 {
        assert_eq!(dp.run(&frame), XDP_PASS);
    }
    let s = dp.rule(allow);
    assert_eq!(s.pkts[verdict::ALLOWED], 3);
    assert_eq!(s.bytes[verdict::ALLOWED], 900);
}

/// The program caches each source's classification per CPU, keyed by the rule-set epoch: every
/// install must be seen by the very next packet, including one that brings back the trie half a
/// cached entry came from (no packet in between), a rule that now covers a source that matched
/// nothing, and ports that pick different rules for one source.
#[test]
fn classification_follows_every_rule_change() {
    require_root();
    let mut dp = TestDataplane::new("pktcache", 1024).expect("load");
    let src = v4(7);
    let udp = |port| eth().ipv4(src, dst4()).udp(1000, port).build();
    let outside = eth()
        .ipv4(Ipv4Addr::new(198, 19, 0, 7), dst4())
        .udp(1000, 53)
        .build();
    let id =
        |set: &ratelimit::compile::CompiledRuleSet, name: &str| set.by_name(name).expect("rule").id;
    // Which rule counted the last frame, and how.
    let check = |dp: &TestDataplane, frame: &[u8], rule: Option<u32>, v: usize, want: u32| {
        let g0 = dp.global();
        let r0 = rule.map(|id| dp.rule(id));
        assert_eq!(dp.run(frame), want);
        match rule {
            Some(id) => assert_eq!(dp.rule(id).pkts[v] - r0.unwrap().pkts[v], 1, "rule {id}"),
            None => assert_eq!(
                dp.global().counters[global::NO_MATCH] - g0.counters[global::NO_MATCH],
                1
            ),
        }
    };

    let a = dp
        .install_toml("[[rule]]\nname = \"a\"\nsource = \"198.18.0.0/16\"\naction = \"allow\"\n")
        .expect("install a");
    check(&dp, &udp(53), Some(id(&a, "a")), verdict::ALLOWED, XDP_PASS);
    check(&dp, &outside, None, 0, XDP_PASS);
    // Two installs, no packet in between: the third set lives in the trie half the first did.
    dp.install_toml("[[rule]]\nname = \"b\"\nsource = \"198.18.0.0/16\"\naction = \"deny\"\n")
        .expect("install b");
    let c = dp
        .install_toml(
            "[[rule]]\nname = \"c\"\nsource = \"198.18.0.0/15\"\naction = \"deny\"\n\n\
             [[rule]]\nname = \"c-dns\"\nsource = \"198.18.0.0/16\"\nprotocol = \"udp\"\n\
             dst_port = 53\naction = \"allow\"\n",
        )
        .expect("install c");
    check(
        &dp,
        &udp(53),
        Some(id(&c, "c-dns")),
        verdict::ALLOWED,
        XDP_PASS,
    );
    check(&dp, &udp(80), Some(id(&c, "c")), verdict::DENIED, XDP_DROP);
    check(
        &dp,
        &udp(53),
        Some(id(&c, "c-dns")),
        verdict::ALLOWED,
        XDP_PASS,
    );
    // The source that matched nothing is now under "c" (a /15).
    check(&dp, &outside, Some(id(&c, "c")), verdict::DENIED, XDP_DROP);
}

/// A fragment sent seconds after its first fragment still follows it: the kernel keeps a
/// datagram's fragments for 30 s (IPv4) or 60 s (IPv6) by default, so one classified alone
/// after a shorter memory (it was 5 s) would pass uncharged by ports into a datagram whose first
/// fragment was denied, or charge another rule than its datagram's.
#[test]
fn a_fragment_sent_seconds_after_its_first_still_follows_it() {
    require_root();
    let mut dp = TestDataplane::new("pktlatefrag", 1024).expect("load");
    let set = dp.install_toml(RULES).expect("install");
    let dns = set.by_name("v4-dns").expect("rule").id;
    let first = eth()
        .ipv4(v4(40), dst4())
        .udp(1000, 53)
        .payload(8)
        .frag(0, true)
        .ident(0x7777)
        .build();
    assert_eq!(dp.run(&first), XDP_DROP, "the first fragment is denied");
    std::thread::sleep(std::time::Duration::from_secs(6));
    let later = eth()
        .ipv4(v4(40), dst4())
        .proto(17)
        .payload(16)
        .frag(2, false)
        .ident(0x7777)
        .build();
    let (g0, r0) = (dp.global(), dp.rule(dns));
    assert_eq!(dp.run(&later), XDP_DROP, "6 s later: still its datagram's");
    assert_eq!(
        dp.rule(dns).pkts[verdict::DENIED] - r0.pkts[verdict::DENIED],
        1
    );
    assert_eq!(
        dp.global().counters[global::FRAGMENTS_UNMATCHED]
            - g0.counters[global::FRAGMENTS_UNMATCHED],
        0,
        "not classified alone"
    );
}

/// A frame in more VLAN tags than the program walks hides its source, so it is dropped while a
/// rule that can drop (deny or limit) is in force, whatever the rule, and passed while none is:
/// the agent keeps that in the config's flags with each install, and its other flag writes keep
/// it. In dry run such a frame is counted as dropped and passed, as other shapes' drops are.
#[test]
fn frames_past_the_vlan_walk_are_dropped_only_while_a_rule_can_drop() {
    use ratelimit_common::config_flags::DRY_RUN;
    require_root();
    let mut dp = TestDataplane::new("pktvlan", 1024).expect("load");
    let deep = tags(MAX_TAGS + 1, 0)
        .ipv4(v4(9), dst4())
        .udp(1000, 80)
        .build();
    let walked = tags(MAX_TAGS, 0).ipv4(v4(9), dst4()).udp(1000, 80).build();
    // The frame's action and which of the two counters it moved.
    let run = |dp: &TestDataplane, frame: &[u8]| {
        let g0 = dp.global().counters;
        let action = dp.run(frame);
        let g1 = dp.global().counters;
        let moved = |c: usize| g1[c] - g0[c];
        (
            action,
            moved(global::BAD_VLAN),
            moved(global::DROPPED_VLAN_CHAINS),
        )
    };
    let allow_only = "[[rule]]\nname = \"a\"\nsource = \"198.18.0.0/16\"\naction = \"allow\"\n";
    let set = dp.install_toml(allow_only).expect("install allow");
    assert_eq!(run(&dp, &deep), (XDP_PASS, 1, 0), "allow rules only");
    let a = set.by_name("a").expect("rule").id;
    let before = dp.rule(a).pkts[verdict::ALLOWED];
    assert_eq!(dp.run(&walked), XDP_PASS);
    assert_eq!(
        dp.rule(a).pkts[verdict::ALLOWED] - before,
        1,
        "8 tags: classified"
    );

    // A limit on another prefix: the deep frame's source is unknown, so it could apply.
    dp.install_toml(&format!(
        "{allow_only}\n[[rule]]\nname = \"l\"\nsource = \"203.0.113.0/24\"\nrate = 10\n"
    ))
    .expect("install limit");
    assert_eq!(run(&dp, &deep), (XDP_DROP, 0, 1), "a limit in force");
    dp.dataplane().set_flags(DRY_RUN).expect("dry run");
    assert_eq!(
        run(&dp, &deep),
        (XDP_PASS, 0, 1),
        "dry run: counted, passed"
    );
    dp.dataplane().set_flags(0).expect("flags");
    assert_eq!(run(&dp, &deep), (XDP_DROP, 0, 1), "the flag write kept it");

    dp.install_toml(allow_only).expect("install allow again");
    assert_eq!(run(&dp, &deep), (XDP_PASS, 1, 0), "allow rules only again");
    dp.install_toml("[[rule]]\nname = \"d\"\nsource = \"2001:db8::/32\"\naction = \"deny\"\n")
        .expect("install deny");
    assert_eq!(run(&dp, &deep), (XDP_DROP, 0, 1), "a deny in force");
}
