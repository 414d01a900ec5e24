//! The compiled rule set: the rule records and prefix trie entries the agent writes, and the
//! user-space replay of the XDP program's lookup over them ([`CompiledRuleSet::classify`]).
//! Its own room because every reader of a rule set (the agent, `explain`, `top`, the cluster
//! sync) uses these types, while only [`compile`](super::compile) builds them.

use std::{collections::HashMap, net::IpAddr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use ratelimit_common::{
    family, v4_table, PrefixKey, Rule, RuleSet, MAX_RULES, PREFIX_KEY_HEADER_BITS,
};

use super::{addr_bits, mask};

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
/// [`compile`](super::compile), so do not modify them.
#[derive(Clone, Debug)]
pub struct CompiledRuleSet {
    /// The rules, in config order.
    pub rules: Vec<CompiledRule>,
    /// One entry per distinct source prefix, in (family, address, length) order.
    pub prefixes: Vec<CompiledPrefix>,
    /// [`RuleIds::version`](super::RuleIds::version) this set's ids were assigned against.
    pub(super) ids_version: u64,
    /// (family, cidr_len, address bits) -> index in `prefixes`.
    pub(super) prefix_index: HashMap<(u8, u8, u128), usize>,
    /// Prefix lengths present per family (IPv4, IPv6), longest first.
    pub(super) lengths: [Vec<u8>; 2],
    /// Rule id -> index in `rules`.
    pub(super) by_id: HashMap<u32, usize>,
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
