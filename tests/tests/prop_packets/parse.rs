//! The reference parser: what `ratelimit-ebpf/src/parse.rs` documents, written for a byte slice,
//! and its test on known shapes.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ratelimit_common::global;
use ratelimit_testbed::packet::eth;

use crate::{IPPROTO_TCP, IPPROTO_UDP};

/// How a frame is cut (parse.rs's `shape`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Shape {
    /// Unfragmented, L4 header read (or not TCP/UDP).
    Whole,
    /// Unfragmented, TCP/UDP header cut short (`truncated_l4`): classified without ports.
    Truncated,
    /// Unfragmented IPv6 chain cut by the frame's end (`truncated_l4`): protocol unknown.
    CutChain,
    /// First fragment with its whole L4 header.
    FirstFragment,
    /// First fragment without its whole TCP/UDP header.
    TinyFragment,
    /// A fragment other than the first (`fragments`).
    LaterFragment,
    /// IPv6 chain longer than walked, or a first fragment's chain not reaching L4.
    LongChain,
}

/// What the program needs to know about a frame it could parse.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Parsed {
    pub(crate) src: IpAddr,
    pub(crate) dst: IpAddr,
    /// IP protocol (IPv6: the header the chain ends with); 255 when not reached.
    pub(crate) protocol: u8,
    /// TCP/UDP destination port; 0 when none was read.
    pub(crate) dst_port: u16,
    /// The TCP flags byte; 0 when no whole TCP header was read.
    pub(crate) tcp_flags: u8,
    pub(crate) shape: Shape,
    /// A first fragment (whatever its shape).
    pub(crate) first_fragment: bool,
    /// For fragments: the datagram's protocol (IPv6: the fragment header's next header) and
    /// identification.
    pub(crate) frag_protocol: u8,
    pub(crate) frag_id: u32,
}

/// Most VLAN tags walked.
pub(crate) const MAX_VLAN_TAGS: usize = 8;

/// Most IPv6 extension headers walked, and bytes of them.
pub(crate) const MAX_IPV6_EXT: usize = 8;
pub(crate) const MAX_IPV6_EXT_BYTES: usize = 1024;

pub(crate) fn be16(b: &[u8], off: usize) -> Option<u16> {
    b.get(off..off + 2)
        .map(|s| u16::from_be_bytes([s[0], s[1]]))
}

/// Parses a frame, or returns the [`global`] counter naming why it cannot.
pub(crate) fn model_parse(b: &[u8]) -> Result<Parsed, usize> {
    let mut ether_type = be16(b, 12).ok_or(global::TRUNCATED_ETH)?;
    let mut off = 14;
    // Eight tags are walked; a frame with more hides its source (`dropped_vlan_chains`, or
    // `bad_vlan` where no rule can drop: see `Model::frame`).
    let is_tag = |t: u16| t == 0x8100 || t == 0x88a8;
    for _ in 0..MAX_VLAN_TAGS {
        if !is_tag(ether_type) {
            break;
        }
        ether_type = be16(b, off + 2).ok_or(global::BAD_VLAN)?;
        off += 4;
    }
    if is_tag(ether_type) {
        return Err(global::DROPPED_VLAN_CHAINS);
    }
    match ether_type {
        0x0800 => model_ipv4(b, off),
        0x86dd => model_ipv6(b, off),
        _ => Err(global::NON_IP),
    }
}

pub(crate) fn model_ipv4(b: &[u8], off: usize) -> Result<Parsed, usize> {
    let h = b.get(off..off + 20).ok_or(global::TRUNCATED_IPV4)?;
    let ihl = usize::from(h[0] & 0x0f) * 4;
    // The total length bounds what is read past the header (0: a GRO packet's, the frame does).
    let total = usize::from(u16::from_be_bytes([h[2], h[3]]));
    if h[0] >> 4 != 4 || ihl < 20 || (total != 0 && total < ihl) || off + ihl > b.len() {
        return Err(global::BAD_IPV4);
    }
    let end = if total == 0 { usize::MAX } else { off + total };
    let protocol = h[9];
    let mut p = Parsed {
        src: IpAddr::V4(Ipv4Addr::new(h[12], h[13], h[14], h[15])),
        dst: IpAddr::V4(Ipv4Addr::new(h[16], h[17], h[18], h[19])),
        protocol,
        dst_port: 0,
        tcp_flags: 0,
        shape: Shape::Whole,
        first_fragment: false,
        frag_protocol: protocol,
        frag_id: u32::from(u16::from_be_bytes([h[4], h[5]])),
    };
    let frag = u16::from_be_bytes([h[6], h[7]]);
    if frag & 0x1fff != 0 {
        p.shape = Shape::LaterFragment;
        return Ok(p);
    }
    p.first_fragment = frag & 0x2000 != 0;
    Ok(model_at_l4(b, p, off + ihl, end))
}

/// `p` with its L4 header at `l4` read (in the datagram that ends at `end`): its port and its
/// shape.
pub(crate) fn model_at_l4(b: &[u8], mut p: Parsed, l4: usize, end: usize) -> Parsed {
    p.shape = match (model_l4_port(b, l4, end, p.protocol), p.first_fragment) {
        (Some((port, flags)), first) => {
            p.dst_port = port;
            p.tcp_flags = flags;
            if first {
                Shape::FirstFragment
            } else {
                Shape::Whole
            }
        }
        (None, true) => Shape::TinyFragment,
        (None, false) => Shape::Truncated,
    };
    p
}

pub(crate) fn model_ipv6(b: &[u8], off: usize) -> Result<Parsed, usize> {
    let h = b.get(off..off + 40).ok_or(global::BAD_IPV6)?;
    if h[0] >> 4 != 6 {
        return Err(global::BAD_IPV6);
    }
    let src: [u8; 16] = h[8..24].try_into().expect("16 bytes");
    let dst: [u8; 16] = h[24..40].try_into().expect("16 bytes");
    let mut next = h[6];
    let payload = usize::from(u16::from_be_bytes([h[4], h[5]]));
    let mut p = Parsed {
        src: IpAddr::V6(Ipv6Addr::from(src)),
        dst: IpAddr::V6(Ipv6Addr::from(dst)),
        protocol: next,
        dst_port: 0,
        tcp_flags: 0,
        shape: Shape::Whole,
        first_fragment: false,
        frag_protocol: 0,
        frag_id: 0,
    };
    let is_ext = |n: u8| matches!(n, 0 | 43 | 44 | 51 | 60);
    let start = off + 40;
    // The payload length bounds the walk (0: a jumbogram's or a GRO packet's, the frame does).
    let end = if payload == 0 {
        usize::MAX
    } else {
        start + payload
    };
    let mut hdr = start;
    let cut = |mut p: Parsed| {
        p.protocol = 255;
        p.shape = if p.first_fragment {
            Shape::LongChain
        } else {
            Shape::CutChain
        };
        Ok(p)
    };
    // Hop-by-hop, routing, fragment, AH and destination options are walked, eight at most.
    for _ in 0..MAX_IPV6_EXT {
        if !is_ext(next) || hdr > start + MAX_IPV6_EXT_BYTES {
            break;
        }
        if hdr + 8 > end {
            return cut(p);
        }
        let Some(e) = b.get(hdr..hdr + 8) else {
            return cut(p);
        };
        let len = match next {
            51 => (usize::from(e[1]) + 2) * 4,
            44 => {
                let frag = u16::from_be_bytes([e[2], e[3]]);
                p.frag_protocol = e[0];
                p.frag_id = u32::from_be_bytes([e[4], e[5], e[6], e[7]]);
                if frag >> 3 != 0 {
                    p.protocol = e[0];
                    p.shape = Shape::LaterFragment;
                    return Ok(p);
                }
                p.first_fragment = frag & 1 != 0;
                8
            }
            _ => (usize::from(e[1]) + 1) * 8,
        };
        next = e[0];
        hdr += len;
        if hdr > b.len() || hdr > end {
            return cut(p);
        }
    }
    if is_ext(next) {
        p.protocol = 255;
        p.shape = Shape::LongChain;
        return Ok(p);
    }
    p.protocol = next;
    Ok(model_at_l4(b, p, hdr, end))
}

/// The destination port at `l4` for TCP/UDP whose whole header (20/8 bytes) is in the frame and
/// in the datagram that ends at `end` (0 for other protocols) and the TCP flags byte (0 for other
/// protocols), or `None` when the header is cut short.
pub(crate) fn model_l4_port(b: &[u8], l4: usize, end: usize, protocol: u8) -> Option<(u16, u8)> {
    let min = match protocol {
        IPPROTO_TCP => 20,
        IPPROTO_UDP => 8,
        _ => return Some((0, 0)),
    };
    if l4 + min > b.len() || l4 + min > end {
        return None;
    }
    let flags = if protocol == IPPROTO_TCP {
        b[l4 + 13]
    } else {
        0
    };
    Some((be16(b, l4 + 2).expect("inside the frame"), flags))
}

/// The reference parser itself, on the shapes of tests/packets.rs, so a model bug does not hide
/// a program bug (both would agree on a wrong answer).
#[test]
fn the_model_parses_known_shapes() {
    let v4 = |last| Ipv4Addr::new(198, 18, 0, last);
    let v6 = |last| Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, last);
    let dst4 = v4(254);
    let dst6 = v6(0xfe);
    let ok = |b: Vec<u8>| model_parse(&b).expect("parses");
    let p = ok(eth()
        .qinq(1)
        .vlan(2)
        .ipv4(v4(1), dst4)
        .ipv4_options(8)
        .udp(1, 53)
        .build());
    assert_eq!(
        (p.src, p.protocol, p.dst_port, p.shape),
        (IpAddr::V4(v4(1)), 17, 53, Shape::Whole)
    );
    let p = ok(eth()
        .ipv4(v4(1), dst4)
        .proto(17)
        .payload(32)
        .frag(185, false)
        .build());
    assert!(p.shape == Shape::LaterFragment && p.dst_port == 0);
    let p = ok(eth()
        .ipv4(v4(1), dst4)
        .tcp(1, 80)
        .truncate(14 + 20 + 12)
        .build());
    assert!(p.shape == Shape::Truncated && p.dst_port == 0 && p.protocol == 6);
    let p = ok(eth()
        .ipv4(v4(1), dst4)
        .tcp(1, 80)
        .frag(0, true)
        .truncate(14 + 20 + 8)
        .build());
    assert!(p.shape == Shape::TinyFragment && p.first_fragment);
    let p = ok(eth()
        .ipv6(v6(1), dst6)
        .ext(60, 1)
        .ext(43, 0)
        .tcp(1, 80)
        .build());
    assert_eq!((p.protocol, p.dst_port), (6, 80));
    let p = ok(eth()
        .ipv6(v6(1), dst6)
        .frag6(100, false)
        .proto(6)
        .payload(40)
        .build());
    assert!(p.shape == Shape::LaterFragment && p.protocol == 6 && p.dst_port == 0);
    let p = ok(eth()
        .ipv6(v6(1), dst6)
        .ext(0, 0)
        .ext(60, 0)
        .ext(43, 0)
        .ext(60, 0)
        .ext(60, 0)
        .tcp(1, 80)
        .build());
    assert_eq!((p.shape, p.protocol, p.dst_port), (Shape::Whole, 6, 80));
    let mut nine = eth().ipv6(v6(1), dst6);
    for _ in 0..9 {
        nine = nine.ext(60, 0);
    }
    let p = ok(nine.tcp(1, 80).build());
    assert_eq!((p.shape, p.protocol), (Shape::LongChain, 255));
    let err = |b: Vec<u8>| model_parse(&b).expect_err("unparseable");
    assert_eq!(err(eth().ethertype(0x0806, 28).build()), global::NON_IP);
    assert_eq!(
        ok(eth()
            .qinq(1)
            .vlan(2)
            .vlan(3)
            .ipv4(v4(1), dst4)
            .udp(1, 53)
            .build())
        .dst_port,
        53
    );
    let mut nine = eth().qinq(0);
    for _ in 1..9 {
        nine = nine.vlan(0);
    }
    assert_eq!(
        err(nine.ipv4(v4(1), dst4).build()),
        global::DROPPED_VLAN_CHAINS
    );
    // Padding past the IPv4 total length is not read as TCP flags; a chain past the IPv6
    // payload length is cut.
    let p = ok(eth()
        .ipv4(v4(1), dst4)
        .tcp(1, 80)
        .cut_l4(8)
        .frag(0, true)
        .trailer(&[0; 18])
        .build());
    assert!(p.shape == Shape::TinyFragment && p.first_fragment);
    let p = ok(eth()
        .ipv6(v6(1), dst6)
        .ext(60, 0)
        .proto(60)
        .trailer(&[6, 0, 0, 0, 0, 0, 0, 0])
        .build());
    assert!(p.shape == Shape::CutChain);
    assert_eq!(
        err(eth().vlan(10).ipv4(v4(1), dst4).truncate(16).build()),
        global::BAD_VLAN
    );
    assert_eq!(
        err(eth().ipv4(v4(1), dst4).udp(1, 53).truncate(14 + 19).build()),
        global::TRUNCATED_IPV4
    );
    assert_eq!(
        err(eth().ipv4(v4(1), dst4).udp(1, 53).ihl(4).build()),
        global::BAD_IPV4
    );
    assert_eq!(
        err(eth().ipv4(v4(1), dst4).ihl(15).build()),
        global::BAD_IPV4
    );
    assert_eq!(
        err(eth().ipv6(v6(1), dst6).tcp(1, 80).version(4).build()),
        global::BAD_IPV6
    );
    assert_eq!(
        err(eth().ipv6(v6(1), dst6).tcp(1, 80).truncate(14 + 39).build()),
        global::BAD_IPV6
    );
    // AH: (len + 2) * 4 bytes, then TCP.
    let mut b = eth().ipv6(v6(1), dst6).ext(60, 0).tcp(1, 443).build();
    b[14 + 6] = 51;
    b[14 + 40 + 1] = 0; // AH of 8 bytes
    b[14 + 40] = 6;
    let p = ok(b);
    assert_eq!((p.protocol, p.dst_port), (6, 443));
}
