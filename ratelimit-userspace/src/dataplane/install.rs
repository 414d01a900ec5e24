//! Installing a rule set: the rule records, then the inactive generation of the prefix trie and
//! its half of the IPv4 table, the switch to it with one word, and, once no packet can still read
//! it, the other generation brought to the same set and the ids of removed rules retired. What was
//! written is kept in memory ([`IdSet`], [`Written`], the [`MirrorKey`] list), so that an install
//! writes only what changed ([`PrefixDiff`]).

use std::{thread, time::Duration};

use ratelimit_common::{
    action, config_flags, global, map_names, prefix_generation, PrefixKey, Rule, RuleSet, MAX_RULES,
};

use super::{Dataplane, Result};
use crate::{compile::CompiledRuleSet, maps::MapsError};

/// How long to wait after a generation flip before deleting the old generation: XDP programs run
/// under RCU, so any packet that read the old generation number has finished well within this.
const GRACE: Duration = Duration::from_millis(20);

impl Dataplane {
    /// Makes `rules`/`prefixes` the rule set in force, atomically: written under the inactive
    /// generation, then switched to with one word. Buckets of rules that left the set go stale
    /// (their generation ends), so their ids can be reused with a clean slate; buckets of rules
    /// that stayed keep their level.
    ///
    /// Both generations hold the set in force between installs (the old one is brought up to
    /// the new set after the switch), so an install writes only what changed: a change of one
    /// rule among 10,000 is a few map writes and the grace period, not the whole set twice. What
    /// was written is kept in memory (records by id, the prefixes as one sorted list), so
    /// finding the change costs a comparison per rule and per prefix, no map read.
    ///
    /// When the program counted an internal error since the last install (a prefix naming a
    /// rule id without a record: a state the agent never writes), nothing written is trusted:
    /// every rule record and both generations of the trie are written again, which repairs
    /// whatever was overwritten.
    pub fn install(&mut self, set: &CompiledRuleSet) -> Result<()> {
        // Before anything is written: an id the rule map has no record for fails the install
        // here, not half-way (the compiler never assigns one).
        if let Some(r) = set.rules.iter().find(|r| r.id >= MAX_RULES) {
            return Err(MapsError::Op {
                map: map_names::RULES,
                reason: format!(
                    "rule {:?} has id {}, beyond the last ({})",
                    r.name,
                    r.id,
                    MAX_RULES - 1
                ),
            }
            .into());
        }
        let internal = self.maps.global_stats()?.counters[global::INTERNAL];
        if self
            .internal_at_install
            .is_some_and(|seen| seen != internal)
        {
            tracing::warn!(
                internal,
                "the XDP program counted internal errors since the last install: rewriting every \
                 rule record and prefix"
            );
            self.records.clear();
            self.mirror = None;
        }
        let config = self.maps.config()?;
        // A new epoch (it keys the XDP program's classification cache); its low bit is the
        // inactive half of the prefix trie.
        let epoch = config.generation.wrapping_add(1);
        let next = prefix_generation(epoch);
        let new_ids = IdSet::from_ids(set.rules.iter().map(|r| r.id));

        // 1. Rule records. An id in force keeps its content (a changed rule gets a new id), so
        //    rewriting it changes nothing a packet can see; a new id starts with zeroed counters
        //    and a new bucket generation (the epoch being installed: unique, never 0), so no
        //    bucket of the id's last rule counts for it. A record known to hold what it should
        //    (an unchanged rule) is not touched: it costs a comparison, no map access.
        self.write_records(set, epoch)?;
        // 2. The inactive generation: brought from the set both generations hold to the new one
        //    by writing the difference (or, not known, cleared of whatever it holds, say a crash
        //    mid-install's, and filled). The difference is worked out once, for both.
        let new = mirror_of(set);
        let old = self.mirror.take();
        let diff = old.as_deref().map(|old| PrefixDiff::between(old, &new));
        let table = set.v4_table();
        self.write_generation(next, diff.as_ref(), &new, &table)?;
        // 3. The switch, with whether a rule that can drop is in force (a frame in more VLAN
        //    tags than the program walks is dropped only then: `global::DROPPED_VLAN_CHAINS`).
        let dropping = set.rules.iter().any(|r| r.rule.action != action::ALLOW);
        self.maps.update_config(|c| {
            c.generation = epoch;
            c.flags = with_dropping_rules(c.flags, dropping);
        })?;
        // From here on the new set is in force, whatever fails below: the install is done (the
        // agent reports the new rules), and what is left undone is finished by the next install
        // (the other half, unknown, is cleared and written whole; ids not yet retired stay live
        // until they are). A failure is logged, naming what is left.
        match self.after_switch(next, diff.as_ref(), new, &table, new_ids) {
            Ok(()) => {
                // Only once it all was written: an install that failed half-way repairs next
                // time.
                self.internal_at_install = Some(internal);
            }
            Err(e) => tracing::warn!(
                error = %e,
                "the new rules are in force, but bringing the other half of the prefix table \
                 to them, or retiring the ids of removed rules, failed; the next install \
                 finishes it"
            ),
        }
        Ok(())
    }

    /// [`Self::install`]'s step 1: writes the rule records of `set` (and their names and lines)
    /// that are not known to hold what they should; `epoch` is the bucket generation of an id
    /// new to the set in force.
    fn write_records(&mut self, set: &CompiledRuleSet, epoch: u32) -> Result<()> {
        for r in &set.rules {
            let line = u32::try_from(r.line).unwrap_or(0);
            // A fresh rule (an id the agent hands out anew) starts clean even if the id was not
            // retired yet (a retirement that failed after a switch): never another rule's
            // buckets or counters.
            let live = self.live_ids.contains(r.id) && !r.fresh;
            let known = written(&self.records, r.id).filter(|_| live);
            let mut record = r.rule;
            record.bucket_gen = match known {
                Some(k) => k.rule.bucket_gen,
                None if live => self.maps.rule(r.id)?.bucket_gen,
                None => 0,
            };
            if record.bucket_gen == 0 {
                record.bucket_gen = epoch.max(1);
            }
            let (same_record, same_meta) = known.map_or((false, false), |k| {
                (k.rule == record, k.name == r.name && k.line == line)
            });
            if same_record && same_meta {
                continue;
            }
            if !live {
                self.maps.reset_rule_stats(r.id)?;
            }
            // Forgotten first: a write that fails leaves the record unknown, rewritten next time.
            remember(&mut self.records, r.id, None);
            if !same_record {
                self.maps.set_rule(r.id, record)?;
            }
            if !same_meta {
                self.maps.set_rule_meta(r.id, Some((&r.name, line)))?;
            }
            remember(
                &mut self.records,
                r.id,
                Some(Written {
                    rule: record,
                    name: r.name.clone(),
                    line,
                }),
            );
        }
        Ok(())
    }

    /// [`Self::install`]'s steps after the switch to generation `next`: once no packet can still
    /// be reading the other generation, brings it to the new set too (`new`, from `diff` if
    /// known), then retires the ids of rules that left the set (`new_ids` the set's).
    fn after_switch(
        &mut self,
        next: u8,
        diff: Option<&PrefixDiff>,
        new: Vec<(MirrorKey, RuleSet)>,
        table: &[u32],
        new_ids: IdSet,
    ) -> Result<()> {
        thread::sleep(GRACE);
        fail::fail_point!("dataplane-after-switch", |_| Err(MapsError::Op {
            map: map_names::PREFIXES,
            reason: "failpoint dataplane-after-switch".into(),
        }
        .into()));
        self.write_generation(1 - next, diff, &new, table)?;
        self.mirror = Some(new);
        // Rules that left the set: their buckets go stale with their generation (readers ignore
        // them, the program recycles their records), so nothing is walked or deleted. An id stays
        // live until it is retired, so a failure here is retried by the next install.
        let gone: Vec<u32> = self
            .live_ids
            .iter()
            .filter(|&id| !new_ids.contains(id))
            .collect();
        let mut live = new_ids;
        for (i, &id) in gone.iter().enumerate() {
            if let Err(e) = self.retire(id) {
                for &left in &gone[i..] {
                    live.insert(left);
                }
                self.live_ids = live;
                return Err(e);
            }
        }
        self.live_ids = live;
        Ok(())
    }

    /// Retires rule id `id` (its rule left the set): no name, bucket generation 0.
    fn retire(&mut self, id: u32) -> Result<()> {
        let rule = match self.records.get_mut(id as usize).and_then(Option::take) {
            Some(w) => w.rule,
            None => self.maps.rule(id)?,
        };
        fail::fail_point!("dataplane-retire", |_| Err(MapsError::Op {
            map: map_names::RULES,
            reason: "failpoint dataplane-retire".into(),
        }
        .into()));
        self.maps.set_rule_meta(id, None)?;
        self.maps.set_rule(
            id,
            ratelimit_common::Rule {
                bucket_gen: 0,
                ..rule
            },
        )?;
        Ok(())
    }

    /// Makes `generation` of the prefix trie hold exactly `new`: from the set both generations
    /// held by writing `diff`, removals first so it never holds more than the larger set; from
    /// unknown contents (`None`) by clearing it and writing every entry. Then that half of the
    /// IPv4 table holds `table` (`CompiledRuleSet::v4_table`; compared word by word, in memory).
    fn write_generation(
        &mut self,
        generation: u8,
        diff: Option<&PrefixDiff>,
        new: &[(MirrorKey, RuleSet)],
        table: &[u32],
    ) -> Result<()> {
        match diff {
            Some(diff) => {
                let gone: Vec<_> = diff.gone.iter().map(|k| k.at(generation)).collect();
                self.maps.remove_prefixes(&gone)?;
                for (k, rules) in &diff.set {
                    let (key, len) = k.at(generation);
                    self.maps.insert_prefix(key, len, *rules)?;
                }
            }
            None => {
                self.maps.clear_generation(generation)?;
                for (k, rules) in new {
                    let (key, len) = k.at(generation);
                    self.maps.insert_prefix(key, len, *rules)?;
                }
            }
        }
        self.maps.v4_table().write_half(generation, table);
        Ok(())
    }

    /// Sets the global [`ratelimit_common::config_flags`] the agent's settings decide; whether a
    /// rule that can drop is in force ([`config_flags::DROPPING_RULES`]) goes with the rule set
    /// installed, and is kept.
    pub fn set_flags(&mut self, flags: u32) -> Result<()> {
        self.maps.update_config(|c| {
            c.flags = with_dropping_rules(flags, c.flags & config_flags::DROPPING_RULES != 0);
        })?;
        Ok(())
    }
}

/// `flags` with [`config_flags::DROPPING_RULES`] set to `dropping`.
fn with_dropping_rules(flags: u32, dropping: bool) -> u32 {
    if dropping {
        flags | config_flags::DROPPING_RULES
    } else {
        flags & !config_flags::DROPPING_RULES
    }
}

/// What the data plane wrote to a rule record and its name.
pub(super) struct Written {
    /// The record, with its bucket generation.
    rule: Rule,
    /// The rule's name.
    name: String,
    /// The rule's config line.
    line: u32,
}

/// What `records` knows was written for rule `id`.
fn written(records: &[Option<Written>], id: u32) -> Option<&Written> {
    records.get(id as usize).and_then(Option::as_ref)
}

/// Sets (or, `None`, forgets) what `records` knows was written for rule `id` (< [`MAX_RULES`]).
fn remember(records: &mut Vec<Option<Written>>, id: u32, what: Option<Written>) {
    let i = id as usize;
    if i >= records.len() {
        if what.is_none() {
            return;
        }
        records.resize_with(i + 1, || None);
    }
    records[i] = what;
}

/// A set of rule ids (< [`MAX_RULES`]): one bit each.
#[derive(Clone, Debug)]
pub(super) struct IdSet(Vec<u64>);

impl IdSet {
    pub(super) fn from_ids(ids: impl IntoIterator<Item = u32>) -> Self {
        let mut bits = vec![0u64; MAX_RULES.div_ceil(64) as usize];
        for id in ids {
            if id < MAX_RULES {
                bits[(id / 64) as usize] |= 1 << (id % 64);
            }
        }
        Self(bits)
    }

    fn contains(&self, id: u32) -> bool {
        self.0
            .get((id / 64) as usize)
            .is_some_and(|w| w & (1 << (id % 64)) != 0)
    }

    fn insert(&mut self, id: u32) {
        if let Some(w) = self.0.get_mut((id / 64) as usize) {
            *w |= 1 << (id % 64);
        }
    }

    fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        (0..MAX_RULES).filter(|&id| self.contains(id))
    }
}

/// A prefix trie entry's key apart from its generation: what both generations hold alike.
/// Ordered by family, address and length.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct MirrorKey {
    family: u8,
    addr: [u8; 16],
    /// The LPM prefix length (header bits included).
    prefix_len: u32,
}

impl MirrorKey {
    /// The trie key (data, LPM prefix length) under `generation`.
    fn at(self, generation: u8) -> (PrefixKey, u32) {
        (
            PrefixKey {
                generation,
                family: self.family,
                addr: self.addr,
            },
            self.prefix_len,
        )
    }
}

/// The prefix entries of `set` as both generations hold them, sorted by key; a key given twice
/// holds the later entry's rules, as the trie would after writing both.
fn mirror_of(set: &CompiledRuleSet) -> Vec<(MirrorKey, RuleSet)> {
    let mut entries: Vec<(MirrorKey, RuleSet)> = set
        .prefixes
        .iter()
        .map(|p| {
            let key = MirrorKey {
                family: p.family,
                addr: p.addr,
                prefix_len: p.lpm_prefix_len(),
            };
            (key, p.rules)
        })
        .collect();
    // The compiler hands them over in this order already: the check is one pass.
    if !entries.is_sorted_by_key(|e| e.0) {
        entries.sort_by_key(|e| e.0);
    }
    entries.dedup_by(|later, earlier| {
        let same = later.0 == earlier.0;
        if same {
            earlier.1 = later.1;
        }
        same
    });
    entries
}

/// What turns one set of prefix entries into another: one merge of the two sorted lists, so a
/// change of one prefix among many costs a comparison per entry and a map write for that one.
#[derive(Debug, Default, PartialEq, Eq)]
struct PrefixDiff {
    /// Keys of the old set that the new one lacks.
    gone: Vec<MirrorKey>,
    /// Entries of the new set that the old one lacks or holds with other rules.
    set: Vec<(MirrorKey, RuleSet)>,
}

impl PrefixDiff {
    /// From `old` to `new`, both sorted by key without repeats (see [`mirror_of`]).
    fn between(old: &[(MirrorKey, RuleSet)], new: &[(MirrorKey, RuleSet)]) -> Self {
        use std::cmp::Ordering;
        let mut diff = Self::default();
        let (mut o, mut n) = (old.iter().peekable(), new.iter().peekable());
        loop {
            match (o.peek(), n.peek()) {
                (Some(a), Some(b)) => match a.0.cmp(&b.0) {
                    Ordering::Less => {
                        diff.gone.push(a.0);
                        o.next();
                    }
                    Ordering::Greater => {
                        diff.set.push(**b);
                        n.next();
                    }
                    Ordering::Equal => {
                        if a.1 != b.1 {
                            diff.set.push(**b);
                        }
                        o.next();
                        n.next();
                    }
                },
                (Some(a), None) => {
                    diff.gone.push(a.0);
                    o.next();
                }
                (None, Some(b)) => {
                    diff.set.push(**b);
                    n.next();
                }
                (None, None) => return diff,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u8) -> MirrorKey {
        MirrorKey {
            family: 4,
            addr: [10, i, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            prefix_len: 32,
        }
    }

    fn rules(ids: &[u32]) -> RuleSet {
        let mut set = RuleSet {
            len: u32::try_from(ids.len()).unwrap(),
            ..RuleSet::default()
        };
        set.rules[..ids.len()].copy_from_slice(ids);
        set
    }

    #[test]
    fn a_prefix_diff_holds_what_changed_and_nothing_else() {
        // Deterministic draws: each of 40 keys absent, or present with one of 3 rule sets, in
        // an old and a new set.
        let mut x = 0x9e37_79b9_7f4a_7c15_u64;
        let mut draw = || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % 4
        };
        for _ in 0..200 {
            let mut old = Vec::new();
            let mut new = Vec::new();
            for i in 0..40 {
                for list in [&mut old, &mut new] {
                    match draw() {
                        0 => {}
                        v => list.push((key(i), rules(&[u32::try_from(v).unwrap()]))),
                    }
                }
            }
            let diff = PrefixDiff::between(&old, &new);
            let old_map: std::collections::BTreeMap<_, _> = old.iter().copied().collect();
            let new_map: std::collections::BTreeMap<_, _> = new.iter().copied().collect();
            let gone: Vec<_> = old_map
                .keys()
                .filter(|k| !new_map.contains_key(*k))
                .copied()
                .collect();
            let set: Vec<_> = new
                .iter()
                .filter(|(k, r)| old_map.get(k) != Some(r))
                .copied()
                .collect();
            assert_eq!(diff, PrefixDiff { gone, set });
            // Applied to the old set, it gives the new one.
            let mut applied = old_map.clone();
            for k in &diff.gone {
                applied.remove(k);
            }
            applied.extend(diff.set.iter().copied());
            assert_eq!(applied, new_map);
        }
        assert_eq!(
            PrefixDiff::between(&[(key(1), rules(&[1]))], &[(key(1), rules(&[1]))]),
            PrefixDiff::default()
        );
    }

    #[test]
    fn the_mirror_is_sorted_and_a_repeated_prefix_holds_its_last_rules() {
        use crate::config::RuleConfig;
        let config: Vec<RuleConfig> =
            ["10.2.0.0/16", "10.1.0.0/16", "2001:db8::/32", "10.1.0.0/24"]
                .iter()
                .enumerate()
                .map(|(i, net)| RuleConfig {
                    rate: Some(100),
                    burst: Some(100),
                    ..RuleConfig::new(format!("r{i}"), net.parse().unwrap())
                })
                .collect();
        let mut set = crate::compile::compile(&config, &crate::compile::RuleIds::new()).unwrap();
        let sorted = mirror_of(&set);
        assert_eq!(sorted.len(), 4);
        assert!(sorted.windows(2).all(|w| w[0].0 < w[1].0));
        // Handed over out of order and with a prefix twice: the same, the later entry's rules.
        set.prefixes.reverse();
        let mut again = set.prefixes[0].clone();
        again.rules = rules(&[7]);
        set.prefixes.push(again.clone());
        let mirror = mirror_of(&set);
        assert_eq!(mirror.len(), 4);
        assert!(mirror.windows(2).all(|w| w[0].0 < w[1].0));
        let held = mirror
            .iter()
            .find(|(k, _)| k.addr == again.addr && k.prefix_len == again.lpm_prefix_len())
            .unwrap();
        assert_eq!(held.1, rules(&[7]));
    }

    #[test]
    fn an_id_set_holds_exactly_its_ids() {
        let ids = IdSet::from_ids([0, 63, 64, 700, MAX_RULES - 1]);
        assert_eq!(
            ids.iter().collect::<Vec<_>>(),
            [0, 63, 64, 700, MAX_RULES - 1]
        );
        assert!(!ids.contains(1) && !ids.contains(MAX_RULES) && !ids.contains(u32::MAX));
        assert_eq!(IdSet::from_ids([]).iter().count(), 0);
    }
}
