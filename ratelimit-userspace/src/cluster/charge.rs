//! Giving a local bucket only its share of the cluster's budget, from user space (the XDP program
//! is not involved).
//!
//! Every round, for each key of a cluster-scoped limit, this host's share of the budget is its
//! demand (packets per second that reached its bucket, admitted or dropped) over the demand of
//! the cluster (its own plus what its counted peers report): `s = local / (local + peers)`, 1
//! when no counted peer has demand for the key (fail open), times `heard / known` under
//! `on_partition = "share"`. The program refills the bucket at the limit's whole rate; the round
//! takes back what it should not have: it moves the bucket's packet and byte TATs on by
//! `(1 - s) x elapsed` from `max(TAT, now)` (elapsed: the time since the last round, at most
//! [`lag_allowance_ns`]), so the bucket refills at `s x rate` (and `s x bytes_rate`); a full
//! bucket too (see [`withhold_tat`](crate::maps::store::withhold_tat)). Nothing depends on what the peers
//! admitted, so there is no feedback from admissions: when the demand is steady, every host's
//! `s x rate` is below its own demand as soon as the cluster's demand exceeds the rate (every
//! bucket is saturated, and together they admit `rate`), and nobody is limited otherwise.
//!
//! A round moves a TAT by at most the time since the last round: a claim of any size takes a
//! key's refill on this host down to nothing while it lasts, and leaves at most one round of
//! debt (what the program admitted meanwhile at the whole rate), no more. Once the claims stop,
//! the bucket refills at the whole rate again from the next round on.
//!
//! [`lag_allowance_ns`]: super::remote::lag_allowance_ns

use ratelimit_common::{bucket_header, rule_flags, BucketKey, Limit};

use crate::maps::{store::Slot, MapsError, PinnedMaps};

/// This host's share of a key's budget: `local / (local + peers)` demand (packets/s), 1 when no
/// counted peer has demand (fail open), multiplied by `factor` (`heard / known` under
/// `on_partition = "share"`, else 1). A host with no demand of its own while peers have some
/// gets none of the refill (it keeps what its bucket holds).
#[must_use]
pub fn share(local: f64, peers: f64, factor: f64) -> f64 {
    let s = if peers.is_nan() || peers <= 0.0 {
        1.0
    } else if local.is_nan() || local <= 0.0 {
        0.0
    } else {
        local / (local + peers)
    };
    (s * factor).clamp(0.0, 1.0)
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

/// The ceilings of a bucket's packet and byte TATs at `now`: `now + tolerance + lag_ns`. A round
/// moves a TAT by at most `lag_ns` from at most `now + tolerance` (where the program leaves a
/// bucket it drains), so no honest round reaches them; they bound what a bucket can owe whatever
/// happens (counted as `debt_capped` when one cuts an advance short).
#[must_use]
pub fn ceilings(limit: &Limit, lag_ns: u64, now: u64) -> (u64, u64) {
    (
        now.saturating_add(limit.pkt_tolerance_ns)
            .saturating_add(lag_ns),
        now.saturating_add(limit.byte_tolerance_ns)
            .saturating_add(lag_ns),
    )
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

/// Withholds `advance` ns of refill from the bucket under `key` (of limit `limit`) in place in
/// the bucket store, with the XDP program's compare-and-swap (no packet admitted meanwhile is
/// lost from the TAT): each TAT of a rate the limit sets moves on by `advance` from
/// `max(tat, now)`, not past `ceilings` (see [`ceilings`]). A source without a bucket here is left
/// alone (its first packet finds a full bucket, as without the cluster: its burst is spent once
/// per host). `coarse_now` is `CLOCK_MONOTONIC_COARSE`, which the store's lookup judges records
/// by. `Ok(None)` when there is no bucket, else the TAT ns moved (packet, byte) and whether a
/// ceiling cut either short.
pub fn withhold(
    maps: &PinnedMaps,
    key: &BucketKey,
    limit: &Limit,
    advance: u64,
    now: u64,
    coarse_now: u64,
    ceilings: (u64, u64),
) -> Result<Option<(u64, u64, bool)>, MapsError> {
    let pkt = if limit.flags & rule_flags::PKT_LIMIT != 0 {
        advance
    } else {
        0
    };
    let byte = if limit.flags & rule_flags::BYTE_LIMIT != 0 {
        advance
    } else {
        0
    };
    // Three tries: the record may be taken by a packet between the lookup and the write.
    for _ in 0..3 {
        let (slot, gen) = maps.locate_bucket(key, coarse_now)?;
        if gen == 0 {
            // The rule left the set meanwhile: nothing to slow.
            return Ok(None);
        }
        match slot {
            Slot::Found(i) => {
                let header = bucket_header(key.rule, key.family, gen);
                if let Some(moved) =
                    maps.store()
                        .withhold(i, header, now, (pkt, ceilings.0), (byte, ceilings.1))
                {
                    return Ok(Some(moved));
                }
            }
            Slot::Vacant { .. } => return Ok(None),
            Slot::Busy => {}
        }
    }
    Err(MapsError::Op {
        map: ratelimit_common::map_names::BUCKETS,
        reason: "bucket kept changing while its refill was slowed".into(),
    })
}

#[cfg(test)]
mod tests;
