//! The IPv6 cases.

use std::net::Ipv6Addr;

use ratelimit_common::{global, verdict};
use ratelimit_testbed::{
    packet::eth,
    xdp::{XDP_DROP, XDP_PASS},
};

use super::Case;
use crate::Moves::{Both, Global, Many, Rule};
use crate::{dst6, dstopts_then_tcp, v6, v6o};
use global::{
    DROPPED_FRAGMENT_CONFLICTS as CONFLICT, DROPPED_LONG_CHAINS as LONG,
    DROPPED_TINY_FRAGMENTS as TINY, DROPPED_UNMATCHED_FRAGMENTS as UNMATCHED_DROP, FRAGMENTS,
    FRAGMENTS_UNMATCHED as UNMATCHED,
};

/// IPv6: the first verdicts, inside VLAN tags, behind extension headers, and a first fragment.
pub(super) fn ipv6() -> Vec<Case> {
    vec![
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
            eth()
                .ipv6(v6(1), dst6())
                .frag6(0, true)
                .ident(1)
                .tcp(1000, 80),
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
    ]
}

/// IPv6 fragments and chains: datagrams by identification, chains cut by a trailer or before
/// the L4 header, a first unseen, overlapping, tiny; AH, ESP, no next header, atomic fragments.
pub(super) fn ipv6_fragments() -> Vec<Case> {
    vec![
        // The kernel reassembles an IPv6 datagram by source, destination and identification: a
        // later fragment's own next header does not take it out of its datagram.
        (
            "IPv6 first fragment to TCP/80 (denied), identification 0x901",
            eth()
                .ipv6(v6(1), dst6())
                .frag6(0, true)
                .ident(0x901)
                .tcp(1000, 80),
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
            eth()
                .ipv6(v6(1), dst6())
                .frag6(0, true)
                .ident(2)
                .tcp(1000, 80),
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
            eth()
                .ipv6(v6(1), dst6())
                .frag6(0, true)
                .ident(3)
                .tcp(1000, 81),
            XDP_PASS,
            Rule("v6-all", verdict::ALLOWED),
        ),
        (
            "IPv6 first fragment sent again to TCP/80 (overlap): the datagram is dropped",
            eth()
                .ipv6(v6(1), dst6())
                .frag6(0, true)
                .ident(3)
                .tcp(1000, 80),
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
            eth()
                .ipv6(v6(1), dst6())
                .frag6(0, false)
                .ident(7)
                .tcp(1000, 80),
            XDP_DROP,
            Rule("v6-web", verdict::DENIED),
        ),
    ]
}

/// IPv6 fragment headers inside a chain, headers cut short, and a source no rule covers.
pub(super) fn ipv6_inner_fragments_and_cuts() -> Vec<Case> {
    vec![
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
    ]
}
