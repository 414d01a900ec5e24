//! chitchat's [`Transport`] with every datagram sealed by the cluster key ([`super::wire`]).
//!
//! chitchat encodes its messages only inside its own UDP socket (the envelope's encoder is
//! private to the crate), so the sealing cannot sit between encoder and wire in-process. Instead
//! chitchat's own [`UdpSocket`] runs on a loopback address and every byte it sends or receives
//! passes through this socket:
//! - **send** to peer P: chitchat's socket sends the plaintext to P's *relay*, a loopback socket
//!   connected to chitchat's (so it hears nothing else); we read it back at once (loopback
//!   delivery is synchronous), seal it and send it to P from the public socket;
//! - **receive** from P: the public socket's datagram is opened; only if it is authentic, fresh
//!   and well formed is its plaintext handed to chitchat's socket through P's relay, and chitchat
//!   is told it came from P (the relay's address maps back to P).
//!
//! chitchat therefore never sees a byte that did not verify, and so never answers one: a datagram
//! opens only if it was sealed by a key holder at the address it came from and for this host's
//! address ([`super::wire`]), so a forged, replayed or source-spoofed datagram gets no reply, and
//! the one reply an authentic Syn gets goes to the address that sealed it (no reflection, no
//! amplification towards a third party). Its loopback socket is reachable by
//! local processes, so whatever reaches it from an address that is not one of our relays is
//! dropped and counted as malformed. Relays exist only for addresses chitchat sends to (members
//! and seeds) or that sent an authentic datagram, at most [`MAX_RELAYS`] (least recently used
//! ones are closed first).
//!
//! chitchat reads one message at a time, and an agent starved of CPU (a busy host) falls behind
//! what its peers send: the public socket's queue then grows to its buffer (about 200 KB, 100+
//! messages), and every peer's state reaches this host that much late. Measured on 8 debug
//! agents on 2 busy cores: 0.2-3.9 s, so a host went on at an old split of the budget for
//! seconds (1.24 budgets over 7 s). Each datagram's wait in the queue is read from the kernel's
//! receive time, and one that waited longer than a sync interval
//! ([`SecureTransport::with_max_wait`]) is dropped unread: its sender gossips again every
//! gossip round, and each gossip message carries everything newer than what the receiver holds,
//! so nothing is lost but the wait. chitchat's own loopback socket is read first, so the queue
//! stays on the public socket, where the wait is measured.

mod accept;
mod probes;
mod socket;
#[cfg(test)]
mod tests;

use std::{
    collections::HashMap,
    net::{Ipv4Addr, SocketAddr},
    sync::Arc,
    time::{Duration, Instant},
};

use async_trait::async_trait;
use chitchat::transport::{Socket, Transport, UdpSocket as ChitchatUdpSocket};
use tokio::net::UdpSocket;

use self::probes::{Probes, Unproven};
pub use self::probes::{ANSWERED_FOR, PROBES_PER_S, PROBE_BURST, PROBE_EVERY, UNPROVEN_GRACE};
use super::{
    key::ClusterKey,
    status::{Counters, Shared},
    wire::Codec,
};

/// Most peer addresses with a relay socket at once.
pub const MAX_RELAYS: usize = 256;
/// How long to wait for chitchat's plaintext to come back through a relay (it is already queued
/// when `send_to` on loopback returns; this only guards against the impossible).
const RELAY_READ_TIMEOUT: Duration = Duration::from_millis(500);

/// The sealing transport. `open` binds the public socket at the listen address.
pub struct SecureTransport {
    key: ClusterKey,
    cluster_id: String,
    advertise: Option<SocketAddr>,
    max_wait: Option<Duration>,
    shared: Arc<Shared>,
}

impl SecureTransport {
    /// A transport sealing with `key` for `cluster_id`, counting into `shared`.
    #[must_use]
    pub fn new(key: ClusterKey, cluster_id: String, shared: Arc<Shared>) -> Self {
        Self {
            key,
            cluster_id,
            advertise: None,
            max_wait: None,
            shared,
        }
    }

    /// This host's advertised gossip address, which datagrams are sealed from and must be sent
    /// to. Without it, the address the socket is bound to (which then must not be a wildcard).
    #[must_use]
    pub fn with_advertise(mut self, advertise: SocketAddr) -> Self {
        self.advertise = Some(advertise);
        self
    }

    /// Datagrams that waited longer than `max_wait` in the public socket's queue (by the
    /// kernel's receive time) are dropped unread (`rejected_late`). Without it, none is.
    #[must_use]
    pub fn with_max_wait(mut self, max_wait: Duration) -> Self {
        self.max_wait = Some(max_wait);
        self
    }
}

#[async_trait]
impl Transport for SecureTransport {
    async fn open(&self, listen_addr: SocketAddr) -> anyhow::Result<Box<dyn Socket>> {
        let public = UdpSocket::bind(listen_addr)
            .await
            .map_err(|e| anyhow::anyhow!("binding the gossip socket to {listen_addr}: {e}"))?;
        let local = match self.advertise {
            Some(a) => a,
            None => public.local_addr()?,
        };
        if local.ip().is_unspecified() || local.port() == 0 {
            anyhow::bail!(
                "the gossip socket at {listen_addr} needs this host's advertised address \
                 ({local} is not one): datagrams are sealed for it"
            );
        }
        if self.max_wait.is_some() {
            socket::stamp_arrivals(&public);
        }
        let inner = ChitchatUdpSocket::open((Ipv4Addr::LOCALHOST, 0).into()).await?;
        let inner_addr = inner.local_addr()?;
        Ok(Box::new(SecureSocket {
            public,
            inner,
            inner_addr,
            codec: Codec::new(&self.key, &self.cluster_id, local),
            local,
            max_wait: self.max_wait,
            relays: HashMap::new(),
            by_relay: HashMap::new(),
            buf: vec![0; 65_536],
            shared: self.shared.clone(),
            replay_full: 0,
            heartbeats: super::inspect::Heartbeats::default(),
            introductions: super::inspect::Introductions::default(),
            probes: Probes::new(Instant::now()),
            unproven: Unproven::default(),
            own_state_forged: None,
        }))
    }
}

struct Relay {
    socket: UdpSocket,
    local: SocketAddr,
    used: Instant,
}

struct SecureSocket {
    public: UdpSocket,
    inner: ChitchatUdpSocket,
    inner_addr: SocketAddr,
    codec: Codec,
    /// This host's advertised gossip address.
    local: SocketAddr,
    /// See [`SecureTransport::with_max_wait`].
    max_wait: Option<Duration>,
    relays: HashMap<SocketAddr, Relay>,
    by_relay: HashMap<SocketAddr, SocketAddr>,
    buf: Vec<u8>,
    shared: Arc<Shared>,
    /// Datagrams refused because the replay memory was full (counted as stale; this paces their
    /// own log line).
    replay_full: u64,
    /// Each member's own last reported heartbeat (see [`super::inspect::Heartbeats`]).
    heartbeats: super::inspect::Heartbeats,
    /// The ids chitchat was let hear of (see [`super::inspect::Introductions`]).
    introductions: super::inspect::Introductions,
    /// Where chitchat may send (see [`Probes`]).
    probes: Probes,
    /// Members only named in digests (see [`Unproven`]).
    unproven: Unproven,
    /// A sender that holds this host's own state ahead of anything it published, and how far
    /// (see [`super::inspect::check_own`]): the gossip loop is ended, to be restarted as a new
    /// incarnation, which its peers hold apart from the forged one.
    own_state_forged: Option<(SocketAddr, u64)>,
}

fn counters(shared: &Shared) -> &Counters {
    &shared.counters
}
