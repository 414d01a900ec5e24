//! The ids chitchat is let hear of through digests, within fixed bounds per sender and in all.

use chitchat::ChitchatId;

/// Most ids one sender address may have admitted as its own incarnations
/// ([`Introductions`]): an agent restarting a few times within [`FORGET_MS`].
pub const OWN_IDS_PER_IP: usize = 8;
/// Most ids admitted as their senders' own, all addresses together (a member with the key and
/// many addresses, an IPv6 prefix say, must not grow this host's digest past a datagram either):
/// 64 counted peers restarting twice within [`FORGET_MS`], and more.
pub const MAX_OWN_IDS: usize = 160;
/// Most ids other than its own one sender address may have introduced ([`Introductions`]).
pub const INTRODUCED_PER_IP: usize = 64;
/// Most ids introduced by others than themselves, all senders together. With
/// [`MAX_OWN_IDS`] and [`MAX_NODE_ID_LEN`], this host's own digest stays under 47 KB (a
/// datagram holds 65,507 bytes; chitchat panicked answering a Syn when its digest left less
/// than 100 bytes for the delta).
///
/// [`MAX_NODE_ID_LEN`]: super::MAX_NODE_ID_LEN
pub const MAX_INTRODUCED: usize = 96;
/// How long an id no digest names any more is remembered: longer than chitchat keeps the node
/// state a digest created (`DEAD_NODE_GRACE`, 10 minutes).
pub const FORGET_MS: u64 = 660_000;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum By {
    /// Sent an authentic datagram of its own from this address.
    Own(std::net::IpAddr),
    /// First named by a sender at this address.
    Introduced(std::net::IpAddr),
}

/// The ids this host's chitchat was let hear of, and who introduced them. chitchat creates a
/// node state for every id a digest names; [`Introductions::admit`] lets an id through only
/// if it is known already, or is the sender's own id and its address has fewer than
/// [`OWN_IDS_PER_IP`] (and all together fewer than [`MAX_OWN_IDS`]), or its sender's IP
/// address introduced fewer than [`INTRODUCED_PER_IP`] ids still remembered and all senders
/// together fewer than [`MAX_INTRODUCED`]. An id introduced by another that later speaks for
/// itself counts as its own from then on (so an honest cluster's members, introduced by a
/// seed, soon free the seed's quota). An id no admitted digest named for [`FORGET_MS`] is
/// forgotten. A member with the key can so make this host hold at most [`OWN_IDS_PER_IP`] +
/// [`INTRODUCED_PER_IP`] ids per IP address it sends from (at most [`MAX_INTRODUCED`] beyond
/// its own, however relayed); once all of [`MAX_INTRODUCED`] is taken, new members are learnt
/// only when they speak to this host themselves.
#[derive(Debug, Default)]
pub struct Introductions {
    known: std::collections::HashMap<ChitchatId, (By, u64)>,
    own: std::collections::HashMap<std::net::IpAddr, usize>,
    introduced: std::collections::HashMap<std::net::IpAddr, usize>,
    own_total: usize,
    introduced_total: usize,
    swept_ms: u64,
}

impl Introductions {
    fn add(&mut self, by: By, delta: isize) {
        let (map, total, ip) = match by {
            By::Own(ip) => (&mut self.own, &mut self.own_total, ip),
            By::Introduced(ip) => (&mut self.introduced, &mut self.introduced_total, ip),
        };
        let n = map.entry(ip).or_insert(0);
        *n = n.saturating_add_signed(delta);
        *total = total.saturating_add_signed(delta);
        if *n == 0 {
            map.remove(&ip);
        }
    }

    fn own_room(&self, ip: std::net::IpAddr) -> bool {
        self.own_total < MAX_OWN_IDS && self.own.get(&ip).copied().unwrap_or(0) < OWN_IDS_PER_IP
    }

    fn forget_old(&mut self, now_ms: u64) {
        if now_ms.saturating_sub(self.swept_ms) < 1_000 {
            return;
        }
        self.swept_ms = now_ms;
        let old: Vec<(ChitchatId, By)> = self
            .known
            .iter()
            .filter(|(_, (_, at))| now_ms.saturating_sub(*at) > FORGET_MS)
            .map(|(id, (by, _))| (id.clone(), *by))
            .collect();
        for (id, by) in old {
            self.known.remove(&id);
            self.add(by, -1);
        }
    }

    /// Admits the ids of a digest sent from `from` (`is_sender` tells the sender's own id,
    /// `is_self` this host's), at `now_ms` (a monotonic clock); returns the ids refused, to be
    /// stripped from the digest ([`strip`](super::strip)).
    pub fn admit(
        &mut self,
        entries: &[(ChitchatId, u64)],
        from: std::net::IpAddr,
        is_sender: impl Fn(&ChitchatId) -> bool,
        is_self: impl Fn(&ChitchatId) -> bool,
        now_ms: u64,
    ) -> std::collections::HashSet<ChitchatId> {
        self.forget_old(now_ms);
        let mut refused = std::collections::HashSet::new();
        for (id, _) in entries {
            if is_self(id) {
                continue;
            }
            let sender = is_sender(id);
            if let Some(&(by, _)) = self.known.get(id) {
                let mut by_now = by;
                if sender && matches!(by, By::Introduced(_)) && self.own_room(from) {
                    self.add(by, -1);
                    by_now = By::Own(from);
                    self.add(by_now, 1);
                }
                self.known.insert(id.clone(), (by_now, now_ms));
                continue;
            }
            let by = if sender && self.own_room(from) {
                By::Own(from)
            } else if self.introduced_total < MAX_INTRODUCED
                && self.introduced.get(&from).copied().unwrap_or(0) < INTRODUCED_PER_IP
            {
                By::Introduced(from)
            } else {
                refused.insert(id.clone());
                continue;
            };
            self.add(by, 1);
            self.known.insert(id.clone(), (by, now_ms));
        }
        refused
    }
}
