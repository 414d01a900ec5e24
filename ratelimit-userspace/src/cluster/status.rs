//! What the cluster sync shows: members with their state and lag, and counters, for
//! `ratelimit peers`, `status`, `stats` and the metrics. The JSON shapes are part of the
//! user-facing contract: fields may be added, none renamed or removed.

use std::{
    net::{IpAddr, SocketAddr},
    sync::{
        atomic::{AtomicU64, Ordering::Relaxed},
        Mutex,
    },
};

use chitchat::ChitchatId;
use ratelimit_common::Limit;
use serde::Serialize;

#[cfg(doc)]
use super::timing::Timing;
use super::{publish::KeyName, shares};

/// The cluster as one agent sees it.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct ClusterStatus {
    /// `[cluster] cluster_id`.
    pub cluster_id: String,
    /// This agent's node id (`hostname/advertise address`).
    pub node_id: String,
    /// This agent's incarnation (Unix milliseconds at start): a restarted agent is a new
    /// incarnation, whose counters peers track apart from the old one's.
    pub generation: u64,
    /// Address the gossip socket is bound to.
    pub listen: Option<SocketAddr>,
    /// Address peers are told to reach this agent at.
    pub advertise: Option<SocketAddr>,
    /// `[cluster] sync_interval_ms`.
    pub sync_interval_ms: u64,
    /// Most keys published (and read from each peer) per sync.
    pub max_keys: usize,
    /// A peer not heard from for this long stops being counted.
    pub peer_timeout_ms: u64,
    /// `running`, or `restarting`: chitchat's loop ended (a socket error) and is restarted
    /// with backoff; meanwhile no peer is heard, and none stays counted past the peer timeout.
    pub gossip: &'static str,
    /// Why the gossip loop last ended or failed to restart, while it is `restarting`.
    pub gossip_error: Option<String>,
    /// `[cluster] on_partition`: `fail_open` or `share`.
    pub on_partition: &'static str,
    /// This host and the peers counted now (distinct addresses).
    pub hosts_heard: u64,
    /// This host and every peer address counted within `partition_memory_s`: the hosts last
    /// known alive.
    pub hosts_known: u64,
    /// The share of each cluster budget this host enforces with the hosts it hears:
    /// `hosts_heard / hosts_known` under `share`, 1 under `fail_open`.
    pub budget_share: f64,
    /// Other members, by node id then generation.
    pub peers: Vec<PeerStatus>,
    /// Counters since the agent started.
    pub counters: CounterValues,
    /// The heaviest keys (by cluster demand, at most [`SHOWN_KEYS`]) whose share this host set
    /// in the last sync round, with each holder's demand and share: why a source is limited.
    pub keys: Vec<KeyStatus>,
    /// The last [`LATE_ROUNDS_SHOWN`] sync rounds that set their shares late (see
    /// [`LateRound`]), oldest first: when this host's enforcement lagged its peers' demand.
    pub late_rounds: Vec<LateRound>,
    /// `[cluster] backend`: `gossip` or `redis`.
    pub backend: &'static str,
    /// The Redis store the demand is exchanged through (`backend = "redis"` only).
    pub store: Option<StoreStatus>,
}

/// The Redis store as this agent reaches it (`backend = "redis"`).
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct StoreStatus {
    /// `[cluster] redis`: the URLs (without credentials).
    pub addresses: Vec<String>,
    /// `standalone` or `cluster` (a Redis Cluster), as found when connecting; `unknown` before
    /// the first connection.
    pub mode: &'static str,
    /// Under a Redis Cluster, the shards (masters serving slots) it reported when connecting.
    pub shards: Option<u64>,
    /// `connected` (the last round reached it), `connecting` (no round has yet) or `down` (the
    /// last round failed: peers' demand goes stale and the shares lapse to the whole rate).
    pub state: &'static str,
    /// Round trip of the last round's exchange with the store (all its keys, pipelined), ms.
    pub rtt_ms: Option<f64>,
    /// Rounds that reached the store.
    pub round_trips: u64,
    /// Rounds (and connection attempts) that failed.
    pub errors: u64,
    /// The last error, while `down` and after.
    pub last_error: Option<String>,
    /// When the last error happened, Unix ms.
    pub last_error_unix_ms: Option<u64>,
}

/// A sync round whose shares landed in the buckets more than [`Timing::late_after_ns`] after the round
/// was due: meanwhile the buckets kept the shares of the round before (the agent was starved
/// of CPU, or a map operation stalled). A split that changed then reaches this host's buckets
/// `late_ms` later than the sync interval promises.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct LateRound {
    /// When the shares landed, Unix milliseconds.
    pub at_unix_ms: u64,
    /// How long after the round was due, milliseconds.
    pub late_ms: u64,
    /// How long the shares had lapsed when this round renewed them, milliseconds: the time
    /// past the end of the lag allowance (3 sync intervals) the shares written before held
    /// for, during which every bucket of a cluster-scoped limit refilled at the whole rate
    /// (fail open). 0 when they had not.
    pub lapsed_ms: u64,
}

/// How many [`LateRound`]s the status keeps.
pub const LATE_ROUNDS_SHOWN: usize = 32;

/// The most keys `peers` and the metrics show the holders of: the heaviest by cluster demand.
/// With at most [`MAX_PEERS`](super::sync::MAX_PEERS) counted peers and this host holding each,
/// the metrics carry at most `10 x 65` series per key gauge.
pub const SHOWN_KEYS: usize = 10;

/// A key of a cluster-scoped limit whose share this host set in the last round, with the
/// figures the shares come from.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct KeyStatus {
    /// The rule's name.
    pub rule: String,
    /// Which of the rule's limits (1: its own, 2..: its `[[rule.limit]]`s, as in `stats`).
    pub limit: usize,
    /// The source masked to the limit's `per`, as a prefix (`198.18.0.7/32`, `0.0.0.0/0` for
    /// `per = "rule"`).
    pub key: String,
    /// Hosts holding the key: this one and the counted peers that publish it (0 demand
    /// included); its budget is divided between them.
    pub hosts: u32,
    /// The cluster's demand, packets per second that reached the key's buckets (admitted or
    /// dropped): this host's plus its counted peers'.
    pub demand_pps: f64,
    /// This host first, then each counted peer with demand for the key (by node id, then
    /// generation): its demand and its share of the budget, as this host computes them from
    /// the same figures (the shares of all holders add up to 1, times the partition factor).
    pub holders: Vec<HolderStatus>,
    /// Counted peers holding the key with no demand for it (not named: a round counts them
    /// only), each with `idle_share`.
    pub idle_holders: u32,
    /// The share of each of the `idle_holders` (an even part of the unused budget).
    pub idle_share: f64,
}

/// One host holding a key, as [`KeyStatus::holders`] lists it.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct HolderStatus {
    /// Its node id (this host's own for the first holder).
    pub node_id: String,
    /// Its incarnation.
    pub generation: u64,
    /// Its demand for the key, packets per second.
    pub demand_pps: f64,
    /// Its share of the key's budget: its bucket refills at `share x rate`.
    pub share: f64,
}

/// One key's figures in a sync round, as [`super::sync`] computes this host's share of it.
#[derive(Clone, Copy, Debug)]
pub struct KeyRound<'a> {
    /// The key.
    pub name: &'a KeyName,
    /// Its limit (for the prefix length).
    pub limit: &'a Limit,
    /// This host's demand, packets/s.
    pub demand: f64,
    /// This host's share, as set.
    pub share: f64,
    /// Hosts holding the key (see [`Round::hosts_holding`](super::remote::Round::hosts_holding)).
    pub hosts: u32,
    /// Each counted peer with demand for it, and that demand (packets/s).
    pub peers: &'a [(ChitchatId, f64)],
    /// The partition factor the share was multiplied by.
    pub factor: f64,
    /// The limit's packet rate.
    pub rate: Option<f64>,
}

/// The [`SHOWN_KEYS`] heaviest keys of a round by cluster demand (ties by key), built as the
/// round goes: a key lighter than all those kept costs one comparison.
#[derive(Debug, Default)]
pub struct HeaviestKeys(Vec<(KeyName, KeyStatus)>);

/// A demand figure as [`shares::share`] reads it (NaN or negative: 0).
fn pps(d: f64) -> f64 {
    if d.is_nan() {
        0.0
    } else {
        d.max(0.0)
    }
}

impl HeaviestKeys {
    /// Keeps `k` if it is among the heaviest so far. Each peer's share is computed as this
    /// host's is, from the same vector: [`shares::share`] of its demand against the rest.
    pub fn offer(&mut self, k: &KeyRound<'_>) {
        let local = pps(k.demand);
        let total = local + k.peers.iter().map(|(_, r)| pps(*r)).sum::<f64>();
        let heavier = |(n, s): &(KeyName, KeyStatus)| {
            s.demand_pps > total || (s.demand_pps == total && n < k.name)
        };
        let at = self.0.partition_point(heavier);
        if at >= SHOWN_KEYS {
            return;
        }
        let hosts = f64::from(k.hosts);
        let mut peers: Vec<HolderStatus> = k
            .peers
            .iter()
            .map(|(id, r)| HolderStatus {
                node_id: id.node_id.to_string(),
                generation: id.generation_id,
                demand_pps: pps(*r),
                share: shares::share(pps(*r), total - pps(*r), k.factor, k.rate, hosts),
            })
            .collect();
        peers.sort_by(|a, b| (&a.node_id, a.generation).cmp(&(&b.node_id, b.generation)));
        let idle_holders = k
            .hosts
            .saturating_sub(1)
            .saturating_sub(u32::try_from(peers.len()).unwrap_or(u32::MAX));
        let mut holders = vec![HolderStatus {
            node_id: String::new(),
            generation: 0,
            demand_pps: local,
            share: k.share,
        }];
        holders.extend(peers);
        let status = KeyStatus {
            rule: k.name.rule.clone(),
            limit: usize::from(k.name.limit) + 1,
            key: key_prefix(k.name.addr, k.limit),
            hosts: k.hosts,
            demand_pps: total,
            holders,
            idle_holders,
            idle_share: if idle_holders > 0 {
                shares::share(0.0, total, k.factor, k.rate, hosts)
            } else {
                0.0
            },
        };
        self.0.insert(at, (k.name.clone(), status));
        self.0.truncate(SHOWN_KEYS);
    }

    /// The keys kept, heaviest first, this host (the first holder of each) named `node_id`
    /// incarnation `generation`.
    #[must_use]
    pub fn into_status(self, node_id: &str, generation: u64) -> Vec<KeyStatus> {
        self.0
            .into_iter()
            .map(|(_, mut s)| {
                if let Some(me) = s.holders.first_mut() {
                    me.node_id = node_id.to_string();
                    me.generation = generation;
                }
                s
            })
            .collect()
    }
}

/// `addr` (masked) as a prefix of `limit`'s granularity.
fn key_prefix(addr: IpAddr, limit: &Limit) -> String {
    let len = match addr {
        IpAddr::V4(_) => limit.src_mask[0].count_ones().min(32),
        IpAddr::V6(_) => limit
            .src_mask
            .iter()
            .map(|w| w.count_ones())
            .sum::<u32>()
            .min(128),
    };
    format!("{addr}/{len}")
}

/// One other member.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct PeerStatus {
    /// The peer's node id.
    pub node_id: String,
    /// The peer's incarnation.
    pub generation: u64,
    /// Its gossip address.
    pub addr: SocketAddr,
    /// `alive` (heard within the timeout, its demand takes a share), `joining` (heard, but its
    /// state has not fully arrived yet), `unverified` (alive according to gossip, but no
    /// authentic datagram came from its address lately: an id only named by others, not
    /// counted), `silent` (not heard within the timeout: not counted),
    /// `dead` (the failure detector gave up on it, after 2 to 2.4 timeouts of silence: see
    /// [`super::failure_detector`]; or a newer incarnation replaced it).
    pub state: &'static str,
    /// Whether its demand takes a share of the budget here.
    pub counted: bool,
    /// Milliseconds since its heartbeat last advanced (as seen here).
    pub last_heard_ms: Option<u64>,
    /// Age of the newest consumption data held from it: our clock minus the time it published
    /// that data (needs clocks in sync; includes any offset between them).
    pub lag_ms: Option<i64>,
    /// Keys it publishes (as read here, after the cap).
    pub keys: usize,
    /// Keys of its node state held in this agent's gossip state (deleted ones included): at
    /// most `max_keys` and its sync key after each sync, whatever it publishes.
    pub stored_keys: usize,
    /// Refill withheld here for its share so far (its part, by demand, of what the local
    /// buckets did not get), in packets.
    pub charged_pkts: u64,
    /// The same in bytes.
    pub charged_bytes: u64,
    /// Always 0 since shares follow demand (nothing a peer reports is cut: a claim of any size
    /// takes at most this host's refill, see docs/cluster.md); kept so `peers --json` keeps its
    /// fields.
    pub clamped: u64,
}

/// Counter values (see [`Counters`]).
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq, Eq)]
pub struct CounterValues {
    /// Gossip datagrams accepted (authentic, fresh, well-formed).
    pub messages_in: u64,
    /// Gossip datagrams sent.
    pub messages_out: u64,
    /// Bytes of gossip received, every datagram counted (accepted or not).
    pub bytes_in: u64,
    /// Bytes of gossip sent.
    pub bytes_out: u64,
    /// Datagrams dropped because the tag did not verify (wrong key or cluster id, tampering).
    pub rejected_auth: u64,
    /// Authentic datagrams dropped as too old, from the future, or replayed.
    pub rejected_stale: u64,
    /// Datagrams dropped as not our format, or gossip from an unknown local address.
    pub rejected_malformed: u64,
    /// Datagrams dropped unread because they waited in this host's socket longer than a sync
    /// interval: the agent was behind, and newer ones from the same peers wait behind them (see
    /// `cluster::transport`).
    pub rejected_late: u64,
    /// Authentic datagrams dropped before the gossip library saw them, because they would crash
    /// or corrupt it (see `cluster::inspect`): a delta about this host's own node, a max version
    /// below a key's, a version or heartbeat no member can have reached.
    pub rejected_unsafe: u64,
    /// Ids left out of authentic digests before the gossip library saw them: new members beyond
    /// what their sender may introduce (see `cluster::inspect::Introductions`).
    pub digest_ids_stripped: u64,
    /// Gossip messages not sent to an address that has not sent this host an authentic datagram
    /// lately, beyond a probe a second to each and four a second in all (see
    /// `cluster::transport`): ids at addresses nobody there asked for.
    pub probes_withheld: u64,
    /// Sends that failed (peer unreachable, no route, a message too large for a datagram).
    pub send_errors: u64,
    /// Sync rounds run.
    pub syncs: u64,
    /// Keys this agent publishes now.
    pub keys_published: u64,
    /// Keys read from peers in the last sync (counted peers only).
    pub keys_synced: u64,
    /// Keys of peers ignored because a peer published more than `max_keys`, or peers beyond the
    /// most that are tracked.
    pub keys_dropped: u64,
    /// Rounds that ran later than the lag allowance (3 sync intervals) after the one before:
    /// the refill they take back from the buckets was cut to that allowance (fail open).
    pub charges_clamped: u64,
    /// Refill withheld from a bucket cut short by its ceiling (`tolerance + lag allowance`
    /// ahead of now; no round of the agent reaches it).
    pub debt_capped: u64,
    /// Refill withheld from local buckets for the peers' shares (and the hosts missing under
    /// `on_partition = "share"`), in packets of the limit's rate.
    pub charged_pkts: u64,
    /// The same in bytes of the limit's `bytes_rate`.
    pub charged_bytes: u64,
    /// Bucket reads or writes that failed while slowing a bucket.
    pub charge_errors: u64,
    /// Largest `lag_ms` among counted peers at the last sync (0 without peers).
    pub sync_lag_ms: u64,
    /// Microseconds the last sync round took.
    pub last_sync_us: u64,
    /// Restarts of the gossip loop attempted after it ended (each successful one is a new
    /// generation).
    pub gossip_restarts: u64,
    /// Of `charged_pkts`, what was withheld for hosts known but not heard (`on_partition =
    /// "share"`).
    pub share_charged_pkts: u64,
    /// Readings of peers' gossip refused as impossible (a sync key dated ahead of this host's
    /// clock, a sequence, epoch or counter that went back or ran ahead; see
    /// `RemoteTracker::round`): the peer's figure is left out (fail open) or started again.
    pub readings_refused: u64,
    /// Restarts of the sync loop after it ended (a panic in a round): each is a new gossip
    /// incarnation; meanwhile gossip shows `restarting`.
    pub sync_restarts: u64,
    /// Sync rounds that set their shares late (see [`LateRound`]).
    pub rounds_late: u64,
}

/// Live counters, shared by the transport and the sync task.
#[derive(Debug, Default)]
pub struct Counters {
    /// See [`CounterValues::messages_in`].
    pub messages_in: AtomicU64,
    /// See [`CounterValues::messages_out`].
    pub messages_out: AtomicU64,
    /// See [`CounterValues::bytes_in`].
    pub bytes_in: AtomicU64,
    /// See [`CounterValues::bytes_out`].
    pub bytes_out: AtomicU64,
    /// See [`CounterValues::rejected_auth`].
    pub rejected_auth: AtomicU64,
    /// See [`CounterValues::rejected_stale`].
    pub rejected_stale: AtomicU64,
    /// See [`CounterValues::rejected_malformed`].
    pub rejected_malformed: AtomicU64,
    /// See [`CounterValues::rejected_late`].
    pub rejected_late: AtomicU64,
    /// See [`CounterValues::rejected_unsafe`].
    pub rejected_unsafe: AtomicU64,
    /// See [`CounterValues::digest_ids_stripped`].
    pub digest_ids_stripped: AtomicU64,
    /// See [`CounterValues::probes_withheld`].
    pub probes_withheld: AtomicU64,
    /// See [`CounterValues::send_errors`].
    pub send_errors: AtomicU64,
    /// See [`CounterValues::syncs`].
    pub syncs: AtomicU64,
    /// See [`CounterValues::keys_published`].
    pub keys_published: AtomicU64,
    /// See [`CounterValues::keys_synced`].
    pub keys_synced: AtomicU64,
    /// See [`CounterValues::keys_dropped`].
    pub keys_dropped: AtomicU64,
    /// See [`CounterValues::charges_clamped`].
    pub charges_clamped: AtomicU64,
    /// See [`CounterValues::debt_capped`].
    pub debt_capped: AtomicU64,
    /// See [`CounterValues::charged_pkts`].
    pub charged_pkts: AtomicU64,
    /// See [`CounterValues::charged_bytes`].
    pub charged_bytes: AtomicU64,
    /// See [`CounterValues::charge_errors`].
    pub charge_errors: AtomicU64,
    /// See [`CounterValues::sync_lag_ms`].
    pub sync_lag_ms: AtomicU64,
    /// See [`CounterValues::last_sync_us`].
    pub last_sync_us: AtomicU64,
    /// See [`CounterValues::gossip_restarts`].
    pub gossip_restarts: AtomicU64,
    /// See [`CounterValues::share_charged_pkts`].
    pub share_charged_pkts: AtomicU64,
    /// See [`CounterValues::readings_refused`].
    pub readings_refused: AtomicU64,
    /// See [`CounterValues::sync_restarts`].
    pub sync_restarts: AtomicU64,
    /// See [`CounterValues::rounds_late`].
    pub rounds_late: AtomicU64,
}

impl Counters {
    /// Adds `n` to `counter`.
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Relaxed);
    }

    /// The values now.
    #[must_use]
    pub fn values(&self) -> CounterValues {
        CounterValues {
            messages_in: self.messages_in.load(Relaxed),
            messages_out: self.messages_out.load(Relaxed),
            bytes_in: self.bytes_in.load(Relaxed),
            bytes_out: self.bytes_out.load(Relaxed),
            rejected_auth: self.rejected_auth.load(Relaxed),
            rejected_stale: self.rejected_stale.load(Relaxed),
            rejected_malformed: self.rejected_malformed.load(Relaxed),
            rejected_late: self.rejected_late.load(Relaxed),
            rejected_unsafe: self.rejected_unsafe.load(Relaxed),
            digest_ids_stripped: self.digest_ids_stripped.load(Relaxed),
            probes_withheld: self.probes_withheld.load(Relaxed),
            send_errors: self.send_errors.load(Relaxed),
            syncs: self.syncs.load(Relaxed),
            keys_published: self.keys_published.load(Relaxed),
            keys_synced: self.keys_synced.load(Relaxed),
            keys_dropped: self.keys_dropped.load(Relaxed),
            charges_clamped: self.charges_clamped.load(Relaxed),
            debt_capped: self.debt_capped.load(Relaxed),
            charged_pkts: self.charged_pkts.load(Relaxed),
            charged_bytes: self.charged_bytes.load(Relaxed),
            charge_errors: self.charge_errors.load(Relaxed),
            sync_lag_ms: self.sync_lag_ms.load(Relaxed),
            last_sync_us: self.last_sync_us.load(Relaxed),
            gossip_restarts: self.gossip_restarts.load(Relaxed),
            share_charged_pkts: self.share_charged_pkts.load(Relaxed),
            readings_refused: self.readings_refused.load(Relaxed),
            sync_restarts: self.sync_restarts.load(Relaxed),
            rounds_late: self.rounds_late.load(Relaxed),
        }
    }
}

/// What the sync task shares with the agent (and so the API and metrics).
#[derive(Debug, Default)]
pub struct Shared {
    /// Counters, updated as things happen.
    pub counters: Counters,
    /// Everything but the counters, replaced after every sync.
    pub view: Mutex<ClusterStatus>,
    /// Source addresses of authentic datagrams and the identities that sealed them, with when
    /// the last one arrived.
    pub authenticated: Mutex<Authenticated>,
    /// This agent's identity as sealed into its datagrams ([`super::wire::sender_tag`] of the
    /// running gossip incarnation).
    pub self_tag: AtomicU64,
    /// This agent's own max version in its gossip state, as of its last publish: no peer can
    /// hold more of its state than that (see [`super::inspect::check_own`]); 0 before the
    /// first.
    pub own_max_version: AtomicU64,
}

/// Most (source address, sender identity) pairs remembered as having sent an authentic datagram.
pub const MAX_AUTHENTICATED: usize = 1024;

/// Source addresses that sent an authentic datagram, with the identity that sealed it
/// ([`super::wire::sender_tag`]) and the time of the last one (monotonic ns), at most
/// [`MAX_AUTHENTICATED`] pairs (the least recent forgotten first).
#[derive(Debug, Default)]
pub struct Authenticated(std::collections::HashMap<(SocketAddr, u64), u64>);

impl Authenticated {
    /// Notes an authentic datagram from `from`, sealed by identity `sender`, at `now`.
    pub fn note(&mut self, from: SocketAddr, sender: u64, now: u64) {
        if self.0.len() >= MAX_AUTHENTICATED && !self.0.contains_key(&(from, sender)) {
            if let Some(old) = self.0.iter().min_by_key(|(_, t)| **t).map(|(a, _)| *a) {
                self.0.remove(&old);
            }
        }
        self.0.insert((from, sender), now);
    }

    /// Whether identity `sender` sealed an authentic datagram that came from `from` at or after
    /// `since`.
    #[must_use]
    pub fn heard_since(&self, from: SocketAddr, sender: u64, since: u64) -> bool {
        self.0.get(&(from, sender)).is_some_and(|t| *t >= since)
    }

    /// The (address, identity) pairs that sent an authentic datagram at or after `since`, with
    /// the time of the last one.
    #[must_use]
    pub fn last_since(&self, since: u64) -> std::collections::HashMap<(SocketAddr, u64), u64> {
        self.0
            .iter()
            .filter(|(_, t)| **t >= since)
            .map(|(k, t)| (*k, *t))
            .collect()
    }

    /// The (address, identity) pairs that sent an authentic datagram at or after `since`.
    #[must_use]
    pub fn all_since(&self, since: u64) -> std::collections::HashSet<(SocketAddr, u64)> {
        self.0
            .iter()
            .filter(|(_, t)| **t >= since)
            .map(|(a, _)| *a)
            .collect()
    }
}

impl Shared {
    /// The status now.
    #[must_use]
    pub fn status(&self) -> ClusterStatus {
        let mut status = self.view().clone();
        status.counters = self.counters.values();
        status
    }

    /// The status view, to change (whatever a holder that panicked left in it).
    pub fn view(&self) -> std::sync::MutexGuard<'_, ClusterStatus> {
        self.view
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Gossip runs again, as incarnation `generation`: `running`, no error.
    pub fn gossip_running(&self, generation: u64) {
        let mut view = self.view();
        view.generation = generation;
        view.gossip = "running";
        view.gossip_error = None;
    }

    /// Gossip (or the sync loop) is down for `error` and being restarted: `restarting`, the
    /// error shown. Returns the view for what else the caller changes with it.
    pub fn gossip_restarting(&self, error: String) -> std::sync::MutexGuard<'_, ClusterStatus> {
        let mut view = self.view();
        view.gossip = "restarting";
        view.gossip_error = Some(error);
        view
    }
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    fn id(name: &str, generation: u64) -> ChitchatId {
        ChitchatId::new(name, generation, ([192, 0, 2, 1], 7946).into())
    }

    fn name(rule: &str, limit: u8, addr: [u8; 4]) -> KeyName {
        KeyName {
            rule: rule.into(),
            limit,
            addr: IpAddr::from(addr),
        }
    }

    fn limit(mask: [u32; 4]) -> Limit {
        Limit {
            src_mask: mask,
            ..Limit::default()
        }
    }

    const SOURCE: [u32; 4] = [u32::MAX, 0, 0, 0];

    /// Offers one key as `set_shares` does, this host's share computed by the same formula.
    fn offer(
        keys: &mut HeaviestKeys,
        name: &KeyName,
        local: f64,
        peers: &[(ChitchatId, f64)],
        hosts: u32,
        factor: f64,
    ) {
        let rate = Some(1000.0);
        let others: f64 = peers.iter().map(|(_, r)| r).sum();
        let share = shares::share(local, others, factor, rate, f64::from(hosts));
        keys.offer(&KeyRound {
            name,
            limit: &limit(SOURCE),
            demand: local,
            share,
            hosts,
            peers,
            factor,
            rate,
        });
    }

    fn shares(k: &KeyStatus) -> f64 {
        k.holders.iter().map(|h| h.share).sum::<f64>() + f64::from(k.idle_holders) * k.idle_share
    }

    /// Over the budget every holder's share is its demand over the cluster's; this host comes
    /// first, named as given, the peers by node id; the shares add up to 1.
    #[test]
    fn each_holders_share_comes_from_the_same_figures_and_they_add_up_to_one() {
        let mut keys = HeaviestKeys::default();
        let flood = name("flood", 0, [198, 18, 0, 7]);
        offer(
            &mut keys,
            &flood,
            1500.0,
            &[(id("c", 3), 500.0), (id("b", 2), 1000.0)],
            3,
            1.0,
        );
        let st = keys.into_status("a", 1);
        assert_eq!(st.len(), 1);
        let k = &st[0];
        assert_eq!(
            (
                k.rule.as_str(),
                k.limit,
                k.key.as_str(),
                k.hosts,
                k.demand_pps
            ),
            ("flood", 1, "198.18.0.7/32", 3, 3000.0)
        );
        let got: Vec<(&str, u64, f64, f64)> = k
            .holders
            .iter()
            .map(|h| (h.node_id.as_str(), h.generation, h.demand_pps, h.share))
            .collect();
        assert_eq!(
            got,
            [
                ("a", 1, 1500.0, 0.5),
                ("b", 2, 1000.0, 1000.0 / 3000.0),
                ("c", 3, 500.0, 500.0 / 3000.0)
            ]
        );
        assert_eq!((k.idle_holders, k.idle_share), (0, 0.0));
        assert!((shares(k) - 1.0).abs() < 1e-9, "{k:?}");
    }

    /// Under the budget each holder has its demand and an even part of the slack; a counted
    /// peer holding the key with no demand is an idle holder with its part; the shares still
    /// add up to 1, or to the partition factor.
    #[test]
    fn idle_holders_take_their_even_part_and_the_factor_scales_every_share() {
        let mut keys = HeaviestKeys::default();
        let k = name("web", 2, [0, 0, 0, 0]);
        offer(&mut keys, &k, 100.0, &[(id("b", 1), 200.0)], 3, 1.0);
        let st = keys.into_status("a", 1);
        let k0 = &st[0];
        assert_eq!((k0.limit, k0.hosts, k0.idle_holders), (3, 3, 1));
        let slack = 700.0 / 3.0;
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(
            close(k0.holders[0].share, (100.0 + slack) / 1000.0),
            "{k0:?}"
        );
        assert!(
            close(k0.holders[1].share, (200.0 + slack) / 1000.0),
            "{k0:?}"
        );
        assert!(close(k0.idle_share, slack / 1000.0), "{k0:?}");
        assert!(close(shares(k0), 1.0), "{k0:?}");

        let mut keys = HeaviestKeys::default();
        offer(&mut keys, &k, 3000.0, &[(id("b", 1), 1000.0)], 2, 0.5);
        let st = keys.into_status("a", 1);
        assert!(close(shares(&st[0]), 0.5), "{:?}", st[0]);
        assert!(close(st[0].holders[1].share, 0.125), "{:?}", st[0]);
    }

    /// Only the [`SHOWN_KEYS`] heaviest keys by cluster demand are kept, heaviest first, ties
    /// by key; a lighter key offered later does not displace them.
    #[test]
    fn only_the_heaviest_keys_are_kept() {
        let mut keys = HeaviestKeys::default();
        let peer = [(id("b", 1), 10.0)];
        for i in 0..=20u8 {
            // 12 and 13 tie (local + the peer's 10).
            let local = if i == 13 { 120.0 } else { f64::from(i) * 10.0 };
            offer(
                &mut keys,
                &name("r", 0, [10, 0, 0, i]),
                local,
                &peer,
                2,
                1.0,
            );
        }
        offer(&mut keys, &name("r", 0, [10, 0, 1, 0]), 1.0, &[], 1, 1.0);
        let st = keys.into_status("a", 1);
        let got: Vec<(&str, f64)> = st.iter().map(|k| (k.key.as_str(), k.demand_pps)).collect();
        assert_eq!(
            got,
            [
                ("10.0.0.20/32", 210.0),
                ("10.0.0.19/32", 200.0),
                ("10.0.0.18/32", 190.0),
                ("10.0.0.17/32", 180.0),
                ("10.0.0.16/32", 170.0),
                ("10.0.0.15/32", 160.0),
                ("10.0.0.14/32", 150.0),
                ("10.0.0.12/32", 130.0),
                ("10.0.0.13/32", 130.0),
                ("10.0.0.11/32", 120.0),
            ]
        );
    }

    /// A key is shown as a prefix of its limit's granularity.
    #[test]
    fn keys_show_as_prefixes_of_their_limit() {
        let v4 = |a: [u8; 4]| IpAddr::from(Ipv4Addr::from(a));
        assert_eq!(
            key_prefix(v4([198, 18, 1, 0]), &limit([0xffff_ff00, 0, 0, 0])),
            "198.18.1.0/24"
        );
        assert_eq!(key_prefix(v4([0, 0, 0, 0]), &limit([0; 4])), "0.0.0.0/0");
        assert_eq!(
            key_prefix(
                "2001:db8::".parse().unwrap(),
                &limit([u32::MAX, u32::MAX, 0, 0])
            ),
            "2001:db8::/64"
        );
    }
}
