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

use std::{collections::HashMap, hash::Hash};

use super::publish::{Count, KeyName};

/// A peer as read from chitchat's state in one sync.
#[derive(Clone, Debug)]
pub struct PeerView<P> {
    /// Its identity (node id with generation).
    pub id: P,
    /// Alive according to chitchat's failure detector.
    pub live: bool,
    /// Its heartbeat counter.
    pub heartbeat: u64,
    /// Its sync key: `(sequence, Unix ms, next epoch)`, once it arrived.
    pub sync: Option<(u64, u64, u64)>,
    /// Its consumption keys (at most `max_keys` of them, in key order).
    pub keys: Vec<(KeyName, Count)>,
}

/// The local rule a remote key is charged to, as far as limits go.
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

#[derive(Clone, Copy, Debug)]
struct Applied {
    count: Count,
    at_ns: u64,
}

#[derive(Debug)]
struct PeerTrack {
    heartbeat: u64,
    last_heard_ns: u64,
    counted: bool,
    /// Keys with an epoch below this existed before we started counting the peer.
    baseline_epoch: u64,
    sync: Option<(u64, u64, u64)>,
    keys: HashMap<KeyName, Applied>,
    published: usize,
    charged_pkts: u64,
    charged_bytes: u64,
    live: bool,
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
}

/// Every peer incarnation seen, with what was charged for it.
#[derive(Debug)]
pub struct RemoteTracker<P> {
    timeout_ns: u64,
    peers: HashMap<P, PeerTrack>,
}

impl<P: Clone + Eq + Hash> RemoteTracker<P> {
    /// A tracker that stops counting a peer not heard for `timeout_ns`.
    #[must_use]
    pub fn new(timeout_ns: u64) -> Self {
        Self {
            timeout_ns,
            peers: HashMap::new(),
        }
    }

    /// Folds in the peers as read at `now` (`CLOCK_MONOTONIC` ns); `limits` gives the local
    /// cluster-scoped rules by name (keys of other rules are not charged). Peers no longer in
    /// `views` are forgotten.
    pub fn round(
        &mut self,
        now: u64,
        views: &[PeerView<P>],
        limits: &HashMap<String, Limits>,
    ) -> Round {
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
                    sync: None,
                    keys: HashMap::new(),
                    published: 0,
                    charged_pkts: 0,
                    charged_bytes: 0,
                    live: view.live,
                });
            if view.heartbeat != track.heartbeat {
                track.heartbeat = view.heartbeat;
                track.last_heard_ns = now;
            }
            track.live = view.live;
            track.published = view.keys.len();
            let heard = view.live && now.saturating_sub(track.last_heard_ns) <= self.timeout_ns;
            let Some(sync) = view.sync.filter(|_| heard) else {
                track.counted = false;
                continue;
            };
            track.sync = Some(sync);
            if !track.counted {
                // (Re)joining: everything reported so far is the baseline.
                track.counted = true;
                track.baseline_epoch = sync.2;
                track.keys = view
                    .keys
                    .iter()
                    .map(|(k, c)| {
                        (
                            k.clone(),
                            Applied {
                                count: *c,
                                at_ns: now,
                            },
                        )
                    })
                    .collect();
                continue;
            }
            let mut keys = HashMap::with_capacity(view.keys.len());
            for (name, count) in &view.keys {
                round.keys_synced += 1;
                let prev = track.keys.get(name);
                let (dp, db, since) = match prev {
                    Some(a) if a.count.epoch == count.epoch => (
                        count.pkts.saturating_sub(a.count.pkts),
                        count.bytes.saturating_sub(a.count.bytes),
                        a.at_ns,
                    ),
                    // An older epoch than the one already seen: a stale report, nothing new.
                    Some(a) if a.count.epoch > count.epoch => {
                        keys.insert(name.clone(), *a);
                        continue;
                    }
                    // A key (or a new epoch of it) that began while we counted the peer: all of
                    // it is consumption we have not charged.
                    _ if count.epoch >= track.baseline_epoch => {
                        (count.pkts, count.bytes, prev.map_or(now, |a| a.at_ns))
                    }
                    // A key older than our counting that we had not seen (state still arriving):
                    // baseline.
                    _ => (0, 0, now),
                };
                // The high-water mark never goes down (an older report of the same epoch).
                let mut applied = Applied {
                    count: *count,
                    at_ns: now,
                };
                if let Some(a) = prev.filter(|a| a.count.epoch == count.epoch) {
                    applied.count.pkts = applied.count.pkts.max(a.count.pkts);
                    applied.count.bytes = applied.count.bytes.max(a.count.bytes);
                }
                if dp > 0 || db > 0 {
                    if let Some(l) = limits.get(&name.rule) {
                        let (dp, db, clamped) = clamp(l, dp, db, now.saturating_sub(since));
                        round.clamped += u64::from(clamped);
                        let e = round.charges.entry(name.clone()).or_default();
                        e.0 += dp;
                        e.1 += db;
                        track.charged_pkts += dp;
                        track.charged_bytes += db;
                    }
                } else {
                    applied.at_ns = prev.map_or(now, |a| a.at_ns);
                }
                keys.insert(name.clone(), applied);
            }
            track.keys = keys;
        }
        round
    }

    /// The state of every peer, for display.
    pub fn info(&self, now: u64) -> impl Iterator<Item = (&P, PeerInfo)> {
        self.peers.iter().map(move |(id, t)| {
            let silent_ns = now.saturating_sub(t.last_heard_ns);
            (
                id,
                PeerInfo {
                    heard: t.live && silent_ns <= self.timeout_ns,
                    counted: t.counted,
                    live: t.live,
                    silent_ns,
                    published_unix_ms: t.sync.map(|s| s.1),
                    keys: t.published,
                    charged_pkts: t.charged_pkts,
                    charged_bytes: t.charged_bytes,
                },
            )
        })
    }
}

/// Cuts a peer's reported gain down to what its bucket could have admitted over `dt_ns`: at most
/// its tolerance plus the elapsed time, in TAT nanoseconds; doubled and with a second of slack,
/// since reports arrive with jitter. This bounds what a faulty peer can charge; an honest one
/// never comes near it.
fn clamp(l: &Limits, pkts: u64, bytes: u64, dt_ns: u64) -> (u64, u64, bool) {
    let allowed = |tolerance: u64| {
        tolerance
            .saturating_mul(2)
            .saturating_add(dt_ns)
            .saturating_add(1_000_000_000)
    };
    let mut clamped = false;
    let pkts = match allowed(l.pkt_tolerance_ns).checked_div(l.pkt_interval_ns) {
        Some(max) => {
            let max = max + 1;
            clamped |= pkts > max;
            pkts.min(max)
        }
        None => pkts,
    };
    let bytes = if l.byte_interval_fp > 0 {
        let max = u64::try_from(
            (u128::from(allowed(l.byte_tolerance_ns)) << 16) / u128::from(l.byte_interval_fp),
        )
        .unwrap_or(u64::MAX)
        .saturating_add(1);
        clamped |= bytes > max;
        bytes.min(max)
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

    fn name() -> KeyName {
        KeyName {
            rule: "flood".into(),
            addr: IpAddr::from([198, 18, 0, 100]),
        }
    }

    fn limits() -> HashMap<String, Limits> {
        // 1000 pps, burst 500.
        HashMap::from([(
            "flood".to_string(),
            Limits {
                pkt_interval_ns: MS,
                pkt_tolerance_ns: 500 * MS,
                byte_interval_fp: 0,
                byte_tolerance_ns: 0,
            },
        )])
    }

    fn view(id: &str, hb: u64, epoch_next: u64, counts: &[(u64, u64)]) -> PeerView<String> {
        PeerView {
            id: id.to_string(),
            live: true,
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

    #[test]
    fn cumulative_counters_survive_loss_duplicates_and_reordering() {
        let mut t = RemoteTracker::new(3 * S);
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
        let mut t = RemoteTracker::new(3 * S);
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
        let mut t = RemoteTracker::new(3 * S);
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
        // Heard again: what it admitted meanwhile is the new baseline, not charged late.
        assert_eq!(
            charged(&t.round(4 * S, &[view("a", 3, 2, &[(1, 4000)])], &l)),
            0
        );
        assert_eq!(
            charged(&t.round(4 * S + 100 * MS, &[view("a", 4, 2, &[(1, 4100)])], &l)),
            100
        );
        // Dead according to the failure detector: not counted either.
        let mut dead = view("a", 5, 2, &[(1, 4200)]);
        dead.live = false;
        assert_eq!(charged(&t.round(4 * S + 200 * MS, &[dead], &l)), 0);
    }

    #[test]
    fn keys_older_than_counting_are_baselined_and_absurd_gains_clamped() {
        let mut t = RemoteTracker::new(3 * S);
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
        // A gain no bucket could have admitted in 100 ms: cut to 2 x burst + 1.1 s of rate.
        let r = t.round(300 * MS, &[view("a", 4, 5, &[(3, 10_000_000)])], &l);
        assert_eq!(charged(&r), 2101);
        assert_eq!(r.clamped, 1);
        // Keys of rules that are not cluster-scoped here are not charged.
        let mut other = view("a", 5, 5, &[]);
        other.keys.push((
            KeyName {
                rule: "other".into(),
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
        let mut t = RemoteTracker::new(3 * S);
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
        let mut t = RemoteTracker::new(3 * S);
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

    /// The clamp on bytes as on packets: a gain beyond what the bucket could have admitted is cut
    /// to exactly that and counted; a gain of exactly that is not.
    #[test]
    fn byte_gains_are_clamped_like_packets_and_the_limit_itself_is_not() {
        // 1000 pps, burst 500; 1 MB/s (1000 ns a byte, 48.16 fixed point), burst 64 KiB.
        let l = HashMap::from([(
            "flood".to_string(),
            Limits {
                pkt_interval_ns: MS,
                pkt_tolerance_ns: 500 * MS,
                byte_interval_fp: 1000 << 16,
                byte_tolerance_ns: 65_536 * 1000,
            },
        )]);
        // Over 100 ms: 2 x tolerance + 100 ms + 1 s, in units of one packet or one byte, + 1.
        let (max_pkts, max_bytes) = (2101, 1_231_073);
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
        let mut t = RemoteTracker::new(3 * S);
        let mut at = |n: u64, pkts, bytes| {
            let mut v = key(pkts, bytes);
            v.heartbeat = n;
            t.round(n * 100 * MS, &[v], &l)
        };
        at(0, 0, 0);
        let r = at(1, 10, 10_000_000);
        assert_eq!(r.charges.get(&name()), Some(&(10, max_bytes)));
        assert_eq!(r.clamped, 1);
        let r = at(2, 10 + max_pkts, 10_000_000 + max_bytes);
        assert_eq!(r.charges.get(&name()), Some(&(max_pkts, max_bytes)));
        assert_eq!(r.clamped, 0, "a gain of exactly the limit is not clamped");
        let r = at(3, 11 + 2 * max_pkts, 10_000_000 + 2 * max_bytes);
        assert_eq!(r.charges.get(&name()), Some(&(max_pkts, max_bytes)));
        assert_eq!(r.clamped, 1, "one packet over");
        // Bytes gained alone are charged too.
        let r = at(4, 11 + 2 * max_pkts, 10_000_100 + 2 * max_bytes);
        assert_eq!(r.charges.get(&name()), Some(&(0, 100)));
    }
}
