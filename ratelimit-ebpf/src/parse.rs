//! Packet parsing: Ethernet, up to two VLAN tags (802.1Q, 802.1ad), IPv4 (with options), IPv6
//! (with extension headers) and TCP/UDP destination ports.
//!
//! Every read is bounds-checked against `data_end` right before it happens, in the shape the
//! verifier can follow. What cannot be parsed is reported as the global counter to bump; the
//! caller passes such packets (fail open).

use aya_ebpf::programs::XdpContext;
use ratelimit_common::{family, global};

use crate::stats::bump_global;

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const ETH_P_8021Q: u16 = 0x8100;
const ETH_P_8021AD: u16 = 0x88a8;
const VLAN_HLEN: usize = 4;

pub const IPPROTO_TCP: u8 = 6;
pub const IPPROTO_UDP: u8 = 17;
const IPPROTO_HOPOPTS: u8 = 0;
const IPPROTO_ROUTING: u8 = 43;
const IPPROTO_FRAGMENT: u8 = 44;
const IPPROTO_AH: u8 = 51;
const IPPROTO_DSTOPTS: u8 = 60;
/// Most IPv6 extension headers walked before giving up on finding the L4 header. Real traffic
/// carries zero to two; the bound keeps the verifier's path count small.
const MAX_IPV6_EXT: usize = 4;

/// What the classifier needs to know about a packet.
pub struct Packet {
    /// [`family`] tag.
    pub family: u8,
    /// L4 protocol (the last next-header reached for IPv6).
    pub protocol: u8,
    /// TCP/UDP destination port, host byte order; 0 for other protocols, non-first fragments and
    /// truncated L4 headers. (Not an `Option`: its uninitialised payload bytes on the `None` path
    /// get copied around and the verifier rejects reading them. No rule can name port 0.)
    pub dst_port: u16,
    /// Source address as four words read straight from the packet (network byte order in memory);
    /// IPv4 uses the first word, the rest are zero.
    pub src: [u32; 4],
}

/// Returns a pointer to a `T` at `off` bytes into the packet, if the whole `T` is inside it.
#[inline(always)]
fn ptr_at<T>(ctx: &XdpContext, off: usize) -> Option<*const T> {
    let start = ctx.data();
    let end = ctx.data_end();
    if start + off + core::mem::size_of::<T>() > end {
        return None;
    }
    Some((start + off) as *const T)
}

#[inline(always)]
fn read<T: Copy>(ctx: &XdpContext, off: usize) -> Option<T> {
    // SAFETY: ptr_at checked that the value lies inside the packet; packet data has no alignment
    // guarantee, hence the unaligned read.
    ptr_at::<T>(ctx, off).map(|p| unsafe { core::ptr::read_unaligned(p) })
}

#[inline(always)]
fn read_be16(ctx: &XdpContext, off: usize) -> Option<u16> {
    read::<u16>(ctx, off).map(u16::from_be)
}

/// Parses the frame; on failure returns the [`global`] counter that says why.
#[inline(always)]
pub fn parse(ctx: &XdpContext) -> Result<Packet, usize> {
    let mut ether_type = read_be16(ctx, 12).ok_or(global::TRUNCATED_ETH)?;
    let mut off = ETH_HLEN;
    // Outer tag (802.1ad or 802.1Q), then at most one inner 802.1Q tag.
    if ether_type == ETH_P_8021AD || ether_type == ETH_P_8021Q {
        ether_type = read_be16(ctx, off + 2).ok_or(global::BAD_VLAN)?;
        off += VLAN_HLEN;
        if ether_type == ETH_P_8021AD || ether_type == ETH_P_8021Q {
            ether_type = read_be16(ctx, off + 2).ok_or(global::BAD_VLAN)?;
            off += VLAN_HLEN;
            if ether_type == ETH_P_8021AD || ether_type == ETH_P_8021Q {
                return Err(global::BAD_VLAN);
            }
        }
    }
    match ether_type {
        ETH_P_IP => parse_ipv4(ctx, off),
        ETH_P_IPV6 => parse_ipv6(ctx, off),
        _ => Err(global::NON_IP),
    }
}

#[inline(always)]
fn parse_ipv4(ctx: &XdpContext, off: usize) -> Result<Packet, usize> {
    // One read of the whole fixed header. Multi-byte reads also keep LLVM from turning a
    // `p + 1 > end` bounds check into `p >= end`, which the verifier cannot use.
    let h: [u8; 20] = read(ctx, off).ok_or(global::TRUNCATED_IPV4)?;
    let ihl = usize::from(h[0] & 0x0f) * 4;
    if h[0] >> 4 != 4 || ihl < 20 {
        return Err(global::BAD_IPV4);
    }
    let frag = u16::from_be_bytes([h[6], h[7]]);
    let protocol = h[9];
    let src = u32::from_ne_bytes([h[12], h[13], h[14], h[15]]);
    // Options: the header claims `ihl` bytes, all of which must be in the frame.
    let l4 = off + ihl;
    if l4 > ctx.data_end() - ctx.data() {
        return Err(global::BAD_IPV4);
    }
    let mut pkt = Packet {
        family: family::V4,
        protocol,
        dst_port: 0,
        src: [src, 0, 0, 0],
    };
    if frag & 0x1fff != 0 {
        // Non-first fragment: no L4 header here; classify on addresses and protocol only.
        bump_global(global::FRAGMENTS);
        return Ok(pkt);
    }
    pkt.dst_port = l4_port(ctx, l4, protocol);
    Ok(pkt)
}

#[inline(always)]
fn parse_ipv6(ctx: &XdpContext, off: usize) -> Result<Packet, usize> {
    // The whole fixed header must be there, though only the first 24 bytes are used.
    let h: [u8; 40] = read(ctx, off).ok_or(global::BAD_IPV6)?;
    let word = |i: usize| u32::from_ne_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
    let src = [word(8), word(12), word(16), word(20)];
    if h[0] >> 4 != 6 {
        return Err(global::BAD_IPV6);
    }
    let mut next = h[6];
    let mut pkt = Packet {
        family: family::V6,
        protocol: next,
        dst_port: 0,
        src,
    };
    let mut hdr = off + 40;
    for _ in 0..MAX_IPV6_EXT {
        if !matches!(
            next,
            IPPROTO_HOPOPTS | IPPROTO_ROUTING | IPPROTO_DSTOPTS | IPPROTO_AH | IPPROTO_FRAGMENT
        ) {
            pkt.protocol = next;
            pkt.dst_port = l4_port(ctx, hdr, next);
            return Ok(pkt);
        }
        // Every extension header is at least 8 bytes: next header, length, and (fragment) offset.
        let Some(e) = read::<[u8; 8]>(ctx, hdr) else {
            return truncated_l4(pkt);
        };
        let len = match next {
            IPPROTO_AH => (usize::from(e[1]) + 2) * 4,
            IPPROTO_FRAGMENT => {
                if u16::from_be_bytes([e[2], e[3]]) >> 3 != 0 {
                    // Non-first fragment: the L4 header is in the first one.
                    pkt.protocol = e[0];
                    bump_global(global::FRAGMENTS);
                    return Ok(pkt);
                }
                8
            }
            _ => (usize::from(e[1]) + 1) * 8,
        };
        next = e[0];
        pkt.protocol = next;
        hdr += len;
    }
    // Longer chain than we walk: classify without a port. Counted with the truncated ones.
    truncated_l4(pkt)
}

#[inline(always)]
fn truncated_l4(pkt: Packet) -> Result<Packet, usize> {
    bump_global(global::TRUNCATED_L4);
    Ok(pkt)
}

#[inline(always)]
fn l4_port(ctx: &XdpContext, l4: usize, protocol: u8) -> u16 {
    if protocol != IPPROTO_TCP && protocol != IPPROTO_UDP {
        return 0;
    }
    // TCP and UDP both keep the destination port at bytes 2..4; require the 8 bytes UDP has
    // (TCP's 20) so a header cut short is counted rather than half-read.
    let min = if protocol == IPPROTO_TCP { 20 } else { 8 };
    if l4 + min > ctx.data_end() - ctx.data() {
        bump_global(global::TRUNCATED_L4);
        return 0;
    }
    read_be16(ctx, l4 + 2).unwrap_or(0)
}
