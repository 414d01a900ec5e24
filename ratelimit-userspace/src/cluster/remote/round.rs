//! The outcome of one round: the counted peers' demand and holders per key.

use std::collections::HashMap;

use crate::cluster::publish::KeyName;

/// The outcome of one sync.
#[derive(Debug)]
pub struct Round<P> {
    /// Per key of a cluster-scoped limit here, each counted peer's demand (packets/s, > 0).
    pub demand: HashMap<KeyName, Vec<(P, f64)>>,
    /// Per key of a cluster-scoped limit here, how many counted peers hold it: publish it with
    /// a known demand (0 included; not stale). Each of them has a bucket of the key, which the
    /// budget is divided between (see [`super::shares::share`]). A key with no demand counts
    /// only if the keys read from the peer are the ones its sync key names ([`keys_digest`]):
    /// a key relayed under the peer's id by another member with the cluster key stays in
    /// chitchat's state of the peer for as long as it lives, idle; read as held, it kept a
    /// source at a part of its rate here for that long, after the relaying member had stopped.
    ///
    /// [`super::shares::share`]: crate::cluster::shares::share
    /// [`keys_digest`]: crate::cluster::publish::keys_digest
    pub holders: HashMap<KeyName, u32>,
    /// Keys read from counted peers.
    pub keys_synced: u64,
    /// Peers counted in this round.
    pub counted_peers: u64,
    /// Readings refused in this round (see [`RemoteTracker::round`]): a sync key dated ahead of
    /// this host's clock, one whose sequence went back, a key's epoch beyond the peer's own
    /// next epoch, a counter that went back.
    ///
    /// [`RemoteTracker::round`]: super::RemoteTracker::round
    pub refused: u64,
}

impl<P> Default for Round<P> {
    fn default() -> Self {
        Self {
            demand: HashMap::new(),
            holders: HashMap::new(),
            keys_synced: 0,
            counted_peers: 0,
            refused: 0,
        }
    }
}

impl<P> Round<P> {
    /// The counted peers' demand for `name`, packets/s, summed.
    #[must_use]
    pub fn peer_demand(&self, name: &KeyName) -> f64 {
        self.demand
            .get(name)
            .map_or(0.0, |d| d.iter().map(|(_, r)| r).sum())
    }

    /// The hosts that hold `name`: this one and the counted peers that hold it (see
    /// [`Round::holders`]).
    #[must_use]
    pub fn hosts_holding(&self, name: &KeyName) -> u32 {
        1 + self.holders.get(name).copied().unwrap_or(0)
    }
}
