//! What the cluster sync shows: members with their state and lag, and counters, for
//! `ratelimit peers`, `status`, `stats` and the metrics. The JSON shapes are part of the
//! user-facing contract: fields may be added, none renamed or removed.

use std::{
    net::SocketAddr,
    sync::{
        atomic::{AtomicU64, Ordering::Relaxed},
        Mutex,
    },
};

use serde::Serialize;

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
    /// takes at most this host's refill, see the README); kept so `peers --json` keeps its
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
