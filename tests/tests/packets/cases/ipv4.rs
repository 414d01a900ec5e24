//! The IPv4 cases.

use std::net::Ipv4Addr;

use ratelimit_common::{global, verdict};
use ratelimit_testbed::{
    packet::eth,
    xdp::{XDP_DROP, XDP_PASS},
};

use super::Case;
use crate::Moves::{Both, Global, Many, Rule};
use crate::{dst4, dst6, v4, v4o, v6};
use global::{
    DROPPED_FRAGMENT_CONFLICTS as CONFLICT, DROPPED_TINY_FRAGMENTS as TINY,
    DROPPED_UNMATCHED_FRAGMENTS as UNMATCHED_DROP, FRAGMENTS, FRAGMENTS_UNMATCHED as UNMATCHED,
};

/// IPv4 headers: cut, a bad header length or version, options; and a first fragment.
pub(super) fn ipv4() -> Vec<Case> {
    vec![
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
            eth()
                .ipv4(v4(1), dst4())
                .udp(1000, 53)
                .frag(0, true)
                .ident(100),
            XDP_DROP,
            Rule("v4-dns", verdict::DENIED),
        ),
    ]
}

/// IPv4 fragments: a later one whose first was not seen, tiny first fragments, both orders,
/// overlapping and re-sent first fragments.
pub(super) fn ipv4_fragments() -> Vec<Case> {
    vec![
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
    ]
}

/// IPv4 lengths: padding, a trailer, a total length short of the headers; and a source no rule
/// covers.
pub(super) fn ipv4_lengths() -> Vec<Case> {
    vec![
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
    ]
}
