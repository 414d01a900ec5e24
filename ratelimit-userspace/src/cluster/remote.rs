//! What peers consumed and this host has not charged yet.
//!
//! For every peer *incarnation* (chitchat's node id includes a generation, new at every start) and
//! every key it publishes, this remembers `(epoch, packets, bytes)` already charged. Each sync, the
//! charge for a key is the sum over counted peers of what their counters gained since. Because the
//! counters are cumulative, a lost update is caught up by the next one, a repeated or older one
//! gains nothing, and a restarted peer is a new incarnation counting from zero, tracked apart
//! from the old one (which stops being heard and is forgotten).
//!
//! A peer is *counted* only while it is alive and heard within the timeout, and once its sync key
//! has arrived (its keys are then complete as of that sync). When it starts being counted (first
//! seen, back from a partition or a silence), what it reports is taken as the baseline: its past
//! consumption, which this host could not charge in time, is not charged late (fail open).
//!
//! # Bounded trust
//! A peer holding the cluster key could report anything. What it can make this host charge is
//! bounded by what its own bucket could have admitted: per peer incarnation and key (one bucket
//! of one limit: a rule's own limit and each of its `[[rule.limit]]`s have keys of their own),
//! this keeps an *allowance*, a token bucket of that limit's rate whose depth is the limit's
//! burst plus [`lag_allowance_ns`] (reports arrive with jitter) and whose time is this host's
//! clock. A round charges at most what the allowance holds; the rest is dropped (clamped),
//! counted and logged once per peer. So over any span `t`, one peer incarnation makes this host
//! charge a key at most `burst + rate x (t + lag allowance)` of its limit, and never faster than
//! that limit's rate once that depth is spent. The allowance outlives the key (a peer cannot
//! refill it by withdrawing and republishing a key).

use std::{collections::HashMap, hash::Hash};

use super::publish::{Count, KeyName};

/// A peer as read from chitchat's state in one sync.
#[derive(Clone, Debug)]
pub struct PeerView<P> {
    /// Its identity (node id with generation).
    pub id: P,
    /// Alive according to chitchat's failure detector.
    pub live: bool,
    /// An authentic datagram came from its address lately, and it is the newest incarnation
    /// there: only such a peer can be counted.
    pub verified: bool,
    /// Its heartbeat counter.
    pub heartbeat: u64,
    /// Its sync key: `(sequence, Unix ms, next epoch)`, once it arrived.
    pub sync: Option<(u64, u64, u64)>,
    /// Its consumption keys (at most `max_keys` of them, in key order).
    pub keys: Vec<(KeyName, Count)>,
}

/// The local limit a remote key is charged to (one limit of a rule: its own or a
/// `[[rule.limit]]`), as far as rates go.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Nanoseconds of TAT per packet (0: no packet limit).
    pub pkt_interval_ns: u64,
    /// Packet tolerance, ns.
    pub pkt_tolerance_ns: u64,
    /// Nanoseconds of TAT per byte, 48.16 fixed point (0: no byte limit).
    pub byte_interval_fp: u64,
    /// Byte tolerance, ns.
    pub byte_tolerance_ns: u64,
}

impl Limits {
    /// The rates of limit `l` (a zero interval for a rate the limit does not set); a rule's limit
    /// `k` is [`ratelimit_common::Rule::limit`]`(k)`.
    #[must_use]
    pub fn of(l: &ratelimit_common::Limit) -> Self {
        use ratelimit_common::rule_flags;
        let pkt = l.flags & rule_flags::PKT_LIMIT != 0;
        let byte = l.flags & rule_flags::BYTE_LIMIT != 0;
        Self {
            pkt_interval_ns: if pkt { l.pkt_interval_ns } else { 0 },
            pkt_tolerance_ns: l.pkt_tolerance_ns,
            byte_interval_fp: if byte { l.byte_interval_fp } else { 0 },
            byte_tolerance_ns: l.byte_tolerance_ns,
        }
    }

    /// The depth of a peer's allowance on packets, in TAT ns: the burst plus `lag_ns` of rate.
    #[must_use]
    pub fn pkt_allowance_ns(&self, lag_ns: u64) -> u64 {
        self.pkt_tolerance_ns.saturating_add(lag_ns)
    }

    /// The depth of a peer's allowance on bytes, in TAT ns: the byte burst, one largest packet
    /// (the XDP program admits a packet that ends past the burst if it starts inside it) and
    /// `lag_ns` of rate.
    #[must_use]
    pub fn byte_allowance_ns(&self, lag_ns: u64) -> u64 {
        let packet =
            u64::try_from((u128::from(MAX_PACKET_BYTES) * u128::from(self.byte_interval_fp)) >> 16)
                .unwrap_or(u64::MAX);
        self.byte_tolerance_ns
            .saturating_add(packet)
            .saturating_add(lag_ns)
    }
}

/// The largest packet the byte allowance makes room for beyond the burst (an XDP frame is at most
/// one page without multi-buffer; 64 KiB covers multi-buffer frames too).
pub const MAX_PACKET_BYTES: u64 = 65_536;

/// The cluster-scoped limits here, by rule name and limit index: the keys a peer's consumption is
/// charged to. A key of a rule, or of a limit of it, that is not cluster-scoped here is not
/// charged.
#[derive(Clone, Debug, Default)]
pub struct ClusterLimits(HashMap<String, [Option<Limits>; ratelimit_common::MAX_LIMITS]>);

impl ClusterLimits {
    /// Marks limit `limit` of rule `rule` cluster-scoped, with rates `l` (an index past
    /// [`ratelimit_common::MAX_LIMITS`] is ignored).
    pub fn insert(&mut self, rule: &str, limit: u8, l: Limits) {
        if let Some(slot) = self
            .0
            .entry(rule.to_string())
            .or_default()
            .get_mut(usize::from(limit))
        {
            *slot = Some(l);
        }
    }

    /// [`ClusterLimits::insert`], chained.
    #[must_use]
    pub fn with(mut self, rule: &str, limit: u8, l: Limits) -> Self {
        self.insert(rule, limit, l);
        self
    }

    /// The limit `name` is charged to, if it is cluster-scoped here.
    #[must_use]
    pub fn get(&self, name: &KeyName) -> Option<&Limits> {
        self.0
            .get(&name.rule)?
            .get(usize::from(name.limit))?
            .as_ref()
    }

    /// Whether no limit is cluster-scoped here.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.0.values().all(|l| l.iter().all(Option::is_none))
    }
}

/// How much report jitter the allowance absorbs: this many sync intervals of the rule's rate.
pub const LAG_ROUNDS: u64 = 3;

/// The lag allowance for a sync interval of `interval_ns`: [`LAG_ROUNDS`] intervals.
#[must_use]
pub fn lag_allowance_ns(interval_ns: u64) -> u64 {
    interval_ns.saturating_mul(LAG_ROUNDS)
}

/// What a peer may still make this host charge for one key: the TATs of its packet and byte
/// allowances (a token bucket each, as the XDP program keeps them; a TAT at or before now is a
/// full allowance).
#[derive(Clone, Copy, Debug, Default)]
struct Allowance {
    pkt_tat: u64,
    byte_tat: u64,
}

#[derive(Clone, Copy, Debug)]
struct Applied {
    count: Count,
}

#[derive(Debug)]
struct PeerTrack {
    heartbeat: u64,
    last_heard_ns: u64,
    counted: bool,
    /// Keys with an epoch below this existed before we started counting the peer.
    baseline_epoch: u64,
    /// Heard again after a silence: the first fresh sync sequence read; the baseline waits for a
    /// newer one (see [`RemoteTracker::round`]).
    rejoin_seq: Option<u64>,
    sync: Option<(u64, u64, u64)>,
    keys: HashMap<KeyName, Applied>,
    published: usize,
    charged_pkts: u64,
    charged_bytes: u64,
    live: bool,
    verified: bool,
    /// Per key, what the peer may still make us charge (entries back to full are dropped).
    allowance: HashMap<KeyName, Allowance>,
    /// Whether a clamp of this peer was logged already.
    clamp_logged: bool,
    clamped: u64,
}

/// A peer's state for `peers`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    /// Heard within the timeout (and alive).
    pub heard: bool,
    /// Counted (its consumption is charged).
    pub counted: bool,
    /// Alive according to the failure detector.
    pub live: bool,
    /// See [`PeerView::verified`].
    pub verified: bool,
    /// ns since its heartbeat last advanced.
    pub silent_ns: u64,
    /// Its last sync key's Unix ms.
    pub published_unix_ms: Option<u64>,
    /// Keys read from it.
    pub keys: usize,
    /// Charged so far.
    pub charged_pkts: u64,
    /// Charged so far.
    pub charged_bytes: u64,
    /// Charges of this peer cut down to its allowance so far.
    pub clamped: u64,
}

/// The outcome of one sync.
#[derive(Debug, Default)]
pub struct Round {
    /// Packets and bytes to charge per key.
    pub charges: HashMap<KeyName, (u64, u64)>,
    /// Keys read from counted peers.
    pub keys_synced: u64,
    /// Charges cut down to what a bucket could have admitted.
    pub clamped: u64,
    /// Peers counted in this round.
    pub counted_peers: u64,
}

/// Every peer incarnation seen, with what was charged for it.
#[derive(Debug)]
pub struct RemoteTracker<P> {
    timeout_ns: u64,
    lag_ns: u64,
    peers: HashMap<P, PeerTrack>,
}

impl<P: Clone + Eq + Hash + std::fmt::Debug> RemoteTracker<P> {
    /// A tracker that stops counting a peer not heard for `timeout_ns` and lets a peer's reports
    /// run `lag_ns` ahead of its rate (see [`lag_allowance_ns`]).
    #[must_use]
    pub fn new(timeout_ns: u64, lag_ns: u64) -> Self {
        Self {
            timeout_ns,
            lag_ns,
            peers: HashMap::new(),
        }
    }

    /// Folds in the peers as read at `now` (`CLOCK_MONOTONIC` ns); `limits` gives the local
    /// cluster-scoped limits by rule name and index (keys of other rules and limits are not
    /// charged). Peers no longer in `views` are forgotten.
    pub fn round(&mut self, now: u64, views: &[PeerView<P>], limits: &ClusterLimits) -> Round {
        let mut round = Round::default();
        self.peers.retain(|id, _| views.iter().any(|v| v.id == *id));
        for view in views {
            let track = self
                .peers
                .entry(view.id.clone())
                .or_insert_with(|| PeerTrack {
                    heartbeat: view.heartbeat,
                    last_heard_ns: now,
                    counted: false,
                    baseline_epoch: 0,
                    rejoin_seq: None,
                    sync: None,
                    keys: HashMap::new(),
                    published: 0,
                    charged_pkts: 0,
                    charged_bytes: 0,
                    live: view.live,
                    verified: view.verified,
                    allowance: HashMap::new(),
                    clamp_logged: false,
                    clamped: 0,
                });
            // Full allowances (TAT at or before now) are the same as none: forget them.
            track
                .allowance
                .retain(|_, a| a.pkt_tat > now || a.byte_tat > now);
            if view.heartbeat != track.heartbeat {
                track.heartbeat = view.heartbeat;
                track.last_heard_ns = now;
            }
            track.live = view.live;
            track.verified = view.verified;
            track.published = view.keys.len();
            let heard = view.live
                && view.verified
                && now.saturating_sub(track.last_heard_ns) <= self.timeout_ns;
            let Some(sync) = view.sync.filter(|_| heard) else {
                track.counted = false;
                track.rejoin_seq = None;
                continue;
            };
            if !track.counted {
                if let Some(last) = track.sync {
                    // Heard again after a silence. Its heartbeat travels in digests, ahead of its
                    // keys, so what is read first may still be its state from before the silence;
                    // and the first newer sync key may be a snapshot taken before it could be
                    // heard again (it publishes once a sync interval), so admissions after that
                    // snapshot would show up later and be charged late. The baseline waits for
                    // a sync key newer than the first fresh one: published after this host
                    // heard it again, so everything it admitted while not counted is in it.
                    if sync.0 <= last.0 {
                        continue;
                    }
                    match track.rejoin_seq {
                        Some(first) if sync.0 > first => track.rejoin_seq = None,
                        Some(_) => continue,
                        None => {
                            track.rejoin_seq = Some(sync.0);
                            continue;
                        }
                    }
                }
            }
            track.sync = Some(sync);
            round.counted_peers += 1;
            if !track.counted {
                // (Re)joining: everything reported so far is the baseline.
                track.counted = true;
                track.baseline_epoch = sync.2;
                track.keys = view
                    .keys
                    .iter()
                    .map(|(k, c)| (k.clone(), Applied { count: *c }))
                    .collect();
                continue;
            }
            let mut keys = HashMap::with_capacity(view.keys.len());
            for (name, count) in &view.keys {
                round.keys_synced += 1;
                let prev = track.keys.get(name);
                let (dp, db) = match prev {
                    Some(a) if a.count.epoch == count.epoch => (
                        count.pkts.saturating_sub(a.count.pkts),
                        count.bytes.saturating_sub(a.count.bytes),
                    ),
                    // An older epoch than the one already seen: a stale report, nothing new.
                    Some(a) if a.count.epoch > count.epoch => {
                        keys.insert(name.clone(), *a);
                        continue;
                    }
                    // A key (or a new epoch of it) that began while we counted the peer: all of
                    // it is consumption we have not charged.
                    _ if count.epoch >= track.baseline_epoch => (count.pkts, count.bytes),
                    // A key older than our counting that we had not seen (state still arriving):
                    // baseline.
                    _ => (0, 0),
                };
                // The high-water mark never goes down (an older report of the same epoch).
                let mut applied = Applied { count: *count };
                if let Some(a) = prev.filter(|a| a.count.epoch == count.epoch) {
                    applied.count.pkts = applied.count.pkts.max(a.count.pkts);
                    applied.count.bytes = applied.count.bytes.max(a.count.bytes);
                }
                if dp > 0 || db > 0 {
                    if let Some(l) = limits.get(name) {
                        let allowance = track.allowance.entry(name.clone()).or_default();
                        let (cp, cb) = (dp, db);
                        let (dp, db, clamped) = clamp(l, allowance, dp, db, now, self.lag_ns);
                        if clamped {
                            round.clamped += 1;
                            track.clamped += 1;
                            if !track.clamp_logged {
                                track.clamp_logged = true;
                                tracing::warn!(
                                    peer = ?view.id,
                                    rule = %name.rule,
                                    limit = name.limit,
                                    addr = %name.addr,
                                    claimed_pkts = cp,
                                    claimed_bytes = cb,
                                    charged_pkts = dp,
                                    charged_bytes = db,
                                    "cluster peer claimed more than its bucket could have admitted: charge clamped \
                                     (logged once per peer; see charges_clamped)"
                                );
                            }
                        }
                        let e = round.charges.entry(name.clone()).or_default();
                        e.0 += dp;
                        e.1 += db;
                        track.charged_pkts += dp;
                        track.charged_bytes += db;
                    }
                }
                keys.insert(name.clone(), applied);
            }
            track.keys = keys;
        }
        round
    }

    /// Whether `id`, whose heartbeat reads `heartbeat` at `now`, is still heard: its heartbeat
    /// advanced since the last round, or within the timeout. A peer not tracked yet is.
    #[must_use]
    pub fn heard(&self, id: &P, heartbeat: u64, now: u64) -> bool {
        self.peers.get(id).is_none_or(|t| {
            t.heartbeat != heartbeat || now.saturating_sub(t.last_heard_ns) <= self.timeout_ns
        })
    }

    /// The state of every peer, for display.
    pub fn info(&self, now: u64) -> impl Iterator<Item = (&P, PeerInfo)> {
        self.peers.iter().map(move |(id, t)| {
            let silent_ns = now.saturating_sub(t.last_heard_ns);
            (
                id,
                PeerInfo {
                    heard: t.live && t.verified && silent_ns <= self.timeout_ns,
                    counted: t.counted,
                    live: t.live,
                    verified: t.verified,
                    silent_ns,
                    published_unix_ms: t.sync.map(|s| s.1),
                    keys: t.published,
                    charged_pkts: t.charged_pkts,
                    charged_bytes: t.charged_bytes,
                    clamped: t.clamped,
                },
            )
        })
    }
}

/// Cuts a peer's reported gain down to what its allowance for the key holds at `now`, and takes
/// what is charged from it: `(packets, bytes, clamped)`.
fn clamp(
    l: &Limits,
    a: &mut Allowance,
    pkts: u64,
    bytes: u64,
    now: u64,
    lag_ns: u64,
) -> (u64, u64, bool) {
    let mut clamped = false;
    let pkts = if l.pkt_interval_ns > 0 && pkts > 0 {
        let from = a.pkt_tat.max(now);
        let room = now
            .saturating_add(l.pkt_allowance_ns(lag_ns))
            .saturating_sub(from);
        let granted = pkts.min(room / l.pkt_interval_ns);
        clamped |= granted < pkts;
        a.pkt_tat = from.saturating_add(granted.saturating_mul(l.pkt_interval_ns));
        granted
    } else {
        pkts
    };
    let bytes = if l.byte_interval_fp > 0 && bytes > 0 {
        let from = a.byte_tat.max(now);
        let room = now
            .saturating_add(l.byte_allowance_ns(lag_ns))
            .saturating_sub(from);
        let max = u64::try_from((u128::from(room) << 16) / u128::from(l.byte_interval_fp))
            .unwrap_or(u64::MAX);
        let granted = bytes.min(max);
        clamped |= granted < bytes;
        let cost = u64::try_from((u128::from(granted) * u128::from(l.byte_interval_fp)) >> 16)
            .unwrap_or(u64::MAX);
        a.byte_tat = from.saturating_add(cost);
        granted
    } else {
        bytes
    };
    (pkts, bytes, clamped)
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;

    const S: u64 = 1_000_000_000;
    const MS: u64 = 1_000_000;
    /// Three 100 ms sync intervals.
    const LAG: u64 = 300 * MS;

    fn name() -> KeyName {
        KeyName {
            rule: "flood".into(),
            limit: 0,
            addr: IpAddr::from([198, 18, 0, 100]),
        }
    }

    /// 1000 pps, burst 500.
    const FLOOD: Limits = Limits {
        pkt_interval_ns: MS,
        pkt_tolerance_ns: 500 * MS,
        byte_interval_fp: 0,
        byte_tolerance_ns: 0,
    };

    fn limits() -> ClusterLimits {
        ClusterLimits::default().with("flood", 0, FLOOD)
    }

    fn view(id: &str, hb: u64, epoch_next: u64, counts: &[(u64, u64)]) -> PeerView<String> {
        PeerView {
            id: id.to_string(),
            live: true,
            verified: true,
            heartbeat: hb,
            sync: Some((hb, 0, epoch_next)),
            keys: counts
                .iter()
                .map(|&(epoch, pkts)| {
                    (
                        name(),
                        Count {
                            epoch,
                            pkts,
                            bytes: pkts * 100,
                        },
                    )
                })
                .collect(),
        }
    }

    fn charged(r: &Round) -> u64 {
        r.charges.get(&name()).map_or(0, |c| c.0)
    }

    /// `heard` (what the partition share and `peers` count as heard): a peer not tracked yet is;
    /// a tracked one while its heartbeat moves, or within the timeout of its last move; not after
    /// (found missed by cargo-mutants: `heard` answering false).
    #[test]
    fn a_peer_is_heard_while_its_heartbeat_moves_or_within_the_timeout() {
        let mut t = RemoteTracker::new(3 * S, LAG);
        let id = "a".to_string();
        assert!(t.heard(&id, 1, 0), "not tracked yet");
        t.round(S, &[view("a", 5, 2, &[(1, 100)])], &limits());
        assert!(t.heard(&id, 6, 10 * S), "its heartbeat moved");
        assert!(
            t.heard(&id, 5, S + 3 * S),
            "the same heartbeat, within the timeout"
        );
        assert!(
            !t.heard(&id, 5, S + 3 * S + 1),
            "the same heartbeat, past the timeout"
        );
    }

    #[test]
    fn cumulative_counters_survive_loss_duplicates_and_reordering() {
        let mut t = RemoteTracker::new(3 * S, LAG);
        let l = limits();
        // First sight: baseline, nothing charged.
        assert_eq!(charged(&t.round(0, &[view("a", 1, 2, &[(1, 100)])], &l)), 0);
        assert_eq!(
            charged(&t.round(100 * MS, &[view("a", 2, 2, &[(1, 150)])], &l)),
            50
        );
        // Same report again: nothing.
        assert_eq!(
            charged(&t.round(200 * MS, &[view("a", 3, 2, &[(1, 150)])], &l)),
            0
        );
        // An older report (reordered): nothing, and it does not lower the mark.
        assert_eq!(
            charged(&t.round(300 * MS, &[view("a", 4, 2, &[(1, 120)])], &l)),
            0
        );
        // Updates lost in between: caught up at once.
        assert_eq!(
            charged(&t.round(400 * MS, &[view("a", 5, 2, &[(1, 400)])], &l)),
            250
        );
        // A new epoch of the key (it left and came back): counted from zero.
        assert_eq!(
            charged(&t.round(500 * MS, &[view("a", 6, 3, &[(2, 30)])], &l)),
            30
        );
        // A stale report of the old epoch: nothing.
        assert_eq!(
            charged(&t.round(600 * MS, &[view("a", 7, 3, &[(1, 500)])], &l)),
            0
        );
    }

    #[test]
    fn restarted_peer_is_a_new_incarnation_and_not_counted_twice() {
        let mut t = RemoteTracker::new(3 * S, LAG);
        let l = limits();
        t.round(0, &[view("a@1", 1, 2, &[(1, 100)])], &l);
        assert_eq!(
            charged(&t.round(100 * MS, &[view("a@1", 2, 2, &[(1, 200)])], &l)),
            100
        );
        // The peer restarts: generation 2 appears (baseline), generation 1 stops being heard.
        let r = t.round(
            200 * MS,
            &[view("a@1", 2, 2, &[(1, 200)]), view("a@2", 1, 1, &[])],
            &l,
        );
        assert_eq!(charged(&r), 0);
        // The new incarnation's first key started while we counted it: charged from zero.
        let r = t.round(
            300 * MS,
            &[
                view("a@1", 2, 2, &[(1, 200)]),
                view("a@2", 2, 2, &[(1, 40)]),
            ],
            &l,
        );
        assert_eq!(charged(&r), 40);
        // The old one gone from chitchat: forgotten.
        t.round(400 * MS, &[view("a@2", 3, 2, &[(1, 60)])], &l);
        assert_eq!(t.info(400 * MS).count(), 1);
    }

    #[test]
    fn silent_peer_stops_counting_and_rejoins_from_a_new_baseline() {
        let mut t = RemoteTracker::new(3 * S, LAG);
        let l = limits();
        t.round(0, &[view("a", 1, 2, &[(1, 0)])], &l);
        assert_eq!(
            charged(&t.round(100 * MS, &[view("a", 2, 2, &[(1, 100)])], &l)),
            100
        );
        // Heartbeat frozen (partition) for longer than the timeout, counters moving: not counted.
        assert_eq!(
            charged(&t.round(2 * S, &[view("a", 2, 2, &[(1, 150)])], &l)),
            50
        );
        let r = t.round(3 * S + 200 * MS, &[view("a", 2, 2, &[(1, 3000)])], &l);
        assert_eq!(charged(&r), 0);
        let info = t.info(3 * S + 200 * MS).next().unwrap().1;
        assert!(!info.heard && !info.counted);
        // Heard again: what it admitted meanwhile is the new baseline (taken at the second
        // fresh sync key, see the next test), not charged late.
        assert_eq!(
            charged(&t.round(4 * S, &[view("a", 3, 2, &[(1, 4000)])], &l)),
            0
        );
        assert_eq!(
            charged(&t.round(4 * S + 50 * MS, &[view("a", 4, 2, &[(1, 4000)])], &l)),
            0
        );
        assert_eq!(
            charged(&t.round(4 * S + 100 * MS, &[view("a", 5, 2, &[(1, 4100)])], &l)),
            100
        );
        // Dead according to the failure detector: not counted either.
        let mut dead = view("a", 6, 2, &[(1, 4200)]);
        dead.live = false;
        assert_eq!(charged(&t.round(4 * S + 200 * MS, &[dead], &l)), 0);
    }

    /// Back from a partition, a peer's heartbeat (carried by digests) is heard before its
    /// newer keys arrive: the baseline waits for a newer sync key, so what it admitted while cut
    /// off is not charged when those keys come.
    #[test]
    fn a_rejoining_peer_is_baselined_on_its_fresh_state_not_on_what_was_left() {
        let mut t = RemoteTracker::new(3 * S, LAG);
        let l = limits();
        t.round(0, &[view("a", 1, 2, &[(1, 0)])], &l);
        assert_eq!(
            charged(&t.round(100 * MS, &[view("a", 2, 2, &[(1, 300)])], &l)),
            300
        );
        // Silent past the timeout.
        t.round(4 * S, &[view("a", 2, 2, &[(1, 300)])], &l);
        assert!(!t.info(4 * S).next().unwrap().1.counted);
        // Its heartbeat is heard again, its keys and sync key are still the old ones.
        let mut stale = view("a", 9, 2, &[(1, 300)]);
        stale.sync = Some((2, 0, 2));
        assert_eq!(charged(&t.round(5 * S, &[stale], &l)), 0);
        assert!(
            !t.info(5 * S).next().unwrap().1.counted,
            "counted on stale state"
        );
        // Its first fresh state: a snapshot it took before it could be heard again, while it
        // was still admitting (582 of what it admits while not counted): not the baseline yet.
        assert_eq!(
            charged(&t.round(5 * S + 100 * MS, &[view("a", 10, 2, &[(1, 582)])], &l)),
            0
        );
        assert!(!t.info(5 * S + 100 * MS).next().unwrap().1.counted);
        // The next sync key, published after it was heard again, holds all of it (600): the
        // baseline, nothing charged late.
        assert_eq!(
            charged(&t.round(5 * S + 200 * MS, &[view("a", 11, 2, &[(1, 600)])], &l)),
            0
        );
        assert!(t.info(5 * S + 200 * MS).next().unwrap().1.counted);
        assert_eq!(
            charged(&t.round(5 * S + 300 * MS, &[view("a", 12, 2, &[(1, 650)])], &l)),
            50
        );
    }

    #[test]
    fn keys_older_than_counting_are_baselined_and_absurd_gains_clamped() {
        let mut t = RemoteTracker::new(3 * S, LAG);
        let l = limits();
        t.round(0, &[view("a", 1, 5, &[])], &l);
        // A key of epoch 3 < 5 shows up late (state still arriving): baseline.
        assert_eq!(
            charged(&t.round(100 * MS, &[view("a", 2, 5, &[(3, 100_000)])], &l)),
            0
        );
        assert_eq!(
            charged(&t.round(200 * MS, &[view("a", 3, 5, &[(3, 100_100)])], &l)),
            100
        );
        // A gain no bucket could have admitted in 100 ms: cut to what the allowance holds, its
        // depth (burst 500 + 300 ms of lag at 1000/s) less the 100 charged 100 ms ago, refilled
        // by the 100 ms since.
        let r = t.round(300 * MS, &[view("a", 4, 5, &[(3, 10_000_000)])], &l);
        assert_eq!(charged(&r), 800);
        assert_eq!(r.clamped, 1);
        // Keys of rules that are not cluster-scoped here are not charged.
        let mut other = view("a", 5, 5, &[]);
        other.keys.push((
            KeyName {
                rule: "other".into(),
                limit: 0,
                addr: IpAddr::from([1, 2, 3, 4]),
            },
            Count {
                epoch: 9,
                pkts: 5,
                bytes: 0,
            },
        ));
        assert!(t.round(400 * MS, &[other], &l).charges.is_empty());
    }

    /// What a round reports besides the charges, exactly: keys read, per-key packets and bytes,
    /// the clamp count, and each peer's running totals; a key that gained nothing has no entry.
    #[test]
    fn rounds_count_keys_bytes_clamps_and_per_peer_totals() {
        let mut t = RemoteTracker::new(3 * S, LAG);
        let l = limits();
        let r = t.round(0, &[view("a", 1, 2, &[(2, 100)])], &l);
        assert_eq!(
            (r.keys_synced, r.clamped),
            (0, 0),
            "the baseline reads nothing"
        );
        let r = t.round(100 * MS, &[view("a", 2, 2, &[(2, 160)])], &l);
        assert_eq!(r.charges.get(&name()), Some(&(60, 6000)));
        assert_eq!((r.keys_synced, r.clamped), (1, 0));
        // Nothing new: no entry at all, not a zero one.
        let r = t.round(200 * MS, &[view("a", 3, 2, &[(2, 160)])], &l);
        assert!(r.charges.is_empty(), "{:?}", r.charges);
        assert_eq!(r.keys_synced, 1);
        // Two peers gaining on the same key: summed.
        t.round(
            300 * MS,
            &[view("a", 4, 2, &[(2, 160)]), view("b", 1, 2, &[])],
            &l,
        );
        let r = t.round(
            400 * MS,
            &[view("a", 5, 2, &[(2, 170)]), view("b", 2, 2, &[(2, 5)])],
            &l,
        );
        assert_eq!(r.charges.get(&name()), Some(&(15, 1500)));
        assert_eq!(r.keys_synced, 2);
        let info: HashMap<String, PeerInfo> =
            t.info(400 * MS).map(|(id, i)| (id.clone(), i)).collect();
        assert_eq!(
            (
                info["a"].charged_pkts,
                info["a"].charged_bytes,
                info["a"].keys
            ),
            (70, 7000, 1)
        );
        assert_eq!((info["b"].charged_pkts, info["b"].charged_bytes), (5, 500));
        // Two clamped keys in one round count twice.
        let other = KeyName {
            rule: "flood".into(),
            limit: 0,
            addr: IpAddr::from([198, 18, 0, 200]),
        };
        let mut big = view("a", 6, 2, &[(2, 10_000_000)]);
        big.keys.push((
            other.clone(),
            Count {
                epoch: 2,
                pkts: 10_000_000,
                bytes: 0,
            },
        ));
        let r = t.round(500 * MS, &[big, view("b", 3, 2, &[(2, 5)])], &l);
        assert_eq!(r.clamped, 2, "{:?}", r.charges);
    }

    /// A report of an epoch older than the one already seen, but started while the peer was
    /// counted (so not below its baseline): stale, nothing charged, the newer count kept.
    #[test]
    fn an_older_epoch_after_a_newer_one_charges_nothing() {
        let mut t = RemoteTracker::new(3 * S, LAG);
        let l = limits();
        t.round(0, &[view("a", 1, 2, &[])], &l);
        assert_eq!(
            charged(&t.round(100 * MS, &[view("a", 2, 3, &[(2, 40)])], &l)),
            40
        );
        assert_eq!(
            charged(&t.round(200 * MS, &[view("a", 3, 4, &[(3, 10)])], &l)),
            10
        );
        // Reordered gossip: epoch 2 again, with more than before.
        assert_eq!(
            charged(&t.round(300 * MS, &[view("a", 4, 4, &[(2, 90)])], &l)),
            0
        );
        assert_eq!(
            charged(&t.round(400 * MS, &[view("a", 5, 4, &[(3, 15)])], &l)),
            5
        );
        // The same epoch reported again with the same count: nothing.
        assert_eq!(
            charged(&t.round(500 * MS, &[view("a", 6, 4, &[(3, 15)])], &l)),
            0
        );
    }

    /// The clamp on bytes as on packets: a gain beyond what the allowance holds is cut to exactly
    /// that and counted; a gain of exactly that is not.
    #[test]
    fn byte_gains_are_clamped_like_packets_and_the_limit_itself_is_not() {
        // 1000 pps, burst 500; 1 MB/s (1000 ns a byte, 48.16 fixed point), burst 64 KiB.
        let l = ClusterLimits::default().with(
            "flood",
            0,
            Limits {
                pkt_interval_ns: MS,
                pkt_tolerance_ns: 500 * MS,
                byte_interval_fp: 1000 << 16,
                byte_tolerance_ns: 65_536 * 1000,
            },
        );
        // Allowance depths: 500 packets + 300 ms of rate; 64 KiB + one 64 KiB packet + 300 ms.
        let (depth_pkts, depth_bytes) = (800, 431_072);
        let key = |pkts, bytes| {
            let mut v = view("a", 0, 2, &[]);
            v.keys.push((
                name(),
                Count {
                    epoch: 2,
                    pkts,
                    bytes,
                },
            ));
            v
        };
        let mut t = RemoteTracker::new(3 * S, LAG);
        let mut at = |n: u64, pkts, bytes| {
            let mut v = key(pkts, bytes);
            v.heartbeat = n;
            t.round(n * 100 * MS, &[v], &l)
        };
        at(0, 0, 0);
        let r = at(1, 10, 10_000_000);
        assert_eq!(r.charges.get(&name()), Some(&(10, depth_bytes)));
        assert_eq!(r.clamped, 1);
        // 100 ms later: the byte allowance refilled by 100 ms (100 000 bytes), the packet one
        // (10 taken 100 ms ago) is full again.
        let (p, b) = (10 + depth_pkts, 10_000_000 + 100_000);
        let r = at(2, p, b);
        assert_eq!(r.charges.get(&name()), Some(&(depth_pkts, 100_000)));
        assert_eq!(
            r.clamped, 0,
            "a gain of exactly the allowance is not clamped"
        );
        let r = at(3, p + 101, b + 100_001);
        assert_eq!(r.charges.get(&name()), Some(&(100, 100_000)));
        assert_eq!(r.clamped, 1, "one packet and one byte over: one clamp");
        // Bytes gained alone are charged too.
        let r = at(4, p + 101, b + 100_101);
        assert_eq!(r.charges.get(&name()), Some(&(0, 100)));
    }

    /// A peer with the key claiming a victim source consumed a million packets every round: over
    /// any span `t` of rounds it makes this host charge at most `burst + rate x (t + lag)`, once
    /// the depth is spent exactly the rate, every claim is clamped, counted, and the peer's
    /// own clamp count shows it.
    #[test]
    fn an_inflating_peer_charges_at_most_what_its_own_bucket_could_admit() {
        let mut t = RemoteTracker::new(3 * S, LAG);
        let l = limits();
        t.round(0, &[view("evil", 1, 2, &[(2, 0)])], &l);
        let mut total = vec![(0u64, 0u64)]; // (time, cumulative charge)
        let mut clamped = 0;
        for k in 1..=200u64 {
            let now = k * 100 * MS;
            let r = t.round(now, &[view("evil", k + 1, 2, &[(2, k * 1_000_000)])], &l);
            clamped += r.clamped;
            let sum = total.last().unwrap().1 + charged(&r);
            total.push((now, sum));
        }
        // Burst 500 + 300 ms of lag, at 1000/s.
        let (burst, lag_pkts) = (500, 300);
        for (i, &(ti, ci)) in total.iter().enumerate() {
            for &(tj, cj) in &total[i + 1..] {
                let bound = burst + lag_pkts + (tj - ti) / MS;
                assert!(
                    cj - ci <= bound,
                    "charged {} over {} ms: more than {bound}",
                    cj - ci,
                    (tj - ti) / MS
                );
            }
        }
        // The depth in the first round, then the rate over the 19.9 s after it.
        assert_eq!(total.last().unwrap().1, burst + lag_pkts + 19_900);
        assert_eq!(clamped, 200);
        let info = t.info(20 * S).next().unwrap().1;
        assert_eq!((info.clamped, info.charged_pkts), (200, 20_700));
    }

    /// Withdrawing a key and publishing it again (a new epoch, counted from zero) does not
    /// refill the peer's allowance for it.
    #[test]
    fn republishing_a_key_does_not_refill_the_allowance() {
        let mut t = RemoteTracker::new(3 * S, LAG);
        let l = limits();
        t.round(0, &[view("evil", 1, 2, &[])], &l);
        assert_eq!(
            charged(&t.round(100 * MS, &[view("evil", 2, 3, &[(2, 1_000_000)])], &l)),
            800
        );
        assert_eq!(
            charged(&t.round(200 * MS, &[view("evil", 3, 3, &[])], &l)),
            0
        );
        // 200 ms after the depth was spent: 200 packets of allowance, whatever the new epoch
        // claims.
        let r = t.round(300 * MS, &[view("evil", 4, 4, &[(3, 1_000_000)])], &l);
        assert_eq!(charged(&r), 200);
        assert_eq!(r.clamped, 1);
    }

    /// Two limits of one rule, both cluster-scoped, and a third that is local here: a peer's keys
    /// of each cluster limit are charged to that limit, each clamped to that limit's own
    /// allowance (a peer spending one limit's allowance leaves the other's whole); a key of the
    /// local limit, or of a limit the rule does not have, is not charged.
    #[test]
    fn each_limit_of_a_rule_is_charged_and_clamped_on_its_own() {
        let key = |limit: u8, addr: [u8; 4]| KeyName {
            rule: "flood".into(),
            limit,
            addr: IpAddr::from(addr),
        };
        let (own, agg, local, none) = (
            key(0, [198, 18, 0, 100]),
            key(1, [0, 0, 0, 0]),
            key(2, [198, 18, 0, 0]),
            key(3, [0, 0, 0, 0]),
        );
        // Limit 1: 10,000 pps, burst 2,000.
        let aggregate = Limits {
            pkt_interval_ns: 100_000,
            pkt_tolerance_ns: 200 * MS,
            byte_interval_fp: 0,
            byte_tolerance_ns: 0,
        };
        let l = limits().with("flood", 1, aggregate);
        let at = |hb: u64, pkts: [u64; 4]| {
            let mut v = view("a", hb, 2, &[]);
            for (k, p) in [&own, &agg, &local, &none].into_iter().zip(pkts) {
                v.keys.push((
                    k.clone(),
                    Count {
                        epoch: 2,
                        pkts: p,
                        bytes: 0,
                    },
                ));
            }
            v
        };
        let mut t = RemoteTracker::new(3 * S, LAG);
        t.round(0, &[at(1, [0; 4])], &l);
        let r = t.round(100 * MS, &[at(2, [300, 5_000, 7, 9])], &l);
        assert_eq!(r.charges.get(&own), Some(&(300, 0)));
        assert_eq!(r.charges.get(&agg), Some(&(5_000, 0)));
        assert_eq!(r.charges.len(), 2, "{:?}", r.charges);
        assert_eq!(r.clamped, 0);
        // Claims past both allowances: each cut to its own limit's, the limit-0 one (depth 800
        // packets, 300 spent 100 ms ago, 100 back since) and the aggregate's (depth 2,000 + 300 ms
        // at 10,000/s = 5,000 packets; 5,000 spent 100 ms ago, 1,000 back since).
        let r = t.round(200 * MS, &[at(3, [1_000_000, 1_000_000, 1_000_000, 9])], &l);
        assert_eq!(r.charges.get(&own), Some(&(600, 0)));
        assert_eq!(r.charges.get(&agg), Some(&(1_000, 0)));
        assert_eq!(r.clamped, 2);
        // The rule's own limit made local here: its keys are no longer charged, the aggregate's
        // still are.
        let only_agg = ClusterLimits::default().with("flood", 1, aggregate);
        let r = t.round(
            300 * MS,
            &[at(4, [1_000_100, 1_000_100, 1_000_100, 9])],
            &only_agg,
        );
        assert_eq!(r.charges.get(&own), None);
        assert_eq!(r.charges.get(&agg), Some(&(100, 0)));
        assert!(!only_agg.is_empty() && ClusterLimits::default().is_empty());
    }
}
