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
//! time), and the XDP program runs the bucket on a clock slowed by `s`
//! (`ratelimit_common::share`): it refills at `s x rate` (and `s x bytes_rate`) at every
//! instant, however late the next round runs, and holds up to the limit's whole burst, so a
//! host banks its share's refill over the gaps between the bursts it receives. The words hold
//! while `Config::shares_until_ns` (moved on by every round to the end of its lag allowance,
//! [`Timing::lag_ns`]) is ahead: an agent that stops, or whose rounds stall, leaves every
//! bucket at the whole rate with the tokens it held (fail open). A new key's bucket refills at
//! the whole rate until its first round. Nothing depends on what the peers admitted, so there is
//! no feedback from admissions: when the demand is steady, every host's `s x rate` is below its
//! own demand as soon as the cluster's demand exceeds the rate, and nobody is limited otherwise.
//!
//! An idle key (no demand anywhere) keeps its even part, `1 / hosts` holding it, for as long as
//! they hold it (a host publishes an idle key while its bucket lasts, see
//! [`LocalTracker::update`]): the shares of the holders add up to 1 whether the source sends or
//! not, so the buckets together refill at one rate. Each holds the whole burst, or `hosts x
//! share` bursts if that is 1.5 or more (`ratelimit_common::share`), so after a silence long enough for every
//! holder to refill, an on/off source finds up to `min((2 x hosts - 1) x burst, rate x silence)`
//! across the hosts, where one bucket would hold `burst`: the price of letting each host bank
//! its own refill (see docs/cluster.md's per-cycle bound). Over any longer interval the refill,
//! the rate, is what bounds it.
//!
//! A claim of any size takes a key's share on this host down to the smallest word (1 / 65,536 of
//! the rate) while it lasts, and leaves no debt: a word only slows the bucket's clock, its tokens
//! kept. Once the claims stop, the next rounds give the word back. A peer publishing a key with
//! no demand only takes its own even part of an idle key (one part per counted identity, as
//! each takes a part of the slack).
//!
//! [`Timing::lag_ns`]: super::timing::Timing::lag_ns
//! [`LocalTracker::update`]: super::publish::LocalTracker::update

use ratelimit_common::{bucket_header, rule_flags, BucketKey, Limit, SHARE_ONE};

pub use self::own::OwnFigures;
use crate::maps::{locator::Locator, store::Slot, MapsError};

mod own;

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

/// Gives the bucket under `key` (found with `locator`) share word `share` (see [`share_word`])
/// among `holders` hosts in place in the bucket store: the program then runs it on a clock
/// slowed by the share (`ratelimit_common::share`), so it refills at its share of the rate and
/// holds `holders x share` bursts (at least a packet), while `Config::shares_until_ns` is ahead;
/// a bucket whose share changes keeps its tokens, at most what it then holds (see
/// `MappedStore::set_share`). A source without a bucket here is left alone. `Ok(None)` when
/// there is no bucket, else the word the bucket had.
pub fn set_share(
    locator: &Locator<'_>,
    key: &BucketKey,
    (share, holders): (u16, u32),
    limit: &Limit,
    now: u64,
    coarse_now: u64,
) -> Result<Option<u16>, MapsError> {
    for _ in 0..3 {
        let (slot, gen) = locator.locate(key, coarse_now)?;
        if gen == 0 {
            return Ok(None);
        }
        match slot {
            Slot::Found(i) => {
                let header = bucket_header(key.rule, key.family, gen);
                let holders = u8::try_from(holders.min(255)).unwrap_or(u8::MAX);
                if let Some(old) =
                    locator
                        .maps()
                        .store()
                        .set_share(i, header, (share, holders), limit, now)
                {
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
