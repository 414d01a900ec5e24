//! The share-setting step: every key this host has a demand figure for gets its share of the
//! budget in its bucket's share word, and what that withholds is counted, per peer too.

use std::collections::HashMap;

use chitchat::ChitchatId;
use ratelimit_common::{Limit, Rule};

use super::{demand::Demand, rules::ClusterRules, StoreSide};
use crate::{
    cluster::{
        publish::KeyName,
        remote::{RemoteTracker, Round},
        shares,
        status::{Counters, HeaviestKeys, KeyRound},
    },
    maps::{
        bucket::{limit_bucket_key, monotonic_coarse_ns, monotonic_ns},
        locator::Locator,
        PinnedMaps,
    },
};

impl StoreSide {
    /// Gives every key this host has a demand figure for its share of the budget (see
    /// [`charge`]): its bucket's share word, which the program scales the bucket's costs by, so
    /// that it refills at `share x rate` from now on, whenever this round runs; then moves
    /// `Config::shares_until_ns` on to `now + lag_ns` (shares hold until then: a stalled or
    /// stopped agent's lapse, and every bucket refills at its whole rate). `factor` is `heard /
    /// known` under `on_partition = "share"`, else 1. A key no longer tracked gets its share word
    /// cleared (the whole rate). Nothing takes back the refill a new key's bucket got at the whole
    /// rate before its first round: charged as debt (`(1 - share) x` the time since the bucket was
    /// created) and repaid at the share's rate, it drops packets of a source under the budget (117
    /// of 300 at two hosts, measured), and the documented bound already allows each host its burst
    /// and a sync lag of the rate.
    fn set_shares(
        &mut self,
        rules: &ClusterRules,
        round: &Round<ChitchatId>,
        local: &Demand,
        factor: f64,
        elapsed: u64,
        lag_ns: u64,
    ) -> SharesSet {
        let mut w = SharesSet::default();
        let now = monotonic_ns();
        let coarse = monotonic_coarse_ns();
        if elapsed > lag_ns {
            w.late = 1;
        }
        // The config and rules read once for all the keys (a failure to read the config
        // fails every key's share, counted, as it would one by one).
        let located = Locator::new(&self.maps);
        let locator = match &located {
            Ok(l) => Some(l),
            Err(e) => {
                tracing::debug!(error = %e, "cluster sync: reading the config to set the shares");
                None
            }
        };
        Self::release_gone(
            &mut self.shared_at,
            locator,
            rules,
            local,
            now,
            coarse,
            &mut w,
        );
        let this_round = ShareRound {
            round,
            locator,
            factor,
            lag_ns,
            now,
            coarse,
        };
        for (name, &d) in local {
            let Some((id, rule, limit)) = rules.limit_of(name) else {
                continue;
            };
            let last = self.shared_at.insert(name.clone(), now);
            // The time since this key's last round; for a key in its first, since its bucket
            // was created (if this agent saw that).
            let since = last.or_else(|| {
                self.demand
                    .get(name)
                    .map(|d| d.created_ns)
                    .filter(|&c| c >= self.start_ns)
            });
            let elapsed = since.map_or(elapsed, |t| now.saturating_sub(t));
            set_key_share(&this_round, name, d, (id, rule, limit), elapsed, &mut w);
        }
        drop(located);
        self.renew_shares(lag_ns, &mut w);
        w
    }

    /// Moves `Config::shares_until_ns` on to `lag_ns` from now, after this round's shares are
    /// written: they hold until then. A failure is counted and logged.
    fn renew_shares(&mut self, lag_ns: u64, w: &mut SharesSet) {
        // The shares hold until the end of this round's lag allowance; those written before
        // lapsed (every bucket at the whole rate) if that one's passed first.
        let renewed = monotonic_ns();
        if self.shares_until != 0 {
            w.lapsed_ns = renewed.saturating_sub(self.shares_until);
        }
        let until = renewed.saturating_add(lag_ns);
        if let Err(e) = self.maps.update_config(|c| c.shares_until_ns = until) {
            self.shares_until = 0;
            w.errors += 1;
            tracing::warn!(error = %e, "cluster sync: the shares could not be renewed (buckets refill at the whole rate)");
        } else {
            self.shares_until = until;
        }
    }

    /// Clears the share word of every key no longer tracked (its bucket refills at the whole
    /// rate).
    fn release_gone(
        shared_at: &mut HashMap<KeyName, u64>,
        locator: Option<&Locator<'_>>,
        rules: &ClusterRules,
        local: &Demand,
        now: u64,
        coarse: u64,
        w: &mut SharesSet,
    ) {
        let gone: Vec<KeyName> = shared_at
            .keys()
            .filter(|k| !local.contains_key(*k))
            .cloned()
            .collect();
        for name in gone {
            shared_at.remove(&name);
            if let Some((id, rule, limit)) = rules.limit_of(&name) {
                let key = limit_bucket_key(id, rule, usize::from(name.limit), name.addr);
                let cleared =
                    locator.map(|l| shares::set_share(l, &key, (0, 0), &limit, now, coarse));
                if !matches!(cleared, Some(Ok(_))) {
                    w.errors += 1;
                }
            }
        }
    }
}

/// What every key's share is set from in one round of [`StoreSide::set_shares`].
struct ShareRound<'a> {
    round: &'a Round<ChitchatId>,
    /// The config and rules, read once for all the keys; `None` if that failed.
    locator: Option<&'a Locator<'a>>,
    factor: f64,
    lag_ns: u64,
    now: u64,
    coarse: u64,
}

/// Sets the share of key `name` (this host's demand `d`, its limit `(id, rule, limit)`, its last
/// round `elapsed` ago) in its bucket's share word, and counts into `w` what that withholds.
fn set_key_share(
    r: &ShareRound<'_>,
    name: &KeyName,
    d: f64,
    (id, rule, limit): (u32, &Rule, Limit),
    elapsed: u64,
    w: &mut SharesSet,
) {
    let ShareRound {
        round,
        locator,
        factor,
        lag_ns,
        now,
        coarse,
    } = *r;
    let peers = round.peer_demand(name);
    // The hosts holding the key (this one and the counted peers publishing it): an idle
    // key keeps an even part at each, not the whole rate at every one.
    let hosts = f64::from(round.hosts_holding(name));
    let rate = shares::packet_rate(&limit);
    let s = shares::share(d, peers, factor, rate, hosts);
    let key = limit_bucket_key(id, rule, usize::from(name.limit), name.addr);
    // The refill the share withholds over the time since the last round (counted;
    // nothing moves the bucket's arrival times: the share word does it all).
    let advance = shares::advance_ns(s, elapsed, lag_ns);
    let word = shares::share_word(s);
    let holders = round.hosts_holding(name);
    tracing::trace!(key = %name.addr, rule = %name.rule, demand = d, peers, hosts, share = s, word, "cluster sync: a key's share");
    let Some(locator) = locator else {
        w.errors += 1;
        return;
    };
    match shares::set_share(locator, &key, (word, holders), &limit, now, coarse) {
        Ok(Some(_)) => {}
        Ok(None) => return,
        Err(e) => {
            w.errors += 1;
            tracing::debug!(error = %e, rule = %name.rule, limit = name.limit, addr = %name.addr, "cluster sync: setting a bucket's share");
            return;
        }
    }
    // For `peers` and the metrics: each holder's demand and share, if among the heaviest.
    w.keys.offer(&KeyRound {
        name,
        limit: &limit,
        demand: d,
        share: s,
        hosts: round.hosts_holding(name),
        peers: round.demand.get(name).map_or(&[], Vec::as_slice),
        factor,
        rate,
    });
    // The part of it for hosts missing (`share`): what the factor took.
    let without = shares::advance_ns(shares::share(d, peers, 1.0, rate, hosts), elapsed, lag_ns);
    // Counted as withheld for the peers only while some have demand (then each has its
    // part of the rest, below); an even part of an idle key, or of a key only this host
    // has demand for, takes nothing for any peer's demand: only what the factor took.
    let counted = if peers > 0.0 {
        advance
    } else {
        advance.saturating_sub(without)
    };
    let (pkts, bytes) = shares::withheld(&limit, counted, counted);
    w.pkts += pkts;
    w.bytes += bytes;
    if advance > without {
        w.share_pkts += shares::withheld(&limit, advance - without, 0).0;
    }
    // Each counted peer's part of the rest, by its demand.
    peer_parts(w, round, name, limit, without, peers);
}

/// Each counted peer's part (by its demand) of `without`, the advance withheld for the peers'
/// demand of key `name`, when they have some.
fn peer_parts(
    w: &mut SharesSet,
    round: &Round<ChitchatId>,
    name: &KeyName,
    limit: Limit,
    without: u64,
    peers: f64,
) {
    if peers > 0.0 {
        if let Some(list) = round.demand.get(name) {
            let (pp, pb) = shares::withheld(&limit, without, without);
            for (peer, r) in list {
                #[expect(
                    clippy::cast_possible_truncation,
                    clippy::cast_sign_loss,
                    clippy::cast_precision_loss,
                    reason = "a part of a count"
                )]
                let part = |n: u64| (n as f64 * r / peers).round() as u64;
                w.per_peer.push((peer.clone(), part(pp), part(pb)));
            }
        }
    }
}

/// [`StoreSide::set_shares`] on a blocking thread: the state back and what the round withheld;
/// `None` (logged) if it panicked.
pub(super) async fn set_shares_off_thread(
    mut b: StoreSide,
    rules: ClusterRules,
    round: Round<ChitchatId>,
    local_demand: Demand,
    factor: f64,
    elapsed: u64,
    lag_ns: u64,
) -> Option<(StoreSide, SharesSet)> {
    let withheld = tokio::task::spawn_blocking(move || {
        let w = b.set_shares(&rules, &round, &local_demand, factor, elapsed, lag_ns);
        (b, w)
    })
    .await;
    let Ok((b, w)) = withheld else {
        tracing::error!("cluster sync: slowing the buckets panicked; cluster sync stopped");
        return None;
    };
    Some((b, w))
}

/// Credits each counted peer its part of what a round withheld, counts the round's totals,
/// and returns the heaviest keys whose share was set.
pub(super) fn count_withheld(
    w: SharesSet,
    remote: &mut RemoteTracker<ChitchatId>,
    c: &Counters,
) -> HeaviestKeys {
    for (id, pkts, bytes) in &w.per_peer {
        remote.credit(id, *pkts, *bytes);
    }
    Counters::add(&c.charged_pkts, w.pkts);
    Counters::add(&c.charged_bytes, w.bytes);
    Counters::add(&c.charge_errors, w.errors);
    Counters::add(&c.charges_clamped, w.late);
    Counters::add(&c.share_charged_pkts, w.share_pkts);
    w.keys
}

/// Clears the shares an earlier agent left (the deadline in the config, and every bucket's
/// share word).
pub(super) fn clear_earlier_shares(maps: &mut PinnedMaps) {
    if let Err(e) = maps.update_config(|c| c.shares_until_ns = 0) {
        tracing::warn!(error = %e, "cluster sync: clearing the shares in force");
    }
    let cleared = maps.store().clear_shares(monotonic_ns());
    if cleared > 0 {
        tracing::info!(
            buckets = cleared,
            "cluster sync: cleared the shares an earlier agent left"
        );
    }
}

/// What one round withheld.
#[derive(Debug, Default)]
pub(super) struct SharesSet {
    /// Packets and bytes of refill withheld for the peers' demand and for hosts missing (TAT
    /// advance in packets and bytes; not the even part an idle key's share holds back, which
    /// no peer's demand takes).
    pkts: u64,
    bytes: u64,
    /// Of the packets, what `on_partition = "share"` withheld for hosts missing.
    share_pkts: u64,
    /// Per counted peer, its part (by demand) of the rest.
    per_peer: Vec<(ChitchatId, u64, u64)>,
    /// Buckets that could not be slowed.
    errors: u64,
    /// 1 when the round ran later than the lag allowance (its advance cut to it).
    late: u64,
    /// The heaviest keys whose share was set, with each holder's demand and share.
    keys: HeaviestKeys,
    /// How long the shares written before had lapsed when these renewed them (ns).
    pub(super) lapsed_ns: u64,
}
