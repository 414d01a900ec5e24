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

fn cases() -> Vec<(&'static str, Frame, u32, Moves)> {
    use global::{
        DROPPED_FRAGMENT_CONFLICTS as CONFLICT, DROPPED_LONG_CHAINS as LONG,
        DROPPED_TINY_FRAGMENTS as TINY, DROPPED_UNMATCHED_FRAGMENTS as UNMATCHED_DROP, FRAGMENTS,
        FRAGMENTS_UNMATCHED as UNMATCHED,
    };
    use Moves::{Both, Global, Many, Rule};
    let chains = (1..=10).flat_map(|n| {
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
    });
    let mut cases =
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
            eth().ipv4(v4(1), dst4()).udp(1000, 53).frag(0, true).ident(100),
            XDP_DROP,
            Rule("v4-dns", verdict::DENIED),
        ),
        // A later fragment whose first was not seen: its datagram's ports are unknown, so where
        // a port rule could apply (a limit would not see its charge) it is dropped with its
        // datagram; from a source no such rule covers, the rule whatever the ports takes it.
        (
            "IPv4 non-first fragment of a datagram whose first was not seen: a port rule could \
             apply, dropped",
            eth()
                .ipv4(v4(1), dst4())
                .proto(17)
                .payload(32)
                .frag(185, false)
                .ident(1),
            XDP_DROP,
            Many(&[FRAGMENTS, UNMATCHED, UNMATCHED_DROP], None),
        ),
        (
            "IPv4 non-first TCP fragment whose first was not seen: only a UDP rule looks at ports \
             (an IPv4 fragment names its datagram's protocol), so the rule for any takes it",
            eth()
                .ipv4(v4(1), dst4())
                .proto(6)
                .payload(32)
                .frag(185, false)
                .ident(1),
            XDP_PASS,
            Many(&[FRAGMENTS, UNMATCHED], Some(("v4-all", verdict::ALLOWED))),
        ),
        (
            "IPv4 non-first fragment whose first was not seen, from a source no port rule covers: \
             its any rule",
            eth()
                .ipv4(v4o(1), dst4())
                .proto(17)
                .payload(32)
                .frag(185, false)
                .ident(1),
            XDP_PASS,
            Many(&[FRAGMENTS, UNMATCHED], Some(("v4-any", verdict::ALLOWED))),
        ),
        // The datagram of RFC 1858's tiny-fragment attack: the first fragment holds 8 bytes of
        // the TCP header (ports included, flags not), the second the rest.
        (
            "IPv4 tiny first fragment (8 bytes of TCP)",
            eth()
                .ipv4(v4(1), dst4())
                .tcp(1000, 53)
                .frag(0, true)
                .ident(2)
                .truncate(14 + 20 + 8),
            XDP_DROP,
            Global(TINY),
        ),
        (
            "IPv4 second fragment of the tiny one: dropped with its datagram",
            eth()
                .ipv4(v4(1), dst4())
                .proto(6)
                .payload(12)
                .frag(1, false)
                .ident(2),
            XDP_DROP,
            Many(&[FRAGMENTS, TINY], None),
        ),
        (
            "IPv4 tiny UDP first fragment (4 bytes)",
            eth()
                .ipv4(v4(1), dst4())
                .udp(1000, 54)
                .frag(0, true)
                .ident(3)
                .truncate(14 + 20 + 4),
            XDP_DROP,
            Global(TINY),
        ),
        (
            "IPv4 tiny first fragment where no rule looks at ports: its any rule",
            eth()
                .ipv4(v4o(1), dst4())
                .tcp(1000, 53)
                .frag(0, true)
                .ident(4)
                .truncate(14 + 20 + 8),
            XDP_PASS,
            Rule("v4-any", verdict::ALLOWED),
        ),
        (
            "IPv4 first fragment of a denied datagram",
            eth()
                .ipv4(v4(1), dst4())
                .udp(1000, 53)
                .frag(0, true)
                .ident(5),
            XDP_DROP,
            Rule("v4-dns", verdict::DENIED),
        ),
        (
            "IPv4 second fragment of the denied datagram: denied too",
            eth()
                .ipv4(v4(1), dst4())
                .proto(17)
                .payload(16)
                .frag(1, false)
                .ident(5),
            XDP_DROP,
            Both(FRAGMENTS, "v4-dns", verdict::DENIED),
        ),
        (
            "IPv4 fragment of the same id from another source: not that datagram",
            eth()
                .ipv4(v4o(2), dst4())
                .proto(17)
                .payload(16)
                .frag(1, false)
                .ident(5),
            XDP_PASS,
            Many(&[FRAGMENTS, UNMATCHED], Some(("v4-any", verdict::ALLOWED))),
        ),
        (
            "IPv4 second fragment before its first (reversed order): dropped",
            eth()
                .ipv4(v4(1), dst4())
                .proto(17)
                .payload(16)
                .frag(1, false)
                .ident(6),
            XDP_DROP,
            Many(&[FRAGMENTS, UNMATCHED, UNMATCHED_DROP], None),
        ),
        (
            "IPv4 first fragment after its second: denied (and its datagram lacks the second)",
            eth()
                .ipv4(v4(1), dst4())
                .udp(1000, 53)
                .frag(0, true)
                .ident(6),
            XDP_DROP,
            Rule("v4-dns", verdict::DENIED),
        ),
        (
            "IPv4 second fragment of a datagram to an allowed port, before its first: dropped \
             (the rule without ports takes no charge of it)",
            eth()
                .ipv4(v4(1), dst4())
                .proto(17)
                .payload(16)
                .frag(1, false)
                .ident(0x606),
            XDP_DROP,
            Many(&[FRAGMENTS, UNMATCHED, UNMATCHED_DROP], None),
        ),
        (
            "IPv4 its first fragment, to UDP/54: judged by its own ports (its datagram never \
             completes)",
            eth()
                .ipv4(v4(1), dst4())
                .udp(1000, 54)
                .frag(0, true)
                .ident(0x606),
            XDP_PASS,
            Rule("v4-all", verdict::ALLOWED),
        ),
        (
            "IPv4 that datagram's second fragment sent again, after its first: follows it",
            eth()
                .ipv4(v4(1), dst4())
                .proto(17)
                .payload(16)
                .frag(1, false)
                .ident(0x606),
            XDP_PASS,
            Both(FRAGMENTS, "v4-all", verdict::ALLOWED),
        ),
        (
            "IPv4 first fragment to an allowed port",
            eth()
                .ipv4(v4(1), dst4())
                .udp(1000, 54)
                .frag(0, true)
                .ident(7),
            XDP_PASS,
            Rule("v4-all", verdict::ALLOWED),
        ),
        (
            "IPv4 first fragment sent again to a denied port (overlap): the datagram is dropped",
            eth()
                .ipv4(v4(1), dst4())
                .udp(1000, 53)
                .frag(0, true)
                .ident(7),
            XDP_DROP,
            Global(CONFLICT),
        ),
        (
            "IPv4 first fragment sent a third time to the allowed port: still dropped",
            eth()
                .ipv4(v4(1), dst4())
                .udp(1000, 54)
                .frag(0, true)
                .ident(7),
            XDP_DROP,
            Global(CONFLICT),
        ),
        (
            "IPv4 second fragment of the overlapped datagram: dropped",
            eth()
                .ipv4(v4(1), dst4())
                .proto(17)
                .payload(16)
                .frag(1, false)
                .ident(7),
            XDP_DROP,
            Many(&[FRAGMENTS, CONFLICT], None),
        ),
        (
            "IPv4 first fragment to a denied port, then again to an allowed one: stays dropped",
            eth()
                .ipv4(v4(1), dst4())
                .udp(1000, 53)
                .frag(0, true)
                .ident(8),
            XDP_DROP,
            Rule("v4-dns", verdict::DENIED),
        ),
        (
            "IPv4 first fragment re-sent to an allowed port after a denied one",
            eth()
                .ipv4(v4(1), dst4())
                .udp(1000, 54)
                .frag(0, true)
                .ident(8),
            XDP_DROP,
            Global(CONFLICT),
        ),
        (
            "IPv4 the same first fragment twice (a retransmission): same verdict",
            eth()
                .ipv4(v4(1), dst4())
                .udp(1000, 54)
                .frag(0, true)
                .ident(9),
            XDP_PASS,
            Rule("v4-all", verdict::ALLOWED),
        ),
        (
            "IPv4 the same first fragment again",
            eth()
                .ipv4(v4(1), dst4())
                .udp(1000, 54)
                .frag(0, true)
                .ident(9),
            XDP_PASS,
            Rule("v4-all", verdict::ALLOWED),
        ),
        (
            "IPv4 its second fragment: follows it",
            eth()
                .ipv4(v4(1), dst4())
                .proto(17)
                .payload(16)
                .frag(1, false)
                .ident(9),
            XDP_PASS,
            Both(FRAGMENTS, "v4-all", verdict::ALLOWED),
        ),
        // The IP header's length bounds the parse, not the frame: a short frame is padded to 60
        // bytes on the wire, and the receiving stack trims the padding off before it reassembles.
        (
            "IPv4 whole UDP/53 padded to 60 bytes: its header is all there",
            eth().ipv4(v4(1), dst4()).udp(1000, 53).trailer(&[0; 18]),
            XDP_DROP,
            Rule("v4-dns", verdict::DENIED),
        ),
        (
            "IPv4 first fragment of 8 TCP bytes padded to 60: tiny (the padding is not its flags)",
            eth()
                .ipv4(v4(1), dst4())
                .tcp(1000, 53)
                .cut_l4(8)
                .frag(0, true)
                .ident(10)
                .trailer(&[0; 18]),
            XDP_DROP,
            Global(TINY),
        ),
        (
            "IPv4 second fragment of the padded tiny one: dropped with its datagram",
            eth()
                .ipv4(v4(1), dst4())
                .proto(6)
                .payload(12)
                .frag(1, false)
                .ident(10),
            XDP_DROP,
            Many(&[FRAGMENTS, TINY], None),
        ),
        (
            "IPv4 UDP header past the total length (a trailer holds the rest): no ports",
            eth()
                .ipv4(v4(1), dst4())
                .udp(1000, 53)
                .cut_l4(6)
                .trailer(&[0; 18]),
            XDP_PASS,
            Both(global::TRUNCATED_L4, "v4-all", verdict::ALLOWED),
        ),
        (
            "IPv4 total length shorter than the header",
            eth().ipv4(v4(1), dst4()).cut_l4(0).ihl(6).trailer(&[0; 26]),
            XDP_PASS,
            Global(global::BAD_IPV4),
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
            eth().ipv6(v6(1), dst6()).frag6(0, true).ident(1).tcp(1000, 80),
            XDP_DROP,
            Rule("v6-web", verdict::DENIED),
        ),
        (
            "IPv6 second fragment of the denied datagram: denied too",
            eth()
                .ipv6(v6(1), dst6())
                .frag6(2, false)
                .ident(1)
                .proto(6)
                .payload(40),
            XDP_DROP,
            Both(FRAGMENTS, "v6-web", verdict::DENIED),
        ),
        // The kernel reassembles an IPv6 datagram by source, destination and identification: a
        // later fragment's own next header does not take it out of its datagram.
        (
            "IPv6 first fragment to TCP/80 (denied), identification 0x901",
            eth().ipv6(v6(1), dst6()).frag6(0, true).ident(0x901).tcp(1000, 80),
            XDP_DROP,
            Rule("v6-web", verdict::DENIED),
        ),
        (
            "IPv6 second fragment naming no next header (59): denied with its datagram",
            eth()
                .ipv6(v6(1), dst6())
                .frag6(2, false)
                .ident(0x901)
                .proto(59)
                .payload(40),
            XDP_DROP,
            Both(FRAGMENTS, "v6-web", verdict::DENIED),
        ),
        // An extension header chain that runs past the payload length into a trailer: the stack
        // trims the trailer, so the chain ends (cut) inside this fragment, and the L4 header the
        // trailer shows (TCP/22, allowed) is not the one reassembly delivers (TCP/80, denied).
        (
            "IPv6 first fragment whose chain runs past its payload into a trailer: RFC 7112",
            eth()
                .ipv6(v6(1), dst6())
                .frag6(0, true)
                .ident(0x902)
                .ext(60, 0)
                .proto(60)
                .trailer(&dstopts_then_tcp(22)),
            XDP_DROP,
            Global(LONG),
        ),
        (
            "IPv6 its second fragment (dest-opts, TCP/80): dropped with its datagram",
            eth()
                .ipv6(v6(1), dst6())
                .frag6(1, false)
                .ident(0x902)
                .proto(60)
                .data(&dstopts_then_tcp(80)),
            XDP_DROP,
            Many(&[FRAGMENTS, LONG], None),
        ),
        (
            "IPv6 unfragmented, its chain cut by the payload length (TCP/80 in a trailer): the \
             stack discards it; passed",
            eth()
                .ipv6(v6(1), dst6())
                .ext(60, 0)
                .proto(60)
                .trailer(&dstopts_then_tcp(80)),
            XDP_PASS,
            Global(global::TRUNCATED_L4),
        ),
        (
            "IPv6 non-first fragment of a datagram whose first was not seen: a port rule could \
             apply, dropped",
            eth()
                .ipv6(v6(1), dst6())
                .frag6(100, false)
                .ident(2)
                .proto(6)
                .payload(40),
            XDP_DROP,
            Many(&[FRAGMENTS, UNMATCHED, UNMATCHED_DROP], None),
        ),
        (
            "IPv6 its first fragment afterwards (reversed order), to TCP/80: denied",
            eth().ipv6(v6(1), dst6()).frag6(0, true).ident(2).tcp(1000, 80),
            XDP_DROP,
            Rule("v6-web", verdict::DENIED),
        ),
        (
            "IPv6 non-first fragment whose first was not seen, from a source no port rule covers: \
             its any rule",
            eth()
                .ipv6(v6o(1), dst6())
                .frag6(100, false)
                .ident(2)
                .proto(6)
                .payload(40),
            XDP_PASS,
            Many(&[FRAGMENTS, UNMATCHED], Some(("v6-any", verdict::ALLOWED))),
        ),
        (
            "IPv6 first fragment to TCP/81 (allowed)",
            eth().ipv6(v6(1), dst6()).frag6(0, true).ident(3).tcp(1000, 81),
            XDP_PASS,
            Rule("v6-all", verdict::ALLOWED),
        ),
        (
            "IPv6 first fragment sent again to TCP/80 (overlap): the datagram is dropped",
            eth().ipv6(v6(1), dst6()).frag6(0, true).ident(3).tcp(1000, 80),
            XDP_DROP,
            Global(CONFLICT),
        ),
        (
            "IPv6 second fragment of the overlapped datagram: dropped",
            eth()
                .ipv6(v6(1), dst6())
                .frag6(2, false)
                .ident(3)
                .proto(6)
                .payload(40),
            XDP_DROP,
            Many(&[FRAGMENTS, CONFLICT], None),
        ),
        (
            "IPv6 tiny first fragment (8 bytes of TCP)",
            eth()
                .ipv6(v6(1), dst6())
                .frag6(0, true)
                .ident(4)
                .tcp(1000, 80)
                .truncate(14 + 40 + 8 + 8),
            XDP_DROP,
            Global(TINY),
        ),
        (
            "IPv6 second fragment of the tiny one: dropped",
            eth()
                .ipv6(v6(1), dst6())
                .frag6(1, false)
                .ident(4)
                .proto(6)
                .payload(12),
            XDP_DROP,
            Many(&[FRAGMENTS, TINY], None),
        ),
        (
            "IPv6 first fragment whose chain ends before the L4 header (RFC 7112)",
            eth()
                .ipv6(v6(1), dst6())
                .frag6(0, true)
                .ident(5)
                .ext(60, 2)
                .tcp(1000, 80)
                .truncate(14 + 40 + 8 + 12),
            XDP_DROP,
            Global(LONG),
        ),
        (
            "IPv6 first fragment, chain ends before L4, where no rule looks at ports: any rule",
            eth()
                .ipv6(v6o(1), dst6())
                .frag6(0, true)
                .ident(6)
                .ext(60, 2)
                .tcp(1000, 80)
                .truncate(14 + 40 + 8 + 12),
            XDP_PASS,
            Many(&[global::LONG_CHAINS], Some(("v6-any", verdict::ALLOWED))),
        ),
        (
            "IPv6 twelve extension headers where no rule looks at ports: passed, counted",
            {
                let mut f = eth().ipv6(v6o(1), dst6());
                for _ in 0..12 {
                    f = f.ext(60, 0);
                }
                f.tcp(1000, 80)
            },
            XDP_PASS,
            Many(&[global::LONG_CHAINS], Some(("v6-any", verdict::ALLOWED))),
        ),
        (
            "IPv6 AH then TCP/80",
            eth().ipv6(v6(1), dst6()).ah(4).tcp(1000, 80),
            XDP_DROP,
            Rule("v6-web", verdict::DENIED),
        ),
        (
            "IPv6 hop-by-hop, AH, dest-opts then TCP/80",
            eth()
                .ipv6(v6(1), dst6())
                .ext(0, 0)
                .ah(1)
                .ext(60, 1)
                .tcp(1000, 80),
            XDP_DROP,
            Rule("v6-web", verdict::DENIED),
        ),
        (
            "IPv6 ESP (encrypted: no ports, protocol 50)",
            eth().ipv6(v6(1), dst6()).proto(50).payload(40),
            XDP_PASS,
            Rule("v6-all", verdict::ALLOWED),
        ),
        (
            "IPv6 dest-opts then ESP",
            eth().ipv6(v6(1), dst6()).ext(60, 0).proto(50).payload(40),
            XDP_PASS,
            Rule("v6-all", verdict::ALLOWED),
        ),
        (
            "IPv6 No Next Header after dest-opts",
            eth().ipv6(v6(1), dst6()).ext(60, 0),
            XDP_PASS,
            Rule("v6-all", verdict::ALLOWED),
        ),
        (
            "IPv6 atomic fragment (offset 0, no more): a whole packet",
            eth().ipv6(v6(1), dst6()).frag6(0, false).ident(7).tcp(1000, 80),
            XDP_DROP,
            Rule("v6-web", verdict::DENIED),
        ),
        // Two fragment headers: the kernel queues the packet under the first (its datagram)
        // and reads the second only once that datagram is reassembled. The program judges the
        // packet by the last; the outer datagram's other fragments are then unmatched, and
        // dropped where a port rule could apply, so it never completes.
        (
            "IPv6 first fragment whose chain holds an atomic fragment header, then TCP/80: \
             judged by its ports",
            eth()
                .ipv6(v6(1), dst6())
                .frag6(0, true)
                .ident(0x70a)
                .frag6(0, false)
                .ident(0x70b)
                .tcp(1000, 80),
            XDP_DROP,
            Rule("v6-web", verdict::DENIED),
        ),
        (
            "IPv6 its outer datagram's second fragment: unmatched, dropped",
            eth()
                .ipv6(v6(1), dst6())
                .frag6(4, false)
                .ident(0x70a)
                .proto(6)
                .payload(16),
            XDP_DROP,
            Many(&[FRAGMENTS, UNMATCHED, UNMATCHED_DROP], None),
        ),
        (
            "IPv6 first fragment whose chain holds a later fragment header of another datagram",
            eth()
                .ipv6(v6(1), dst6())
                .frag6(0, true)
                .ident(0x70c)
                .frag6(8, false)
                .ident(0x70d)
                .proto(6)
                .payload(16),
            XDP_DROP,
            Many(&[FRAGMENTS, UNMATCHED, UNMATCHED_DROP], None),
        ),
        (
            "IPv6 extension header cut short (unfragmented): the stack discards it; passed",
            eth()
                .ipv6(v6(1), dst6())
                .ext(60, 2)
                .tcp(1000, 80)
                .truncate(14 + 40 + 12),
            XDP_PASS,
            Global(global::TRUNCATED_L4),
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
    ];
    cases.extend(chains);
    cases
}

fn leak(s: String) -> &'static str {
    Box::leak(s.into_boxed_str())
}

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

/// `tcp_flags = "syn"`: SYN (ACK clear) packets from one source meet the SYN rule, its SYN-ACKs,
/// ACKs and data the general TCP rule, in any order from one source (the per-CPU classification
/// cache keys on the flag bits the rules look at), a port rule outranks the SYN rule, and cut
/// packets never reach it by their flags.
#[test]
fn syn_rule_takes_syns_and_leaves_the_rest_to_the_general_rule() {
    use global::{DROPPED_TINY_FRAGMENTS as TINY, TRUNCATED_L4};
    require_root();
    let mut dp = TestDataplane::new("pktsyn", 1024).expect("load");
    let set = dp
        .install_toml(
            r#"
[[rule]]
name = "syn"
source = "198.18.0.0/16"
protocol = "tcp"
tcp_flags = "syn"
action = "deny"

[[rule]]
name = "tcp"
source = "198.18.0.0/16"
protocol = "tcp"
action = "allow"

[[rule]]
name = "ssh"
source = "198.18.0.0/16"
protocol = "tcp"
dst_port = 22
action = "allow"

[[rule]]
name = "syn6"
source = "2001:db8::/32"
protocol = "tcp"
tcp_flags = "syn"
action = "deny"

[[rule]]
name = "all6"
source = "2001:db8::/32"
action = "allow"
"#,
        )
        .expect("install");
    let id = |name: &str| set.by_name(name).expect("rule").id;
    const SYN: u8 = 0x02;
    const ACK: u8 = 0x10;
    const PSH: u8 = 0x08;
    const FIN: u8 = 0x01;
    let tcp4 = |port: u16, flags: u8| {
        eth()
            .ipv4(v4(33), dst4())
            .tcp(40000, port)
            .tcp_flags(flags)
            .build()
    };
    let tcp6 = |flags: u8| {
        eth()
            .ipv6(v6(33), dst6())
            .tcp(40000, 443)
            .tcp_flags(flags)
            .build()
    };
    // (what, frame, verdict, rule, rule verdict, global counter that must move too)
    type Case = (
        &'static str,
        Vec<u8>,
        u32,
        &'static str,
        usize,
        Option<usize>,
    );
    let cases: Vec<Case> = vec![
        (
            "SYN",
            tcp4(443, SYN),
            XDP_DROP,
            "syn",
            verdict::DENIED,
            None,
        ),
        (
            "SYN-ACK",
            tcp4(443, SYN | ACK),
            XDP_PASS,
            "tcp",
            verdict::ALLOWED,
            None,
        ),
        (
            "ACK",
            tcp4(443, ACK),
            XDP_PASS,
            "tcp",
            verdict::ALLOWED,
            None,
        ),
        (
            "SYN after ACK (cached source)",
            tcp4(443, SYN),
            XDP_DROP,
            "syn",
            verdict::DENIED,
            None,
        ),
        (
            "PSH-ACK",
            tcp4(443, PSH | ACK),
            XDP_PASS,
            "tcp",
            verdict::ALLOWED,
            None,
        ),
        (
            "FIN-ACK",
            tcp4(443, FIN | ACK),
            XDP_PASS,
            "tcp",
            verdict::ALLOWED,
            None,
        ),
        (
            "no flags",
            tcp4(443, 0),
            XDP_PASS,
            "tcp",
            verdict::ALLOWED,
            None,
        ),
        (
            "SYN+PSH (still a SYN)",
            tcp4(443, SYN | PSH),
            XDP_DROP,
            "syn",
            verdict::DENIED,
            None,
        ),
        (
            "SYN+FIN",
            tcp4(443, SYN | FIN),
            XDP_DROP,
            "syn",
            verdict::DENIED,
            None,
        ),
        // Whatever else is set, the kernel's listener opens a connection for a SYN without ACK
        // (`tcp_rcv_state_process`: ACK answered by a reset, RST and SYN+FIN discarded, then
        // `conn_request`): ECN setup (ECE, CWR), URG, PSH; each is the SYN rule's.
        (
            "SYN+ECE+CWR (ECN setup: a connection request)",
            tcp4(443, SYN | 0x40 | 0x80),
            XDP_DROP,
            "syn",
            verdict::DENIED,
            None,
        ),
        (
            "SYN+URG",
            tcp4(443, SYN | 0x20),
            XDP_DROP,
            "syn",
            verdict::DENIED,
            None,
        ),
        (
            "SYN+RST (the kernel discards it)",
            tcp4(443, SYN | 0x04),
            XDP_DROP,
            "syn",
            verdict::DENIED,
            None,
        ),
        (
            "SYN to the port rule's port",
            tcp4(22, SYN),
            XDP_PASS,
            "ssh",
            verdict::ALLOWED,
            None,
        ),
        (
            "ACK to the port rule's port",
            tcp4(22, ACK),
            XDP_PASS,
            "ssh",
            verdict::ALLOWED,
            None,
        ),
        (
            "SYN again",
            tcp4(443, SYN),
            XDP_DROP,
            "syn",
            verdict::DENIED,
            None,
        ),
        (
            "SYN whose TCP header is cut (no flags read)",
            eth()
                .ipv4(v4(33), dst4())
                .tcp(40000, 443)
                .tcp_flags(SYN)
                .truncate(14 + 20 + 19)
                .build(),
            XDP_PASS,
            "tcp",
            verdict::ALLOWED,
            Some(TRUNCATED_L4),
        ),
        (
            "first fragment with the whole TCP header, SYN",
            eth()
                .ipv4(v4(34), dst4())
                .frag(0, true)
                .ident(0x5151)
                .tcp(40000, 443)
                .tcp_flags(SYN)
                .payload(16)
                .build(),
            XDP_DROP,
            "syn",
            verdict::DENIED,
            None,
        ),
        (
            "its later fragment follows it",
            eth()
                .ipv4(v4(34), dst4())
                .frag(3, false)
                .ident(0x5151)
                .proto(6)
                .payload(16)
                .build(),
            XDP_DROP,
            "syn",
            verdict::DENIED,
            Some(global::FRAGMENTS),
        ),
        (
            "first fragment with the whole TCP header, ACK",
            eth()
                .ipv4(v4(34), dst4())
                .frag(0, true)
                .ident(0x5152)
                .tcp(40000, 443)
                .tcp_flags(ACK)
                .payload(16)
                .build(),
            XDP_PASS,
            "tcp",
            verdict::ALLOWED,
            None,
        ),
        (
            "IPv6 SYN",
            tcp6(SYN),
            XDP_DROP,
            "syn6",
            verdict::DENIED,
            None,
        ),
        (
            "IPv6 ACK",
            tcp6(ACK),
            XDP_PASS,
            "all6",
            verdict::ALLOWED,
            None,
        ),
        (
            "IPv6 SYN-ACK",
            tcp6(SYN | ACK),
            XDP_PASS,
            "all6",
            verdict::ALLOWED,
            None,
        ),
        (
            "IPv6 SYN again",
            tcp6(SYN),
            XDP_DROP,
            "syn6",
            verdict::DENIED,
            None,
        ),
    ];
    for (what, frame, want, rule, v, counter) in cases {
        let (g0, r0) = (dp.global(), dp.rule(id(rule)));
        assert_eq!(dp.run(&frame), want, "{what}");
        assert_eq!(
            dp.rule(id(rule)).pkts[v] - r0.pkts[v],
            1,
            "{what}: rule {rule}"
        );
        if let Some(c) = counter {
            assert_eq!(
                dp.global().counters[c] - g0.counters[c],
                1,
                "{what}: counter {c}"
            );
        }
    }
    // A first fragment too short for the flags: the tiny-fragment case (a rule looks at them).
    let g0 = dp.global();
    let tiny = eth()
        .ipv4(v4(35), dst4())
        .frag(0, true)
        .ident(0x5153)
        .tcp(40000, 443)
        .truncate(14 + 20 + 13)
        .build();
    assert_eq!(dp.run(&tiny), XDP_DROP);
    assert_eq!(dp.global().counters[TINY] - g0.counters[TINY], 1);
    // RFC 1858's SYN in two fragments as the wire delivers the first: 8 bytes of TCP (ports, no
    // flags) padded to 60 bytes with zeros. The zeros are not its flags (which would make it no
    // SYN, under the general TCP rule, and its second fragment, which holds the SYN flag, with
    // it): tiny, dropped.
    let g0 = dp.global();
    let padded = eth()
        .ipv4(v4(36), dst4())
        .tcp(40000, 443)
        .cut_l4(8)
        .frag(0, true)
        .ident(0x5154)
        .trailer(&[0; 18])
        .build();
    assert_eq!(padded.len(), 60);
    assert_eq!(dp.run(&padded), XDP_DROP);
    assert_eq!(dp.global().counters[TINY] - g0.counters[TINY], 1);
}
