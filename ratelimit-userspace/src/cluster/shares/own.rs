//! The figure a host divides by for itself: its own demand as of the time of its peers' figures.

use std::collections::{HashMap, VecDeque};

use crate::cluster::publish::KeyName;

/// This host's demand as it read it at its last few syncs (the time of each sync, by the clock
/// its peers' sync times are read by; demand per key), for dividing by figures as old as the
/// peers' (see [`OwnFigures::as_of`]).
#[derive(Debug, Default)]
pub struct OwnFigures(VecDeque<(u64, HashMap<KeyName, f64>)>);

impl OwnFigures {
    /// Syncs kept (this round's too): the gossip brings a figure within one or two sync
    /// intervals.
    const KEPT: usize = 5;

    /// Records this round's figures, read at `at`.
    pub fn push(&mut self, at: u64, demand: HashMap<KeyName, f64>) {
        self.0.push_back((at, demand));
        while self.0.len() > Self::KEPT {
            self.0.pop_front();
        }
    }

    /// Records `fresh`, this round's figures read at `at`, and returns the figures to divide by
    /// this round: [`OwnFigures::as_of`] `oldest_peer` (the oldest counted peer's sync or
    /// write), and for a key with none there (new here) its fresh one: its peers have no
    /// figure for it from this host either. Gossip's rounds and the store's both divide by it.
    pub fn to_divide_by(
        &mut self,
        at: u64,
        fresh: HashMap<KeyName, f64>,
        oldest_peer: Option<u64>,
    ) -> HashMap<KeyName, f64> {
        self.push(at, fresh.clone());
        let mut figures = self.as_of(oldest_peer);
        for (k, d) in fresh {
            figures.entry(k).or_insert(d);
        }
        figures
    }

    /// Its figures as of `as_of` (the oldest counted peer's sync): the ones read nearest that
    /// time, before or after it (this round's, at the latest). Every host then divides figures
    /// no newer than the oldest it reads of its peers, so a change of demand reaches its own
    /// figure no sooner than theirs: with its last publication against peers that synced since,
    /// a host whose round falls late in the interval mixed its own old figure with their new
    /// ones and took most of the budget for a round at every change of demand. As of the peers'
    /// mean sync time (interpolated), its figure was newer than some of theirs at every step up
    /// of demand: an on/off source end to end (3 hosts, 0.1 s on, 1 s off) gained 60-80 packets
    /// a cycle over the rate, past the written bound, and a heavy new key under a flood of
    /// two-packet keys 835 over `rate x T` (bound 750). Without counted peers, the last
    /// published (the one before this round's).
    #[must_use]
    pub fn as_of(&self, as_of: Option<u64>) -> HashMap<KeyName, f64> {
        let n = self.0.len();
        let Some(t) = as_of else {
            return n
                .checked_sub(2)
                .map(|i| self.0[i].1.clone())
                .unwrap_or_default();
        };
        if n == 0 {
            return HashMap::new();
        }
        let after = self.0.iter().position(|(at, _)| *at > t).unwrap_or(n - 1);
        let before = after.saturating_sub(1);
        let nearest = if t.abs_diff(self.0[before].0) <= t.abs_diff(self.0[after].0) {
            before
        } else {
            after
        };
        self.0[nearest].1.clone()
    }
}
