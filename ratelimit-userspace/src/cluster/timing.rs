//! Every period the cluster derives from `[cluster] sync_interval_ms`, in one place: how often
//! chitchat gossips, how long a round's shares hold, when a peer's demand goes stale, when a
//! round counts as late, when a silent peer stops being counted, when a key not read is
//! forgotten. Each is a multiple of the sync interval chosen for the reason given beside it;
//! change one here and the docs' figures (docs/cluster.md, "Accuracy" and "Failures fail open")
//! with it.

use std::time::Duration;

/// A peer is no longer counted after this long without news, unless 10 sync intervals are
/// longer.
pub const MIN_PEER_TIMEOUT: Duration = Duration::from_secs(3);

/// How long a round's shares hold in the program (`Config::shares_until_ns`), in sync
/// intervals: a round that runs later than this after the one before finds them lapsed (every
/// bucket at the whole rate: fail open), and what it withheld is counted up to this much.
pub const LAG_ROUNDS: u64 = 3;

/// A counted peer's demand stops taking a share once its sync key has not moved on here for
/// this many sync intervals: its own shares' lag allowance ([`LAG_ROUNDS`]: a stopped peer's
/// buckets refill at the whole rate by then), and two more for a busy peer's round running late
/// and gossip bringing its sync key (a flooded debug agent on 2 busy cores ran rounds 186 ms
/// late, and at 3 intervals its peers dropped its demand for a round several times a second,
/// each taking its share: small hosts of a 95/5 split admitted 2-3x their share). Longer only
/// costs the other hosts part of their share for longer after a peer stops (never more than the
/// budget).
pub const STALE_ROUNDS: u64 = LAG_ROUNDS + 2;

/// A key not read for this many sync intervals is forgotten by the local demand tracker (its
/// readings between full scans of the store are kept that long).
pub const FORGET_ROUNDS: u64 = 30;

/// A silent peer stops being counted after this many sync intervals, at least
/// [`MIN_PEER_TIMEOUT`].
pub const TIMEOUT_ROUNDS: u64 = 10;

/// The periods of one cluster, derived once from its sync interval.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timing {
    interval: Duration,
}

impl Timing {
    /// The periods for a sync interval of `sync_interval_ms` (at least 1 ms).
    #[must_use]
    pub fn new(sync_interval_ms: u64) -> Self {
        Self {
            interval: Duration::from_millis(sync_interval_ms.max(1)),
        }
    }

    /// The sync interval: a round every this long.
    #[must_use]
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// The sync interval in ns.
    #[must_use]
    pub fn interval_ns(&self) -> u64 {
        u64::try_from(self.interval.as_nanos()).unwrap_or(u64::MAX)
    }

    /// The time a bursty key's demand is read over, [`DEMAND_HISTORY`] intervals: the same
    /// span for this host's readings and for a peer's, however many of the peer's syncs gossip
    /// skipped (see [`DemandWindow::rate`]).
    ///
    /// [`DEMAND_HISTORY`]: crate::cluster::remote::DEMAND_HISTORY
    /// [`DemandWindow::rate`]: crate::cluster::remote::DemandWindow::rate
    #[must_use]
    pub fn demand_span_ns(&self) -> u64 {
        self.interval_ns()
            .saturating_mul(crate::cluster::remote::DEMAND_HISTORY as u64)
    }

    /// How often chitchat gossips: twice per interval. chitchat sends each round to a few peers
    /// (3 live ones at most), so a value published at one round reaches all 8 hosts of a
    /// cluster only after one or two gossip rounds; at one gossip round per sync, the shares of
    /// a change of split were right only 3.4-8.5 sync intervals after it
    /// (tests/tests/e2e_cluster_scale.rs, 5 runs), at two 2.1-2.5. It costs about 1.8x the
    /// gossip bytes (24-26 KB/s per host at 8 hosts and 100 ms: 44-46).
    #[must_use]
    pub fn gossip(&self) -> Duration {
        self.interval / 2
    }

    /// How long a round's shares hold: [`LAG_ROUNDS`] intervals.
    #[must_use]
    pub fn lag_ns(&self) -> u64 {
        self.interval_ns().saturating_mul(LAG_ROUNDS)
    }

    /// When a counted peer's demand goes stale: [`STALE_ROUNDS`] intervals without its sync key
    /// moving on.
    #[must_use]
    pub fn stale_ns(&self) -> u64 {
        self.interval_ns().saturating_mul(STALE_ROUNDS)
    }

    /// A round is late when its shares land more than a quarter of the sync interval after it
    /// was due: a round takes well under that (`last_sync_us`, a few ms at 10,000 keys), so
    /// only a stalled agent crosses it.
    #[must_use]
    pub fn late_after_ns(&self) -> u64 {
        self.interval_ns() / 4
    }

    /// The silence after which a peer stops being counted: [`TIMEOUT_ROUNDS`] intervals, at
    /// least [`MIN_PEER_TIMEOUT`].
    #[must_use]
    pub fn peer_timeout(&self) -> Duration {
        MIN_PEER_TIMEOUT.max(
            self.interval
                .saturating_mul(u32::try_from(TIMEOUT_ROUNDS).unwrap_or(u32::MAX)),
        )
    }

    /// When a key not read is forgotten by the local demand tracker: [`FORGET_ROUNDS`]
    /// intervals.
    #[must_use]
    pub fn forget_ns(&self) -> u64 {
        self.interval_ns().saturating_mul(FORGET_ROUNDS)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::Timing;

    /// max(3 s, 10 x `sync_interval_ms`), over the whole range the config accepts (10..=10000).
    #[test]
    fn peer_timeout_is_ten_sync_intervals_and_at_least_three_seconds() {
        for (sync_ms, want_ms) in [
            (10, 3000),
            (100, 3000),
            (299, 3000),
            (300, 3000),
            (301, 3010),
            (400, 4000),
            (1000, 10_000),
            (10_000, 100_000),
        ] {
            assert_eq!(
                Timing::new(sync_ms).peer_timeout(),
                Duration::from_millis(want_ms),
                "sync_interval_ms = {sync_ms}"
            );
        }
    }

    #[test]
    fn the_periods_are_the_documented_multiples_of_the_interval() {
        let t = Timing::new(100);
        assert_eq!(t.interval_ns(), 100_000_000);
        assert_eq!(t.gossip(), Duration::from_millis(50));
        assert_eq!(t.lag_ns(), 300_000_000);
        assert_eq!(t.stale_ns(), 500_000_000);
        assert_eq!(t.late_after_ns(), 25_000_000);
        assert_eq!(t.forget_ns(), 3_000_000_000);
        assert!(
            t.lag_ns() < t.stale_ns(),
            "a peer's own shares lapse before its demand goes stale"
        );
        assert_eq!(Timing::new(0).interval(), Duration::from_millis(1));
    }
}
