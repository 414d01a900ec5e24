//! Finding many keys' buckets in one go: the config's seed and sets, and each rule's record,
//! read once for all of them rather than once a key. [`PinnedMaps::locate_bucket`] reads them
//! for its one key: two to four map lookups (system calls) a key, and a cluster round locates
//! each of its up to `max_keys` keys twice (its reading, its share); under a flood of new keys
//! that was most of a debug agent's round.
//!
//! A rule reinstalled while a locator lives is seen as it was when the locator first read it:
//! the same as a key located a moment earlier. A locator lives for one pass.

use std::{cell::RefCell, collections::HashMap};

use ratelimit_common::{map_names, Bucket, BucketKey, Rule, MAX_RULES};

use super::{store::Slot, MapsError, PinnedMaps, Result};

/// The config and the rules' records, read once, for locating buckets (see the module docs).
pub struct Locator<'a> {
    maps: &'a PinnedMaps,
    seed: [u64; 2],
    sets: u32,
    /// Each rule id's record as first read (`None`: unreadable, as a free id).
    rules: RefCell<HashMap<u32, Option<Rule>>>,
}

impl<'a> Locator<'a> {
    /// A locator over `maps`, reading the config now.
    pub fn new(maps: &'a PinnedMaps) -> Result<Self> {
        let config = maps.config()?;
        Ok(Self {
            maps,
            seed: config.seed,
            sets: config.bucket_sets,
            rules: RefCell::new(HashMap::new()),
        })
    }

    /// The maps it reads.
    #[must_use]
    pub fn maps(&self) -> &'a PinnedMaps {
        self.maps
    }

    /// Rule `id`'s record, read at its first use.
    fn rule(&self, id: u32) -> Option<Rule> {
        *self
            .rules
            .borrow_mut()
            .entry(id)
            .or_insert_with(|| (id < MAX_RULES).then(|| self.maps.rule(id).ok()).flatten())
    }

    /// Where the bucket under `key` is (or would go) at `now`, with the generation of its rule
    /// in force (0 if the id is free: nothing is found): see [`PinnedMaps::locate_bucket`].
    pub fn locate(&self, key: &BucketKey, now: u64) -> Result<(Slot, u32)> {
        let (id, _) = ratelimit_common::split_bucket_rule(key.rule);
        if key.rule > 0xffff || id >= MAX_RULES {
            return Ok((Slot::Busy, 0));
        }
        let gen = self
            .rule(id)
            .ok_or_else(|| MapsError::Op {
                map: map_names::RULES,
                reason: format!("rule record {id} could not be read"),
            })?
            .bucket_gen;
        let slot = self
            .maps
            .store()
            .locate(self.seed, self.sets, key, gen, now, |rule| {
                self.rule(ratelimit_common::split_bucket_rule(rule).0)
            });
        Ok((slot, gen))
    }

    /// The bucket under `key`, if tracked.
    pub fn bucket(&self, key: &BucketKey) -> Result<Option<Bucket>> {
        match self.locate(key, 0)? {
            (Slot::Found(i), gen) if gen != 0 => Ok(Some(self.maps.store().get(i))),
            _ => Ok(None),
        }
    }
}
