//! A small frame builder for BPF_PROG_TEST_RUN cases:
//! `eth().vlan(10).ipv4(src, dst).udp(1234, 53).build()`.
//!
//! Each layer appends its header; `build` fixes up lengths. Malformed shapes come from
//! `truncate(n)` (cut the frame to n bytes) and the raw setters (`ihl`, `frag_offset`, ...).
//!
//! The same builder makes frames for the wire (sent with [`crate::raw::RawSocket`]): `macs` sets
//! the real addresses, and `checksums` (opt-in, so the frames above keep their zero checksums)
//! fills in the IPv4 header's and the TCP or UDP checksum, which a receiving stack verifies.

use std::net::{Ipv4Addr, Ipv6Addr};

/// A frame under construction.
#[derive(Clone, Debug, Default)]
pub struct Frame {
    bytes: Vec<u8>,
    /// Offset of the IPv4/IPv6 header, once added.
    l3: Option<usize>,
    v6: bool,
    /// Offset of the L4 header, once added.
    l4: Option<usize>,
    truncate_to: Option<usize>,
    ihl_override: Option<u8>,
    version_override: Option<u8>,
    payload: usize,
    /// Offset of the last IPv6 fragment header, once added.
    frag6_at: Option<usize>,
    /// The protocol of the L4 header added (`udp`, `tcp`, `icmp`), once added.
    l4_proto: Option<u8>,
    /// Whether `build` fills in the IPv4 header checksum.
    ipv4_checksum: bool,
    /// Whether `build` fills in the TCP or UDP checksum.
    l4_checksum: bool,
    /// Bytes after the IP datagram, outside its length (see [`Frame::trailer`]).
    trailer: Vec<u8>,
}

/// Starts an Ethernet frame (destination 02:00:00:00:00:02, source 02:00:00:00:00:01).
#[must_use]
pub fn eth() -> Frame {
    let mut bytes = vec![0x02, 0, 0, 0, 0, 0x02, 0x02, 0, 0, 0, 0, 0x01];
    bytes.extend_from_slice(&[0, 0]); // ether type, filled by the next layer
    Frame {
        bytes,
        ..Frame::default()
    }
}

/// The frame most of the program's tests send: UDP (port 1000 to 9) from IPv4 `src` to
/// 198.18.0.254.
#[must_use]
pub fn udp4(src: Ipv4Addr) -> Vec<u8> {
    eth()
        .ipv4(src, Ipv4Addr::new(198, 18, 0, 254))
        .udp(1000, 9)
        .build()
}

/// The IPv4 address a test writes as `s`.
///
/// # Panics
/// If `s` is not one.
#[must_use]
pub fn ip(s: &str) -> Ipv4Addr {
    s.parse().expect("an IPv4 address")
}

impl Frame {
    /// Sets the source and destination MAC addresses (a frame for the wire: the receiving
    /// interface drops a unicast frame that is not addressed to it).
    #[must_use]
    pub fn macs(mut self, src: [u8; 6], dst: [u8; 6]) -> Self {
        self.bytes[0..6].copy_from_slice(&dst);
        self.bytes[6..12].copy_from_slice(&src);
        self
    }

    fn set_ethertype(&mut self, ty: u16) {
        let n = self.bytes.len();
        self.bytes[n - 2..].copy_from_slice(&ty.to_be_bytes());
    }

    /// Adds an 802.1Q tag.
    #[must_use]
    pub fn vlan(self, vid: u16) -> Self {
        self.tag(0x8100, vid)
    }

    /// Adds an 802.1ad (QinQ outer) tag.
    #[must_use]
    pub fn qinq(self, vid: u16) -> Self {
        self.tag(0x88a8, vid)
    }

    fn tag(mut self, tpid: u16, vid: u16) -> Self {
        self.set_ethertype(tpid);
        self.bytes.extend_from_slice(&(vid & 0x0fff).to_be_bytes());
        self.bytes.extend_from_slice(&[0, 0]);
        self
    }

    /// Sets a raw ether type (e.g. 0x0806 for ARP) and appends `payload` zero bytes.
    #[must_use]
    pub fn ethertype(mut self, ty: u16, payload: usize) -> Self {
        self.set_ethertype(ty);
        self.bytes.resize(self.bytes.len() + payload, 0);
        self
    }

    /// Adds an IPv4 header (no options, TTL 64, protocol set by the L4 layer).
    #[must_use]
    pub fn ipv4(mut self, src: Ipv4Addr, dst: Ipv4Addr) -> Self {
        self.set_ethertype(0x0800);
        self.l3 = Some(self.bytes.len());
        let mut h = [0u8; 20];
        h[0] = 0x45;
        h[8] = 64;
        h[12..16].copy_from_slice(&src.octets());
        h[16..20].copy_from_slice(&dst.octets());
        self.bytes.extend_from_slice(&h);
        self
    }

    /// Appends `n` bytes of IPv4 options (NOPs) and raises IHL accordingly.
    #[must_use]
    pub fn ipv4_options(mut self, n: usize) -> Self {
        assert!(
            n.is_multiple_of(4) && n <= 40,
            "options come in 4-byte words, at most 40 bytes"
        );
        let l3 = self.l3.expect("ipv4 first");
        self.bytes.resize(self.bytes.len() + n, 1);
        #[expect(clippy::cast_possible_truncation, reason = "n <= 40")]
        {
            self.bytes[l3] = 0x40 | (5 + (n / 4) as u8);
        }
        self
    }

    /// Overrides the IPv4 IHL field (to build bad headers).
    #[must_use]
    pub fn ihl(mut self, ihl: u8) -> Self {
        self.ihl_override = Some(ihl);
        self
    }

    /// Overrides the IP version nibble (to build bad headers).
    #[must_use]
    pub fn version(mut self, version: u8) -> Self {
        self.version_override = Some(version);
        self
    }

    /// Sets the IPv4 fragment offset (in 8-byte units) and the more-fragments flag.
    #[must_use]
    pub fn frag(mut self, offset: u16, more: bool) -> Self {
        let l3 = self.l3.expect("ipv4 first");
        let v = (offset & 0x1fff) | if more { 0x2000 } else { 0 };
        self.bytes[l3 + 6..l3 + 8].copy_from_slice(&v.to_be_bytes());
        self
    }

    /// Adds an IPv6 header (hop limit 64, next header set by the following layer).
    #[must_use]
    pub fn ipv6(mut self, src: Ipv6Addr, dst: Ipv6Addr) -> Self {
        self.set_ethertype(0x86dd);
        self.l3 = Some(self.bytes.len());
        self.v6 = true;
        let mut h = [0u8; 40];
        h[0] = 0x60;
        h[7] = 64;
        h[8..24].copy_from_slice(&src.octets());
        h[24..40].copy_from_slice(&dst.octets());
        self.bytes.extend_from_slice(&h);
        self
    }

    /// Sets the "next protocol" field of the last header that has one.
    fn set_next(&mut self, proto: u8) {
        let l3 = self.l3.expect("an IP layer first");
        if !self.v6 {
            self.bytes[l3 + 9] = proto;
            return;
        }
        // Walk our own extension headers to the last one.
        let mut next_at = l3 + 6;
        let mut off = l3 + 40;
        while off < self.bytes.len() {
            let nh = self.bytes[next_at];
            let len = match nh {
                0 | 43 | 60 => (usize::from(self.bytes[off + 1]) + 1) * 8,
                44 => 8,
                51 => (usize::from(self.bytes[off + 1]) + 2) * 4,
                _ => break,
            };
            next_at = off;
            off += len;
        }
        self.bytes[next_at] = proto;
    }

    /// Adds an IPv6 extension header (0 hop-by-hop, 43 routing, 60 destination options) of
    /// `len8` 8-byte units.
    #[must_use]
    pub fn ext(mut self, kind: u8, len8: u8) -> Self {
        self.set_next(kind);
        let mut h = vec![0u8; (usize::from(len8) + 1) * 8];
        h[0] = 59; // "no next header" until another layer follows
        h[1] = len8;
        self.bytes.extend_from_slice(&h);
        self
    }

    /// Sets the datagram identification: the IPv4 header's (16 bits), or for IPv6 the last
    /// fragment header's (32 bits).
    #[must_use]
    pub fn ident(mut self, id: u32) -> Self {
        if self.v6 {
            let at = self.frag6_at.expect("frag6 first");
            self.bytes[at + 4..at + 8].copy_from_slice(&id.to_be_bytes());
        } else {
            let l3 = self.l3.expect("ipv4 first");
            let id = u16::try_from(id).expect("IPv4 identification is 16 bits");
            self.bytes[l3 + 4..l3 + 6].copy_from_slice(&id.to_be_bytes());
        }
        self
    }

    /// Adds an IPv6 authentication header of `(len4 + 2) * 4` bytes (its length field's unit).
    #[must_use]
    pub fn ah(mut self, len4: u8) -> Self {
        self.set_next(51);
        let mut h = vec![0u8; (usize::from(len4) + 2) * 4];
        h[0] = 59;
        h[1] = len4;
        self.bytes.extend_from_slice(&h);
        self
    }

    /// Adds an IPv6 fragment header with `offset` (8-byte units).
    #[must_use]
    pub fn frag6(mut self, offset: u16, more: bool) -> Self {
        self.set_next(44);
        self.frag6_at = Some(self.bytes.len());
        let mut h = [0u8; 8];
        h[0] = 59;
        let v = (offset << 3) | u16::from(more);
        h[2..4].copy_from_slice(&v.to_be_bytes());
        self.bytes.extend_from_slice(&h);
        self
    }

    /// Adds a UDP header.
    #[must_use]
    pub fn udp(mut self, src_port: u16, dst_port: u16) -> Self {
        self.set_next(17);
        self.l4 = Some(self.bytes.len());
        self.l4_proto = Some(17);
        self.bytes.extend_from_slice(&src_port.to_be_bytes());
        self.bytes.extend_from_slice(&dst_port.to_be_bytes());
        self.bytes.extend_from_slice(&[0, 8, 0, 0]);
        self
    }

    /// Adds a TCP header (SYN).
    #[must_use]
    pub fn tcp(mut self, src_port: u16, dst_port: u16) -> Self {
        self.set_next(6);
        self.l4 = Some(self.bytes.len());
        self.l4_proto = Some(6);
        let mut h = [0u8; 20];
        h[0..2].copy_from_slice(&src_port.to_be_bytes());
        h[2..4].copy_from_slice(&dst_port.to_be_bytes());
        h[12] = 0x50;
        h[13] = 0x02;
        self.bytes.extend_from_slice(&h);
        self
    }

    /// Sets the TCP header's flags byte (FIN 0x01, SYN 0x02, RST 0x04, PSH 0x08, ACK 0x10).
    #[must_use]
    pub fn tcp_flags(mut self, flags: u8) -> Self {
        let l4 = self.l4.expect("tcp first");
        self.bytes[l4 + 13] = flags;
        self
    }

    /// Sets the TCP sequence number.
    #[must_use]
    pub fn tcp_seq(mut self, seq: u32) -> Self {
        let l4 = self.tcp_at();
        self.bytes[l4 + 4..l4 + 8].copy_from_slice(&seq.to_be_bytes());
        self
    }

    /// Sets the TCP window.
    #[must_use]
    pub fn tcp_window(mut self, window: u16) -> Self {
        let l4 = self.tcp_at();
        self.bytes[l4 + 14..l4 + 16].copy_from_slice(&window.to_be_bytes());
        self
    }

    fn tcp_at(&self) -> usize {
        assert_eq!(self.l4_proto, Some(6), "tcp first");
        self.l4.expect("tcp first")
    }

    /// Offset of the L4 header in the built frame, once added.
    #[must_use]
    pub fn l4_offset(&self) -> Option<usize> {
        self.l4
    }

    /// Adds an ICMP (IPv4) or ICMPv6 echo request header.
    #[must_use]
    pub fn icmp(mut self) -> Self {
        let v6 = self.v6;
        let proto = if v6 { 58 } else { 1 };
        self.set_next(proto);
        self.l4 = Some(self.bytes.len());
        self.l4_proto = Some(proto);
        self.bytes
            .extend_from_slice(&[if v6 { 128 } else { 8 }, 0, 0, 0, 0, 0, 0, 0]);
        self
    }

    /// Sets an L4 protocol number with no header (e.g. 47 GRE).
    #[must_use]
    pub fn proto(mut self, proto: u8) -> Self {
        self.set_next(proto);
        self
    }

    /// Appends `data` as payload (before any filler from `payload` or `pad_to`, so call it
    /// first).
    #[must_use]
    pub fn data(mut self, data: &[u8]) -> Self {
        assert_eq!(self.payload, 0, "data before payload and pad_to");
        self.bytes.extend_from_slice(data);
        self
    }

    /// Fills in the IPv4 header checksum and the TCP or UDP checksum when the frame is built:
    /// [`Frame::ipv4_checksum`] and [`Frame::l4_checksum`].
    #[must_use]
    pub fn checksums(self) -> Self {
        self.ipv4_checksum().l4_checksum()
    }

    /// Fills in the IPv4 header checksum when the frame is built (over the header as built,
    /// options and overrides included).
    #[must_use]
    pub fn ipv4_checksum(mut self) -> Self {
        assert!(self.l3.is_some() && !self.v6, "ipv4 first");
        self.ipv4_checksum = true;
        self
    }

    /// Fills in the TCP or UDP checksum (IPv4 or IPv6 pseudo-header) when the frame is built,
    /// over the segment as built: right for a whole datagram, not for a first fragment. Without
    /// it a UDP checksum stays 0 ("none", which IPv4 allows) and a TCP checksum 0 (wrong).
    #[must_use]
    pub fn l4_checksum(mut self) -> Self {
        assert!(
            matches!(self.l4_proto, Some(6 | 17)),
            "l4_checksum: tcp or udp first"
        );
        self.l4_checksum = true;
        self
    }

    /// Appends `n` payload bytes.
    #[must_use]
    pub fn payload(mut self, n: usize) -> Self {
        self.payload += n;
        self
    }

    /// Cuts the final frame to `n` bytes (after lengths are fixed up).
    #[must_use]
    pub fn truncate(mut self, n: usize) -> Self {
        self.truncate_to = Some(n);
        self
    }

    /// Pads the frame (with payload) to exactly `n` bytes, if shorter.
    #[must_use]
    pub fn pad_to(mut self, n: usize) -> Self {
        let have = self.bytes.len() + self.payload;
        if have < n {
            self.payload += n - have;
        }
        self
    }

    /// Keeps only the first `n` bytes of the L4 header added last (or of the IP payload so far,
    /// if none was), so the datagram's length counts only those: with [`Frame::trailer`], a
    /// header the frame holds but the datagram does not.
    #[must_use]
    pub fn cut_l4(mut self, n: usize) -> Self {
        let at = match (self.l4, self.l3) {
            (Some(l4), _) => l4,
            (None, Some(l3)) => l3 + if self.v6 { 40 } else { 20 },
            (None, None) => panic!("an IP layer first"),
        };
        self.bytes.truncate(at + n);
        self
    }

    /// Appends `bytes` after the IP datagram, outside the length its header gives (the IPv4 total
    /// length, the IPv6 payload length): the padding a short frame gets on the wire (zeros), or a
    /// trailer a crafted frame carries. The receiving stack trims them off before it looks at the
    /// datagram.
    #[must_use]
    pub fn trailer(mut self, bytes: &[u8]) -> Self {
        self.trailer.extend_from_slice(bytes);
        self
    }

    /// The finished frame bytes.
    #[must_use]
    pub fn build(&self) -> Vec<u8> {
        let mut b = self.bytes.clone();
        b.resize(b.len() + self.payload, 0xab);
        if let Some(l3) = self.l3 {
            let total = b.len() - l3;
            if self.v6 {
                let plen = u16::try_from(total - 40).unwrap_or(u16::MAX);
                b[l3 + 4..l3 + 6].copy_from_slice(&plen.to_be_bytes());
            } else {
                let tl = u16::try_from(total).unwrap_or(u16::MAX);
                b[l3 + 2..l3 + 4].copy_from_slice(&tl.to_be_bytes());
                if let Some(ihl) = self.ihl_override {
                    b[l3] = 0x40 | (ihl & 0x0f);
                }
            }
            if let (Some(l4), Some(17)) = (self.l4, self.l4_proto) {
                let ulen = u16::try_from(b.len() - l4).unwrap_or(u16::MAX);
                b[l4 + 4..l4 + 6].copy_from_slice(&ulen.to_be_bytes());
            }
        }
        if let (Some(l3), Some(v)) = (self.l3, self.version_override) {
            b[l3] = (v << 4) | (b[l3] & 0x0f);
        }
        if let (true, Some(l3), Some(l4), Some(proto)) =
            (self.l4_checksum, self.l3, self.l4, self.l4_proto)
        {
            fill_l4_checksum(&mut b, l3, self.v6, l4, proto);
        }
        if let (true, Some(l3)) = (self.ipv4_checksum, self.l3) {
            let end = (l3 + usize::from(b[l3] & 0x0f) * 4).min(b.len());
            b[l3 + 10..l3 + 12].fill(0);
            let sum = checksum(&b[l3..end]);
            b[l3 + 10..l3 + 12].copy_from_slice(&sum.to_be_bytes());
        }
        b.extend_from_slice(&self.trailer);
        if let Some(n) = self.truncate_to {
            b.truncate(n);
        }
        b
    }
}

/// Writes the TCP (`proto` 6) or UDP (17) checksum of the segment at `l4` to the end of `b`,
/// over the pseudo-header of the IP header at `l3` (RFC 793, RFC 768, RFC 8200 section 8.1).
fn fill_l4_checksum(b: &mut [u8], l3: usize, v6: bool, l4: usize, proto: u8) {
    let at = l4 + if proto == 6 { 16 } else { 6 };
    b[at..at + 2].fill(0);
    let len = b.len() - l4;
    let mut pseudo = Vec::with_capacity(40 + len);
    if v6 {
        pseudo.extend_from_slice(&b[l3 + 8..l3 + 40]);
        pseudo.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
        pseudo.extend_from_slice(&[0, 0, 0, proto]);
    } else {
        pseudo.extend_from_slice(&b[l3 + 12..l3 + 20]);
        pseudo.extend_from_slice(&[0, proto]);
        pseudo.extend_from_slice(&u16::try_from(len).unwrap_or(u16::MAX).to_be_bytes());
    }
    pseudo.extend_from_slice(&b[l4..]);
    let mut sum = checksum(&pseudo);
    if proto == 17 && sum == 0 {
        // A computed 0 goes on the wire as all ones: 0 means "no checksum" (RFC 768).
        sum = 0xffff;
    }
    b[at..at + 2].copy_from_slice(&sum.to_be_bytes());
}

/// The source and destination MACs of the frames the e2e tests pin to the bytes they sent
/// before the builder (e2e_limits, e2e_syn, e2e_fragments: their frames' byte tests).
pub const PINNED_MACS: ([u8; 6], [u8; 6]) = (
    [0x02, 0x11, 0x22, 0x33, 0x44, 0x55],
    [0x02, 0x66, 0x77, 0x88, 0x99, 0xaa],
);

/// The bytes a string of hex digits spells (`"0800"` is `[8, 0]`), for expected frames in tests.
///
/// # Panics
/// On an odd length or a character that is not a hex digit.
#[must_use]
pub fn from_hex(hex: &str) -> Vec<u8> {
    assert!(hex.len().is_multiple_of(2), "odd length hex {hex:?}");
    (0..hex.len())
        .step_by(2)
        .map(|i| {
            u8::from_str_radix(&hex[i..i + 2], 16)
                .unwrap_or_else(|e| panic!("hex {hex:?} at {i}: {e}"))
        })
        .collect()
}

/// The Internet checksum (RFC 1071) of `data`: the one's complement of the one's-complement sum
/// of its 16-bit big-endian words, an odd last byte padded with a zero.
#[must_use]
pub fn checksum(data: &[u8]) -> u16 {
    // In 64 bits no frame's sum can overflow before it is folded.
    let mut sum: u64 = data
        .chunks(2)
        .map(|w| u64::from(u16::from_be_bytes([w[0], w.get(1).copied().unwrap_or(0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !u16::try_from(sum).expect("folded to 16 bits")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_checksum_of_known_vectors() {
        // RFC 1071 section 3's example: the words sum to 0xddf2.
        assert_eq!(
            checksum(&[0x00, 0x01, 0xf2, 0x03, 0xf4, 0xf5, 0xf6, 0xf7]),
            !0xddf2
        );
        // An IPv4 header (checksum field zeroed) whose checksum is 0xb861.
        let header = [
            0x45, 0x00, 0x00, 0x73, 0x00, 0x00, 0x40, 0x00, 0x40, 0x11, 0x00, 0x00, 0xc0, 0xa8,
            0x00, 0x01, 0xc0, 0xa8, 0x00, 0xc7,
        ];
        assert_eq!(checksum(&header), 0xb861);
        // An odd length pads with a zero byte; the empty sum is 0, its complement all ones.
        assert_eq!(
            checksum(&[0x12, 0x34, 0x56]),
            checksum(&[0x12, 0x34, 0x56, 0x00])
        );
        assert_eq!(checksum(&[]), 0xffff);
        // Carries fold back in, however many: 40,000 words of 0xffff sum to 0xffff.
        assert_eq!(checksum(&[0xff; 80_000]), 0);
    }

    #[test]
    fn udp_checksums_of_known_datagrams_v4_and_v6() {
        // UDP 12345 -> 54321 carrying "test" (libpnet's udp tests give these checksums).
        let v4 = eth()
            .ipv4([192, 168, 0, 1].into(), [192, 168, 0, 199].into())
            .udp(12345, 54321)
            .data(b"test")
            .checksums()
            .build();
        assert_eq!(v4[34..42], [0x30, 0x39, 0xd4, 0x31, 0x00, 0x0c, 0x91, 0x78]);
        assert_eq!(
            checksum(&v4[14..34]),
            0,
            "the IPv4 header checksum verifies"
        );
        let v6 = eth()
            .ipv6(Ipv6Addr::LOCALHOST, Ipv6Addr::LOCALHOST)
            .udp(12345, 54321)
            .data(b"test")
            .l4_checksum()
            .build();
        assert_eq!(v6[54..62], [0x30, 0x39, 0xd4, 0x31, 0x00, 0x0c, 0x13, 0x90]);
        // Without the opt-in, the checksums stay 0 (the BPF_PROG_TEST_RUN frames).
        let plain = eth()
            .ipv4([192, 168, 0, 1].into(), [192, 168, 0, 199].into())
            .udp(12345, 54321)
            .data(b"test")
            .build();
        assert_eq!(
            (&plain[24..26], &plain[40..42]),
            (&[0u8, 0][..], &[0u8, 0][..])
        );
    }

    #[test]
    fn a_udp_checksum_of_zero_is_sent_as_all_ones() {
        // Find a datagram whose checksum computes to 0 by its payload's last word: the sum of
        // everything else plus that word must be 0xffff.
        let frame = |word: u16| {
            eth()
                .ipv4([198, 18, 0, 1].into(), [198, 18, 0, 2].into())
                .udp(1, 2)
                .data(&word.to_be_bytes())
                .l4_checksum()
                .build()
        };
        let sum_without = !u16::from_be_bytes(frame(0)[40..42].try_into().unwrap());
        let word = 0xffff - sum_without;
        let f = frame(word);
        assert_eq!(f[40..42], [0xff, 0xff]);
    }
}
