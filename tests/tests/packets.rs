//! Every parser branch and malformed shape, run through the real XDP program with
//! BPF_PROG_TEST_RUN: each case names the frame, the expected verdict and the one counter that must
//! move (a rule verdict or a global parse counter).

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
"#;

/// The counter a case must move by one.
#[derive(Clone, Copy, Debug)]
enum Moves {
    /// Rule (by name) and verdict index.
    Rule(&'static str, usize),
    /// Global counter index, with no rule counter moving.
    Global(usize),
    /// A global parse counter *and* a rule verdict (packets classified without ports).
    Both(usize, &'static str, usize),
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

fn cases() -> Vec<(&'static str, Frame, u32, Moves)> {
    use Moves::{Both, Global, Rule};
    vec![
        // Ethernet and VLAN.
        // (A frame shorter than an Ethernet header cannot be tested here: BPF_PROG_TEST_RUN refuses
        // inputs under 14 bytes with EINVAL. The program still checks and counts it.)
        (
            "ARP (non-IP)",
            eth().ethertype(0x0806, 28),
            XDP_PASS,
            Global(global::NON_IP),
        ),
        (
            "LLDP (non-IP)",
            eth().ethertype(0x88cc, 40),
            XDP_PASS,
            Global(global::NON_IP),
        ),
        (
            "IPv4 UDP/53 denied",
            eth().ipv4(v4(1), dst4()).udp(1000, 53),
            XDP_DROP,
            Rule("v4-dns", verdict::DENIED),
        ),
        (
            "IPv4 UDP/54 allowed",
            eth().ipv4(v4(1), dst4()).udp(1000, 54),
            XDP_PASS,
            Rule("v4-all", verdict::ALLOWED),
        ),
        (
            "IPv4 TCP/53 is not UDP",
            eth().ipv4(v4(1), dst4()).tcp(1000, 53),
            XDP_PASS,
            Rule("v4-all", verdict::ALLOWED),
        ),
        (
            "IPv4 ICMP",
            eth().ipv4(v4(1), dst4()).icmp(),
            XDP_PASS,
            Rule("v4-all", verdict::ALLOWED),
        ),
        (
            "IPv4 GRE (no ports)",
            eth().ipv4(v4(1), dst4()).proto(47).payload(8),
            XDP_PASS,
            Rule("v4-all", verdict::ALLOWED),
        ),
        (
            "802.1Q tag",
            eth().vlan(10).ipv4(v4(1), dst4()).udp(1000, 53),
            XDP_DROP,
            Rule("v4-dns", verdict::DENIED),
        ),
        (
            "802.1ad outer + 802.1Q inner (QinQ)",
            eth().qinq(100).vlan(10).ipv4(v4(1), dst4()).udp(1000, 53),
            XDP_DROP,
            Rule("v4-dns", verdict::DENIED),
        ),
        (
            "two 802.1Q tags",
            eth().vlan(100).vlan(10).ipv4(v4(1), dst4()).udp(1000, 53),
            XDP_DROP,
            Rule("v4-dns", verdict::DENIED),
        ),
        (
            "three tags",
            eth()
                .qinq(1)
                .vlan(2)
                .vlan(3)
                .ipv4(v4(1), dst4())
                .udp(1000, 53),
            XDP_PASS,
            Global(global::BAD_VLAN),
        ),
        (
            "truncated inside the VLAN tag",
            eth().vlan(10).ipv4(v4(1), dst4()).truncate(16),
            XDP_PASS,
            Global(global::BAD_VLAN),
        ),
        (
            "truncated inside the inner VLAN tag",
            eth().qinq(1).vlan(10).ipv4(v4(1), dst4()).truncate(20),
            XDP_PASS,
            Global(global::BAD_VLAN),
        ),
        (
            "non-IP inside a VLAN tag",
            eth().vlan(10).ethertype(0x0806, 28),
            XDP_PASS,
            Global(global::NON_IP),
        ),
        // IPv4.
        (
            "IPv4 ether type, no header",
            eth().ipv4(v4(1), dst4()).truncate(14),
            XDP_PASS,
            Global(global::TRUNCATED_IPV4),
        ),
        (
            "IPv4 header cut at 19 bytes",
            eth().ipv4(v4(1), dst4()).udp(1, 53).truncate(14 + 19),
            XDP_PASS,
            Global(global::TRUNCATED_IPV4),
        ),
        (
            "IPv4 IHL 4 (< 5)",
            eth().ipv4(v4(1), dst4()).udp(1, 53).ihl(4),
            XDP_PASS,
            Global(global::BAD_IPV4),
        ),
        (
            "IPv4 IHL 15 past the frame end",
            eth().ipv4(v4(1), dst4()).ihl(15),
            XDP_PASS,
            Global(global::BAD_IPV4),
        ),
        (
            "IPv4 ether type, version field 6",
            eth().ipv4(v4(1), dst4()).udp(1, 53).version(6),
            XDP_PASS,
            Global(global::BAD_IPV4),
        ),
        (
            "IPv6 ether type, version field 4",
            eth().ipv6(v6(1), dst6()).tcp(1, 80).version(4),
            XDP_PASS,
            Global(global::BAD_IPV6),
        ),
        (
            "IPv4 with 12 bytes of options: port found after them",
            eth().ipv4(v4(1), dst4()).ipv4_options(12).udp(1000, 53),
            XDP_DROP,
            Rule("v4-dns", verdict::DENIED),
        ),
        (
            "IPv4 with 40 bytes of options",
            eth().ipv4(v4(1), dst4()).ipv4_options(40).udp(1000, 53),
            XDP_DROP,
            Rule("v4-dns", verdict::DENIED),
        ),
        (
            "IPv4 first fragment (offset 0, MF) keeps its ports",
            eth().ipv4(v4(1), dst4()).udp(1000, 53).frag(0, true),
            XDP_DROP,
            Rule("v4-dns", verdict::DENIED),
        ),
        (
            "IPv4 non-first fragment: no ports",
            eth()
                .ipv4(v4(1), dst4())
                .proto(17)
                .payload(32)
                .frag(185, false),
            XDP_PASS,
            Both(global::FRAGMENTS, "v4-all", verdict::ALLOWED),
        ),
        (
            "IPv4 UDP header cut short",
            eth()
                .ipv4(v4(1), dst4())
                .udp(1000, 53)
                .truncate(14 + 20 + 6),
            XDP_PASS,
            Both(global::TRUNCATED_L4, "v4-all", verdict::ALLOWED),
        ),
        (
            "IPv4 TCP header cut short",
            eth()
                .ipv4(v4(1), dst4())
                .tcp(1000, 53)
                .truncate(14 + 20 + 12),
            XDP_PASS,
            Both(global::TRUNCATED_L4, "v4-all", verdict::ALLOWED),
        ),
        (
            "IPv4 source outside every rule",
            eth().ipv4(Ipv4Addr::new(198, 19, 0, 1), dst4()).udp(1, 53),
            XDP_PASS,
            Global(global::NO_MATCH),
        ),
        // IPv6.
        (
            "IPv6 TCP/80 denied",
            eth().ipv6(v6(1), dst6()).tcp(1000, 80),
            XDP_DROP,
            Rule("v6-web", verdict::DENIED),
        ),
        (
            "IPv6 UDP/80 allowed",
            eth().ipv6(v6(1), dst6()).udp(1000, 80),
            XDP_PASS,
            Rule("v6-all", verdict::ALLOWED),
        ),
        (
            "IPv6 ICMPv6",
            eth().ipv6(v6(1), dst6()).icmp(),
            XDP_PASS,
            Rule("v6-all", verdict::ALLOWED),
        ),
        (
            "IPv6 in 802.1Q",
            eth().vlan(7).ipv6(v6(1), dst6()).tcp(1000, 80),
            XDP_DROP,
            Rule("v6-web", verdict::DENIED),
        ),
        (
            "IPv6 in QinQ",
            eth().qinq(7).vlan(8).ipv6(v6(1), dst6()).tcp(1000, 80),
            XDP_DROP,
            Rule("v6-web", verdict::DENIED),
        ),
        (
            "IPv6 hop-by-hop then TCP/80",
            eth().ipv6(v6(1), dst6()).ext(0, 0).tcp(1000, 80),
            XDP_DROP,
            Rule("v6-web", verdict::DENIED),
        ),
        (
            "IPv6 dest-opts + routing then TCP/80",
            eth()
                .ipv6(v6(1), dst6())
                .ext(60, 1)
                .ext(43, 0)
                .tcp(1000, 80),
            XDP_DROP,
            Rule("v6-web", verdict::DENIED),
        ),
        (
            "IPv6 first fragment then TCP/80",
            eth().ipv6(v6(1), dst6()).frag6(0, true).tcp(1000, 80),
            XDP_DROP,
            Rule("v6-web", verdict::DENIED),
        ),
        (
            "IPv6 non-first fragment: no ports",
            eth()
                .ipv6(v6(1), dst6())
                .frag6(100, false)
                .proto(6)
                .payload(40),
            XDP_PASS,
            Both(global::FRAGMENTS, "v6-all", verdict::ALLOWED),
        ),
        (
            "IPv6 five extension headers: port not reached",
            eth()
                .ipv6(v6(1), dst6())
                .ext(0, 0)
                .ext(60, 0)
                .ext(43, 0)
                .ext(60, 0)
                .ext(60, 0)
                .tcp(1000, 80),
            XDP_PASS,
            Both(global::TRUNCATED_L4, "v6-all", verdict::ALLOWED),
        ),
        (
            "IPv6 extension header cut short",
            eth()
                .ipv6(v6(1), dst6())
                .ext(60, 2)
                .tcp(1000, 80)
                .truncate(14 + 40 + 12),
            XDP_PASS,
            Both(global::TRUNCATED_L4, "v6-all", verdict::ALLOWED),
        ),
        (
            "IPv6 TCP header cut short",
            eth()
                .ipv6(v6(1), dst6())
                .tcp(1000, 80)
                .truncate(14 + 40 + 10),
            XDP_PASS,
            Both(global::TRUNCATED_L4, "v6-all", verdict::ALLOWED),
        ),
        (
            "IPv6 header cut at 39 bytes",
            eth().ipv6(v6(1), dst6()).tcp(1000, 80).truncate(14 + 39),
            XDP_PASS,
            Global(global::BAD_IPV6),
        ),
        (
            "IPv6 source outside every rule",
            eth()
                .ipv6(Ipv6Addr::new(0x2001, 0xdb9, 0, 0, 0, 0, 0, 1), dst6())
                .tcp(1, 80),
            XDP_PASS,
            Global(global::NO_MATCH),
        ),
    ]
}

#[test]
fn every_parser_branch_has_its_verdict_and_counter() {
    require_root();
    let mut dp = TestDataplane::new("packets", 1024).expect("load");
    let set = dp.install_toml(RULES).expect("install");
    let id = |name: &str| set.by_name(name).expect("rule").id;
    let all_rules = ["v4-dns", "v4-all", "v6-web", "v6-all"];
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
