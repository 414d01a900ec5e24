//! Cluster-wide budgets: agents gossip each heavy source's demand under a `scope = "cluster"`
//! limit (the packets that reached its bucket), and every agent gives its local bucket the share
//! of the budget its own demand is of the cluster's, so N hosts together admit what one host
//! with the rule would.
//!
//! Membership, failure detection and dissemination are chitchat's (Quickwit's scuttlebutt
//! anti-entropy gossip with a phi-accrual failure detector): each agent publishes its counters as
//! key-values of its own node state, and chitchat brings every peer's state to everyone. chitchat
//! does not authenticate, so its datagrams go through [`transport`], which seals each one with
//! ChaCha20-Poly1305 under a key derived from `[cluster] key_file` and the cluster id.
//!
//! # Layout
//! - [`key`]: the key file, its checks, the derived key.
//! - [`wire`]: the sealed datagram format (nonce, time, fragments, replay window).
//! - [`transport`]: chitchat's transport over the sealed format.
//! - [`gossip`]: chitchat's server, restarted (as a new generation) when a socket error ends it.
//! - [`publish`]: the local counters and the choice of the heaviest keys.
//! - [`remote`]: the peers' counters and their demand, per peer incarnation.
//! - [`shares`]: the share of a key's budget, and slowing a pinned bucket's refill to it.
//! - [`sync`]: the round that ties them together; [`status`]: what `peers`, `status` and the
//!   metrics show.
//! - [`redis`]: under `backend = "redis"`, the Redis store the agents exchange their demand
//!   through instead of gossip (`sync::ExchangeLoop` runs the same round over it).
//! - `sim` (tests only): a simulated cluster running the real share arithmetic against bursty,
//!   uneven and spoofed arrivals, and the property test of docs/cluster.md's bound.
//!
//! # Accuracy and failures
//! Counters are cumulative and per epoch, so lost, repeated or reordered gossip counts nothing
//! twice. Shares follow demand, not admissions: there is no feedback from what a host admitted
//! to what the others admit, so the cluster settles within a few sync intervals of a change of
//! demand. Over any interval the cluster admits at most `rate x T + (2 x hosts - 1) x burst +
//! (hosts - 1) x rate x lag` (each host's bucket holds the burst, or `hosts x share` bursts if
//! more; shares follow figures a lag old): see docs/cluster.md, "Accuracy". A peer not heard for the peer timeout ([`timing::Timing::peer_timeout`]) stops being counted (its demand takes no
//! share): in a partition each side enforces the budget on its own (fail open). The XDP program
//! enforces the local bucket whether or not the agent runs.
//!
//! # Trust
//! A peer holding the key can claim any demand: that takes this host's share of a key down to
//! nothing while it claims (as the peer could, by admitting the rate itself), but a share word
//! only slows the bucket's clock, its tokens kept, so it leaves no debt and the source is
//! admitted again a few rounds after the claims stop ([`shares`]).

pub mod gossip;
pub mod inspect;
pub mod key;
pub mod partition;
pub mod publish;
pub mod redis;
pub mod remote;
pub mod shares;
#[cfg(test)]
mod sim;
pub mod status;
pub mod sync;
pub mod timing;
pub mod transport;
pub mod wire;

use std::{net::SocketAddr, path::Path, sync::Arc, time::Duration};

use chitchat::{ChitchatConfig, ChitchatId, FailureDetectorConfig, ProtocolVersion};

pub use self::status::{ClusterStatus, CounterValues, HolderStatus, KeyStatus, PeerStatus};
use self::{gossip::Gossip, key::ClusterKey, status::Shared, transport::SecureTransport};
use tokio::sync::watch;

use crate::{compile::CompiledRuleSet, config::ClusterConfig, maps::PinnedMaps};

/// Why the cluster sync cannot start (the key file, the listen address, the pinned maps, gossip).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ClusterError(String);

pub use self::timing::MIN_PEER_TIMEOUT;
pub use crate::config::MAX_KEYS;
/// How long chitchat keeps a dead peer's state before forgetting it.
const DEAD_NODE_GRACE: Duration = Duration::from_secs(600);
/// How long chitchat keeps a deleted key's tombstone.
const TOMBSTONE_GRACE: Duration = Duration::from_secs(60);

/// chitchat's phi threshold: with [`failure_detector`]'s mean, a silent peer is declared dead
/// between [`DEAD_AFTER`] (2) and this many (2.4) peer timeouts of silence.
pub const PHI_THRESHOLD: f64 = 2.4;
/// The fewest peer timeouts of silence after which chitchat declares a peer dead:
/// [`PHI_THRESHOLD`] x 5/6 (see [`failure_detector`]).
pub const DEAD_AFTER: f64 = PHI_THRESHOLD * 5.0 / 6.0;

/// chitchat's failure detector for a peer timeout of `timeout`: a peer that stops is declared
/// dead after between [`DEAD_AFTER`] (2) and [`PHI_THRESHOLD`] (2.4) timeouts of silence (plus
/// up to one gossip interval, when liveness is next updated), never sooner; so from the timeout
/// on it is shown `silent` and no longer counted, and only later `dead`.
///
/// chitchat's phi is the silence divided by a mean heartbeat interval smoothed with a prior:
/// `(sum of the last sampling_window_size intervals + 5 x initial_interval) / (n + 5)`, where
/// intervals longer than `max_interval` are left out. With a window of one interval, no interval
/// longer than the timeout, and the timeout as the prior, that mean lies between 5/6 of the
/// timeout and the timeout whatever the heartbeats did before, so phi crosses [`PHI_THRESHOLD`]
/// between 2 and 2.4 timeouts of silence. (chitchat's own window of 1000 intervals follows the
/// rate at which a peer's heartbeat is seen to advance, which is every message it handles: a
/// fraction of the sync interval. A stopped peer was then dead after about 5 sync intervals,
/// long before the timeout, and `silent` was never shown.) After a death, chitchat forgets the
/// interval: the peer is alive again from its second heartbeat on.
#[must_use]
pub fn failure_detector(timeout: Duration) -> FailureDetectorConfig {
    FailureDetectorConfig {
        phi_threshold: PHI_THRESHOLD,
        sampling_window_size: 1,
        max_interval: timeout,
        initial_interval: timeout,
        dead_node_grace_period: DEAD_NODE_GRACE,
    }
}

/// Checks what can be checked before anything starts (before the dataplane is touched, so a
/// failure here changes nothing in force): the key file, and the address to advertise.
pub fn check(config: &ClusterConfig) -> Result<(), ClusterError> {
    if let Some(redis) = &config.redis {
        if let Some(p) = &redis.password_file {
            crate::config::read_redis_password(p)
                .map_err(|e| ClusterError(format!("[cluster] redis_password_file: {e}")))?;
        }
        return Ok(());
    }
    ClusterKey::load(&gossip_key_file(config)?, &config.cluster_id)
        .map_err(|e| ClusterError(e.to_string()))?;
    advertise_addr(config).map(|_| ())
}

/// `[cluster] key_file` (required under gossip: the config refuses a table without it).
fn gossip_key_file(config: &ClusterConfig) -> Result<std::path::PathBuf, ClusterError> {
    config
        .key_file
        .clone()
        .ok_or_else(|| ClusterError("[cluster] key_file: missing (backend = \"gossip\")".into()))
}

/// `[cluster] listen` (required under gossip).
fn gossip_listen(config: &ClusterConfig) -> Result<SocketAddr, ClusterError> {
    config
        .listen
        .ok_or_else(|| ClusterError("[cluster] listen: missing (backend = \"gossip\")".into()))
}

/// The running cluster sync, as the servers that show its status hold it.
#[derive(Clone, Debug)]
pub struct ClusterHandle {
    shared: Arc<Shared>,
}

impl ClusterHandle {
    /// Members and counters now.
    #[must_use]
    pub fn status(&self) -> ClusterStatus {
        self.shared.status()
    }
}

/// Starts gossip on `[cluster] listen` and the sync loop over the maps pinned in `pin_dir`, for
/// the cluster-scoped rules among `rules` (the agent's rules in force, followed as they change).
/// Returns the handle for the status and the task to abort at shutdown (which also stops gossip).
pub async fn spawn(
    config: &ClusterConfig,
    rules: watch::Receiver<Arc<CompiledRuleSet>>,
    pin_dir: &Path,
) -> Result<(ClusterHandle, tokio::task::JoinHandle<()>), ClusterError> {
    if config.redis.is_some() {
        return spawn_redis(config, rules, pin_dir).await;
    }
    let listen = gossip_listen(config)?;
    let key = ClusterKey::load(&gossip_key_file(config)?, &config.cluster_id)
        .map_err(|e| ClusterError(e.to_string()))?;
    let advertise = advertise_addr(config)?;
    let generation = unix_ms();
    let node_id = format!("{}/{advertise}", hostname());
    let timing = timing::Timing::new(config.sync_interval_ms);
    let timeout = timing.peer_timeout();
    let shared = Arc::new(Shared::default());
    {
        let mut view = shared.view();
        *view = ClusterStatus {
            cluster_id: config.cluster_id.clone(),
            node_id: node_id.clone(),
            generation,
            listen: Some(listen),
            backend: "gossip",
            advertise: Some(advertise),
            sync_interval_ms: config.sync_interval_ms,
            max_keys: config.max_keys,
            peer_timeout_ms: u64::try_from(timeout.as_millis()).unwrap_or(u64::MAX),
            gossip: "running",
            on_partition: config.on_partition.as_str(),
            hosts_heard: 1,
            hosts_known: 1,
            budget_share: 1.0,
            ..ClusterStatus::default()
        };
    }
    let config_of: Arc<dyn Fn(u64) -> ChitchatConfig + Send + Sync> = {
        let (node_id, cluster_id, listen) = (node_id.clone(), config.cluster_id.clone(), listen);
        let seeds: Vec<String> = config.seeds.iter().map(ToString::to_string).collect();
        Arc::new(move |generation| ChitchatConfig {
            chitchat_id: ChitchatId::new(node_id.as_str(), generation, advertise),
            cluster_id: cluster_id.clone(),
            gossip_interval: timing.gossip(),
            listen_addr: listen,
            seed_nodes: seeds.clone(),
            failure_detector_config: failure_detector(timeout),
            marked_for_deletion_grace_period: TOMBSTONE_GRACE,
            catchup_callback: None,
            extra_liveness_predicate: None,
            // Every agent of this version decodes V1 (compressed digests).
            protocol_version: ProtocolVersion::V1,
        })
    };
    let factory = SyncFactory {
        config_of,
        key,
        cluster_id: config.cluster_id.clone(),
        advertise,
        shared: shared.clone(),
        pin_dir: pin_dir.to_path_buf(),
        rules,
        timing,
        max_keys: config.max_keys,
        on_partition: config.on_partition,
        partition_memory_ns: config.partition_memory_s.saturating_mul(1_000_000_000),
    };
    let first = factory.build(generation).await?;
    tracing::info!(
        node = %node_id,
        generation,
        listen = %listen,
        seeds = ?config.seeds,
        cluster_id = %config.cluster_id,
        sync_interval_ms = config.sync_interval_ms,
        "cluster gossip started"
    );
    let first: Started = (generation, Box::pin(first.run()));
    let factory = Arc::new(factory);
    let task = tokio::spawn(supervise_sync(
        shared.clone(),
        Some(first),
        move || {
            let factory = factory.clone();
            async move {
                let generation = unix_ms();
                let sync = factory.build(generation).await?;
                let generation = sync.chitchat.handle().chitchat_id().generation_id;
                Ok::<Started, ClusterError>((generation, Box::pin(sync.run())))
            }
        },
        gossip::MIN_BACKOFF,
    ));
    Ok((ClusterHandle { shared }, task))
}

/// [`spawn`] under `backend = "redis"`: the sync loop exchanging demand through the Redis store
/// ([`sync::ExchangeLoop`]), supervised as gossip's is. The node id is `hostname/ADDRESS`, the
/// address this host reaches the first store address from (unique per host however many share
/// a hostname), and the store is first reached in the first round (until then, and whenever it
/// cannot be, every bucket keeps the whole rate: fail open).
async fn spawn_redis(
    config: &ClusterConfig,
    rules: watch::Receiver<Arc<CompiledRuleSet>>,
    pin_dir: &Path,
) -> Result<(ClusterHandle, tokio::task::JoinHandle<()>), ClusterError> {
    let redis = config
        .redis
        .clone()
        .ok_or_else(|| ClusterError("[cluster] redis: missing".into()))?;
    let generation = unix_ms();
    let local = local_addr_towards(&redis.urls).await;
    let node_id = match local {
        Some(ip) => format!("{}/{ip}", hostname()),
        None => format!("{}/{generation}", hostname()),
    };
    let timing = timing::Timing::new(config.sync_interval_ms);
    let shared = Arc::new(Shared::default());
    {
        let mut view = shared.view();
        *view = ClusterStatus {
            cluster_id: config.cluster_id.clone(),
            node_id: node_id.clone(),
            generation,
            sync_interval_ms: config.sync_interval_ms,
            max_keys: config.max_keys,
            peer_timeout_ms: timing.stale_ns() / 1_000_000,
            gossip: "running",
            backend: "redis",
            store: Some(status::StoreStatus {
                addresses: redis.urls.clone(),
                mode: "unknown",
                state: "connecting",
                ..status::StoreStatus::default()
            }),
            on_partition: config.on_partition.as_str(),
            hosts_heard: 1,
            hosts_known: 1,
            budget_share: 1.0,
            ..ClusterStatus::default()
        };
    }
    let build = {
        let (shared, pin_dir, cluster_id, node_id) = (
            shared.clone(),
            pin_dir.to_path_buf(),
            config.cluster_id.clone(),
            node_id.clone(),
        );
        let max_keys = config.max_keys;
        move |generation: u64| -> Result<Started, ClusterError> {
            let store = redis::RedisStore::new(&redis, &cluster_id, node_id.clone(), generation)
                .map_err(ClusterError)?;
            let maps = PinnedMaps::open(&pin_dir)
                .map_err(|e| ClusterError(format!("[cluster] opening the pinned maps: {e}")))?;
            let run = sync::ExchangeLoop {
                rules: rules.clone(),
                store,
                maps,
                shared: shared.clone(),
                timing,
                max_keys,
                cluster_id: cluster_id.clone(),
                node: (node_id.clone(), generation),
            }
            .run();
            Ok((generation, Box::pin(run)))
        }
    };
    let first = build(generation)?;
    tracing::info!(
        node = %node_id,
        generation,
        redis = ?config.redis.as_ref().map(|r| &r.urls),
        cluster_id = %config.cluster_id,
        sync_interval_ms = config.sync_interval_ms,
        "cluster sync started over Redis"
    );
    let build = Arc::new(build);
    let task = tokio::spawn(supervise_sync(
        shared.clone(),
        Some(first),
        move || {
            let build = build.clone();
            async move { build(unix_ms()) }
        },
        gossip::MIN_BACKOFF,
    ));
    Ok((ClusterHandle { shared }, task))
}

/// The local address this host reaches the first resolvable store address from (a UDP
/// `connect`, which sends nothing), if any.
async fn local_addr_towards(urls: &[String]) -> Option<std::net::IpAddr> {
    let hosts: Vec<String> = urls
        .iter()
        .filter_map(|u| {
            let rest = u.split_once("://")?.1;
            let authority = rest.split('/').next()?;
            Some(if authority.starts_with('[') || authority.contains(':') {
                authority.to_string()
            } else {
                format!("{authority}:6379")
            })
        })
        .collect();
    tokio::task::spawn_blocking(move || {
        use std::net::ToSocketAddrs as _;
        for h in hosts {
            let Ok(addrs) = h.to_socket_addrs() else {
                continue;
            };
            for a in addrs {
                let bind: SocketAddr = if a.is_ipv4() {
                    ([0, 0, 0, 0], 0).into()
                } else {
                    ([0u16; 8], 0).into()
                };
                let probe = std::net::UdpSocket::bind(bind)
                    .and_then(|s| s.connect(a).and_then(|()| s.local_addr()));
                if let Ok(local) = probe {
                    if !local.ip().is_unspecified() {
                        return Some(local.ip());
                    }
                }
            }
        }
        None
    })
    .await
    .ok()
    .flatten()
}

/// What it takes to start the sync loop (and its gossip) again.
struct SyncFactory {
    config_of: Arc<dyn Fn(u64) -> ChitchatConfig + Send + Sync>,
    key: ClusterKey,
    cluster_id: String,
    advertise: SocketAddr,
    shared: Arc<Shared>,
    pin_dir: std::path::PathBuf,
    rules: watch::Receiver<Arc<CompiledRuleSet>>,
    timing: timing::Timing,
    max_keys: usize,
    on_partition: crate::config::OnPartition,
    partition_memory_ns: u64,
}

impl SyncFactory {
    /// A sync loop over a new gossip incarnation (`generation`) and fresh handles on the maps.
    async fn build(&self, generation: u64) -> Result<sync::SyncLoop, ClusterError> {
        let err =
            |what: &str, e: &dyn std::fmt::Display| ClusterError(format!("[cluster] {what}: {e}"));
        let transport = SecureTransport::new(
            self.key.clone(),
            self.cluster_id.clone(),
            self.shared.clone(),
        )
        .with_advertise(self.advertise)
        .with_max_wait(self.timing.interval());
        let maps =
            PinnedMaps::open(&self.pin_dir).map_err(|e| err("opening the pinned maps", &e))?;
        let config_of = self.config_of.clone();
        let chitchat = Gossip::spawn(
            generation,
            Box::new(move |g| config_of(g)),
            Box::new(transport),
            self.shared.clone(),
            gossip::MIN_BACKOFF,
        )
        .await
        .map_err(|e| err("starting gossip", &format!("{e:#}")))?;
        Ok(sync::SyncLoop {
            rules: self.rules.clone(),
            chitchat,
            maps,
            shared: self.shared.clone(),
            timing: self.timing,
            max_keys: self.max_keys,
            partition: partition::Partition::new(self.on_partition, self.partition_memory_ns),
        })
    }
}

/// Aborts a task when dropped (the supervisor's own abort at shutdown reaches the loop it runs).
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What a task's end says: its panic message, or that it returned.
fn why_ended(r: Result<(), tokio::task::JoinError>) -> String {
    match r {
        Ok(()) => "the cluster sync loop ended".to_string(),
        Err(e) if e.is_panic() => {
            let p = e.into_panic();
            let msg = p
                .downcast_ref::<&str>()
                .map(ToString::to_string)
                .or_else(|| p.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic".to_string());
            format!("the cluster sync loop panicked: {msg}")
        }
        Err(e) => format!("the cluster sync loop stopped: {e}"),
    }
}

/// A sync loop started: its gossip generation and the loop to run.
type Started = (
    u64,
    std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>,
);

/// Runs the sync loop (`first`, then what `build` starts), and when it ends (a panic in a round,
/// a bucket scan that panicked) starts it again, over a new gossip incarnation, after
/// `min_backoff`, doubling the wait (up to [`gossip::MAX_BACKOFF`]) while it keeps ending within
/// a minute. Meanwhile the status shows gossip `restarting` with the error
/// (`ratelimit_cluster_gossip_up` 0), the error is logged, every end counts in `sync_restarts`,
/// no peer is shown, and the shares lapse within their lag allowance: every bucket refills at
/// the whole rate (fail open, visibly). (Before, the agent kept the task's handle only to abort
/// it: a sync loop that died left `status` at `running` and cluster enforcement gone.)
async fn supervise_sync<B, F>(
    shared: Arc<Shared>,
    first: Option<Started>,
    build: B,
    min_backoff: Duration,
) where
    B: Fn() -> F + Send,
    F: std::future::Future<Output = Result<Started, ClusterError>> + Send,
{
    let mut next = first;
    let mut backoff = min_backoff;
    loop {
        let (_, run) = match next.take() {
            Some(s) => s,
            None => match build().await {
                Ok((generation, run)) => {
                    tracing::warn!(
                        generation,
                        "cluster sync restarted (a new gossip incarnation)"
                    );
                    shared.gossip_running(generation);
                    (generation, run)
                }
                Err(e) => {
                    tracing::error!(error = %e, retry_in_ms = backoff.as_millis(), "cluster sync: restart failed");
                    set_sync_down(&shared, e.to_string());
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(gossip::MAX_BACKOFF);
                    continue;
                }
            },
        };
        let started = std::time::Instant::now();
        let task = tokio::spawn(run);
        let abort = AbortOnDrop(task.abort_handle());
        let why = why_ended(task.await);
        drop(abort);
        if started.elapsed() >= Duration::from_secs(60) {
            backoff = min_backoff;
        }
        tracing::error!(error = %why, retry_in_ms = backoff.as_millis(), "cluster sync stopped: this host enforces its buckets alone (every share lapses: fail open) until it restarts");
        shared
            .counters
            .sync_restarts
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        set_sync_down(&shared, why);
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(gossip::MAX_BACKOFF);
    }
}

fn set_sync_down(shared: &Shared, error: String) {
    let mut view = shared.gossip_restarting(error);
    view.peers.clear();
    view.keys.clear();
    view.hosts_heard = 1;
}

/// The address peers reach us at: `listen`, or when that is a wildcard, the local address the
/// kernel would use towards the first seed.
fn advertise_addr(config: &ClusterConfig) -> Result<SocketAddr, ClusterError> {
    let listen = gossip_listen(config)?;
    if !listen.ip().is_unspecified() {
        return Ok(listen);
    }
    for seed in &config.seeds {
        let bind: SocketAddr = if seed.is_ipv4() {
            ([0, 0, 0, 0], 0).into()
        } else {
            ([0u16; 8], 0).into()
        };
        // connect() on UDP sends nothing: it only picks the route and source address.
        let probe = std::net::UdpSocket::bind(bind)
            .and_then(|s| s.connect(seed).and_then(|()| s.local_addr()));
        if let Ok(local) = probe {
            if !local.ip().is_unspecified() && !local.ip().is_loopback() {
                return Ok(SocketAddr::new(local.ip(), listen.port()));
            }
        }
    }
    Err(ClusterError(format!(
        "[cluster] listen = \"{listen}\" is a wildcard address and no seed is reachable to tell which address peers should use; \
         set listen to this host's address"
    )))
}

/// This host's name, at most 64 bytes (Linux's limit), so that its node id (`hostname/gossip
/// address`) stays within what peers accept ([`inspect::MAX_NODE_ID_LEN`]).
fn hostname() -> String {
    let mut h = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map_or_else(|_| "localhost".to_string(), |h| h.trim().to_string());
    let mut end = h.len().min(64);
    while !h.is_char_boundary(end) {
        end -= 1;
    }
    h.truncate(end);
    h
}

/// Wall-clock Unix milliseconds.
pub(crate) fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use chitchat::{spawn_chitchat, transport::ChannelTransport, ChitchatHandle};
    use tokio::time::Instant;

    use super::*;

    const GOSSIP: Duration = Duration::from_millis(100);

    async fn node(
        name: &str,
        port: u16,
        seed: u16,
        timeout: Duration,
        transport: &ChannelTransport,
    ) -> ChitchatHandle {
        let addr: SocketAddr = ([127, 0, 0, 1], port).into();
        spawn_chitchat(
            ChitchatConfig {
                chitchat_id: ChitchatId::new(name.to_string(), 1, addr),
                cluster_id: "test".to_string(),
                gossip_interval: GOSSIP,
                listen_addr: addr,
                seed_nodes: vec![format!("127.0.0.1:{seed}")],
                failure_detector_config: failure_detector(timeout),
                marked_for_deletion_grace_period: TOMBSTONE_GRACE,
                catchup_callback: None,
                extra_liveness_predicate: None,
                protocol_version: ProtocolVersion::V1,
            },
            Vec::new(),
            transport,
        )
        .await
        .unwrap()
    }

    async fn live(at: &ChitchatHandle) -> HashSet<ChitchatId> {
        at.with_chitchat(|c| c.live_nodes().cloned().collect())
            .await
    }

    /// How long after `from` `at` sees `whom` become `live` (polled every 10 ms).
    async fn until(at: &ChitchatHandle, whom: &ChitchatId, live_: bool, from: Instant) -> Duration {
        loop {
            if live(at).await.contains(whom) == live_ {
                return from.elapsed();
            }
            assert!(
                from.elapsed() < Duration::from_secs(60),
                "{whom:?} never became {}",
                if live_ { "live" } else { "dead" }
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// chitchat with [`failure_detector`] (on tokio's paused clock, which its detector uses):
    /// a peer cut off is alive until 2 peer timeouts of silence, dead by 2.4 (plus a gossip
    /// interval, when liveness is next updated, and the last heartbeat's age at the cut, up to
    /// a gossip interval); heard again it is alive within a few gossip intervals; and cut off
    /// again right after (chitchat forgot its intervals at the death) it again lives 2 timeouts.
    /// With chitchat's default window the peer was dead after about 5 gossip intervals, before
    /// the timeout, so `silent` could not be shown.
    #[tokio::test(start_paused = true)]
    async fn a_peer_cut_off_is_declared_dead_between_two_and_two_point_four_timeouts() {
        let timeout = Duration::from_secs(3);
        let transport = ChannelTransport::default();
        let a = node("a", 1, 2, timeout, &transport).await;
        let b = node("b", 2, 1, timeout, &transport).await;
        let (a_addr, b_addr) = (
            a.chitchat_id().gossip_advertise_addr,
            b.chitchat_id().gossip_advertise_addr,
        );
        let b_id = b.chitchat_id().clone();
        until(&a, &b_id, true, Instant::now()).await;
        // A long healthy run first: many short heartbeat intervals, which made chitchat's
        // default detector quick to declare death.
        tokio::time::sleep(Duration::from_secs(30)).await;
        assert!(live(&a).await.contains(&b_id), "died while heard");

        let min = timeout.mul_f64(DEAD_AFTER) - GOSSIP;
        let max = timeout.mul_f64(PHI_THRESHOLD) + 2 * GOSSIP + Duration::from_millis(10);
        for round in 0..3 {
            transport.remove_link(a_addr, b_addr).await;
            let dead = until(&a, &b_id, false, Instant::now()).await;
            assert!(
                dead >= min && dead <= max,
                "round {round}: dead after {dead:?}, want {min:?}..={max:?}"
            );
            transport.add_link(a_addr, b_addr).await;
            let back = until(&a, &b_id, true, Instant::now()).await;
            println!("round {round}: dead after {dead:?}, alive again after {back:?}");
            assert!(
                back <= 5 * GOSSIP,
                "round {round}: alive again only after {back:?}"
            );
        }
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    }

    /// A sync loop that panics (as the sync loop did on the first `set` after a delta left its
    /// own max version at `u64::MAX`) is seen at once: the status shows gossip `restarting`
    /// with the panic's message, `sync_restarts` counts it; after the backoff a new loop runs
    /// (a new generation) and the status is `running` again. A loop that fails to start is
    /// retried; aborting the supervisor aborts the loop it runs.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_sync_loop_that_dies_is_shown_down_and_restarted() {
        use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
        let shared = Arc::new(Shared::default());
        shared.view.lock().unwrap().gossip = "running";
        let builds = Arc::new(AtomicU64::new(0));
        let running = Arc::new(AtomicU64::new(0));
        let first: Started = (
            1,
            Box::pin(async {
                tokio::time::sleep(Duration::from_millis(50)).await;
                panic!("attempt to add with overflow");
            }),
        );
        let (b, r) = (builds.clone(), running.clone());
        let task = tokio::spawn(supervise_sync(
            shared.clone(),
            Some(first),
            move || {
                let (b, r) = (b.clone(), r.clone());
                async move {
                    // The first restart fails (the old socket not released yet, say).
                    if b.fetch_add(1, SeqCst) == 0 {
                        return Err(ClusterError("[cluster] starting gossip: busy".into()));
                    }
                    let run: Started = (
                        2,
                        Box::pin(async move {
                            r.fetch_add(1, SeqCst);
                            std::future::pending::<()>().await;
                        }),
                    );
                    Ok(run)
                }
            },
            Duration::from_millis(300),
        ));
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let st = shared.status();
            if st.gossip == "restarting" {
                assert!(
                    st.gossip_error
                        .as_deref()
                        .is_some_and(|e| e.contains("panicked: attempt to add with overflow")),
                    "{st:?}"
                );
                assert_eq!(st.counters.sync_restarts, 1);
                break;
            }
            assert!(Instant::now() < deadline, "the loop's death was not shown");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        while running.load(SeqCst) == 0 {
            assert!(Instant::now() < deadline, "the loop was not restarted");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let st = shared.status();
        assert_eq!(
            (st.gossip, st.gossip_error, st.generation),
            ("running", None, 2)
        );
        assert_eq!(builds.load(SeqCst), 2, "a failed start is retried");
        task.abort();
        let _ = task.await;
    }
}
