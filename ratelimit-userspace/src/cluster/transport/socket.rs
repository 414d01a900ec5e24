//! The socket chitchat is given: a relay per peer address between chitchat's own loopback
//! socket and the public one, sealing what chitchat sends and handing it what was opened.

use std::{
    io,
    net::{Ipv4Addr, SocketAddr},
    os::fd::AsRawFd,
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use async_trait::async_trait;
use chitchat::{
    transport::{RecvOutcome, SendOutcome, Socket},
    ChitchatEnvelope,
};
use tokio::net::UdpSocket;

use super::{counters, Relay, SecureSocket, MAX_RELAYS, RELAY_READ_TIMEOUT};
use crate::cluster::{status::Counters, unix_ms};

/// Errors a datagram socket reports for one send or receive that say nothing about the socket
/// itself (an ICMP error from an earlier send, a full buffer, no route right now).
fn is_transient(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(
            libc::ECONNREFUSED
                | libc::ECONNRESET
                | libc::ENOBUFS
                | libc::EAGAIN
                | libc::EHOSTUNREACH
                | libc::ENETUNREACH
                | libc::ENETDOWN
                | libc::EHOSTDOWN
                | libc::EPERM
                | libc::EADDRNOTAVAIL
                | libc::EMSGSIZE
        )
    )
}

/// `SIOCGSTAMPNS` (linux/sockios.h, `SIOCGSTAMPNS_OLD`: the same request on 64-bit targets):
/// the kernel's receive time (`CLOCK_REALTIME`) of the last datagram read from a socket.
const SIOCGSTAMPNS: libc::Ioctl = 0x8907;

/// Asks the kernel to keep each datagram's receive time on `socket` (the first `SIOCGSTAMPNS`
/// turns it on, and answers `ENOENT` as nothing was read yet): from then on [`waited`] can read
/// it. The kernel's global switch for receive times is thrown by a work item, shortly after:
/// datagrams received before carry no time and count as not having waited (nothing dropped).
pub(super) fn stamp_arrivals(socket: &UdpSocket) {
    let _ = waited(socket);
}

/// How long the datagram last read from `socket` waited between the kernel's receive and now,
/// or `None` if unknown (timestamps not on, a time after now: the clock stepped).
fn waited(socket: &UdpSocket) -> Option<Duration> {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid socket and a `timespec` the call writes into.
    if unsafe { libc::ioctl(socket.as_raw_fd(), SIOCGSTAMPNS, &raw mut ts) } != 0 {
        return None;
    }
    let at = Duration::new(
        u64::try_from(ts.tv_sec).ok()?,
        u32::try_from(ts.tv_nsec).ok()?,
    );
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .ok()?
        .checked_sub(at)
}

impl SecureSocket {
    /// The relay for `peer`, created (and the least recently used one closed) if needed.
    pub(super) async fn relay(&mut self, peer: SocketAddr) -> io::Result<&Relay> {
        if !self.relays.contains_key(&peer) {
            if self.relays.len() >= MAX_RELAYS {
                if let Some(old) = self
                    .relays
                    .iter()
                    .min_by_key(|(_, r)| r.used)
                    .map(|(p, _)| *p)
                {
                    if let Some(r) = self.relays.remove(&old) {
                        self.by_relay.remove(&r.local);
                    }
                }
            }
            let socket = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).await?;
            socket.connect(self.inner_addr).await?;
            let local = socket.local_addr()?;
            self.by_relay.insert(local, peer);
            self.relays.insert(
                peer,
                Relay {
                    socket,
                    local,
                    used: Instant::now(),
                },
            );
        }
        let relay = self.relays.get_mut(&peer).expect("just inserted");
        relay.used = Instant::now();
        Ok(relay)
    }
}

enum Event {
    Inner(anyhow::Result<RecvOutcome>),
    Public(io::Result<(usize, SocketAddr)>),
}

#[async_trait]
impl Socket for SecureSocket {
    fn local_addr(&self) -> anyhow::Result<SocketAddr> {
        Ok(self.public.local_addr()?)
    }

    async fn send(
        &mut self,
        to: SocketAddr,
        envelope: ChitchatEnvelope,
    ) -> anyhow::Result<SendOutcome> {
        if !self.probes.may_send(to, Instant::now()) {
            let n = counters(&self.shared)
                .probes_withheld
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if n.is_multiple_of(1000) {
                tracing::warn!(%to, total = n + 1, "gossip not sent to an address that has not answered (a probe a second at most)");
            }
            return Ok(SendOutcome { num_bytes_sent: 0 });
        }
        let relay_addr = self.relay(to).await?.local;
        // chitchat's own socket sends at most one datagram of 65,507 bytes: a larger message
        // (a digest grown past it) fails here. Counted and logged, not left to chitchat, which
        // drops the error silently when it answers.
        if let Err(e) = self.inner.send(relay_addr, envelope).await {
            let n = counters(&self.shared)
                .send_errors
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if n.is_multiple_of(100) {
                tracing::warn!(%to, error = %format!("{e:#}"), total = n + 1, "gossip message not sent (too large for a datagram?)");
            }
            return Ok(SendOutcome { num_bytes_sent: 0 });
        }
        let relay = &self.relays[&to];
        let len = tokio::time::timeout(RELAY_READ_TIMEOUT, relay.socket.recv(&mut self.buf))
            .await
            .map_err(|_| anyhow::anyhow!("chitchat's message did not come through the relay"))??;
        let c = counters(&self.shared);
        self.codec.set_sender(
            self.shared
                .self_tag
                .load(std::sync::atomic::Ordering::Relaxed),
        );
        let Some(datagrams) = self.codec.seal(&self.buf[..len], to, unix_ms()) else {
            Counters::add(&c.send_errors, 1);
            tracing::warn!(%to, bytes = len, "gossip message too large to send");
            return Ok(SendOutcome { num_bytes_sent: 0 });
        };
        let mut sent = 0;
        for d in &datagrams {
            match self.public.send_to(d, to).await {
                Ok(n) => {
                    sent += n;
                    Counters::add(&c.messages_out, 1);
                    Counters::add(&c.bytes_out, n as u64);
                }
                // A peer that cannot be reached now (partition, link down) is the failure
                // detector's business, not a broken transport: count it and carry on.
                Err(e) if is_transient(&e) => {
                    Counters::add(&c.send_errors, 1);
                    tracing::debug!(%to, error = %e, "gossip send failed");
                }
                Err(e) => return Err(anyhow::anyhow!("sending gossip to {to}: {e}")),
            }
        }
        Ok(SendOutcome {
            num_bytes_sent: sent,
        })
    }

    async fn recv(&mut self) -> anyhow::Result<RecvOutcome> {
        loop {
            // Both reads are cancel safe: a datagram is either fully taken or left queued.
            // chitchat's socket first: what was relayed to it goes back to chitchat before the
            // next datagram is opened, so the backlog stays on the public socket, where its
            // wait is measured (see the module docs).
            let event = tokio::select! {
                biased;
                r = self.inner.recv() => Event::Inner(r),
                r = self.public.recv_from(&mut self.buf) => Event::Public(r),
            };
            match event {
                Event::Inner(r) => {
                    let outcome = r?;
                    // Only our relays may talk to chitchat's socket: anything else on loopback
                    // would bypass authentication.
                    let Some(&peer) = self.by_relay.get(&outcome.from_addr) else {
                        Counters::add(&counters(&self.shared).rejected_malformed, 1);
                        continue;
                    };
                    return Ok(RecvOutcome {
                        from_addr: peer,
                        ..outcome
                    });
                }
                Event::Public(Ok((len, from))) => {
                    if let Some(max) = self.max_wait {
                        if waited(&self.public).is_some_and(|w| w > max) {
                            let c = counters(&self.shared);
                            Counters::add(&c.bytes_in, len as u64);
                            Counters::add(&c.rejected_late, 1);
                            continue;
                        }
                    }
                    self.accept(len, from).await?;
                    // This host's own state, forged ahead at a peer (by a member with the key):
                    // that peer takes none of its updates until they pass the forged version
                    // (never, near the largest one), and this host refuses every reply of it.
                    // Only a new incarnation is heard there again: end the loop (the
                    // supervisor restarts it as one, see `crate::cluster::gossip`).
                    if let Some((from, ahead)) = self.own_state_forged.take() {
                        tracing::error!(%from, versions_ahead = ahead, "a peer holds this host's own gossip state ahead of anything it published (forged by a member with the cluster key): gossip restarts as a new incarnation");
                        return Err(anyhow::anyhow!(
                            "{from} holds this host's gossip state {ahead} versions ahead of \
                             what it published (forged by a member with the cluster key)"
                        ));
                    }
                }
                Event::Public(Err(e)) if is_transient(&e) => {}
                Event::Public(Err(e)) => return Err(anyhow::anyhow!("gossip socket: {e}")),
            }
        }
    }
}
