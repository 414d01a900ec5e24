//! Property tests of the real XDP program against a user-space reference model, through
//! BPF_PROG_TEST_RUN.
//!
//! Random rule sets (prefixes from a small pool, so that they nest and overlap; random protocol,
//! port and `tcp_flags = "syn"`; allow, deny, and limit rules with rate 1 and bursts of at most 5 packets, some with a
//! byte limit of 1 byte/s) meet random frames (IPv4 and IPv6, VLAN tags, IPv4 options, IPv6
//! extension headers, fragments, TCP (SYN, SYN-ACK, ACK, ... any flags byte)/UDP/ICMP/other, and
//! then mutations: truncated, bytes flipped,
//! bad IHL or version, retyped headers). For every frame the model
//! - parses it the way `ratelimit-ebpf/src/parse.rs` documents (or names the counter of the reason
//!   it cannot: an unparseable frame must pass, whatever the rules say),
//! - classifies it with [`CompiledRuleSet::classify`], the user-space reference classifier,
//! - charges a model bucket per (rule, source masked to the rule's `per`),
//!
//! and predicts the XDP action, every rule counter and every global counter that moves. The
//! program must agree on all three, frame by frame.
//!
//! Time: at 1 packet/s (and 1 byte/s) a bucket earns its next token one second after it was
//! created, so a bucket younger than that admits exactly `burst` packets (`bytes_burst` bytes) and
//! nothing more. Every case installs rules under new names, so they get fresh ids (or reused ids under a
//! new bucket generation) and the buckets of earlier cases go stale, and a case stops sending after [`CASE_BUDGET`].
//!
//! Deterministic: the seed is fixed; `RL_PROP_SEED=N` replays another, `RL_PROP_CASES=N` runs more
//! cases. A failure prints the seed, the case, its rules as TOML and the frame in hex.

use std::{
    collections::HashMap,
    fmt::Write as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    time::{Duration, Instant},
};

use ratelimit::{
    compile::{compile, CompiledRuleSet, RuleIds, WithoutL4},
    config::{Action, Config, Per, RuleConfig},
};
use ratelimit_common::{
    addr_words, bucket_hash, bucket_sets, config_flags, family, global, verdict, BucketKey,
    GlobalStats, RuleStats, BUCKET_CANDIDATES,
};
use ratelimit_testbed::{
    packet::eth,
    require_root,
    xdp::{XDP_DROP, XDP_PASS},
    TestDataplane,
};

/// Default seed (any value; fixed so that CI runs the same cases every time).
const SEED: u64 = 0x005e_ed0f_7e57;
/// Rule sets per run by default, and frames per rule set.
const CASES: usize = 250;
const FRAMES_PER_CASE: usize = 40;
/// A case stops sending after this long: far below the 1 s in which a rate-1 bucket earns a token.
const CASE_BUDGET: Duration = Duration::from_millis(700);
/// Failures printed in full.
const SHOW: usize = 8;

const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;

/// Rule prefixes: nested and overlapping on purpose.
const V4_PREFIXES: [&str; 9] = [
    "0.0.0.0/0",
    "198.18.0.0/15",
    "198.18.0.0/16",
    "198.18.1.0/24",
    "198.18.1.0/25",
    "198.18.1.128/25",
    "198.18.1.7/32",
    "198.19.0.0/16",
    "198.18.2.0/24",
];
const V6_PREFIXES: [&str; 6] = [
    "::/0",
    "2001:db8::/32",
    "2001:db8:0:1::/64",
    "2001:db8:0:1::7/128",
    "2001:db8:1::/48",
    "2001:db8:0:1:8000::/65",
];
/// Packet sources: inside the prefixes above at various depths, and outside all but /0.
const V4_SOURCES: [&str; 7] = [
    "198.18.1.7",
    "198.18.1.8",
    "198.18.1.200",
    "198.18.2.3",
    "198.19.5.5",
    "198.18.9.9",
    "192.0.2.1",
];
const V6_SOURCES: [&str; 7] = [
    "2001:db8:0:1::7",
    "2001:db8:0:1::8",
    "2001:db8:0:1:ffff::1",
    "2001:db8:1::5",
    "2001:db8:2::1",
    "2001:db8:1:0:1::1",
    "3fff::1",
];
const PORTS: [u16; 3] = [53, 80, 443];

// ---------------------------------------------------------------------------------------------
// A small deterministic RNG (SplitMix64): no dependency, identical sequences everywhere.

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0; the modulo bias is irrelevant here).
    fn below(&mut self, n: usize) -> usize {
        usize::try_from(self.next() % n as u64).expect("fits")
    }

    /// True with probability `percent`%.
    fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    fn byte(&mut self) -> u8 {
        self.next().to_le_bytes()[0]
    }

    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.byte(), self.byte()])
    }
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

// ---------------------------------------------------------------------------------------------
// The reference parser: what parse.rs documents, written for a byte slice.

/// How a frame is cut (parse.rs's `shape`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Shape {
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
struct Parsed {
    src: IpAddr,
    dst: IpAddr,
    /// IP protocol (IPv6: the header the chain ends with); 255 when not reached.
    protocol: u8,
    /// TCP/UDP destination port; 0 when none was read.
    dst_port: u16,
    /// The TCP flags byte; 0 when no whole TCP header was read.
    tcp_flags: u8,
    shape: Shape,
    /// A first fragment (whatever its shape).
    first_fragment: bool,
    /// For fragments: the datagram's protocol (IPv6: the fragment header's next header) and
    /// identification.
    frag_protocol: u8,
    frag_id: u32,
}

/// Most VLAN tags walked.
const MAX_VLAN_TAGS: usize = 8;

/// Most IPv6 extension headers walked, and bytes of them.
const MAX_IPV6_EXT: usize = 8;
const MAX_IPV6_EXT_BYTES: usize = 1024;

fn be16(b: &[u8], off: usize) -> Option<u16> {
    b.get(off..off + 2)
        .map(|s| u16::from_be_bytes([s[0], s[1]]))
}

/// Parses a frame, or returns the [`global`] counter naming why it cannot.
fn model_parse(b: &[u8]) -> Result<Parsed, usize> {
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

fn model_ipv4(b: &[u8], off: usize) -> Result<Parsed, usize> {
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
fn model_at_l4(b: &[u8], mut p: Parsed, l4: usize, end: usize) -> Parsed {
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

fn model_ipv6(b: &[u8], off: usize) -> Result<Parsed, usize> {
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
fn model_l4_port(b: &[u8], l4: usize, end: usize, protocol: u8) -> Option<(u16, u8)> {
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

// ---------------------------------------------------------------------------------------------
// The bucket model.

/// Tokens spent by one model bucket since it was created.
#[derive(Clone, Copy, Debug, Default)]
struct ModelBucket {
    pkts: u64,
    bytes: u64,
}

/// (rule id, keyed as IPv6?, source masked to the rule's `per`, left-aligned bits).
type BucketId = (u32, bool, u128);

/// The program's bucket key for a model bucket.
fn kernel_key((id, v6, bits): BucketId) -> BucketKey {
    BucketKey {
        rule: id,
        family: if v6 { family::V6 } else { family::V4 },
        _pad: [0; 3],
        addr: bits.to_be_bytes(),
    }
}

fn mask(len: u8) -> u128 {
    match len {
        0 => 0,
        n => !0u128 << (128 - u32::from(n)),
    }
}

fn bucket_of(id: u32, rule: &RuleConfig, src: IpAddr) -> BucketId {
    let (v6, bits) = match src {
        IpAddr::V4(a) => (false, u128::from(u32::from(a)) << 96),
        IpAddr::V6(a) => (true, u128::from(a)),
    };
    let len = match rule.per {
        Per::Source => 128,
        Per::Rule => 0,
        Per::Prefix(n) => n,
    };
    // A mask of length 0 (`per = "rule"`, or "/0") is the rule's one bucket, whatever the
    // source's family: the program keys it as IPv4's.
    (id, v6 && len != 0, bits & mask(len))
}

/// Charges a frame of `len` bytes to a limit rule's bucket (created full if new) and returns the
/// rule verdict: the GCRA of bucket.rs with every packet at the same instant (see the module doc).
fn charge(bucket: &mut ModelBucket, rule: &RuleConfig, len: u64) -> usize {
    if let Some(burst) = rule.burst.filter(|_| rule.rate.is_some()) {
        if bucket.pkts + 1 > burst {
            return verdict::DROPPED_RATE;
        }
        bucket.pkts += 1;
    }
    if let Some(bytes_burst) = rule.bytes_burst.filter(|_| rule.bytes_rate.is_some()) {
        if bucket.bytes + len > bytes_burst {
            // The packet token charged above is given back.
            if rule.rate.is_some() {
                bucket.pkts -= 1;
            }
            return verdict::DROPPED_BYTES;
        }
        bucket.bytes += len;
    }
    verdict::PASSED
}

/// What the model expects of one frame.
#[derive(Debug, PartialEq, Eq)]
struct Expect {
    action: u32,
    /// Deltas of every global counter.
    global: [u64; global::COUNT],
    /// (rule id, verdict) whose packet counter moves by one, if a rule matched.
    rule: Option<(u32, usize)>,
}

/// One installed rule set and the model's state for it.
struct Model<'a> {
    set: &'a CompiledRuleSet,
    rules: HashMap<u32, &'a RuleConfig>,
    buckets: HashMap<BucketId, ModelBucket>,
    /// The bucket store's seed and sets (read from the pinned config), and how many of this
    /// case's buckets share each key's pair of sets: the model has every bucket live, so it
    /// checks that no pair is asked to hold more than its records (the store could evict; no
    /// case comes near it).
    seed: [u64; 2],
    sets: u32,
    per_set: HashMap<[u32; 2], u32>,
    /// Fragmented datagrams whose first fragment was seen: its rule, or the reason they drop.
    fragments: HashMap<Datagram, (Option<u32>, Option<usize>)>,
    agent_dry_run: bool,
}

/// A fragmented datagram: source, destination, protocol, identification.
type Datagram = (IpAddr, IpAddr, u8, u32);

impl<'a> Model<'a> {
    fn new(
        set: &'a CompiledRuleSet,
        config: &'a Config,
        agent_dry_run: bool,
        store: &ratelimit_common::Config,
    ) -> Self {
        let rules = config
            .rules
            .iter()
            .map(|r| (set.by_name(&r.name).expect("compiled").id, r))
            .collect();
        Self {
            set,
            rules,
            buckets: HashMap::new(),
            seed: store.seed,
            sets: store.bucket_sets,
            per_set: HashMap::new(),
            fragments: HashMap::new(),
            agent_dry_run,
        }
    }

    /// ratelimit-ebpf/src/frag.rs `remember`: the datagram's first fragment decided `id` (or
    /// `drop` for `reason`); `Some(reason)` if this fragment is dropped.
    fn remember(
        &mut self,
        datagram: Datagram,
        id: Option<u32>,
        drop: Option<usize>,
    ) -> Option<usize> {
        match self.fragments.get_mut(&datagram) {
            Some((_, Some(reason))) => Some(*reason),
            Some(entry) => {
                if entry.0 != id || drop.is_some() {
                    let reason = drop.unwrap_or(global::DROPPED_FRAGMENT_CONFLICTS);
                    entry.1 = Some(reason);
                    Some(reason)
                } else {
                    None
                }
            }
            None => {
                self.fragments.insert(datagram, (id, drop));
                drop
            }
        }
    }

    fn frame(&mut self, bytes: &[u8]) -> Expect {
        let mut g = [0u64; global::COUNT];
        g[global::PACKETS] = 1;
        let parsed = match model_parse(bytes) {
            Ok(p) => p,
            Err(global::DROPPED_VLAN_CHAINS)
                if self.rules.values().any(|r| r.action != Action::Allow) =>
            {
                // Its source is unknown, and a rule that can drop is in force.
                g[global::DROPPED_VLAN_CHAINS] += 1;
                return Expect {
                    action: if self.agent_dry_run {
                        XDP_PASS
                    } else {
                        XDP_DROP
                    },
                    global: g,
                    rule: None,
                };
            }
            Err(counter) => {
                let counter = if counter == global::DROPPED_VLAN_CHAINS {
                    global::BAD_VLAN
                } else {
                    counter
                };
                g[counter] += 1;
                return Expect {
                    action: XDP_PASS,
                    global: g,
                    rule: None,
                };
            }
        };
        match parsed.shape {
            Shape::LaterFragment => g[global::FRAGMENTS] += 1,
            Shape::Truncated | Shape::CutChain => g[global::TRUNCATED_L4] += 1,
            _ => {}
        }
        let pass = |g| Expect {
            action: XDP_PASS,
            global: g,
            rule: None,
        };
        let drop = |mut g: [u64; global::COUNT], reason: usize, dry_run: bool| {
            g[reason] += 1;
            Expect {
                action: if dry_run { XDP_PASS } else { XDP_DROP },
                global: g,
                rule: None,
            }
        };
        // The kernel's reassembly key: an IPv6 datagram's has no protocol.
        let protocol = if parsed.src.is_ipv6() {
            0
        } else {
            parsed.frag_protocol
        };
        let datagram = (parsed.src, parsed.dst, protocol, parsed.frag_id);
        let port = (parsed.dst_port != 0).then_some(parsed.dst_port);
        // The rule (id) that decides, as ratelimit-ebpf/src/main.rs `decide` does.
        let id: Option<u32> = match parsed.shape {
            Shape::FirstFragment => {
                let id = self
                    .set
                    .classify(parsed.src, parsed.protocol, port, parsed.tcp_flags)
                    .map(|c| c.id);
                if let Some(reason) = self.remember(datagram, id, None) {
                    return drop(g, reason, self.agent_dry_run);
                }
                id
            }
            Shape::LaterFragment => match self.fragments.get(&datagram) {
                Some(&(_, Some(reason))) => return drop(g, reason, self.agent_dry_run),
                Some(&(id, None)) => id,
                None => {
                    g[global::FRAGMENTS_UNMATCHED] += 1;
                    // Its datagram's rule is unknown: dropped where a rule that looks at the
                    // port (for IPv6, also the protocol) could apply (nothing remembered).
                    let without = if parsed.src.is_ipv4() {
                        self.set.classify_without_port(parsed.src, parsed.protocol)
                    } else {
                        self.set.classify_without_l4(parsed.src)
                    };
                    if let WithoutL4::Dependent = without {
                        return drop(g, global::DROPPED_UNMATCHED_FRAGMENTS, self.agent_dry_run);
                    }
                    self.set
                        .classify(parsed.src, parsed.protocol, None, 0)
                        .map(|c| c.id)
                }
            },
            Shape::TinyFragment | Shape::LongChain => {
                let id = match self.set.classify_without_l4(parsed.src) {
                    WithoutL4::Dependent => {
                        let reason = if parsed.shape == Shape::TinyFragment {
                            global::DROPPED_TINY_FRAGMENTS
                        } else {
                            global::DROPPED_LONG_CHAINS
                        };
                        if parsed.first_fragment {
                            self.remember(datagram, None, Some(reason));
                        }
                        return drop(g, reason, self.agent_dry_run);
                    }
                    WithoutL4::NoRule => None,
                    WithoutL4::Rule(r) => Some(r.id),
                };
                if parsed.shape == Shape::LongChain {
                    g[global::LONG_CHAINS] += 1;
                }
                if parsed.first_fragment {
                    if let Some(reason) = self.remember(datagram, id, None) {
                        return drop(g, reason, self.agent_dry_run);
                    }
                }
                id
            }
            Shape::CutChain => match self.set.classify_without_l4(parsed.src) {
                WithoutL4::Dependent => return pass(g),
                WithoutL4::NoRule => None,
                WithoutL4::Rule(r) => Some(r.id),
            },
            Shape::Whole | Shape::Truncated => self
                .set
                .classify(parsed.src, parsed.protocol, port, parsed.tcp_flags)
                .map(|c| c.id),
        };
        let Some(compiled) = id.and_then(|id| self.set.rule(id)) else {
            g[global::NO_MATCH] += 1;
            return pass(g);
        };
        let rule = self.rules[&compiled.id];
        let len = bytes.len() as u64;
        let v = match rule.action {
            Action::Allow => verdict::ALLOWED,
            Action::Deny => verdict::DENIED,
            Action::Limit => {
                let key = bucket_of(compiled.id, rule, parsed.src);
                if !self.buckets.contains_key(&key) {
                    // A new source: its bucket is created (full) for its first packet, in one of
                    // the records of its set.
                    g[global::NEW_BUCKETS] += 1;
                    let k = kernel_key(key);
                    let mut sets = bucket_sets(
                        bucket_hash(self.seed, k.rule, k.family, addr_words(&k.addr)),
                        self.sets,
                    );
                    sets.sort_unstable();
                    let n = self.per_set.entry(sets).or_default();
                    *n += 1;
                    assert!(
                        *n <= BUCKET_CANDIDATES,
                        "the case's sources fill sets {sets:?} past their records: the model \
                         has no evictions; use a larger store"
                    );
                }
                let bucket = self.buckets.entry(key).or_default();
                charge(bucket, rule, len)
            }
        };
        let dropped = matches!(
            v,
            verdict::DROPPED_RATE | verdict::DROPPED_BYTES | verdict::DENIED
        );
        let (v, action) = match (dropped, rule.dry_run || self.agent_dry_run) {
            (false, _) => (v, XDP_PASS),
            (true, true) => (verdict::DRY_RUN, XDP_PASS),
            (true, false) => (v, XDP_DROP),
        };
        Expect {
            action,
            global: g,
            rule: Some((compiled.id, v)),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Random rule sets.

fn random_sources(rng: &mut Rng) -> Vec<&'static str> {
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
fn random_rule(rng: &mut Rng, name: &str) -> String {
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
fn random_rule_set(rng: &mut Rng, case: usize) -> (String, Config) {
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
fn random_frame(rng: &mut Rng) -> (Vec<u8>, String) {
    let (bytes, desc, _) = random_frame_flags_at(rng);
    (bytes, desc)
}

/// [`random_frame`], and where a TCP header's flags byte is in it.
fn random_frame_flags_at(rng: &mut Rng) -> (Vec<u8>, String, Option<usize>) {
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
fn mutate(rng: &mut Rng, b: &mut Vec<u8>, l3: usize, v6: bool, desc: &mut String) {
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

// ---------------------------------------------------------------------------------------------
// The runs.

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn delta(after: &GlobalStats, before: &GlobalStats) -> [u64; global::COUNT] {
    std::array::from_fn(|i| after.counters[i] - before.counters[i])
}

fn rule_delta(after: &RuleStats, before: &RuleStats) -> [u64; verdict::COUNT] {
    std::array::from_fn(|v| after.pkts[v] - before.pkts[v])
}

#[test]
fn verdicts_and_counters_match_the_reference_model() {
    require_root();
    let seed = env_or("RL_PROP_SEED", SEED);
    let cases = usize::try_from(env_or("RL_PROP_CASES", CASES as u64)).expect("fits");
    let mut rng = Rng(seed);
    let mut dp = TestDataplane::new("prop", 1 << 16).expect("load");
    dp.make_buckets_at_first_packet();
    let started = Instant::now();
    let (mut checked, mut unparseable, mut drops, mut cut_short) = (0usize, 0usize, 0usize, 0usize);
    let mut verdicts = [0usize; verdict::COUNT];
    let mut failures: Vec<String> = Vec::new();
    for case in 0..cases {
        let (toml, config) = random_rule_set(&mut rng, case);
        let agent_dry_run = rng.chance(10);
        let set = dp
            .install_toml(&toml)
            .unwrap_or_else(|e| panic!("case {case}: install: {e:#}\n{toml}"));
        dp.dataplane()
            .set_flags(if agent_dry_run {
                config_flags::DRY_RUN
            } else {
                0
            })
            .expect("set flags");
        let store = dp.maps().config().expect("config");
        let mut model = Model::new(&set, &config, agent_dry_run, &store);
        let ids: Vec<u32> = set.rules.iter().map(|r| r.id).collect();
        let case_start = Instant::now();
        let mut g0 = dp.global();
        let mut r0: Vec<RuleStats> = ids.iter().map(|&id| dp.rule(id)).collect();
        let mut twin: Option<(Vec<u8>, String, usize)> = None;
        for n in 0..FRAMES_PER_CASE {
            if case_start.elapsed() > CASE_BUDGET {
                cut_short += 1;
                break;
            }
            // Now and then the last TCP frame again with other flags: one source's SYNs, SYN-ACKs
            // and ACKs in a row, as the per-CPU classification cache sees them.
            let (bytes, desc) = match twin.take() {
                Some((mut bytes, desc, at)) if rng.chance(70) => {
                    let flags = *rng.pick(&[0x02u8, 0x12, 0x10, 0x18, 0x00]);
                    bytes[at] = flags;
                    (bytes, format!("{desc} (again, flags {flags:#04x})"))
                }
                _ => {
                    let (bytes, desc, at) = random_frame_flags_at(&mut rng);
                    if let Some(at) = at.filter(|&at| at < bytes.len()) {
                        twin = Some((bytes.clone(), desc.clone(), at));
                    }
                    (bytes, desc)
                }
            };
            let want = model.frame(&bytes);
            let action = dp.run(&bytes);
            let g1 = dp.global();
            let r1: Vec<RuleStats> = ids.iter().map(|&id| dp.rule(id)).collect();
            let got_global = delta(&g1, &g0);
            let moved: Vec<(u32, usize)> = ids
                .iter()
                .zip(r0.iter().zip(&r1))
                .flat_map(|(&id, (a, b))| {
                    let d = rule_delta(b, a);
                    (0..verdict::COUNT).flat_map(move |v| {
                        std::iter::repeat_n((id, v), usize::try_from(d[v]).expect("small"))
                    })
                })
                .collect();
            let got = Expect {
                action,
                global: got_global,
                rule: moved.first().copied(),
            };
            checked += 1;
            if model_parse(&bytes).is_err() {
                unparseable += 1;
            }
            if action == XDP_DROP {
                drops += 1;
            }
            if let Some((_, v)) = got.rule {
                verdicts[v] += 1;
            }
            if got != want || moved.len() > 1 {
                let name = |r: Option<(u32, usize)>| {
                    r.map(|(id, v)| {
                        format!(
                            "{} {}",
                            set.rule(id).map_or("?", |c| c.name.as_str()),
                            verdict::NAMES[v]
                        )
                    })
                };
                failures.push(format!(
                    "seed {seed:#x} case {case} frame {n}: {desc}\n  frame ({} bytes) {}\n  model parse: {:?}\n  \
                     action {} (model {}), rule {:?} (model {:?}, all moved {moved:?})\n  global deltas {:?}\n  \
                     model          {:?}\n  agent dry run {agent_dry_run}; rules:\n{toml}",
                    bytes.len(),
                    hex(&bytes),
                    model_parse(&bytes),
                    action,
                    want.action,
                    name(got.rule),
                    name(want.rule),
                    got.global,
                    want.global,
                ));
            }
            g0 = g1;
            r0 = r1;
        }
    }
    dp.dataplane().set_flags(0).expect("set flags");
    println!(
        "{checked} frames in {cases} rule sets in {:?} (seed {seed:#x}): {unparseable} unparseable, {drops} \
         dropped; rule verdicts {:?} = {verdicts:?}; {cut_short} cases cut short by the time budget",
        started.elapsed(),
        verdict::NAMES
    );
    let shown: Vec<&String> = failures.iter().take(SHOW).collect();
    assert!(
        failures.is_empty(),
        "{} of {checked} frames disagree with the model; the first {}:\n\n{}",
        failures.len(),
        shown.len(),
        shown
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    );
    // The generator must reach every outcome, or the property says little.
    assert!(
        checked >= cases * FRAMES_PER_CASE * 9 / 10,
        "only {checked} frames checked"
    );
    for v in [
        verdict::PASSED,
        verdict::ALLOWED,
        verdict::DROPPED_RATE,
        verdict::DROPPED_BYTES,
        verdict::DENIED,
        verdict::DRY_RUN,
    ] {
        assert!(
            verdicts[v] > 0,
            "no frame got verdict {}: {verdicts:?}",
            verdict::NAMES[v]
        );
    }
    assert!(
        unparseable * 20 > checked,
        "too few unparseable frames: {unparseable} of {checked}"
    );
}

/// With a rule that denies every source of both families, whatever the protocol: every frame
/// the model parses is dropped and every frame it cannot parse passes, counted under its reason.
#[test]
fn unparseable_frames_pass_even_when_everything_is_denied() {
    require_root();
    let seed = env_or("RL_PROP_SEED", SEED) ^ 0xdead;
    let mut rng = Rng(seed);
    let mut dp = TestDataplane::new("propdeny", 1024).expect("load");
    dp.make_buckets_at_first_packet();
    dp.install_toml(
        "[[rule]]\nname = \"deny-all\"\nsource = [\"0.0.0.0/0\", \"::/0\"]\naction = \"deny\"\n",
    )
    .expect("install");
    let frames = 3000;
    let mut failures = Vec::new();
    let mut reasons = [0usize; global::COUNT];
    for n in 0..frames {
        let (mut bytes, mut desc) = random_frame(&mut rng);
        // Damage every other frame some more.
        if n % 2 == 0 {
            mutate(&mut rng, &mut bytes, 14, false, &mut desc);
        }
        let g0 = dp.global();
        let action = dp.run(&bytes);
        let got = delta(&dp.global(), &g0);
        match model_parse(&bytes) {
            // Past the VLAN walk: its source is unknown, and the deny rule could apply.
            Err(reason @ global::DROPPED_VLAN_CHAINS) => {
                reasons[reason] += 1;
                if action != XDP_DROP || got[reason] != 1 {
                    failures.push(format!(
                        "frame {n} ({desc}): past the VLAN walk but action {action}, global deltas {got:?}\n  {}",
                        hex(&bytes)
                    ));
                }
            }
            Err(reason) => {
                reasons[reason] += 1;
                if action != XDP_PASS || got[reason] != 1 {
                    failures.push(format!(
                        "frame {n} ({desc}): unparseable ({}) but action {action}, global deltas {got:?}\n  {}",
                        global::NAMES[reason],
                        hex(&bytes)
                    ));
                }
            }
            Ok(p) if action != XDP_DROP => failures.push(format!(
                "frame {n} ({desc}): parsed as {p:?} but not dropped (action {action}, global deltas {got:?})\n  {}",
                hex(&bytes)
            )),
            Ok(_) => {}
        }
    }
    println!(
        "{frames} frames (seed {seed:#x}); unparseable by reason: {:?}",
        global::NAMES
            .iter()
            .zip(reasons)
            .filter(|(_, n)| *n > 0)
            .collect::<Vec<_>>()
    );
    assert!(
        failures.is_empty(),
        "{} failures, first:\n{}",
        failures.len(),
        failures
            .iter()
            .take(SHOW)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    for reason in [
        global::NON_IP,
        global::BAD_VLAN,
        global::TRUNCATED_IPV4,
        global::BAD_IPV4,
        global::BAD_IPV6,
    ] {
        assert!(
            reasons[reason] > 0,
            "no frame was unparseable for {}: {reasons:?}",
            global::NAMES[reason]
        );
    }
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

/// The bucket model on its own: burst then drops, bytes give the packet token back.
#[test]
fn the_bucket_model_spends_bursts() {
    let mut rule = RuleConfig::new("r", "198.18.0.0/16".parse().expect("net"));
    rule.rate = Some(1);
    rule.burst = Some(3);
    let mut b = ModelBucket::default();
    let got: Vec<usize> = (0..5).map(|_| charge(&mut b, &rule, 100)).collect();
    assert_eq!(got, [0, 0, 0, verdict::DROPPED_RATE, verdict::DROPPED_RATE]);
    rule.bytes_rate = Some(1);
    rule.bytes_burst = Some(1514);
    let mut b = ModelBucket::default();
    assert_eq!(charge(&mut b, &rule, 1000), verdict::PASSED);
    assert_eq!(charge(&mut b, &rule, 1000), verdict::DROPPED_BYTES);
    assert_eq!(charge(&mut b, &rule, 500), verdict::PASSED);
    assert_eq!(charge(&mut b, &rule, 14), verdict::PASSED);
    assert_eq!((b.pkts, b.bytes), (3, 1514));
    assert_eq!(charge(&mut b, &rule, 14), verdict::DROPPED_RATE);
}
