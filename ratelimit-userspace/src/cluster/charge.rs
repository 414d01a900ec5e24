//! Giving a local bucket only its share of the cluster's budget.
//!
//! Every round, for each key of a cluster-scoped limit, this host's share of the budget is its
//! demand (packets per second that reached its bucket, admitted or dropped) over the demand of
//! the cluster (its own plus what its counted peers report): `s = local / (local + peers)` once
//! that reaches the rate, and under it its own demand and an even part of what is left between
//! the hosts that *hold* the key (this one and the counted peers that publish it with a known
//! demand, 0 included: each has a bucket of it); times `heard / known` under `on_partition =
//! "share"`. A key no counted peer holds has the whole rate here (fail open). The round writes
//! `s` into the bucket as its share word ([`share_word`], 16 bits beside the bucket's creation
//! time), and the XDP program charges each packet (and byte) of a cluster-scoped limit
//! `SHARE_ONE / word` times its cost, so the bucket refills at `s x rate` (and `s x bytes_rate`)
//! at every instant, however late the next round runs, and holds `s x burst` at most. The words
//! hold while `Config::shares_until_ns` (moved on by every round to the end of its lag
//! allowance, [`lag_allowance_ns`]) is ahead: an agent that stops, or whose rounds stall, leaves
//! every bucket at the whole rate (fail open). A new key's bucket refills at the whole rate until
//! its first round. Nothing depends on what the peers admitted, so there is no feedback from
//! admissions: when the demand is steady, every host's `s x rate` is below its own demand as
//! soon as the cluster's demand exceeds the rate (every bucket is saturated, and together they
//! admit `rate`), and nobody is limited otherwise.
//!
//! An idle key (no demand anywhere) keeps its even part, `1 / hosts` holding it, for as long as
//! they hold it (a host publishes an idle key while its bucket lasts, see
//! [`LocalTracker::update`]): the shares of the holders add up to 1 whether the source sends or
//! not, so the buckets together hold one burst and refill at one rate. Before, an idle key went
//! back to the whole rate at every host a round or two after its demand stopped: a source that
//! sent `hosts x burst` over the hosts within a sync interval, then idled for `burst / rate` and
//! two intervals, found every bucket full at the whole burst again, and got `(hosts - 1) x burst`
//! more than the budget at every such cycle (3 real agents, 1,000 pps, burst 500, 10 cycles of
//! 0.1 s on and 1 s off, tests/tests/e2e_cluster_onoff.rs: 16,077-16,482 packets admitted in
//! 11 s, a window 6,087-6,471 over `rate x T` where the README's bound allows 1,950; now
//! 7,015-7,062, at most 1,685-1,699 over, the first bursts). Keeping the last share only for the
//! limit's tolerance after the demand stops would not do: every bucket would still go back to
//! its whole burst later, and `hosts x burst` come every cycle of about twice the tolerance; any
//! hold shorter than `hosts x burst / rate` leaves a source more than the rate over a long run.
//!
//! (Before the share words, the round took the refill back by moving the bucket's TATs on by
//! `(1 - s) x elapsed`: between rounds the bucket refilled at the whole rate, so a host whose
//! round ran late admitted up to its whole demand and owed it afterwards: 1 s windows of an even
//! split over 8 hosts swung 0.85-1.14 x the budget.)
//!
//! A claim of any size takes a key's share on this host down to the smallest word (1 / 65,536 of
//! the rate) while it lasts, and leaves no debt: a word only makes packets cost more. Once the
//! claims stop, the next rounds give the word back. A peer publishing a key with no demand only
//! takes its own even part of an idle key (one part per counted identity, as each takes a part of
//! the slack).
//!
//! [`lag_allowance_ns`]: super::remote::lag_allowance_ns
//! [`LocalTracker::update`]: super::publish::LocalTracker::update

use ratelimit_common::{bucket_header, rule_flags, BucketKey, Limit, SHARE_ONE};

use crate::maps::{store::Slot, MapsError, PinnedMaps};

/// This host's share of a key's budget from the demand (packets/s) here (`local`) and at its
/// counted peers (`peers`), multiplied by `factor` (`heard / known` under `on_partition =
/// "share"`, else 1), where `hosts` hold the key (this one and the counted peers that publish it
/// with a known demand, see [`Round::holders`]): 1 (times the factor) when this host alone holds
/// it (fail open).
///
/// When the cluster's demand `D = local + peers` reaches the limit's packet rate (`rate`, None
/// for a limit without one) the share is `local / D`: every host's part of the rate is below its
/// demand, and together they admit the rate; a host with no demand of its own gets none of the
/// refill. Below the rate there is slack, `rate - D`, and every host holding the key gets its
/// own demand and an even part of the slack: `(local + (rate - D) / hosts) / rate`. So nobody is
/// limited below the budget even while the figures are a round old: a host whose demand has
/// just begun (its published figure still 0) has its part of the slack meanwhile, not nothing
/// (with shares proportional to demand alone, a source at two hosts under the budget lost 40% of
/// its packets at one of them for a round). With no demand anywhere that is `1 / hosts` (and
/// likewise for a limit without a packet rate): an idle key's buckets together hold one burst,
/// not one each (see the module docs).
///
/// [`Round::holders`]: super::remote::Round::holders
#[must_use]
pub fn share(local: f64, peers: f64, factor: f64, rate: Option<f64>, hosts: f64) -> f64 {
    let local = if local.is_nan() { 0.0 } else { local.max(0.0) };
    let peers = if peers.is_nan() { 0.0 } else { peers.max(0.0) };
    let hosts = if hosts.is_nan() { 1.0 } else { hosts.max(1.0) };
    let demand = local + peers;
    let s = match rate {
        Some(r) if r > 0.0 && demand < r => (local + (r - demand) / hosts) / r,
        _ if demand <= 0.0 => 1.0 / hosts,
        _ => local / demand,
    };
    (s * factor).clamp(0.0, 1.0)
}

/// A limit's packet rate (packets/s), `None` for one without a packet limit.
#[must_use]
pub fn packet_rate(limit: &Limit) -> Option<f64> {
    #[expect(clippy::cast_precision_loss, reason = "a rate")]
    (limit.flags & rule_flags::PKT_LIMIT != 0 && limit.pkt_interval_ns > 0)
        .then(|| 1e9 / limit.pkt_interval_ns as f64)
}

/// How far a round moves a TAT for share `s` after `elapsed_ns` (at most `max_elapsed_ns`: a
/// round that ran late takes back no more than that, failing open): `(1 - s) x elapsed`.
#[must_use]
pub fn advance_ns(s: f64, elapsed_ns: u64, max_elapsed_ns: u64) -> u64 {
    #[expect(clippy::cast_precision_loss, reason = "nanoseconds of a round")]
    let e = elapsed_ns.min(max_elapsed_ns) as f64;
    #[expect(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        reason = "0 <= (1 - s) x e <= e"
    )]
    let a = ((1.0 - s.clamp(0.0, 1.0)) * e).round() as u64;
    a
}

/// Packets and bytes a TAT advance of `pkt_ns` and `byte_ns` stands for under `limit` (what
/// the refill withheld would have let through).
#[must_use]
pub fn withheld(limit: &Limit, pkt_ns: u64, byte_ns: u64) -> (u64, u64) {
    let pkts = if limit.flags & rule_flags::PKT_LIMIT != 0 && limit.pkt_interval_ns > 0 {
        pkt_ns / limit.pkt_interval_ns
    } else {
        0
    };
    let bytes = if limit.flags & rule_flags::BYTE_LIMIT != 0 && limit.byte_interval_fp > 0 {
        u64::try_from((u128::from(byte_ns) << 16) / u128::from(limit.byte_interval_fp))
            .unwrap_or(u64::MAX)
    } else {
        0
    };
    (pkts, bytes)
}

/// The share word (see `Bucket::created_share`) for share `s` of the rate: `s x SHARE_ONE`
/// rounded, at least 1 (a host with no share refills at 1 / 65,536 of the rate, next to
/// nothing), and 0 (none: the whole rate) for a share that rounds to the whole.
#[must_use]
pub fn share_word(s: f64) -> u16 {
    #[expect(clippy::cast_precision_loss, reason = "2^16")]
    let one = SHARE_ONE as f64;
    let q = (s.clamp(0.0, 1.0) * one).round();
    if q >= one {
        0
    } else {
        #[expect(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            reason = "0 <= q < 2^16"
        )]
        let q = q as u16;
        q.max(1)
    }
}

/// Gives the bucket under `key` share word `share` (see [`share_word`]) in place in the bucket
/// store: the program then charges its packets (and bytes) `SHARE_ONE / share` times their cost,
/// so it refills at its share of the rate, while `Config::shares_until_ns` is ahead; a bucket
/// whose share grows keeps the tokens it holds (see `MappedStore::set_share`). A source
/// without a bucket here is left alone. `Ok(None)` when there is no bucket, else the word the
/// bucket had.
pub fn set_share(
    maps: &PinnedMaps,
    key: &BucketKey,
    _limit: &Limit,
    share: u16,
    now: u64,
    coarse_now: u64,
) -> Result<Option<u16>, MapsError> {
    for _ in 0..3 {
        let (slot, gen) = maps.locate_bucket(key, coarse_now)?;
        if gen == 0 {
            return Ok(None);
        }
        match slot {
            Slot::Found(i) => {
                let header = bucket_header(key.rule, key.family, gen);
                if let Some(old) = maps.store().set_share(i, header, share, now) {
                    return Ok(Some(old));
                }
            }
            Slot::Vacant { .. } => return Ok(None),
            Slot::Busy => {}
        }
    }
    Err(MapsError::Op {
        map: ratelimit_common::map_names::BUCKETS,
        reason: "bucket kept changing while its share was set".into(),
    })
}

#[cfg(test)]
mod tests;
