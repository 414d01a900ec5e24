//! [`RuleIds`]: the rule ids kept stable across reloads, and the two-phase swap that hands out
//! fresh ones. Its own room because it outlives every compiled set: the agent keeps one for its
//! whole run, while a [`CompiledRuleSet`] lasts one reload.

use std::collections::{HashMap, HashSet, VecDeque};

use ratelimit_common::{Rule, MAX_RULES};

use super::{CompileError, CompiledRuleSet};

/// Assigns stable rule ids across reloads.
///
/// A rule keeps its id while its name and [`Rule`] record are unchanged, so its buckets and
/// counters survive a reload. A new or changed rule gets an id the installed set does not use,
/// because during the swap the active generation still refers to the installed ids. The flow:
///
/// 1. [`compile`](super::compile)`(&rules, &ids)`: assigns ids, changes nothing;
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
    pub(super) installed: HashMap<String, (u32, Rule)>,
    /// Ids at or above this were never handed out.
    next_unused: u32,
    /// Ids below `next_unused` not installed, in the order they were freed.
    free: VecDeque<u32>,
    /// Bumped by every commit.
    pub(super) version: u64,
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

    /// Ids not installed, in the order [`compile`](super::compile) hands them out.
    pub(super) fn fresh_ids(&self) -> impl Iterator<Item = u32> + '_ {
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
