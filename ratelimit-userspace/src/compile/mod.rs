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
//!
//! # Layout
//! - `compiled.rs`: the output ([`CompiledRuleSet`] and its parts) and the user-space replay of
//!   the XDP program's lookup ([`CompiledRuleSet::classify`]).
//! - `record.rs`: one rule's kernel [`Rule`] record and its limits ([`rule_record`]).
//! - `prefixes.rs`: the prefix trie entries: each prefix's ordered candidate list.
//! - `ids.rs`: [`RuleIds`], the rule ids kept stable across reloads.
//! - `error.rs`: [`CompileError`].
//!
//! This file holds [`compile`] itself, which runs those stages in order.
//!
//! [`RuleSet`]: ratelimit_common::RuleSet

mod compiled;
mod error;
mod ids;
mod prefixes;
mod record;
pub use record::coarse_lag_ns;

use std::{collections::HashMap, net::IpAddr};

use ipnet::IpNet;
use ratelimit_common::{family, Rule, MAX_RULES};

use self::prefixes::build_prefixes;
pub use self::{
    compiled::{CompiledPrefix, CompiledRule, CompiledRuleSet, WithoutL4},
    error::CompileError,
    ids::RuleIds,
    record::rule_record,
};
use crate::config::RuleConfig;

// The unit tests (`tests.rs`) reach the kernel types and the config's enums through `super::*`.
#[cfg(test)]
use {
    crate::config::{Action, Per, Protocol, Scope, TcpFlags},
    ipnet::{Ipv4Net, Ipv6Net},
    ratelimit_common::{
        action, rule_flags, v4_table, PrefixKey, MAX_PREFIXES, PREFIX_KEY_HEADER_BITS,
    },
    std::collections::HashSet,
};

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

/// Family tag and address bits, left-aligned (IPv4 in the top 32 bits), so that big-endian bytes
/// of the value are exactly a [`PrefixKey`](ratelimit_common::PrefixKey) address.
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

#[cfg(test)]
mod tests;
