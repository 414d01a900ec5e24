//! Fragmented datagrams: how long a first fragment's classification is followed, and the
//! records that remember it.

use core::mem::size_of;

#[cfg(doc)]
use crate::{family, map_names, Config};

/// How long the first fragment's classification is followed by the datagram's other fragments:
/// as long as the kernel keeps a datagram's fragments for reassembly by default (IPv4's
/// `net.ipv4.ipfrag_time` is 30 s, IPv6's `net.ipv6.ip6frag_time` 60 s), so a fragment sent late
/// on purpose still follows its first fragment rather than being classified without ports. (A
/// host that raises those sysctls above 60 s gives late fragments that much longer to be
/// classified alone, by their source's protocol or `any` rule.) For as long, another first
/// fragment of the same datagram classified otherwise drops the datagram (an overlap that tries to
/// rewrite the ports: the kernel keeps the first copy of a duplicate fragment, so the datagram it
/// delivers is the first one judged): an IPv4 sender that reuses an identification within the
/// minute for a datagram to the same destination and protocol under another rule has that one
/// dropped (`dropped_fragment_conflicts`).
pub const FRAGMENT_TIMEOUT_NS: u64 = 60_000_000_000;

/// Key of [`map_names::FRAGMENTS`]: one fragmented datagram (RFC 791 / RFC 8200 identify one by
/// source, destination, protocol and identification).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct FragKey {
    /// [`family`] tag.
    pub family: u8,
    /// IPv4 protocol, or the IPv6 fragment header's next header.
    pub protocol: u8,
    /// Always zero.
    pub _pad: u16,
    /// IPv4 identification (16 bits, network byte order as read) or IPv6 fragment identification.
    pub id: u32,
    /// Source address as read from the packet (IPv4 in the first word, the rest zero).
    pub src: [u32; 4],
    /// Destination address, likewise.
    pub dst: [u32; 4],
}
const _: () = assert!(size_of::<FragKey>() == 40);

/// Value of [`map_names::FRAGMENTS`]: how the datagram's first fragment was classified.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FragEntry {
    /// Rule-set epoch ([`Config::generation`]) of the classification: under another, it is void.
    pub epoch: u32,
    /// Rule id, or `u32::MAX` for none.
    pub rule: u32,
    /// [`frag_flags`] bits.
    pub flags: u32,
    /// Always zero.
    pub _pad: u32,
    /// When the first fragment came (`bpf_ktime_get_coarse_ns`).
    pub time_ns: u64,
}
const _: () = assert!(size_of::<FragEntry>() == 24);

/// Bits of [`FragEntry::flags`].
pub mod frag_flags {
    /// Every fragment of the datagram is dropped (its first fragment was tiny, or sent again
    /// with another classification).
    pub const DROP: u32 = 1 << 0;
}
