//! The config as the agent uses it: [`Config`] with its `[agent]` and `[cluster]` tables, and the
//! limits and defaults of every setting. The `[[rule]]` table is [`RuleConfig`] (`rule.rs`), its
//! checks are in `validate.rs`, and the words settings are spelled with in `keywords.rs`.

use std::{net::SocketAddr, path::PathBuf};

use serde::{Deserialize, Serialize};

use super::{AttachMode, RuleConfig};

/// Default control socket path (`[agent] socket`).
pub const DEFAULT_SOCKET: &str = "/run/ratelimit/agent.sock";
/// Default bpffs directory for pinned maps and links (`[agent] pin_path`).
pub const DEFAULT_PIN_PATH: &str = "/sys/fs/bpf/ratelimit";
/// Default `[agent] state_dir`.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/ratelimit";
/// Smallest accepted `[agent] max_buckets`.
pub const MIN_MAX_BUCKETS: u32 = 16;
/// Largest accepted `[agent] max_buckets` (2^26).
pub const MAX_MAX_BUCKETS: u32 = 1 << 26;
/// Largest `rate` (packets/s): one packet then costs 1 ns, the clock's resolution.
pub const MAX_RATE: u64 = 1_000_000_000;
/// Largest `bytes_rate` (bytes/s, 8 Tbit/s): keeps `byte_interval_fp` non-zero.
pub const MAX_BYTES_RATE: u64 = 1_000_000_000_000;
/// Largest time a full bucket takes to refill (`burst / rate`), in nanoseconds: one hour. Bounds
/// the tolerances so that the kernel's `now + tolerance` arithmetic cannot overflow.
pub const MAX_TOLERANCE_NS: u64 = 3_600_000_000_000;
/// Smallest `bytes_burst`: one full Ethernet frame must be able to pass.
pub const MIN_BYTES_BURST: u64 = 1514;
/// Floor of the default `bytes_burst` (the default is `max(bytes_rate, 65536)`).
pub const DEFAULT_BYTES_BURST_FLOOR: u64 = 65_536;
/// Longest rule name.
pub const MAX_NAME_LEN: usize = 64;
/// Most source prefixes one rule may list (`source` array or `source_file`).
pub const MAX_RULE_PREFIXES: usize = 250_000;
/// Most distinct source prefixes over all rules: half the prefix trie, because the trie holds
/// the installed and the next rule set during a swap.
pub const MAX_TOTAL_PREFIXES: usize = ratelimit_common::MAX_PREFIXES as usize / 2;

/// Default of `[cluster] max_keys`: most keys each agent publishes, and reads from each peer, per
/// sync, the heaviest first. Bounds message size, memory and CPU however many sources there are.
pub const MAX_KEYS: usize = 1000;

pub(super) const NS_PER_SEC: u64 = 1_000_000_000;

/// A parsed and validated config file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Config {
    /// `[agent]`: how the agent attaches and where it listens.
    pub agent: AgentConfig,
    /// `[[rule]]` tables, in file order. May be empty: then every packet passes.
    pub rules: Vec<RuleConfig>,
    /// `[cluster]`: peers sharing cluster-scoped budgets, if any.
    pub cluster: Option<ClusterConfig>,
}

/// The `[agent]` table.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct AgentConfig {
    /// Interfaces the XDP program attaches to.
    pub interfaces: Vec<String>,
    /// XDP attach mode.
    pub mode: AttachMode,
    /// Control API Unix socket.
    pub socket: PathBuf,
    /// Prometheus endpoint, if enabled.
    pub metrics: Option<SocketAddr>,
    /// Capacity of the bucket map (tracked sources).
    pub max_buckets: u32,
    /// bpffs directory where maps and links are pinned (absolute).
    pub pin_path: PathBuf,
    /// Count would-be drops but pass everything, for every rule.
    pub dry_run: bool,
    /// Emit debug records from the XDP program.
    pub ebpf_log: bool,
    /// Log format on stderr (`--log-format` overrides it; read at start, not on reload).
    pub log_format: LogFormat,
    /// Where the agent keeps what it learns across restarts (`suggest`'s history; absolute).
    pub state_dir: PathBuf,
    /// Learn from the traffic for `suggest` (a walk of the store a second, its history in
    /// `state_dir`); read at start only.
    pub learn: bool,
}

impl Default for AgentConfig {
    fn default() -> Self {
        Self {
            interfaces: Vec::new(),
            mode: AttachMode::Auto,
            socket: PathBuf::from(DEFAULT_SOCKET),
            metrics: None,
            max_buckets: ratelimit_common::DEFAULT_MAX_BUCKETS,
            pin_path: PathBuf::from(DEFAULT_PIN_PATH),
            dry_run: false,
            ebpf_log: false,
            log_format: LogFormat::Plain,
            state_dir: PathBuf::from(DEFAULT_STATE_DIR),
            learn: true,
        }
    }
}

/// The `[cluster]` table. Parsed and checked for shape only; the cluster sync consumes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ClusterConfig {
    /// How the agents exchange their demand: gossip between them (the default) or a Redis store.
    pub backend: ClusterBackend,
    /// Address the gossip transport binds (required under gossip; unused under Redis).
    pub listen: Option<SocketAddr>,
    /// Peers contacted at startup (gossip).
    pub seeds: Vec<SocketAddr>,
    /// Shared secret authenticating cluster messages (required under gossip; unused under Redis).
    pub key_file: Option<PathBuf>,
    /// The Redis store (`backend = "redis"` only).
    pub redis: Option<RedisConfig>,
    /// How often consumption is exchanged, in milliseconds (10..=10000).
    pub sync_interval_ms: u64,
    /// Name separating independent clusters on one network.
    pub cluster_id: String,
    /// Most keys (heavy sources) published per sync, and read from each peer (1..=100000,
    /// default 1000): bounds message size, CPU and the state a peer can make us hold.
    pub max_keys: usize,
    /// What a part of the cluster enforces while it cannot hear the rest.
    pub on_partition: OnPartition,
    /// Under `share`, how long a host no longer heard still counts among the hosts last known
    /// alive, in seconds (1..=86400, default 600).
    pub partition_memory_s: u64,
}

/// `[cluster] backend`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ClusterBackend {
    /// The agents gossip their demand to each other (chitchat over sealed UDP).
    #[default]
    Gossip,
    /// The agents exchange their demand through a Redis server or Redis Cluster.
    Redis,
}

impl ClusterBackend {
    /// The spelling in the config file and the status.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Gossip => "gossip",
            Self::Redis => "redis",
        }
    }
}

/// Default of `[cluster] redis_connect_timeout_ms`.
pub const DEFAULT_REDIS_CONNECT_TIMEOUT_MS: u64 = 1000;
/// Default of `[cluster] redis_command_timeout_ms`.
pub const DEFAULT_REDIS_COMMAND_TIMEOUT_MS: u64 = 250;
/// The range of `[cluster] redis_connect_timeout_ms` and `redis_command_timeout_ms`.
pub const REDIS_TIMEOUT_MS: std::ops::RangeInclusive<u64> = 10..=60_000;
/// Most `[cluster] redis` URLs (seeds of a Redis Cluster).
pub const MAX_REDIS_URLS: usize = 64;
/// Largest `redis_password_file` read.
pub const MAX_REDIS_PASSWORD_FILE: u64 = 4096;
/// Largest `redis_ca_file` read.
pub const MAX_REDIS_CA_FILE: u64 = 1 << 20;

/// The Redis store of `backend = "redis"`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RedisConfig {
    /// `redis://HOST:PORT` or `rediss://HOST:PORT` (TLS), one server or seeds of a Redis
    /// Cluster (told apart when connecting), without credentials.
    pub urls: Vec<String>,
    /// The ACL user, if not `default`.
    pub user: Option<String>,
    /// The file holding the password (checked as `key_file` is).
    pub password_file: Option<PathBuf>,
    /// PEM certificates a `rediss://` store's certificate must chain to, instead of the
    /// system's roots.
    pub ca_file: Option<PathBuf>,
    /// How long a connection attempt may take, ms.
    pub connect_timeout_ms: u64,
    /// How long a round's commands may take, ms.
    pub command_timeout_ms: u64,
}

/// Default of `[cluster] partition_memory_s`: ten minutes, as long as the gossip library keeps a
/// dead member's state.
pub const DEFAULT_PARTITION_MEMORY_S: u64 = 600;

/// `[cluster] on_partition`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OnPartition {
    /// Each side of a partition enforces the whole budget on its own.
    #[default]
    FailOpen,
    /// Each side enforces `budget x hosts it hears / hosts last known alive`.
    Share,
}

impl OnPartition {
    /// The spelling in the config file and the status.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::FailOpen => "fail_open",
            Self::Share => "share",
        }
    }
}

/// How log records are written (`--log-format`, `[agent] log_format`).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize, Serialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// `LEVEL target: message key=value ...`, one line per record.
    #[default]
    Plain,
    /// One JSON object per line: `timestamp`, `level`, `target`, `fields` (with `message`).
    Json,
}
