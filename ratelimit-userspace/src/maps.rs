//! Typed access to the limiter's pinned maps.
//!
//! Everything user space does with the maps (install rules, read counters, list buckets) goes
//! through the files pinned under the pin directory, so the agent and a CLI reading the same
//! directory see the same state, and a restarted agent picks up where the last one stopped.

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use aya::{
    maps::{Array, HashMap, LpmTrie, Map, MapData, MapError, PerCpuArray, PerCpuValues},
    util::nr_cpus,
};
use ratelimit_common::{
    global, map_names, verdict, Bucket, BucketKey, Config, FirstSeen, GlobalStats, PrefixKey, Rule,
    RuleMeta, RuleSet, RuleStats, FIRST_SEEN_SLOTS, MAX_PREFIXES, MAX_RULES,
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
    #[error("pinned map {path} does not match this version of ratelimit ({detail}); remove it with `ratelimit detach` or `rm -r {dir}`")]
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

/// `bpf_map_update_elem` flag: create only (from `linux/bpf.h`).
pub const BPF_NOEXIST: u64 = 1;
/// `bpf_map_update_elem` flag: replace only (from `linux/bpf.h`).
pub const BPF_EXIST: u64 = 2;

type Result<T, E = MapsError> = std::result::Result<T, E>;

/// `BPF_MAP_LOOKUP_BATCH` (from `linux/bpf.h`; Linux 5.6+).
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
/// `ENOTSUPP` (kernel-internal, what an old kernel returns for an unsupported command).
const ENOTSUPP: i32 = 524;
/// Buckets read per `BPF_MAP_LOOKUP_BATCH` call (2.3 MiB of buffers).
const BUCKET_BATCH: usize = 8192;

/// The `batch` member of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

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
        map_names::BUCKETS => (sz(size_of::<BucketKey>()), sz(size_of::<Bucket>()), None),
        map_names::RULE_STATS => (4, sz(size_of::<RuleStats>()), Some(MAX_RULES)),
        map_names::GLOBAL_STATS => (4, sz(size_of::<GlobalStats>()), Some(1)),
        map_names::FIRST_SEEN => (4, sz(size_of::<FirstSeen>()), Some(FIRST_SEEN_SLOTS)),
        _ => return None,
    })
}

/// Every map the program pins.
pub const ALL: [&str; 8] = [
    map_names::FIRST_SEEN,
    map_names::CONFIG,
    map_names::RULES,
    map_names::RULE_META,
    map_names::PREFIXES,
    map_names::BUCKETS,
    map_names::RULE_STATS,
    map_names::GLOBAL_STATS,
];

/// Checks that whatever is already pinned in `dir` has the shapes this version uses, so a stale
/// pin from another version is refused with a clear message instead of being misread.
/// `max_buckets` is the capacity the agent is about to ask for: a different one is a mismatch too
/// (an LRU map cannot be resized in place).
pub fn check_pinned(dir: &Path, max_buckets: u32) -> Result<()> {
    for name in ALL {
        let path = dir.join(name);
        if !path.exists() {
            continue;
        }
        let info = aya::maps::MapInfo::from_pin(&path).map_err(|e| MapsError::Open {
            path: path.clone(),
            reason: format!("{e}"),
        })?;
        let (key, value, max) = expected_shape(name).expect("known map");
        let max = max.unwrap_or(max_buckets);
        if info.key_size() != key || info.value_size() != value || info.max_entries() != max {
            return Err(MapsError::Mismatch {
                path,
                dir: dir.to_path_buf(),
                detail: format!(
                    "key/value/capacity {}/{}/{}, expected {key}/{value}/{max}",
                    info.key_size(),
                    info.value_size(),
                    info.max_entries()
                ),
            });
        }
    }
    Ok(())
}

/// Removes every pinned map file in `dir`, then `dir` itself if it is left empty.
pub fn remove_pins(dir: &Path) -> std::io::Result<()> {
    for name in ALL {
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

/// Handles on the pinned maps.
pub struct PinnedMaps {
    dir: PathBuf,
    config: Map,
    rules: Map,
    rule_meta: Map,
    prefixes: Map,
    buckets: Map,
    rule_stats: Map,
    global_stats: Map,
}

impl PinnedMaps {
    /// Opens the maps pinned in `dir`.
    pub fn open(dir: &Path) -> Result<Self> {
        let open = |name: &str| -> Result<Map> {
            let path = dir.join(name);
            let data = MapData::from_pin(&path).map_err(|e| MapsError::Open {
                path: path.clone(),
                reason: format!("{e}"),
            })?;
            Map::from_map_data(data).map_err(|e| MapsError::Open {
                path,
                reason: format!("{e}"),
            })
        };
        Ok(Self {
            dir: dir.to_path_buf(),
            config: open(map_names::CONFIG)?,
            rules: open(map_names::RULES)?,
            rule_meta: open(map_names::RULE_META)?,
            prefixes: open(map_names::PREFIXES)?,
            buckets: open(map_names::BUCKETS)?,
            rule_stats: open(map_names::RULE_STATS)?,
            global_stats: open(map_names::GLOBAL_STATS)?,
        })
    }

    /// The pin directory.
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The config record.
    pub fn config(&self) -> Result<Config> {
        let map: Array<_, Config> = Array::try_from(&self.config).map_err(op(map_names::CONFIG))?;
        map.get(&0, 0).map_err(op(map_names::CONFIG))
    }

    /// Overwrites the config record.
    pub fn set_config(&mut self, config: Config) -> Result<()> {
        let mut map: Array<_, Config> =
            Array::try_from(&mut self.config).map_err(op(map_names::CONFIG))?;
        map.set(0, config, 0).map_err(op(map_names::CONFIG))
    }

    /// The rule record with `id`.
    pub fn rule(&self, id: u32) -> Result<Rule> {
        let map: Array<_, Rule> = Array::try_from(&self.rules).map_err(op(map_names::RULES))?;
        map.get(&id, 0).map_err(op(map_names::RULES))
    }

    /// Writes the rule record `id`.
    pub fn set_rule(&mut self, id: u32, rule: Rule) -> Result<()> {
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
            trie.remove(key).map_err(op(map_names::PREFIXES))?;
        }
        Ok(())
    }

    /// Every tracked bucket.
    pub fn buckets(&self) -> Result<Vec<(BucketKey, Bucket)>> {
        let mut all = Vec::new();
        self.for_each_bucket(|keys, values| {
            all.extend(keys.iter().copied().zip(values.iter().copied()));
        })?;
        Ok(all)
    }

    /// How many buckets are tracked (nothing kept), for status and stats, which need no more.
    pub fn bucket_count(&self) -> Result<u64> {
        let mut count = 0u64;
        self.for_each_bucket(|keys, _| count += keys.len() as u64)?;
        Ok(count)
    }

    /// Hands every tracked bucket to `f`: in batches ([`Self::bucket_batches`]), or one at a time
    /// on kernels without batch lookup, where entries evicted during the walk show up as errors
    /// and are skipped.
    fn for_each_bucket(&self, mut f: impl FnMut(&[BucketKey], &[Bucket])) -> Result<()> {
        if self.bucket_batches(&mut f)? {
            return Ok(());
        }
        let map: HashMap<_, BucketKey, Bucket> =
            HashMap::try_from(&self.buckets).map_err(op(map_names::BUCKETS))?;
        for (k, v) in map.iter().filter_map(std::result::Result::ok) {
            f(&[k], &[v]);
        }
        Ok(())
    }

    /// Hands every tracked bucket to `f`, [`BUCKET_BATCH`] per system call
    /// (`BPF_MAP_LOOKUP_BATCH`): a walk of a million buckets is a hundred-odd calls instead of two
    /// million. `Ok(false)` when the kernel has no batch lookup (before Linux 5.6), before `f` saw
    /// anything: [`Self::for_each_bucket`] then walks key by key. Buckets created or evicted during
    /// the walk may be seen or not, as with any walk of a live hash map.
    fn bucket_batches(&self, mut f: impl FnMut(&[BucketKey], &[Bucket])) -> Result<bool> {
        use std::os::fd::{AsFd as _, AsRawFd as _};
        let Map::LruHashMap(data) = &self.buckets else {
            return Err(MapsError::Op {
                map: map_names::BUCKETS,
                reason: "not an LRU hash".into(),
            });
        };
        let fd = data.fd().as_fd().as_raw_fd();
        let mut keys = vec![BucketKey::default(); BUCKET_BATCH];
        let mut values = vec![Bucket::default(); BUCKET_BATCH];
        // The hash map's position token (a bucket index, 4 bytes); 8 to be safe.
        let (mut token_in, mut token_out) = (0u64, 0u64);
        let mut first = true;
        loop {
            let mut attr = BatchAttr {
                in_batch: if first {
                    0
                } else {
                    (&raw const token_in) as u64
                },
                out_batch: (&raw mut token_out) as u64,
                keys: keys.as_mut_ptr() as u64,
                values: values.as_mut_ptr() as u64,
                count: BUCKET_BATCH as u32,
                map_fd: fd as u32,
                ..BatchAttr::default()
            };
            // SAFETY: `attr` is the `batch` member of union bpf_attr; its buffers hold `count`
            // keys and values of the map's key and value sizes (checked when the pins were
            // opened: `check_pinned`) and outlive the call.
            let rc = unsafe {
                libc::syscall(
                    libc::SYS_bpf,
                    BPF_MAP_LOOKUP_BATCH,
                    &raw mut attr,
                    std::mem::size_of::<BatchAttr>(),
                )
            };
            let errno = (rc < 0).then(|| std::io::Error::last_os_error().raw_os_error());
            let n = (attr.count as usize).min(BUCKET_BATCH);
            match errno {
                None => f(&keys[..n], &values[..n]),
                // The end: the last entries come with it.
                Some(Some(libc::ENOENT)) => {
                    f(&keys[..n], &values[..n]);
                    return Ok(true);
                }
                Some(Some(libc::EINVAL | libc::EOPNOTSUPP | ENOTSUPP)) if first => {
                    return Ok(false)
                }
                Some(e) => {
                    return Err(MapsError::Op {
                        map: map_names::BUCKETS,
                        reason: format!(
                            "batch lookup: {}",
                            std::io::Error::from_raw_os_error(e.unwrap_or(0))
                        ),
                    })
                }
            }
            token_in = token_out;
            first = false;
        }
    }

    /// The bucket under `key`, if tracked.
    pub fn bucket(&self, key: &BucketKey) -> Result<Option<Bucket>> {
        let map: HashMap<_, BucketKey, Bucket> =
            HashMap::try_from(&self.buckets).map_err(op(map_names::BUCKETS))?;
        match map.get(key, 0) {
            Ok(b) => Ok(Some(b)),
            Err(MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(op(map_names::BUCKETS)(e)),
        }
    }

    /// Writes the bucket under `key` (the cluster sync charging peers' consumption): `flags` is
    /// [`BPF_EXIST`] (replace an existing bucket) or [`BPF_NOEXIST`] (create a missing one).
    /// `Ok(false)` when the kernel refused because the bucket appeared or vanished meanwhile.
    pub fn update_bucket(&mut self, key: &BucketKey, value: &Bucket, flags: u64) -> Result<bool> {
        let mut map: HashMap<_, BucketKey, Bucket> =
            HashMap::try_from(&mut self.buckets).map_err(op(map_names::BUCKETS))?;
        match map.insert(key, value, flags) {
            Ok(()) => Ok(true),
            Err(MapError::SyscallError(e))
                if matches!(e.io_error.raw_os_error(), Some(libc::ENOENT | libc::EEXIST)) =>
            {
                Ok(false)
            }
            Err(e) => Err(op(map_names::BUCKETS)(e)),
        }
    }

    /// Deletes the buckets of the given rule ids.
    pub fn purge_buckets(&mut self, ids: &std::collections::BTreeSet<u32>) -> Result<usize> {
        let mut stale = Vec::new();
        self.for_each_bucket(|keys, _| {
            stale.extend(keys.iter().filter(|k| ids.contains(&k.rule)).copied());
        })?;
        let mut map: HashMap<_, BucketKey, Bucket> =
            HashMap::try_from(&mut self.buckets).map_err(op(map_names::BUCKETS))?;
        for key in &stale {
            // Evicted meanwhile is fine.
            let _ = map.remove(key);
        }
        Ok(stale.len())
    }

    /// Capacity of the bucket map.
    pub fn bucket_capacity(&self) -> Result<u32> {
        let Map::LruHashMap(data) = &self.buckets else {
            return Err(MapsError::Op {
                map: map_names::BUCKETS,
                reason: "not an LRU hash".into(),
            });
        };
        data.info()
            .map(|i| i.max_entries())
            .map_err(op(map_names::BUCKETS))
    }

    /// Zeroes the counters of rule `id` (a freshly assigned id).
    pub fn reset_rule_stats(&mut self, id: u32) -> Result<()> {
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
