//! The prefix trie entries: for each distinct rule prefix, the candidate rules in the order the
//! XDP program walks them (see the module docs of [`crate::compile`]). Its own room because the
//! ordering, the inheritance from enclosing prefixes and the conflict checks are one algorithm.

use ipnet::IpNet;
use ratelimit_common::{Rule, RuleSet, MAX_CANDIDATES, MAX_PREFIXES};

use super::{addr_bits, mask, CompileError, CompiledPrefix, CompiledRule};
use crate::config::RuleConfig;

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

/// Builds the prefix entries from (source prefix, index of its rule) pairs: any number of
/// prefixes per rule, and one prefix may be listed by several rules. O(n log n) in the pairs.
/// Pairs listed twice count once.
pub(super) fn build_prefixes(
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
