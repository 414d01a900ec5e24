//! The sync round, every `sync_interval_ms`: read the local buckets of cluster-scoped limits (a
//! rule's own or a `[[rule.limit]]`, each on its own) and publish the heaviest keys' counters
//! (admitted and demand); read the peers' demand from chitchat; give each local bucket its
//! share of the budget, in proportion to its demand ([`charge`](super::charge)); refresh the
//! status.

mod demand;
mod exchange;
mod peer_status;
mod peers;
mod rules;
mod set_shares;
#[cfg(test)]
mod tests;

use std::{
    collections::{HashMap, HashSet},
    net::SocketAddr,
    sync::{atomic::AtomicU64, Arc},
    time::Instant,
};

use chitchat::ChitchatId;
use tokio::sync::watch;

use self::{
    demand::{observe_off_thread, own_demand, LocalDemand},
    peer_status::{count_late, count_sync, log_membership, peer_statuses, show},
    peers::{heard_lately, trim_and_read},
    set_shares::{clear_earlier_shares, count_withheld, set_shares_off_thread},
};
pub use self::{
    exchange::{round_of, ExchangeLoop, Reading},
    peers::{standings, Member, Standing},
    rules::ClusterRules,
};
use super::{
    gossip::Gossip,
    partition::Partition,
    publish::{sync_value, KeyName, LocalTracker, KEY_PREFIX, SYNC_KEY},
    remote::RemoteTracker,
    shares::OwnFigures,
    status::{Counters, HeaviestKeys, Shared},
    timing::Timing,
};
use crate::{
    compile::CompiledRuleSet,
    maps::{bucket::monotonic_ns, PinnedMaps},
};

/// Most peer incarnations read per round; more are ignored (and their keys counted as dropped).
pub const MAX_PEERS: usize = 64;

/// Everything the sync loop owns.
pub struct SyncLoop {
    /// The agent's rules in force.
    pub rules: watch::Receiver<Arc<CompiledRuleSet>>,
    /// chitchat's server, supervised (dropping it stops gossip).
    pub chitchat: Gossip,
    /// Our own handles on the pinned maps (the agent's stay behind its lock).
    pub maps: PinnedMaps,
    /// Shared with the agent.
    pub shared: Arc<Shared>,
    /// The sync interval and the periods derived from it.
    pub timing: Timing,
    /// Cap on published and read keys.
    pub max_keys: usize,
    /// `[cluster] on_partition` and the memory of hosts last known alive.
    pub partition: Partition,
}

/// The round's side that reads and writes the bucket store: the pinned maps, this host's demand
/// bookkeeping and when each key last had its share set. Its steps run on a blocking thread (map
/// reads are system calls) and hand it back.
struct StoreSide {
    maps: PinnedMaps,
    local: LocalTracker,
    next_full_ns: u64,
    /// The walk of the whole store under way, if one is.
    walk: Option<demand::Walk>,
    /// Where the passes over the new pages' flags are.
    pages: demand::PagesPass,
    /// Per key read lately, its bucket's life, demand counter and readings, for this host's
    /// demand.
    demand: HashMap<KeyName, LocalDemand>,
    /// When the buckets were last read.
    last_observed_ns: u64,
    /// When this agent started.
    start_ns: u64,
    /// Per key, when its last round ran (whatever its share then).
    shared_at: HashMap<KeyName, u64>,
    /// Until when the shares last written hold (`Config::shares_until_ns`); 0 before the first.
    shares_until: u64,
}

impl StoreSide {
    /// The state of an agent started at `start_ns`, publishing at most `max_keys` keys.
    fn new(maps: PinnedMaps, max_keys: usize, start_ns: u64) -> Self {
        Self {
            maps,
            local: LocalTracker::new(max_keys, start_ns),
            next_full_ns: 0,
            walk: None,
            pages: demand::PagesPass::new(start_ns),
            demand: HashMap::new(),
            last_observed_ns: start_ns,
            start_ns,
            shared_at: HashMap::new(),
            shares_until: 0,
        }
    }
}

impl SyncLoop {
    /// Runs until the task is aborted.
    pub async fn run(self) {
        let Self {
            rules: in_force,
            mut chitchat,
            maps,
            shared,
            timing,
            max_keys,
            mut partition,
        } = self;
        let start_ns = monotonic_ns();
        // No share of an earlier agent's holds for this one (see `StoreSide::set_shares`).
        let mut maps = maps;
        clear_earlier_shares(&mut maps);
        let mut blocking = Some(StoreSide::new(maps, max_keys, start_ns));
        let timeout_ns = u64::try_from(timing.peer_timeout().as_nanos()).unwrap_or(u64::MAX);
        let lag_ns = timing.lag_ns();
        let mut remote: RemoteTracker<ChitchatId> =
            RemoteTracker::new(timeout_ns, timing.stale_ns(), timing.demand_span_ns());
        let mut last_round_ns: Option<u64> = None;
        // This host's demand as of the last round: the figure its peers divide by now.
        let mut own_figures = OwnFigures::default();
        let mut seq = 0u64;
        let mut was_counted: HashSet<ChitchatId> = HashSet::new();
        let mut tick = tokio::time::interval(timing.interval());
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let due = tick.tick().await;
            let began = Instant::now();
            let rules = ClusterRules::of(&in_force.borrow());

            // 1. Local buckets -> published counters (map syscalls off the async threads).
            let Some(b) = blocking.take() else { return };
            let Some((b, set, deleted, fresh_demand)) =
                observe_off_thread(b, rules.clone(), timing).await
            else {
                return;
            };
            let next_epoch = b.local.next_epoch();
            let published = b.local.len();
            blocking = Some(b);
            seq += 1;
            let unix_ms = super::unix_ms();

            // 2. Publish, and read the peers (counting only identities that sealed an authentic
            // datagram from their advertised address within ten peer timeouts).
            let (trusted, direct) = heard_lately(&shared, timeout_ns);
            // A loop that ended is restarted here (as a new incarnation, see [`Gossip`]).
            chitchat.supervise().await;
            let self_id = chitchat.handle().chitchat_id().clone();
            let own_max_version = &shared.own_max_version;
            let (views, dropped, stored) = chitchat
                .handle()
                .with_chitchat(|c| {
                    publish_own(c, &set, &deleted, seq, unix_ms, next_epoch, own_max_version);
                    trim_and_read(c, &self_id, max_keys, &trusted, &direct, &remote)
                })
                .await;
            let c = &shared.counters;
            Counters::add(&c.keys_dropped, dropped);
            c.keys_published
                .store(published as u64, std::sync::atomic::Ordering::Relaxed);

            // 3. Demand -> shares: each local bucket refills at its share of the rate.
            let now = monotonic_ns();
            remote.set_clock(super::unix_ms());
            let round = remote.round(now, &views, &rules.limits());
            count_refused(c, round.refused);
            let keys_synced = round.keys_synced;
            // `on_partition`: the hosts heard (distinct IP addresses) and the hosts last known alive.
            let share = partition.observe(now, &counted_addrs(&remote, now));
            let factor = partition.budget_share(share);
            let elapsed = last_round_ns.map_or(0, |t| now.saturating_sub(t));
            last_round_ns = Some(now);
            let local_demand = own_demand(&mut own_figures, &remote, now, unix_ms, fresh_demand);
            let mut heaviest = HeaviestKeys::default();
            let mut lapsed_ns = 0;
            if elapsed > 0 && !local_demand.is_empty() {
                let Some(b) = blocking.take() else { return };
                let Some((b, w)) =
                    set_shares_off_thread(b, rules, round, local_demand, factor, elapsed, lag_ns)
                        .await
                else {
                    return;
                };
                blocking = Some(b);
                lapsed_ns = w.lapsed_ns;
                heaviest = count_withheld(w, &mut remote, c);
            }
            count_late(&shared, due.elapsed(), &timing, lapsed_ns);
            c.keys_synced
                .store(keys_synced, std::sync::atomic::Ordering::Relaxed);

            // 4. Status.
            let peers = peer_statuses(&remote, now, super::unix_ms(), &stored);
            log_membership(&peers, &mut was_counted);
            count_sync(c, &peers, began);
            show(&shared, peers, heaviest, &self_id, share, &partition);
        }
    }
}

/// Sets this round's keys in this host's own node state and deletes the retired ones, then sets
/// its sync key, and tells `own_max_version` the state's max version.
fn publish_own(
    c: &mut chitchat::Chitchat,
    set: &[(String, String)],
    deleted: &[String],
    seq: u64,
    unix_ms: u64,
    next_epoch: u64,
    own_max_version: &AtomicU64,
) {
    let node = c.self_node_state();
    for (k, v) in set {
        node.set(k, v);
    }
    for k in deleted {
        node.delete(k);
    }
    // Last: a peer holding this sync key holds every key set before it. It
    // names the keys published now (`keys_digest`): a peer holding keys of
    // this host that do not make it holds one relayed under this host's id.
    let value = sync_value(
        seq,
        unix_ms,
        next_epoch,
        node.iter_prefix(KEY_PREFIX).map(|(k, _)| k),
    );
    node.set(SYNC_KEY, value);
    // No peer can hold more of this host's state than this (a delta about it
    // beyond is forged, see `inspect::check_own`).
    own_max_version.store(node.max_version(), std::sync::atomic::Ordering::Relaxed);
}

/// Counts the peers' readings refused this round (see [`Round::refused`]).
///
/// [`Round::refused`]: super::remote::Round::refused
fn count_refused(c: &Counters, refused: u64) {
    Counters::add(&c.readings_refused, refused);
    if refused > 0 {
        tracing::debug!(
            refused = refused,
            "cluster sync: peers' readings refused (dated ahead, or going back)"
        );
    }
}

/// The advertised addresses of the peers counted now.
fn counted_addrs(remote: &RemoteTracker<ChitchatId>, now: u64) -> Vec<SocketAddr> {
    remote
        .info(now)
        .filter(|(_, i)| i.counted)
        .map(|(id, _)| id.gossip_advertise_addr)
        .collect()
}
