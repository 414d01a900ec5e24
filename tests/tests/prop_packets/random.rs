//! Random rule sets and random frames, with their mutations.

use std::{
    fmt::Write as _,
    net::{Ipv4Addr, Ipv6Addr},
};

use ratelimit::{
    compile::{compile, RuleIds},
    config::Config,
};
use ratelimit_testbed::packet::eth;

use crate::{Rng, PORTS, V4_PREFIXES, V4_SOURCES, V6_PREFIXES, V6_SOURCES};

pub(crate) fn random_sources(rng: &mut Rng) -> Vec<&'static str> {
    // One family mostly; both now and then (rules may mix them).
    let families: &[&[&str]] = match rng.below(10) {
        0..=3 => &[&V4_PREFIXES],
        4..=7 => &[&V6_PREFIXES],
        _ => &[&V4_PREFIXES, &V6_PREFIXES],
    };
    let n = 1 + rng.below(2).max(families.len() - 1);
    let mut out = Vec::new();
    for i in 0..n {
        let pool = families[i % families.len()];
        let p = *rng.pick(pool);
        if !out.contains(&p) {
            out.push(p);
        }
    }
    out
}

/// One `[[rule]]` table. Some combinations are invalid (a `per = "/24"` rule with IPv6 sources,
/// ICMP over both families): the caller draws again when the set does not compile.
pub(crate) fn random_rule(rng: &mut Rng, name: &str) -> String {
    let sources = random_sources(rng);
    let mut t = format!("[[rule]]\nname = \"{name}\"\nsource = {sources:?}\n");
    match rng.below(10) {
        0..=1 => t.push_str("action = \"allow\"\n"),
        2..=3 => t.push_str("action = \"deny\"\n"),
        _ => {
            // Limit: packets, bytes, or both. Rate 1 so that nothing refills during a case.
            let kind = rng.below(10);
            if kind < 8 {
                let _ = writeln!(t, "rate = 1\nburst = {}", 1 + rng.below(5));
            }
            if kind >= 6 {
                let _ = writeln!(
                    t,
                    "bytes_rate = 1\nbytes_burst = {}",
                    1514 + rng.below(1500)
                );
            }
            let v6_only = sources.iter().all(|s| s.contains(':'));
            let v4_only = sources.iter().all(|s| !s.contains(':'));
            match rng.below(10) {
                0..=4 => {}
                5..=6 => t.push_str("per = \"rule\"\n"),
                _ if v4_only => t.push_str(rng.pick::<&str>(&[
                    "per = \"/24\"\n",
                    "per = \"/16\"\n",
                    "per = \"/31\"\n",
                ])),
                _ if v6_only => t.push_str(rng.pick::<&str>(&[
                    "per = \"/64\"\n",
                    "per = \"/48\"\n",
                    "per = \"/127\"\n",
                ])),
                _ => t.push_str("per = \"/24\"\n"), // mixed families: refused, drawn again
            }
        }
    }
    match rng.below(10) {
        0..=4 => {}
        5..=6 => {
            t.push_str("protocol = \"udp\"\n");
            if rng.chance(60) {
                let _ = writeln!(t, "dst_port = {}", rng.pick(&PORTS));
            }
        }
        7..=8 => {
            t.push_str("protocol = \"tcp\"\n");
            if rng.chance(60) {
                let _ = writeln!(t, "dst_port = {}", rng.pick(&PORTS));
            }
            if rng.chance(40) {
                t.push_str("tcp_flags = \"syn\"\n");
            }
        }
        _ => t.push_str("protocol = \"icmp\"\n"),
    }
    if rng.chance(8) {
        t.push_str("dry_run = true\n");
    }
    t
}

/// A rule set that compiles (drawn again until one does), as TOML and parsed.
pub(crate) fn random_rule_set(rng: &mut Rng, case: usize) -> (String, Config) {
    loop {
        let n = 1 + rng.below(6);
        let toml: String = (0..n)
            .map(|i| random_rule(rng, &format!("c{case}r{i}")) + "\n")
            .collect();
        let Ok(config) = Config::parse(&toml, "prop.toml") else {
            continue;
        };
        if compile(&config.rules, &RuleIds::new()).is_ok() {
            return (toml, config);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Random frames.

/// A random frame (built with the testbed's builder, then maybe mutated) and a description.
pub(crate) fn random_frame(rng: &mut Rng) -> (Vec<u8>, String) {
    let (bytes, desc, _) = random_frame_flags_at(rng);
    (bytes, desc)
}

/// [`random_frame`], and where a TCP header's flags byte is in it.
pub(crate) fn random_frame_flags_at(rng: &mut Rng) -> (Vec<u8>, String, Option<usize>) {
    let mut desc = String::new();
    let mut f = eth();
    let tags = match rng.below(40) {
        0..=23 => 0,
        24..=31 => 1,
        32..=35 => 2,
        36 => 3,
        37 => 8,
        38 => 9,
        _ => 10,
    };
    // Priority tags (VLAN id 0), which the stack strips whatever their number, now and then.
    let priority = rng.chance(30);
    for _ in 0..tags {
        let vid = if priority { 0 } else { rng.u16() & 0x0fff };
        if rng.chance(50) {
            f = f.vlan(vid);
            desc.push_str("vlan ");
        } else {
            f = f.qinq(vid);
            desc.push_str("qinq ");
        }
    }
    let l3 = 14 + 4 * tags;
    let kind = rng.below(20);
    let v6 = (9..18).contains(&kind);
    if kind < 9 {
        let src: Ipv4Addr = rng.pick(&V4_SOURCES).parse().expect("address");
        f = f.ipv4(src, Ipv4Addr::new(198, 18, 0, 254));
        let _ = write!(desc, "ipv4 {src} ");
        if rng.chance(25) {
            let n = 4 * rng.below(11);
            f = f.ipv4_options(n);
            let _ = write!(desc, "options {n} ");
        }
    } else if v6 {
        let src: Ipv6Addr = rng.pick(&V6_SOURCES).parse().expect("address");
        f = f.ipv6(src, "2001:db8::fe".parse().expect("address"));
        let _ = write!(desc, "ipv6 {src} ");
        let exts = match rng.below(10) {
            0..=4 => 0,
            5..=6 => 1,
            7 => 2,
            8 => 4,
            _ => 5,
        };
        for _ in 0..exts {
            if rng.chance(20) {
                let offset = if rng.chance(50) {
                    0
                } else {
                    1 + (rng.u16() & 0xfff)
                };
                f = f.frag6(offset, rng.chance(50));
                let _ = write!(desc, "frag6 {offset} ");
            } else {
                let (kind, len8) = (
                    *rng.pick(&[0u8, 43, 60]),
                    u8::try_from(rng.below(3)).expect("small"),
                );
                f = f.ext(kind, len8);
                let _ = write!(desc, "ext {kind}/{len8} ");
            }
        }
    } else {
        let any = rng.u16();
        let ty = *rng.pick(&[0x0806, 0x88cc, 0x8847, any]);
        let _ = write!(desc, "ethertype {ty:#06x}");
        return (f.ethertype(ty, rng.below(64)).build(), desc, None);
    }
    let dst_port = if rng.chance(70) {
        *rng.pick(&PORTS)
    } else {
        rng.u16()
    };
    let mut flags_at = None;
    f = match rng.below(10) {
        0..=3 => {
            let _ = write!(desc, "udp {dst_port} ");
            f.udp(rng.u16(), dst_port)
        }
        4..=6 => {
            // SYN, SYN-ACK, ACK, PSH-ACK, SYN+FIN, none, or any byte.
            let flags = match rng.below(7) {
                0 => 0x02,
                1 => 0x12,
                2 => 0x10,
                3 => 0x18,
                4 => 0x03,
                5 => 0,
                _ => rng.byte(),
            };
            let _ = write!(desc, "tcp {dst_port} flags {flags:#04x} ");
            let f = f.tcp(rng.u16(), dst_port).tcp_flags(flags);
            flags_at = f.l4_offset().map(|l4| l4 + 13);
            f
        }
        7 => {
            desc.push_str("icmp ");
            f.icmp()
        }
        8 => {
            desc.push_str("gre ");
            f.proto(47).payload(8)
        }
        _ => {
            // Any protocol number, extension header numbers included: then the "header" after
            // them is whatever bytes follow.
            let p = rng.byte();
            let _ = write!(desc, "proto {p} ");
            f.proto(p).payload(rng.below(16))
        }
    };
    if !v6 && rng.chance(15) {
        let (offset, more) = if rng.chance(50) {
            (0, true)
        } else {
            (1 + (rng.u16() & 0x1ff), rng.chance(50))
        };
        f = f.frag(offset, more);
        let _ = write!(desc, "frag {offset}{} ", if more { "+MF" } else { "" });
    }
    // Large frames now and then, so that byte limits (1514..3013 bytes of burst) bite.
    let payload = if rng.chance(35) {
        200 + rng.below(1000)
    } else {
        rng.below(32)
    };
    let mut bytes = f.payload(payload).build();
    let _ = write!(desc, "payload {payload}");
    if rng.chance(35) {
        for _ in 0..1 + rng.below(3) {
            mutate(rng, &mut bytes, l3, v6, &mut desc);
        }
    }
    (bytes, desc, flags_at)
}

/// Damages a frame: cuts it, flips header bytes, breaks IHL or version, retypes headers.
pub(crate) fn mutate(rng: &mut Rng, b: &mut Vec<u8>, l3: usize, v6: bool, desc: &mut String) {
    match rng.below(10) {
        8 => {
            // A trailer past the IP datagram (padding on the wire, or crafted bytes).
            let n = 1 + rng.below(40);
            let zeros = rng.chance(50);
            for _ in 0..n {
                b.push(if zeros { 0 } else { rng.byte() });
            }
            let _ = write!(desc, "; trailer {n}{}", if zeros { " zeros" } else { "" });
        }
        9 if l3 + 6 <= b.len() => {
            // The IP length field (IPv4 total, IPv6 payload) made shorter: the rest a trailer.
            let at = if v6 { l3 + 4 } else { l3 + 2 };
            let was = usize::from(u16::from_be_bytes([b[at], b[at + 1]]));
            let now = u16::try_from(rng.below(was + 1)).expect("below a u16");
            b[at..at + 2].copy_from_slice(&now.to_be_bytes());
            let _ = write!(desc, "; ip length {was} -> {now}");
        }
        0 | 1 => {
            // BPF_PROG_TEST_RUN refuses frames shorter than an Ethernet header.
            let n = 14 + rng.below(b.len() - 14 + 1);
            b.truncate(n);
            let _ = write!(desc, "; cut to {n}");
        }
        2 | 3 => {
            let i = rng.below(b.len().min(l3 + 100));
            let x = 1 + u8::try_from(rng.below(255)).expect("small");
            b[i] ^= x;
            let _ = write!(desc, "; byte {i} ^= {x:#04x}");
        }
        4 if l3 < b.len() => {
            let ihl = u8::try_from(rng.below(16)).expect("small");
            b[l3] = (b[l3] & 0xf0) | ihl;
            let _ = write!(desc, "; ihl {ihl}");
        }
        5 if l3 < b.len() => {
            let version = u8::try_from(rng.below(16)).expect("small");
            b[l3] = (version << 4) | (b[l3] & 0x0f);
            let _ = write!(desc, "; version {version}");
        }
        6 => {
            let at = if l3 > 14 && l3 <= b.len() && rng.chance(50) {
                l3 - 2
            } else {
                12
            };
            let ty: u16 = *rng.pick(&[0x0800, 0x86dd, 0x8100, 0x88a8]);
            b[at..at + 2].copy_from_slice(&ty.to_be_bytes());
            let _ = write!(desc, "; ethertype at {at} = {ty:#06x}");
        }
        _ if v6 && l3 + 6 < b.len() => {
            // The first next-header becomes AH (or another extension header), whatever follows.
            let nh = *rng.pick(&[51u8, 51, 0, 43, 44, 60]);
            b[l3 + 6] = nh;
            let _ = write!(desc, "; next header {nh}");
        }
        _ if !v6 && l3 + 8 <= b.len() => {
            let v = rng.u16();
            b[l3 + 6..l3 + 8].copy_from_slice(&v.to_be_bytes());
            let _ = write!(desc, "; frag field {v:#06x}");
        }
        _ => {}
    }
}
