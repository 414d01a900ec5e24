//! What comes in on the public socket: a datagram opened, the message it completes checked,
//! and only then handed to chitchat through its sender's relay.

use std::{net::SocketAddr, time::Instant};

use super::{counters, probes::ANSWERED_FOR, SecureSocket};
use crate::cluster::{
    inspect::{self, Unsafe},
    status::Counters,
    unix_ms,
    wire::{self, Reject},
};

impl SecureSocket {
    /// Opens a datagram from the public socket and, if it completes an authentic message, hands
    /// the plaintext to chitchat's socket through the sender's relay.
    pub(super) async fn accept(&mut self, len: usize, from: SocketAddr) -> anyhow::Result<()> {
        let c = counters(&self.shared);
        Counters::add(&c.bytes_in, len as u64);
        let (message, sender) = match self.codec.open_tagged(&self.buf[..len], from, unix_ms()) {
            Ok(Some(opened)) => opened,
            Ok(None) => return Ok(()),
            Err(reject) => {
                let (counter, what) = match reject {
                    Reject::Auth => (
                        &c.rejected_auth,
                        "not authentic (wrong key or cluster id, sealed for another address, \
                         or from a source address other than the sender's advertised one?)",
                    ),
                    Reject::Stale => (&c.rejected_stale, "stale or replayed"),
                    // Counted as stale (`rejected{stale}`: refused by the replay memory); its own
                    // log line, first and every 1000th, tells the two apart.
                    Reject::ReplayFull => (
                        &c.rejected_stale,
                        "refused: the replay window (or this sender's quota of it) is full of live datagrams",
                    ),
                    Reject::Malformed => (&c.rejected_malformed, "malformed"),
                };
                let mut n = counter.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if reject == Reject::ReplayFull {
                    n = self.replay_full;
                    self.replay_full += 1;
                }
                // The first of each kind, then every 1000th: a flood of junk must not flood the log.
                if n % 1000 == 0 {
                    tracing::warn!(%from, bytes = len, total = n + 1, "gossip datagram dropped: {what}");
                }
                return Ok(());
            }
        };
        // Authentic, but checked before chitchat applies it: a member with the key could
        // otherwise crash chitchat's loop or this agent's sync ([`inspect`]).
        let checked = self.check(message, from, sender);
        let c = counters(&self.shared);
        let message = match checked {
            Ok(message) => message,
            Err(why) => {
                let n = c
                    .rejected_unsafe
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if n.is_multiple_of(1000) {
                    tracing::warn!(%from, bytes = len, total = n + 1, sender = sender, "gossip message refused before the gossip library saw it: {}", why.describe());
                }
                return Ok(());
            }
        };
        Counters::add(&c.messages_in, 1);
        self.probes.answered(from, Instant::now());
        self.shared
            .authenticated
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .note(from, sender, crate::maps::bucket::monotonic_ns());
        let relay = self.relay(from).await?;
        if let Err(e) = relay.socket.send(&message).await {
            tracing::debug!(%from, error = %e, "handing a gossip message to chitchat");
        }
        Ok(())
    }

    /// Checks an authentic `message` from `from`, sealed by `sender`, before chitchat sees it
    /// ([`inspect`]): the message to hand on (its digest rewritten when ids in it are
    /// refused or frozen), or why it is refused.
    fn check(
        &mut self,
        message: Vec<u8>,
        from: SocketAddr,
        sender: u64,
    ) -> Result<Vec<u8>, Unsafe> {
        let c = counters(&self.shared);
        let self_tag = self
            .shared
            .self_tag
            .load(std::sync::atomic::Ordering::Relaxed);
        let local = self.local;
        let is_self = |id: &chitchat::ChitchatId| {
            id.gossip_advertise_addr == local
                && wire::sender_tag(&id.node_id, id.generation_id) == self_tag
        };
        let is_sender = |id: &chitchat::ChitchatId| {
            id.gossip_advertise_addr == from
                && wire::sender_tag(&id.node_id, id.generation_id) == sender
        };
        let now_ms = crate::maps::bucket::monotonic_ns() / 1_000_000;
        let mut named = None;
        let checked = inspect::check_own(&message, is_self, &mut named);
        let own_max = self
            .shared
            .own_max_version
            .load(std::sync::atomic::Ordering::Relaxed);
        // 0: not published yet (before the sync loop's first round, or a transport without
        // one): not judged.
        if let Some(named) =
            named.filter(|&v| own_max > 0 && v > own_max.saturating_add(inspect::OWN_STATE_AHEAD))
        {
            self.own_state_forged = Some((from, named - own_max));
        }
        let checked = checked.and_then(|digest| {
            self.heartbeats.check(&digest, is_sender, now_ms)?;
            Ok(digest)
        });
        checked.and_then(|digest| {
            let refused =
                self.introductions
                    .admit(&digest, from.ip(), is_sender, is_self, now_ms);
            let now = Instant::now();
            let since = crate::maps::bucket::monotonic_ns()
                .saturating_sub(u64::try_from(ANSWERED_FOR.as_nanos()).unwrap_or(u64::MAX));
            let frozen: std::collections::HashSet<&chitchat::ChitchatId> = {
                let authenticated = self
                    .shared
                    .authenticated
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                digest
                    .iter()
                    .map(|(id, _)| id)
                    .filter(|id| !is_sender(id) && !is_self(id) && !refused.contains(*id))
                    .filter(|id| {
                        let proven = authenticated.heard_since(
                            id.gossip_advertise_addr,
                            wire::sender_tag(&id.node_id, id.generation_id),
                            since,
                        );
                        self.unproven.frozen(id, proven, now)
                    })
                    .collect()
            };
            if refused.is_empty() && frozen.is_empty() {
                return Ok(message);
            }
            if !refused.is_empty() {
                let n = c
                    .digest_ids_stripped
                    .fetch_add(refused.len() as u64, std::sync::atomic::Ordering::Relaxed);
                if n == 0 || n / 1000 != (n + refused.len() as u64) / 1000 {
                    tracing::warn!(%from, sender = sender, stripped = refused.len(), total = n + refused.len() as u64,
                        "gossip digest names more new members than this sender may introduce: those left out");
                }
            }
            inspect::rewrite(&message, |id| !refused.contains(id), |id| frozen.contains(id))
        })
    }
}
