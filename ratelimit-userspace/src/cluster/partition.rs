//! `[cluster] on_partition`: what a part of the cluster enforces while it cannot hear the rest.
//!
//! - `fail_open` (the default): each side enforces the whole budget on its own.
//! - `share`: each side enforces `budget x heard / known`, where `heard` is this host plus the
//!   peers counted now and `known` this host plus every peer *address* counted within the last
//!   `partition_memory_s` (a restarted peer, a new incarnation at the same address, is the same
//!   host). Every host's share of a key (its demand over the demand it hears of, see
//!   [`super::sync`]) is multiplied by `heard / known`, so the buckets on the side fill at
//!   `heard / known` of the rate together.
//!
//! Memory is per agent and in memory only: a host not heard for `partition_memory_s` is
//! forgotten (so a host removed for good stops reducing the others' share after that long), and
//! a restarted agent knows only the hosts it hears (it starts at the whole budget: fail open).

use std::{collections::HashMap, net::SocketAddr};

use crate::config::OnPartition;

/// The hosts heard and known, and the share of the budget this side enforces.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Share {
    /// This host and the peers counted now.
    pub heard: u64,
    /// This host and every peer address counted within the memory.
    pub known: u64,
}

impl Share {
    /// `heard / known` (1 when nothing is missing or under `fail_open`).
    #[must_use]
    pub fn fraction(&self) -> f64 {
        if self.known <= self.heard || self.heard == 0 {
            1.0
        } else {
            #[expect(clippy::cast_precision_loss, reason = "host counts")]
            let f = self.heard as f64 / self.known as f64;
            f
        }
    }

    /// Hosts known but not heard now.
    #[must_use]
    pub fn missing(&self) -> u64 {
        self.known.saturating_sub(self.heard)
    }
}

/// The peer addresses counted lately, with when each was last counted.
#[derive(Debug)]
pub struct Partition {
    policy: OnPartition,
    memory_ns: u64,
    last_counted: HashMap<SocketAddr, u64>,
}

impl Partition {
    /// A tracker for `policy`, forgetting a peer address not counted for `memory_ns`.
    #[must_use]
    pub fn new(policy: OnPartition, memory_ns: u64) -> Self {
        Self {
            policy,
            memory_ns,
            last_counted: HashMap::new(),
        }
    }

    /// Folds in the peer addresses counted at `now` (monotonic ns) and returns the share.
    pub fn observe<'a>(
        &mut self,
        now: u64,
        counted: impl IntoIterator<Item = &'a SocketAddr>,
    ) -> Share {
        let mut heard = std::collections::HashSet::new();
        for addr in counted {
            heard.insert(*addr);
            self.last_counted.insert(*addr, now);
        }
        let memory = self.memory_ns;
        self.last_counted
            .retain(|_, t| now.saturating_sub(*t) <= memory);
        Share {
            heard: 1 + heard.len() as u64,
            known: 1 + self.last_counted.len() as u64,
        }
    }

    /// The share of each budget enforced: [`Share::fraction`] under `share`, 1 under
    /// `fail_open`.
    #[must_use]
    pub fn budget_share(&self, share: Share) -> f64 {
        match self.policy {
            OnPartition::FailOpen => 1.0,
            OnPartition::Share => share.fraction(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;

    const S: u64 = 1_000_000_000;

    fn addr(i: u8) -> SocketAddr {
        SocketAddr::new(IpAddr::from([192, 0, 2, i]), 7946)
    }

    #[test]
    fn known_hosts_are_remembered_by_address_for_the_memory_then_forgotten() {
        let mut p = Partition::new(OnPartition::Share, 10 * S);
        assert_eq!(
            p.observe(0, &[addr(1), addr(2)]),
            Share { heard: 3, known: 3 }
        );
        // addr(2) restarts: same address, counted again; addr(1) goes quiet.
        assert_eq!(p.observe(S, &[addr(2)]), Share { heard: 2, known: 3 });
        assert_eq!(p.observe(10 * S, &[addr(2)]), Share { heard: 2, known: 3 });
        // 10 s after addr(1) was last counted plus a tick: forgotten.
        assert_eq!(
            p.observe(10 * S + 1, &[addr(2)]),
            Share { heard: 2, known: 2 }
        );
        assert!((Share { heard: 1, known: 3 }.fraction() - 1.0 / 3.0).abs() < 1e-9);
        assert!((Share { heard: 2, known: 2 }.fraction() - 1.0).abs() < 1e-9);
    }
}
