//! The figure a host divides by for itself: its own demand as of the time of its peers' figures.

use std::collections::{HashMap, VecDeque};

use crate::cluster::publish::KeyName;

/// This host's demand as it read it at its last few syncs (the time of each sync, by the clock
/// its peers' sync times are read by; demand per key), for dividing by figures as old as the
/// peers' (see [`OwnFigures::as_of`]).
#[derive(Clone, Debug, Default)]
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

    /// Its figures as of `as_of`, the mean time of the counted peers' syncs it divides by
    /// ([`mean_time`]): per key, between the two syncs around it in proportion to where it
    /// falls (the keys of the nearer one; a key the other lacks keeps the nearer one's figure),
    /// the first before them and this round's after them. Every host then divides figures of
    /// about the same age, so the shares add up to about 1 while demand moves: each host's
    /// rounds fall at their own point of the interval, so its peers' figures are half an
    /// interval old on average. Taken a round old (its last publication), a host read itself
    /// older than the others and the shares of an on/off source added up to 0.87-1.12 over
    /// its cycle (16 hosts in the simulator); as of the mean, 0.93-1.04. Taken fresh, newer:
    /// a source starting to send at every host found each host taking most of the budget for
    /// a round. Without counted peers, the last published (the one before this round's).
    #[must_use]
    pub fn as_of(&self, as_of: Option<u64>) -> HashMap<KeyName, f64> {
        let n = self.0.len();
        let Some(t) = as_of else {
            return n
                .checked_sub(2)
                .map(|i| self.0[i].1.clone())
                .unwrap_or_default();
        };
        let Some(after) = self.0.iter().position(|(at, _)| *at >= t) else {
            return self.0.back().map(|f| f.1.clone()).unwrap_or_default();
        };
        if after == 0 {
            return self.0[0].1.clone();
        }
        let ((t0, before), (t1, later)) = (&self.0[after - 1], &self.0[after]);
        #[expect(clippy::cast_precision_loss, reason = "a fraction of an interval")]
        let f = (t - t0) as f64 / (t1 - t0) as f64;
        let (nearer, other) = if f <= 0.5 {
            (before, later)
        } else {
            (later, before)
        };
        nearer
            .iter()
            .map(|(k, &d)| {
                let v = match (before.get(k), later.get(k)) {
                    (Some(&a), Some(&b)) if other.contains_key(k) => a + (b - a) * f,
                    _ => d,
                };
                (k.clone(), v)
            })
            .collect()
    }
}

/// The mean of the peers' sync times `times` (None without any): the time [`OwnFigures::as_of`]
/// takes this host's figures at.
#[must_use]
pub fn mean_time(times: impl IntoIterator<Item = u64>) -> Option<u64> {
    let (sum, n) = times
        .into_iter()
        .fold((0u128, 0u128), |(s, n), t| (s + u128::from(t), n + 1));
    (n > 0).then(|| u64::try_from(sum / n).unwrap_or(u64::MAX))
}
