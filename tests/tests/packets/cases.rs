//! The cases of `every_parser_branch_has_its_verdict_and_counter`, by layer, in the order they
//! run: the fragments of one datagram (one identification) are consecutive.

use ratelimit_common::{global, verdict};
use ratelimit_testbed::{
    packet::{eth, Frame},
    xdp::{XDP_DROP, XDP_PASS},
};

use crate::Moves::{Global, Rule};
use crate::{chain6, dst4, tags, v4, Moves, MAX_TAGS};
use global::DROPPED_LONG_CHAINS as LONG;

mod ipv4;
mod ipv6;

use ipv4::{ipv4, ipv4_fragments, ipv4_lengths};
use ipv6::{ipv6, ipv6_fragments, ipv6_inner_fragments_and_cuts};

/// What a case sends, the XDP action it must get and the counter it must move.
pub type Case = (&'static str, Frame, u32, Moves);

/// Every case, in order.
pub fn cases() -> Vec<Case> {
    [
        ethernet(),
        ipv4(),
        ipv4_fragments(),
        ipv4_lengths(),
        ipv6(),
        ipv6_fragments(),
        ipv6_inner_fragments_and_cuts(),
        chains(),
    ]
    .concat()
}

/// Non-IP frames, the first IPv4 verdicts, and VLAN tags: those the program walks, more than
/// that, and frames cut inside them.
fn ethernet() -> Vec<Case> {
    vec![
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
        // The stack strips any number of priority tags (VLAN id 0) and delivers what is inside,
        // so a third (or eighth) tag must not walk past the deny rule.
        (
            "three priority tags (VLAN id 0)",
            tags(3, 0).ipv4(v4(1), dst4()).udp(1000, 53),
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
            XDP_DROP,
            Rule("v4-dns", verdict::DENIED),
        ),
        (
            "eight priority tags, the most the parser walks",
            tags(MAX_TAGS, 0).ipv4(v4(1), dst4()).udp(1000, 53),
            XDP_DROP,
            Rule("v4-dns", verdict::DENIED),
        ),
        (
            "nine priority tags: the source is past the walk, and a rule that drops is in force",
            tags(MAX_TAGS + 1, 0).ipv4(v4(1), dst4()).udp(1000, 53),
            XDP_DROP,
            Global(global::DROPPED_VLAN_CHAINS),
        ),
        (
            "nine tags around an allowed packet: dropped all the same (its source is unknown)",
            tags(MAX_TAGS + 1, 7).ipv4(v4(1), dst4()).udp(1000, 54),
            XDP_DROP,
            Global(global::DROPPED_VLAN_CHAINS),
        ),
        (
            "truncated inside the eighth tag",
            tags(MAX_TAGS + 1, 0).truncate(14 + 4 * (MAX_TAGS - 1) + 3),
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
    ]
}

/// IPv6 extension header chains of 1 to 10 headers, unfragmented and in a first fragment: past
/// the most the program walks, dropped as long chains.
fn chains() -> Vec<Case> {
    (1..=10)
        .flat_map(|n| {
            let frag_ext = n - 1; // with the fragment header, n extension headers in all
            let (unfragmented, fragmented) = if n <= 8 {
                (
                    (XDP_DROP, Rule("v6-web", verdict::DENIED)),
                    (XDP_DROP, Rule("v6-web", verdict::DENIED)),
                )
            } else {
                ((XDP_DROP, Global(LONG)), (XDP_DROP, Global(LONG)))
            };
            [
                (
                    leak(format!("IPv6 {n} extension headers, then TCP/80")),
                    chain6(n, None),
                    unfragmented.0,
                    unfragmented.1,
                ),
                (
                    leak(format!(
                        "IPv6 first fragment with {n} extension headers in all, then TCP/80"
                    )),
                    chain6(frag_ext, Some(0x600 + u32::try_from(n).unwrap())),
                    fragmented.0,
                    fragmented.1,
                ),
            ]
        })
        .collect()
}

fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}
