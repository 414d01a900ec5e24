//! The program's maps. Names and record types come from `ratelimit-common`; every map is pinned by
//! name so an agent restart (or crash) leaves rules, buckets and counters in place. (The per-CPU
//! caches, which are not pinned, live with their record type in `scratch`.)

use aya_ebpf::{
    macros::map,
    maps::{lpm_trie::LpmTrie, Array, LruHashMap, PerCpuArray},
};
use ratelimit_common::{
    bucket_capacity, bucket_tag_lines, new_pages_words, v4_table, Bucket, Config, FragEntry,
    FragKey, GlobalStats, PrefixKey, Rule, RuleMeta, RuleSet, RuleStats, TagLine, BPF_F_MMAPABLE,
    DEFAULT_MAX_BUCKETS, MAX_FRAGMENTED, MAX_PREFIXES, MAX_RULES,
};

#[map(name = "RL_CONFIG")]
pub static CONFIG: Array<Config> = Array::pinned(1, 0);

#[map(name = "RL_RULES")]
pub static RULES: Array<Rule> = Array::pinned(MAX_RULES, 0);

#[map(name = "RL_PREFIXES")]
pub static PREFIXES: LpmTrie<PrefixKey, RuleSet> = LpmTrie::pinned(MAX_PREFIXES, 0);

/// The IPv4 table (see `ratelimit_common::v4_table`): most IPv4 sources' classification in one
/// array read, before the trie.
#[map(name = "RL_V4_TABLE")]
pub static V4_TABLE: Array<v4_table::Entry> = Array::pinned(v4_table::ENTRIES, BPF_F_MMAPABLE);

/// The bucket store (see `store`). Capacity is replaced at load time by the agent's `max_buckets`
/// (rounded up to whole sets); memory-mappable so the agent reads and charges it in place.
#[map(name = "RL_BUCKETS")]
pub static BUCKETS: Array<Bucket> =
    Array::pinned(bucket_capacity(DEFAULT_MAX_BUCKETS), BPF_F_MMAPABLE);

/// A bit for each page of the bucket store where a bucket of a cluster-scoped limit was created
/// since the agent last took them (see `ratelimit_common::map_names::NEW_PAGES`). Capacity
/// replaced at load time, with the store's.
#[map(name = "RL_NEW_PAGES")]
pub static NEW_PAGES: Array<u64> = Array::pinned(
    new_pages_words(bucket_capacity(DEFAULT_MAX_BUCKETS)),
    BPF_F_MMAPABLE,
);

/// A line for each group of the store's records (see `ratelimit_common::tags`): their tags,
/// then the group's first-packet slots (`ratelimit_common::first_pick`). Capacity replaced at
/// load time, with the store's; memory-mappable so the agent writes a tag in place.
#[map(name = "RL_BUCKET_TAGS")]
pub static BUCKET_TAGS: Array<TagLine> = Array::pinned(
    bucket_tag_lines(bucket_capacity(DEFAULT_MAX_BUCKETS)),
    BPF_F_MMAPABLE,
);

#[map(name = "RL_RULE_STATS")]
pub static RULE_STATS: PerCpuArray<RuleStats> = PerCpuArray::pinned(MAX_RULES, 0);

#[map(name = "RL_GLOBAL_STATS")]
pub static GLOBAL_STATS: PerCpuArray<GlobalStats> = PerCpuArray::pinned(1, 0);

/// Never read here: user space keeps rule names in it (see `RuleMeta`); defined in the object so
/// it is created and pinned with the rest.
#[map(name = "RL_RULE_META")]
pub static RULE_META: Array<RuleMeta> = Array::pinned(MAX_RULES, 0);

/// Recent fragmented datagrams and their first fragment's classification (see `frag`). Not
/// pinned: a few seconds of memory that a new program may start without.
#[map(name = "RL_FRAGMENTS")]
pub static FRAGMENTS: LruHashMap<FragKey, FragEntry> =
    LruHashMap::with_max_entries(MAX_FRAGMENTED, 0);
