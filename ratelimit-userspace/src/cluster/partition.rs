//! `[cluster] on_partition`: what a part of the cluster enforces while it cannot hear the rest.
//!
//! - `fail_open` (the default): each side enforces the whole budget on its own.
//! - `share`: each side enforces `budget x heard / known`, where `heard` is this host plus the
//!   peers counted now and `known` this host plus every peer *IP address* counted within the
//!   last `partition_memory_s` (a restarted peer, a new incarnation at the same address, is the
//!   same host; so is every identity at one IP address, whatever its port: a member with the key
//!   running throwaway identities on ports of its own until each was counted, then stopping them,
//!   made every host enforce `hosts / (hosts + identities)` of the budget for the whole memory).
//!   Several agents sharing one IP address are therefore counted as one host: while any of them
//!   is heard, none of them is missing. Every host's share of a key (its demand over the demand it hears of, see
//!   [`super::sync`]) is multiplied by `heard / known`, so the buckets on the side fill at
//!   `heard / known` of the rate together.
//!
//! Memory is per agent and in memory only: a host not heard for `partition_memory_s` is
//! forgotten (so a host removed for good stops reducing the others' share after that long), and
//! a restarted agent knows only the hosts it hears (it starts at the whole budget: fail open).

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
};

use crate::config::OnPartition;

/// The hosts heard and known, and the share of the budget this side enforces.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Share {
    /// This host and the peers counted now (distinct IP addresses).
    pub heard: u64,
    /// This host and every peer IP address counted within the memory.
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

/// The peer IP addresses counted lately, with when each was last counted.
#[derive(Debug)]
pub struct Partition {
    policy: OnPartition,
    memory_ns: u64,
    last_counted: HashMap<IpAddr, u64>,
}

impl Partition {
    /// A tracker for `policy`, forgetting a peer IP address not counted for `memory_ns`.
    #[must_use]
    pub fn new(policy: OnPartition, memory_ns: u64) -> Self {
        Self {
            policy,
            memory_ns,
            last_counted: HashMap::new(),
        }
    }

    /// Folds in the peer addresses counted at `now` (monotonic ns) and returns the share; peers
    /// are told apart by IP address only.
    pub fn observe<'a>(
        &mut self,
        now: u64,
        counted: impl IntoIterator<Item = &'a SocketAddr>,
    ) -> Share {
        let mut heard = std::collections::HashSet::new();
        for addr in counted {
            let ip = addr.ip().to_canonical();
            heard.insert(ip);
            self.last_counted.insert(ip, now);
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

    /// A member with the key runs throwaway identities on ports of its own until each is
    /// counted, then stops them: they are one host with it (counted by IP address), so the share
    /// of the hosts still heard is not cut for the memory.
    #[test]
    fn throwaway_identities_on_one_address_count_as_one_host() {
        let mut p = Partition::new(OnPartition::Share, 600 * S);
        let honest = [addr(1), addr(2)];
        let evil: Vec<SocketAddr> = (0..60u16)
            .map(|i| SocketAddr::new(IpAddr::from([192, 0, 2, 9]), 20_000 + i))
            .collect();
        let mut all: Vec<SocketAddr> = honest.to_vec();
        all.extend(&evil);
        assert_eq!(p.observe(0, &all), Share { heard: 4, known: 4 });
        // The throwaways stop; the member's own agent (one of its ports) goes on.
        let after = p.observe(S, &[addr(1), addr(2), evil[0]]);
        assert_eq!(after, Share { heard: 4, known: 4 });
        assert!((p.budget_share(after) - 1.0).abs() < 1e-9);
        // The member stops entirely: one host missing, not 60.
        let gone = p.observe(2 * S, &honest);
        assert_eq!(gone, Share { heard: 3, known: 4 });
        assert!((p.budget_share(gone) - 0.75).abs() < 1e-9);
        // An IPv4-mapped IPv6 address is the same host as its IPv4 address.
        let mapped = SocketAddr::new(IpAddr::from([192, 0, 2, 1]).to_canonical(), 1);
        let v6 = SocketAddr::new(
            std::net::Ipv4Addr::new(192, 0, 2, 2)
                .to_ipv6_mapped()
                .into(),
            2,
        );
        assert_eq!(
            p.observe(3 * S, &[mapped, v6]),
            Share { heard: 3, known: 4 }
        );
    }
}
