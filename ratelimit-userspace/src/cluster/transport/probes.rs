//! Where chitchat may send, and which members named in digests have yet to speak for
//! themselves.

use std::{
    collections::HashMap,
    net::SocketAddr,
    time::{Duration, Instant},
};

/// How long an address that sent this host an authentic datagram may be sent to freely.
pub const ANSWERED_FOR: Duration = Duration::from_secs(60);
/// Datagrams per second, at most, to addresses that have not (their *probes*: a first Syn to a
/// member learnt through gossip, to a seed, or to a member silent for [`ANSWERED_FOR`]), all
/// together ...
pub const PROBES_PER_S: f64 = 4.0;
/// ... and this many at once.
pub const PROBE_BURST: f64 = 8.0;
/// One probe per address at most this often.
pub const PROBE_EVERY: Duration = Duration::from_secs(1);
/// Most addresses remembered as answered or probed (the least recent forgotten first).
const MAX_PROBE_MEMORY: usize = 1024;
/// How long a member named in digests may go without sealing a datagram of its own that reaches
/// this host from its address before digests stop moving its heartbeat here (see
/// [`Unproven`]).
pub const UNPROVEN_GRACE: Duration = Duration::from_secs(5);

/// Members named in digests that have not sealed a datagram of their own to this host (from
/// their address, within [`ANSWERED_FOR`]), with when first named. chitchat holds a member
/// alive while digests move its heartbeat, and gossips with three live members a round: ids a
/// member with the key names at addresses of its choice, their heartbeats kept moving, took
/// those places from the real peers (with 60 of them, 13 of 49 values a host published reached
/// its peer within 100 ms, instead of 49). Past [`UNPROVEN_GRACE`] (a new member learnt
/// through gossip answers a probe within a second), their heartbeat in digests is written 0,
/// which chitchat ignores: they are declared dead as a silent member is, and gossip goes to the
/// members that speak.
#[derive(Debug, Default)]
pub(super) struct Unproven(HashMap<chitchat::ChitchatId, Instant>);

impl Unproven {
    /// Whether `id`, named in a digest at `now`, is past its grace (`proven`: it sealed a
    /// datagram of its own lately).
    pub(super) fn frozen(&mut self, id: &chitchat::ChitchatId, proven: bool, now: Instant) -> bool {
        if proven {
            self.0.remove(id);
            return false;
        }
        if !self.0.contains_key(id) && self.0.len() >= MAX_PROBE_MEMORY {
            // The one named first goes (the ids a digest may name here are bounded far below
            // this, see `Introductions`; one still named comes back with a grace of its own).
            if let Some(old) = self
                .0
                .iter()
                .min_by_key(|(_, t)| **t)
                .map(|(k, _)| k.clone())
            {
                self.0.remove(&old);
            }
        }
        let first = *self.0.entry(id.clone()).or_insert(now);
        now.saturating_duration_since(first) > UNPROVEN_GRACE
    }
}

/// Where chitchat may send. chitchat gossips with the members it holds alive, and a digest
/// may name any id at any address: a member with the key naming ids at addresses of its choice,
/// with heartbeats kept moving, made every host send them its Syns (its whole digest) several
/// times per gossip round, at the expense of its real peers (60 such ids at two hosts: 575
/// datagrams, 269 KB, in 5 s, 115 a second). An address that sent this host an authentic
/// datagram within [`ANSWERED_FOR`] is sent to freely; any other gets a probe at most every
/// [`PROBE_EVERY`], and all of them together at most [`PROBES_PER_S`] (burst [`PROBE_BURST`]):
/// enough to reach a seed or a new member (its answer makes it answered), never a stream to
/// an address nobody there asked for.
#[derive(Debug)]
pub(super) struct Probes {
    answered: HashMap<SocketAddr, Instant>,
    probed: HashMap<SocketAddr, Instant>,
    tokens: f64,
    at: Instant,
}

impl Probes {
    pub(super) fn new(now: Instant) -> Self {
        Self {
            answered: HashMap::new(),
            probed: HashMap::new(),
            tokens: PROBE_BURST,
            at: now,
        }
    }

    fn remember(map: &mut HashMap<SocketAddr, Instant>, addr: SocketAddr, now: Instant) {
        if map.len() >= MAX_PROBE_MEMORY && !map.contains_key(&addr) {
            if let Some(old) = map.iter().min_by_key(|(_, t)| **t).map(|(a, _)| *a) {
                map.remove(&old);
            }
        }
        map.insert(addr, now);
    }

    /// An authentic datagram came from `from` at `now`.
    pub(super) fn answered(&mut self, from: SocketAddr, now: Instant) {
        Self::remember(&mut self.answered, from, now);
    }

    /// Whether a datagram may go to `to` at `now` (a probe is then taken).
    pub(super) fn may_send(&mut self, to: SocketAddr, now: Instant) -> bool {
        if self
            .answered
            .get(&to)
            .is_some_and(|t| now.saturating_duration_since(*t) <= ANSWERED_FOR)
        {
            return true;
        }
        self.tokens = (self.tokens
            + now.saturating_duration_since(self.at).as_secs_f64() * PROBES_PER_S)
            .min(PROBE_BURST);
        self.at = now;
        if self.tokens < 1.0
            || self
                .probed
                .get(&to)
                .is_some_and(|t| now.saturating_duration_since(*t) < PROBE_EVERY)
        {
            return false;
        }
        self.tokens -= 1.0;
        Self::remember(&mut self.probed, to, now);
        true
    }
}
