//! Packet parsing: Ethernet, up to 8 VLAN tags (802.1Q, 802.1ad), IPv4 (with options), IPv6
//! (with extension headers), TCP/UDP destination ports and the TCP flags.
//!
//! Every read is bounds-checked against `data_end` right before it happens, in the shape the
//! verifier can follow. What cannot be parsed is reported as the global counter to bump; the
//! caller passes such packets (fail open), but for frames in more VLAN tags than the walk (see
//! [`MAX_VLAN_TAGS`]).
//!
//! The IP header's own length bounds what is read past it, not only the frame: the receiving
//! stack trims a frame to the IPv4 total length (the IPv6 payload length) before it looks further,
//! and a frame's padding or trailer (a short frame is padded to 60 bytes on the wire) must not be
//! read as the TCP flags of a first fragment that holds only 8 bytes of them, or as an IPv6
//! extension header the datagram does not have.

use aya_ebpf::programs::XdpContext;
use ratelimit_common::{family, global};

use crate::stats::bump_global;

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;
const VLAN_HLEN: usize = 4;
/// Most VLAN tags walked to reach the IP header. The receiving stack strips any number of
/// priority tags (VLAN id 0) and delivers what is inside, so a frame with more tags than this is
/// dropped where a rule could apply (its source is unknown, so any rule that can drop could:
/// [`global::DROPPED_VLAN_CHAINS`]). Real frames carry one or two.
pub const MAX_VLAN_TAGS: usize = 8;

pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;
const IPPROTO_HOPOPTS: u8 = 0;
const IPPROTO_ROUTING: u8 = 43;
const IPPROTO_FRAGMENT: u8 = 44;
const IPPROTO_AH: u8 = 51;
const IPPROTO_DSTOPTS: u8 = 60;
/// "Protocol unknown": the IPv6 chain was not walked to its end. IANA's reserved number, so no
/// rule names it.
pub const PROTOCOL_UNKNOWN: u8 = 255;
/// Most IPv6 extension headers walked to reach the L4 header. Real stacks send zero to three;
/// RFC 7112 and RFC 8200 put no number on it, so a longer chain is handled by policy (see
/// [`shape::LONG_CHAIN`]).
const MAX_IPV6_EXT: usize = 8;
/// Most bytes of IPv6 extension headers walked (a chain must also end within them).
const MAX_IPV6_EXT_BYTES: usize = 1024;

/// The bench-only build without the handling of cut packets (see the crate's Cargo.toml): the
/// destination address and fragment id, which only that handling reads, are not read.
const WITHOUT_CUT: bool = cfg!(feature = "bench-without-cut");

/// How a packet is cut, which decides how it can be classified.
pub mod shape {
    /// Unfragmented (or an IPv6 atomic fragment), L4 header read (or not TCP/UDP).
    pub const WHOLE: u8 = 0;
    /// Unfragmented, but the TCP/UDP header is cut short: classified without ports. The
    /// receiving stack discards such a packet, so passing it walks past nothing.
    pub const TRUNCATED: u8 = 1;
    /// Unfragmented IPv6 whose extension header chain is cut short by the frame's end: protocol
    /// unknown; the receiving stack discards it too.
    pub const CUT_CHAIN: u8 = 2;
    /// The first fragment of a datagram, with its whole L4 header.
    pub const FIRST_FRAGMENT: u8 = 3;
    /// A first fragment without its whole TCP/UDP header (RFC 1858's tiny fragment).
    pub const TINY_FRAGMENT: u8 = 4;
    /// A fragment other than the first: no L4 header.
    pub const LATER_FRAGMENT: u8 = 5;
    /// An IPv6 chain longer than the walk, or a first fragment whose chain ends before the L4
    /// header (RFC 7112): protocol unknown.
    pub const LONG_CHAIN: u8 = 6;
}

/// What the classifier needs to know about a packet.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Packet {
    /// [`family`] tag.
    pub family: u8,
    /// L4 protocol ([`PROTOCOL_UNKNOWN`] when the IPv6 chain was not walked to its end).
    pub protocol: u8,
    /// TCP/UDP destination port, host byte order; 0 for other protocols, non-first fragments and
    /// truncated L4 headers. (Not an `Option`: its uninitialised payload bytes on the `None` path
    /// get copied around and the verifier rejects reading them. No rule can name port 0.)
    pub dst_port: u16,
    /// [`shape`].
    pub shape: u8,
    /// For a fragment: the IPv4 protocol or the IPv6 fragment header's next header.
    pub frag_protocol: u8,
    /// 1 if this is the first fragment of a datagram (whatever its [`shape`]).
    pub first_fragment: u8,
    /// The TCP header's flags byte (byte 13: FIN 0x01, SYN 0x02, ... ACK 0x10) where the whole
    /// TCP header was read; 0 for other protocols, non-first fragments and cut headers, so no
    /// rule that asks for a flag set (such as `tcp_flags = "syn"`) matches them.
    pub tcp_flags: u8,
    /// For a fragment: the IPv4 identification or the IPv6 fragment identification.
    pub frag_id: u32,
    /// Source address as four words read straight from the packet (network byte order in memory);
    /// IPv4 uses the first word, the rest are zero.
    pub src: [u32; 4],
    /// Destination address, likewise (it identifies a fragmented datagram).
    pub dst: [u32; 4],
}

/// The start of the `N` bytes at `off` into the packet, if they are all in the frame: the one
/// bounds check the verifier follows for the [`load`]s at offsets below `N` from it.
#[inline(always)]
fn bytes_at<const N: usize>(ctx: &XdpContext, off: usize) -> Option<usize> {
    let start = ctx.data();
    if start + off + N > ctx.data_end() {
        return None;
    }
    Some(start + off)
}

/// Reads of 1, 2 and 4 packet bytes at `p + OFF` ([`bytes_at`] checked that they are in the
/// frame), in native byte order, each one BPF load however the packet is aligned.
///
/// A packet has no alignment guarantee, and LLVM's BPF backend lowers `read_unaligned` to one
/// load per byte (a fifth of the program's time under a flood, `kernel.layered.*`'s profile). The
/// verifier accepts unaligned packet loads on x86-64 and arm64, where the CPU does them in one
/// instruction. See CONSTRAINTS.md, "Arithmetic the target lacks" (and "What the verifier
/// refuses" for LLVM's `allows-misaligned-mem-access`).
mod load {
    use core::arch::asm;

    macro_rules! loads {
        ($($name:ident),*) => {$(
            #[inline(always)]
            pub unsafe fn $name<const OFF: i16>(p: usize) -> $name {
                let v: u64;
                // SAFETY: the caller's (see the module doc): `p + OFF` is in the frame.
                unsafe {
                    asm!(
                        concat!("{v} = *(", stringify!($name), " *)({p} + {off})"),
                        v = out(reg) v,
                        p = in(reg) p,
                        off = const OFF,
                        options(readonly, nostack, preserves_flags),
                    );
                }
                v as $name
            }
        )*};
    }

    loads!(u8, u16, u32);
}

/// The big-endian 16 bits at `off` into the packet, if they are in the frame.
#[inline(always)]
fn read_be16(ctx: &XdpContext, off: usize) -> Option<u16> {
    let p = bytes_at::<2>(ctx, off)?;
    // SAFETY: the two bytes are in the frame (`bytes_at`).
    Some(u16::from_be(unsafe { load::u16::<0>(p) }))
}

/// Parses the frame; on failure returns the [`global`] counter that says why.
#[inline(always)]
pub fn parse(ctx: &XdpContext) -> Result<Packet, usize> {
    let mut ether_type = read_be16(ctx, 12).ok_or(global::TRUNCATED_ETH)?;
    let mut off = ETH_HLEN;
    // VLAN tags (802.1ad or 802.1Q, in any order and number: the stack strips priority tags
    // whatever their count), up to the walk's bound.
    for _ in 0..MAX_VLAN_TAGS {
        if ether_type != ETH_P_8021AD && ether_type != ETH_P_8021Q {
            break;
        }
        ether_type = read_be16(ctx, off + 2).ok_or(global::BAD_VLAN)?;
        off += VLAN_HLEN;
    }
    if ether_type == ETH_P_8021AD || ether_type == ETH_P_8021Q {
        return Err(global::DROPPED_VLAN_CHAINS);
    }
    match ether_type {
        ETH_P_IP => parse_ipv4(ctx, off),
        ETH_P_IPV6 => parse_ipv6(ctx, off),
        _ => Err(global::NON_IP),
    }
}

#[inline(always)]
fn parse_ipv4(ctx: &XdpContext, off: usize) -> Result<Packet, usize> {
    // One bounds check for the whole fixed header. Multi-byte checks also keep LLVM from turning
    // a `p + 1 > end` bounds check into `p >= end`, which the verifier cannot use.
    let h = bytes_at::<20>(ctx, off).ok_or(global::TRUNCATED_IPV4)?;
    // SAFETY: the 20 bytes from `h` are in the frame (`bytes_at`).
    let (b0, total, frag, protocol) = unsafe {
        (
            load::u8::<0>(h),
            usize::from(u16::from_be(load::u16::<2>(h))),
            u16::from_be(load::u16::<6>(h)),
            load::u8::<9>(h),
        )
    };
    let ihl = usize::from(b0 & 0x0f) * 4;
    // A total length shorter than the header: the stack discards the packet. (0 is a GRO
    // packet's over 64 KiB, which generic XDP can see: its frame bounds it.)
    if b0 >> 4 != 4 || ihl < 20 || (total != 0 && total < ihl) {
        return Err(global::BAD_IPV4);
    }
    let end = if total == 0 { usize::MAX } else { off + total };
    // Options: the header claims `ihl` bytes, all of which must be in the frame.
    let l4 = off + ihl;
    if l4 > ctx.data_end() - ctx.data() {
        return Err(global::BAD_IPV4);
    }
    let mut pkt = Packet {
        family: family::V4,
        protocol,
        dst_port: 0,
        shape: shape::WHOLE,
        frag_protocol: protocol,
        first_fragment: 0,
        tcp_flags: 0,
        // SAFETY (the loads below): as above.
        frag_id: if WITHOUT_CUT {
            0
        } else {
            u32::from(unsafe { load::u16::<4>(h) })
        },
        src: [unsafe { load::u32::<12>(h) }, 0, 0, 0],
        dst: if WITHOUT_CUT {
            [0; 4]
        } else {
            [unsafe { load::u32::<16>(h) }, 0, 0, 0]
        },
    };
    if frag & 0x1fff != 0 {
        // Non-first fragment: no L4 header here; it follows its first fragment (`frag`).
        bump_global(global::FRAGMENTS);
        pkt.shape = shape::LATER_FRAGMENT;
        return Ok(pkt);
    }
    let first = frag & 0x2000 != 0;
    pkt.first_fragment = u8::from(first);
    at_l4(ctx, pkt, l4, end, first)
}

// Stays whole: its bounds checks and header walk, in the shape the verifier accepts.
#[inline(always)]
fn parse_ipv6(ctx: &XdpContext, off: usize) -> Result<Packet, usize> {
    let h = bytes_at::<40>(ctx, off).ok_or(global::BAD_IPV6)?;
    // SAFETY: the 40 bytes from `h` are in the frame (`bytes_at`).
    let (b0, payload, mut next) = unsafe {
        (
            load::u8::<0>(h),
            usize::from(u16::from_be(load::u16::<4>(h))),
            load::u8::<6>(h),
        )
    };
    if b0 >> 4 != 6 {
        return Err(global::BAD_IPV6);
    }
    // SAFETY: as above.
    let (src, dst) = unsafe {
        (
            [
                load::u32::<8>(h),
                load::u32::<12>(h),
                load::u32::<16>(h),
                load::u32::<20>(h),
            ],
            if WITHOUT_CUT {
                [0; 4]
            } else {
                [
                    load::u32::<24>(h),
                    load::u32::<28>(h),
                    load::u32::<32>(h),
                    load::u32::<36>(h),
                ]
            },
        )
    };
    let mut pkt = Packet {
        family: family::V6,
        protocol: next,
        dst_port: 0,
        shape: shape::WHOLE,
        frag_protocol: 0,
        first_fragment: 0,
        tcp_flags: 0,
        frag_id: 0,
        src,
        dst,
    };
    let start = off + 40;
    // Where the datagram ends: the payload length, but for 0, a jumbogram's or a GRO packet's
    // over 64 KiB (the frame's end bounds it; without a jumbo option the stack keeps none of the
    // payload and discards the packet, so reading it classifies nothing that is delivered).
    let end = if payload == 0 {
        usize::MAX
    } else {
        start + payload
    };
    let mut hdr = start;
    // A fragment header with offset 0 and more fragments to come: this is a first fragment.
    let mut first = false;
    for _ in 0..MAX_IPV6_EXT {
        if !is_extension(next) {
            break;
        }
        if hdr > start + MAX_IPV6_EXT_BYTES {
            break;
        }
        // Every extension header is at least 8 bytes: next header, length, and (fragment) offset.
        if hdr + 8 > end {
            return chain_cut(pkt, first);
        }
        let Some(e) = bytes_at::<8>(ctx, hdr) else {
            return chain_cut(pkt, first);
        };
        // SAFETY: the 8 bytes from `e` are in the frame (`bytes_at`).
        let (e_next, e_len) = unsafe { (load::u8::<0>(e), load::u8::<1>(e)) };
        let len = match next {
            IPPROTO_AH => (usize::from(e_len) + 2) * 4,
            IPPROTO_FRAGMENT => {
                // SAFETY: as above.
                let frag = u16::from_be(unsafe { load::u16::<2>(e) });
                pkt.frag_protocol = e_next;
                // SAFETY: as above.
                pkt.frag_id = unsafe { load::u32::<4>(e) };
                if frag >> 3 != 0 {
                    // Non-first fragment: the L4 header is in the first one.
                    pkt.protocol = e_next;
                    pkt.shape = shape::LATER_FRAGMENT;
                    bump_global(global::FRAGMENTS);
                    return Ok(pkt);
                }
                // Offset 0: a first fragment if more follow, else an atomic fragment (RFC 6946),
                // a whole packet.
                first = frag & 1 != 0;
                pkt.first_fragment = u8::from(first);
                8
            }
            _ => (usize::from(e_len) + 1) * 8,
        };
        next = e_next;
        hdr += len;
        if hdr > ctx.data_end() - ctx.data() || hdr > end {
            // The header runs past the frame's (or the datagram's) end: the chain is cut before
            // the L4 header.
            return chain_cut(pkt, first);
        }
    }
    if is_extension(next) {
        // Longer than the walk: the L4 header was not reached.
        pkt.protocol = PROTOCOL_UNKNOWN;
        pkt.shape = shape::LONG_CHAIN;
        return Ok(pkt);
    }
    // The L4 header (ESP and No Next Header end the chain with no ports to read).
    pkt.protocol = next;
    at_l4(ctx, pkt, hdr, end, first)
}

/// `pkt` with its L4 header at `l4` read (within the datagram, which ends at `end`): its port,
/// and its shape (a first fragment's, if `first`).
#[inline(always)]
fn at_l4(
    ctx: &XdpContext,
    mut pkt: Packet,
    l4: usize,
    end: usize,
    first: bool,
) -> Result<Packet, usize> {
    match l4_port(ctx, l4, end, pkt.protocol) {
        Some(word) => {
            pkt.dst_port = word as u16;
            pkt.tcp_flags = (word >> 16) as u8;
            if first {
                pkt.shape = shape::FIRST_FRAGMENT;
            }
        }
        None if first => pkt.shape = shape::TINY_FRAGMENT,
        None => {
            bump_global(global::TRUNCATED_L4);
            pkt.shape = shape::TRUNCATED;
        }
    }
    Ok(pkt)
}

/// `pkt` whose IPv6 chain the frame cuts before the L4 header: a first fragment's chain is too
/// long (RFC 7112), any other packet is cut short.
#[inline(always)]
fn chain_cut(mut pkt: Packet, first: bool) -> Result<Packet, usize> {
    pkt.protocol = PROTOCOL_UNKNOWN;
    if first {
        pkt.shape = shape::LONG_CHAIN;
    } else {
        bump_global(global::TRUNCATED_L4);
        pkt.shape = shape::CUT_CHAIN;
    }
    Ok(pkt)
}

/// Whether IPv6 next header `next` is an extension header the walk steps over.
#[inline(always)]
fn is_extension(next: u8) -> bool {
    matches!(
        next,
        IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS | IPPROTO_AH | IPPROTO_FRAGMENT
    )
}

/// The destination port of a TCP/UDP header at `l4` (0 for other protocols) in the low 16 bits
/// and, for TCP, the flags byte in the next 8; or `None` when the header is not all there (in
/// the frame, and in the datagram that ends at `end`): TCP and UDP both keep the destination port
/// at bytes 2..4, but a header cut short is not half-read (8 bytes for UDP, 20 for TCP, its flags
/// included). One integer rather than a tuple: fewer verifier states.
///
/// Each header is read whole, in one read whose own bounds check is the one the verifier
/// follows: with a separate `l4 + 20 > len` test first, LLVM dropped the read's check as
/// redundant and the verifier, which cannot relate the two, refused the read. (`end` comes from
/// the packet's length field, not the frame's, so the datagram's check cannot replace it.)
#[inline(always)]
fn l4_port(ctx: &XdpContext, l4: usize, end: usize, protocol: u8) -> Option<u32> {
    if protocol == IPPROTO_TCP {
        if l4 + 20 > end {
            return None;
        }
        let h = bytes_at::<20>(ctx, l4)?;
        // SAFETY: the 20 bytes from `h` are in the frame (`bytes_at`).
        let (port, flags) = unsafe { (load::u16::<2>(h), load::u8::<13>(h)) };
        return Some(u32::from(u16::from_be(port)) | u32::from(flags) << 16);
    }
    if protocol == IPPROTO_UDP {
        if l4 + 8 > end {
            return None;
        }
        let h = bytes_at::<8>(ctx, l4)?;
        // SAFETY: the 8 bytes from `h` are in the frame (`bytes_at`).
        return Some(u32::from(u16::from_be(unsafe { load::u16::<2>(h) })));
    }
    Some(0)
}
