//! Compiles validated rules into what the XDP program reads, and classifies packets the same way.
//!
//! The XDP program does one longest-prefix lookup of the packet's source in the prefix trie and
//! walks the [`RuleSet`] it finds, taking the first rule whose protocol, destination port and TCP
//! flags match. To give "the matching rule with the longest source prefix wins; among rules of
//! one prefix, the most specific wins", each distinct rule prefix gets the list:
//!
//! 1. its own rules, most specific first: protocol+port+flags, protocol+port, protocol+flags,
//!    protocol, any. A port outranks flags, so a SYN cannot walk past a port's rule (a `deny`
//!    among them) just by being a SYN: a SYN limit for a port that has its own rule names the
//!    port too;
//! 2. then the list of its longest enclosing rule prefix (itself built the same way), minus the
//!    entries an earlier entry already covers: those could never be reached by the walk. Dropping
//!    them keeps lists short, and implies cutting the list after the first protocol-any entry.
//!
//! A rule may list many prefixes (and several rules the same prefix): every (rule, prefix) pair
//! is a candidate at that prefix, so a rule with nested prefixes appears once in a list.
//!
//! [`CompiledRuleSet::classify`] replays exactly that lookup and walk in user space.
//!
//! Rule ids index the rule and counter arrays and are part of every bucket key, so they are kept
//! stable across reloads by [`RuleIds`]: see there for the two-phase swap.

use std::{
    collections::{HashMap, HashSet, VecDeque},
    fmt,
    net::IpAddr,
};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use ratelimit_common::{
    action, family, rule_flags, v4_table, Limit, PrefixKey, Rule, RuleSet, MAX_CANDIDATES,
    MAX_PREFIXES, MAX_RULES, PREFIX_KEY_HEADER_BITS,
};

use crate::config::{Action, Per, Protocol, RuleConfig, RuleError, Scope, TcpFlags};

const NS_PER_SEC: u128 = 1_000_000_000;
/// The shortest tolerance a rule on the coarse clock may have: 20 ms, five ticks at HZ=250.
/// Below it, nearly every charge would be within the lag the program allows that clock
/// (`ratelimit_common::COARSE_LAG_TICKS` ticks) of a full or an empty bucket, where the program
/// reads the precise clock anyway. A matter of cost only: a charge is exact on either clock.
const COARSE_CLOCK_MIN_TOLERANCE_NS: u64 = 20_000_000;

/// One rule as installed: its id, its kernel record and where it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompiledRule {
    /// Rule name (unique).
    pub name: String,
    /// Index into the rule and counter maps.
    pub id: u32,
    /// The kernel record.
    pub rule: Rule,
    /// Source prefixes the rule applies to.
    pub sources: Vec<IpNet>,
    /// Line of the rule in its config file (0 if it did not come from a file).
    pub line: usize,
    /// The id was not in use by the installed rule set: the agent must reset the id's counters
    /// before installing (and may skip rewriting the records of rules that are not fresh).
    pub fresh: bool,
}

/// One entry of the prefix trie: a distinct rule source prefix and its candidate rules.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompiledPrefix {
    /// [`family`] tag.
    pub family: u8,
    /// Network address, network byte order; IPv4 in the first four bytes, the rest zero.
    pub addr: [u8; 16],
    /// CIDR prefix length.
    pub cidr_len: u8,
    /// Candidate rule ids, in the order the XDP program tries them.
    pub rules: RuleSet,
}

impl CompiledPrefix {
    /// The prefix as an [`IpNet`].
    pub fn net(&self) -> IpNet {
        let addr = u128::from_be_bytes(self.addr);
        if self.family == family::V4 {
            IpNet::V4(
                Ipv4Net::new(((addr >> 96) as u32).into(), self.cidr_len).expect("valid length"),
            )
        } else {
            IpNet::V6(Ipv6Net::new(addr.into(), self.cidr_len).expect("valid length"))
        }
    }

    /// The trie's `prefix_len` for this entry: the key's header bits plus the CIDR length.
    pub fn lpm_prefix_len(&self) -> u32 {
        PREFIX_KEY_HEADER_BITS + u32::from(self.cidr_len)
    }

    /// The trie key data under rule `generation`.
    pub fn key(&self, generation: u8) -> PrefixKey {
        PrefixKey {
            generation,
            family: self.family,
            addr: self.addr,
        }
    }

    /// The complete trie key (prefix length and data) under rule `generation`.
    pub fn lpm_key(&self, generation: u8) -> aya::maps::lpm_trie::Key<PrefixKey> {
        aya::maps::lpm_trie::Key::new(self.lpm_prefix_len(), self.key(generation))
    }

    /// The candidate ids, in order.
    pub fn candidates(&self) -> &[u32] {
        &self.rules.rules[..self.rules.len as usize]
    }
}

/// A compiled rule set: the rule records and the prefix trie entries, ready to be written whole.
///
/// The fields are public for reading; [`classify`](Self::classify) relies on an index built by
/// [`compile`], so do not modify them.
#[derive(Clone, Debug)]
pub struct CompiledRuleSet {
    /// The rules, in config order.
    pub rules: Vec<CompiledRule>,
    /// One entry per distinct source prefix, in (family, address, length) order.
    pub prefixes: Vec<CompiledPrefix>,
    /// [`RuleIds::version`] this set's ids were assigned against.
    ids_version: u64,
    /// (family, cidr_len, address bits) -> index in `prefixes`.
    prefix_index: HashMap<(u8, u8, u128), usize>,
    /// Prefix lengths present per family (IPv4, IPv6), longest first.
    lengths: [Vec<u8>; 2],
    /// Rule id -> index in `rules`.
    by_id: HashMap<u32, usize>,
}

impl CompiledRuleSet {
    /// The rule with id `id`.
    pub fn rule(&self, id: u32) -> Option<&CompiledRule> {
        self.by_id.get(&id).map(|&i| &self.rules[i])
    }

    /// The rule named `name`.
    #[must_use]
    pub fn by_name(&self, name: &str) -> Option<&CompiledRule> {
        self.rules.iter().find(|r| r.name == name)
    }

    /// The IPv4 table's words for this set (see [`v4_table`]), one per /16: the outcome of the
    /// trie's lookup and candidate walk where it is the same for every packet of the /16 (no
    /// prefix longer than /16 inside it, and its longest covering prefix's first candidate looks
    /// at no protocol, port or TCP flag), [`v4_table::TRIE`] elsewhere.
    ///
    /// Each prefix of /16 or shorter is written over the /16s it covers, shortest first, so at
    /// most 17 x 65,536 steps however many prefixes the set has (prefixes of one length do not
    /// overlap).
    #[must_use]
    pub fn v4_table(&self) -> Vec<u32> {
        let slots = v4_table::SLOTS as usize;
        // The longest covering prefix of /16 or shorter (index into `prefixes`), per /16.
        let mut covering: Vec<Option<usize>> = vec![None; slots];
        let mut longer_inside = vec![false; slots];
        // (length, first /16, index) of each prefix of /16 or shorter.
        let mut short = Vec::new();
        for (i, p) in self.prefixes.iter().enumerate() {
            if p.family != family::V4 {
                continue;
            }
            let hi = usize::from(u16::from_be_bytes([p.addr[0], p.addr[1]]));
            if p.cidr_len > 16 {
                longer_inside[hi] = true;
            } else {
                short.push((p.cidr_len, hi, i));
            }
        }
        short.sort_by_key(|&(len, ..)| len);
        for (len, hi, i) in short {
            let span = 1usize << (16 - len);
            let first = hi & !(span - 1);
            for c in &mut covering[first..first + span] {
                *c = Some(i);
            }
        }
        covering
            .iter()
            .zip(&longer_inside)
            .map(|(c, &longer)| {
                if longer {
                    return v4_table::TRIE;
                }
                let Some(i) = *c else {
                    return v4_table::direct(None);
                };
                let set = &self.prefixes[i].rules;
                let first = (set.len > 0)
                    .then(|| self.rule(set.rules[0]))
                    .flatten()
                    .map(|r| (r.id, r.rule));
                match first {
                    Some((id, r))
                        if r.protocol == 0
                            && r.dst_port == 0
                            && r.tcp_mask == 0
                            && r.tcp_flags == 0
                            && id < MAX_RULES =>
                    {
                        v4_table::direct(Some(id))
                    }
                    _ => v4_table::TRIE,
                }
            })
            .collect()
    }

    /// The trie entry the XDP program finds for source `src`: the longest rule prefix containing
    /// it, if any.
    pub fn lookup(&self, src: IpAddr) -> Option<&CompiledPrefix> {
        let (fam, bits) = addr_bits(src);
        let lengths = &self.lengths[usize::from(fam == family::V6)];
        lengths
            .iter()
            .find_map(|&len| self.prefix_index.get(&(fam, len, bits & mask(len))))
            .map(|&i| &self.prefixes[i])
    }

    /// The rule the XDP program applies to a packet from `src` with IP protocol number `protocol`
    /// and, for TCP/UDP packets whose header was readable, destination port `dst_port` (host
    /// order) and TCP flags byte `tcp_flags` (0 for other packets). `None`: no rule, the packet
    /// passes.
    pub fn classify(
        &self,
        src: IpAddr,
        protocol: u8,
        dst_port: Option<u16>,
        tcp_flags: u8,
    ) -> Option<&CompiledRule> {
        self.lookup(src)?
            .candidates()
            .iter()
            .map(|&id| self.rule(id).expect("candidate ids are rules"))
            .find(|r| {
                (r.rule.protocol == 0 || r.rule.protocol == protocol)
                    && (r.rule.dst_port == 0 || dst_port == Some(r.rule.dst_port))
                    && tcp_flags & r.rule.tcp_mask == r.rule.tcp_flags
            })
    }

    /// What the XDP program does with a packet from `src` whose protocol and port it cannot know:
    /// the prefix's first rule if none of its rules looks at them, else [`WithoutL4::Dependent`].
    pub fn classify_without_l4(&self, src: IpAddr) -> WithoutL4<'_> {
        let Some(prefix) = self.lookup(src) else {
            return WithoutL4::NoRule;
        };
        let rules: Vec<&CompiledRule> = prefix
            .candidates()
            .iter()
            .map(|&id| self.rule(id).expect("candidate ids are rules"))
            .collect();
        if rules
            .iter()
            .any(|r| r.rule.protocol != 0 || r.rule.dst_port != 0 || r.rule.tcp_mask != 0)
        {
            return WithoutL4::Dependent;
        }
        rules
            .first()
            .map_or(WithoutL4::NoRule, |r| WithoutL4::Rule(r))
    }

    /// What the XDP program does with a packet from `src` of IP protocol `protocol` whose port it
    /// cannot know (an IPv4 fragment whose first fragment it has not seen): rules of other
    /// protocols are passed over; the first rule left that fits whatever the port (and TCP
    /// flags) is the one, but [`WithoutL4::Dependent`] if a rule that looks at them comes first.
    pub fn classify_without_port(&self, src: IpAddr, protocol: u8) -> WithoutL4<'_> {
        let Some(prefix) = self.lookup(src) else {
            return WithoutL4::NoRule;
        };
        for &id in prefix.candidates() {
            let r = self.rule(id).expect("candidate ids are rules");
            if r.rule.protocol != 0 && r.rule.protocol != protocol {
                continue;
            }
            if r.rule.dst_port != 0 || r.rule.tcp_mask != 0 {
                return WithoutL4::Dependent;
            }
            return WithoutL4::Rule(r);
        }
        WithoutL4::NoRule
    }
}

/// How the XDP program classifies a packet from a source whose protocol and port it cannot know
/// (a tiny first fragment, an IPv6 header chain longer than it walks): see
/// [`CompiledRuleSet::classify_without_l4`].
#[derive(Clone, Copy, Debug)]
pub enum WithoutL4<'a> {
    /// No rule's prefix holds the source: passed.
    NoRule,
    /// No rule of the source's prefix looks at the protocol or port: this one applies.
    Rule(&'a CompiledRule),
    /// A rule of the source's prefix looks at the protocol or port: such packets are dropped
    /// (their shape would walk past it).
    Dependent,
}

/// Why a rule set cannot be compiled. Messages name the rules involved and their config lines.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompileError {
    /// A rule fails [`RuleConfig::validate`] (only possible for rules not parsed from a file).
    #[error("rule {name:?}{}: {error}", Line(*line))]
    InvalidRule {
        /// Rule name.
        name: String,
        /// Its config line.
        line: usize,
        /// What is wrong.
        #[source]
        error: RuleError,
    },
    /// Two rules have the same name.
    #[error(
        "rule {name:?}{}: duplicate name{}",
        Line(*line),
        if *first_line > 0 { format!(" (first used at line {first_line})") } else { String::new() }
    )]
    DuplicateName {
        /// The name.
        name: String,
        /// Line of the first rule with the name.
        first_line: usize,
        /// Line of the second.
        line: usize,
    },
    /// Two rules have the same source, protocol, port and TCP flags, so one of them could never
    /// apply.
    #[error(
        "rules {first:?}{} and {second:?}{} both match source {prefix}, protocol {protocol}{}{}: \
         one of them would never apply",
        Line(*first_line), Line(*second_line), dst_port.map(|p| format!(", dst_port {p}")).unwrap_or_default(),
        tcp_flags.map(|f| format!(", tcp_flags {f}")).unwrap_or_default()
    )]
    Conflict {
        /// First rule's name.
        first: String,
        /// First rule's line.
        first_line: usize,
        /// Second rule's name.
        second: String,
        /// Second rule's line.
        second_line: usize,
        /// The shared source prefix.
        prefix: IpNet,
        /// The shared protocol.
        protocol: Protocol,
        /// The shared port.
        dst_port: Option<u16>,
        /// The shared TCP flags.
        tcp_flags: Option<TcpFlags>,
    },
    /// A prefix would list more candidate rules than the XDP program scans.
    #[error(
        "sources in {prefix} could match {} rules, more than the {MAX_CANDIDATES} the XDP program \
         can try per packet: {}; give these rules fewer distinct protocol/port combinations",
        rules.len(), rules.iter().map(|(n, l)| format!("{n:?}{}", Line(*l))).collect::<Vec<_>>().join(", ")
    )]
    TooManyCandidates {
        /// The prefix.
        prefix: IpNet,
        /// Names and lines of the rules it would list, in precedence order.
        rules: Vec<(String, usize)>,
    },
    /// More distinct prefixes than one generation's half of the prefix trie holds.
    #[error(
        "{count} distinct source prefixes: at most {} fit (the trie holds two rule sets during a swap)",
        MAX_PREFIXES / 2
    )]
    TooManyPrefixes {
        /// Number of distinct prefixes.
        count: usize,
    },
    /// More rules than rule ids.
    #[error("{count} rules: at most {MAX_RULES} are supported")]
    TooManyRules {
        /// Number of rules.
        count: usize,
    },
    /// Not enough ids are free for the new and changed rules while the installed rules keep
    /// theirs until the swap.
    #[error(
        "{needed} new or changed rules need fresh ids but only {available} are free while the \
         {installed} installed rules keep theirs until the swap; apply the change in smaller steps"
    )]
    OutOfIds {
        /// Fresh ids needed.
        needed: usize,
        /// Fresh ids available.
        available: usize,
        /// Rules currently installed.
        installed: usize,
    },
    /// The installed rules given to [`RuleIds::from_installed`] are inconsistent.
    #[error("installed rule {name:?} (id {id}): {reason}")]
    BadInstalled {
        /// Rule name.
        name: String,
        /// Its id.
        id: u32,
        /// What is wrong.
        reason: String,
    },
    /// [`RuleIds::commit`] got a rule set compiled against an older state of the ids.
    #[error("the rule set was compiled before the last commit of rule ids; compile it again")]
    StaleCompile,
}

/// Formats " (line N)", or nothing for rules that did not come from a file.
struct Line(usize);

impl fmt::Display for Line {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            0 => Ok(()),
            n => write!(f, " (line {n})"),
        }
    }
}

/// Assigns stable rule ids across reloads.
///
/// A rule keeps its id while its name and [`Rule`] record are unchanged, so its buckets and
/// counters survive a reload. A new or changed rule gets an id the installed set does not use,
/// because during the swap the active generation still refers to the installed ids. The flow:
///
/// 1. [`compile`]`(&rules, &ids)`: assigns ids, changes nothing;
/// 2. the agent writes the fresh rules' records and the prefixes under the inactive generation,
///    flips the generation, and removes the old generation's prefixes;
/// 3. [`RuleIds::commit`]: the compiled set becomes the installed one; the ids of rules that
///    disappeared become free again (returned, so the agent can drop their buckets).
///
/// If step 2 fails, skip step 3: nothing changed. Freed ids are reused oldest first, after ids
/// never used, so a reused id's leftover state has had as long as possible to age out.
#[derive(Clone, Debug, Default)]
pub struct RuleIds {
    /// Installed rules: name -> (id, record).
    installed: HashMap<String, (u32, Rule)>,
    /// Ids at or above this were never handed out.
    next_unused: u32,
    /// Ids below `next_unused` not installed, in the order they were freed.
    free: VecDeque<u32>,
    /// Bumped by every commit.
    version: u64,
}

impl RuleIds {
    /// No rules installed.
    pub fn new() -> Self {
        Self::default()
    }

    /// Rebuilds the ids of an installed rule set (name, id, record), e.g. read back from the
    /// pinned maps by a restarted agent, so that unchanged rules keep their ids.
    pub fn from_installed(
        installed: impl IntoIterator<Item = (String, u32, Rule)>,
    ) -> Result<Self, CompileError> {
        let mut ids = Self::new();
        let mut used = HashSet::new();
        for (name, id, rule) in installed {
            let bad = |reason: &str| CompileError::BadInstalled {
                name: name.clone(),
                id,
                reason: reason.into(),
            };
            if id >= MAX_RULES {
                return Err(bad(&format!("id out of range (at most {})", MAX_RULES - 1)));
            }
            if !used.insert(id) {
                return Err(bad("id used by two rules"));
            }
            if ids.installed.contains_key(&name) {
                return Err(bad("name used by two rules"));
            }
            ids.next_unused = ids.next_unused.max(id + 1);
            // The bucket generation is the data plane's, not the rule's: compiled records carry
            // none, so an unchanged rule compares equal and keeps its id (and its buckets).
            let rule = Rule {
                bucket_gen: 0,
                ..rule
            };
            ids.installed.insert(name, (id, rule));
        }
        ids.free = (0..ids.next_unused)
            .filter(|id| !used.contains(id))
            .collect();
        Ok(ids)
    }

    /// The installed id of rule `name`.
    pub fn id_of(&self, name: &str) -> Option<u32> {
        self.installed.get(name).map(|&(id, _)| id)
    }

    /// Number of installed rules.
    pub fn len(&self) -> usize {
        self.installed.len()
    }

    /// Whether no rules are installed.
    pub fn is_empty(&self) -> bool {
        self.installed.is_empty()
    }

    /// Changes whenever [`commit`](Self::commit) succeeds.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// Ids not installed, in the order [`compile`] hands them out.
    fn fresh_ids(&self) -> impl Iterator<Item = u32> + '_ {
        (self.next_unused..MAX_RULES).chain(self.free.iter().copied())
    }

    /// Makes `compiled` the installed set (after the agent swapped it in). Returns the ids no
    /// longer used: their buckets and counters belong to rules that are gone.
    pub fn commit(&mut self, compiled: &CompiledRuleSet) -> Result<Vec<u32>, CompileError> {
        if compiled.ids_version != self.version {
            return Err(CompileError::StaleCompile);
        }
        let new_ids: HashSet<u32> = compiled.rules.iter().map(|r| r.id).collect();
        let mut freed: Vec<u32> = self
            .installed
            .values()
            .map(|&(id, _)| id)
            .filter(|id| !new_ids.contains(id))
            .collect();
        freed.sort_unstable();
        let fresh: HashSet<u32> = compiled
            .rules
            .iter()
            .filter(|r| r.fresh)
            .map(|r| r.id)
            .collect();
        self.free.retain(|id| !fresh.contains(id));
        let old_next = self.next_unused;
        self.next_unused = fresh.iter().map(|&id| id + 1).fold(old_next, u32::max);
        // Keeps free + installed + never-used a partition of all ids even if some id in the
        // newly passed range was skipped.
        self.free
            .extend((old_next..self.next_unused).filter(|id| !fresh.contains(id)));
        self.free.extend(freed.iter().copied());
        self.installed = compiled
            .rules
            .iter()
            .map(|r| (r.name.clone(), (r.id, r.rule)))
            .collect();
        self.version += 1;
        Ok(freed)
    }
}

/// Family tag and address bits, left-aligned (IPv4 in the top 32 bits), so that big-endian bytes
/// of the value are exactly a [`PrefixKey`] address.
fn addr_bits(addr: IpAddr) -> (u8, u128) {
    match addr {
        IpAddr::V4(a) => (family::V4, u128::from(u32::from(a)) << 96),
        IpAddr::V6(a) => (family::V6, u128::from(a)),
    }
}

/// `len` leading one bits.
fn mask(len: u8) -> u128 {
    match len {
        0 => 0,
        n => !0u128 << (128 - u32::from(n)),
    }
}

/// The IP protocol number of `protocol` for a rule whose sources are all IPv6 (`v6_only`) or
/// not (validation keeps `icmp` rules to one family).
fn ip_protocol(protocol: Protocol, v6_only: bool) -> u8 {
    match (protocol, v6_only) {
        (Protocol::Tcp, _) => 6,
        (Protocol::Udp, _) => 17,
        (Protocol::Icmp, false) => 1,
        (Protocol::Icmp, true) => 58,
        (Protocol::Any, _) => 0,
    }
}

/// The kernel record of a valid rule.
pub fn rule_record(r: &RuleConfig) -> Rule {
    let (has_v4, has_v6) = r.families();
    let mut rule = Rule {
        action: match r.action {
            Action::Limit => action::LIMIT,
            Action::Allow => action::ALLOW,
            Action::Deny => action::DENY,
        },
        protocol: ip_protocol(r.protocol, has_v6 && !has_v4),
        dst_port: r.dst_port.unwrap_or(0),
        flags: if r.dry_run { rule_flags::DRY_RUN } else { 0 },
        ..Rule::default()
    };
    if let Some(f) = r.tcp_flags {
        (rule.tcp_mask, rule.tcp_flags) = f.mask_value();
    }
    if r.action != Action::Limit {
        return rule;
    }
    let (first, mut coarse) = limit_record(
        (r.per, r.scope),
        (r.rate, r.burst),
        (r.bytes_rate, r.bytes_burst),
        has_v6,
    );
    rule.set_limit(0, first);
    for (k, l) in r.limits.iter().enumerate() {
        let (limit, c) = limit_record(
            (l.per, l.scope),
            (l.rate, l.burst),
            (l.bytes_rate, l.bytes_burst),
            has_v6,
        );
        coarse &= c;
        rule.set_limit(k + 1, limit);
    }
    if coarse {
        rule.flags |= rule_flags::COARSE_CLOCK;
        for l in &mut rule.extra[..r.limits.len()] {
            l.flags |= rule_flags::COARSE_CLOCK;
        }
    }
    // A `per = "rule"` packet limit gates the others: while its one bucket is empty, the program
    // drops the rule's packets from a per-CPU window before charging any other limit (a flood of
    // new sources then makes no bucket per source).
    let gate = (0..rule.limits()).find(|&k| {
        rule.limit(k)
            .is_some_and(|l| l.src_mask == [0; 4] && l.flags & rule_flags::PKT_LIMIT != 0)
    });
    if let Some(k) = gate {
        rule.flags |= rule_flags::gate(k as u32);
    }
    rule
}

/// The kernel form of one limit of a valid rule (whose sources include IPv6 ones if `has_v6`),
/// and whether its tolerances allow the coarse clock.
fn limit_record(
    (per, scope): (Per, Scope),
    (rate, burst): (Option<u64>, Option<u64>),
    (bytes_rate, bytes_burst): (Option<u64>, Option<u64>),
    has_v6: bool,
) -> (Limit, bool) {
    let mut l = Limit::default();
    let per_len = match per {
        // An IPv4 address fills the first word of the key and the rest is zero, so a rule
        // with IPv6 sources (IPv4 too or not) can mask every word.
        Per::Source if has_v6 => 128,
        Per::Source => 32,
        Per::Rule => 0,
        Per::Prefix(len) => len,
    };
    // Read as the XDP program reads the packet's address: 4-byte chunks in memory order.
    let mask_bytes = mask(per_len).to_be_bytes();
    for (word, chunk) in l.src_mask.iter_mut().zip(mask_bytes.chunks_exact(4)) {
        *word = u32::from_ne_bytes(chunk.try_into().expect("4 bytes"));
    }
    if scope == Scope::Cluster {
        l.flags |= rule_flags::CLUSTER;
    }
    // Validation bounds rate, burst and the refill time (one hour), so none of this overflows.
    let mut coarse = true;
    if let (Some(rate), Some(burst)) = (rate, burst) {
        l.flags |= rule_flags::PKT_LIMIT;
        // Rounded up: the effective rate is 1e9 / ceil(1e9 / rate), slightly below `rate` when
        // it does not divide 1e9 (by under 0.1% up to 1e6 packets/s), never above it (rounded
        // down, 30,000,000/s admitted 1% more over any interval).
        l.pkt_interval_ns = 1_000_000_000u64.div_ceil(rate);
        l.pkt_tolerance_ns = burst * l.pkt_interval_ns;
        coarse &= l.pkt_tolerance_ns >= COARSE_CLOCK_MIN_TOLERANCE_NS;
    }
    if let (Some(rate), Some(burst)) = (bytes_rate, bytes_burst) {
        l.flags |= rule_flags::BYTE_LIMIT;
        // Rounded up, as every byte cost is (`byte_cost_ns`): never above `bytes_rate`.
        l.byte_interval_fp = (NS_PER_SEC << 16).div_ceil(u128::from(rate)) as u64;
        l.byte_tolerance_ns = (u128::from(burst) * NS_PER_SEC / u128::from(rate)) as u64;
        coarse &= l.byte_tolerance_ns >= COARSE_CLOCK_MIN_TOLERANCE_NS;
    }
    let limits = l.flags & (rule_flags::PKT_LIMIT | rule_flags::BYTE_LIMIT) != 0;
    (l, coarse && limits)
}

/// A rule as a candidate: what the XDP program compares, and which rule it is.
#[derive(Clone, Copy)]
struct Candidate {
    index: usize,
    protocol: u8,
    port: u16,
    tcp_mask: u8,
    tcp_flags: u8,
}

impl Candidate {
    fn new(index: usize, rule: &Rule) -> Self {
        Self {
            index,
            protocol: rule.protocol,
            port: rule.dst_port,
            tcp_mask: rule.tcp_mask,
            tcp_flags: rule.tcp_flags,
        }
    }

    /// Whether every packet `other` matches is matched by `self` (so `other` after `self` is
    /// unreachable): `self`'s flag bits are a subset of `other`'s, with the same values.
    fn covers(&self, other: &Candidate) -> bool {
        (self.protocol == 0 || self.protocol == other.protocol)
            && (self.port == 0 || self.port == other.port)
            && self.tcp_mask & !other.tcp_mask == 0
            && other.tcp_flags & self.tcp_mask == self.tcp_flags
    }

    /// What the XDP program compares: two candidates of one prefix that agree on it conflict.
    fn matches_on(&self) -> (u8, u16, u8, u8) {
        (self.protocol, self.port, self.tcp_mask, self.tcp_flags)
    }

    /// Within one prefix: protocol+port+flags, protocol+port, protocol+flags, protocol, any.
    /// A port outranks flags: see the module docs.
    fn specificity_order(&self) -> (u8, u8, u16, u8, u8) {
        let class = match (self.protocol, self.port, self.tcp_mask) {
            (0, _, _) => 4,
            (_, 0, 0) => 3,
            (_, 0, _) => 2,
            (_, _, 0) => 1,
            _ => 0,
        };
        (
            class,
            self.protocol,
            self.port,
            self.tcp_mask,
            self.tcp_flags,
        )
    }
}

/// Compiles `rules` (validated, with defaults filled in) into rule records and prefix entries,
/// assigning ids against the installed set `ids`. Changes nothing in `ids`: see [`RuleIds`].
pub fn compile(rules: &[RuleConfig], ids: &RuleIds) -> Result<CompiledRuleSet, CompileError> {
    if rules.len() > MAX_RULES as usize {
        return Err(CompileError::TooManyRules { count: rules.len() });
    }
    let mut first_line: HashMap<&str, usize> = HashMap::with_capacity(rules.len());
    for r in rules {
        r.validate().map_err(|error| CompileError::InvalidRule {
            name: r.name.clone(),
            line: r.line,
            error,
        })?;
        if let Some(&first) = first_line.get(r.name.as_str()) {
            return Err(CompileError::DuplicateName {
                name: r.name.clone(),
                first_line: first,
                line: r.line,
            });
        }
        first_line.insert(&r.name, r.line);
    }
    let compiled = assign_ids(rules, ids)?;
    let sources: Vec<(IpNet, usize)> = rules
        .iter()
        .enumerate()
        .flat_map(|(i, r)| r.sources.iter().map(move |&net| (net, i)))
        .collect();
    let prefixes = build_prefixes(rules, &compiled, &sources)?;
    Ok(assemble(compiled, prefixes, ids.version))
}

/// Builds the prefix entries from (source prefix, index of its rule) pairs: any number of
/// prefixes per rule, and one prefix may be listed by several rules. O(n log n) in the pairs.
/// Pairs listed twice count once.
fn build_prefixes(
    rules: &[RuleConfig],
    compiled: &[CompiledRule],
    sources: &[(IpNet, usize)],
) -> Result<Vec<CompiledPrefix>, CompileError> {
    // Sorted in (family, address, length) order, the pairs of one prefix are adjacent, and an
    // enclosing prefix comes before every prefix it contains (its address is smaller or equal
    // and, if equal, its length shorter). That is a pre-order walk of the prefix tree, so a stack
    // of the enclosing prefixes gives each prefix its parent without searching.
    let mut keyed: Vec<((u8, u128, u8), usize)> = sources
        .iter()
        .map(|&(net, index)| {
            let (fam, bits) = addr_bits(net.network());
            (
                (fam, bits & mask(net.prefix_len()), net.prefix_len()),
                index,
            )
        })
        .collect();
    keyed.sort_unstable();
    keyed.dedup();

    let mut prefixes: Vec<CompiledPrefix> = Vec::new();
    let mut lists: Vec<Vec<Candidate>> = Vec::new();
    // Indices into `prefixes` of the prefixes enclosing the current one, innermost last.
    let mut stack: Vec<usize> = Vec::new();
    for group in keyed.chunk_by(|a, b| a.0 == b.0) {
        let (fam, bits, len) = group[0].0;
        let mut list: Vec<Candidate> = group
            .iter()
            .map(|&(_, index)| Candidate::new(index, &compiled[index].rule))
            .collect();
        list.sort_unstable_by_key(|c| (c.specificity_order(), c.index));
        if let Some(pair) = list
            .windows(2)
            .find(|w| w[0].matches_on() == w[1].matches_on())
        {
            let (a, b) = (&rules[pair[0].index], &rules[pair[1].index]);
            return Err(CompileError::Conflict {
                first: a.name.clone(),
                first_line: a.line,
                second: b.name.clone(),
                second_line: b.line,
                prefix: key_net(fam, bits, len),
                protocol: a.protocol,
                dst_port: a.dst_port,
                tcp_flags: a.tcp_flags,
            });
        }

        while let Some(&top) = stack.last() {
            let p = &prefixes[top];
            if p.family == fam
                && p.cidr_len < len
                && bits & mask(p.cidr_len) == u128::from_be_bytes(p.addr)
            {
                break;
            }
            stack.pop();
        }
        if let Some(&parent) = stack.last() {
            for inherited in &lists[parent] {
                if !list.iter().any(|c| c.covers(inherited)) {
                    list.push(*inherited);
                }
            }
        }
        if list.len() > MAX_CANDIDATES {
            return Err(CompileError::TooManyCandidates {
                prefix: key_net(fam, bits, len),
                rules: list
                    .iter()
                    .map(|c| (compiled[c.index].name.clone(), compiled[c.index].line))
                    .collect(),
            });
        }
        let mut set = RuleSet {
            len: list.len() as u32,
            ..RuleSet::default()
        };
        for (slot, c) in set.rules.iter_mut().zip(&list) {
            *slot = compiled[c.index].id;
        }
        stack.push(prefixes.len());
        prefixes.push(CompiledPrefix {
            family: fam,
            addr: bits.to_be_bytes(),
            cidr_len: len,
            rules: set,
        });
        lists.push(list);
    }
    if prefixes.len() > MAX_PREFIXES as usize / 2 {
        return Err(CompileError::TooManyPrefixes {
            count: prefixes.len(),
        });
    }
    Ok(prefixes)
}

fn key_net(fam: u8, bits: u128, len: u8) -> IpNet {
    CompiledPrefix {
        family: fam,
        addr: bits.to_be_bytes(),
        cidr_len: len,
        rules: RuleSet::default(),
    }
    .net()
}

/// Builds the lookup indexes `classify` uses.
fn assemble(
    rules: Vec<CompiledRule>,
    prefixes: Vec<CompiledPrefix>,
    ids_version: u64,
) -> CompiledRuleSet {
    let by_id = rules.iter().enumerate().map(|(i, r)| (r.id, i)).collect();
    let mut prefix_index = HashMap::with_capacity(prefixes.len());
    let mut lengths: [Vec<u8>; 2] = Default::default();
    for (i, p) in prefixes.iter().enumerate() {
        prefix_index.insert((p.family, p.cidr_len, u128::from_be_bytes(p.addr)), i);
        lengths[usize::from(p.family == family::V6)].push(p.cidr_len);
    }
    for l in &mut lengths {
        l.sort_unstable_by(|a, b| b.cmp(a));
        l.dedup();
    }
    CompiledRuleSet {
        rules,
        prefixes,
        ids_version,
        prefix_index,
        lengths,
        by_id,
    }
}

/// Keeps the installed id of every rule whose name and record are unchanged; gives the others
/// fresh ids that the installed set does not use.
fn assign_ids(rules: &[RuleConfig], ids: &RuleIds) -> Result<Vec<CompiledRule>, CompileError> {
    let records: Vec<Rule> = rules.iter().map(rule_record).collect();
    let kept: Vec<Option<u32>> = rules
        .iter()
        .zip(&records)
        .map(|(r, rec)| match ids.installed.get(&r.name) {
            Some(&(id, installed)) if installed == *rec => Some(id),
            _ => None,
        })
        .collect();
    let needed = kept.iter().filter(|k| k.is_none()).count();
    let mut fresh = ids.fresh_ids();
    let mut out = Vec::with_capacity(rules.len());
    for ((r, rule), kept) in rules.iter().zip(records).zip(kept) {
        let (id, is_fresh) = match kept {
            Some(id) => (id, false),
            None => {
                let id = fresh.next().ok_or(CompileError::OutOfIds {
                    needed,
                    available: ids.fresh_ids().count(),
                    installed: ids.installed.len(),
                })?;
                (id, true)
            }
        };
        out.push(CompiledRule {
            name: r.name.clone(),
            id,
            rule,
            sources: r.sources.clone(),
            line: r.line,
            fresh: is_fresh,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
