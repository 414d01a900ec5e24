//! A small frame builder for BPF_PROG_TEST_RUN cases:
//! `eth().vlan(10).ipv4(src, dst).udp(1234, 53).build()`.
//!
//! Each layer appends its header; `build` fixes up lengths. Malformed shapes come from
//! `truncate(n)` (cut the frame to n bytes) and the raw setters (`ihl`, `frag_offset`, ...).

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

impl Frame {
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

    /// Offset of the L4 header in the built frame, once added.
    #[must_use]
    pub fn l4_offset(&self) -> Option<usize> {
        self.l4
    }

    /// Adds an ICMP (IPv4) or ICMPv6 echo request header.
    #[must_use]
    pub fn icmp(mut self) -> Self {
        let v6 = self.v6;
        self.set_next(if v6 { 58 } else { 1 });
        self.l4 = Some(self.bytes.len());
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
            if let Some(l4) = self.l4 {
                if b.get(l3 + if self.v6 { 6 } else { 9 }) == Some(&17) || self.is_udp_at(&b, l4) {
                    let ulen = u16::try_from(b.len() - l4).unwrap_or(u16::MAX);
                    b[l4 + 4..l4 + 6].copy_from_slice(&ulen.to_be_bytes());
                }
            }
        }
        if let (Some(l3), Some(v)) = (self.l3, self.version_override) {
            b[l3] = (v << 4) | (b[l3] & 0x0f);
        }
        if let Some(n) = self.truncate_to {
            b.truncate(n);
        }
        b
    }

    fn is_udp_at(&self, b: &[u8], l4: usize) -> bool {
        // The UDP length field sits where TCP keeps its sequence number; only touch it for UDP.
        b.len() >= l4 + 8 && b[l4 + 4..l4 + 6] == [0, 8]
    }
}
