//! A peer as a round reads it from chitchat's state, and the fields of its sync key.

use crate::cluster::publish::{Count, KeyName};

/// A peer as read from chitchat's state in one sync.
#[derive(Clone, Debug)]
pub struct PeerView<P> {
    /// Its identity (node id with generation).
    pub id: P,
    /// Alive according to chitchat's failure detector.
    pub live: bool,
    /// An authentic datagram came from its address lately, and it is the newest incarnation
    /// there: only such a peer can be counted.
    pub verified: bool,
    /// Its heartbeat counter.
    pub heartbeat: u64,
    /// When (`CLOCK_MONOTONIC` ns) the last authentic datagram sealed by this identity came from
    /// its address, if within the peer timeout: heard then, whatever its heartbeat in chitchat
    /// says (a member with the key can push another's heartbeat in chitchat far ahead in a
    /// digest, so that its real heartbeats look old).
    pub heard_at: Option<u64>,
    /// Its sync key: `(sequence, Unix ms, next epoch)`, once it arrived.
    pub sync: Option<(u64, u64, u64)>,
    /// The [`keys_digest`] its sync key names: of the keys it publishes as of that sync (None
    /// from an agent of before it, or without a sync key).
    ///
    /// [`keys_digest`]: crate::cluster::publish::keys_digest
    pub keys_digest: Option<String>,
    /// Its consumption keys (at most `max_keys` of them, in key order).
    pub keys: Vec<(KeyName, Count)>,
}

/// Parses a sync key's value, `SEQ:UNIX_MS:NEXT_EPOCH` (and a fourth field, the [`keys_digest`], read
/// by [`parse_keys_digest`]; see [`PeerView::sync`]).
///
/// [`keys_digest`]: crate::cluster::publish::keys_digest
#[must_use]
pub fn parse_sync(value: &str) -> Option<(u64, u64, u64)> {
    let mut it = value.split(':').map(str::parse::<u64>);
    Some((it.next()?.ok()?, it.next()?.ok()?, it.next()?.ok()?))
}

/// The [`keys_digest`] a sync key's value names (its fourth field), if any.
///
/// [`keys_digest`]: crate::cluster::publish::keys_digest
#[must_use]
pub fn parse_keys_digest(value: &str) -> Option<String> {
    let d = value.split(':').nth(3)?;
    (d.len() == 32 && d.bytes().all(|b| b.is_ascii_hexdigit())).then(|| d.to_ascii_lowercase())
}
