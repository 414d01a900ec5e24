//! Each member's heartbeat as it reported it itself, against which the heartbeats others name
//! for it are checked.

use chitchat::ChitchatId;

use super::{Unsafe, R};

/// A digest may name another member's heartbeat at most this far ahead of what that member itself
/// last reported here, plus [`HEARTBEATS_PER_MS`] per millisecond since.
pub const HEARTBEAT_SLACK: u64 = 1_000;
/// How fast a member's heartbeat may advance, at most, per millisecond (chitchat adds one per
/// gossip round and per message received: about 0.2/ms at the default sync interval, 2/ms at the
/// smallest).
pub const HEARTBEATS_PER_MS: u64 = 4;
/// Most members whose own heartbeat is remembered (the least recently heard forgotten first).
pub const MAX_HEARTBEATS: usize = 1024;

/// Each member's heartbeat as it reported it itself (its own entry in the digest of a datagram
/// it sealed and sent from its address), and when. chitchat keeps the highest heartbeat any
/// digest names for a member; one named far ahead (by a member with the key) makes the real ones
/// look old, so chitchat's failure detector stops hearing that member and, once it is declared
/// dead and collected, never takes it back until its heartbeat catches up. [`Heartbeats::check`]
/// refuses a message naming another member's heartbeat more than [`HEARTBEAT_SLACK`] +
/// [`HEARTBEATS_PER_MS`] x the milliseconds since that member's own report ahead of it; a
/// member not heard directly yet is not judged.
#[derive(Debug, Default)]
pub struct Heartbeats(std::collections::HashMap<ChitchatId, (u64, u64)>);

impl Heartbeats {
    /// Checks the digest `entries` of a message whose sender's own id is the one `is_sender`
    /// tells, received at `now_ms` (a monotonic clock); on success records the sender's own
    /// heartbeat.
    ///
    /// # Errors
    /// [`Unsafe::HeartbeatAhead`] when another member's heartbeat is ahead of its own report.
    pub fn check(
        &mut self,
        entries: &[(ChitchatId, u64)],
        is_sender: impl Fn(&ChitchatId) -> bool,
        now_ms: u64,
    ) -> R<()> {
        for (id, heartbeat) in entries {
            if is_sender(id) {
                continue;
            }
            if let Some(&(own, at)) = self.0.get(id) {
                let allowed = own
                    .saturating_add(HEARTBEAT_SLACK)
                    .saturating_add(now_ms.saturating_sub(at).saturating_mul(HEARTBEATS_PER_MS));
                if *heartbeat > allowed {
                    return Err(Unsafe::HeartbeatAhead);
                }
            }
        }
        for (id, heartbeat) in entries.iter().filter(|(id, _)| is_sender(id)) {
            if self.0.len() >= MAX_HEARTBEATS && !self.0.contains_key(id) {
                if let Some(old) = self
                    .0
                    .iter()
                    .min_by_key(|(_, (_, at))| *at)
                    .map(|(k, _)| k.clone())
                {
                    self.0.remove(&old);
                }
            }
            let e = self.0.entry(id.clone()).or_insert((*heartbeat, now_ms));
            if *heartbeat >= e.0 {
                *e = (*heartbeat, now_ms);
            }
        }
        Ok(())
    }
}
