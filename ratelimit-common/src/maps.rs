//! The XDP object's program and maps: their names and the capacities fixed at build time.

/// Names of the maps in the XDP object; they are also the file names under the pin directory.
pub mod map_names {
    /// One [`crate::Config`] record: active rule generation and global flags.
    pub const CONFIG: &str = "RL_CONFIG";
    /// [`crate::Rule`] records indexed by rule id.
    pub const RULES: &str = "RL_RULES";
    /// LPM trie from [`crate::PrefixKey`] to [`crate::RuleSet`]: which rules a source may match.
    pub const PREFIXES: &str = "RL_PREFIXES";
    /// Array of [`crate::Bucket`] records, the bucket store: set-associative by a secret-seeded
    /// hash of the bucket key (see [`crate::bucket_sets`]), [`crate::BUCKET_WAYS`] records a set,
    /// memory-mappable (`BPF_F_MMAPABLE`) so user space reads and charges it in place.
    pub const BUCKETS: &str = "RL_BUCKETS";
    /// Per-CPU array of [`crate::RuleStats`] indexed by rule id.
    pub const RULE_STATS: &str = "RL_RULE_STATS";
    /// Per-CPU array with one [`crate::GlobalStats`] record.
    pub const GLOBAL_STATS: &str = "RL_GLOBAL_STATS";
    /// LRU hash from [`crate::FragKey`] to [`crate::FragEntry`]: the classification of the first
    /// fragment of each recent fragmented datagram, which its other fragments follow.
    pub const FRAGMENTS: &str = "RL_FRAGMENTS";
    /// The first-seen table of earlier versions (replaced by the bucket store): no longer
    /// created, only removed by `detach` where an older version left it.
    pub const LEGACY_FIRST_SEEN: &str = "RL_FIRST_SEEN";
    /// [`crate::RuleMeta`] records indexed by rule id. Written and read by user space only, so a
    /// restarted agent can tell which named rule each id holds.
    pub const RULE_META: &str = "RL_RULE_META";
    /// Array of `u32` words ([`crate::v4_table`]): for each IPv4 /16 and each half of the prefix trie,
    /// the outcome of the trie's lookup and candidate walk where one outcome holds for the whole
    /// /16, so that most IPv4 sources are classified with one array read instead of the trie.
    /// Memory-mappable: the agent writes it in place.
    pub const V4_TABLE: &str = "RL_V4_TABLE";
    /// Array of `u64` words where the cluster sync finds the keys it has not published: first
    /// the [`crate::GROWN_SLOTS`], buckets of cluster-scoped limits whose count just passed a
    /// power of two ([`crate::grown_entry`]); then a bit for each page of the bucket store
    /// ([`crate::new_page_bit`]), set by the program when it creates a bucket of a
    /// cluster-scoped limit in that page. The agent's sync takes (swaps to 0) both every round
    /// and reads those records and pages. So a new key is found at the next round however large
    /// the store is, not at the next walk of the whole store (paced to a tenth of a core:
    /// seconds apart for millions of buckets, while every host refilled the key at its whole
    /// rate), and a heavy one however many new keys a flood makes. Memory-mappable; capacity
    /// set at load ([`crate::new_pages_words`]).
    pub const NEW_PAGES: &str = "RL_NEW_PAGES";
    /// The first-packet slots of versions before they moved into the lines of [`BUCKET_TAGS`]:
    /// no longer created, only removed by `detach` where an older version left it.
    pub const LEGACY_FIRST_PACKETS: &str = "RL_FIRST_PACKETS";
    /// Array of 64-byte lines ([`crate::TagLine`]), one for each [`crate::TAG_LINE_RECORDS`]
    /// records of [`BUCKETS`]: a tag byte for each of them ([`crate::bucket_tag`]; a record that
    /// holds a key has its tag, so a key none of whose candidates' tags is its own has no
    /// record), then the group's first-packet slots ([`crate::first_stamp`],
    /// [`crate::first_pick`]): for keys whose first packet passed without a bucket, when that
    /// bucket would be full again, so that a second packet before then makes the bucket owing
    /// the first's charge. Memory-mappable; capacity set at load ([`crate::bucket_tag_lines`]).
    pub const BUCKET_TAGS: &str = "RL_BUCKET_TAGS";
}

/// Name of the XDP program (the function name in `ratelimit-ebpf`).
pub const PROGRAM_NAME: &str = "ratelimit";

/// Number of rule ids: capacity of [`map_names::RULES`] and [`map_names::RULE_STATS`].
pub const MAX_RULES: u32 = 16_384;
/// Capacity of the prefix trie. Both generations live in it during a swap, so this is twice the
/// number of distinct prefixes one rule set may hold.
pub const MAX_PREFIXES: u32 = 524_288;

/// Capacity of [`map_names::FRAGMENTS`]: fragmented datagrams remembered at once.
pub const MAX_FRAGMENTED: u32 = 16_384;
