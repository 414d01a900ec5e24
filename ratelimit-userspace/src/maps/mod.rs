//! Typed access to the limiter's pinned maps.
//!
//! Everything user space does with the maps (install rules, read counters, list buckets) goes
//! through the files pinned under the pin directory, so the agent and a CLI reading the same
//! directory see the same state, and a restarted agent picks up where the last one stopped.
//!
//! - this file: [`PinnedMaps`], one typed handle per pinned map (rules, prefix tries, counters).
//! - [`store`]: the bucket store, the memory-mapped array of bucket records, read and charged in
//!   place.
//! - [`bucket`]: bucket keys, the clocks bucket times are kept in, and buckets in user terms.
//! - [`locator`]: finding many keys' buckets with the config and rules read once.
//! - [`v4`]: the IPv4 table, the memory-mapped index of the trie's outcomes by /16.

pub mod bucket;
pub mod locator;
pub mod new_pages;
pub mod store;
pub mod v4;

use std::{
    collections::{BTreeMap, HashMap},
    ops::ControlFlow,
    path::{Path, PathBuf},
};

use aya::{
    maps::{Array, LpmTrie, Map, MapData, MapError, PerCpuArray, PerCpuValues},
    util::nr_cpus,
};
use ratelimit_common::{
    bucket_capacity, global, layout, map_names, v4_table, verdict, Bucket, BucketKey, Config,
    GlobalStats, PrefixKey, Rule, RuleMeta, RuleSet, RuleStats, MAX_PREFIXES, MAX_RULES,
};

use self::{
    store::{MappedStore, Slot},
    v4::MappedTable,
};

/// Errors from opening or using the pinned maps.
#[derive(Debug, thiserror::Error)]
pub enum MapsError {
    /// A pinned map file is missing or could not be opened.
    #[error(
        "cannot open pinned map {path}: {reason} (is the agent running with this pin directory?)"
    )]
    Open {
        /// The pinned file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A pinned map exists but has a different shape than this version expects.
    #[error("pinned map {path} does not match this version of ratelimit ({detail}); stop the agent that uses {dir}, then remove its pins with `ratelimit detach --pin-path {dir}`, and start this one")]
    Mismatch {
        /// The pinned file.
        path: PathBuf,
        /// The pin directory.
        dir: PathBuf,
        /// What differs.
        detail: String,
    },
    /// A map operation failed.
    #[error("map {map}: {reason}")]
    Op {
        /// Map name.
        map: &'static str,
        /// Kernel or aya error.
        reason: String,
    },
}

type Result<T, E = MapsError> = std::result::Result<T, E>;

fn op(map: &'static str) -> impl Fn(MapError) -> MapsError {
    move |e| MapsError::Op {
        map,
        reason: format!("{e}"),
    }
}

/// Expected (key size, value size, max entries or None when configurable) of each map.
fn expected_shape(name: &str) -> Option<(u32, u32, Option<u32>)> {
    use std::mem::size_of;
    #[expect(clippy::cast_possible_truncation, reason = "record sizes are tiny")]
    let sz = |n: usize| n as u32;
    Some(match name {
        map_names::CONFIG => (4, sz(size_of::<Config>()), Some(1)),
        map_names::RULES => (4, sz(size_of::<Rule>()), Some(MAX_RULES)),
        map_names::RULE_META => (4, sz(size_of::<RuleMeta>()), Some(MAX_RULES)),
        map_names::PREFIXES => (
            4 + sz(size_of::<PrefixKey>()),
            sz(size_of::<RuleSet>()),
            Some(MAX_PREFIXES),
        ),
        map_names::BUCKETS => (4, sz(size_of::<Bucket>()), None),
        map_names::RULE_STATS => (4, sz(size_of::<RuleStats>()), Some(MAX_RULES)),
        map_names::GLOBAL_STATS => (4, sz(size_of::<GlobalStats>()), Some(1)),
        map_names::V4_TABLE => (4, sz(size_of::<v4_table::Entry>()), Some(v4_table::ENTRIES)),
        map_names::NEW_PAGES => (4, 8, None),
        map_names::BUCKET_TAGS => (4, sz(size_of::<ratelimit_common::TagLine>()), None),
        _ => return None,
    })
}

/// Every map the program pins: the names of [`layout::PINNED_MAPS`], the one list of them.
pub const ALL: [&str; layout::PINNED_MAPS.len()] = {
    let mut names = [""; layout::PINNED_MAPS.len()];
    let mut i = 0;
    while i < names.len() {
        names[i] = layout::PINNED_MAPS[i].0;
        i += 1;
    }
    names
};

/// Checks that whatever is already pinned in `dir` has the shapes this version uses, so a stale
/// pin from another version is refused with a clear message instead of being misread: each map's
/// type, flags, key and value sizes and capacity, and the layout stamp in the config record
/// (`check_stamp`). `max_buckets` is the capacity the agent is about to ask for: a different
/// one is a mismatch too (the bucket store cannot be resized in place). A pinned first-seen table
/// (of a version before the bucket store) means the whole directory is of that version: refused
/// the same way.
pub fn check_pinned(dir: &Path, max_buckets: u32) -> Result<()> {
    let legacy = dir.join(map_names::LEGACY_FIRST_SEEN);
    if legacy.exists() {
        return Err(MapsError::Mismatch {
            path: legacy,
            dir: dir.to_path_buf(),
            detail: "pinned by a version with the first-seen table and an LRU bucket map".into(),
        });
    }
    for map in layout::PINNED_MAPS {
        if dir.join(map.0).exists() {
            check_map(dir, map, Some(bucket_capacity(max_buckets)))?;
        }
    }
    // A store pinned without its tags: a new, empty tag table would say none of its records
    // holds its key (`ratelimit_common::tags`), and their sources' first packets would pass again.
    let tags = dir.join(map_names::BUCKET_TAGS);
    if dir.join(map_names::BUCKETS).exists() && !tags.exists() {
        return Err(MapsError::Mismatch {
            path: tags,
            dir: dir.to_path_buf(),
            detail: "the bucket store is pinned without its tags".into(),
        });
    }
    if dir.join(map_names::CONFIG).exists() {
        check_stamp(dir)?;
    }
    Ok(())
}

/// Checks one pinned map (name, type, flags as [`layout::PINNED_MAPS`] has them): its type, flags,
/// key and value sizes and capacity (the bucket store's against `buckets`, unless `None`).
fn check_map(
    dir: &Path,
    (name, kind, flags): (&str, u32, u32),
    buckets: Option<u32>,
) -> Result<()> {
    let path = dir.join(name);
    let info = aya::maps::MapInfo::from_pin(&path).map_err(|e| MapsError::Open {
        path: path.clone(),
        reason: format!("{e}"),
    })?;
    let (key, value, max) = expected_shape(name).expect("known map");
    let max = max.or(match name {
        map_names::NEW_PAGES => buckets.map(ratelimit_common::new_pages_words),
        map_names::BUCKET_TAGS => buckets.map(ratelimit_common::bucket_tag_lines),
        _ => buckets,
    });
    let actual_kind = info.map_type().map_or(u32::MAX, |t| t as u32);
    let mismatch = |detail: String| MapsError::Mismatch {
        path: path.clone(),
        dir: dir.to_path_buf(),
        detail,
    };
    if actual_kind != kind || info.map_flags() != flags {
        return Err(mismatch(format!(
            "map type/flags {actual_kind}/{:#x}, expected {kind}/{flags:#x}",
            info.map_flags()
        )));
    }
    if info.key_size() != key
        || info.value_size() != value
        || max.is_some_and(|m| info.max_entries() != m)
    {
        return Err(mismatch(format!(
            "key/value/capacity {}/{}/{}, expected {key}/{value}/{}",
            info.key_size(),
            info.value_size(),
            info.max_entries(),
            max.map_or_else(|| "any".to_string(), |m| m.to_string())
        )));
    }
    Ok(())
}

/// Checks the layout stamp the pins were created with ([`Config::layout`]) against this
/// version's ([`layout::STAMP`]). Pins not initialised yet (no seed drawn: an agent stopped
/// between creating and initialising them) carry none and pass.
fn check_stamp(dir: &Path) -> Result<()> {
    let path = dir.join(map_names::CONFIG);
    let open_err = |e: &dyn std::fmt::Display| MapsError::Open {
        path: path.clone(),
        reason: e.to_string(),
    };
    let data = MapData::from_pin(&path).map_err(|e| open_err(&e))?;
    let map = Map::from_map_data(data).map_err(|e| open_err(&e))?;
    let config: Array<_, Config> = Array::try_from(&map).map_err(op(map_names::CONFIG))?;
    let config = config.get(&0, 0).map_err(op(map_names::CONFIG))?;
    if config.layout == layout::STAMP || (config.layout == 0 && config.seed == [0, 0]) {
        return Ok(());
    }
    Err(MapsError::Mismatch {
        path,
        dir: dir.to_path_buf(),
        detail: format!(
            "pinned by another version of ratelimit: layout stamp {:08x}, this version's {:08x}",
            config.layout,
            layout::STAMP
        ),
    })
}

/// Removes every pinned map file in `dir`, then `dir` itself if it is left empty.
pub fn remove_pins(dir: &Path) -> std::io::Result<()> {
    for name in ALL.into_iter().chain([
        map_names::LEGACY_FIRST_SEEN,
        map_names::LEGACY_FIRST_PACKETS,
    ]) {
        match std::fs::remove_file(dir.join(name)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
    }
    match std::fs::remove_dir(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        // Something else lives there (a link pin, a user's file): leave it.
        Err(e) if e.raw_os_error() == Some(libc::ENOTEMPTY) => Ok(()),
        Err(e) => Err(e),
    }
}

/// The map pinned as `name` in `dir`.
fn open_pinned(dir: &Path, name: &str) -> Result<Map> {
    let path = dir.join(name);
    let data = MapData::from_pin(&path).map_err(|e| MapsError::Open {
        path: path.clone(),
        reason: format!("{e}"),
    })?;
    Map::from_map_data(data).map_err(|e| MapsError::Open {
        path,
        reason: format!("{e}"),
    })
}

/// The memory-mappable array pinned as `name` in `dir`, mapped into this process by `map`
/// (given its descriptor, map id and capacity); `what` names it in errors.
fn open_mapped<T>(
    dir: &Path,
    name: &'static str,
    what: &str,
    map: impl FnOnce(std::os::fd::BorrowedFd<'_>, u32, u32) -> std::io::Result<T>,
) -> Result<T> {
    use std::os::fd::AsFd as _;
    let path = dir.join(name);
    let Map::Array(data) = open_pinned(dir, name)? else {
        return Err(MapsError::Mismatch {
            path,
            dir: dir.to_path_buf(),
            detail: "not an array".into(),
        });
    };
    let info = data.info().map_err(op(name))?;
    map(data.fd().as_fd(), info.id(), info.max_entries()).map_err(|e| MapsError::Open {
        path,
        reason: format!("mapping {what} into memory: {e}"),
    })
}

/// Handles on the pinned maps.
pub struct PinnedMaps {
    dir: PathBuf,
    config: Map,
    rules: Map,
    rule_meta: Map,
    prefixes: Map,
    v4_table: MappedTable,
    store: MappedStore,
    new_pages: new_pages::MappedNewPages,
    rule_stats: Map,
    global_stats: Map,
    /// Entries written or deleted through this handle (see [`PinnedMaps::writes`]).
    writes: u64,
}

impl PinnedMaps {
    /// Opens the maps pinned in `dir`, after checking that they are of this version's layout
    /// (types, flags, record sizes, layout stamp): pins of another version are refused, never
    /// misread.
    pub fn open(dir: &Path) -> Result<Self> {
        // The stamp first: pins of a version without one of this version's maps are refused as
        // another version's, not as a map missing.
        check_stamp(dir)?;
        for map in layout::PINNED_MAPS {
            check_map(dir, map, None)?;
        }
        let open = |name: &str| open_pinned(dir, name);
        let mut store = open_mapped(
            dir,
            map_names::BUCKETS,
            "the bucket store",
            MappedStore::map,
        )?;
        open_mapped(
            dir,
            map_names::BUCKET_TAGS,
            "the bucket tags",
            |fd, id, lines| store.map_tags(fd, id, lines),
        )?;
        // Its shape (ENTRIES entries of 16 words) was checked above.
        let v4_table = open_mapped(dir, map_names::V4_TABLE, "the IPv4 table", |fd, id, _| {
            MappedTable::map(fd, id)
        })?;
        let new_pages = open_mapped(
            dir,
            map_names::NEW_PAGES,
            "the new pages' flags",
            new_pages::MappedNewPages::map,
        )?;
        Ok(Self {
            dir: dir.to_path_buf(),
            config: open(map_names::CONFIG)?,
            rules: open(map_names::RULES)?,
            rule_meta: open(map_names::RULE_META)?,
            prefixes: open(map_names::PREFIXES)?,
            v4_table,
            store,
            new_pages,
            rule_stats: open(map_names::RULE_STATS)?,
            global_stats: open(map_names::GLOBAL_STATS)?,
            writes: 0,
        })
    }

    /// The pin directory.
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// How many map entries this handle has written or deleted (config, rule records, names,
    /// counters, prefix entries; one per entry, failed attempts included; the bucket store and
    /// the IPv4 table, written in memory, are not counted): what an install costs in bpf()
    /// calls, for tests that check it writes only what changed.
    #[must_use]
    pub fn writes(&self) -> u64 {
        self.writes
    }

    /// The config record.
    pub fn config(&self) -> Result<Config> {
        let map: Array<_, Config> = Array::try_from(&self.config).map_err(op(map_names::CONFIG))?;
        map.get(&0, 0).map_err(op(map_names::CONFIG))
    }

    /// Overwrites the config record. Within the agent, prefer [`PinnedMaps::update_config`]: two
    /// writers of different fields (an install's epoch, the cluster sync's
    /// [`Config::shares_until_ns`]) must not undo each other's field.
    pub fn set_config(&mut self, config: Config) -> Result<()> {
        self.writes += 1;
        let mut map: Array<_, Config> =
            Array::try_from(&mut self.config).map_err(op(map_names::CONFIG))?;
        map.set(0, config, 0).map_err(op(map_names::CONFIG))
    }

    /// Reads the config record, changes it with `f` and writes it back, under a lock that every
    /// `update_config` of this process takes: the fields `f` leaves alone keep what any other
    /// writer of this process wrote (the record is written whole, so two unserialised
    /// read-modify-writes could put an old epoch back). Returns the record written.
    pub fn update_config(&mut self, f: impl FnOnce(&mut Config)) -> Result<Config> {
        static WRITES: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _held = WRITES
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut config = self.config()?;
        f(&mut config);
        self.set_config(config)?;
        Ok(config)
    }

    /// The rule record with `id`.
    pub fn rule(&self, id: u32) -> Result<Rule> {
        let map: Array<_, Rule> = Array::try_from(&self.rules).map_err(op(map_names::RULES))?;
        map.get(&id, 0).map_err(op(map_names::RULES))
    }

    /// Writes the rule record `id`.
    pub fn set_rule(&mut self, id: u32, rule: Rule) -> Result<()> {
        self.writes += 1;
        let mut map: Array<_, Rule> =
            Array::try_from(&mut self.rules).map_err(op(map_names::RULES))?;
        map.set(id, rule, 0).map_err(op(map_names::RULES))
    }

    /// Name and config line of rule `id` (`None` for a free id).
    pub fn rule_meta(&self, id: u32) -> Result<Option<(String, u32)>> {
        let map: Array<_, RuleMeta> =
            Array::try_from(&self.rule_meta).map_err(op(map_names::RULE_META))?;
        let meta = map.get(&id, 0).map_err(op(map_names::RULE_META))?;
        if meta.name_len == 0 {
            return Ok(None);
        }
        let len = (meta.name_len as usize).min(meta.name.len());
        Ok(Some((
            String::from_utf8_lossy(&meta.name[..len]).into_owned(),
            meta.line,
        )))
    }

    /// Writes the name of rule `id` (`None` frees it).
    pub fn set_rule_meta(&mut self, id: u32, name_line: Option<(&str, u32)>) -> Result<()> {
        self.writes += 1;
        let mut meta = RuleMeta::default();
        if let Some((name, line)) = name_line {
            let bytes = name.as_bytes();
            let len = bytes.len().min(meta.name.len());
            meta.name[..len].copy_from_slice(&bytes[..len]);
            #[expect(clippy::cast_possible_truncation, reason = "len <= MAX_RULE_NAME")]
            {
                meta.name_len = len as u32;
            }
            meta.line = line;
        }
        let mut map: Array<_, RuleMeta> =
            Array::try_from(&mut self.rule_meta).map_err(op(map_names::RULE_META))?;
        map.set(id, meta, 0).map_err(op(map_names::RULE_META))
    }

    /// Every prefix entry (both generations).
    pub fn prefixes(&self) -> Result<Vec<(PrefixKey, u32, RuleSet)>> {
        let trie: LpmTrie<_, PrefixKey, RuleSet> =
            LpmTrie::try_from(&self.prefixes).map_err(op(map_names::PREFIXES))?;
        trie.iter()
            .map(|item| {
                item.map(|(k, v)| (k.data(), k.prefix_len(), v))
                    .map_err(op(map_names::PREFIXES))
            })
            .collect()
    }

    /// Inserts a prefix entry.
    pub fn insert_prefix(&mut self, key: PrefixKey, prefix_len: u32, set: RuleSet) -> Result<()> {
        self.writes += 1;
        let mut trie: LpmTrie<_, PrefixKey, RuleSet> =
            LpmTrie::try_from(&mut self.prefixes).map_err(op(map_names::PREFIXES))?;
        trie.insert(&aya::maps::lpm_trie::Key::new(prefix_len, key), set, 0)
            .map_err(op(map_names::PREFIXES))
    }

    /// Removes the given prefix entries (data, LPM prefix length); missing ones are skipped.
    pub fn remove_prefixes(&mut self, keys: &[(PrefixKey, u32)]) -> Result<()> {
        let mut trie: LpmTrie<_, PrefixKey, RuleSet> =
            LpmTrie::try_from(&mut self.prefixes).map_err(op(map_names::PREFIXES))?;
        for &(key, len) in keys {
            self.writes += 1;
            match trie.remove(&aya::maps::lpm_trie::Key::new(len, key)) {
                Ok(()) | Err(MapError::KeyNotFound) => {}
                Err(e) => return Err(op(map_names::PREFIXES)(e)),
            }
        }
        Ok(())
    }

    /// Removes every prefix entry of `generation`.
    pub fn clear_generation(&mut self, generation: u8) -> Result<()> {
        let mut trie: LpmTrie<_, PrefixKey, RuleSet> =
            LpmTrie::try_from(&mut self.prefixes).map_err(op(map_names::PREFIXES))?;
        let stale: Vec<_> = trie
            .keys()
            .filter_map(std::result::Result::ok)
            .filter(|k| k.data().generation == generation)
            .collect();
        for key in &stale {
            self.writes += 1;
            trie.remove(key).map_err(op(map_names::PREFIXES))?;
        }
        Ok(())
    }

    /// The IPv4 table, mapped (see [`v4_table`]).
    #[must_use]
    pub fn v4_table(&self) -> &MappedTable {
        &self.v4_table
    }

    /// The bucket store, mapped.
    #[must_use]
    pub fn store(&self) -> &MappedStore {
        &self.store
    }

    /// The flags of the store's pages where the program created a bucket of a cluster-scoped
    /// limit since they were last taken (see [`new_pages::MappedNewPages::take`]).
    #[must_use]
    pub fn new_pages(&self) -> &new_pages::MappedNewPages {
        &self.new_pages
    }

    /// Whether record `b` holds a live bucket: a key, not being written, and of the generation
    /// its rule id has now (`gens` caches the ids' generations for one walk).
    fn live(&self, b: &Bucket, gens: &mut HashMap<u16, u32>) -> Result<bool> {
        if b.family == 0 || b.state != 0 {
            return Ok(false);
        }
        let gen = match gens.get(&b.rule) {
            Some(&g) => g,
            None => {
                let (id, limit) = ratelimit_common::split_bucket_rule(u32::from(b.rule));
                let g = if id < MAX_RULES {
                    let rule = self.rule(id)?;
                    if limit < rule.limits() {
                        rule.bucket_gen
                    } else {
                        0
                    }
                } else {
                    0
                };
                gens.insert(b.rule, g);
                g
            }
        };
        Ok(gen != 0 && gen == b.rule_gen)
    }

    /// Hands every live bucket to `f`, with its record index. Buckets created or evicted during
    /// the walk may be seen or not, as with any walk of a live store.
    pub fn for_each_bucket(&self, mut f: impl FnMut(u32, &Bucket)) -> Result<()> {
        self.for_each_bucket_in(0..self.store.records(), |i, b| {
            f(i, b);
            ControlFlow::Continue(())
        })
        .map(|_| ())
    }

    /// [`PinnedMaps::for_each_bucket`] over the records of `range`, until `f` breaks: returns
    /// the index of the record `f` broke on (not done), else the range's end (clamped to the
    /// store). Nothing is kept: memory stays bounded however large the store.
    pub fn for_each_bucket_in(
        &self,
        range: std::ops::Range<u32>,
        mut f: impl FnMut(u32, &Bucket) -> ControlFlow<()>,
    ) -> Result<u32> {
        let mut gens = HashMap::new();
        let mut err = None;
        let end = self
            .store
            .for_each_in(range, |i, b| match self.live(b, &mut gens) {
                Ok(true) => f(i, b),
                Ok(false) => ControlFlow::Continue(()),
                Err(e) => {
                    err = Some(e);
                    ControlFlow::Break(())
                }
            });
        err.map_or(Ok(end), Err)
    }

    /// [`PinnedMaps::for_each_bucket_in`] over the records `records` (each in the store; others
    /// are skipped), with one look at each rule's generation for all of them: the records of
    /// the grown slots, scattered over the store.
    pub fn for_each_bucket_at(
        &self,
        records: impl IntoIterator<Item = u32>,
        mut f: impl FnMut(u32, &Bucket),
    ) -> Result<()> {
        let mut gens = HashMap::new();
        for i in records {
            if i >= self.store.records() {
                continue;
            }
            let b = self.store.get(i);
            if self.live(&b, &mut gens)? {
                f(i, &b);
            }
        }
        Ok(())
    }

    /// Every tracked bucket, all in memory at once (88 bytes each and more): for tests and tools
    /// on small stores only. The agent streams ([`PinnedMaps::for_each_bucket_in`]).
    pub fn buckets(&self) -> Result<Vec<(BucketKey, Bucket)>> {
        let mut all = Vec::new();
        self.for_each_bucket(|_, b| all.push((b.key(), *b)))?;
        Ok(all)
    }

    /// How many buckets are tracked (a walk of the whole store, nothing kept): for `stats
    /// --pin-path` and the agent's census ([`crate::census`]), never under the agent's lock.
    pub fn bucket_count(&self) -> Result<u64> {
        let mut count = 0u64;
        self.for_each_bucket(|_, _| count += 1)?;
        Ok(count)
    }

    /// Where the bucket under `key` is (or would go) at `now`: see [`MappedStore::locate`].
    /// With the generation of its rule in force (0 if the id is free: nothing is found). For
    /// many keys, a [`Locator`](locator::Locator) reads the config and rules once.
    pub fn locate_bucket(&self, key: &BucketKey, now: u64) -> Result<(Slot, u32)> {
        locator::Locator::new(self)?.locate(key, now)
    }

    /// Another record than `mine` holding `key`'s bucket of generation `gen`: see
    /// [`MappedStore::other_holder`].
    pub fn other_bucket(&self, key: &BucketKey, gen: u32, mine: u32) -> Result<Option<u32>> {
        let config = self.config()?;
        Ok(self
            .store
            .other_holder(config.seed, config.bucket_sets, key, gen, mine))
    }

    /// The tag of `key` (`ratelimit_common::bucket_tag`), for
    /// [`MappedStore::install_tagged`].
    pub fn bucket_tag(&self, key: &BucketKey) -> Result<u8> {
        let config = self.config()?;
        let hash = ratelimit_common::bucket_hash(
            config.seed,
            key.rule,
            key.family,
            ratelimit_common::addr_words(&key.addr),
        );
        Ok(ratelimit_common::bucket_tag(hash))
    }

    /// The bucket under `key`, if tracked.
    pub fn bucket(&self, key: &BucketKey) -> Result<Option<Bucket>> {
        locator::Locator::new(self)?.bucket(key)
    }

    /// Capacity of the bucket store (records).
    pub fn bucket_capacity(&self) -> Result<u32> {
        Ok(self.store.records())
    }

    /// Zeroes the counters of rule `id` (a freshly assigned id).
    pub fn reset_rule_stats(&mut self, id: u32) -> Result<()> {
        self.writes += 1;
        let mut map: PerCpuArray<_, RuleStats> =
            PerCpuArray::try_from(&mut self.rule_stats).map_err(op(map_names::RULE_STATS))?;
        let cpus = nr_cpus().map_err(|(_, e)| MapsError::Op {
            map: map_names::RULE_STATS,
            reason: format!("reading the number of CPUs: {e}"),
        })?;
        let zero = PerCpuValues::try_from(vec![RuleStats::default(); cpus]).map_err(|e| {
            MapsError::Op {
                map: map_names::RULE_STATS,
                reason: format!("{e}"),
            }
        })?;
        map.set(id, zero, 0).map_err(op(map_names::RULE_STATS))
    }

    /// Counters of rule `id`, summed over CPUs.
    pub fn rule_stats(&self, id: u32) -> Result<RuleStats> {
        let map: PerCpuArray<_, RuleStats> =
            PerCpuArray::try_from(&self.rule_stats).map_err(op(map_names::RULE_STATS))?;
        let per_cpu = map.get(&id, 0).map_err(op(map_names::RULE_STATS))?;
        let mut sum = RuleStats::default();
        for s in per_cpu.iter() {
            for v in 0..verdict::COUNT {
                sum.pkts[v] += s.pkts[v];
                sum.bytes[v] += s.bytes[v];
            }
            for l in 0..ratelimit_common::MAX_LIMITS {
                sum.limit_dropped_rate[l] += s.limit_dropped_rate[l];
                sum.limit_dropped_bytes[l] += s.limit_dropped_bytes[l];
            }
        }
        Ok(sum)
    }

    /// Global counters, summed over CPUs.
    pub fn global_stats(&self) -> Result<GlobalStats> {
        let map: PerCpuArray<_, GlobalStats> =
            PerCpuArray::try_from(&self.global_stats).map_err(op(map_names::GLOBAL_STATS))?;
        let per_cpu = map.get(&0, 0).map_err(op(map_names::GLOBAL_STATS))?;
        let mut sum = GlobalStats::default();
        for s in per_cpu.iter() {
            for i in 0..global::COUNT {
                sum.counters[i] += s.counters[i];
            }
        }
        Ok(sum)
    }

    /// The rules that hold an id (named in the meta map): id -> (name, line, record).
    pub fn named_rules(&self) -> Result<BTreeMap<u32, (String, u32, Rule)>> {
        let meta: Array<_, RuleMeta> =
            Array::try_from(&self.rule_meta).map_err(op(map_names::RULE_META))?;
        let mut out = BTreeMap::new();
        for (id, m) in (0..MAX_RULES).zip(meta.iter()) {
            let m = m.map_err(op(map_names::RULE_META))?;
            if m.name_len == 0 {
                continue;
            }
            let len = (m.name_len as usize).min(m.name.len());
            let name = String::from_utf8_lossy(&m.name[..len]).into_owned();
            out.insert(id, (name, m.line, self.rule(id)?));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `detach` removes every map this version pins and those earlier versions pinned that it no
    /// longer does (the first-seen table, the first-packet table), and leaves what is not a pin
    /// of ours.
    #[test]
    fn removing_the_pins_takes_this_versions_maps_and_earlier_ones() {
        let dir = tempfile::tempdir().unwrap();
        let names = ALL.into_iter().chain([
            map_names::LEGACY_FIRST_SEEN,
            map_names::LEGACY_FIRST_PACKETS,
        ]);
        for name in names.clone() {
            std::fs::write(dir.path().join(name), b"").unwrap();
        }
        std::fs::write(dir.path().join("link"), b"").unwrap();
        remove_pins(dir.path()).unwrap();
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, ["link"], "left in the directory");
        std::fs::remove_file(dir.path().join("link")).unwrap();
        for name in names {
            std::fs::write(dir.path().join(name), b"").unwrap();
        }
        remove_pins(dir.path()).unwrap();
        assert!(!dir.path().exists(), "the emptied directory is removed");
    }
}
